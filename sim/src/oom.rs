//! The `CUDA out of memory` message of PyTorch (fact sheet §6.2).
//!
//! SKELETON: the exact text is being verified against PyTorch's source.

use crate::device::Device;

/// Everything PyTorch's OOM message quotes, gathered at the failing `malloc`.
#[derive(Clone, Debug, PartialEq)]
pub struct OomFacts<'a> {
    /// The device (index, total memory, context, other processes).
    pub device: &'a Device,
    /// The §1.4 allocation size of the failing request ("Tried to allocate ...").
    pub alloc_size: u64,
    /// `cudaMemGetInfo` free bytes at the failure.
    pub device_free: u64,
    /// The per-process limit when a memory fraction is set.
    pub allowed: Option<u64>,
    /// `allocated_bytes.all.current`.
    pub allocated_bytes: u64,
    /// `reserved_bytes.all.current`.
    pub reserved_bytes: u64,
}

/// The message PyTorch ≥ 2.2 raises for an allocation that cannot be satisfied.
pub fn out_of_memory_message(facts: &OomFacts<'_>) -> String {
    let _ = facts;
    todo!("oom message")
}

/// The message for requests of 2^60 bytes or more, raised before the allocator is involved (§3).
pub const MORE_THAN_1EB_MESSAGE: &str =
    "CUDA out of memory. Tried to allocate more than 1EB memory.";
