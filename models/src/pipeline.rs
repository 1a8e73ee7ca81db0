//! Pipeline parallelism (`--pp N --pp-schedule gpipe|1f1b|interleaved:V --microbatches M`) as
//! `torch.distributed.pipelining` runs it under torchtitan: the stage split, each rank's order of
//! forward and backward actions, and the graph one rank runs. The lowering (`lower/pipeline.rs`)
//! writes the rank's step from these; every rule names its source (PyTorch 2.15's
//! `torch/distributed/pipelining/`, torchtitan's `torchtitan/distributed/pipeline_parallel.py`).
//!
//! * **Split** ([`split_layers`]): torchtitan's `_generate_llm_fqn_per_model_part` with its default
//!   weights (`pipeline_parallel_first_stage_less_layers = 1`, `..._last_stage_less_layers = 1`):
//!   the embeddings count as one layer on the first stage, the final norm and the output head as
//!   one on the last, and the `L + 2` effective layers are spread evenly over the `pp × V` stages
//!   (the first `(L + 2) mod S` stages one more). Stage `s` runs on rank `s mod pp`
//!   (`_get_pp_rank_to_stage_indices_mapping`, "loop" style).
//! * **Micro-batches** ([`microbatches`]): torchtitan (before its commit 73aed7f6c, "fold batch
//!   dim") splits `training.local_batch_size` into micro-batches of
//!   `parallelism.pipeline_parallel_microbatch_size` (default 1): `M = local batch / 1`; later
//!   versions take `parallelism.num_pp_microbatches` (default 1). vramsim's `--batch` is the local
//!   batch of one gradient-accumulation step and `M` defaults to it (micro-batch size 1);
//!   `--microbatches` overrides. `schedule.step` cuts the batch with `tensor_split` (views of it).
//! * **Schedules** ([`rank_actions`]): `ScheduleGPipe` (every forward, then every backward),
//!   `Schedule1F1B` (`warmup_chunks = min(m, num_stages - stage_index)` forwards, then one backward
//!   and one forward alternately, backward first, then the remaining backwards),
//!   `ScheduleInterleaved1F1B` (`_calculate_single_rank_operations` with `_get_warmup_ops`:
//!   `min((V - 1)·mpr + 2·(pp - 1 - rank), m·V)` warm-up forwards, then a forward and a backward
//!   per step, forward first, depth first over the local stages).
//! * **The rank's graph** ([`rank_graph`]): the ops of its stages, each stage's input the
//!   activation it receives (a value made on the previous stage that requires grad) and its output
//!   the one it sends; values a stage reads that need no gradient (rotary tables, masks) are
//!   recomputed by the stage from its own inputs and buffers (torchtitan's Llama keeps `freqs_cis`
//!   as a buffer of every stage).

use std::collections::BTreeSet;

use crate::graph::{Graph, Input, OpId, RegionKind, Source, ValueId};
use crate::ops::OpKind;
use crate::parallel::{Parallel, PpSchedule};

/// The `Graph::meta` key under which [`rank_graph`] describes the rank's stages for the lowering.
pub const META_KEY: &str = "pipeline";

/// A model or layout the pipeline split cannot take, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PipelineError {
    /// The model has no stack of blocks to split, or its stages exchange more than one tensor.
    #[error("{0}")]
    Unsupported(String),
    /// The layout does not fit the model or the schedule (the source's own checks).
    #[error("{0}")]
    Invalid(String),
}

/// Stages of the pipeline: `pp × V` (V = 1 but for the interleaved schedule).
pub fn num_stages(p: &Parallel) -> u32 {
    p.pp.saturating_mul(chunks_per_rank(p.pp_schedule))
}

/// Model chunks (virtual stages) per rank.
pub fn chunks_per_rank(s: PpSchedule) -> u32 {
    match s {
        PpSchedule::Interleaved(v) => v,
        _ => 1,
    }
}

/// torchtitan's `_generate_llm_fqn_per_model_part(num_stages, num_layers, input_weight=1,
/// output_weight=1)`: the layer range `[a, b)` of each stage. The first stage also holds the
/// embeddings, the last the final norm and the head.
pub fn split_layers(
    num_layers: usize,
    num_stages: usize,
) -> Result<Vec<(usize, usize)>, PipelineError> {
    if num_stages <= 1 {
        return Ok(vec![(0, num_layers)]);
    }
    let (input_weight, output_weight) = (1usize, 1usize);
    let effective = num_layers + input_weight + output_weight;
    if num_stages > effective {
        return Err(PipelineError::Invalid(format!(
            "Number of stages ({num_stages}) cannot be greater than effective layers ({effective}) (torchtitan _generate_llm_fqn_per_model_part)"
        )));
    }
    let per_stage = effective / num_stages;
    let extra = effective % num_stages;
    let mut out = Vec::with_capacity(num_stages);
    let mut current = 0usize;
    for s in 0..num_stages {
        let mut n = per_stage + usize::from(s < extra);
        if s == 0 {
            n -= input_weight;
        } else if s == num_stages - 1 {
            n -= output_weight;
        }
        let start = current;
        current = (current + n).min(num_layers);
        out.push((start, current));
    }
    Ok(out)
}

/// The micro-batches of a step: `--microbatches`, else torchtitan's default micro-batch size 1
/// (`M = batch`). Checks the source's own conditions: `M` divides the batch (torchtitan
/// `build_pipeline_schedule`: "Batch size ... must be divisible by microbatch_size"), 1F1B needs
/// `M ≥ pp` (`Schedule1F1B.__init__`), interleaved 1F1B needs `M` a multiple of its rounds
/// `max(1, M // pp)` (`ScheduleInterleaved1F1B.__init__`).
pub fn microbatches(p: &Parallel, batch: u64) -> Result<u32, PipelineError> {
    let m = match p.microbatches {
        Some(m) => m,
        None => u32::try_from(batch).map_err(|_| {
            PipelineError::Invalid(format!(
                "batch {batch} is too large for one micro-batch each"
            ))
        })?,
    };
    if m == 0 || !batch.is_multiple_of(u64::from(m)) {
        return Err(PipelineError::Invalid(format!(
            "--microbatches {m} must divide the batch {batch} (torchtitan: the local batch size must be divisible by the micro-batch size)"
        )));
    }
    match p.pp_schedule {
        PpSchedule::GPipe => {}
        PpSchedule::OneFOneB => {
            if m < p.pp {
                return Err(PipelineError::Invalid(format!(
                    "Number of microbatches ({m}) must be greater than or equal to the number of stages ({}) (Schedule1F1B); give --microbatches {} or more, or --pp-schedule gpipe",
                    p.pp, p.pp
                )));
            }
        }
        PpSchedule::Interleaved(_) => {
            let rounds = (m / p.pp).max(1);
            if !m.is_multiple_of(rounds) {
                return Err(PipelineError::Invalid(format!(
                    "Interleaved 1F1B requires the number of microbatches to be a multiple of the number of rounds ({rounds}), but got {m} (ScheduleInterleaved1F1B: rounds = max(1, M // pp))"
                )));
            }
        }
    }
    Ok(m)
}

/// The batches of a pipeline with `--microbatches M`, as `M + k·M` (k = 0, 1, ...): every multiple
/// of `M`, each `M` micro-batches of `batch / M` samples (whether `M` suits the schedule does not
/// depend on the batch: [`microbatches`]). `None` for a pipeline whose micro-batch count follows
/// the batch (one sample each: its memory barely grows with the batch, and a batch of B lowers
/// B micro-batches); `(1, 1)`, every batch, without a pipeline.
pub fn batch_grid(p: &Parallel) -> Option<(u64, u64)> {
    if p.pp < 2 {
        return Some((1, 1));
    }
    p.microbatches.map(|m| (u64::from(m), u64::from(m)))
}

/// One compute action of a rank: the forward or the (full) backward of micro-batch `mb` on
/// stage `stage` (global stage index).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// `forward_one_chunk(mb)` of the stage.
    Forward {
        /// Global stage index.
        stage: u32,
        /// Micro-batch.
        mb: u32,
    },
    /// `backward_one_chunk(mb)` of the stage (full backward).
    Backward {
        /// Global stage index.
        stage: u32,
        /// Micro-batch.
        mb: u32,
    },
}

impl Action {
    /// Whether this is a forward.
    pub fn is_forward(self) -> bool {
        matches!(self, Action::Forward { .. })
    }
}

/// The compute actions of pipeline rank `rank` in the order its schedule runs them (PyTorch
/// 2.15 `schedules.py`; idle steps left out).
pub fn rank_actions(schedule: PpSchedule, pp: u32, rank: u32, m: u32) -> Vec<Action> {
    let f = |stage, mb| Action::Forward { stage, mb };
    let b = |stage, mb| Action::Backward { stage, mb };
    match schedule {
        // `ScheduleGPipe._step_microbatches`: all forwards, then all backwards.
        PpSchedule::GPipe => (0..m)
            .map(|i| f(rank, i))
            .chain((0..m).map(|i| b(rank, i)))
            .collect(),
        // `Schedule1F1B._step_microbatches`.
        PpSchedule::OneFOneB => {
            let warmup = m.min(pp - rank);
            let mut out: Vec<Action> = (0..warmup).map(|i| f(rank, i)).collect();
            let (mut fwd, mut bwd) = (warmup, 0);
            loop {
                out.push(b(rank, bwd));
                bwd += 1;
                if fwd == m {
                    break;
                }
                out.push(f(rank, fwd));
                fwd += 1;
            }
            out.extend((bwd..m).map(|i| b(rank, i)));
            out
        }
        PpSchedule::Interleaved(v) => interleaved_actions(pp, rank, m, v),
    }
}

/// `_get_warmup_ops(rank, n_local_stages, microbatches_per_round, pp_group_size, n_microbatches,
/// multiply_factor=2)` of `schedules.py`.
pub fn interleaved_warmup(pp: u32, rank: u32, m: u32, v: u32) -> u32 {
    let rounds = (m / pp).max(1);
    let per_round = m / rounds;
    let last = (v - 1) * per_round;
    (last + 2 * (pp - 1 - rank)).min(m * v)
}

/// `ScheduleInterleaved1F1B._calculate_single_rank_operations` → `_get_1f1b_rank_ops` without
/// zero bubble.
fn interleaved_actions(pp: u32, rank: u32, m: u32, v: u32) -> Vec<Action> {
    let rounds = (m / pp).max(1);
    let per_round = m / rounds;
    let warmup = interleaved_warmup(pp, rank, m, v);
    let total_mb_ops = v * m;
    let fwd_bwd = total_mb_ops - warmup;
    let cooldown = total_mb_ops - fwd_bwd;
    let fwd_stage = |step: u32| ((step / per_round) % v) * pp + rank;
    let bwd_stage = |step: u32| (v - 1 - ((step - warmup) / per_round) % v) * pp + rank;
    let mut fwd_mb = vec![0u32; (v * pp) as usize];
    let mut bwd_mb = vec![0u32; (v * pp) as usize];
    let mut out = Vec::new();
    let next = |counter: &mut Vec<u32>, stage: u32| {
        let mb = counter[stage as usize];
        counter[stage as usize] += 1;
        mb
    };
    for op in 0..warmup + fwd_bwd + cooldown {
        if op < warmup {
            let s = fwd_stage(op);
            out.push(Action::Forward {
                stage: s,
                mb: next(&mut fwd_mb, s),
            });
        } else if op < warmup + fwd_bwd {
            let s = fwd_stage(op);
            out.push(Action::Forward {
                stage: s,
                mb: next(&mut fwd_mb, s),
            });
            let s = bwd_stage(op);
            out.push(Action::Backward {
                stage: s,
                mb: next(&mut bwd_mb, s),
            });
        } else {
            let s = bwd_stage(op);
            out.push(Action::Backward {
                stage: s,
                mb: next(&mut bwd_mb, s),
            });
        }
    }
    out
}

/// One action of `_PipelineScheduleRuntime` (`ScheduleInterleaved1F1B`'s executor) once
/// `_prepare_schedule_with_comms` has lowered the compute schedule: the compute actions with the
/// receives, sends and send waits placed among them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeAction {
    /// A forward or a full backward.
    Compute(Action),
    /// `RECV_F`: the activation's receive buffer is allocated and its receive posted.
    RecvF {
        /// Global stage index (the receiving stage).
        stage: u32,
        /// Micro-batch.
        mb: u32,
    },
    /// `RECV_B`: the output gradient's receive buffer is allocated and its receive posted.
    RecvB {
        /// Global stage index (the receiving stage).
        stage: u32,
        /// Micro-batch.
        mb: u32,
    },
    /// `WAIT_SEND_F`: the stage lets go of the output it sent.
    WaitSendF {
        /// Global stage index (the sending stage).
        stage: u32,
        /// Micro-batch.
        mb: u32,
    },
    /// `WAIT_SEND_B`: the input gradient it sent is let go.
    WaitSendB {
        /// Global stage index (the sending stage).
        stage: u32,
        /// Micro-batch.
        mb: u32,
    },
    /// `UNSHARD`: an FSDP2 stage's groups all-gathered (`unshard(async_op=True)`).
    Unshard {
        /// Global stage index.
        stage: u32,
    },
    /// `RESHARD`: an FSDP2 stage's unsharded parameters freed.
    Reshard {
        /// Global stage index.
        stage: u32,
    },
    /// `REDUCE_GRAD`: an FSDP2 stage's accumulated gradients reduce-scattered
    /// (`start_gradient_reduction`).
    ReduceGrad {
        /// Global stage index.
        stage: u32,
    },
    /// `WAIT_REDUCE_GRAD`: the reduction waited for (`wait_for_gradient_reduction`).
    WaitReduceGrad,
    /// Anything without memory of its own here (`SEND_F`, `SEND_B`; the FSDP actions of
    /// stages without FSDP are the variants above, no-ops there).
    Other,
}

/// A slot of the lowering passes: a compute action or another action, with what the
/// communication pass needs to know of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Slot {
    Compute(Action),
    RecvF(u32, u32),
    RecvB(u32, u32),
    SendF(u32, u32),
    SendB(u32, u32),
    WaitSendF(u32, u32),
    WaitSendB(u32, u32),
    Unshard(u32),
    Reshard(u32),
    ReduceGrad(u32),
    WaitReduceGrad(u32),
}

/// `_add_unshard_reshard(actions, max_active_stages=3, unshard_lookahead=3)` ("full", the
/// default): UNSHARD/RESHARD slots among the compute actions (no-ops without FSDP, but slots of
/// the communication pass).
fn add_unshard_reshard(actions: &[Action]) -> Vec<Slot> {
    let stage = |a: &Action| match *a {
        Action::Forward { stage, .. } | Action::Backward { stage, .. } => stage,
    };
    let next = |from: usize| -> Vec<u32> {
        let mut seen: Vec<u32> = Vec::new();
        for a in &actions[from..] {
            if !seen.contains(&stage(a)) {
                seen.push(stage(a));
            }
            if seen.len() >= 3 {
                break;
            }
        }
        seen
    };
    let mut active: Vec<u32> = Vec::new();
    let mut out = Vec::new();
    for (i, a) in actions.iter().enumerate() {
        let resident = next(i);
        let fetch: Vec<u32> = resident
            .iter()
            .copied()
            .filter(|s| !active.contains(s))
            .collect();
        let evict: Vec<u32> = active
            .iter()
            .copied()
            .filter(|s| !resident.contains(s))
            .collect();
        for s in evict {
            active.retain(|x| *x != s);
            out.push(Slot::Reshard(s));
        }
        for s in fetch {
            active.push(s);
            out.push(Slot::Unshard(s));
        }
        out.push(Slot::Compute(*a));
    }
    out.extend(active.iter().map(|&s| Slot::Reshard(s)));
    out
}

/// `_add_reduce_grad(actions, n_microbatches)`: `REDUCE_GRAD` and its wait after a stage's last
/// backward.
fn add_reduce_grad(slots: Vec<Slot>, m: u32) -> Vec<Slot> {
    let mut count: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    let mut out = Vec::with_capacity(slots.len());
    for s in slots {
        out.push(s);
        if let Slot::Compute(Action::Backward { stage, .. }) = s {
            let c = count.entry(stage).or_insert(0);
            *c += 1;
            if *c == m {
                out.push(Slot::ReduceGrad(stage));
                out.push(Slot::WaitReduceGrad(stage));
            }
        }
    }
    out
}

/// `_add_send_recv`: the ranks' lists are walked together, one action per rank per round (in rank
/// order), an action waiting until what it needs is in its rank's list (a forward its `RECV_F`, a
/// backward its `RECV_B`); a compute action whose neighbour stage is on another rank appends its
/// send to its own list and the receive to the neighbour's, at that moment.
fn add_send_recv(
    mut lists: Vec<std::collections::VecDeque<Slot>>,
    pp: u32,
    stages: u32,
) -> Vec<Vec<Slot>> {
    let rank_of = |s: u32| s % pp;
    let mut out: Vec<Vec<Slot>> = vec![Vec::new(); lists.len()];
    let mut have: Vec<std::collections::HashSet<Slot>> = vec![Default::default(); lists.len()];
    while lists.iter().any(|l| !l.is_empty()) {
        let mut progress = false;
        for r in 0..lists.len() {
            let Some(&slot) = lists[r].front() else {
                continue;
            };
            let ready = match slot {
                Slot::Compute(Action::Forward { stage, mb }) if stage != 0 => {
                    have[r].contains(&Slot::RecvF(stage, mb))
                        || have[r].contains(&Slot::Compute(Action::Forward {
                            stage: stage - 1,
                            mb,
                        }))
                }
                Slot::Compute(Action::Backward { stage, mb }) if stage + 1 != stages => {
                    have[r].contains(&Slot::RecvB(stage, mb))
                        || have[r].contains(&Slot::Compute(Action::Backward {
                            stage: stage + 1,
                            mb,
                        }))
                }
                _ => true,
            };
            if !ready {
                continue;
            }
            out[r].push(slot);
            have[r].insert(slot);
            match slot {
                Slot::Compute(Action::Forward { stage, mb })
                    if stage + 1 != stages && rank_of(stage + 1) != rank_of(stage) =>
                {
                    out[r].push(Slot::SendF(stage, mb));
                    have[r].insert(Slot::SendF(stage, mb));
                    let to = rank_of(stage + 1) as usize;
                    out[to].push(Slot::RecvF(stage + 1, mb));
                    have[to].insert(Slot::RecvF(stage + 1, mb));
                }
                Slot::Compute(Action::Backward { stage, mb })
                    if stage != 0 && rank_of(stage - 1) != rank_of(stage) =>
                {
                    out[r].push(Slot::SendB(stage, mb));
                    have[r].insert(Slot::SendB(stage, mb));
                    let to = rank_of(stage - 1) as usize;
                    out[to].push(Slot::RecvB(stage - 1, mb));
                    have[to].insert(Slot::RecvB(stage - 1, mb));
                }
                _ => {}
            }
            lists[r].pop_front();
            progress = true;
        }
        if !progress {
            break;
        }
    }
    out
}

/// `_add_wait_send`: a forward send is waited right after the matching local backward, the
/// others (backward sends) at the end of the schedule, in the order they were sent.
fn add_wait_send(slots: Vec<Slot>) -> Vec<Slot> {
    let mut pending: Vec<Slot> = Vec::new();
    let mut out = Vec::with_capacity(slots.len());
    for s in slots {
        out.push(s);
        match s {
            Slot::SendF(..) | Slot::SendB(..) => pending.push(s),
            Slot::Compute(Action::Backward { stage, mb }) => {
                if let Some(i) = pending.iter().position(|p| *p == Slot::SendF(stage, mb)) {
                    pending.remove(i);
                    out.push(Slot::WaitSendF(stage, mb));
                }
            }
            _ => {}
        }
    }
    for p in pending {
        out.push(match p {
            Slot::SendF(s, m) => Slot::WaitSendF(s, m),
            Slot::SendB(s, m) => Slot::WaitSendB(s, m),
            other => other,
        });
    }
    out
}

/// `ScheduleInterleaved1F1B`'s actions on `rank` as `_PipelineScheduleRuntime` runs them
/// (`_prepare_schedule_with_comms` with its defaults: no `defer_pp_recv`, no send budget).
pub fn runtime_actions(pp: u32, rank: u32, m: u32, v: u32) -> Vec<RuntimeAction> {
    let lists = (0..pp)
        .map(|r| add_reduce_grad(add_unshard_reshard(&interleaved_actions(pp, r, m, v)), m).into())
        .collect();
    let comms = add_send_recv(lists, pp, pp * v);
    add_wait_send(comms[rank as usize].clone())
        .into_iter()
        .map(|s| match s {
            Slot::Compute(a) => RuntimeAction::Compute(a),
            Slot::RecvF(stage, mb) => RuntimeAction::RecvF { stage, mb },
            Slot::RecvB(stage, mb) => RuntimeAction::RecvB { stage, mb },
            Slot::WaitSendF(stage, mb) => RuntimeAction::WaitSendF { stage, mb },
            Slot::WaitSendB(stage, mb) => RuntimeAction::WaitSendB { stage, mb },
            Slot::Unshard(stage) => RuntimeAction::Unshard { stage },
            Slot::Reshard(stage) => RuntimeAction::Reshard { stage },
            Slot::ReduceGrad(stage) => RuntimeAction::ReduceGrad { stage },
            Slot::WaitReduceGrad(_) => RuntimeAction::WaitReduceGrad,
            Slot::SendF(..) | Slot::SendB(..) => RuntimeAction::Other,
        })
        .collect()
}

/// The most forwards a rank has run whose backward has not run yet, over its actions: the
/// micro-batches (of any of its stages) whose activations it holds at once.
pub fn max_in_flight(actions: &[Action]) -> u32 {
    let mut now = 0u32;
    let mut max = 0u32;
    for a in actions {
        if a.is_forward() {
            now += 1;
            max = max.max(now);
        } else {
            now -= 1;
        }
    }
    max
}

/// One stage of a rank's graph, as [`rank_graph`] writes it into `Graph::meta[META_KEY]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Global stage index.
    pub stage: u32,
    /// Its ops in the rank's graph: `[start, end)`.
    pub start: usize,
    /// One past its last op.
    pub end: usize,
    /// The model's inputs it reads (token ids, labels, ...): micro-batch views of the batch.
    pub inputs: Vec<ValueId>,
    /// The activation it receives from the previous stage (none on the first stage).
    pub recv: Vec<ValueId>,
    /// What its forward returns: the activation it sends, or the loss on the last stage.
    pub output: ValueId,
    /// The model's returned tensors the last stage keeps until its backward (the logits:
    /// `_PipelineStageBase._output_slot_is_releasable` is false on the last stage).
    pub model_outputs: Vec<ValueId>,
    /// Whether each received activation requires grad (as `recv`). Under fine-tuning a frozen
    /// prefix's hidden state does not: `PipelineStage`'s metadata inference records the
    /// previous stage's output as it is (`_forward_metadata_inference`: `extract_tensor_metas(
    /// outputs)`), `_retrieve_recv_activations` sets `requires_grad_(tensor_meta.requires_grad)`,
    /// so the buffer is no leaf of the stage's graph and no gradient is sent back
    /// (`_backward_metadata_inference`: an input without a gradient gets no grad meta;
    /// `get_bwd_send_ops` skips it).
    pub recv_grad: Vec<bool>,
    /// Whether the stage's output requires grad. When it does not (a fully frozen stage), the
    /// next stage sends it no gradient, so it allocates no gradient receive buffer
    /// (`_create_grad_recv_info`: `tensor_meta=None`; `_get_recv_ops` skips it) and its backward
    /// has no root (`stage_backward` skips an output that neither requires grad nor has a
    /// `grad_fn`, and `torch.autograd.backward([])` does nothing).
    pub output_grad: bool,
}

/// The stages of a rank's graph (from its meta); empty for a graph [`rank_graph`] did not make.
pub fn chunks(g: &Graph) -> Vec<Chunk> {
    let Some(list) = g
        .meta
        .get(META_KEY)
        .and_then(|m| m.get("chunks"))
        .and_then(|c| c.as_array())
    else {
        return Vec::new();
    };
    let ids = |c: &serde_json::Value, k: &str| -> Vec<ValueId> {
        c.get(k)
            .and_then(|a| a.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| ValueId(x as u32))
                    .collect()
            })
            .unwrap_or_default()
    };
    let num = |c: &serde_json::Value, k: &str| c.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
    list.iter()
        .map(|c| Chunk {
            stage: num(c, "stage") as u32,
            start: num(c, "start") as usize,
            end: num(c, "end") as usize,
            inputs: ids(c, "inputs"),
            recv: ids(c, "recv"),
            output: ValueId(num(c, "output") as u32),
            model_outputs: ids(c, "model_outputs"),
            recv_grad: c
                .get("recv_grad")
                .and_then(|a| a.as_array())
                .map(|a| a.iter().map(|x| x.as_bool().unwrap_or(true)).collect())
                .unwrap_or_default(),
            output_grad: c
                .get("output_grad")
                .and_then(|x| x.as_bool())
                .unwrap_or(true),
        })
        .collect()
}

/// Whether input `j` of `op` only gives a dtype (`x.to(other.dtype)`, the lowering's
/// `exec`: autograd records no edge for it).
fn dtype_only(op: &crate::graph::Op, j: usize) -> bool {
    j == 1 && matches!(op.kind, OpKind::ToDtypeOf | OpKind::AsStridedInplace)
}

/// Which values require grad, in program order: trainable parameters (every floating-point one
/// with `all_params`), and what a differentiable op computes from one (the lowering's rule in
/// `exec`: factories, recorded calls without a node and dtype-only arguments carry none).
fn requires_grad(g: &Graph, all_params: bool) -> Vec<bool> {
    let mut rg = vec![false; g.values.len()];
    for p in &g.params {
        rg[p.value.0 as usize] =
            p.trainable || (all_params && g.values[p.value.0 as usize].differentiable);
    }
    for op in &g.ops {
        let differentiable = match &op.kind {
            OpKind::Factory { .. } => false,
            OpKind::Recorded(r) => r.grad,
            _ => true,
        };
        let any = differentiable
            && op
                .inputs
                .iter()
                .enumerate()
                .any(|(j, v)| rg[v.0 as usize] && !dtype_only(op, j));
        for &o in &op.outputs {
            rg[o.0 as usize] = any && g.values[o.0 as usize].differentiable;
        }
    }
    rg
}

/// The op of the graph that makes `v`, if any.
fn producer(g: &Graph, v: ValueId) -> Option<usize> {
    match g.values[v.0 as usize].source {
        Source::Op { op, .. } => Some(op.0 as usize),
        _ => None,
    }
}

/// One stage of the whole graph: its ops (original indices, sorted), the activations it
/// receives, the model inputs it reads and what it sends.
struct StagePlan {
    ops: Vec<usize>,
    recv: Vec<ValueId>,
    inputs: Vec<ValueId>,
    sent: Vec<ValueId>,
    /// Inputs of recomputed ops replaced: (op, value read, value read instead).
    subst: Vec<(usize, ValueId, ValueId)>,
}

/// The ops each stage runs and what crosses between stages.
fn plan_stages(g: &Graph, num_stages: usize) -> Result<Vec<StagePlan>, PipelineError> {
    let mut blocks: Vec<(usize, usize)> = g
        .regions
        .iter()
        .filter(|r| r.kind == RegionKind::Block)
        .map(|r| (r.start, r.end))
        .collect();
    blocks.sort();
    if blocks.is_empty() {
        return Err(PipelineError::Unsupported(format!(
            "{} has no stack of repeated blocks (transformer layers) to split into pipeline stages: pipeline parallelism is modelled for the transformer models (GPT-2, Llama, BERT families)",
            g.name
        )));
    }
    let n_layers = blocks.len();
    if num_stages > n_layers {
        return Err(PipelineError::Invalid(format!(
            "{} stages for {} layers of {}: give --pp (× V for interleaved) of at most {n_layers}, the model's layers (torchtitan's own bound is layers + 2, the embeddings and the head each counted as a layer)",
            num_stages, n_layers, g.name
        )));
    }
    let split = split_layers(n_layers, num_stages)?;
    // Layer i's ops: from its block's start to the next block's (ops between blocks go with the
    // layer before them); the prologue before block 0 is the first stage's, the epilogue after
    // the last block the last stage's.
    let layer_ops = |i: usize| {
        let end = if i + 1 < n_layers {
            blocks[i + 1].0
        } else {
            blocks[i].1
        };
        blocks[i].0..end
    };
    // The cut is the model's, whatever is frozen: a stage receives the activation that would
    // need a gradient if every parameter trained (torchtitan splits the model before any
    // freezing; a frozen prefix's hidden state is still what the next stage receives, without
    // `requires_grad`: `Chunk::recv_grad`).
    let rg = requires_grad(g, true);
    let mut plans = Vec::with_capacity(num_stages);
    for (s, &(a, b)) in split.iter().enumerate() {
        let mut base: BTreeSet<usize> = BTreeSet::new();
        if s == 0 {
            base.extend(0..blocks[0].0);
        }
        for l in a..b {
            base.extend(layer_ops(l));
        }
        if s + 1 == num_stages {
            base.extend(blocks[n_layers - 1].1..g.ops.len());
        }
        // Values read from outside: received when they require grad, else recomputed here.
        let mut recv: Vec<ValueId> = Vec::new();
        for &i in &base {
            for (j, &v) in g.ops[i].inputs.iter().enumerate() {
                let outside = producer(g, v).is_some_and(|p| !base.contains(&p));
                if outside && rg[v.0 as usize] && !dtype_only(&g.ops[i], j) && !recv.contains(&v) {
                    recv.push(v);
                }
            }
        }
        let mut set = base.clone();
        let mut subst: Vec<(usize, ValueId, ValueId)> = Vec::new();
        let mut stack: Vec<usize> = set.iter().copied().collect();
        // Arguments a block's call takes and no op reads (HF passes `position_ids` to every
        // layer): the stage makes them too, and a checkpoint of the block holds them.
        for r in g.regions.iter().filter(|r| base.contains(&r.start)) {
            for &v in &r.args {
                if let Some(p) = producer(g, v) {
                    if !rg[v.0 as usize] && set.insert(p) {
                        stack.push(p);
                    }
                }
            }
        }
        while let Some(i) = stack.pop() {
            for (j, &v) in g.ops[i].inputs.iter().enumerate() {
                let Some(p) = producer(g, v) else { continue };
                if set.contains(&p) || recv.contains(&v) {
                    continue;
                }
                if !rg[v.0 as usize] {
                    set.insert(p);
                    stack.push(p);
                } else if dtype_only(&g.ops[i], j) && !recv.is_empty() {
                    // `x.to(hidden.dtype)` (HF's rotary embedding): the stage's own activation
                    // has that dtype.
                    subst.push((i, v, recv[0]));
                } else {
                    return Err(PipelineError::Unsupported(format!(
                        "{}: stage {s} would recompute value {} that requires grad: not modelled",
                        g.name, v.0
                    )));
                }
            }
        }
        let ops: Vec<usize> = set.into_iter().collect();
        let mut inputs: Vec<ValueId> = Vec::new();
        for &i in &ops {
            for &v in &g.ops[i].inputs {
                if matches!(g.values[v.0 as usize].source, Source::Input(_)) && !inputs.contains(&v)
                {
                    inputs.push(v);
                }
            }
        }
        plans.push(StagePlan {
            ops,
            recv,
            inputs,
            sent: Vec::new(),
            subst,
        });
    }
    // What each stage sends: what the next stage receives, made by this stage's own ops.
    for s in 0..num_stages {
        if s + 1 == num_stages {
            break;
        }
        let next = plans[s + 1].recv.clone();
        for &v in &next {
            let made_here = producer(g, v).is_some_and(|p| plans[s].ops.binary_search(&p).is_ok());
            if !made_here {
                return Err(PipelineError::Unsupported(format!(
                    "{}: stage {} reads value {} made before stage {s}: a tensor passed over more than one stage is not modelled",
                    g.name,
                    s + 1,
                    v.0
                )));
            }
        }
        if next.len() != 1 {
            return Err(PipelineError::Unsupported(format!(
                "{}: stage {} receives {} tensors that require grad; the pipeline is modelled for stages that exchange one activation (torchtitan's hidden state)",
                g.name,
                s + 1,
                next.len()
            )));
        }
        plans[s].sent = next;
    }
    Ok(plans)
}

/// The graph rank `p.stage` runs under the pipeline layout `p`: the ops of its stages
/// (`rank`, `rank + pp`, ... for the interleaved schedule), in stage order, its parameters and
/// buffers only, each received activation an input of the graph, and `Graph::meta[META_KEY]`
/// describing each stage ([`chunks`]). `g` is the model built for one micro-batch.
pub fn rank_graph(g: &Graph, p: &Parallel) -> Result<Graph, PipelineError> {
    let stages = num_stages(p) as usize;
    let plans = plan_stages(g, stages)?;
    // What actually requires grad under the recipe's frozen parameters and adapters.
    let rg = requires_grad(g, false);
    let v = chunks_per_rank(p.pp_schedule);
    let mut h = g.clone();
    h.ops.clear();
    h.regions.clear();
    h.holds.clear();
    h.kept_outputs.clear();
    let mut new_inputs: Vec<Input> = Vec::new();
    let mut chunks_meta = Vec::new();
    let mut last_output = None;
    // Where each kept original op went (per stage, since recomputed ops repeat).
    for k in 0..v {
        let s = (p.stage + k * p.pp) as usize;
        let plan = &plans[s];
        let start = h.ops.len();
        // Values a recomputed op of this stage makes again get new ids when an earlier stage of
        // the rank made them already.
        let mut rename: Vec<(ValueId, ValueId)> = Vec::new();
        let mut op_map: Vec<(usize, usize)> = Vec::new();
        for &i in &plan.ops {
            let mut op = g.ops[i].clone();
            let new_index = h.ops.len();
            for &(_, from, to) in plan.subst.iter().filter(|(o, _, _)| *o == i) {
                for inp in &mut op.inputs {
                    if *inp == from {
                        *inp = to;
                    }
                }
            }
            for inp in &mut op.inputs {
                if let Some(&(_, n)) = rename.iter().find(|(o, _)| o == inp) {
                    *inp = n;
                }
            }
            let repeated = k > 0
                && chunks_meta
                    .iter()
                    .any(|c: &(usize, usize, Vec<usize>)| c.2.contains(&i));
            for (j, out) in op.outputs.iter_mut().enumerate() {
                if repeated {
                    let mut val = g.values[out.0 as usize].clone();
                    val.source = Source::Op {
                        op: OpId(new_index as u32),
                        index: j,
                    };
                    let nv = ValueId(h.values.len() as u32);
                    h.values.push(val);
                    rename.push((*out, nv));
                    *out = nv;
                } else {
                    h.values[out.0 as usize].source = Source::Op {
                        op: OpId(new_index as u32),
                        index: j,
                    };
                }
            }
            h.ops.push(op);
            op_map.push((i, new_index));
        }
        let end = h.ops.len();
        let map_op = |i: usize| op_map.iter().find(|(o, _)| *o == i).map(|&(_, n)| n);
        // Checkpointable regions inside the stage.
        for r in &g.regions {
            let (Some(a), Some(b)) = (map_op(r.start), map_op(r.end - 1)) else {
                continue;
            };
            if b + 1 - a != r.end - r.start {
                continue;
            }
            let mut r2 = r.clone();
            r2.start = a;
            r2.end = b + 1;
            r2.args = r
                .args
                .iter()
                .map(|x| rename.iter().find(|(o, _)| o == x).map_or(*x, |&(_, n)| n))
                .filter(|x| match h.values[x.0 as usize].source {
                    Source::Op { op, .. } => (op.0 as usize) >= start && (op.0 as usize) < end,
                    _ => true,
                })
                .collect();
            h.regions.push(r2);
        }
        // Python locals held to the end of a module's forward: the stage's forward ends with its
        // last op.
        for &(hv, hop) in &g.holds {
            let hv = rename
                .iter()
                .find(|(o, _)| *o == hv)
                .map_or(hv, |&(_, n)| n);
            let made_here = match h.values[hv.0 as usize].source {
                Source::Op { op, .. } => (op.0 as usize) >= start && (op.0 as usize) < end,
                _ => false,
            };
            if !made_here {
                continue;
            }
            let at = map_op(hop.0 as usize).unwrap_or(end - 1).min(end - 1);
            h.holds.push((hv, OpId(at as u32)));
        }
        // Received activations: inputs of the rank's graph.
        for &rv in &plan.recv {
            h.values[rv.0 as usize].source = Source::Input(usize::MAX);
            new_inputs.push(Input {
                name: format!("pp_recv:stage{s}"),
                value: rv,
            });
        }
        let output = if s + 1 == stages {
            g.output.expect("a training graph has an output")
        } else {
            plan.sent[0]
        };
        last_output = Some(output);
        let model_outputs: Vec<u32> = if s + 1 == stages {
            let first = g.kept_outputs.iter().map(|&(_, op)| op.0).min();
            g.kept_outputs
                .iter()
                .filter(|&&(kv, op)| Some(op.0) == first && Some(kv) != g.output)
                .map(|&(kv, _)| kv.0)
                .collect()
        } else {
            Vec::new()
        };
        chunks_meta.push((start, end, plan.ops.clone()));
        let meta = serde_json::json!({
            "stage": s,
            "start": start,
            "end": end,
            "inputs": plan.inputs.iter().map(|x| x.0).collect::<Vec<_>>(),
            "recv": plan.recv.iter().map(|x| x.0).collect::<Vec<_>>(),
            "output": output.0,
            "model_outputs": model_outputs,
            "recv_grad": plan.recv.iter().map(|x| rg[x.0 as usize]).collect::<Vec<_>>(),
            "output_grad": rg[output.0 as usize],
        });
        if let Some(serde_json::Value::Array(a)) = h
            .meta
            .entry(META_KEY.to_string())
            .or_insert_with(|| serde_json::json!({"chunks": []}))
            .get_mut("chunks")
        {
            a.push(meta);
        }
    }
    // The model inputs any stage of the rank reads, then the received activations.
    let read: BTreeSet<u32> = plans
        .iter()
        .enumerate()
        .filter(|(s, _)| (*s as u32) % p.pp == p.stage)
        .flat_map(|(_, pl)| pl.inputs.iter().map(|x| x.0))
        .collect();
    let mut inputs: Vec<Input> = g
        .inputs
        .iter()
        .filter(|i| read.contains(&i.value.0))
        .cloned()
        .collect();
    inputs.extend(new_inputs);
    for (k, i) in inputs.iter().enumerate() {
        h.values[i.value.0 as usize].source = Source::Input(k);
    }
    h.inputs = inputs;
    h.output = last_output;
    // Parameters and buffers the rank's ops read (`_split_module` deletes the other modules).
    let used: BTreeSet<u32> = h
        .ops
        .iter()
        .flat_map(|op| op.inputs.iter().map(|x| x.0))
        .collect();
    let keep_p: Vec<usize> = (0..g.params.len())
        .filter(|&i| used.contains(&g.params[i].value.0))
        .collect();
    let keep_b: Vec<usize> = (0..g.buffers.len())
        .filter(|&i| used.contains(&g.buffers[i].value.0))
        .collect();
    h.params = keep_p.iter().map(|&i| g.params[i].clone()).collect();
    for (k, pp) in h.params.iter().enumerate() {
        h.values[pp.value.0 as usize].source = Source::Param(k);
    }
    h.buffers = keep_b
        .iter()
        .map(|&i| {
            let mut b = g.buffers[i].clone();
            b.after_params = keep_p.iter().filter(|&&q| q < b.after_params).count();
            b
        })
        .collect();
    for (k, b) in h.buffers.iter().enumerate() {
        h.values[b.value.0 as usize].source = Source::Buffer(k);
    }
    if let Some(m) = h.meta.get_mut(META_KEY) {
        m["rank"] = serde_json::json!(p.stage);
    }
    // A DDP stage needs a parameter to train: `DistributedDataParallel.__init__` raises when none
    // of its module's parameters requires grad (`torch/nn/parallel/distributed.py`).
    if p.shard.uses_ddp() {
        for (k, &(start, end, _)) in chunks_meta.iter().enumerate() {
            let read: BTreeSet<u32> = h.ops[start..end]
                .iter()
                .flat_map(|op| op.inputs.iter().map(|x| x.0))
                .collect();
            if !h
                .params
                .iter()
                .any(|q| q.trainable && read.contains(&q.value.0))
            {
                let s = p.stage + k as u32 * p.pp;
                return Err(PipelineError::Invalid(format!(
                    "stage {s} of {} trains no parameter (all frozen), and --shard {} wraps each stage in DistributedDataParallel, which raises \"DistributedDataParallel is not needed when a module doesn't have any parameter that requires a gradient.\" (torch/nn/parallel/distributed.py); freeze fewer layers, or give --shard fsdp2 or none",
                    g.name, p.shard
                )));
            }
        }
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// torchtitan's docstring example and its even split.
    #[test]
    fn split_as_torchtitan() {
        // 8 layers over 2 stages: 10 effective, 5 each: stage 0 = emb + 4, stage 1 = 4 + head.
        assert_eq!(split_layers(8, 2).unwrap(), vec![(0, 4), (4, 8)]);
        // 12 layers over 4 stages: 14 effective, 3 each and 2 extra: 3, 4, 3, 2 layers.
        assert_eq!(
            split_layers(12, 4).unwrap(),
            vec![(0, 3), (3, 7), (7, 10), (10, 12)]
        );
        assert!(split_layers(2, 5).is_err());
    }

    /// The 1F1B order of `Schedule1F1B._step_microbatches` for pp 4, m 8 on stage 1.
    #[test]
    fn one_f_one_b_order() {
        let a = rank_actions(PpSchedule::OneFOneB, 4, 1, 8);
        let s: Vec<String> = a
            .iter()
            .map(|a| match a {
                Action::Forward { mb, .. } => format!("F{mb}"),
                Action::Backward { mb, .. } => format!("B{mb}"),
            })
            .collect();
        assert_eq!(
            s.join(" "),
            "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
        );
        // Warm-up min(m, pp − stage), then forward after backward: at most pp − stage in flight.
        for st in 0..4 {
            assert_eq!(
                max_in_flight(&rank_actions(PpSchedule::OneFOneB, 4, st, 8)),
                4 - st
            );
        }
        assert_eq!(max_in_flight(&rank_actions(PpSchedule::GPipe, 4, 2, 8)), 8);
    }

    /// Interleaved: PyTorch's warm-up formula, forward before backward in the steady state.
    #[test]
    fn interleaved_in_flight() {
        for (pp, m, v) in [(4u32, 8u32, 2u32), (2, 4, 3), (4, 4, 2), (2, 6, 2)] {
            for r in 0..pp {
                let a = rank_actions(PpSchedule::Interleaved(v), pp, r, m);
                assert_eq!(a.len() as u32, 2 * m * v);
                let mpr = m / (m / pp).max(1);
                let w = ((v - 1) * mpr + 2 * (pp - 1 - r)).min(m * v);
                let expect = if w < m * v { w + 1 } else { w };
                assert_eq!(max_in_flight(&a), expect, "pp {pp} m {m} v {v} rank {r}");
            }
        }
    }
}
