//! `--quant nf4|fp4|nf4-dq|fp4-dq|int8`: bitsandbytes' quantized linear layers, as transformers'
//! `BitsAndBytesConfig` loads them (`integrations/bitsandbytes.py`, `quantizers/base.py`).
//!
//! Every `nn.Linear` / `Conv1D` but the output embedding and the module of the last parameter
//! (`get_keys_to_not_convert`) becomes a `Linear4bit` (`Params4bit`) or `Linear8bitLt`
//! (`Int8Params`); other weights (embeddings, norms, `lm_head`) stay in the model's dtype, as do
//! biases. The layer's forward is one [`crate::OpKind::QuantLinear`].
//!
//! **Storage** (bitsandbytes `functional.py` `quantize_4bit`, blocksize 64; `quantize_blockwise`
//! of the absmax with the nested blocksize 256 when double-quantized), per weight of n elements,
//! nb = ceil(n / 64):
//!
//! | tensor | shape, dtype |
//! |---|---|
//! | packed weight | `[(n+1) // (2·s), 1]` in `quant_storage` (itemsize s; uint8 by default: `[ceil(n/2), 1]`) |
//! | `code` (NF4/FP4 table) | `[16]` float32 |
//! | absmax (no DQ) | `[nb]` float32 |
//! | absmax (DQ) | `[nb]` uint8, + `state2.absmax` `[ceil(nb/256)]` float32, `state2.code` `[256]` float32, `offset` 0-d float32 |
//!
//! `int8` (`Int8Params`, `has_fp16_weights=False`): `CB` int8 `[out, in]` and `SCB` float32
//! `[out]`.
//!
//! **`quant_storage`** (`--quant-storage`; transformers' `bnb_4bit_quant_storage`, default
//! uint8; bitsandbytes `Params4bit(quant_storage=...)`): the dtype the packed 4-bit codes are
//! stored in, `torch.empty(((n + 1) // (quant_storage.itemsize * 2), 1), dtype=quant_storage)`
//! (`_ops.py` fake of `bitsandbytes::quantize_4bit`, `backends/cuda/ops.py`). A floating-point
//! storage is what FSDP-QLoRA sets (bitsandbytes PR #970, docs `fsdp_qlora.md`) so that FSDP
//! shards the codes like the other weights; the quant state is unchanged.

use super::lora::{linear_modules, LinearLayer};
use super::FinetuneError;
use crate::dtype::DType;
use crate::graph::{DTypeSpec, Graph, GraphBuilder};
use crate::ops::OpKind;

/// bitsandbytes' 4-bit block size (`Params4bit` `blocksize=None → 64`).
pub const BLOCK_4BIT: u64 = 64;
/// The nested block size of double quantization (`quantize_4bit`: `quantize_blockwise(absmax,
/// blocksize=256)`).
pub const BLOCK_NESTED: u64 = 256;

/// A bitsandbytes weight format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Quant {
    /// 4-bit NormalFloat (`bnb_4bit_quant_type="nf4"`), float32 absmax.
    Nf4,
    /// 4-bit float (`"fp4"`, bitsandbytes' and transformers' default type), float32 absmax.
    Fp4,
    /// NF4 with double quantization (`bnb_4bit_use_double_quant=True`): the QLoRA setting.
    Nf4Dq,
    /// FP4 with double quantization.
    Fp4Dq,
    /// LLM.int8 (`load_in_8bit=True`): row-wise int8 weights.
    Int8,
}

impl Quant {
    /// Every format, in `--quant` order.
    pub const ALL: [Quant; 5] = [
        Quant::Nf4,
        Quant::Fp4,
        Quant::Nf4Dq,
        Quant::Fp4Dq,
        Quant::Int8,
    ];

    /// The `--quant` name.
    pub fn name(self) -> &'static str {
        match self {
            Quant::Nf4 => "nf4",
            Quant::Fp4 => "fp4",
            Quant::Nf4Dq => "nf4-dq",
            Quant::Fp4Dq => "fp4-dq",
            Quant::Int8 => "int8",
        }
    }

    /// Whether the absmax is itself quantized (double quantization).
    pub fn double(self) -> bool {
        matches!(self, Quant::Nf4Dq | Quant::Fp4Dq)
    }

    /// The tensors that hold a quantized `[out, in]` weight with uint8 storage, in allocation
    /// order: (name, shape, dtype). The first is the weight itself.
    pub fn storage(self, out: u64, inp: u64) -> Vec<(&'static str, Vec<u64>, DType)> {
        self.storage_in(out, inp, DType::U8)
    }

    /// [`Quant::storage`] with the 4-bit codes packed into `quant_storage` elements
    /// (`(n + 1) // (2 · itemsize)` of them, bitsandbytes `quantize_4bit`); LLM.int8's `CB`
    /// ignores it (transformers passes `bnb_4bit_quant_storage` to 4-bit layers only).
    pub fn storage_in(
        self,
        out: u64,
        inp: u64,
        quant_storage: DType,
    ) -> Vec<(&'static str, Vec<u64>, DType)> {
        let n = out * inp;
        if self == Quant::Int8 {
            // Int8Params: CB int8 (stored as uint8 here: same 1-byte element) and SCB.
            return vec![
                ("weight", vec![out, inp], DType::U8),
                ("SCB", vec![out], DType::F32),
            ];
        }
        let nb = n.div_ceil(BLOCK_4BIT);
        let packed = (n + 1) / (2 * quant_storage.size());
        let mut v = vec![("weight", vec![packed, 1], quant_storage)];
        if self.double() {
            v.push(("absmax", vec![nb], DType::U8));
            v.push(("state2.absmax", vec![nb.div_ceil(BLOCK_NESTED)], DType::F32));
            v.push(("state2.code", vec![256], DType::F32));
            v.push(("offset", vec![], DType::F32));
        } else {
            v.push(("absmax", vec![nb], DType::F32));
        }
        v.push(("code", vec![16], DType::F32));
        v
    }

    /// Bytes of a quantized `[out, in]` weight ([`Quant::storage`] summed).
    pub fn storage_bytes(self, out: u64, inp: u64) -> u64 {
        self.storage(out, inp)
            .iter()
            .map(|(_, s, d)| s.iter().product::<u64>() * d.size())
            .sum()
    }
}

impl std::fmt::Display for Quant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Quant {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Quant::ALL
            .into_iter()
            .find(|q| q.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown --quant {s:?}: use one of {}",
                    Quant::ALL.map(|q| q.name()).join(", ")
                )
            })
    }
}

/// The layers bitsandbytes converts: every linear layer but the output embedding and the module
/// of the model's last parameter (transformers `get_keys_to_not_convert`).
pub fn quantized_layers(g: &Graph) -> Vec<LinearLayer> {
    let last_module = g
        .params
        .last()
        .and_then(|p| p.name.rsplit_once('.'))
        .map(|(m, _)| m.to_string());
    linear_modules(g)
        .into_iter()
        .filter(|l| {
            !super::lora::is_output_embedding(&l.path) && Some(&l.path) != last_module.as_ref()
        })
        .collect()
}

/// The `--quant-storage` names and dtypes (transformers' `bnb_4bit_quant_storage`).
pub const QUANT_STORAGES: [(&str, DType); 4] = [
    ("uint8", DType::U8),
    ("bf16", DType::BF16),
    ("fp16", DType::F16),
    ("fp32", DType::F32),
];

/// Parses a `--quant-storage` name ([`QUANT_STORAGES`]).
pub fn parse_quant_storage(s: &str) -> Result<DType, String> {
    QUANT_STORAGES
        .iter()
        .find(|(n, _)| *n == s)
        .map(|&(_, d)| d)
        .ok_or_else(|| {
            format!(
                "unknown --quant-storage {s:?}: use one of {}",
                QUANT_STORAGES.map(|(n, _)| n).join(", ")
            )
        })
}

/// The `--quant-storage` name of `d`.
pub fn quant_storage_name(d: DType) -> &'static str {
    QUANT_STORAGES
        .iter()
        .find(|(_, x)| *x == d)
        .map_or("uint8", |(n, _)| n)
}

/// Quantizes the linear layers of `g` ([`quantized_layers`]): each weight becomes its packed
/// storage in `quant_storage` elements (a frozen parameter with its unquantized shape kept for
/// counting) and quant-state buffers, and the layer's ops one [`OpKind::QuantLinear`].
pub fn apply_quant(g: Graph, q: Quant, quant_storage: DType) -> Result<Graph, FinetuneError> {
    let layers = quantized_layers(&g);
    if layers.is_empty() {
        return Err(FinetuneError::NoLinear {
            model: g.name.clone(),
            what: format!(
                "--quant {q} (bitsandbytes keeps the output layer in 16 bits, so there must be another)"
            ),
        });
    }
    let n_ops = g.ops.len();
    let mut b = GraphBuilder::resume(g);
    let mut replaced = Vec::new();
    for l in &layers {
        let g = b.graph();
        let Some((x, y)) = l.input_output(g) else {
            continue;
        };
        let y_shape = g.values[y.0 as usize].shape.clone();
        let bias = g
            .params
            .iter()
            .find(|p| p.name == format!("{}.bias", l.path))
            .map(|p| p.value);
        let w = g.params[l.weight].value;
        let storage = q.storage_in(l.out_features, l.in_features, quant_storage);
        // The weight parameter becomes the packed storage (Params4bit / Int8Params: frozen).
        b.set_path(&l.path);
        b.quantize_param(
            l.weight,
            &storage[0].1,
            storage[0].2,
            vec![l.out_features, l.in_features],
        );
        for (name, shape, dtype) in &storage[1..] {
            b.buffer_after(
                &format!("weight.quant_state.{name}"),
                shape,
                DTypeSpec::Fixed(*dtype),
                l.weight + 1,
            );
        }
        let mut ins = vec![x, w];
        ins.extend(bias);
        let op0 = b.graph().ops.len();
        let y_new = b.op1(
            OpKind::QuantLinear {
                quant: q,
                in_features: l.in_features,
                out_features: l.out_features,
            },
            &ins,
            y_shape,
            DTypeSpec::Model,
        );
        replaced.push((l.ops, y, y_new, op0));
    }
    let mut g = b.finish()?;
    for &((_, last), y, y_new, _) in &replaced {
        super::lora::replace_uses(&mut g, last, n_ops, y, y_new);
    }
    let mut groups: Vec<Vec<usize>> = (0..n_ops).map(|i| vec![i]).collect();
    for &((first, last), _, _, op0) in &replaced {
        for gr in &mut groups[first..last] {
            gr.clear();
        }
        groups[last] = vec![op0];
    }
    super::lora::reorder_ops(&mut g, &groups);
    g.sort_buffers();
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// QLoRA paper §3 / bitsandbytes docs: 4 bits per weight, plus 32/64 = 0.5 bits of fp32 absmax
    /// per 64-block, or with double quantization 8/64 + 32/(64·256) = 0.127 bits.
    #[test]
    fn bytes_per_parameter() {
        let (out, inp) = (4096u64, 4096u64);
        let n = (out * inp) as f64;
        let fixed = 16.0 * 4.0; // the 16-entry code
        let nf4 = Quant::Nf4.storage_bytes(out, inp) as f64 - fixed;
        assert_eq!(nf4, n * (4.0 + 32.0 / 64.0) / 8.0);
        let dq = Quant::Nf4Dq.storage_bytes(out, inp) as f64 - fixed - 256.0 * 4.0 - 4.0;
        assert_eq!(dq, n * (4.0 + 8.0 / 64.0 + 32.0 / (64.0 * 256.0)) / 8.0);
        // 0.127 bits of constants per parameter (the paper's figure, rounded).
        assert!(((8.0 / 64.0 + 32.0 / (64.0 * 256.0)) - 0.127f64).abs() < 0.001);
        // LLM.int8: 1 byte per weight plus a float32 scale per row.
        assert_eq!(Quant::Int8.storage_bytes(out, inp), out * inp + 4 * out);
    }

    /// bitsandbytes `quantize_4bit`: `(n + 1) // (itemsize * 2)` elements of `quant_storage`,
    /// so bf16 storage holds four codes per element, the same bytes as uint8 for even sizes.
    #[test]
    fn quant_storage_packs_codes_by_itemsize() {
        let w = |s| Quant::Nf4.storage_in(4096, 4096, s)[0].clone();
        assert_eq!(w(DType::U8).1, vec![8_388_608, 1]);
        assert_eq!(w(DType::BF16).1, vec![4_194_304, 1]);
        assert_eq!(w(DType::BF16).2, DType::BF16);
        assert_eq!(w(DType::F32).1, vec![2_097_152, 1]);
        // An odd count: (15 + 1) // 2 = 8 bytes; (15 + 1) // 4 = 4 bf16.
        assert_eq!(Quant::Fp4.storage_in(3, 5, DType::BF16)[0].1, vec![4, 1]);
        assert_eq!(parse_quant_storage("bf16"), Ok(DType::BF16));
        assert!(parse_quant_storage("int4")
            .unwrap_err()
            .contains("uint8, bf16, fp16, fp32"));
    }
}
