//! Selective activation checkpointing (`--checkpoint selective-op`): torchtitan's op-level policy on
//! top of the non-reentrant checkpoint frames (`fwd.rs`).
//!
//! PyTorch's mechanism (2.15 `torch/utils/checkpoint.py`): `create_selective_checkpoint_contexts(policy)`
//! makes one `storage = defaultdict(dict)` shared by a `_CachingTorchDispatchMode` (the forward
//! context, entered around the region's first run) and a `_CachedTorchDispatchMode` (the recompute
//! context, entered by `recompute_fn`). Both are `TorchDispatchMode`s, below autograd and autocast:
//! they see every ATen op as dispatched, with its cast inputs, while autograd records its node above.
//! * Forward (`_CachingTorchDispatchMode.__torch_dispatch__`): `out = func(*args)`, `idx =
//!   func_counter[func]++`; when the policy answers `MUST_SAVE`/`PREFER_SAVE`, `storage[func][idx] =
//!   tree_map(wrap, out)` (`_VersionWrapper(_detach_helper(x))`): every output of the op, as a
//!   detached alias of the same storage, stays alive; else `storage[func][idx] = _RECOMPUTE`. The
//!   region's nodes still pack only handles (the checkpoint's pack hook), so everything else dies
//!   as in plain non-reentrant checkpointing.
//! * Recomputation (`_CachedTorchDispatchMode.__torch_dispatch__`, which no longer asks the
//!   policy): `idx = func_counter[func]++`; a `_RECOMPUTE` entry runs the op again, a cached one is
//!   returned instead (`func_storage[idx] = _CONSUMED`: the storage's reference goes, the recomputed
//!   region holds the tensor as it would hold the op's result).
//! * The storage is captured by the recompute context, which `_checkpoint_without_reentrant_generator`'s
//!   `recompute_fn` closes over and the `_CheckpointFrame` holds: entries never consumed (ops after
//!   an early stop) go when the frame goes.
//!
//! torchtitan's policy (9dec370 `torchtitan/parallelisms/parallelize_llama.py`
//! `_apply_ac_to_transformer_block`, `_custom_policy`): one `meta = defaultdict(int)` per
//! `context_fn()` call, i.e. per block per forward; each `aten.mm.default` increments
//! `meta["forward_mm_count"]`, and an op is saved when it is in `_save_list` and is not an mm with
//! an even count: the 1st, 3rd, 5th, ... mm of the block (the policy's `"recompute_mm_count"`
//! branch is never taken under 2.15, whose recompute mode does not call the policy).
//! `_save_list`: `aten.mm`, `aten._scaled_dot_product_efficient_attention`,
//! `aten._scaled_dot_product_flash_attention`, `_c10d_functional.reduce_scatter_tensor`, `aten.abs`,
//! `aten.max` (all `.default`). The graphs vramsim builds have no functional collective, `abs` or
//! full-reduction `max` inside a block; `_scaled_dot_product_cudnn_attention` is not in 9dec370's
//! list, so a cuDNN SDPA is recomputed.

use super::fwd::{gemm_saves, sdpa_saves, Fwd};
use super::{Lowering, NodeKind, Rt};
use crate::ops::{FusedSdpa, OpKind};
use crate::recipe::Checkpointing;
use rustc_hash::FxHashMap;

/// One block call's selective-checkpoint contexts: the shared storage, the modes' counters and the
/// policy's `meta`. Only the functions the policy can save are tracked: every other function's
/// entries are all `_RECOMPUTE`, which hold nothing.
#[derive(Default)]
pub(super) struct SacStorage {
    /// `storage[func][idx]`: the cached outputs of call `idx` of `func` (`None`: `_RECOMPUTE` or
    /// `_CONSUMED`).
    storage: FxHashMap<&'static str, Vec<Option<Vec<Rt>>>>,
    /// `_CachedTorchDispatchMode.func_counter`.
    recompute_counter: FxHashMap<&'static str, usize>,
    /// torchtitan's `meta["forward_mm_count"]`.
    forward_mm_count: u32,
}

/// What the selective-checkpoint mode does with one op of a checkpointed region.
#[derive(Clone, Copy, Debug)]
pub(super) struct SacCall {
    frame: u32,
    func: &'static str,
    /// Forward: the policy's answer is `MUST_SAVE`. Recomputation: the entry is cached.
    pub save: bool,
    /// In the recomputation (`_CachedTorchDispatchMode`).
    pub recompute: bool,
}

/// The functions of torchtitan's `_save_list` that vramsim's graphs dispatch inside a block.
fn save_list(kind: &OpKind) -> Option<&'static str> {
    match kind {
        OpKind::Mm
        | OpKind::Sdpa {
            backend: FusedSdpa::Flash | FusedSdpa::MemEfficient,
        } => Some(kind.aten_name()),
        _ => None,
    }
}

/// Which ops of one checkpointed region torchtitan's op-level policy saves (the recomputation
/// returns their stored outputs instead of running them): every other `aten.mm` of the region's
/// forward, from the first (`_custom_policy`'s per-context count), and the flash and
/// memory-efficient attention calls.
pub fn selective_op_saves(kinds: impl IntoIterator<Item = OpKind>) -> Vec<bool> {
    let mut mm = 0u32;
    kinds
        .into_iter()
        .map(|kind| match save_list(&kind) {
            Some("aten.mm") => {
                mm += 1;
                mm % 2 == 1
            }
            Some(_) => true,
            None => false,
        })
        .collect()
}

impl Lowering<'_> {
    /// `context_fn()` for a new checkpoint frame: fresh contexts under `selective-op`.
    pub(super) fn sac_contexts(&self) -> Option<SacStorage> {
        (self.r.checkpointing == Checkpointing::SelectiveOp).then(SacStorage::default)
    }

    /// What the running frame's mode (forward or recomputation) does with op `kind`; `None` for an
    /// op outside the save list, or outside a selective-checkpoint region.
    pub(super) fn sac_policy(&mut self, kind: &OpKind) -> Option<SacCall> {
        let (frame, recompute) = match (self.active_frame, self.recompute_frame) {
            (Some(f), _) => (f, false),
            (None, Some(f)) => (f, true),
            (None, None) => return None,
        };
        let func = save_list(kind)?;
        let st = self.frames[frame as usize].sac.as_mut()?;
        let save = if recompute {
            let idx = st.recompute_counter.entry(func).or_default();
            let cached = st
                .storage
                .get(func)
                .and_then(|calls| calls.get(*idx))
                .is_some_and(|e| e.is_some());
            *idx += 1;
            cached
        } else {
            // torchtitan's `_custom_policy`: count the mm, save it unless the count is even.
            if func == "aten.mm" {
                st.forward_mm_count += 1;
                st.forward_mm_count % 2 == 1
            } else {
                true
            }
        };
        Some(SacCall {
            frame,
            func,
            save,
            recompute,
        })
    }

    /// `_CachingTorchDispatchMode`: `storage[func][idx]`, detached aliases of `outs` when saved.
    pub(super) fn sac_store(&mut self, d: SacCall, outs: &[Rt]) {
        let cached = d.save.then(|| {
            outs.iter()
                .map(|o| {
                    let mut c = self.dup(o);
                    c.edge = None;
                    c
                })
                .collect()
        });
        if let Some(st) = self.frames[d.frame as usize].sac.as_mut() {
            st.storage.entry(d.func).or_default().push(cached);
        }
    }

    /// `_CachedTorchDispatchMode` on a cached entry: the outputs instead of running the op
    /// (`func_storage[idx] = _CONSUMED`); autograd, above the mode, records the op's node with
    /// what its formula saves. Called only when [`Lowering::sac_policy`] found the entry.
    pub(super) fn sac_cached(&mut self, kind: &OpKind, ins: &[Rt], d: SacCall) -> Fwd {
        let outs = self.frames[d.frame as usize]
            .sac
            .as_mut()
            .and_then(|st| {
                let idx = st.recompute_counter.get(d.func)?.checked_sub(1)?;
                st.storage.get_mut(d.func)?.get_mut(idx)?.take()
            })
            .unwrap_or_default();
        let saves = match kind {
            OpKind::Sdpa { backend } => sdpa_saves(*backend),
            _ => gemm_saves(kind, ins),
        };
        Fwd::New(outs, NodeKind::Op(kind.clone()), saves)
    }

    /// The frame dies: its recompute context, and the storage's remaining entries, with it.
    pub(super) fn sac_release(&mut self, f: u32) {
        let Some(st) = self.frames[f as usize].sac.take() else {
            return;
        };
        for outs in st.storage.into_values().flatten().flatten() {
            for rt in outs {
                self.drop_rt(rt);
            }
        }
    }
}
