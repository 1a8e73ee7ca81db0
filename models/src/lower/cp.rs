//! Context parallelism's ring attention on one rank (`--cp`): what PyTorch 2.15's
//! `torch/distributed/tensor/experimental/_context_parallel/_attention.py` allocates when the
//! context-parallel dispatcher (`context_parallel(mesh, buffers=...)`: SDPA patched, the DTensor
//! handler `_sdpa_handler`) replaces a fused SDPA call on the rank's sequence shard, statement by
//! statement, with Python's reference lifetimes:
//!
//! * `_templated_ring_attention` (forward) with the default options (`_ContextParallelOptions`:
//!   `convert_to_f32=True`, `enable_load_balance=True` — `context_parallel` keeps it when
//!   `_create_default_load_balancer` makes the head-tail balancer, `seq % (2·cp) == 0` —,
//!   `rotate_method=ALL_GATHER`, which torchtitan's `context_parallel_rotate_method`
//!   "allgather" also picks): `key.contiguous()`, `value.contiguous()`; one
//!   `all_gather_single(cat([k, v]))` into a `cp ×` buffer (`_AllGatherRotater`); one kernel call per
//!   step (step 0 causal on the local q, k, v; step i ≤ rank on the first half of the received
//!   K/V; step i > rank on the second half of q, `partial`); `_SDPAMerger`'s float32 merge
//!   (`out - sigmoid(block_lse - lse) * (out - block_out)`, `lse - logsigmoid(lse - block_lse)`,
//!   `_partial_update`'s `cat` for a partial step), the result cast back (`results`).
//! * `_templated_ring_attention_backward`: float32 `zeros_like` accumulators of dq, dk, dv, the
//!   same all-gathered K/V, one backward kernel per step (`lse.chunk(2)[1].contiguous()` for a
//!   partial step), and the K/V gradients passed round the ring by `all_to_all_single`
//!   (`_AllToAllRotater`, always, `dkv_rotater`) as a float32 `cat([dk, dv])` each step, the last
//!   received cast to the key's dtype: dk and dv are views of that one buffer.
//!
//! The functional collectives (`_c10d_functional.all_gather_into_tensor`,
//! `all_to_all_single`) allocate their output on the current stream; `ProcessGroupNCCL` keeps
//! their input (`stashed_for_allocator_safety_`) until the work is waited
//! (`WorkNCCL::synchronizeStream` unstashes), which the ring does at the next step
//! (`_maybe_wait`). The gathered K/V and the rotated K/V gradients are communication buffers
//! ([`Kind::Comm`]); the other tensors are the forward's or backward's own (temporaries, or the
//! activations the attention's node saves).

use super::{Kind, Lowering, Meta, Rt};
use crate::dtype::DType;
use crate::graph::ModuleId;
use crate::layout::{elementwise_layout, Layout};
use crate::ops::FusedSdpa;

/// The sequence dimension of SDPA's `[B, H, L, D]` (the ring's hard-coded `seq_dim = 2`).
const SEQ: usize = 2;

/// `t.chunk(2, dim=2)[j]`: a view of half the sequence.
fn half(l: &Layout) -> Layout {
    l.narrow(SEQ, l.shape[SEQ] / 2)
}

impl<'g> Lowering<'g> {
    /// The rank's place in the ring: (cp rank, cp world size).
    fn ring(&self) -> (u32, u32) {
        (self.r.parallel.cp_rank, self.r.parallel.cp)
    }

    /// `t.contiguous()`: `t` itself when contiguous, else a contiguous copy.
    fn cp_contiguous(&mut self, t: &Rt, m: ModuleId) -> Rt {
        if t.layout.is_contiguous() {
            self.dup(t)
        } else {
            self.alloc(Layout::contiguous(t.shape()), t.dtype, m, "aten.clone")
        }
    }

    /// `t.to(dtype)`: `t` itself when already of `dtype`, else a copy in `t`'s memory order
    /// (`preserve_format`).
    fn cp_to(&mut self, t: &Rt, dtype: DType, m: ModuleId) -> Rt {
        if t.dtype == dtype {
            self.dup(t)
        } else {
            self.alloc(t.layout.empty_like(), dtype, m, "aten._to_copy")
        }
    }

    /// A new float32 tensor of an elementwise op on `a` and `b` (broadcast), in the order
    /// TensorIterator gives it.
    fn cp_elementwise(&mut self, shape: &[u64], a: &Layout, b: &Layout, m: ModuleId) -> Rt {
        let l = elementwise_layout(shape, &[a, b]);
        self.alloc(l, DType::F32, m, "aten.sub")
    }

    /// `_SDPAMerger._merge_one` of a step's float32 `block_out` and `block_lse` (already
    /// unsqueezed to 4-D) into `merged` (`self._out`, `self._lse`), allocation by allocation.
    fn cp_merge(
        &mut self,
        merged: &mut Option<(Rt, Rt)>,
        block_out: &Rt,
        block_lse: &Rt,
        partial: bool,
        m: ModuleId,
    ) {
        let Some((out, lse)) = merged.take() else {
            // First step: `self._lse = block_lse; self._out = block_out` (references).
            let o = self.dup(block_out);
            let l = self.dup(block_lse);
            *merged = Some((o, l));
            return;
        };
        // `lse = self._lse.chunk(2, dim=seq)[1] if partial else self._lse` (views).
        let (lo, ll) = if partial {
            (half(&out.layout), half(&lse.layout))
        } else {
            (out.layout.clone(), lse.layout.clone())
        };
        // `out = out - F.sigmoid(block_lse - lse) * (out - block_out)`.
        let t1 = self.cp_elementwise(&ll.shape, &block_lse.layout, &ll, m);
        let t2 = self.alloc(t1.layout.empty_like(), DType::F32, m, "aten.sigmoid");
        self.drop_rt(t1);
        let t3 = self.cp_elementwise(&lo.shape, &lo, &block_out.layout, m);
        let t4 = self.cp_elementwise(&lo.shape, &t2.layout, &t3.layout, m);
        self.drop_rt(t2);
        self.drop_rt(t3);
        let new_out = self.cp_elementwise(&lo.shape, &lo, &t4.layout, m);
        self.drop_rt(t4);
        // `lse = lse - F.logsigmoid(lse - block_lse)` (`log_sigmoid_forward`'s CUDA buffer is
        // `empty({0})`: no block).
        let u1 = self.cp_elementwise(&ll.shape, &ll, &block_lse.layout, m);
        let u2 = self.alloc(
            u1.layout.empty_like(),
            DType::F32,
            m,
            "aten.log_sigmoid_forward",
        );
        self.drop_rt(u1);
        let new_lse = self.cp_elementwise(&ll.shape, &ll, &u2.layout, m);
        self.drop_rt(u2);
        if partial {
            // `_partial_update(..., idx=1, add=False)`: `torch.cat(chunks, dim=seq)`, a new
            // full-length tensor (contiguous: the chunks suggest no other memory format),
            // assigned over `self._lse`, then `self._out`; the halves die at return.
            let l = self.alloc(Layout::contiguous(lse.shape()), DType::F32, m, "aten.cat");
            self.drop_rt(lse);
            let o = self.alloc(Layout::contiguous(out.shape()), DType::F32, m, "aten.cat");
            self.drop_rt(out);
            self.drop_rt(new_lse);
            self.drop_rt(new_out);
            *merged = Some((o, l));
        } else {
            // `self._lse = lse; self._out = out`.
            self.drop_rt(lse);
            self.drop_rt(out);
            *merged = Some((new_out, new_lse));
        }
    }

    /// `_templated_ring_attention` on the rank's `q`, `k`, `v` (`[B, H, L/cp, D]`): the ring's
    /// allocations and frees, and its results in the order the lowering's `Sdpa` op lists a
    /// kernel's outputs (merged output, merged logsumexp, then step 0's small tensors, which the
    /// ring returns as `*saved_rest`).
    pub(super) fn ring_attention_fwd(
        &mut self,
        backend: FusedSdpa,
        q: &Rt,
        k: &Rt,
        v: &Rt,
        m: ModuleId,
        name: &str,
    ) -> Vec<Rt> {
        let (rank, n) = self.ring();
        let outer = self.kind_now;
        // `key = key.contiguous(); value = value.contiguous()`.
        let mut key = self.cp_contiguous(k, m);
        let mut value = self.cp_contiguous(v, m);
        let kv = key.layout.numel() + value.layout.numel();
        let kv_dtype = key.dtype;
        let mut gathered: Option<Rt> = None;
        let mut stash: Option<Rt> = None;
        let mut merged: Option<(Rt, Rt)> = None;
        // The Python locals that outlive a step: `q, k, v` of the step, `out, logsumexp, *rest`
        // of its kernel, `saved_rest` (step 0's rest).
        let mut qkv: Vec<Rt> = Vec::new();
        let mut last: Vec<Rt> = Vec::new();
        let mut saved_rest: Vec<Rt> = Vec::new();
        for i in 0..n {
            if i > 0 {
                // `rotater.next_buffer()`: the first wait unstashes the all-gather's input;
                // `key`, `value` become views of this step's chunk of the gathered buffer.
                if let Some(s) = stash.take() {
                    self.drop_rt(s);
                }
                let g = gathered.clone().expect("gathered at step 0");
                let nk = self.view(&g, key.layout.clone());
                let nv = self.view(&g, value.layout.clone());
                self.drop_rt(std::mem::replace(&mut key, nk));
                self.drop_rt(std::mem::replace(&mut value, nv));
            }
            if i < n - 1 {
                // `next_kv = torch.cat([key.flatten(), value.flatten()])`, then
                // `rotater.exchange_buffers(next_kv)`, whose None is assigned over it: the
                // all-gather (once, at step 0) stashes it until the wait; later cats die at once.
                let cat = self.alloc(Layout::contiguous(&[kv]), kv_dtype, m, "aten.cat");
                if gathered.is_none() {
                    self.kind_now = Kind::Comm;
                    let g = self.alloc(
                        Layout::contiguous(&[kv * u64::from(n)]),
                        kv_dtype,
                        m,
                        "_c10d_functional.all_gather_into_tensor",
                    );
                    self.kind_now = outer;
                    gathered = Some(g);
                    stash = Some(cat);
                } else {
                    self.drop_rt(cat);
                }
            }
            // `_is_causal_behavior` with load balancing: step 0 causal on the local q, k, v;
            // step i ≤ rank on `key.chunk(2)[0]`, `value.chunk(2)[0]`; step i > rank on
            // `query.chunk(2)[1]` (partial).
            let partial = i > rank;
            let (sq, sk, sv) = if i == 0 {
                (q.layout.clone(), key.layout.clone(), value.layout.clone())
            } else if !partial {
                (q.layout.clone(), half(&key.layout), half(&value.layout))
            } else {
                (half(&q.layout), key.layout.clone(), value.layout.clone())
            };
            // `q, k, v, partial = ...` drops the previous step's (step 0's hold the contiguous
            // copies of the key and value); the kernel's outputs exist before
            // `out, logsumexp, *rest = op(...)` drops the previous ones.
            let nq = self.view(q, sq);
            let nk = self.view(&key, sk);
            let nv = self.view(&value, sv);
            for t in std::mem::replace(&mut qkv, vec![nq, nk, nv]) {
                self.drop_rt(t);
            }
            let outs = self.sdpa_kernel_fwd(backend, &qkv[0], &qkv[2], m, name);
            for t in std::mem::take(&mut last) {
                self.drop_rt(t);
            }
            if i == 0 {
                saved_rest = outs[2..].iter().map(|t| self.dup(t)).collect();
            }
            // `sdpa_merger.step(out, logsumexp, partial)`: float32 copies (`convert_to_f32`),
            // the logsumexp unsqueezed to 4-D (flash's `[B, H, L]`; cuDNN's is `[B, H, L, 1]`).
            let block_out = self.cp_to(&outs[0], DType::F32, m);
            let lse = self.cp_to(&outs[1], DType::F32, m);
            let block_lse = if lse.layout.dim() < 4 {
                let l = lse.layout.unsqueeze(3);
                let u = self.view(&lse, l);
                self.drop_rt(lse);
                u
            } else {
                lse
            };
            self.cp_merge(&mut merged, &block_out, &block_lse, partial, m);
            self.drop_rt(block_out);
            self.drop_rt(block_lse);
            last = outs;
        }
        // `sdpa_merger.results()`: the output cast back to the kernel's dtype, the logsumexp
        // squeezed (a view; float32 already).
        let (mo, ml) = merged.expect("one step at least");
        let out_dtype = last[0].dtype;
        let out = self.cp_to(&mo, out_dtype, m);
        let lse = if backend == FusedSdpa::Cudnn {
            self.dup(&ml)
        } else {
            let mut l = ml.layout.clone();
            l.shape.truncate(3);
            l.strides.truncate(3);
            self.view(&ml, l)
        };
        // Return: the merger, the rotater's buffer, the step's locals and `key`, `value` die.
        for t in [mo, ml, key, value] {
            self.drop_rt(t);
        }
        for t in qkv.into_iter().chain(last) {
            self.drop_rt(t);
        }
        if let Some(g) = gathered {
            self.drop_rt(g);
        }
        if let Some(s) = stash {
            self.drop_rt(s);
        }
        let mut results = vec![out, lse];
        results.extend(saved_rest);
        results
    }

    /// `_templated_ring_attention_backward` for the saved `q`, `k`, `v` (the output's gradient
    /// and the saved output are only read, through views): the ring's allocations and frees; returns dq and dk, dv (views of one
    /// buffer, the last received K/V gradients cast to the key's dtype).
    pub(super) fn ring_attention_bwd(
        &mut self,
        backend: FusedSdpa,
        q: &Meta,
        k: &Meta,
        v: &Meta,
        m: ModuleId,
    ) -> [Rt; 3] {
        let (rank, n) = self.ring();
        let outer = self.kind_now;
        let f32 = DType::F32;
        // `grad_query = torch.zeros_like(query, dtype=accum_dtype)` and the key's, value's.
        let mut dq_acc = self.alloc(q.layout.empty_like(), f32, m, "aten.zeros_like");
        let mut dk_acc = self.alloc(k.layout.empty_like(), f32, m, "aten.zeros_like");
        let mut dv_acc = self.alloc(v.layout.empty_like(), f32, m, "aten.zeros_like");
        // `key = key.contiguous(); value = value.contiguous()`.
        let kl = Layout::contiguous(&k.layout.shape);
        let vl = Layout::contiguous(&v.layout.shape);
        let mut key = if k.layout.is_contiguous() {
            None
        } else {
            Some(self.alloc(kl.clone(), k.dtype, m, "aten.clone"))
        };
        let mut value = if v.layout.is_contiguous() {
            None
        } else {
            Some(self.alloc(vl.clone(), v.dtype, m, "aten.clone"))
        };
        let kv = kl.numel() + vl.numel();
        let mut gathered: Option<Rt> = None;
        let mut next_kv: Option<Rt> = None;
        let mut kv_stash: Option<Rt> = None;
        // The all-to-all of the K/V gradients: its input (stashed until the wait) and output.
        let mut dkv_sent: Option<Rt> = None;
        let mut dkv_recv: Option<Rt> = None;
        let mut step_locals: Vec<Rt> = Vec::new();
        let mut held: Vec<Rt> = Vec::new();
        let mut kernel_out: Vec<Rt> = Vec::new();
        for i in 0..n {
            if i > 0 {
                // `kv_rotater.next_buffer()`: the first wait unstashes the all-gather's input;
                // `key`, `value` become views of the gathered buffer.
                if let Some(s) = kv_stash.take() {
                    self.drop_rt(s);
                }
                // The contiguous copies stay referenced by step 0's `k, v` locals until the
                // tuple assignment below.
                let gb = gathered.clone().expect("gathered at step 0");
                let nk = self.view(&gb, kl.clone());
                let nv = self.view(&gb, vl.clone());
                held.extend(key.replace(nk));
                held.extend(value.replace(nv));
            }
            if i != n - 1 {
                // `next_kv = torch.cat([key.flatten(), value.flatten()])`;
                // `kv_rotater.exchange_buffers(next_kv)` all-gathers once, stashing it.
                let cat = self.alloc(Layout::contiguous(&[kv]), k.dtype, m, "aten.cat");
                if gathered.is_none() {
                    self.kind_now = Kind::Comm;
                    gathered = Some(self.alloc(
                        Layout::contiguous(&[kv * u64::from(n)]),
                        k.dtype,
                        m,
                        "_c10d_functional.all_gather_into_tensor",
                    ));
                    self.kind_now = outer;
                    kv_stash = Some(self.dup(&cat));
                }
                if let Some(t) = next_kv.replace(cat) {
                    self.drop_rt(t);
                }
            }
            let partial = i > rank;
            let (sq, sk, sv) = if i == 0 {
                (q.layout.clone(), kl.clone(), vl.clone())
            } else if !partial {
                (q.layout.clone(), half(&kl), half(&vl))
            } else {
                (half(&q.layout), kl.clone(), vl.clone())
            };
            // `logsumexp.chunk(2, dim=seq_dim)[1].contiguous()` for a partial step (the chunk
            // of `[B, H, L]` — cuDNN's `[B, H, L, 1]` — is not contiguous for B·H > 1).
            let mut locals = Vec::new();
            if partial {
                let lse_shape: Vec<u64> = if backend == FusedSdpa::Cudnn {
                    vec![q.layout.shape[0], q.layout.shape[1], sq.shape[SEQ], 1]
                } else {
                    vec![q.layout.shape[0], q.layout.shape[1], sq.shape[SEQ]]
                };
                let full: Vec<u64> = {
                    let mut s = lse_shape.clone();
                    s[SEQ] = q.layout.shape[SEQ];
                    s
                };
                let chunk = half(&Layout::contiguous(&full));
                if !chunk.is_contiguous() {
                    locals.push(self.alloc(Layout::contiguous(&lse_shape), f32, m, "aten.clone"));
                }
            }
            // `q, k, v, out_, dout, lse = ...` drops the previous step's locals.
            for t in std::mem::replace(&mut step_locals, locals) {
                self.drop_rt(t);
            }
            for t in std::mem::take(&mut held) {
                self.drop_rt(t);
            }
            let qm = Meta {
                layout: sq,
                dtype: q.dtype,
            };
            let km = Meta {
                layout: sk,
                dtype: k.dtype,
            };
            let vm = Meta {
                layout: sv,
                dtype: v.dtype,
            };
            let grads = self.sdpa_kernel_bwd(backend, &qm, &km, &vm, m);
            // `grad_query_, grad_key_, grad_value_, *rest = op(...)` drops the previous ones.
            for t in std::mem::replace(&mut kernel_out, grads.into()) {
                self.drop_rt(t);
            }
            if i > 0 {
                // `next_grad_kv = dkv_rotater.next_buffer()`: the wait unstashes the sent cat
                // (whose local `next_grad_kv` is rebound); `grad_key`, `grad_value` become views
                // of the received buffer.
                if let Some(t) = dkv_sent.take() {
                    self.drop_rt(t);
                }
                let recv = dkv_recv.clone().expect("sent at the previous step");
                let nk = self.view(&recv, kl.clone());
                let nv = self.view(&recv, vl.clone());
                self.drop_rt(std::mem::replace(&mut dk_acc, nk));
                self.drop_rt(std::mem::replace(&mut dv_acc, nv));
                if !partial {
                    // `_partial_update(grad_key, grad_key_, idx=0, add=True)`: added in place
                    // to the chunk, then `torch.cat` of the chunks (new, contiguous).
                    let ck = self.alloc(Layout::contiguous(&kl.shape), f32, m, "aten.cat");
                    self.drop_rt(std::mem::replace(&mut dk_acc, ck));
                    let cv = self.alloc(Layout::contiguous(&vl.shape), f32, m, "aten.cat");
                    self.drop_rt(std::mem::replace(&mut dv_acc, cv));
                }
                // (else `grad_key += grad_key_` in place on the received buffer.)
            }
            // `next_grad_kv = torch.cat([grad_key.flatten(), grad_value.flatten()])` (the
            // received buffer's local reference goes with the rebinding), then
            // `dkv_rotater.exchange_buffers(next_grad_kv)`: `permute_tensor` →
            // `all_to_all_single`, a new output; its input stashed until the wait.
            // `flatten()` of an accumulator that is not contiguous (step 0's `zeros_like` of a
            // transposed key or value) copies; the copies die with the list after the cat.
            let flat: Vec<Rt> = [&dk_acc, &dv_acc]
                .into_iter()
                .filter(|t| !t.layout.is_contiguous())
                .map(|t| t.layout.numel())
                .collect::<Vec<_>>()
                .into_iter()
                .map(|numel| self.alloc(Layout::contiguous(&[numel]), f32, m, "aten.clone"))
                .collect();
            let sent = self.alloc(Layout::contiguous(&[kv]), f32, m, "aten.cat");
            for t in flat.into_iter().rev() {
                self.drop_rt(t);
            }
            self.kind_now = Kind::Comm;
            let recv = self.alloc(
                Layout::contiguous(&[kv]),
                f32,
                m,
                "_c10d_functional.all_to_all_single",
            );
            self.kind_now = outer;
            if let Some(t) = dkv_recv.replace(recv) {
                self.drop_rt(t);
            }
            dkv_sent = Some(sent);
            if partial {
                // `_partial_update(grad_query, grad_query_, idx=1, add=True)`: a new cat.
                let c = self.alloc(Layout::contiguous(&q.layout.shape), f32, m, "aten.cat");
                self.drop_rt(std::mem::replace(&mut dq_acc, c));
            }
            // (else `grad_query += grad_query_` in place.)
        }
        // `grad_query = grad_query.to(query.dtype)`.
        let dq = self.cp_to(&dq_acc, q.dtype, m);
        self.drop_rt(dq_acc);
        // `next_grad_kv = dkv_rotater.next_buffer().to(key.dtype)`: the last wait unstashes the
        // sent cat; `grad_key`, `grad_value` are views of the cast buffer.
        let recv = dkv_recv.take().expect("n ≥ 2 steps");
        let cast = self.cp_to(&recv, k.dtype, m);
        if let Some(t) = dkv_sent.take() {
            self.drop_rt(t);
        }
        let dk = self.view(&cast, kl.clone());
        let dv = self.view(&cast, vl.clone());
        self.drop_rt(cast);
        self.drop_rt(dk_acc);
        self.drop_rt(dv_acc);
        // Return: the locals, the rotaters' buffers and the last kernel's gradients die.
        for t in step_locals.into_iter().chain(kernel_out).chain(held) {
            self.drop_rt(t);
        }
        for t in [key, value, next_kv, gathered, kv_stash]
            .into_iter()
            .flatten()
        {
            self.drop_rt(t);
        }
        self.drop_rt(recv);
        [dq, dk, dv]
    }
}
