//! TensorFlow's out-of-memory error, read back.
//!
//! `OpKernelContext::allocate_tensor` (`tensorflow/core/framework/op_kernel.cc`) returns
//! `errors::ResourceExhausted("OOM when allocating tensor with shape", shape.DebugString(), " and type ",
//! DataTypeString(type), " on ", device->name(), " by allocator ", a->Name())`, which Python raises as
//! `ResourceExhaustedError` (`shape[32,64,112,112]`: `TensorShape::DebugString` has no space). Older
//! releases wrote `OOM when allocating tensor of shape [...] and type T`. The message holds no device
//! figures, only the tensor: its bytes are the product of the shape times the dtype's size
//! (`DataTypeSize`, `tensorflow/core/framework/types.cc`).

use super::scan::{after, at};
use super::sizes::Size;
use super::{Format, ParseError, ParsedOom, TensorRequest};

const ANCHORS: [&str; 2] = [
    "OOM when allocating tensor with shape",
    "OOM when allocating tensor of shape",
];

/// Where the first TensorFlow message starts, if any.
pub fn locate(line: &str) -> Option<usize> {
    ANCHORS.iter().filter_map(|a| line.find(a)).min()
}

/// Bytes per element of a dtype as `DataTypeString` writes it; `None` for types without a fixed size
/// (`string`, `resource`, `variant`).
pub fn dtype_bytes(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "bool" | "int8" | "uint8" | "qint8" | "quint8" | "float8_e5m2" | "float8_e4m3fn" => 1,
        "half" | "bfloat16" | "int16" | "uint16" | "qint16" | "quint16" => 2,
        "float" | "int32" | "uint32" | "qint32" => 4,
        "double" | "int64" | "uint64" | "complex64" => 8,
        "complex128" => 16,
        _ => return None,
    })
}

/// Reads the message whose anchor is at `anchor`.
pub fn read(line: &str, anchor: usize) -> Result<ParsedOom, ParseError> {
    let format = Format::TensorFlow;
    let bad = |what: String| ParseError::Bad {
        format: format.name(),
        what,
    };
    let open = at(line, anchor, "[").filter(|&p| p < anchor + 45);
    let close = open.and_then(|o| at(line, o, "]"));
    let (Some(open), Some(close)) = (open, close) else {
        return Err(ParseError::Missing {
            format: format.name(),
            missing: vec!["the tensor's shape \"[d0,d1,...]\"".into()],
        });
    };
    let dims = line[open + 1..close].trim();
    let shape: Vec<u64> = if dims.is_empty() {
        Vec::new()
    } else {
        dims.split(',')
            .map(|d| d.trim().parse::<u64>())
            .collect::<Result<_, _>>()
            .map_err(|_| bad(format!("the shape [{dims}] is not a list of sizes")))?
    };
    let Some(t) = after(line, close, " and type ").filter(|&t| t <= close + 12) else {
        return Err(ParseError::Missing {
            format: format.name(),
            missing: vec!["\"and type T\" (the dtype)".into()],
        });
    };
    let dtype: String = line[t..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    let element_bytes = dtype_bytes(&dtype).ok_or_else(|| {
        bad(format!(
            "dtype {dtype:?} has no fixed size (known: bool, int8, uint8, half, bfloat16, int16, \
             uint16, float, int32, uint32, double, int64, uint64, complex64, complex128)"
        ))
    })?;
    let elements = shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .ok_or_else(|| bad(format!("the shape [{dims}] has more than 2^64 elements")))?;
    let bytes = elements.checked_mul(element_bytes).ok_or_else(|| {
        bad(format!(
            "the tensor [{dims}] of {dtype} is 2^64 bytes or more"
        ))
    })?;
    let printed = format!("shape[{dims}] of {dtype}");
    let mut oom = ParsedOom::new(format, "", Size::exact(bytes, printed));
    let t_end = t + dtype.len();
    if let Some(on) = after(line, t_end, " on ").filter(|&p| p == t_end + 4) {
        let device: String = line[on..]
            .chars()
            .take_while(|c| !c.is_whitespace())
            .collect();
        oom.backend = if device.contains("GPU") {
            "GPU"
        } else if device.contains("CPU") {
            "CPU"
        } else {
            ""
        }
        .to_string();
        oom.device = Some(device);
        if let Some(by) = after(line, on, " by allocator ").filter(|&p| p < on + 80) {
            let name: String = line[by..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            oom.allocator = (!name.is_empty()).then_some(name);
        }
    }
    oom.tensor = Some(TensorRequest {
        shape,
        dtype,
        element_bytes,
    });
    Ok(oom)
}
