//! Graphs captured from a user's `nn.Module` (`vramsim.from_module`), lowered like a zoo model.
//!
//! The Python side (`python/vramsim/_graph_capture.py`) runs the forward and the loss on the meta
//! device under a `TorchFunctionMode` and writes each call (`F.linear`, `F.conv2d`, `Tensor.view`,
//! `F.cross_entropy`, ...) with its module path, its arguments and its outputs' shapes to a JSON
//! document (format `vramsim-graph`, version 1, described in `models/README.md`). Integers that
//! depend on the batch are written `{"b": k, "c": c}` (`k * batch + c`), so [`ImportedGraph::build`]
//! rebuilds the graph at any batch: each call is mapped onto the op library's builder method of the
//! same PyTorch function (which writes the ATen ops eager PyTorch runs, autocast's casts included),
//! so every recipe (precision, checkpointing of nothing but the whole step, accumulation, optimizer)
//! applies as to a zoo model.
//!
//! Calls without a rule fall back on what the capture recorded of them (`"recorded"`: which
//! outputs are views of an input, what autograd saved, per storage), lowered as an
//! [`OpKind::Recorded`](crate::ops::OpKind::Recorded) op and listed by [`ImportedGraph::recorded`];
//! a document without that recording for such a call is an [`ImportError::Unsupported`] listing
//! them.

use crate::autocast::Policy;
use crate::dtype::DType;
use crate::graph::{DTypeSpec, Graph, GraphBuilder, GraphError, RegionKind, T};
use crate::ops::{
    Recorded, RecordedBackward, RecordedDType, RecordedGrad, RecordedOut, RecordedSave,
    RecordedStep,
};
use crate::recipe::{Precision, Recipe};
use crate::sdpa::{self, SdpaCall};
use serde_json::Value as J;
use std::collections::BTreeMap;

#[path = "imported_text.rs"]
mod text;

/// The `format` field of a graph document.
pub const FORMAT: &str = "vramsim-graph";
/// The version of the graph format read here.
pub const VERSION: u64 = 2;

/// Why a graph document cannot be imported or built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    /// Not JSON, or not a `vramsim-graph` document of a known version.
    #[error("not a vramsim graph document: {0}")]
    Format(String),
    /// Calls without a rule in the op library and without the capture's recording of them (name,
    /// module path, count).
    #[error("calls without a rule in vramsim's op library, and no recording of them to fall back on (op @ module × count): {}; capture the module again with this vramsim's from_module", list_calls(.0))]
    Unsupported(Vec<(String, String, usize)>),
    /// A call whose arguments the rule does not take (op, module, what).
    #[error("{module}: {op}: {msg}")]
    Arguments {
        /// Call name.
        op: String,
        /// Module path.
        module: String,
        /// What is wrong.
        msg: String,
    },
    /// Shapes that do not fit at this batch.
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// A parsed graph document: builds the model's [`Graph`] at any batch.
#[derive(Clone, Debug, PartialEq)]
pub struct ImportedGraph {
    /// The model name (the module's class name unless given).
    pub name: String,
    /// The batch the example inputs had.
    pub example_batch: u64,
    /// The sequence length the example inputs had, where it is a variable (version 2, captured
    /// with `dynamic_dims`); `None` when only the batch varies.
    pub example_seq: Option<u64>,
    doc: J,
    /// Calls whose rule refuses their arguments, lowered from their recording (found by building
    /// the graph at the example batch): `name (why)`, module, count.
    refused: Vec<(String, String, usize)>,
}

/// The call `F.multi_head_attention_forward` makes to `F.scaled_dot_product_attention` under
/// `recipe` for a `(l, n, e)` query with `heads` heads (the zoo's `sdpa_call` for the ViT):
/// no mask, not causal, q/k/v in the recipe's compute dtype.
fn mha_sdpa_call(recipe: &Recipe, [l, n, e]: [u64; 3], heads: u64, dropout: f64) -> SdpaCall {
    SdpaCall {
        dtype: match recipe.precision {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 | Precision::AmpBf16 => DType::BF16,
            Precision::AmpFp16 | Precision::Fp16 => DType::F16,
        },
        batch: n,
        heads_q: heads,
        heads_kv: heads,
        seq_q: l,
        seq_kv: l,
        head_dim: e / heads.max(1),
        head_dim_v: e / heads.max(1),
        mask: false,
        dropout,
        is_causal: false,
        enable_gqa: false,
        requires_grad: !recipe.inference,
    }
}

/// `op @ module × count, ...` (the top module written `<top>`).
pub fn list_calls(calls: &[(String, String, usize)]) -> String {
    calls
        .iter()
        .map(|(o, m, n)| format!("{o} @ {} × {n}", if m.is_empty() { "<top>" } else { m }))
        .collect::<Vec<_>>()
        .join(", ")
}

fn field<'a>(j: &'a J, key: &str) -> Result<&'a J, ImportError> {
    j.get(key)
        .ok_or_else(|| ImportError::Format(format!("missing field {key:?}")))
}

/// An integer of the document at `(batch, seq)`: a number, or an integer polynomial in the batch
/// and the sequence length, `{"c": c, "b": .., "s": .., "bs": .., "s2": .., "bs2": ..}` meaning
/// `c + b·batch + s·seq + bs·batch·seq + s2·seq² + bs2·batch·seq²` (absent terms are 0; version 1
/// writes only `b` and `c`).
fn int_at(j: &J, (batch, seq): (u64, u64)) -> Option<i64> {
    if let Some(i) = j.as_i64() {
        return Some(i);
    }
    let o = j.as_object()?;
    let (b, s) = (i64::try_from(batch).ok()?, i64::try_from(seq).ok()?);
    let mut total = o.get("c")?.as_i64()?;
    for (key, coef) in o {
        let x = match key.as_str() {
            "c" => continue,
            "b" => b,
            "s" => s,
            "bs" => b.checked_mul(s)?,
            "s2" => s.checked_mul(s)?,
            "bs2" => b.checked_mul(s)?.checked_mul(s)?,
            _ => return None,
        };
        total = total.checked_add(coef.as_i64()?.checked_mul(x)?)?;
    }
    Some(total)
}

/// The value ids of a JSON list (`[3, 7]`); anything else is no ids.
fn id_list(j: &J) -> Vec<usize> {
    j.as_array()
        .map(|a| a.iter().filter_map(J::as_u64).map(|v| v as usize).collect())
        .unwrap_or_default()
}

fn dtype_spec(name: &str) -> Result<DTypeSpec, ImportError> {
    Ok(match name {
        "model" => DTypeSpec::Model,
        "float32" => DTypeSpec::Fixed(DType::F32),
        "float16" => DTypeSpec::Fixed(DType::F16),
        "bfloat16" => DTypeSpec::Fixed(DType::BF16),
        "float64" => DTypeSpec::Fixed(DType::F64),
        "int64" => DTypeSpec::Fixed(DType::I64),
        "int32" => DTypeSpec::Fixed(DType::I32),
        "bool" => DTypeSpec::Fixed(DType::Bool),
        "uint8" => DTypeSpec::Fixed(DType::U8),
        other => return Err(ImportError::Format(format!("unknown dtype {other:?}"))),
    })
}

/// Every call name the importer has a rule for: [`SUPPORTED`], transformers' calls and the
/// comparisons (what the capture need not record a fallback for).
pub fn rules() -> Vec<&'static str> {
    let mut v = SUPPORTED.to_vec();
    v.extend_from_slice(text::SUPPORTED);
    v.extend_from_slice(text::COMPARISONS);
    v
}

/// The calls the importer maps onto the op library (the `op` names of the document).
pub const SUPPORTED: &[&str] = &[
    "linear",
    "conv2d",
    "batch_norm",
    "relu",
    "relu_",
    "hardtanh",
    "hardtanh_",
    "gelu",
    "multi_head_attention_forward",
    "__getitem__",
    "empty",
    "bernoulli_",
    "div_",
    "silu",
    "tanh",
    "sigmoid",
    "layer_norm",
    "softmax",
    "log_softmax",
    "dropout",
    "embedding",
    "add",
    "__add__",
    "__radd__",
    "sub",
    "__sub__",
    "mul",
    "__mul__",
    "__rmul__",
    "div",
    "__truediv__",
    "add_",
    "__iadd__",
    "view",
    "reshape",
    "flatten",
    "permute",
    "transpose",
    "t",
    "contiguous",
    "expand",
    "unsqueeze",
    "cat",
    "matmul",
    "__matmul__",
    "mm",
    "bmm",
    "max_pool2d",
    "_max_pool2d",
    "adaptive_avg_pool2d",
    "mean",
    "float",
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "hardswish",
    "hardsigmoid",
    "avg_pool2d",
    "chunk",
];

impl ImportedGraph {
    /// Parses a graph document (JSON text).
    pub fn parse(text: &str) -> Result<ImportedGraph, ImportError> {
        let doc: J = serde_json::from_str(text).map_err(|e| ImportError::Format(e.to_string()))?;
        if doc.get("format").and_then(J::as_str) != Some(FORMAT) {
            return Err(ImportError::Format(format!(
                "the format field is not {FORMAT:?}"
            )));
        }
        let version = doc.get("version").and_then(J::as_u64);
        if !matches!(version, Some(v) if (1..=VERSION).contains(&v)) {
            return Err(ImportError::Format(format!(
                "version {version:?} (this vramsim reads versions 1 to {VERSION})"
            )));
        }
        // Version 2: the sequence length is a variable too, `seq` its example value.
        let example_seq = match doc.get("seq") {
            None | Some(J::Null) => None,
            Some(s) => Some(
                s.as_u64()
                    .filter(|&s| s > 0)
                    .ok_or_else(|| ImportError::Format("seq is not a count".into()))?,
            ),
        };
        let name = field(&doc, "name")?
            .as_str()
            .unwrap_or("module")
            .to_string();
        let example_batch = field(&doc, "batch")?
            .as_u64()
            .ok_or_else(|| ImportError::Format("batch is not a count".into()))?;
        for key in [
            "values", "ops", "params", "buffers", "inputs", "output", "loss",
        ] {
            field(&doc, key)?;
        }
        let mut g = ImportedGraph {
            name,
            example_batch,
            example_seq,
            doc,
            refused: Vec::new(),
        };
        let missing = g.unsupported();
        if !missing.is_empty() {
            return Err(ImportError::Unsupported(missing));
        }
        // The calls whose arguments their rule does not model (known once built; a graph that
        // does not build reports why when it is built).
        if let Ok((_, refused)) = g.build_with(example_batch, &Recipe::new(example_batch, 0)) {
            let mut counts: Vec<(String, String, usize)> = Vec::new();
            for (op, module, why) in refused {
                let key = format!("{op} ({why})");
                match counts.iter_mut().find(|c| c.0 == key) {
                    Some(c) => c.2 += 1,
                    None => counts.push((key, module, 1)),
                }
            }
            g.refused = counts;
        }
        Ok(g)
    }

    /// The checkpointable blocks the capture marked (module paths).
    pub fn blocks(&self) -> Vec<String> {
        self.doc["blocks"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|b| b["module"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn ops(&self) -> &[J] {
        self.doc["ops"].as_array().map(Vec::as_slice).unwrap_or(&[])
    }

    /// The calls without a rule and without a recording to fall back on: (name, first module
    /// path, count), in program order.
    pub fn unsupported(&self) -> Vec<(String, String, usize)> {
        self.calls_without_rule(false)
    }

    /// The calls without a rule that are lowered from what the capture recorded of them
    /// ([`OpKind::Recorded`](crate::ops::OpKind::Recorded)): (name, first module path, count), in
    /// program order.
    /// Calls whose rule refuses their arguments (`conv2d (padding given as a string is not
    /// modelled)`) come after them.
    pub fn recorded(&self) -> Vec<(String, String, usize)> {
        let mut v = self.calls_without_rule(true);
        v.extend(self.refused.iter().cloned());
        v
    }

    fn calls_without_rule(&self, recorded: bool) -> Vec<(String, String, usize)> {
        let mut seen: BTreeMap<String, (usize, String, usize)> = BTreeMap::new();
        for (i, op) in self.ops().iter().enumerate() {
            let name = op["op"].as_str().unwrap_or("?");
            let outs: Vec<usize> = id_list(&op["outputs"]);
            let args = op["args"].as_array().map(Vec::as_slice).unwrap_or(&[]);
            if !SUPPORTED.contains(&name)
                && !text::SUPPORTED.contains(&name)
                && !text::COMPARISONS.contains(&name)
                && !text::integer_call(args, &outs, &self.doc["values"])
                && op.get("recorded").is_some_and(J::is_object) == recorded
            {
                let e = seen.entry(name.to_string()).or_insert((
                    i,
                    op["module"].as_str().unwrap_or("").to_string(),
                    0,
                ));
                e.2 += 1;
            }
        }
        let mut v: Vec<_> = seen
            .into_iter()
            .map(|(n, (i, m, c))| (i, n, m, c))
            .collect();
        v.sort();
        v.into_iter().map(|(_, n, m, c)| (n, m, c)).collect()
    }

    /// Whether the graph calls `F.scaled_dot_product_attention` itself (transformers'
    /// `sdpa_attention_forward`), rather than through `F.multi_head_attention_forward`.
    pub fn calls_sdpa(&self) -> bool {
        self.ops()
            .iter()
            .any(|o| o["op"] == "scaled_dot_product_attention")
    }

    /// The SDPA call of the graph's first `F.scaled_dot_product_attention` (else `F.multi_head_attention_forward`) under `recipe` (at
    /// `recipe.batch`), `None` without one: what the attention kernel is chosen from.
    pub fn sdpa_call(&self, recipe: &Recipe) -> Option<SdpaCall> {
        if let Some(op) = self
            .ops()
            .iter()
            .find(|o| o["op"] == "scaled_dot_product_attention")
        {
            return text::sdpa_call(op, &self.doc["values"], recipe, self.vars(recipe));
        }
        let op = self
            .ops()
            .iter()
            .find(|o| o["op"] == "multi_head_attention_forward")?;
        let q = op["args"].get(0)?.get("t")?.as_u64()? as usize;
        let shape: Vec<u64> = self.doc["values"].get(q)?["shape"]
            .as_array()?
            .iter()
            .map(|d| int_at(d, self.vars(recipe)).map(|x| x.max(0) as u64))
            .collect::<Option<_>>()?;
        let heads = op["args"]
            .get(4)
            .and_then(|h| int_at(h, self.vars(recipe)))?
            .max(1) as u64;
        let training = op["kwargs"]["training"].as_bool().unwrap_or(true);
        let dropout = if training {
            op["args"].get(10).and_then(J::as_f64).unwrap_or(0.0)
        } else {
            0.0
        };
        match shape.as_slice() {
            [l, n, e] => Some(mha_sdpa_call(recipe, [*l, *n, *e], heads, dropout)),
            _ => None,
        }
    }

    /// The model's graph at `batch` (dim 0 of every input), its attention kernels chosen for the
    /// default recipe ([`Recipe::new`]: fp32, `--attention auto`, sm 9.0).
    pub fn build(&self, batch: u64) -> Result<Graph, ImportError> {
        if let Some(seq) = self.example_seq {
            return self.build_for(batch, &Recipe::new(batch, seq));
        }
        self.build_for(batch, &Recipe::new(batch, 0))
    }

    /// The model's graph at `batch`, each `F.multi_head_attention_forward` on the SDPA backend
    /// PyTorch picks for `recipe` (its precision, `--attention` and target), as the zoo's ViT does.
    pub fn build_for(&self, batch: u64, recipe: &Recipe) -> Result<Graph, ImportError> {
        Ok(self.build_with(batch, recipe)?.0)
    }

    /// [`ImportedGraph::build_for`], with the calls whose rule refused their arguments (name,
    /// module, why).
    fn build_with(
        &self,
        batch: u64,
        recipe: &Recipe,
    ) -> Result<(Graph, Vec<Refused>), ImportError> {
        let mut b = Builder::new(self, batch, self.vars(recipe).1);
        b.recipe = Some(recipe.clone());
        b.run()
    }

    /// `(batch, seq)` under `recipe`: the recipe's sequence length where the capture made it a
    /// variable (`dynamic_dims`) and the recipe gives one, else the example's.
    pub fn vars(&self, recipe: &Recipe) -> (u64, u64) {
        let seq = match self.example_seq {
            Some(_) if recipe.seq > 0 => recipe.seq,
            s => s.unwrap_or(0),
        };
        (recipe.batch, seq)
    }
}

/// A call whose rule refused its arguments: name, module, why.
type Refused = (String, String, String);

struct Builder<'a> {
    g: &'a ImportedGraph,
    batch: u64,
    /// The sequence length (0 where the graph has no sequence variable).
    seq: u64,
    b: GraphBuilder,
    vals: Vec<Option<T>>,
    recipe: Option<Recipe>,
    /// Values made by a factory (`torch.empty`) and written in place since: outside autograd.
    no_grad: std::collections::BTreeSet<T>,
    /// Calls whose rule refused their arguments, lowered from their recording instead (name,
    /// module, why).
    refused: Vec<Refused>,
}

impl<'a> Builder<'a> {
    fn new(g: &'a ImportedGraph, batch: u64, seq: u64) -> Self {
        let n = g.doc["values"].as_array().map_or(0, Vec::len);
        let mut b = GraphBuilder::new(&g.name, batch, seq);
        let recorded = g.recorded();
        let fallback = if recorded.is_empty() {
            String::new()
        } else {
            format!(
                "; calls without a rule from their recording: {}",
                list_calls(&recorded)
            )
        };
        b.meta(
            "reference",
            format!(
                "vramsim.from_module capture of {} (example batch {}), lowered by the op library{fallback}",
                g.name, g.example_batch
            )
            .into(),
        );
        Builder {
            g,
            batch,
            seq,
            b,
            vals: vec![None; n],
            recipe: None,
            no_grad: Default::default(),
            refused: Vec::new(),
        }
    }

    fn shape(&self, j: &J) -> Result<Vec<u64>, ImportError> {
        j.as_array()
            .ok_or_else(|| ImportError::Format("a shape is not a list".into()))?
            .iter()
            .map(|d| {
                int_at(d, (self.batch, self.seq))
                    .filter(|&x| x >= 0)
                    .map(|x| x as u64)
                    .ok_or_else(|| ImportError::Format(format!("bad dimension {d}")))
            })
            .collect()
    }

    fn value_decl(&self, vid: &J) -> Result<(usize, &'a J), ImportError> {
        let i = vid
            .as_u64()
            .ok_or_else(|| ImportError::Format("a value id is not a count".into()))?
            as usize;
        let v = self.g.doc["values"]
            .get(i)
            .ok_or_else(|| ImportError::Format(format!("value {i} is not declared")))?;
        Ok((i, v))
    }

    fn run(mut self) -> Result<(Graph, Vec<Refused>), ImportError> {
        let doc = &self.g.doc;
        let params = doc["params"].as_array().cloned().unwrap_or_default();
        let buffers = doc["buffers"].as_array().cloned().unwrap_or_default();
        // `model.to(device)`: each buffer after the parameters registered before it.
        let mut bi = 0;
        let mut place_buffers = |s: &mut Self, placed: usize| -> Result<(), ImportError> {
            while bi < buffers.len() {
                let (i, v) = s.value_decl(&buffers[bi])?;
                if v["after_params"].as_u64().unwrap_or(0) as usize > placed {
                    break;
                }
                let shape = s.shape(&v["shape"])?;
                let dt = dtype_spec(v["dtype"].as_str().unwrap_or("?"))?;
                let t =
                    s.b.buffer(v["name"].as_str().unwrap_or("buffer"), &shape, dt);
                s.vals[i] = Some(t);
                bi += 1;
            }
            Ok(())
        };
        place_buffers(&mut self, 0)?;
        for (n, p) in params.iter().enumerate() {
            let (i, v) = self.value_decl(p)?;
            let shape = self.shape(&v["shape"])?;
            let trainable = v["trainable"].as_bool().unwrap_or(true);
            let t = self
                .b
                .param_with(v["name"].as_str().unwrap_or("param"), &shape, trainable);
            self.vals[i] = Some(t);
            place_buffers(&mut self, n + 1)?;
        }
        place_buffers(&mut self, usize::MAX)?;
        for x in doc["inputs"].as_array().cloned().unwrap_or_default() {
            let (i, v) = self.value_decl(&x)?;
            let shape = self.shape(&v["shape"])?;
            let dt = dtype_spec(v["dtype"].as_str().unwrap_or("?"))?;
            let t = self
                .b
                .input(v["name"].as_str().unwrap_or("input"), &shape, dt);
            self.vals[i] = Some(t);
        }
        let output = doc["output"].as_u64().unwrap_or(u64::MAX) as usize;
        let loss = doc["loss"].as_u64().unwrap_or(u64::MAX) as usize;
        let forward_ops = doc["forward_ops"].as_u64().unwrap_or(0) as usize;
        let ops = self.g.ops();
        // Checkpointable blocks: the contiguous ops of each block module (`blocks`, the repeated
        // children of an nn.Sequential/ModuleList unless `from_module(blocks=...)` named them).
        let in_block = |m: &str, blk: &str| m == blk || m.starts_with(&format!("{blk}."));
        let mut blocks: Vec<(usize, usize, String, Vec<usize>)> = Vec::new();
        for blk in doc["blocks"].as_array().cloned().unwrap_or_default() {
            let path = blk["module"].as_str().unwrap_or("").to_string();
            let idx: Vec<usize> = (0..ops.len())
                .filter(|&k| in_block(ops[k]["module"].as_str().unwrap_or(""), &path))
                .collect();
            let (Some(&first), Some(&last)) = (idx.first(), idx.last()) else {
                continue;
            };
            if path.is_empty() || last + 1 - first != idx.len() || last >= forward_ops {
                return Err(ImportError::Format(format!(
                    "block {path:?} is not one contiguous run of forward calls"
                )));
            }
            let args = id_list(&blk["args"]);
            blocks.push((first, last + 1, path, args));
        }
        blocks.sort();
        let calls: Vec<(usize, usize, Vec<usize>)> = doc["calls"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|c| {
                        let c = c.as_array()?;
                        let held = c.get(2).filter(|h| h.is_array())?;
                        Some((
                            c.first()?.as_u64()? as usize,
                            c.get(1)?.as_u64()? as usize,
                            id_list(held),
                        ))
                    })
                    .collect()
            })
            .unwrap_or_default();
        // Values a Python local holds while a call runs (`held`: `[[call, [ids]]]`).
        let held_by_locals: BTreeMap<usize, Vec<usize>> = doc["held"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|e| {
                        let k = e.get(0)?.as_u64()? as usize;
                        Some((k, id_list(e.get(1)?)))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut open: Option<(usize, String)> = None;
        for (k, op) in ops.iter().enumerate() {
            if let Some((_, _, path, args)) = blocks.iter().find(|b| b.0 == k) {
                if open.is_some() {
                    return Err(ImportError::Format(format!(
                        "block {path:?} is nested in another"
                    )));
                }
                self.b.begin_region(RegionKind::Block, path);
                // `forward(self, x)`: the block's arguments live until it returns.
                for &a in args {
                    let v = self.get(a)?;
                    self.b.hold(v);
                }
                let end = blocks.iter().find(|b| b.0 == k).map_or(k + 1, |b| b.1);
                open = Some((end, path.clone()));
            }
            if k == forward_ops {
                // `output = model(x)` then `loss = loss_fn(output, y)`: the output lives until the
                // loss returns (the loop's local), as the zoo's classifier loss holds it.
                let out = self.get(output)?;
                self.b.keep_output(out);
                self.b.push_module("");
                self.b.hold(out);
            }
            let full = op["module"].as_str().unwrap_or("").to_string();
            // Inside a region the builder's path is the block's: push the rest.
            let module = match &open {
                Some((_, blk)) => full[blk.len()..].trim_start_matches('.').to_string(),
                None => full,
            };
            self.b.push_module(&module);
            let r = self.op(op);
            self.b.pop_module(&module);
            r?;
            // A module call's tensor arguments live until it returns: the caller's frame holds
            // them (`y = self.mlp(y)` rebinds `y` only after the call), whatever the callee does.
            for (_, _, held) in calls.iter().filter(|c| c.1 == k + 1 && c.0 <= k) {
                for &a in held {
                    let v = self.get(a)?;
                    self.b.hold_until_last_op(v);
                }
            }
            for &a in held_by_locals.get(&k).into_iter().flatten() {
                let v = self.get(a)?;
                self.b.hold_until_last_op(v);
            }
            if open.as_ref().is_some_and(|(end, _)| *end == k + 1) {
                self.b.end_region();
                open = None;
            }
        }
        if ops.len() < forward_ops {
            return Err(ImportError::Format(
                "forward_ops is past the last op".into(),
            ));
        }
        if forward_ops < ops.len() {
            self.b.pop_module("");
        }
        let l = self.get(loss)?;
        // What the model returned besides its own loss (`kept`): the loop's name holds it with
        // `--keep-outputs` (`outputs = model(**batch)`, `logits, loss = model(X, Y)`).
        for v in doc["kept"].as_array().into_iter().flatten() {
            let (i, _) = self.value_decl(v)?;
            let t = self.get(i)?;
            self.b.keep_output(t);
        }
        self.b.keep_output(l);
        self.b.set_output(l);
        let refused = std::mem::take(&mut self.refused);
        Ok((self.b.finish()?, refused))
    }

    fn get(&self, i: usize) -> Result<T, ImportError> {
        self.vals
            .get(i)
            .copied()
            .flatten()
            .ok_or_else(|| ImportError::Format(format!("value {i} is used before it is made")))
    }

    /// A call without a rule, lowered from its recording (`"recorded"`, written by the capture
    /// for every call): its inputs (value ids), each output a view of an input or a new tensor,
    /// what autograd saved, whether it made a node. See [`OpKind::Recorded`](crate::ops::OpKind).
    fn recorded_op(
        &mut self,
        name: &str,
        rec: &J,
        outs: &[usize],
        bad: &dyn Fn(String) -> ImportError,
    ) -> Result<Vec<T>, ImportError> {
        let index = |j: &J, n: usize, what: &str| -> Result<usize, ImportError> {
            j.as_u64()
                .map(|i| i as usize)
                .filter(|&i| i < n)
                .ok_or_else(|| bad(format!("recorded {what} {j} is out of range")))
        };
        let mut inputs = Vec::new();
        for v in rec["inputs"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            let i = v
                .as_u64()
                .ok_or_else(|| bad(format!("recorded input {v} is not a value id")))?;
            inputs.push(self.get(i as usize)?);
        }
        let n_in = inputs.len();
        let dtype = |j: &J| -> Result<RecordedDType, ImportError> {
            match j.get("like") {
                Some(l) => Ok(RecordedDType::Like(index(l, n_in, "input")?)),
                None => Ok(RecordedDType::Spec(dtype_spec(
                    j["dtype"].as_str().unwrap_or("?"),
                )?)),
            }
        };
        let mut out_specs = Vec::new();
        let mut view_strides = Vec::new();
        let mut shapes = Vec::new();
        for (k, &o) in outs.iter().enumerate() {
            let decl = self.g.doc["values"]
                .get(o)
                .ok_or_else(|| ImportError::Format(format!("value {o} is not declared")))?;
            let shape = self.shape(&decl["shape"])?;
            let spec = dtype_spec(decl["dtype"].as_str().unwrap_or("?"))?;
            let r = rec["outputs"].get(k).cloned().unwrap_or(J::Null);
            view_strides.push(match r.get("strides") {
                Some(st) => Some(self.shape(st)?),
                None => None,
            });
            let out = match r.get("view") {
                Some(v) if r["inplace"].as_bool() == Some(true) => {
                    RecordedOut::InPlace(index(v, n_in, "input")?)
                }
                Some(v) => RecordedOut::View(index(v, n_in, "input")?),
                None if r.is_object() => RecordedOut::New(dtype(&r)?),
                None => RecordedOut::New(RecordedDType::Spec(spec)),
            };
            // The graph's dtype of the output: the input's for a view or a `like` output.
            let graph_dtype = match &out {
                RecordedOut::View(j)
                | RecordedOut::InPlace(j)
                | RecordedOut::New(RecordedDType::Like(j)) => self.b.dtype(inputs[*j]),
                RecordedOut::New(RecordedDType::Spec(d)) => *d,
            };
            out_specs.push(out);
            shapes.push((shape, graph_dtype));
        }
        let mut saves = Vec::new();
        for sv in rec["saved"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            saves.push(if let Some(j) = sv.get("input") {
                RecordedSave::In(index(j, n_in, "input")?)
            } else if let Some(k) = sv.get("output") {
                RecordedSave::Out(index(k, outs.len(), "output")?)
            } else {
                RecordedSave::New(self.shape(&sv["shape"])?, dtype(sv)?)
            });
        }
        let backward = match rec.get("backward").filter(|b| b.is_object()) {
            None => None,
            Some(bw) => {
                let mut steps = Vec::new();
                let mut allocs = 0;
                for st in bw["steps"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
                    if let Some(k) = st.get("free") {
                        steps.push(RecordedStep::Free(index(k, allocs, "allocation")?));
                    } else {
                        let n = self.shape(&st["alloc"])?;
                        steps.push(RecordedStep::Alloc(n.iter().product(), dtype(st)?));
                        allocs += 1;
                    }
                }
                let mut grads = Vec::new();
                for g in bw["grads"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
                    grads.push(if let Some(k) = g.get("alloc") {
                        Some(RecordedGrad::Alloc(index(k, allocs, "allocation")?))
                    } else if g.get("grad_output").is_some() {
                        Some(RecordedGrad::GradOutput)
                    } else {
                        None
                    });
                }
                Some(RecordedBackward { steps, grads })
            }
        };
        let r = Recorded {
            name: crate::ops::intern(name),
            outs: out_specs,
            view_strides,
            saves,
            grad: rec["grad"].as_bool().unwrap_or(true),
            backward,
            autocast: match rec["autocast"].as_str() {
                Some("lower") => Policy::Lower,
                Some("fp32") => Policy::Fp32,
                Some("promote") => Policy::Promote,
                _ => Policy::None,
            },
        };
        Ok(self.b.recorded(r, &inputs, &shapes))
    }

    /// The op library's rule for one call (or its recording when it has no rule).
    fn rule(&mut self, op: &J) -> Result<Vec<T>, ImportError> {
        let name = op["op"].as_str().unwrap_or("?").to_string();
        let module = op["module"].as_str().unwrap_or("").to_string();
        let args = op["args"].as_array().cloned().unwrap_or_default();
        let kwargs = op["kwargs"].as_object().cloned().unwrap_or_default();
        let outs: Vec<usize> = id_list(&op["outputs"]);
        let bad = |msg: String| ImportError::Arguments {
            op: name.clone(),
            module: module.clone(),
            msg,
        };
        // Argument `i` (positional) or `key` (keyword).
        let arg = |i: usize, key: &str| -> Option<J> {
            args.get(i)
                .cloned()
                .or_else(|| kwargs.get(key).cloned())
                .filter(|v| !v.is_null())
        };
        let at = (self.batch, self.seq);
        let int = |j: &J| int_at(j, at);
        let ints = |j: &J| -> Option<Vec<i64>> {
            match j.as_array() {
                Some(a) => a.iter().map(int).collect(),
                None => int(j).map(|x| vec![x]),
            }
        };
        let pair = |j: Option<J>, default: [u64; 2]| -> Result<[u64; 2], ImportError> {
            match j {
                None => Ok(default),
                Some(j) => match ints(&j).as_deref() {
                    Some([a]) if *a >= 0 => Ok([*a as u64; 2]),
                    Some([a, b]) if *a >= 0 && *b >= 0 => Ok([*a as u64, *b as u64]),
                    _ => Err(bad(format!("expected an int or a pair, got {j}"))),
                },
            }
        };
        // A pooling call's `kernel_size, stride, padding` (arguments 1–3): a missing or empty
        // `stride` is the kernel, as `F.max_pool2d`/`F.avg_pool2d` default it.
        let window = || -> Result<[[u64; 2]; 3], ImportError> {
            let kernel = pair(arg(1, "kernel_size"), [1, 1])?;
            let stride = match arg(2, "stride") {
                Some(j) if !j.as_array().is_some_and(Vec::is_empty) => pair(Some(j), kernel)?,
                _ => kernel,
            };
            Ok([kernel, stride, pair(arg(3, "padding"), [0, 0])?])
        };
        let tensor = |s: &Self, j: Option<J>| -> Result<Option<T>, ImportError> {
            match j {
                None => Ok(None),
                Some(j) => match j.get("t").and_then(J::as_u64) {
                    Some(i) => s.get(i as usize).map(Some),
                    None => Ok(None),
                },
            }
        };
        let need = |s: &Self, i: usize, key: &str| -> Result<T, ImportError> {
            tensor(s, arg(i, key))?.ok_or_else(|| bad(format!("argument {key} is not a tensor")))
        };
        let float_arg = |i: usize, key: &str, default: f64| -> f64 {
            arg(i, key).and_then(|j| j.as_f64()).unwrap_or(default)
        };
        let bool_arg = |i: usize, key: &str, default: bool| -> bool {
            arg(i, key).and_then(|j| j.as_bool()).unwrap_or(default)
        };
        // The rest of the positional arguments from `i` as one int list (`x.view(2, 3)` or
        // `x.view((2, 3))`).
        let rest_ints = |i: usize, key: &str| -> Result<Vec<i64>, ImportError> {
            let j = if args.len() > i + 1 {
                J::Array(args[i..].to_vec())
            } else {
                arg(i, key).ok_or_else(|| bad(format!("missing {key}")))?
            };
            let j = match j.as_array() {
                Some(a) if a.len() == 1 && a[0].is_array() => a[0].clone(),
                _ => j,
            };
            ints(&j).ok_or_else(|| bad(format!("{key} is not a list of ints: {j}")))
        };
        let x0 = || tensor(self, arg(0, "input"));
        let out: Vec<T> = match name.as_str() {
            // transformers' calls (`imported_text.rs`).
            _ if self.claims_text(&name, &args, &outs) => self.text_op(&text::Call {
                name: &name,
                module: &module,
                args: &args,
                kwargs: &kwargs,
                outs: &outs,
            })?,
            "linear" => {
                let x = need(self, 0, "input")?;
                let w = need(self, 1, "weight")?;
                let bias = tensor(self, arg(2, "bias"))?;
                vec![self.b.linear_op(x, w, bias)]
            }
            "conv2d" => {
                let x = need(self, 0, "input")?;
                let w = need(self, 1, "weight")?;
                let bias = tensor(self, arg(2, "bias"))?;
                if arg(4, "padding").is_some_and(|p| p.is_string()) {
                    return Err(bad("padding given as a string is not modelled".into()));
                }
                let stride = pair(arg(3, "stride"), [1, 1])?;
                let padding = pair(arg(4, "padding"), [0, 0])?;
                let dilation = pair(arg(5, "dilation"), [1, 1])?;
                let groups = arg(6, "groups").and_then(|j| int(&j)).unwrap_or(1).max(1) as u64;
                vec![self
                    .b
                    .conv2d_op(x, w, bias, stride, padding, dilation, groups)]
            }
            "batch_norm" => {
                let x = need(self, 0, "input")?;
                let rm = need(self, 1, "running_mean")?;
                let rv = need(self, 2, "running_var")?;
                let w = need(self, 3, "weight")?;
                let bias = need(self, 4, "bias")?;
                if !bool_arg(5, "training", false) {
                    return Err(bad("batch_norm in eval mode is not modelled".into()));
                }
                vec![self.b.batch_norm_op(x, w, bias, rm, rv)]
            }
            "relu" | "relu_" => {
                let x = need(self, 0, "input")?;
                if name == "relu_" || bool_arg(1, "inplace", false) {
                    vec![self.b.relu_(x)]
                } else {
                    vec![self.b.relu(x)]
                }
            }
            // `nn.ReLU6` / `nn.Hardtanh` call `F.hardtanh(input, min_val, max_val, inplace)`
            // (torch/nn/functional.py), which runs `hardtanh_` when `inplace`.
            "hardtanh" | "hardtanh_" => {
                let x = need(self, 0, "input")?;
                if name == "hardtanh_" || bool_arg(3, "inplace", false) {
                    vec![self.b.hardtanh_(x)]
                } else {
                    vec![self.b.hardtanh(x)]
                }
            }
            // `nn.MultiheadAttention.forward` in training (its fast path is inference-only) with
            // `query is key is value` (self-attention), torch/nn/functional.py: only the
            // packed-projection, mask-free, `need_weights=False` path that calls
            // `F.scaled_dot_product_attention` is modelled — the zoo ViT's, shared with it.
            "multi_head_attention_forward" => {
                let id = |i: usize, key: &str| arg(i, key).and_then(|j| j.get("t").cloned());
                if id(1, "key") != id(0, "query") || id(2, "value") != id(0, "query") {
                    return Err(bad(
                        "only self-attention (query, key and value the same tensor) is modelled"
                            .into(),
                    ));
                }
                let q0 = need(self, 0, "query")?;
                let heads = arg(4, "num_heads")
                    .and_then(|j| int(&j))
                    .filter(|&h| h > 0)
                    .ok_or_else(|| bad("num_heads is not a positive int".into()))?
                    as u64;
                let w = need(self, 5, "in_proj_weight")?;
                let in_bias = need(self, 6, "in_proj_bias")?;
                let out_w = need(self, 11, "out_proj_weight")?;
                let out_b = tensor(self, arg(12, "out_proj_bias"))?;
                for (i, key) in [
                    (7, "bias_k"),
                    (8, "bias_v"),
                    (14, "key_padding_mask"),
                    (16, "attn_mask"),
                    (18, "q_proj_weight"),
                    (21, "static_k"),
                    (22, "static_v"),
                ] {
                    if arg(i, key).is_some() {
                        return Err(bad(format!("{key} is not modelled (only None)")));
                    }
                }
                for (i, key, modelled) in [
                    (9, "add_zero_attn", false),
                    (15, "need_weights", false),
                    (17, "use_separate_proj_weight", false),
                    (24, "is_causal", false),
                ] {
                    if bool_arg(i, key, !modelled) != modelled {
                        return Err(bad(format!("{key}={} is not modelled", !modelled)));
                    }
                }
                let training = bool_arg(13, "training", true);
                // `if not training: dropout_p = 0.0`.
                let dropout = if training {
                    float_arg(10, "dropout_p", 0.0)
                } else {
                    0.0
                };
                let s = self.b.shape(q0);
                if s.len() != 3 || !s[2].is_multiple_of(heads) {
                    return Err(bad(format!(
                        "query {s:?} is not (L, N, E) with E divisible by {heads} heads"
                    )));
                }
                let default = Recipe::new(self.batch, 0);
                let r = self.recipe.as_ref().unwrap_or(&default);
                let call = mha_sdpa_call(r, [s[0], s[1], s[2]], heads, dropout);
                let backend = sdpa::choose(r.attention, &call, r.target)
                    .map_err(|e| bad(e.to_string()))?
                    .backend;
                vec![crate::zoo::vit::multi_head_attention_forward(
                    &mut self.b,
                    q0,
                    heads,
                    w,
                    in_bias,
                    dropout,
                    backend,
                    |b, o| b.linear_op(o, out_w, out_b),
                )]
            }
            // `x[idx]` with ints (select) and slices of step 1 (slice), e.g. ViT's `x[:, 0]`.
            "__getitem__" => {
                let mut x = need(self, 0, "self")?;
                let idx = arg(1, "index").unwrap_or(J::Null);
                let items = match idx {
                    J::Array(a) => a,
                    other => vec![other],
                };
                let mut dim = 0usize;
                for it in &items {
                    let shape = self.b.shape(x);
                    let size = *shape.get(dim).ok_or_else(|| {
                        // Named by what is wrong, not by value (the reason groups the calls).
                        bad(if items.iter().any(J::is_null) {
                            "`None` is not modelled (ints and slices)".to_string()
                        } else {
                            format!(
                                "an index of more entries than a {}-D tensor has dims",
                                shape.len()
                            )
                        })
                    })? as i64;
                    if let Some(i) = int(it) {
                        let i = if i < 0 { i + size } else { i };
                        if !(0..size).contains(&i) {
                            return Err(bad(format!(
                                "index {i} is out of dim {dim} of size {size}"
                            )));
                        }
                        x = self.b.select(x, dim as isize, i as u64);
                    } else if let Some([start, stop, step]) =
                        it.get("slice").and_then(J::as_array).map(Vec::as_slice)
                    {
                        let bound = |j: &J, default: i64| -> Option<i64> {
                            if j.is_null() {
                                return Some(default);
                            }
                            let v = int(j)?;
                            Some((if v < 0 { v + size } else { v }).clamp(0, size))
                        };
                        let (a, z) = (bound(start, 0), bound(stop, size));
                        let unit = step.is_null() || int(step) == Some(1);
                        match (a, z, unit) {
                            (Some(0), Some(z), true) if z == size => {}
                            (Some(a), Some(z), true) => {
                                x = self.b.slice(x, dim as isize, a as u64, z.max(a) as u64)
                            }
                            _ => {
                                return Err(bad(format!(
                                    "slice {it} is not modelled (int bounds, step 1)"
                                )))
                            }
                        }
                        dim += 1;
                    } else {
                        // Named by kind, not by value (the reason groups the calls it refuses).
                        let kind = if it.get("t").is_some() {
                            "a tensor index".to_string()
                        } else if it.get("other").and_then(J::as_str) == Some("ellipsis") {
                            "`...`".to_string()
                        } else if it.is_null() {
                            "`None`".to_string()
                        } else {
                            format!("index entry {it}")
                        };
                        return Err(bad(format!("{kind} is not modelled (ints and slices)")));
                    }
                }
                vec![x]
            }
            // torchvision.ops.stochastic_depth in training (`noise = torch.empty(size,
            // dtype=input.dtype)`, `noise.bernoulli_(survival_rate)`, `noise.div_(survival_rate)`,
            // `input * noise`): the empty tensor is an allocation outside autograd; bernoulli_ and
            // div_ by a scalar write into it (no allocation, no autograd node).
            "empty" => {
                let shape = rest_ints(0, "size")?;
                if shape.iter().any(|&d| d < 0) {
                    return Err(bad(format!("negative size {shape:?}")));
                }
                let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
                let dt = match kwargs.get("dtype") {
                    None | Some(J::Null) => DTypeSpec::Model,
                    Some(d) if d["model"].as_bool() == Some(true) => DTypeSpec::Model,
                    Some(d) => dtype_spec(d["dtype"].as_str().unwrap_or("?"))?,
                };
                // `dtype=input.dtype` of the enclosing module's input (the capture names it,
                // `"like"`): the dtype that input has when the step runs, 16-bit under autocast
                // where the parameters stay float32.
                let like = kwargs
                    .get("dtype")
                    .and_then(|d| d.get("like"))
                    .and_then(J::as_u64);
                let t = match like {
                    Some(v) => {
                        let input = self.get(v as usize)?;
                        let rec = Recorded {
                            name: "aten.empty",
                            outs: vec![RecordedOut::New(RecordedDType::Like(0))],
                            view_strides: vec![],
                            saves: vec![],
                            grad: false,
                            backward: None,
                            autocast: Policy::None,
                        };
                        self.b.recorded(rec, &[input], &[(shape, dt)])[0]
                    }
                    None => self.b.factory("aten.empty", &[], &shape, dt, vec![]),
                };
                self.no_grad.insert(t);
                vec![t]
            }
            "bernoulli_" | "div_" => {
                let x = need(self, 0, "self")?;
                if !self.no_grad.contains(&x) {
                    return Err(bad(
                        "in place on a tensor other than a fresh torch.empty is not modelled"
                            .into(),
                    ));
                }
                if name == "div_" && tensor(self, arg(1, "other"))?.is_some() {
                    return Err(bad("div_ by a tensor is not modelled".into()));
                }
                vec![x]
            }
            "gelu" => {
                let x = need(self, 0, "input")?;
                let tanh = arg(1, "approximate").and_then(|j| j.as_str().map(|s| s == "tanh"));
                vec![self.b.gelu(x, tanh.unwrap_or(false))]
            }
            "silu" | "tanh" | "sigmoid" | "float" | "contiguous" | "t" => {
                let x = need(self, 0, "input")?;
                let inplace = name == "silu" && bool_arg(1, "inplace", false);
                vec![match name.as_str() {
                    "silu" if inplace => self.b.silu_(x),
                    "silu" => self.b.silu(x),
                    "tanh" => self.b.tanh(x),
                    "sigmoid" => self.b.sigmoid(x),
                    "float" => self.b.to_dtype(x, DType::F32),
                    "contiguous" => self.b.contiguous(x),
                    _ => self.b.t(x),
                }]
            }
            "layer_norm" => {
                let x = need(self, 0, "input")?;
                let w = need(self, 2, "weight")?;
                let bias = tensor(self, arg(3, "bias"))?;
                vec![self.b.layer_norm_op_opt(x, w, bias)]
            }
            "softmax" | "log_softmax" => {
                let x = need(self, 0, "input")?;
                let dim = arg(1, "dim")
                    .and_then(|j| int(&j))
                    .ok_or_else(|| bad("softmax without dim".into()))?;
                let f32 = arg(3, "dtype").and_then(|j| j.get("dtype").cloned());
                if name == "softmax" {
                    let to_f32 = f32.as_ref().and_then(J::as_str) == Some("float32");
                    vec![self.b.softmax(x, dim as isize, to_f32)]
                } else {
                    vec![self.b.log_softmax(x, dim as isize)]
                }
            }
            "dropout" => {
                let x = need(self, 0, "input")?;
                let p = float_arg(1, "p", 0.5);
                let training = bool_arg(2, "training", true);
                // ATen `_dropout_impl`: `if (p == 0 || !train || input.numel() == 0) return input`.
                // `inplace=True` runs `_VF.dropout_` (torch/nn/functional.py), which is never the
                // fused kernel (see `OpKind::DropoutInplace`).
                if p == 0.0 || !training {
                    vec![x]
                } else if bool_arg(3, "inplace", false) {
                    vec![self.b.dropout_(x, p)]
                } else {
                    vec![self.b.dropout(x, p)]
                }
            }
            // `nn.Hardswish` / `nn.Hardsigmoid` call `F.hardswish(input, inplace)` /
            // `F.hardsigmoid(input, inplace)`, which run `hardswish_` / `hardsigmoid_` when
            // `inplace` (torch/nn/functional.py).
            "hardswish" | "hardsigmoid" => {
                let x = need(self, 0, "input")?;
                let inplace = bool_arg(1, "inplace", false);
                vec![match (name.as_str(), inplace) {
                    ("hardswish", false) => self.b.hardswish(x),
                    ("hardswish", true) => self.b.hardswish_(x),
                    (_, false) => self.b.hardsigmoid(x),
                    (_, true) => self.b.hardsigmoid_(x),
                }]
            }
            // `x.chunk(n, dim)` (ShuffleNetV2's `x.chunk(2, dim=1)`): ATen `chunk` splits into
            // pieces of `ceil(size / n)` (the last one shorter), views (`split_with_sizes`).
            "chunk" => {
                let x = need(self, 0, "input")?;
                let n = arg(1, "chunks")
                    .and_then(|j| int(&j))
                    .filter(|&c| c > 0)
                    .ok_or_else(|| bad("chunks is not a positive int".into()))?
                    as u64;
                let dim = arg(2, "dim").and_then(|j| int(&j)).unwrap_or(0);
                let s = self.b.shape(x);
                let d = if dim < 0 { dim + s.len() as i64 } else { dim };
                let size = *s
                    .get(d.max(0) as usize)
                    .filter(|_| d >= 0)
                    .ok_or_else(|| bad(format!("dim {dim} of a {}-D tensor", s.len())))?;
                let piece = size.div_ceil(n).max(1);
                let mut sizes = Vec::new();
                let mut left = size;
                while left > 0 {
                    sizes.push(piece.min(left));
                    left -= piece.min(left);
                }
                self.b.split(x, &sizes, d as isize)
            }
            "embedding" => {
                let ids = need(self, 0, "input")?;
                let w = need(self, 1, "weight")?;
                vec![self.b.embedding_op(w, ids)]
            }
            "add" | "__add__" | "__radd__" | "sub" | "__sub__" | "mul" | "__mul__" | "__rmul__"
            | "div" | "__truediv__" => {
                let a = need(self, 0, "input")?;
                if arg(2, "alpha").is_some() {
                    return Err(bad("alpha is not modelled".into()));
                }
                match tensor(self, arg(1, "other"))? {
                    Some(o) => vec![match name.trim_matches('_') {
                        "add" | "radd" => self.b.add(a, o),
                        "sub" => self.b.sub(a, o),
                        "mul" | "rmul" => self.b.mul(a, o),
                        _ => self.b.div(a, o),
                    }],
                    None => vec![match name.trim_matches('_') {
                        "add" | "radd" => self.b.add_scalar(a),
                        "sub" => self.b.add_scalar(a),
                        "mul" | "rmul" => self.b.mul_scalar(a),
                        _ => self.b.div_scalar(a),
                    }],
                }
            }
            "add_" | "__iadd__" => {
                let a = need(self, 0, "input")?;
                match tensor(self, arg(1, "other"))? {
                    Some(o) => vec![self.b.add_(a, o)],
                    // `self.num_batches_tracked.add_(1)` (`_BatchNorm.forward`): in place on a
                    // buffer, a kernel on existing storage: nothing allocated, nothing saved.
                    None if !self.b.g_value_differentiable(a) => vec![a],
                    None => {
                        return Err(bad(
                            "in-place add of a scalar to a float tensor is not modelled".into(),
                        ))
                    }
                }
            }
            "view" | "reshape" => {
                let x = need(self, 0, "input")?;
                let shape = rest_ints(1, "shape")?;
                vec![if name == "view" {
                    self.b.view(x, &shape)
                } else {
                    self.b.reshape(x, &shape)
                }]
            }
            "flatten" => {
                let x = need(self, 0, "input")?;
                let start = arg(1, "start_dim").and_then(|j| int(&j)).unwrap_or(0);
                let end = arg(2, "end_dim").and_then(|j| int(&j)).unwrap_or(-1);
                let s = self.b.shape(x);
                let n = s.len() as i64;
                let (st, en) = (
                    if start < 0 { start + n } else { start },
                    if end < 0 { end + n } else { end },
                );
                if st < 0 || en >= n || st > en {
                    return Err(bad(format!("dims {start}..{end} of a {n}-D tensor")));
                }
                if en == n - 1 {
                    vec![self.b.flatten(x, st as usize)]
                } else {
                    let (st, en) = (st as usize, en as usize);
                    let mut shape: Vec<i64> = s[..st].iter().map(|&d| d as i64).collect();
                    shape.push(s[st..=en].iter().product::<u64>() as i64);
                    shape.extend(s[en + 1..].iter().map(|&d| d as i64));
                    vec![self.b.reshape(x, &shape)]
                }
            }
            "permute" => {
                let x = need(self, 0, "input")?;
                let n = self.b.shape(x).len() as i64;
                let dims = rest_ints(1, "dims")?;
                let dims: Vec<usize> = dims
                    .iter()
                    .map(|&d| if d < 0 { d + n } else { d } as usize)
                    .collect();
                vec![self.b.permute(x, &dims)]
            }
            "transpose" => {
                let x = need(self, 0, "input")?;
                let d0 = arg(1, "dim0").and_then(|j| int(&j)).unwrap_or(0);
                let d1 = arg(2, "dim1").and_then(|j| int(&j)).unwrap_or(1);
                vec![self.b.transpose(x, d0 as isize, d1 as isize)]
            }
            "unsqueeze" => {
                let x = need(self, 0, "input")?;
                let n = self.b.shape(x).len() as i64 + 1;
                let d = arg(1, "dim").and_then(|j| int(&j)).unwrap_or(0);
                vec![self.b.unsqueeze(x, if d < 0 { d + n } else { d } as usize)]
            }
            "expand" => {
                let x = need(self, 0, "input")?;
                let sizes = rest_ints(1, "size")?;
                let s = self.b.shape(x);
                let off = sizes.len().saturating_sub(s.len());
                let shape: Vec<u64> = sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &d)| {
                        if d < 0 {
                            s.get(i.wrapping_sub(off)).copied().unwrap_or(1)
                        } else {
                            d as u64
                        }
                    })
                    .collect();
                vec![self.b.expand(x, &shape)]
            }
            "cat" => {
                let list = arg(0, "tensors")
                    .and_then(|j| j.as_array().cloned())
                    .ok_or_else(|| bad("cat without a list of tensors".into()))?;
                let mut xs = Vec::new();
                for j in list {
                    xs.push(
                        tensor(self, Some(j))?.ok_or_else(|| bad("cat of a non-tensor".into()))?,
                    );
                }
                let dim = arg(1, "dim").and_then(|j| int(&j)).unwrap_or(0);
                vec![self.b.cat(&xs, dim as isize)]
            }
            "matmul" | "__matmul__" | "mm" | "bmm" => {
                let a = need(self, 0, "input")?;
                let o = need(self, 1, "other").or_else(|_| need(self, 1, "mat2"))?;
                vec![match name.as_str() {
                    "mm" => self.b.mm(a, o),
                    "bmm" => self.b.bmm(a, o),
                    _ => self.b.matmul(a, o),
                }]
            }
            "max_pool2d" | "_max_pool2d" => {
                let x = need(self, 0, "input")?;
                let [kernel, stride, padding] = window()?;
                if pair(arg(4, "dilation"), [1, 1])? != [1, 1]
                    || bool_arg(6, "return_indices", false)
                {
                    return Err(bad("dilation or return_indices are not modelled".into()));
                }
                let ceil = bool_arg(5, "ceil_mode", false);
                vec![self.b.max_pool2d_ceil(x, kernel, stride, padding, ceil)]
            }
            // `F.avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False,
            // count_include_pad=True, divisor_override=None)`: the last two change no memory.
            "avg_pool2d" => {
                let x = need(self, 0, "input")?;
                let [kernel, stride, padding] = window()?;
                let ceil = bool_arg(4, "ceil_mode", false);
                vec![self.b.avg_pool2d(x, kernel, stride, padding, ceil)]
            }
            "adaptive_avg_pool2d" => {
                let x = need(self, 0, "input")?;
                let o = pair(arg(1, "output_size"), [1, 1])?;
                vec![self.b.adaptive_avg_pool2d(x, o)]
            }
            "mean" => {
                let x = need(self, 0, "input")?;
                if arg(3, "dtype").is_some() {
                    return Err(bad("mean(dtype=...) is not modelled".into()));
                }
                let keep = bool_arg(2, "keepdim", false);
                let n = self.b.shape(x).len() as isize;
                match arg(1, "dim") {
                    None => {
                        let all: Vec<isize> = (0..n).collect();
                        vec![self.b.mean_dims(x, &all, false)]
                    }
                    Some(j) => {
                        let dims = ints(&j).ok_or_else(|| bad(format!("dim {j}")))?;
                        if dims.len() == 1 && !j.is_array() {
                            vec![self.b.mean_dim(x, dims[0] as isize, keep)]
                        } else {
                            let d: Vec<isize> = dims.iter().map(|&d| d as isize).collect();
                            vec![self.b.mean_dims(x, &d, keep)]
                        }
                    }
                }
            }
            "cross_entropy" | "nll_loss" | "mse_loss" => {
                let x = need(self, 0, "input")?;
                let y = need(self, 1, "target")?;
                let reduction = arg(6, "reduction")
                    .or_else(|| kwargs.get("reduction").cloned())
                    .and_then(|j| j.as_str().map(str::to_string))
                    .unwrap_or_else(|| "mean".into());
                let weight = if name == "mse_loss" {
                    None
                } else {
                    arg(2, "weight")
                };
                let smoothing = kwargs
                    .get("label_smoothing")
                    .and_then(J::as_f64)
                    .unwrap_or(0.0);
                if reduction != "mean" || weight.is_some() || smoothing != 0.0 {
                    return Err(bad(
                        "only reduction='mean' without class weights or label smoothing is modelled".into(),
                    ));
                }
                vec![match name.as_str() {
                    "cross_entropy" => self.b.cross_entropy(x, y),
                    "nll_loss" => self.b.nll_loss(x, y),
                    _ => self.b.mse_loss(x, y),
                }]
            }
            _ => match op.get("recorded") {
                Some(rec) if rec.is_object() => self.recorded_op(&name, rec, &outs, &bad)?,
                _ => {
                    let _ = x0()?;
                    return Err(ImportError::Unsupported(vec![(
                        name.clone(),
                        module.clone(),
                        1,
                    )]));
                }
            },
        };
        Ok(out)
    }

    /// One call of the document: its rule, or — without a rule, or with arguments the rule does
    /// not model — the capture's recording of it; then its outputs checked against the capture's
    /// shapes.
    fn op(&mut self, op: &J) -> Result<(), ImportError> {
        let name = op["op"].as_str().unwrap_or("?").to_string();
        let module = op["module"].as_str().unwrap_or("").to_string();
        let outs: Vec<usize> = id_list(&op["outputs"]);
        let bad = |msg: String| ImportError::Arguments {
            op: name.clone(),
            module: module.clone(),
            msg,
        };
        let out = match (self.rule(op), op.get("recorded").filter(|r| r.is_object())) {
            (Err(ImportError::Arguments { msg, .. }), Some(rec)) => {
                self.refused.push((name.clone(), module.clone(), msg));
                self.recorded_op(&name, rec, &outs, &bad)?
            }
            (r, _) => r?,
        };
        if out.len() != outs.len() {
            return Err(bad(format!(
                "the rule gives {} outputs, the capture {}",
                out.len(),
                outs.len()
            )));
        }
        for (&i, &t) in outs.iter().zip(&out) {
            let decl = self.g.doc["values"]
                .get(i)
                .ok_or_else(|| ImportError::Format(format!("value {i} is not declared")))?;
            let want = self.shape(&decl["shape"])?;
            let got = self.b.shape(t);
            if want != got {
                return Err(bad(format!(
                    "the op library gives shape {got:?}, PyTorch gave {want:?}"
                )));
            }
            if let Some(slot) = self.vals.get_mut(i) {
                *slot = Some(t);
            }
        }
        Ok(())
    }
}
