//! NCCL's own device memory on one rank: buffers NCCL allocates with `cuMem`/`cudaMalloc` outside
//! PyTorch's caching allocator. They count in the device memory used (nvidia-smi, and the
//! "process has … memory in use" of an out-of-memory message) and leave the allocator less room,
//! but never appear in `memory_reserved()`. A documented estimate, overridable with
//! `--nccl-memory`.
//!
//! Per communicator, per channel, a ring connects each rank to a receiving and a sending peer
//! (NVIDIA/nccl `src/transport/p2p.cc`, `p2pRecvSetup`/`p2pSendSetup`, intra-node P2P transport):
//!
//! * the receiver holds `sizeof(ncclRecvMem)` (4 KiB, `MEM_ALIGN`) plus the FIFO of every protocol:
//!   LL 512 KiB (`DEFAULT_LL_BUFFSIZE` = 8 lines × 512 threads × 8 steps × 16 B), LL128
//!   4,915,200 B (120 × 640 × 8 × 8 B) and Simple 4 MiB (`DEFAULT_BUFFSIZE`), the last on the sender
//!   instead in P2P-read mode (sm80 over NVLink, `paths.cc`);
//! * the sender holds `sizeof(ncclSendMem)` (4 KiB);
//! * each side is rounded up to `CUDA_IPC_MIN` (2 MiB): 10 MiB + 2 MiB in write mode, 6 + 6 MiB in
//!   read mode — 12 MiB per channel either way (nccl#1685 logs 10,485,760 B and 2,097,152 B
//!   allocations on 8×H100).
//!
//! A rank joins one communicator per parallel dimension above 1 (PyTorch makes one NCCL
//! communicator per process group on its first collective; a device mesh has one group per
//! dimension; pipeline send/recv use the pipeline group's). `nn.DataParallel`'s one process
//! makes one clique over its devices. The channel count comes from the GPU's links
//! ([`crate::links`]). Not counted: tree-only connections (small all-reduces), NVLS and
//! CollNet buffers, and the network transport's buffers between nodes.

use vramsim_models::{Parallel, Shard};

use crate::links::Links;

/// The FIFO bytes of one ring channel on one rank, receiver and sender side, each rounded up to
/// `CUDA_IPC_MIN`.
pub const CHANNEL_BYTES: u64 = {
    const MEM_ALIGN: u64 = 4096;
    const CUDA_IPC_MIN: u64 = 2 * 1024 * 1024;
    const LL: u64 = 8 * 512 * 8 * 16;
    const LL128: u64 = 120 * 640 * 8 * 8;
    const SIMPLE: u64 = 4 * 1024 * 1024;
    let recv = (MEM_ALIGN + LL + LL128 + SIMPLE).div_ceil(CUDA_IPC_MIN) * CUDA_IPC_MIN;
    let send = MEM_ALIGN.div_ceil(CUDA_IPC_MIN) * CUDA_IPC_MIN;
    recv + send
};

/// What NCCL holds on one rank of a layout.
#[derive(Clone, Debug, PartialEq)]
pub struct NcclMemory {
    /// The process groups the rank communicates in: (dimension, ranks in it).
    pub communicators: Vec<(&'static str, u32)>,
    /// Channels per communicator.
    pub channels: u32,
    /// Bytes on the rank: the estimate, or `--nccl-memory`.
    pub bytes: u64,
    /// Whether `bytes` was given (`--nccl-memory`) rather than estimated.
    pub given: bool,
}

/// NCCL's device memory on one rank of `parallel` on GPUs with `links`; `given` (`--nccl-memory`)
/// replaces the estimate for layouts that communicate.
pub fn nccl_memory(parallel: &Parallel, links: &Links, given: Option<u64>) -> NcclMemory {
    let dims = if parallel.shard == Shard::DataParallel {
        vec![("dataparallel", parallel.dp)]
    } else {
        vec![
            ("dp", parallel.dp),
            ("tp", parallel.tp),
            ("pp", parallel.pp),
        ]
    };
    let communicators: Vec<(&'static str, u32)> =
        dims.into_iter().filter(|&(_, n)| n > 1).collect();
    let given = given.filter(|_| !communicators.is_empty());
    let estimate = communicators.len() as u64 * u64::from(links.nccl_channels) * CHANNEL_BYTES;
    NcclMemory {
        channels: links.nccl_channels,
        bytes: given.unwrap_or(estimate),
        given: given.is_some(),
        communicators,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::links::links;

    #[test]
    fn a_channel_holds_twelve_mib() {
        // 10 MiB receiver + 2 MiB sender, the two allocation sizes nccl#1685 logs.
        assert_eq!(CHANNEL_BYTES, 10_485_760 + 2_097_152);
    }

    #[test]
    fn one_communicator_per_dimension_above_one() {
        let h100 = links(Some("h100-80gb"));
        let single = nccl_memory(&Parallel::default(), h100, None);
        assert_eq!(single.bytes, 0);
        let ddp = Parallel {
            dp: 8,
            shard: Shard::Ddp,
            ..Parallel::default()
        };
        assert_eq!(nccl_memory(&ddp, h100, None).bytes, 32 * 12 * 1024 * 1024);
        let three = Parallel {
            dp: 2,
            tp: 2,
            pp: 2,
            shard: Shard::Fsdp2,
            ..Parallel::default()
        };
        assert_eq!(
            nccl_memory(&three, h100, None).bytes,
            3 * 32 * 12 * 1024 * 1024
        );
        let pcie = links(Some("rtx4090"));
        assert_eq!(nccl_memory(&ddp, pcie, None).bytes, 4 * 12 * 1024 * 1024);
        assert_eq!(nccl_memory(&ddp, h100, Some(1 << 30)).bytes, 1 << 30);
        // nothing to communicate: nothing given is held
        assert_eq!(
            nccl_memory(&Parallel::default(), h100, Some(1 << 30)).bytes,
            0
        );
    }
}
