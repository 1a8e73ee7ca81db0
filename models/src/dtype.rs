//! Tensor element types and their sizes in bytes (`c10::ScalarType` and `elementSize`).

use std::fmt;

/// The element type of a tensor, as PyTorch names it (`torch.float32`, `torch.bfloat16`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `torch.float32`: 4 bytes.
    F32,
    /// `torch.float16`: 2 bytes.
    F16,
    /// `torch.bfloat16`: 2 bytes.
    BF16,
    /// `torch.float64`: 8 bytes.
    F64,
    /// `torch.int64` (token ids, labels, indices): 8 bytes.
    I64,
    /// `torch.int32`: 4 bytes.
    I32,
    /// `torch.bool` (dropout masks, causal masks): 1 byte.
    Bool,
    /// `torch.uint8`: 1 byte.
    U8,
}

impl DType {
    /// Bytes per element (`c10::elementSize`).
    pub fn size(self) -> u64 {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Bool | DType::U8 => 1,
        }
    }

    /// Whether this is a floating-point type (the only kind autograd differentiates).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }

    /// PyTorch's name for it (`float32`, `bfloat16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F64 => "float64",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::Bool => "bool",
            DType::U8 => "uint8",
        }
    }

    /// The result type of a binary op between two floating types (`c10::promoteTypes` restricted to
    /// floats): the wider one, and `float32` for `float16` with `bfloat16`.
    pub fn promote(self, other: DType) -> DType {
        use DType::*;
        if self == other {
            return self;
        }
        match (self, other) {
            (F64, _) | (_, F64) => F64,
            (F32, _) | (_, F32) => F32,
            (F16, BF16) | (BF16, F16) => F32,
            (a, b) if a.is_float() && !b.is_float() => a,
            (a, b) if b.is_float() && !a.is_float() => b,
            (I64, _) | (_, I64) => I64,
            (a, _) => a,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
