//! One pipeline rank's step (`--pp`): the actions of its schedule
//! (`crate::pipeline::rank_actions`) on the stages of its graph (`crate::pipeline::rank_graph`),
//! with several micro-batches' forwards in flight before their backwards, as
//! `torch.distributed.pipelining` (PyTorch 2.15) runs them:
//!
//! * **Inputs**: `schedule.step(inputs, target=labels)` cuts the batch with `tensor_split`
//!   (`microbatch.py` `split_args_kwargs_into_chunks`, `_PipelineSchedule.step`): each micro-batch's
//!   model inputs are views of the batch, which the training loop holds through the step.
//! * **Receive** (`stage.py` `_get_recv_ops` → `_RecvInfo.allocate_buffer`): a non-first stage
//!   allocates the activation's buffer immediately before each forward receive;
//!   `_retrieve_recv_activations` takes it and `requires_grad_()` makes it a leaf of the stage's
//!   graph; `_ForwardChunkState.input_values` keeps it until that micro-batch's backward returns
//!   (one buffer per micro-batch in flight, nothing kept across steps in 2.15). On the last stage
//!   the leaf lives until the step ends: the micro-batch's loss, kept in `_internal_losses` and
//!   the caller's `losses`, reaches it through its `grad_fn` chain (the leaf's `AccumulateGrad`
//!   node holds it; a backward frees saved tensors, not nodes), so the last stage ends its step
//!   holding all `M` receive buffers.
//! * **Forward** (`forward_one_chunk`): the stage's ops; a non-last stage's output is held by its
//!   send until the schedule waits for it (`_wait_and_release_fwd_send` →
//!   `release_fwd_send_outputs`; backward then starts from the output's gradient edge). GPipe
//!   waits after every forward; 1F1B waits for a warm-up forward's send after the next forward,
//!   and otherwise in the batch before the next backward (`fwd_send_bwd_recv`). The last stage
//!   keeps the model's output until its backward (`_output_slot_is_releasable` is false there)
//!   and every loss until the step ends (`_internal_losses`).
//! * **Backward** (`backward_one_chunk` → `_backward.py` `stage_backward`): the last stage from
//!   its loss (`torch.autograd.backward(loss)`, a `ones_like` seed); the others from the gradient
//!   received into a buffer allocated before the backward (`get_bwd_recv_ops`) and held until
//!   `backward_one_chunk` returns (GPipe: until the next receive is waited for, the last until the
//!   backward sends are, or the step's end on the first stage: `ScheduleGPipe._step_microbatches`'
//!   loop variable `work` holds the receive's `Work`, which keeps its tensor: `_batch_p2p` posts a
//!   batch of receives as plain `irecv`s, and `ProcessGroupNCCL::pointToPoint` stores the tensor in
//!   the work's `outputs_`, as gloo's `RecvWork` does). The gradient of each received input is taken from `.grad`
//!   (`val.grad = None`) and held by its send (`bwd_cache`, then the `P2POp` list): 1F1B drops it
//!   when the next backward's sends replace the list (after that backward), GPipe when it waits
//!   for every backward send at the end. Then the micro-batch's graph is freed (only its nodes:
//!   the others are in flight) and its inputs die with its chunk state.
//! * **Gradients** accumulate in `.grad` over the micro-batches; the optimizer steps once. An
//!   FSDP2 stage (`--shard fsdp2`) keeps its parameters unsharded and accumulates unsharded
//!   gradients over the micro-batches, then reduces once after the schedule (`fsdp.rs`). A DDP
//!   stage (`--shard ddp`, `zero1-torch`) runs every backward but the last micro-batch's under
//!   `no_sync()` and fills its buckets in the last (`backward_maybe_with_nosync`,
//!   `parallel.rs`), and keeps each output until that micro-batch's backward returns
//!   (`_output_slot_is_releasable`: "DDP reducer requires live outputs").
//!
//! `ScheduleInterleaved1F1B` runs through `_PipelineScheduleRuntime`, whose actions
//! `crate::pipeline::runtime_actions` lowers as `_prepare_schedule_with_comms` does: `RECV_F` and
//! `RECV_B` allocate their buffers where the communication pass put them (as soon as the sender's
//! action is scheduled, often ahead of the forward that reads them), a forward output is held by
//! its send until `WAIT_SEND_F` right after that micro-batch's backward on this rank, and the input
//! gradients sent back are held until the `WAIT_SEND_B`s at the end of the step. With FSDP2 each
//! of the rank's stages is its own root, and the schedule's `UNSHARD`, `RESHARD`, `REDUCE_GRAD`
//! and `WAIT_REDUCE_GRAD` actions all-gather, reshard and reduce it (`fsdp.rs`).

use super::{Edge, Kind, LowerError, Lowering, Rt};
use crate::graph::{ModuleId, ValueId};
use crate::layout::Layout;
use crate::parallel::{PpLoop, PpSchedule};
use crate::pipeline::{self, Action, Chunk};
use rustc_hash::FxHashMap;
use std::ops::Range;

/// One micro-batch of one stage between its forward and its backward (`_ForwardChunkState`).
struct InFlight {
    /// `input_values`: the micro-batch views of the model inputs and the received activations.
    inputs: Vec<Rt>,
    /// Leaf slots of the received activations (their `.grad` is what is sent back).
    recv_slots: Vec<u32>,
    /// The output's gradient edge (non-last stages: the backward's root).
    root: Option<Edge>,
    /// The last stage's loss.
    loss: Option<Rt>,
    /// The last stage's received activations that require grad: its loss's graph keeps them
    /// (the input leaf's `AccumulateGrad` node holds its tensor).
    loss_leaves: Vec<Rt>,
    /// The last stage's model outputs, alive until the backward.
    held: Vec<Rt>,
    /// A DDP stage's output, which its chunk state keeps until the backward returns
    /// (`_output_slot_is_releasable`: "DDP reducer requires live outputs").
    live_output: Option<Rt>,
    /// The autograd nodes, checkpoint frames and leaf slots its forward made.
    nodes: Range<usize>,
    frames: Range<usize>,
    leaves: Range<usize>,
}

/// The pipeline state of a rank's lowering.
#[derive(Default)]
pub(crate) struct PpState {
    chunks: Vec<Chunk>,
    /// The batch's model inputs (value, full-batch tensor) for the step.
    batch: Vec<(ValueId, Rt)>,
    inflight: FxHashMap<(u32, u32), InFlight>,
    /// Forward outputs whose send has not been waited for.
    sends: Vec<Rt>,
    /// Input gradients whose send has not been released, with the backward that made them.
    grad_sends: Vec<(usize, Rt)>,
    /// `_internal_losses`, each with the received leaves its graph keeps (`InFlight::loss_leaves`).
    losses: Vec<(Rt, Vec<Rt>)>,
    /// What the training loop keeps of the last `schedule.step` until its step ends
    /// (`Lowering::pp_loop_loss`): torchtitan's `loss` and the receive buffers its graph reaches.
    kept: Vec<Rt>,
    /// Values whose handles the running forward keeps (the last stage's model outputs).
    hold: Vec<ValueId>,
    held: Vec<Rt>,
    /// `ScheduleGPipe`: the received output gradient the loop variable `work` still holds (its
    /// receive's `Work`) after `backward_one_chunk` returns.
    recv_work: Option<Rt>,
    /// Micro-batches of the step.
    m: u32,
}

impl<'g> Lowering<'g> {
    /// Whether this lowering is a pipeline rank's.
    pub(super) fn pp_on(&self) -> bool {
        self.r.parallel.pp > 1
    }

    /// The rank's stages, read from its graph.
    pub(super) fn pp_setup(&mut self) {
        if self.pp_on() {
            self.pp.chunks = pipeline::chunks(self.g);
        }
    }

    /// The forward running keeps one more reference on the model outputs it returns to the
    /// schedule (the last stage's).
    pub(super) fn pp_hold_outputs(&mut self, outputs: &[ValueId]) {
        if self.pp.hold.is_empty() || self.recompute_saved.is_some() || self.in_reentrant_recompute
        {
            return;
        }
        for &v in outputs {
            if self.pp.hold.contains(&v) {
                if let Some(rt) = self.vals[v.0 as usize].clone() {
                    let d = self.dup(&rt);
                    self.pp.held.push(d);
                }
            }
        }
    }

    /// One optimizer step's worth of `schedule.step(...)` on this rank.
    pub(super) fn pp_step(&mut self) -> Result<(), LowerError> {
        let p = self.r.parallel;
        let m = pipeline::microbatches(&p, self.r.batch)?;
        self.pp.m = m;
        self.pp_batch_inputs(m);
        if let PpSchedule::Interleaved(v) = p.pp_schedule {
            self.pp_runtime(&pipeline::runtime_actions(p.pp, p.stage, m, v))?;
        } else {
            self.pp_single(&pipeline::rank_actions(p.pp_schedule, p.pp, p.stage, m))?;
        }
        // `_step_microbatches` ends with `perform_reduce_grad` (an FSDP2 stage's one reduce).
        self.fsdp_pp_reduce();
        if let Some(t) = self.pp.recv_work.take() {
            self.drop_rt(t);
        }
        let losses = std::mem::take(&mut self.pp.losses);
        let mut kept = self.pp_loop_loss(&losses);
        // `_update_losses`; the loop's `losses` list dies after the step (CPython's list
        // deallocation releases its items last first), and with each loss its graph: the
        // received leaf's `AccumulateGrad` lets go of the receive buffer. Under torchtitan the
        // summed loss's graph still reaches every loss's `grad_fn` chain, so the leaves stay.
        let titan = self.r.parallel.pp_loop == PpLoop::Torchtitan;
        for (t, leaves) in losses.into_iter().rev() {
            self.drop_rt(t);
            for l in leaves {
                if titan {
                    kept.push(l);
                } else {
                    self.drop_rt(l);
                }
            }
        }
        // torchtitan's `loss = self.forward_backward_step(...)`: the next accumulation step's
        // rebinding frees the previous one (after its `losses` list died).
        let old = std::mem::replace(&mut self.pp.kept, kept);
        for t in old {
            self.drop_rt(t);
        }
        for (_, t) in std::mem::take(&mut self.pp.batch).into_iter().rev() {
            self.drop_rt(t);
        }
        // Every micro-batch's graph is gone: the autograd state starts afresh.
        let keep = self.persistent_nodes();
        self.nodes.truncate(keep);
        self.seq = 0;
        self.leaf_grads.clear();
        self.frames.clear();
        Ok(())
    }

    /// What the training loop keeps of a `schedule.step` (`Parallel::pp_loop`). torchtitan's
    /// `Trainer.pp_forward_backward_step` (`trainer.py`) returns, on the last stage,
    /// `torch.sum(torch.stack(losses)).to(self.device)`: `stack` makes an `[M]` tensor, a
    /// temporary that dies once `sum` returns (`StackBackward0` and `SumBackward0` save no tensor),
    /// and the 0-dim sum is returned (`.to` of a tensor already there is itself); on the other
    /// stages `torch.tensor([-1.0], device=self.device)`. `train_step` binds it to `loss` (and
    /// `detached_loss`, a view) until it returns, after `optimizers.step()`. The plain loop
    /// keeps nothing.
    fn pp_loop_loss(&mut self, losses: &[(Rt, Vec<Rt>)]) -> Vec<Rt> {
        if self.r.parallel.pp_loop != PpLoop::Torchtitan {
            return Vec::new();
        }
        let kind = self.kind_now;
        self.kind_now = Kind::Temporary;
        let kept = match losses.first() {
            Some((l, _)) => {
                let dtype = l.dtype;
                let m = losses.len() as u64;
                let stacked =
                    self.alloc(Layout::contiguous(&[m]), dtype, ModuleId(0), "aten.stack");
                let sum = self.alloc(Layout::contiguous(&[]), dtype, ModuleId(0), "aten.sum");
                self.drop_rt(stacked);
                sum
            }
            None => self.alloc(
                Layout::contiguous(&[1]),
                crate::dtype::DType::F32,
                ModuleId(0),
                "aten.tensor",
            ),
        };
        self.kind_now = kind;
        self.retag(&kept, "pp_loop_loss".to_string());
        vec![kept]
    }

    /// torchtitan's `train_step` returns after the optimizer step: its `loss` dies, and with it
    /// the last stage's loss graph and the receive buffers it reaches (last first: the graph is
    /// freed depth-first from the last edge, `deleteNode` in `torch/csrc/autograd/function.cpp`).
    pub(super) fn pp_end_train_step(&mut self) {
        for t in std::mem::take(&mut self.pp.kept) {
            self.drop_rt(t);
        }
    }

    /// `_PipelineScheduleRuntime._step_microbatches` (`ScheduleInterleaved1F1B`): each action as
    /// `_perform_action` does it.
    fn pp_runtime(&mut self, actions: &[pipeline::RuntimeAction]) -> Result<(), LowerError> {
        use pipeline::RuntimeAction as R;
        let mut recv_f: FxHashMap<(u32, u32), Vec<Rt>> = FxHashMap::default();
        let mut recv_b: FxHashMap<(u32, u32), Rt> = FxHashMap::default();
        let mut sent_f: FxHashMap<(u32, u32), Rt> = FxHashMap::default();
        let mut sent_b: FxHashMap<(u32, u32), Vec<Rt>> = FxHashMap::default();
        for &a in actions {
            match a {
                R::RecvF { stage, mb } => {
                    let bufs = self.pp_recv_activation(stage);
                    recv_f.insert((stage, mb), bufs);
                }
                R::RecvB { stage, mb } => {
                    if let Some(g) = self.pp_recv_grad(stage, mb) {
                        recv_b.insert((stage, mb), g);
                    }
                }
                R::Compute(Action::Forward { stage, mb }) => {
                    self.micro = mb;
                    self.phase("forward");
                    self.fsdp_assert_unsharded(stage);
                    let bufs = recv_f.remove(&(stage, mb)).unwrap_or_default();
                    // The send (`SEND_F`, next in the list) holds the output until its wait.
                    if let Some(out) = self.pp_forward(stage, mb, Some(bufs))? {
                        sent_f.insert((stage, mb), out);
                    }
                }
                R::Compute(Action::Backward { stage, mb }) => {
                    self.micro = mb;
                    self.phase("backward");
                    self.fsdp_assert_unsharded(stage);
                    let grad = recv_b.remove(&(stage, mb));
                    let sent = self.pp_backward(stage, mb, grad);
                    sent_b.insert((stage, mb), sent);
                }
                R::WaitSendF { stage, mb } => {
                    if let Some(t) = sent_f.remove(&(stage, mb)) {
                        self.drop_rt(t);
                    }
                }
                R::WaitSendB { stage, mb } => {
                    for t in sent_b.remove(&(stage, mb)).unwrap_or_default() {
                        self.drop_rt(t);
                    }
                }
                R::Unshard { stage } => self.fsdp_unshard_stage(stage),
                R::Reshard { stage } => self.fsdp_reshard_stage(stage),
                R::ReduceGrad { stage } => self.fsdp_reduce_stage(stage),
                R::WaitReduceGrad => self.fsdp_wait_reduce(),
                R::Other => {}
            }
        }
        Ok(())
    }

    /// `ScheduleGPipe` / `Schedule1F1B._step_microbatches`.
    fn pp_single(&mut self, actions: &[Action]) -> Result<(), LowerError> {
        let gpipe = self.r.parallel.pp_schedule == PpSchedule::GPipe;
        let last_forward = actions.iter().rposition(|a| a.is_forward());
        for (i, &a) in actions.iter().enumerate() {
            match a {
                Action::Forward { stage, mb } => {
                    self.micro = mb;
                    self.phase("forward");
                    let out = match self.pp_forward(stage, mb, None)? {
                        Some(out) => {
                            self.pp.sends.push(out);
                            true
                        }
                        None => false,
                    };
                    if gpipe {
                        if Some(i) == last_forward {
                            // `_wait_and_release_fwd_send` for every forward, after the last.
                            self.pp_release_sends(0);
                        }
                    } else {
                        // The previous forward's send is waited after this forward.
                        self.pp_release_sends(usize::from(out));
                    }
                }
                Action::Backward { stage, mb } => {
                    self.micro = mb;
                    self.phase("backward");
                    let grad = self.pp_recv_grad(stage, mb);
                    if gpipe {
                        // `for work in works.values(): _wait_batch_p2p(work)` rebinds `work` to this
                        // receive: the previous one's buffer dies, this one's outlives the backward.
                        let kept = grad.as_ref().map(|g| self.dup(g));
                        if let Some(old) = std::mem::replace(&mut self.pp.recv_work, kept) {
                            self.drop_rt(old);
                        }
                    }
                    if !gpipe {
                        // `fwd_send_bwd_recv`: the pending forward send is waited here.
                        self.pp_release_sends(0);
                    }
                    for t in self.pp_backward(stage, mb, grad) {
                        self.pp.grad_sends.push((i, t));
                    }
                    if !gpipe {
                        // The previous backward's sends die when this one's replace them.
                        self.pp_release_grad_sends(Some(i));
                    }
                }
            }
        }
        self.pp_release_sends(0);
        // GPipe's `for work in bwd_sends_to_wait` rebinds `work` (a stage that sends gradients
        // back); the first stage sends none, so its last receive lives until `_step_microbatches`
        // returns, after `perform_reduce_grad` (`pp_step`).
        if !self.pp.grad_sends.is_empty() {
            if let Some(old) = self.pp.recv_work.take() {
                self.drop_rt(old);
            }
        }
        self.pp_release_grad_sends(None);
        Ok(())
    }

    /// The training loop's batch of the model inputs this rank's stages read (token ids on the
    /// first stage, labels on the last), `M` micro-batches long.
    fn pp_batch_inputs(&mut self, m: u32) {
        let g = self.g;
        let mut read: Vec<ValueId> = Vec::new();
        for c in &self.pp.chunks {
            for &v in &c.inputs {
                if !read.contains(&v) {
                    read.push(v);
                }
            }
        }
        for inp in &g.inputs {
            if !read.contains(&inp.value) {
                continue;
            }
            let v = &g.values[inp.value.0 as usize];
            let dtype = self.resolve(v.dtype);
            let mut shape = v.shape.clone();
            if let Some(b) = shape.first_mut() {
                *b *= u64::from(m);
            }
            let layout = Layout::contiguous(&shape);
            let size = layout.numel() * dtype.size();
            let st = self.alloc_raw(size, Kind::Input, format!("input:{}", inp.name).into());
            self.pp.batch.push((
                inp.value,
                Rt {
                    layout,
                    dtype,
                    st,
                    edge: None,
                    view: false,
                },
            ));
        }
    }

    fn pp_chunk(&self, stage: u32) -> Chunk {
        self.pp
            .chunks
            .iter()
            .find(|c| c.stage == stage)
            .cloned()
            .expect("the schedule runs the rank's own stages")
    }

    /// `get_fwd_recv_ops(mb)` of a non-first stage: a buffer per received activation.
    fn pp_recv_activation(&mut self, stage: u32) -> Vec<Rt> {
        let c = self.pp_chunk(stage);
        let mut out = Vec::new();
        for &v in &c.recv {
            let val = &self.g.values[v.0 as usize];
            let dtype = self.resolve(val.dtype);
            self.kind_now = Kind::Pending;
            let rt = self.alloc(
                Layout::contiguous(&val.shape),
                dtype,
                ModuleId(0),
                "pp_recv",
            );
            self.retag(&rt, format!("pp_recv_activation:stage{stage}"));
            out.push(rt);
        }
        out
    }

    /// `forward_one_chunk(mb)` of `stage`, on the buffers `received` (allocated now when `None`);
    /// returns the output it sends (none on the last stage).
    fn pp_forward(
        &mut self,
        stage: u32,
        mb: u32,
        received: Option<Vec<Rt>>,
    ) -> Result<Option<Rt>, LowerError> {
        let g = self.g;
        let c = self.pp_chunk(stage);
        let last = self.pp_is_last(stage);
        let (node0, frame0, leaf0) = (self.nodes.len(), self.frames.len(), self.leaf_grads.len());
        // The micro-batch's model inputs: `tensor_split` views of the batch.
        for &v in &c.inputs {
            let full = self
                .pp
                .batch
                .iter()
                .find(|(b, _)| *b == v)
                .map(|(_, t)| t.clone())
                .expect("the batch holds every input the rank reads");
            let view = self.view(&full, Layout::contiguous(&g.values[v.0 as usize].shape));
            self.vals[v.0 as usize] = Some(view);
        }
        // `_retrieve_recv_activations`: each received buffer becomes a leaf that requires grad,
        // but a frozen prefix's hidden state, which stays a plain tensor (`Chunk::recv_grad`).
        let received = match received {
            Some(r) => r,
            None => self.pp_recv_activation(stage),
        };
        let mut recv_slots = Vec::new();
        let mut loss_leaves = Vec::new();
        for (k, (&v, mut rt)) in c.recv.iter().zip(received).enumerate() {
            if c.recv_grad.get(k).copied().unwrap_or(true) {
                let (leaf, slot) = self.new_leaf(&rt);
                rt.edge = Some(Edge { node: leaf, nr: 0 });
                recv_slots.push(slot);
                // On the last stage the leaf outlives its backward: the loss, which the schedule
                // keeps until the step ends (`_internal_losses`, then the caller's `losses`),
                // reaches through its `grad_fn` chain (not freed by a backward without
                // `retain_graph`: only saved tensors are) the input's `AccumulateGrad` node,
                // which holds the leaf (`stage.py` `_retrieve_recv_activations`:
                // `buffer.requires_grad_(...)`; `stage_backward` only clears its `.grad`).
                if last {
                    loss_leaves.push(self.dup(&rt));
                }
            }
            self.vals[v.0 as usize] = Some(rt);
        }
        if last {
            self.pp.hold = c.model_outputs.clone();
        }
        // A DDP stage's `_pre_forward` (under `no_sync()`): the buckets rebuilt once, at the first
        // forward after a backward that recorded the gradients' ready order.
        self.ddp_stage_pre_forward(stage);
        self.fsdp_pp_pre_forward(stage);
        let out = self.forward_ops(c.start..c.end, c.output)?;
        self.fsdp_post_forward();
        self.pp.hold.clear();
        let held = std::mem::take(&mut self.pp.held);
        let mut inputs = Vec::new();
        for &v in c.inputs.iter().chain(&c.recv) {
            if let Some(rt) = self.vals[v.0 as usize].take() {
                inputs.push(rt);
            }
        }
        let mut state = InFlight {
            inputs,
            recv_slots,
            root: None,
            loss: None,
            loss_leaves,
            held,
            live_output: None,
            nodes: node0..self.nodes.len(),
            frames: frame0..self.frames.len(),
            leaves: leaf0..self.leaf_grads.len(),
        };
        let sent = if last {
            state.loss = Some(out);
            None
        } else {
            state.root = out.edge;
            if self.r.parallel.shard.uses_ddp() {
                state.live_output = Some(self.dup(&out));
            }
            Some(out)
        };
        self.pp.inflight.insert((stage, mb), state);
        Ok(sent)
    }

    fn pp_is_last(&self, stage: u32) -> bool {
        stage + 1 == pipeline::num_stages(&self.r.parallel)
    }

    /// Waits for the pending forward sends but the last `keep`: the stage lets go of those
    /// outputs (`release_fwd_send_outputs`).
    fn pp_release_sends(&mut self, keep: usize) {
        let n = self.pp.sends.len().saturating_sub(keep);
        let done: Vec<Rt> = self.pp.sends.drain(..n).collect();
        for t in done {
            self.drop_rt(t);
        }
    }

    /// Releases the input gradients sent by backwards before `current` (all with `None`).
    fn pp_release_grad_sends(&mut self, current: Option<usize>) {
        let (done, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pp.grad_sends)
            .into_iter()
            .partition(|(i, _)| current.is_none_or(|c| *i < c));
        self.pp.grad_sends = keep;
        for (_, t) in done {
            self.drop_rt(t);
        }
    }

    /// `get_bwd_recv_ops(mb)` of a non-last stage: the buffer of the output's gradient (none
    /// when the output does not require grad: `Chunk::output_grad`).
    fn pp_recv_grad(&mut self, stage: u32, mb: u32) -> Option<Rt> {
        if self.pp_is_last(stage) {
            return None;
        }
        let c = self.pp_chunk(stage);
        if !c.output_grad {
            return None;
        }
        let val = &self.g.values[c.output.0 as usize];
        let dtype = self.resolve(val.dtype);
        self.kind_now = Kind::Comm;
        let rt = self.alloc(
            Layout::contiguous(&val.shape),
            dtype,
            ModuleId(0),
            "pp_recv",
        );
        self.kind_now = Kind::Temporary;
        self.retag(&rt, format!("pp_recv_grad:stage{stage}.mb{mb}"));
        Some(rt)
    }

    /// `backward_one_chunk(mb)` of `stage` from the received output gradient `grad` (none on the
    /// last stage); returns the gradients of the received inputs, which its sends hold.
    fn pp_backward(&mut self, stage: u32, mb: u32, grad: Option<Rt>) -> Vec<Rt> {
        let st = self
            .pp
            .inflight
            .remove(&(stage, mb))
            .expect("a backward follows its forward");
        let (node0, frame0, leaf0) = (self.nodes.len(), self.frames.len(), self.leaf_grads.len());
        // `last_backward=bwd_mb_index == self._n_microbatches - 1` (`schedules.py`; the
        // runtime's `backward_counter[stage_idx] == self._n_microbatches`): a stage's backwards
        // run in micro-batch order.
        let last_backward = mb + 1 == self.pp.m;
        self.ddp_pp_pre_backward(stage, last_backward);
        if let Some(loss) = st.loss {
            let (loss, unscaled) = self.finish_loss(loss);
            self.backward_run(&loss);
            if let Some(u) = unscaled {
                self.drop_rt(u);
            }
            self.pp.losses.push((loss, st.loss_leaves));
        } else if let (Some(root), Some(g)) = (st.root, grad.as_ref()) {
            let into_engine = self.dup(g);
            self.run_backward(root, into_engine, None);
        }
        self.fsdp_pp_end_backward();
        self.ddp_pp_post_backward(stage, last_backward);
        // `backward_one_chunk` returns: its `bwd_kwargs` (holding a DDP stage's output) dies
        // before its `grads_output`, which lives until then.
        if let Some(t) = st.live_output {
            self.drop_rt(t);
        }
        if let Some(g) = grad {
            self.drop_rt(g);
        }
        // `stage_backward`: `grad_inputs.append(val.grad); val.grad = None`, then `bwd_cache`.
        let mut sent = Vec::new();
        for &slot in &st.recv_slots {
            if let Some(t) = self.leaf_grads[slot as usize].take() {
                self.retag(&t, format!("pp_send_grad:stage{stage}.mb{mb}"));
                sent.push(t);
            }
        }
        // The micro-batch's graph is freed (its nodes only), then its chunk state dies.
        let (node1, frame1, leaf1) = (self.nodes.len(), self.frames.len(), self.leaf_grads.len());
        self.release_nodes(st.nodes.clone());
        self.release_nodes(node0..node1);
        self.release_leaves(st.leaves.clone());
        self.release_leaves(leaf0..leaf1);
        self.release_frames(st.frames.clone());
        self.release_frames(frame0..frame1);
        for t in st.held {
            self.drop_rt(t);
        }
        for t in st.inputs.into_iter().rev() {
            self.drop_rt(t);
        }
        sent
    }
}
