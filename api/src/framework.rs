//! The settings of TensorFlow's and JAX's GPU allocators (`--allocator tf-bfc|jax`): the options and
//! environment variables each framework reads, turned into a BFC configuration or the allocator they
//! select instead.
//!
//! TensorFlow (`tensorflow/core/common_runtime/gpu/gpu_bfc_allocator.cc`, `gpu_device.cc`,
//! `gpu_process_state.cc`):
//! - `allow_growth` (`tf.config.experimental.set_memory_growth`, `--allow-growth`), overridden by
//!   `TF_FORCE_GPU_ALLOW_GROWTH=true|false` (`GetAllowGrowthValue`); default false: preallocation;
//! - garbage collection of free regions unless `TF_ENABLE_GPU_GARBAGE_COLLECTION=false`
//!   (`GetGarbageCollectionValue`);
//! - the memory limit: a logical device's `memory_limit` (`--memory-limit`), else
//!   `per_process_gpu_memory_fraction × total` (`--memory-fraction`), else free memory less
//!   `MinSystemMemory` (`SingleVirtualDeviceMemoryLimit`);
//! - `TF_GPU_ALLOCATOR=cuda_malloc_async`: CUDA's stream-ordered pool instead of BFC
//!   (`GpuCudaMallocAsyncAllocator`, whose release threshold is the memory limit).
//!
//! JAX (docs.jax.dev "GPU memory allocation"; `xla/pjrt/gpu/gpu_helpers.cc` `CreateBFCAllocator`):
//! - preallocation of `XLA_PYTHON_CLIENT_MEM_FRACTION` (`--memory-fraction`; default 0.75) of the
//!   *total* memory (jaxlib ≥ 0.4.1), the BFC memory limit;
//! - `XLA_PYTHON_CLIENT_PREALLOCATE=false` (`--allow-growth`): the same limit, regions grown on demand;
//! - `XLA_PYTHON_CLIENT_ALLOCATOR=platform`: no caching, every buffer its own `cudaMalloc`/`cudaFree`;
//! - garbage collection left off (the `BFCAllocator::Options` default).

use anyhow::{bail, Result};
use vramsim_sim::allocator::bfc::{tf_default_memory_limit, BfcConfig, BfcFlavor};
use vramsim_sim::device::Device;

/// JAX's default `XLA_PYTHON_CLIENT_MEM_FRACTION`.
pub const JAX_DEFAULT_MEM_FRACTION: f64 = 0.75;

/// The environment variables `--env` accepts.
pub const ENV_VARS: &[&str] = &[
    "TF_FORCE_GPU_ALLOW_GROWTH",
    "TF_ENABLE_GPU_GARBAGE_COLLECTION",
    "TF_GPU_ALLOCATOR",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
];

/// What a framework's settings select.
#[derive(Clone, Debug, PartialEq)]
pub enum FrameworkAllocator {
    /// The BFC allocator with this configuration.
    Bfc(BfcConfig),
    /// TensorFlow's `cuda_malloc_async`: CUDA's pool, holding up to this limit.
    CudaMallocAsync {
        /// The memory limit (the pool's release threshold and TF's `bytes_limit`).
        memory_limit: u64,
    },
    /// JAX's `platform` allocator: no caching.
    Platform,
}

/// The framework settings given on the command line.
#[derive(Clone, Debug, Default)]
pub struct FrameworkSettings<'a> {
    /// `--allow-growth`.
    pub allow_growth: bool,
    /// `--memory-limit`, in bytes.
    pub memory_limit: Option<u64>,
    /// `--memory-fraction`.
    pub memory_fraction: Option<f64>,
    /// `--env KEY=VALUE` items.
    pub env: &'a [String],
}

/// The value of one `--env` variable, the last one given winning; unknown names are refused.
fn env_value<'a>(env: &'a [String], name: &str) -> Result<Option<&'a str>> {
    let mut value = None;
    for item in env {
        let Some((key, v)) = item.split_once('=') else {
            bail!(
                "invalid --env {item:?}: expected KEY=VALUE, KEY one of {}",
                ENV_VARS.join(", ")
            );
        };
        if !ENV_VARS.contains(&key) {
            bail!(
                "invalid --env {item:?}: vramsim models {}",
                ENV_VARS.join(", ")
            );
        }
        if key == name {
            value = Some(v);
        }
    }
    Ok(value)
}

/// A `true`/`false` variable (the frameworks compare the exact strings).
fn env_bool(env: &[String], name: &str) -> Result<Option<bool>> {
    match env_value(env, name)? {
        None => Ok(None),
        Some("true") => Ok(Some(true)),
        Some("false") => Ok(Some(false)),
        Some(other) => bail!("invalid --env {name}={other}: valid values are true and false"),
    }
}

/// TensorFlow's allocator for these settings on `device` (compute capability major `cc_major`).
pub fn tensorflow(
    settings: &FrameworkSettings,
    device: &Device,
    cc_major: u32,
) -> Result<FrameworkAllocator> {
    let env = settings.env;
    let allow_growth = env_bool(env, "TF_FORCE_GPU_ALLOW_GROWTH")?.unwrap_or(settings.allow_growth);
    let garbage_collection = env_bool(env, "TF_ENABLE_GPU_GARBAGE_COLLECTION")?.unwrap_or(true);
    let memory_limit = match (settings.memory_limit, settings.memory_fraction) {
        (Some(limit), _) => limit,
        (None, Some(fraction)) => (device.total_memory as f64 * fraction) as u64,
        (None, None) => tf_default_memory_limit(device.free_memory(0), cc_major),
    };
    for key in [
        "XLA_PYTHON_CLIENT_PREALLOCATE",
        "XLA_PYTHON_CLIENT_MEM_FRACTION",
        "XLA_CLIENT_MEM_FRACTION",
        "XLA_PYTHON_CLIENT_ALLOCATOR",
    ] {
        if env_value(env, key)?.is_some() {
            bail!("--env {key} is a JAX setting: use it with --allocator jax");
        }
    }
    match env_value(env, "TF_GPU_ALLOCATOR")? {
        None | Some("") | Some("bfc") => Ok(FrameworkAllocator::Bfc(BfcConfig {
            memory_limit,
            allow_growth,
            garbage_collection,
            fragmentation_fraction: 0.0,
            flavor: BfcFlavor::TensorFlow,
        })),
        Some("cuda_malloc_async") => Ok(FrameworkAllocator::CudaMallocAsync { memory_limit }),
        Some(other) => bail!(
            "invalid --env TF_GPU_ALLOCATOR={other}: valid values are cuda_malloc_async and bfc"
        ),
    }
}

/// JAX's allocator for these settings on `device`.
pub fn jax(settings: &FrameworkSettings, device: &Device) -> Result<FrameworkAllocator> {
    let env = settings.env;
    for key in [
        "TF_FORCE_GPU_ALLOW_GROWTH",
        "TF_ENABLE_GPU_GARBAGE_COLLECTION",
        "TF_GPU_ALLOCATOR",
    ] {
        if env_value(env, key)?.is_some() {
            bail!("--env {key} is a TensorFlow setting: use it with --allocator tf-bfc");
        }
    }
    let preallocate =
        env_bool(env, "XLA_PYTHON_CLIENT_PREALLOCATE")?.unwrap_or(!settings.allow_growth);
    let fraction_text = match env_value(env, "XLA_PYTHON_CLIENT_MEM_FRACTION")? {
        Some(v) => Some(v),
        None => env_value(env, "XLA_CLIENT_MEM_FRACTION")?,
    };
    let fraction = match fraction_text {
        Some(text) => match text.parse::<f64>() {
            Ok(f) if f > 0.0 && f <= 1.0 => f,
            _ => bail!("invalid --env XLA_PYTHON_CLIENT_MEM_FRACTION={text}: a fraction in (0, 1]"),
        },
        None => settings.memory_fraction.unwrap_or(JAX_DEFAULT_MEM_FRACTION),
    };
    let memory_limit = settings
        .memory_limit
        .unwrap_or((device.total_memory as f64 * fraction) as u64);
    match env_value(env, "XLA_PYTHON_CLIENT_ALLOCATOR")? {
        None | Some("default") | Some("bfc") => Ok(FrameworkAllocator::Bfc(BfcConfig {
            memory_limit,
            allow_growth: !preallocate,
            garbage_collection: false,
            fragmentation_fraction: 0.0,
            flavor: BfcFlavor::Jax,
        })),
        Some("platform") => Ok(FrameworkAllocator::Platform),
        Some(other) => bail!("invalid --env XLA_PYTHON_CLIENT_ALLOCATOR={other}: valid values are default, bfc and platform"),
    }
}
