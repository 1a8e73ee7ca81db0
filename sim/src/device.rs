//! The device model: capacity, the CUDA context, other processes, and GPU presets.
//!
//! SKELETON: presets are being researched.

/// Memory held on the device by another process (shown by NVML in OOM messages).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtherProcess {
    /// Its process id.
    pub pid: u32,
    /// Bytes it holds.
    pub bytes: u64,
}

/// A GPU as the allocator sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Device {
    /// Device index (`GPU 0` in messages).
    pub index: u32,
    /// Marketing name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// `torch.cuda.get_device_properties().total_memory` in bytes.
    pub total_memory: u64,
    /// Bytes the CUDA context of this process takes (invisible to allocator stats).
    pub context_bytes: u64,
    /// Memory held by other processes.
    pub other_processes: Vec<OtherProcess>,
}

impl Device {
    /// A device with the given total memory, no context and no other processes.
    pub fn with_capacity(total_memory: u64) -> Device {
        Device {
            index: 0,
            name: "custom".to_string(),
            total_memory,
            context_bytes: 0,
            other_processes: Vec::new(),
        }
    }

    /// Bytes used on the device by everything except this process's allocator.
    pub fn non_allocator_bytes(&self) -> u64 {
        self.context_bytes + self.other_processes.iter().map(|p| p.bytes).sum::<u64>()
    }

    /// `cudaMemGetInfo` free bytes when the allocator holds `reserved` bytes.
    pub fn free_memory(&self, reserved: u64) -> u64 {
        self.total_memory
            .saturating_sub(self.non_allocator_bytes())
            .saturating_sub(reserved)
    }
}
