//! `PYTORCH_CUDA_ALLOC_CONF`: the allocator settings and their parser (fact sheet §12).
//!
//! SKELETON: the parser is being written; the struct and its defaults are the contract.

use std::fmt;

use crate::rounding::LARGE_BUFFER;

/// Which allocator backend the settings string selects (`backend:native|cudaMallocAsync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backend {
    /// The caching allocator.
    #[default]
    Native,
    /// CUDA's stream-ordered allocator.
    CudaMallocAsync,
}

/// Every setting of the native caching allocator, with PyTorch's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorConfig {
    /// The settings string as given (`allocator_settings["PYTORCH_CUDA_ALLOC_CONF"]`).
    pub settings: String,
    /// `backend`.
    pub backend: Backend,
    /// `max_split_size_mb` in bytes; `u64::MAX` (SIZE_MAX) when unset.
    pub max_split_size: u64,
    /// `max_non_split_rounding_mb` in bytes (default 20 MiB).
    pub max_non_split_rounding_size: u64,
    /// `roundup_power2_divisions`: 16 entries, entry k for sizes in [2^(20+k), 2^(21+k)) (§12.4).
    pub roundup_power2_divisions: [u64; 16],
    /// `garbage_collection_threshold` (0 = off).
    pub garbage_collection_threshold: f64,
    /// `expandable_segments`.
    pub expandable_segments: bool,
    /// `release_lock_on_cudamalloc` (no effect on memory).
    pub release_lock_on_cudamalloc: bool,
    /// `pinned_use_cuda_host_register` (host allocator only).
    pub pinned_use_cuda_host_register: bool,
    /// `pinned_num_register_threads` (host allocator only).
    pub pinned_num_register_threads: u64,
    /// `pinned_use_background_threads` (host allocator only).
    pub pinned_use_background_threads: bool,
    /// `pinned_reserve_segment_size_mb` (host allocator only).
    pub pinned_reserve_segment_size_mb: u64,
    /// `graph_capture_record_stream_reuse` (CUDA graphs only).
    pub graph_capture_record_stream_reuse: bool,
    /// `per_process_memory_fraction`, when given.
    pub per_process_memory_fraction: Option<f64>,
    /// `large_segment_size_mb` in bytes (default 20 MiB): the 1–10 MiB segment size and the large
    /// expandable page.
    pub large_segment_size: u64,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            settings: String::new(),
            backend: Backend::Native,
            max_split_size: u64::MAX,
            max_non_split_rounding_size: LARGE_BUFFER,
            roundup_power2_divisions: [0; 16],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            release_lock_on_cudamalloc: false,
            pinned_use_cuda_host_register: false,
            pinned_num_register_threads: 1,
            pinned_use_background_threads: false,
            pinned_reserve_segment_size_mb: 0,
            graph_capture_record_stream_reuse: false,
            per_process_memory_fraction: None,
            large_segment_size: LARGE_BUFFER,
        }
    }
}

/// A settings string PyTorch would reject, with PyTorch's own message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The text PyTorch raises.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

impl AllocatorConfig {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` string.
    pub fn parse(settings: &str) -> Result<AllocatorConfig, ConfigError> {
        let _ = settings;
        todo!("config parser")
    }

    /// §12.4 lookup: the divisions that apply to a request of `size` bytes.
    #[inline]
    pub fn roundup_power2_divisions(&self, size: u64) -> u64 {
        let log2 = 63 - size.max(1).leading_zeros() as i64;
        let index = (log2 - 20).clamp(0, 15) as usize;
        self.roundup_power2_divisions[index]
    }

    /// Whether the garbage collector of §5.4 may run (needs a threshold; the memory fraction is checked by
    /// the allocator).
    pub fn garbage_collection_enabled(&self) -> bool {
        self.garbage_collection_threshold > 0.0
    }
}
