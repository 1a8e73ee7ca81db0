//! `--lora r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj`: PEFT's LoRA on linear layers.
//!
//! PEFT (`peft/tuners/lora/layer.py`, `Linear.forward`, unmerged, one adapter):
//! `result = base_layer(x)`; `x = self._cast_input_dtype(x, lora_A.weight.dtype)` (a copy only
//! if the dtypes differ); `result = result + lora_B(lora_A(dropout(x))) * scaling`;
//! `result = result.to(torch_result_dtype)`. `lora_A = nn.Linear(in, r, bias=False)`,
//! `lora_B = nn.Linear(r, out, bias=False)`, `lora_dropout = nn.Dropout(p)` (`nn.Identity` for
//! p = 0), `scaling = lora_alpha / r`. `get_peft_model` freezes every other parameter
//! (`bias="none"`), and `PeftModel.__init__`'s `cast_adapter_dtype` (`autocast_adapter_dtype=True`)
//! keeps the adapter weights in float32 on a 16-bit model.
//!
//! The rewrite appends those ops after each target layer's own and hands the layer's users the
//! new result.

use super::freeze::condense;
use super::lora_tp::TpSide;
use super::FinetuneError;
use crate::dtype::DType;
use crate::graph::{DTypeSpec, Graph, GraphBuilder, OpId, Source, ValueId};
use crate::ops::OpKind;
use crate::zoo::tp::TpPlan;
use std::collections::HashMap;

/// Which linear layers get adapters.
#[derive(Clone, Debug, PartialEq)]
pub enum LoraTargets {
    /// PEFT's `target_modules="all-linear"` (`_maybe_include_all_linear_layers`): every
    /// `nn.Linear` / `Conv1D` but the output embedding (`get_output_embeddings()`, `lm_head`).
    AllLinear,
    /// Module names: a layer matches if its path equals a name or ends with `.name` (PEFT's
    /// `check_target_module_exists`).
    Names(Vec<String>),
}

/// A LoRA configuration (PEFT's `LoraConfig`).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// Rank `r` (PEFT's default 8).
    pub r: u64,
    /// `lora_alpha` (PEFT's default 8); scaling is `alpha / r`.
    pub alpha: f64,
    /// `lora_dropout` (PEFT's default 0: `nn.Identity`).
    pub dropout: f64,
    /// `target_modules`.
    pub targets: LoraTargets,
    /// The adapters' dtype: float32 (PEFT's `autocast_adapter_dtype=True`) unless `None` (the
    /// model's dtype: `autocast_adapter_dtype=False`, or torchtune / LitGPT, which keep LoRA
    /// weights in the model's dtype).
    pub dtype: Option<DType>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            r: 8,
            alpha: 8.0,
            dropout: 0.0,
            targets: LoraTargets::Names(vec!["q_proj".into(), "v_proj".into()]),
            dtype: Some(DType::F32),
        }
    }
}

impl std::str::FromStr for LoraConfig {
    type Err = String;

    /// `r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj,dtype=model`: the keys in any order; the
    /// names after `targets=` run until the next `key=`; `targets=all-linear`; `dtype=fp32|model`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut c = LoraConfig::default();
        let mut alpha_given = false;
        let mut targets: Option<Vec<String>> = None;
        let mut key = String::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let val = match part.split_once('=') {
                Some((k, v)) => {
                    key = k.trim().to_string();
                    v.trim()
                }
                None if key == "targets" => part,
                None => {
                    return Err(format!(
                        "{part:?}: expected key=value (keys: r, alpha, dropout, targets, dtype)"
                    ))
                }
            };
            match key.as_str() {
                "r" | "rank" => {
                    c.r = val
                        .parse::<i64>()
                        .ok()
                        .filter(|&r| r > 0)
                        .ok_or_else(|| format!("r={val}: the rank must be an integer ≥ 1"))?
                        as u64
                }
                "alpha" | "lora_alpha" => {
                    c.alpha = val
                        .parse()
                        .map_err(|_| format!("alpha={val}: not a number"))?;
                    alpha_given = true;
                }
                "dropout" | "lora_dropout" => {
                    c.dropout = val
                        .parse::<f64>()
                        .ok()
                        .filter(|p| (0.0..1.0).contains(p))
                        .ok_or_else(|| format!("dropout={val}: must be in [0, 1)"))?
                }
                "targets" | "target_modules" => {
                    targets.get_or_insert_with(Vec::new).push(val.into())
                }
                "dtype" => {
                    c.dtype = match val {
                        "fp32" | "float32" => Some(DType::F32),
                        "model" => None,
                        _ => {
                            return Err(format!("dtype={val}: use fp32 (PEFT's default) or model"))
                        }
                    }
                }
                _ => {
                    return Err(format!(
                        "unknown key {key:?}: use r, alpha, dropout, targets, dtype"
                    ))
                }
            }
        }
        if !alpha_given {
            // PEFT's LoraConfig default lora_alpha is 8 whatever r is.
            c.alpha = 8.0;
        }
        if let Some(t) = targets {
            c.targets = if t.len() == 1 && t[0].eq_ignore_ascii_case("all-linear") {
                LoraTargets::AllLinear
            } else {
                LoraTargets::Names(t)
            };
        }
        Ok(c)
    }
}

impl std::fmt::Display for LoraConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = match &self.targets {
            LoraTargets::AllLinear => "all-linear".to_string(),
            LoraTargets::Names(n) => n.join(","),
        };
        write!(
            f,
            "r={},alpha={},dropout={},targets={t}",
            self.r, self.alpha, self.dropout
        )?;
        if self.dtype.is_none() {
            write!(f, ",dtype=model")?;
        }
        Ok(())
    }
}

/// A linear layer of a graph (`nn.Linear` or HF `Conv1D`).
#[derive(Clone, Debug, PartialEq)]
pub struct LinearLayer {
    /// Module path.
    pub path: String,
    /// `in_features`.
    pub in_features: u64,
    /// `out_features`.
    pub out_features: u64,
    /// Index of its weight in [`Graph::params`].
    pub weight: usize,
    /// Its ops: `[first, last]` in program order.
    pub ops: (usize, usize),
}

impl LinearLayer {
    /// The layer's input (the first value its ops read that they did not make and that is not a
    /// parameter) and its output (the last op's first output) in `g`; `None` without such an input.
    pub fn input_output(&self, g: &Graph) -> Option<(ValueId, ValueId)> {
        let range = self.ops.0..=self.ops.1;
        let made_here = |v: ValueId| match g.values[v.0 as usize].source {
            Source::Op { op, .. } => range.contains(&(op.0 as usize)),
            _ => false,
        };
        let x = g.ops[self.ops.0..=self.ops.1]
            .iter()
            .flat_map(|o| o.inputs.iter().copied())
            .find(|&v| {
                !made_here(v) && !matches!(g.values[v.0 as usize].source, Source::Param(_))
            })?;
        let y = *g.ops[self.ops.1].outputs.first()?;
        Some((x, y))
    }
}

/// The linear layers of `g`, in program order: modules with a 2-D `weight` parameter that a
/// matrix multiply (`mm`/`addmm`) of the module consumes (directly: HF `Conv1D`'s `[in, out]`
/// weight; or transposed: `nn.Linear`'s `[out, in]`). Embeddings and convolutions are not.
pub fn linear_modules(g: &Graph) -> Vec<LinearLayer> {
    let by_value: HashMap<ValueId, usize> = g
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| (p.value, i))
        .collect();
    let mut ranges: HashMap<u32, (usize, usize)> = HashMap::new();
    for (i, op) in g.ops.iter().enumerate() {
        let e = ranges.entry(op.module.0).or_insert((i, i));
        e.1 = i;
    }
    let mut out = Vec::new();
    for (m, path) in g.modules.iter().enumerate() {
        let Some(&(first, last)) = ranges.get(&(m as u32)) else {
            continue;
        };
        let ops = &g.ops[first..=last];
        if ops.iter().any(|o| o.module.0 as usize != m) {
            continue;
        }
        // A bitsandbytes layer ([`crate::finetune::quant`]): its op knows its features.
        if let Some(op) = ops
            .iter()
            .find(|o| matches!(o.kind, OpKind::QuantLinear { .. }))
        {
            if let (
                OpKind::QuantLinear {
                    in_features,
                    out_features,
                    ..
                },
                Some(&Source::Param(w)),
            ) = (
                &op.kind,
                op.inputs.get(1).map(|v| &g.values[v.0 as usize].source),
            ) {
                out.push(LinearLayer {
                    path: path.clone(),
                    in_features: *in_features,
                    out_features: *out_features,
                    weight: w,
                    ops: (first, last),
                });
            }
            continue;
        }
        // The weight: a parameter `<path>.weight` of 2 dims.
        let Some(w) = g
            .params
            .iter()
            .position(|p| p.name == format!("{path}.weight") && p.shape.len() == 2)
        else {
            continue;
        };
        // Follows autocast casts and transposes of the weight to a mm/addmm.
        let mut derived = vec![g.params[w].value];
        let mut transposed = false;
        let mut found = false;
        for op in ops {
            if !op.inputs.iter().any(|v| derived.contains(v)) {
                continue;
            }
            match op.kind {
                OpKind::AutocastLower => derived.push(op.outputs[0]),
                OpKind::T | OpKind::Transpose(..) => {
                    transposed = true;
                    derived.push(op.outputs[0]);
                }
                OpKind::Mm | OpKind::Addmm => found = true,
                _ => {}
            }
        }
        if !found || !by_value.contains_key(&g.params[w].value) {
            continue;
        }
        let s = &g.params[w].shape;
        let (in_features, out_features) = if transposed {
            (s[1], s[0])
        } else {
            (s[0], s[1])
        };
        out.push(LinearLayer {
            path: path.clone(),
            in_features,
            out_features,
            weight: w,
            ops: (first, last),
        });
    }
    out.sort_by_key(|l| l.ops.0);
    out
}

/// The output embedding PEFT's `all-linear` leaves out (`get_output_embeddings()` of the
/// transformers models of the zoo: `lm_head`, BERT's `cls.predictions.decoder`).
pub(crate) fn is_output_embedding(path: &str) -> bool {
    path == "lm_head" || path == "cls.predictions.decoder"
}

/// The layers `cfg` targets, or an error naming a target that matches nothing.
pub fn targets(g: &Graph, cfg: &LoraConfig) -> Result<Vec<LinearLayer>, FinetuneError> {
    let all = linear_modules(g);
    if all.is_empty() {
        return Err(FinetuneError::NoLinear {
            model: g.name.clone(),
            what: "--lora".into(),
        });
    }
    let listing = || condense(all.iter().map(|l| l.path.clone()));
    match &cfg.targets {
        LoraTargets::AllLinear => Ok(all
            .iter()
            .filter(|l| !is_output_embedding(&l.path))
            .cloned()
            .collect()),
        LoraTargets::Names(names) => {
            let hit = |l: &LinearLayer, n: &str| l.path == n || l.path.ends_with(&format!(".{n}"));
            for n in names {
                if !all.iter().any(|l| hit(l, n)) {
                    return Err(FinetuneError::LoraNoTarget {
                        model: g.name.clone(),
                        target: n.clone(),
                        linear: listing(),
                    });
                }
            }
            Ok(all
                .into_iter()
                .filter(|l| names.iter().any(|n| hit(l, n)))
                .collect())
        }
    }
}

/// Wraps the target layers of `g` in LoRA adapters and freezes every other parameter.
pub fn apply_lora(g: Graph, cfg: &LoraConfig) -> Result<Graph, FinetuneError> {
    apply_lora_tp(g, cfg, TpPlan::NONE)
}

/// [`apply_lora`] on one rank of a tensor-parallel split (`plan`): PEFT's adapters when the
/// model is whole, Megatron-Bridge's `ParallelLinearAdapter` on the tensor-parallel layers when
/// it is split ([`super::lora_tp`]).
pub fn apply_lora_tp(g: Graph, cfg: &LoraConfig, plan: TpPlan) -> Result<Graph, FinetuneError> {
    let layers: Vec<(LinearLayer, Option<TpSide>)> = if plan.on() {
        super::lora_tp::targets(&g, cfg, plan)?
            .into_iter()
            .map(|(l, s)| (l, Some(s)))
            .collect()
    } else {
        targets(&g, cfg)?.into_iter().map(|l| (l, None)).collect()
    };
    let n_ops = g.ops.len();
    let n_params = g.params.len();
    let mut b = GraphBuilder::resume(g);
    for p in b.params_mut() {
        p.trainable = false;
    }
    let adapter = match cfg.dtype {
        Some(d) => DTypeSpec::Fixed(d),
        None => DTypeSpec::Model,
    };
    // (last op of the base layer, its output, the new result, first and one-past-last new op,
    // first and one-past-last new parameter, the base layer's last parameter).
    struct Insert {
        after_op: usize,
        y: ValueId,
        y_new: ValueId,
        ops: (usize, usize),
        params: (usize, usize),
        after_param: usize,
    }
    let mut inserts = Vec::new();
    for (l, side) in &layers {
        let g = b.graph();
        let Some((x, y)) = l.input_output(g) else {
            continue;
        };
        let after_param = g
            .params
            .iter()
            .rposition(|p| p.name.starts_with(&format!("{}.", l.path)))
            .unwrap_or(l.weight);
        let quant = g.ops[l.ops.0..=l.ops.1].iter().find_map(|o| match o.kind {
            OpKind::QuantLinear { quant, .. } => Some(quant),
            _ => None,
        });
        let (op0, p0) = (g.ops.len(), g.params.len());
        if let Some(side) = *side {
            let y_new = super::lora_tp::adapter(&mut b, l, side, (x, y), cfg, plan);
            inserts.push(Insert {
                after_op: l.ops.1,
                y,
                y_new,
                ops: (op0, b.graph().ops.len()),
                params: (p0, b.graph().params.len()),
                after_param,
            });
            continue;
        }
        // PEFT's module names: `<layer>.lora_A.default`, ...
        b.set_path(&format!("{}.lora_A.default", l.path));
        let a = b.param_typed("weight", &[cfg.r, l.in_features], adapter);
        b.set_path(&format!("{}.lora_B.default", l.path));
        let bw = b.param_typed("weight", &[l.out_features, cfg.r], adapter);
        b.set_path(&l.path);
        // A bitsandbytes base layer: PEFT's `lora/bnb.py` wrappers.
        // `Linear4bit.forward`: "for 4bit, we need to defensively clone here".
        let result = match quant {
            Some(q) if q != crate::finetune::Quant::Int8 => b.clone_t(y),
            _ => y,
        };
        // _cast_input_dtype: `x.to(lora_A.weight.dtype)` if they differ (an alias otherwise).
        let xc = match cfg.dtype {
            Some(d) => b.to_dtype(x, d),
            None => x,
        };
        b.set_path(&format!("{}.lora_dropout.default", l.path));
        let xd = b.dropout(xc, cfg.dropout);
        b.set_path(&format!("{}.lora_A.default", l.path));
        let h = b.linear_op(xd, a, None);
        b.set_path(&format!("{}.lora_B.default", l.path));
        let o = b.linear_op(h, bw, None);
        b.set_path(&l.path);
        let scaled = b.mul_scalar(o);
        let y_new = if quant.is_some() {
            // bnb wrappers: `output = (lora_B(lora_A(dropout(x))) * scaling).to(expected_dtype)`,
            // `result = result + output`.
            let back = b.to_dtype_of(scaled, y);
            b.add(result, back)
        } else {
            let sum = b.add(result, scaled);
            b.to_dtype_of(sum, y)
        };
        inserts.push(Insert {
            after_op: l.ops.1,
            y,
            y_new,
            ops: (op0, b.graph().ops.len()),
            params: (p0, b.graph().params.len()),
            after_param,
        });
    }
    let mut g = b.finish()?;
    for ins in &inserts {
        replace_uses(&mut g, ins.after_op, n_ops, ins.y, ins.y_new);
    }
    // Program order: each layer's new ops right after its own; parameter order: each adapter's
    // after its layer's parameters (`model.to()` and `named_parameters()` visit `base_layer`,
    // then `lora_A`, then `lora_B`).
    let mut op_groups: Vec<Vec<usize>> = (0..n_ops).map(|i| vec![i]).collect();
    let mut param_groups: Vec<Vec<usize>> = (0..n_params).map(|i| vec![i]).collect();
    for ins in &inserts {
        op_groups[ins.after_op].extend(ins.ops.0..ins.ops.1);
        param_groups[ins.after_param].extend(ins.params.0..ins.params.1);
    }
    reorder_ops(&mut g, &op_groups);
    reorder_params(&mut g, &param_groups);
    Ok(g)
}

/// The users of `y` among the original ops after `after_op` (those before `n_ops`), the holds,
/// the kept outputs, the graph's output and the regions' arguments take `y_new` instead.
pub(crate) fn replace_uses(
    g: &mut Graph,
    after_op: usize,
    n_ops: usize,
    y: ValueId,
    y_new: ValueId,
) {
    for op in &mut g.ops[after_op + 1..n_ops] {
        for v in &mut op.inputs {
            if *v == y {
                *v = y_new;
            }
        }
    }
    // A hold released inside the layer (a local of its forward, such as RowParallelLinear's
    // `output_`) stays on `y`.
    for (v, op) in g.holds.iter_mut().chain(g.kept_outputs.iter_mut()) {
        if *v == y && op.0 as usize > after_op {
            *v = y_new;
        }
    }
    if g.output == Some(y) {
        g.output = Some(y_new);
    }
    for r in &mut g.regions {
        for v in &mut r.args {
            if *v == y {
                *v = y_new;
            }
        }
    }
}

/// Puts the ops in the order of `groups` (each group: an original op, then ops to run after it),
/// renumbering every reference to an op.
pub(crate) fn reorder_ops(g: &mut Graph, groups: &[Vec<usize>]) {
    let order: Vec<usize> = groups.iter().flatten().copied().collect();
    let total = order.len().max(groups.len());
    let n_all = g.ops.len();
    let mut new_of: Vec<Option<usize>> = vec![None; n_all.max(total)];
    for (new, &old) in order.iter().enumerate() {
        new_of[old] = Some(new);
    }
    // An op dropped (an empty group: a layer replaced by one op) stands for the next kept one;
    // a release "after op k" waits for the last op of k's group (what runs after k inside the
    // same module call), or of the nearest earlier kept group for a dropped op.
    let mut group_end: Vec<usize> = vec![0; groups.len()];
    let mut last_end = 0;
    for (k, gr) in groups.iter().enumerate() {
        if let Some(&l) = gr.last() {
            last_end = new_of[l].expect("placed");
        }
        group_end[k] = last_end;
    }
    let mut next_kept = order.len().saturating_sub(1);
    for k in (0..n_all).rev() {
        match new_of[k] {
            Some(n) => next_kept = n,
            None => new_of[k] = Some(next_kept),
        }
    }
    let new_of: Vec<usize> = new_of.into_iter().map(|x| x.unwrap_or(0)).collect();
    let end_of = |k: usize| {
        if k < group_end.len() {
            group_end[k]
        } else {
            new_of[k]
        }
    };
    let old_ops = std::mem::take(&mut g.ops);
    let mut slots: Vec<Option<crate::graph::Op>> = old_ops.into_iter().map(Some).collect();
    g.ops = order
        .iter()
        .map(|&i| slots[i].take().expect("once"))
        .collect();
    for v in &mut g.values {
        if let Source::Op { op, .. } = &mut v.source {
            *op = OpId(new_of[op.0 as usize] as u32);
        }
    }
    for (_, op) in g.holds.iter_mut().chain(g.kept_outputs.iter_mut()) {
        *op = OpId(end_of(op.0 as usize) as u32);
    }
    for r in &mut g.regions {
        r.start = new_of[r.start];
        r.end = end_of(r.end - 1) + 1;
    }
}

/// Puts the parameters in the order of `groups`, renumbering [`Source::Param`] and the buffers'
/// positions.
fn reorder_params(g: &mut Graph, groups: &[Vec<usize>]) {
    let order: Vec<usize> = groups.iter().flatten().copied().collect();
    let mut new_of = vec![0usize; order.len()];
    for (new, &old) in order.iter().enumerate() {
        new_of[old] = new;
    }
    let old = std::mem::take(&mut g.params);
    let mut slots: Vec<_> = old.into_iter().map(Some).collect();
    g.params = order
        .iter()
        .map(|&i| slots[i].take().expect("once"))
        .collect();
    for v in &mut g.values {
        if let Source::Param(i) = &mut v.source {
            *i = new_of[*i];
        }
    }
    for b in &mut g.buffers {
        if b.after_params > 0 {
            let last = groups[b.after_params - 1].last().copied().unwrap_or(0);
            b.after_params = new_of[last] + 1;
        }
    }
}
