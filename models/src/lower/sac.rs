//! Selective activation checkpointing (`--checkpoint selective-op`): torchtitan's op-level policy on
//! top of the non-reentrant checkpoint frames (`fwd.rs`).
//!
//! PyTorch's mechanism (`torch/utils/checkpoint.py`): `create_selective_checkpoint_contexts(policy)`
//! makes one `storage = defaultdict(list)` shared by a `_CachingTorchDispatchMode` (the forward
//! context, entered around the region's first run) and a `_CachedTorchDispatchMode` (the recompute
//! context, entered by `recompute_fn`). Both are `TorchDispatchMode`s, below autograd and autocast:
//! they see every ATen op as dispatched, with its cast inputs, while autograd records its node above.
//! * Forward (`_CachingTorchDispatchMode.__torch_dispatch__`): `out = func(*args)`; when the policy
//!   answers `MUST_SAVE`/`PREFER_SAVE`, `storage[func].append(tree_map(lambda x:
//!   _VersionWrapper(_maybe_detach(x)), out))`: every output of the op, as a detached alias of the
//!   same storage, stays alive. The region's nodes still pack only handles (the checkpoint's pack
//!   hook), so everything else dies as in plain non-reentrant checkpointing.
//! * Recomputation (`_CachedTorchDispatchMode.__torch_dispatch__`): a saved op is not run: `out =
//!   storage[func].pop(0)` (the storage's reference goes, the recomputed region holds the tensor as
//!   it would hold the op's result); the other ops run again.
//! * The storage is captured by the recompute context, which `_checkpoint_without_reentrant_generator`'s
//!   `recompute_fn` closes over and the `_CheckpointFrame` holds: entries never popped (ops after an
//!   early stop) go when the frame goes.
//!
//! torchtitan's policy (9dec370 `torchtitan/parallelisms/parallelize_llama.py`
//! `_apply_ac_to_transformer_block`, `_custom_policy`): one `meta = defaultdict(int)` per
//! `context_fn()` call, i.e. per block per forward; each `aten.mm.default` increments
//! `meta["forward_mm_count"]` (`"recompute_mm_count"` in the recomputation), and an op is saved when
//! it is in `_save_list` and is not an mm with an even count: the 1st, 3rd, 5th, ... mm of the block.
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
use std::collections::VecDeque;

/// One block call's selective-checkpoint contexts: the shared storage and the policy's `meta`.
#[derive(Default)]
pub(super) struct SacStorage {
    /// `storage[func]`: the cached outputs of each saved call of `func`, oldest first.
    storage: FxHashMap<&'static str, VecDeque<Vec<Rt>>>,
    /// `meta["forward_mm_count"]`.
    forward_mm_count: u32,
    /// `meta["recompute_mm_count"]`.
    recompute_mm_count: u32,
}

/// The policy's `MUST_SAVE` answer for one op of a checkpointed region.
#[derive(Clone, Copy, Debug)]
pub(super) struct SacSave {
    frame: u32,
    func: &'static str,
    /// In the recomputation (`ctx.is_recompute`).
    pub recompute: bool,
}

/// torchtitan's `_custom_policy` for op `kind`: `Some(func)` for `MUST_SAVE`, `None` for
/// `PREFER_RECOMPUTE`; `mm_count` is the mode's `meta[...]` counter.
fn policy(kind: &OpKind, mm_count: &mut u32) -> Option<&'static str> {
    match kind {
        OpKind::Mm => {
            *mm_count += 1;
            (*mm_count % 2 == 1).then_some("aten.mm")
        }
        OpKind::Sdpa {
            backend: FusedSdpa::Flash | FusedSdpa::MemEfficient,
        } => Some(kind.aten_name()),
        _ => None,
    }
}

impl Lowering<'_> {
    /// `context_fn()` for a new checkpoint frame: fresh contexts under `selective-op`.
    pub(super) fn sac_contexts(&self) -> Option<SacStorage> {
        (self.r.checkpointing == Checkpointing::SelectiveOp).then(SacStorage::default)
    }

    /// Asks the policy of the running frame (forward or recomputation) about op `kind`.
    pub(super) fn sac_policy(&mut self, kind: &OpKind) -> Option<SacSave> {
        let (frame, recompute) = match (self.active_frame, self.recompute_frame) {
            (Some(f), _) => (f, false),
            (None, Some(f)) => (f, true),
            (None, None) => return None,
        };
        let st = self.frames[frame as usize].sac.as_mut()?;
        let count = if recompute {
            &mut st.recompute_mm_count
        } else {
            &mut st.forward_mm_count
        };
        policy(kind, count).map(|func| SacSave {
            frame,
            func,
            recompute,
        })
    }

    /// `_CachingTorchDispatchMode`: `storage[func].append(...)` of detached aliases of `outs`.
    pub(super) fn sac_store(&mut self, d: SacSave, outs: &[Rt]) {
        let mut cached = Vec::with_capacity(outs.len());
        for o in outs {
            let mut c = self.dup(o);
            c.edge = None;
            cached.push(c);
        }
        if let Some(st) = self.frames[d.frame as usize].sac.as_mut() {
            st.storage.entry(d.func).or_default().push_back(cached);
        }
    }

    /// `_CachedTorchDispatchMode`: `storage[func].pop(0)` instead of running the op; autograd,
    /// above the mode, records the op's node with what its formula saves. PyTorch raises when the
    /// storage has no entry ("not found in storage"); the recomputation replays the forward's ops,
    /// so it always has one here.
    pub(super) fn sac_cached(&mut self, kind: &OpKind, ins: &[Rt], d: SacSave) -> Fwd {
        let outs = self.frames[d.frame as usize]
            .sac
            .as_mut()
            .and_then(|st| st.storage.get_mut(d.func))
            .and_then(|q| q.pop_front())
            .unwrap_or_else(|| panic!("{} recomputed but not found in the SAC storage", d.func));
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
        for outs in st.storage.into_values().flatten() {
            for rt in outs {
                self.drop_rt(rt);
            }
        }
    }
}
