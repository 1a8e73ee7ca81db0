//! Frozen column-parallel layers under sequence parallelism (`--tp N --sp` with `--freeze` or
//! `--lora`): Megatron-core's `ColumnParallelLinear.forward` runs a frozen weight through
//! `linear_with_frozen_weight` (`megatron/core/tensor_parallel/layers.py`: `if not
//! weight.requires_grad: self._forward_impl = linear_with_frozen_weight`), which gathers the
//! sequence shard with `gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True)`
//! — a new tensor, reduce-scattered into a new shard in backward — and whose
//! `LinearWithFrozenWeight` saves only the weight, where a trainable weight's
//! `LinearWithGradAccumulationAndAsyncCommunication` gathers into the persistent "mpu" buffer and
//! saves the local shard to gather again in backward. The rank's graph is built with the trainable
//! path ([`TpComm::GatherToBuffer`]); once the fine-tuning options have frozen parameters, each
//! gather whose products all multiply frozen weights becomes [`TpComm::SeqGather`].

use crate::graph::{Graph, Source, ValueId};
use crate::ops::{OpKind, TpComm};

/// The parameter `v` is (through transposes, views and autocast casts), if any.
fn param_of(g: &Graph, mut v: ValueId) -> Option<usize> {
    loop {
        match g.values[v.0 as usize].source {
            Source::Param(i) => return Some(i),
            Source::Op { op, .. } => {
                let op = &g.ops[op.0 as usize];
                match op.kind {
                    OpKind::T
                    | OpKind::Transpose(..)
                    | OpKind::AutocastLower
                    | OpKind::View
                    | OpKind::Reshape => v = *op.inputs.first()?,
                    _ => return None,
                }
            }
            _ => return None,
        }
    }
}

/// Whether every matrix product reading `v` (through views and autocast casts) multiplies a
/// frozen parameter; `None` when no product reads it.
fn feeds_only_frozen(g: &Graph, v: ValueId) -> Option<bool> {
    let mut frontier = vec![v];
    let mut weights = Vec::new();
    while let Some(x) = frontier.pop() {
        for op in g.ops.iter().filter(|o| o.inputs.contains(&x)) {
            match op.kind {
                OpKind::View
                | OpKind::Reshape
                | OpKind::UnsafeView
                | OpKind::AutocastLower
                | OpKind::Transpose(..)
                | OpKind::T => frontier.extend(op.outputs.iter().copied()),
                OpKind::Mm | OpKind::Addmm => {
                    let w = op.inputs.iter().rev().find(|&&i| i != x)?;
                    weights.push(param_of(g, *w)?);
                }
                _ => {}
            }
        }
    }
    if weights.is_empty() {
        return None;
    }
    Some(weights.iter().all(|&i| !g.params[i].trainable))
}

/// Turns the sequence-parallel all-gathers that feed only frozen column-parallel products into
/// `linear_with_frozen_weight`'s gather ([`TpComm::SeqGather`]).
pub fn frozen_gathers(g: &mut Graph) {
    let gathers: Vec<usize> = g
        .ops
        .iter()
        .enumerate()
        .filter(|(_, o)| o.kind == OpKind::TpComm(TpComm::GatherToBuffer))
        .map(|(i, _)| i)
        .collect();
    for i in gathers {
        let Some(&out) = g.ops[i].outputs.first() else {
            continue;
        };
        if feeds_only_frozen(g, out) == Some(true) {
            g.ops[i].kind = OpKind::TpComm(TpComm::SeqGather);
        }
    }
}
