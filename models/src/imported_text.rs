//! The calls transformers' models make (`from_module` on an HF `PreTrainedModel`), mapped onto the
//! op library as the zoo's HF lowerings (`zoo/gpt2.rs`, `zoo/bert.rs`, `zoo/llama.rs`, `zoo/nn.rs`)
//! write them: a child of [`super`] (`imported.rs`) kept apart from the vision rules.
//!
//! Integer and boolean tensors (positions, masks, labels) are not differentiable: the op library
//! allocates them like any tensor and autograd never saves or reaches them, so mask construction
//! under `torch.no_grad()` costs what CUDA allocates for it.

use super::{dtype_spec, int_at, Builder, ImportError};
use crate::dtype::DType;
use crate::graph::{DTypeSpec, T};
use crate::ops::OpKind;
use crate::recipe::{Precision, Recipe};
use crate::sdpa::{self, SdpaCall};
use serde_json::{Map, Value as J};

/// The calls this module maps (added to [`super::SUPPORTED`]'s).
pub const SUPPORTED: &[&str] = &[
    "arange",
    "tensor",
    "to",
    "addmm",
    "split",
    "scaled_dot_product_attention",
    "pow",
    "__pow__",
    "pad",
    "gather",
    "cos",
    "sin",
    "rsqrt",
    "neg",
    "__neg__",
    "log",
    "zeros",
    "where",
    "topk",
    "sum",
    "div_",
    "chunk",
    "_grouped_mm",
    "grouped_mm",
    "masked_fill",
];

/// Comparisons: boolean results, outside autograd.
pub(super) const COMPARISONS: &[&str] = &[
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "eq", "ne", "lt", "le", "gt", "ge",
];

const INTEGER_DTYPES: &[&str] = &["int64", "int32", "int16", "int8", "uint8", "bool"];

/// Whether an index holds a tensor (advanced indexing, a new tensor; slices and ints are views).
fn has_tensor(j: Option<&J>) -> bool {
    match j {
        Some(J::Array(a)) => a.iter().any(|x| has_tensor(Some(x))),
        other => tensor_id(other).is_some(),
    }
}

fn integer_value(values: &J, id: usize) -> bool {
    INTEGER_DTYPES.contains(&values[id]["dtype"].as_str().unwrap_or("model"))
}

/// Whether a call reads tensors and makes outputs that are all integer or boolean (mask and
/// position arithmetic: `diff`, `cumsum`, `!=`, `sum`, `all` on ids): outside autograd.
pub(super) fn integer_call(args: &[J], outs: &[usize], values: &J) -> bool {
    let mut any = false;
    let mut stack: Vec<&J> = args.iter().collect();
    while let Some(j) = stack.pop() {
        if let Some(id) = tensor_id(Some(j)) {
            any = true;
            if !integer_value(values, id) {
                return false;
            }
        } else if let Some(a) = j.as_array() {
            stack.extend(a);
        }
    }
    any && !outs.is_empty() && outs.iter().all(|&o| integer_value(values, o))
}

/// One captured call: its name, module path, arguments and output value ids.
pub(super) struct Call<'j> {
    pub name: &'j str,
    pub module: &'j str,
    pub args: &'j [J],
    pub kwargs: &'j Map<String, J>,
    pub outs: &'j [usize],
}

impl Call<'_> {
    /// Argument `i` (positional) or `key` (keyword), `None` when absent or `None`.
    fn arg(&self, i: usize, key: &str) -> Option<&J> {
        self.args
            .get(i)
            .or_else(|| self.kwargs.get(key))
            .filter(|v| !v.is_null())
    }

    fn bad(&self, msg: String) -> ImportError {
        ImportError::Arguments {
            op: self.name.to_string(),
            module: self.module.to_string(),
            msg,
        }
    }
}

fn tensor_id(j: Option<&J>) -> Option<usize> {
    j?.get("t")?.as_u64().map(|v| v as usize)
}

/// The SDPA call a captured `F.scaled_dot_product_attention` makes under `recipe`: q/k/v shapes
/// at `recipe.batch`, the recipe's compute dtype (autocast casts q/k/v to it; a 16-bit model's
/// are 16-bit), `dropout_p` in training only, `is_causal`, `attn_mask`, `enable_gqa` as passed
/// (transformers' `sdpa_attention_forward`).
pub(super) fn sdpa_call(op: &J, values: &J, recipe: &Recipe, at: (u64, u64)) -> Option<SdpaCall> {
    let args = op["args"].as_array()?;
    let kwargs = op["kwargs"].as_object()?;
    let get = |i: usize, key: &str| {
        args.get(i)
            .or_else(|| kwargs.get(key))
            .filter(|v| !v.is_null())
    };
    let shape = |i: usize, key: &str| -> Option<Vec<u64>> {
        let id = tensor_id(get(i, key))?;
        values.get(id)?["shape"]
            .as_array()?
            .iter()
            .map(|d| int_at(d, at).map(|x| x.max(0) as u64))
            .collect()
    };
    let (q, k, v) = (shape(0, "query")?, shape(1, "key")?, shape(2, "value")?);
    let ([b, hq, l, d], [_, hkv, s, _], [_, _, _, dv]) = (q.as_slice(), k.as_slice(), v.as_slice())
    else {
        return None;
    };
    let dtype = match recipe.precision {
        Precision::Fp32 => DType::F32,
        Precision::Bf16 | Precision::AmpBf16 => DType::BF16,
        Precision::AmpFp16 | Precision::Fp16 => DType::F16,
    };
    let dropout = if recipe.inference {
        0.0
    } else {
        get(4, "dropout_p").and_then(J::as_f64).unwrap_or(0.0)
    };
    Some(SdpaCall {
        dtype,
        batch: *b,
        heads_q: *hq,
        heads_kv: *hkv,
        seq_q: *l,
        seq_kv: *s,
        head_dim: *d,
        head_dim_v: *dv,
        mask: get(3, "attn_mask").is_some(),
        dropout,
        is_causal: get(5, "is_causal").and_then(J::as_bool).unwrap_or(false),
        enable_gqa: get(7, "enable_gqa").and_then(J::as_bool).unwrap_or(false),
        requires_grad: !recipe.inference,
    })
}

impl Builder<'_> {
    /// Whether [`Builder::text_op`] maps this call: its own calls, and `cat` with a legacy empty
    /// `[0]` tensor among its inputs (a `DynamicLayer`'s first update).
    pub(super) fn claims_text(&self, name: &str, args: &[J], outs: &[usize]) -> bool {
        if name == "div_" {
            // By a tensor (the router's normalisation); by a scalar it is the vision rule's.
            return tensor_id(args.get(1)).is_some();
        }
        if SUPPORTED.contains(&name) || COMPARISONS.contains(&name) {
            return true;
        }
        if !super::SUPPORTED.contains(&name) && integer_call(args, outs, &self.g.doc["values"]) {
            return true;
        }
        if name == "__getitem__" {
            // `position_ids[:, None, :]` (LLaMA's rotary embedding): an index with `None`;
            // `hidden_states[perm // k]` (MoE dispatch): one index tensor.
            let index = args.get(1);
            return index
                .and_then(J::as_array)
                .is_some_and(|a| a.iter().any(J::is_null))
                || tensor_id(index).is_some()
                || (has_tensor(index) && integer_call(args, outs, &self.g.doc["values"]));
        }
        name == "cat"
            && args
                .first()
                .and_then(J::as_array)
                .is_some_and(|l| l.iter().any(|j| self.is_empty_1d(j)))
    }

    fn is_empty_1d(&self, j: &J) -> bool {
        tensor_id(Some(j))
            .and_then(|i| self.g.doc["values"].get(i))
            .and_then(|v| v["shape"].as_array())
            .is_some_and(|s| s.len() == 1 && s[0].as_i64() == Some(0))
    }

    fn declared(&self, c: &Call, i: usize) -> Result<(Vec<u64>, DTypeSpec), ImportError> {
        let id = *c
            .outs
            .get(i)
            .ok_or_else(|| c.bad(format!("output {i} is missing")))?;
        let decl = &self.g.doc["values"][id];
        let shape = self.shape(&decl["shape"])?;
        Ok((shape, dtype_spec(decl["dtype"].as_str().unwrap_or("?"))?))
    }

    /// Whether a trainable parameter reaches value `id` through the captured calls (autograd
    /// would record it): integer and boolean values never do.
    fn reaches_param(&self, id: usize) -> bool {
        let values = &self.g.doc["values"];
        let ops = self.g.doc["ops"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let mut stack = vec![id];
        let mut seen = std::collections::BTreeSet::new();
        while let Some(v) = stack.pop() {
            if !seen.insert(v) || integer_value(values, v) {
                continue;
            }
            let decl = &values[v];
            match decl["kind"].as_str() {
                Some("param") if decl["trainable"].as_bool().unwrap_or(true) => return true,
                Some("op") => {
                    let Some(op) = decl["op"].as_u64().and_then(|k| ops.get(k as usize)) else {
                        continue;
                    };
                    let mut args: Vec<&J> = op["args"].as_array().into_iter().flatten().collect();
                    args.extend(
                        op["kwargs"]
                            .as_object()
                            .into_iter()
                            .flat_map(|m| m.values()),
                    );
                    while let Some(j) = args.pop() {
                        if let Some(t) = tensor_id(Some(j)) {
                            stack.push(t);
                        } else if let Some(a) = j.as_array() {
                            args.extend(a);
                        }
                    }
                }
                _ => {}
            }
        }
        false
    }

    /// The tensor whose dtype a factory's output takes at run time (`dtype_like`, recorded by the
    /// capture for transformers' `DynamicLayer.lazy_initialization`).
    fn dtype_like(&self, id: usize) -> Option<T> {
        let values = &self.g.doc["values"];
        let op = values[id]["op"].as_u64()? as usize;
        let like = tensor_id(self.g.doc["ops"][op]["kwargs"].get("dtype_like"))?;
        self.get(like).ok()
    }

    fn any_input_reaches_param(&self, c: &Call) -> bool {
        let mut stack: Vec<&J> = c.args.iter().chain(c.kwargs.values()).collect();
        while let Some(j) = stack.pop() {
            if let Some(id) = tensor_id(Some(j)) {
                if self.reaches_param(id) {
                    return true;
                }
            } else if let Some(a) = j.as_array() {
                stack.extend(a);
            }
        }
        false
    }

    fn first_param(&self) -> Option<T> {
        let id = self.g.doc["params"].get(0)?.as_u64()? as usize;
        self.vals.get(id).copied().flatten()
    }

    fn input_t(&self, c: &Call, i: usize, key: &str) -> Result<T, ImportError> {
        let id = tensor_id(c.arg(i, key)).ok_or_else(|| c.bad(format!("{key} is not a tensor")))?;
        self.get(id)
    }

    /// The op library's result of a transformers call (see [`SUPPORTED`]).
    pub(super) fn text_op(&mut self, c: &Call) -> Result<Vec<T>, ImportError> {
        Ok(match c.name {
            // `torch.arange(past, past + S)` (cache positions), `torch.tensor([])` (a
            // `DynamicLayer`'s lazy `keys`/`values`, 0 bytes: no block), `F.pad(labels, (0, 1),
            // value=-100)` (`ForCausalLMLoss`'s shift), `torch.gather` of BERT's `token_type_ids`
            // buffer: factories outside autograd, in the shape and dtype PyTorch gave.
            "arange" | "tensor" | "pad" | "gather" => {
                let (shape, dt) = self.declared(c, 0)?;
                let mut inputs = Vec::new();
                if matches!(c.name, "pad" | "gather") {
                    for (i, key) in [(0, "input"), (2, "index")] {
                        let Some(id) = tensor_id(c.arg(i, key)) else {
                            continue;
                        };
                        let x = self.get(id)?;
                        if self.b.g_value_differentiable(x) {
                            return Err(c.bad(format!(
                                "{} of a differentiable tensor is not modelled",
                                c.name
                            )));
                        }
                        inputs.push(x);
                    }
                }
                let tag = match c.name {
                    "arange" => "aten.arange",
                    "tensor" => "aten.tensor",
                    "gather" => "aten.gather",
                    _ => "aten.constant_pad_nd",
                };
                vec![self.b.factory(tag, &inputs, &shape, dt, vec![])]
            }
            // `Tensor.to(device)` / `.to(dtype)` / `.to(other)`: the tensor itself unless the dtype
            // changes (`aten::to` returns `self` when nothing changes, `_to_copy` otherwise).
            "to" => {
                let x = self.input_t(c, 0, "self")?;
                let (_, want) = self.declared(c, 0)?;
                let dtype = c
                    .args
                    .iter()
                    .skip(1)
                    .chain(c.kwargs.values())
                    .find_map(|j| j.get("dtype"))
                    .and_then(J::as_str);
                match (dtype, want) {
                    (None, _) => vec![x],
                    (Some(_), _) if self.b.dtype(x) == want => vec![x],
                    (Some(_), DTypeSpec::Fixed(d)) => vec![self.b.to_dtype(x, d)],
                    // `.to(input_dtype)` back to the model's dtype (RMSNorm, rotary cos/sin):
                    // the dtype of the parameters, whatever `--precision` makes it.
                    (Some(_), _) => {
                        let p = self.first_param().ok_or_else(|| {
                            c.bad("to(the model's dtype) in a module without parameters".into())
                        })?;
                        vec![self.b.to_dtype_of(x, p)]
                    }
                }
            }
            // `Conv1D.forward` (transformers `pytorch_utils.py`): `torch.addmm(self.bias,
            // x.view(-1, x.size(-1)), self.weight)`, the zoo's `conv1d`.
            "addmm" => {
                let bias = self.input_t(c, 0, "input")?;
                let a = self.input_t(c, 1, "mat1")?;
                let w = self.input_t(c, 2, "mat2")?;
                vec![self.b.addmm(bias, a, w)]
            }
            // `qkv.split(n_embd, dim=2)`, `gate_up.chunk(2, dim=-1)`: views of the sizes PyTorch
            // gave.
            "split" | "chunk" => {
                let x = self.input_t(c, 0, if c.name == "split" { "self" } else { "input" })?;
                let dim = c
                    .arg(2, "dim")
                    .and_then(|j| int_at(j, (self.batch, self.seq)))
                    .unwrap_or(0);
                let n = self.b.shape(x).len() as i64;
                let d = if dim < 0 { dim + n } else { dim } as usize;
                let mut sizes = Vec::new();
                for i in 0..c.outs.len() {
                    sizes.push(self.declared(c, i)?.0.get(d).copied().unwrap_or(0));
                }
                self.b.split(x, &sizes, d as isize)
            }
            // LLaMA's rotary embedding under `@torch.no_grad()`: `emb.cos()`, `emb.sin()` of the
            // float32 frequencies, outside autograd.
            // T5's relative position buckets: `log` of float32 distances made from integer positions.
            "cos" | "sin" | "log" => {
                // Factories: no backward. transformers computes them from buffers and integer
                // positions only (`LlamaRotaryEmbedding.forward`, `T5Attention._relative_position_bucket`),
                // never from a parameter: refused where one reaches them.
                let id = tensor_id(c.arg(0, "input"))
                    .ok_or_else(|| c.bad("input is not a tensor".into()))?;
                if self.reaches_param(id) {
                    return Err(c.bad(format!(
                        "{} of a tensor that needs grad is not modelled",
                        c.name
                    )));
                }
                let x = self.get(id)?;
                let s = self.b.shape(x);
                let d = self.b.dtype(x);
                let tag = match c.name {
                    "cos" => "aten.cos",
                    "sin" => "aten.sin",
                    _ => "aten.log",
                };
                vec![self.b.factory(tag, &[x], &s, d, vec![])]
            }
            // `torch.zeros(...)` (T5's position bias of a layer without relative attention bias, the
            // scalar of its causal mask) and `torch.where(mask, zeros, min)` (T5's additive causal
            // mask): outside autograd, in the shape and dtype PyTorch gave.
            "zeros" | "where" => {
                let mut inputs = Vec::new();
                for (i, key) in [(0, "condition"), (1, "input"), (2, "other")] {
                    if c.name == "zeros" {
                        break;
                    }
                    if let Some(id) = tensor_id(c.arg(i, key)) {
                        if self.reaches_param(id) {
                            return Err(
                                c.bad("where on a tensor that needs grad is not modelled".into())
                            );
                        }
                        inputs.push(self.get(id)?);
                    }
                }
                let (shape, dt) = self.declared(c, 0)?;
                let tag = if c.name == "zeros" {
                    "aten.zeros"
                } else {
                    "aten.where"
                };
                vec![self.b.factory(tag, &inputs, &shape, dt, vec![])]
            }
            "rsqrt" => {
                let x = self.input_t(c, 0, "input")?;
                vec![self.b.rsqrt(x)]
            }
            "neg" | "__neg__" => {
                let x = self.input_t(c, 0, "input")?;
                vec![self.b.neg(x)]
            }
            // Indexing of integer/boolean tensors (eager attention's padding mask
            // `padding_mask[batch_idx, kv_idx]`): an integer call.
            "__getitem__"
                if has_tensor(c.args.get(1))
                    && integer_call(c.args, c.outs, &self.g.doc["values"]) =>
            {
                self.integer_outputs(c)?
            }
            // `x[idx]` with an int64 index tensor: `aten.index`, a new tensor (transformers'
            // `grouped_mm_experts_forward`: `hidden_states[perm // num_top_k]`, `weighted_out[inv_perm]`).
            "__getitem__" if tensor_id(c.args.get(1)).is_some() => {
                let x = self.input_t(c, 0, "self")?;
                let idx = self.input_t(c, 1, "index")?;
                vec![self.b.index1(x, idx)]
            }
            // `x[:, None, :]`: `None` inserts a dim (a view), full slices keep one.
            "__getitem__" => {
                let mut x = self.input_t(c, 0, "self")?;
                let items = c.args[1].as_array().cloned().unwrap_or_default();
                let mut dim = 0usize;
                for it in &items {
                    let full = it
                        .get("slice")
                        .and_then(J::as_array)
                        .is_some_and(|s| s.iter().all(J::is_null));
                    if it.is_null() {
                        x = self.b.unsqueeze(x, dim);
                        dim += 1;
                    } else if full {
                        dim += 1;
                    } else {
                        return Err(c.bad(format!(
                            "index entry {it} next to None is not modelled (full slices and None)"
                        )));
                    }
                }
                vec![x]
            }
            // MixtralTopKRouter: `torch.topk(router_probs, k, dim=-1)`.
            "topk" => {
                let x = self.input_t(c, 0, "input")?;
                let k = c
                    .arg(1, "k")
                    .and_then(|j| int_at(j, (self.batch, self.seq)))
                    .filter(|&k| k > 0)
                    .ok_or_else(|| c.bad("k is not a positive int".into()))?;
                let dim = c
                    .arg(2, "dim")
                    .and_then(|j| int_at(j, (self.batch, self.seq)))
                    .unwrap_or(-1);
                if c.arg(3, "largest").and_then(J::as_bool) == Some(false) {
                    return Err(c.bad("largest=False is not modelled".into()));
                }
                let (v, i) = self.b.topk(x, k as u64, dim as isize);
                vec![v, i]
            }
            // `x.sum(dim, keepdim)` of a floating tensor (the router's normalisation, the experts'
            // per-token reduction); integer sums are integer calls.
            "sum" => {
                let x = self.input_t(c, 0, "input")?;
                let keep = c.arg(2, "keepdim").and_then(J::as_bool).unwrap_or(false);
                if c.arg(3, "dtype").is_some() {
                    return Err(c.bad("sum(dtype=...) is not modelled".into()));
                }
                let n = self.b.shape(x).len() as isize;
                let dims: Vec<isize> = match c.arg(1, "dim") {
                    None => (0..n).collect(),
                    Some(j) => match j.as_array() {
                        Some(a) => a
                            .iter()
                            .map(|d| int_at(d, (self.batch, self.seq)).map(|d| d as isize))
                            .collect::<Option<_>>()
                            .ok_or_else(|| c.bad(format!("dim {j}")))?,
                        None => vec![int_at(j, (self.batch, self.seq))
                            .ok_or_else(|| c.bad(format!("dim {j}")))?
                            as isize],
                    },
                };
                vec![self.b.sum_dims(x, &dims, keep)]
            }
            // `routing_weights /= routing_weights.sum(dim=-1, keepdim=True)`: in place, autograd
            // saves `other` and a clone of the original `self` (derivatives.yaml div.Tensor uses
            // `self`): the bytes of the out-of-place `div` (a new result, the old `self` saved).
            "div_" => {
                let a = self.input_t(c, 0, "self")?;
                let o = self.input_t(c, 1, "other")?;
                vec![self.b.div(a, o)]
            }
            // transformers' `_grouped_mm` (`grouped_mm_experts_forward`): the experts' GEMMs,
            // whose allocations do not depend on how many tokens each expert gets.
            "_grouped_mm" | "grouped_mm" => {
                let a = self.input_t(c, 0, "mat_a")?;
                let b = self.input_t(c, 1, "mat_b")?;
                let offs = self.input_t(c, 2, "offs")?;
                if c.arg(3, "bias").is_some() || c.arg(4, "out_dtype").is_some() {
                    return Err(c.bad("bias and out_dtype are not modelled".into()));
                }
                vec![self.b.grouped_mm(a, b, offs)]
            }
            // nanoGPT's manual attention: `att.masked_fill(mask, float("-inf"))` (a copy; saves the
            // mask).
            "masked_fill" => {
                let x = self.input_t(c, 0, "input")?;
                let mask = self.input_t(c, 1, "mask")?;
                if tensor_id(c.arg(2, "value")).is_some() {
                    return Err(c.bad("a tensor fill value is not modelled".into()));
                }
                vec![self.b.masked_fill(x, mask)]
            }
            // A comparison whose inputs no parameter reaches (`self.bias[:, :, :T, :T] == 0` on
            // nanoGPT's float32 mask buffer): a boolean tensor outside autograd.
            n if c
                .outs
                .iter()
                .all(|&o| integer_value(&self.g.doc["values"], o))
                && !c.outs.is_empty()
                && COMPARISONS.contains(&n)
                && !self.any_input_reaches_param(c) =>
            {
                self.integer_outputs(c)?
            }
            "pow" | "__pow__" => {
                let x = self.input_t(c, 0, "input")?;
                let e = c
                    .arg(1, "exponent")
                    .and_then(J::as_f64)
                    .ok_or_else(|| c.bad("a tensor exponent is not modelled".into()))?;
                vec![self.b.pow(x, e)]
            }
            // `sdpa_attention_forward`: one `F.scaled_dot_product_attention` on the backend PyTorch
            // picks for the recipe's GPU and dtype (`sdpa::choose`), as the zoo's HF models.
            "scaled_dot_product_attention" => {
                let q = self.input_t(c, 0, "query")?;
                let k = self.input_t(c, 1, "key")?;
                let v = self.input_t(c, 2, "value")?;
                if c.arg(3, "attn_mask").is_some() {
                    return Err(c.bad(
                        "attn_mask is not modelled (HF drops an all-ones mask: pass no attention_mask)"
                            .into(),
                    ));
                }
                let default = Recipe::new(self.batch, 0);
                let r = self.recipe.clone().unwrap_or(default);
                let call = sdpa_call(
                    &J::Object(
                        [
                            ("args".to_string(), J::Array(c.args.to_vec())),
                            ("kwargs".to_string(), J::Object(c.kwargs.clone())),
                        ]
                        .into_iter()
                        .collect(),
                    ),
                    &self.g.doc["values"],
                    &r,
                    (self.batch, self.seq),
                )
                .ok_or_else(|| c.bad("q, k, v are not [B, H, L, D]".into()))?;
                let backend = sdpa::choose(r.attention, &call, r.target)
                    .map_err(|e| c.bad(e.to_string()))?
                    .backend;
                vec![self
                    .b
                    .sdpa_with(q, k, v, backend, call.is_causal, call.dropout)]
            }
            // `torch.cat([self.keys, key_states], dim=-2)` on a fresh `DynamicLayer`: PyTorch's
            // `cat` skips legacy empty `[0]` tensors, so it copies `key_states` (the zoo's
            // `kv_cache_update`).
            "cat" => {
                let list = c.args[0].as_array().cloned().unwrap_or_default();
                let (mut xs, mut all) = (Vec::new(), Vec::new());
                for j in &list {
                    let id =
                        tensor_id(Some(j)).ok_or_else(|| c.bad("cat of a non-tensor".into()))?;
                    let mut t = self.get(id)?;
                    if !self.is_empty_1d(j) {
                        xs.push(t);
                    } else if let Some(like) = self.dtype_like(id) {
                        // `torch.tensor([], dtype=key_states.dtype)`: the keys' dtype at run time
                        // (a 0-byte `to`, outside autograd).
                        t = self.b.to_dtype_of(t, like);
                    }
                    all.push(t);
                }
                let Some(&first) = xs.first() else {
                    let (shape, dt) = self.declared(c, 0)?;
                    return Ok(vec![self.b.factory("aten.cat", &[], &shape, dt, vec![])]);
                };
                let n = self.b.shape(first).len() as i64;
                let dim = c
                    .arg(1, "dim")
                    .and_then(|j| int_at(j, (self.batch, self.seq)))
                    .unwrap_or(0);
                let dim = if dim < 0 { dim + n } else { dim } as usize;
                let mut shape = self.b.shape(first);
                shape[dim] = xs.iter().map(|&x| self.b.shape(x)[dim]).sum();
                // The result's dtype promotes over every input, the skipped ones too: a
                // `DynamicLayer` makes `values` empty in `key_states`' dtype, so under autocast
                // (float32 keys after RoPE, bfloat16 values) the value cache is a float32 copy.
                let d = self.b.result_dtype(&all);
                vec![self.b.op1(OpKind::Cat { dim }, &all, shape, d)]
            }
            // Integer/boolean arithmetic (mask construction, position ids, the packed-sequence
            // check): each output is allocated in the shape and dtype PyTorch gave, nothing is
            // saved for backward (no floating tensor is involved).
            // In place on an integer tensor (`shifted.masked_fill_(shifted == -100, pad)` in T5's
            // `_shift_right`): the kernel writes existing storage, nothing is allocated.
            n if n.ends_with('_')
                && !n.ends_with("__")
                && integer_call(c.args, c.outs, &self.g.doc["values"]) =>
            {
                vec![self.input_t(c, 0, "self")?]
            }
            _ if integer_call(c.args, c.outs, &self.g.doc["values"]) => self.integer_outputs(c)?,
            // Arguments these rules do not take (a comparison a parameter reaches, a floating
            // in-place call): refused, so the call falls back on its recording where there is one.
            other => {
                return Err(c.bad(format!(
                    "{other} with these arguments has no rule (not integer or mask arithmetic)"
                )))
            }
        })
    }

    /// An integer call's outputs (mask and position arithmetic): each allocated in the shape and
    /// dtype PyTorch gave, reading the call's tensors; nothing is saved for backward (no floating
    /// tensor is involved).
    fn integer_outputs(&mut self, c: &Call) -> Result<Vec<T>, ImportError> {
        let mut inputs = Vec::new();
        let mut stack: Vec<&J> = c.args.iter().chain(c.kwargs.values()).collect();
        while let Some(j) = stack.pop() {
            if let Some(id) = tensor_id(Some(j)) {
                inputs.push(self.get(id)?);
            } else if let Some(a) = j.as_array() {
                stack.extend(a);
            }
        }
        let mut out = Vec::new();
        for i in 0..c.outs.len() {
            let (shape, dt) = self.declared(c, i)?;
            out.push(
                self.b
                    .factory("aten.integer_op", &inputs, &shape, dt, vec![]),
            );
        }
        Ok(out)
    }
}
