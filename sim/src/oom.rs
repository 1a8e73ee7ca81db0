//! The `CUDA out of memory` message of PyTorch (fact sheet §6.2).
//!
//! [`out_of_memory_message`] builds the text `DeviceCachingAllocator::malloc` raises when every stage of
//! §3 has failed, byte for byte as in PyTorch 2.15.0 (`c10/cuda/CUDACachingAllocator.cpp`; the literal
//! pieces were checked in the released `libc10_cuda.so`). It is one line:
//!
//! ```text
//! CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which
//! 3.69 MiB is free. Process 1234 has 1.00 GiB memory in use. Including non-PyTorch memory, this process
//! has 77.67 GiB memory in use. 70.00 GiB allowed; Of the allocated memory 76.50 GiB is allocated by
//! PyTorch, and 661.63 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is
//! large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See
//! documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)
//! ```
//!
//! Where the figures come from (§6.1):
//! - "Tried to allocate": the §1.4 segment size of the request, not the request.
//! - "total capacity" and "free": `cudaMemGetInfo`.
//! - the process list (`reportProcessMemoryInfo`): NVML's compute processes in NVML's order; this process
//!   is "Including non-PyTorch memory, this process", the others "Process `<pid>`". NVML's figure for this
//!   process is everything it holds on the device: the reserved bytes plus its CUDA context.
//! - "allowed": only when a memory fraction is set.
//! - "allocated by PyTorch": `allocated_bytes.all.current` plus the free cached blocks of private pools;
//!   "reserved ... but unallocated": `reserved_bytes.all.current` minus both.

use crate::device::Device;
use crate::format::format_size;

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

/// The rarer inputs of the message; [`OomContext::default`] describes an ordinary run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OomContext {
    /// `allocated_in_private_pools`: bytes of the free cached blocks of all private pools (CUDA graphs,
    /// MemPools). PyTorch adds them to "allocated by PyTorch" and names them (§6.1 step 7). Default 0.
    pub allocated_in_private_pools: u64,
    /// Where this process stands in NVML's list of compute processes: 0 puts it before every entry of
    /// `Device::other_processes`, `other_processes.len()` after all of them. Default 0.
    pub this_process_position: usize,
    /// Whether NVML could be asked; without it PyTorch lists no processes at all. Default true.
    pub nvml_available: bool,
}

impl Default for OomContext {
    fn default() -> Self {
        OomContext {
            allocated_in_private_pools: 0,
            this_process_position: 0,
            nvml_available: true,
        }
    }
}

/// The hint and documentation link that end the message (2.15.0; older releases link
/// `https://pytorch.org/docs/stable/notes/cuda.html#environment-variables`). Note the two double spaces.
pub const OOM_HINT: &str = " If reserved but unallocated memory is large try setting \
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory \
Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";

/// The message PyTorch (2.15.0) raises for an allocation that cannot be satisfied, for an ordinary run:
/// no private pools, NVML available, this process listed before the others.
pub fn out_of_memory_message(facts: &OomFacts<'_>) -> String {
    out_of_memory_message_with(facts, &OomContext::default())
}

/// [`out_of_memory_message`] with the rarer inputs spelled out.
pub fn out_of_memory_message_with(facts: &OomFacts<'_>, context: &OomContext) -> String {
    let device = facts.device;
    // §6.1 step 2: "<allowed> allowed; " only when a memory fraction is set.
    let allowed_info = match facts.allowed {
        Some(allowed) => format!("{} allowed; ", format_size(allowed)),
        None => String::new(),
    };
    let proc_info = process_memory_info(facts, context);
    let private = context.allocated_in_private_pools;
    // §6.2 private pools are named only when they hold free cached blocks.
    let private_pool_msg = if private > 0 {
        format!(
            "with {} allocated in private pools (e.g., CUDA Graphs), ",
            format_size(private)
        )
    } else {
        String::new()
    };
    // size_t arithmetic, as in PyTorch.
    let unallocated = facts
        .reserved_bytes
        .wrapping_sub(facts.allocated_bytes)
        .wrapping_sub(private);
    format!(
        "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. \
         {proc_info}{allowed_info}Of the allocated memory {} is allocated by PyTorch, {private_pool_msg}and \
         {} is reserved by PyTorch but unallocated.{OOM_HINT}",
        format_size(facts.alloc_size),
        device.index,
        format_size(device.total_memory),
        format_size(facts.device_free),
        format_size(facts.allocated_bytes.wrapping_add(private)),
        format_size(unallocated),
    )
}

/// §6.1 step 3 `reportProcessMemoryInfo`: one sentence per NVML compute process, each ending in a space.
fn process_memory_info(facts: &OomFacts<'_>, context: &OomContext) -> String {
    if !context.nvml_available {
        return String::new();
    }
    let device = facts.device;
    // NVML's figure for this process: everything it holds, the allocator's segments and its context.
    let this_process = facts.reserved_bytes + device.context_bytes;
    let position = context
        .this_process_position
        .min(device.other_processes.len());
    let mut out = String::new();
    for (i, other) in device.other_processes.iter().enumerate() {
        if i == position {
            push_this_process(&mut out, this_process);
        }
        out.push_str(&format!(
            "Process {} has {} memory in use. ",
            other.pid,
            format_size(other.bytes)
        ));
    }
    if position == device.other_processes.len() {
        push_this_process(&mut out, this_process);
    }
    out
}

fn push_this_process(out: &mut String, bytes: u64) {
    out.push_str(&format!(
        "Including non-PyTorch memory, this process has {} memory in use. ",
        format_size(bytes)
    ));
}

/// The message for requests of 2^60 bytes or more, raised before the allocator is involved (§3).
pub const MORE_THAN_1EB_MESSAGE: &str =
    "CUDA out of memory. Tried to allocate more than 1EB memory.";
