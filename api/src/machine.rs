//! The options that describe the simulated machine: GPU, capacity, context, allocator and its settings.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use vramsim_sim::allocator::bfc::BfcAllocator;
use vramsim_sim::allocator::caching::CachingAllocator;
use vramsim_sim::allocator::cuda_async::{CudaAsyncAllocator, CudaAsyncConfig};
use vramsim_sim::allocator::cuda_malloc::CudaMallocAllocator;
use vramsim_sim::allocator::Allocator;
use vramsim_sim::calibration::{Calibration, TimedAllocator};
use vramsim_sim::config::{AllocatorConfig, Backend};
use vramsim_sim::device::{
    find_preset, parse_cuda, parse_size, ContextChoice, Device, OtherProcess, UnknownGpu,
    CONTEXT_MEASUREMENTS, DEFAULT_CUDA, DEFAULT_GPU, PRESETS,
};
use vramsim_sim::format::format_size;

/// The allocator models.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AllocatorKind {
    /// PyTorch's CUDA caching allocator (the default native backend).
    Pytorch,
    /// No caching: every tensor is its own cudaMalloc (PYTORCH_NO_CUDA_MEMORY_CACHING=1).
    CudaMalloc,
    /// CUDA's stream-ordered pool (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync); also chosen by that
    /// --alloc-conf with the default allocator.
    CudaAsync,
    /// TensorFlow's BFC allocator (preallocates its memory limit unless --allow-growth; --env
    /// TF_GPU_ALLOCATOR=cuda_malloc_async and the other TF_* variables).
    TfBfc,
    /// JAX/XLA's BFC allocator (preallocates 75% of the memory unless --allow-growth; --env
    /// XLA_PYTHON_CLIENT_*).
    Jax,
}

impl AllocatorKind {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            AllocatorKind::Pytorch => "pytorch",
            AllocatorKind::CudaMalloc => "cuda-malloc",
            AllocatorKind::CudaAsync => "cuda-async",
            AllocatorKind::TfBfc => "tf-bfc",
            AllocatorKind::Jax => "jax",
        }
    }

    /// Whether the allocator is PyTorch's (reads PYTORCH_CUDA_ALLOC_CONF and the memory fraction as
    /// PyTorch does) rather than TensorFlow's or JAX's.
    pub fn is_pytorch(self) -> bool {
        !matches!(self, AllocatorKind::TfBfc | AllocatorKind::Jax)
    }
}

/// Machine options shared by every command that simulates a device.
#[derive(Args, Clone, Debug)]
pub struct MachineArgs {
    /// Allocator model.
    #[arg(long, value_enum, default_value_t = AllocatorKind::Pytorch)]
    pub allocator: AllocatorKind,
    /// PYTORCH_CUDA_ALLOC_CONF settings, e.g. "expandable_segments:True" or
    /// "max_split_size_mb:128,garbage_collection_threshold:0.6".
    #[arg(long, default_value = "")]
    pub alloc_conf: String,
    /// GPU preset (see `vramsim gpus`); the default is an 80 GB H100.
    #[arg(long, conflicts_with = "capacity")]
    pub gpu: Option<String>,
    /// A calibration.json written by `vramsim-validate calibrate` on a real GPU: its measured name, total
    /// memory and CUDA context replace a preset's, its stream-ordered pool figures tune
    /// --allocator cuda-async, and its allocation latencies time device allocations and frees.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["gpu", "capacity"])]
    pub calibration: Option<PathBuf>,
    /// Device capacity instead of a preset, e.g. 24GiB, 80GB, 17179869184.
    #[arg(long)]
    pub capacity: Option<String>,
    /// CUDA context size of this process (default: the preset's figure), e.g. 500MiB.
    #[arg(long)]
    pub context: Option<String>,
    /// Memory held on the GPU by other processes: sizes, optionally with the process id that OOM messages
    /// name, e.g. "2GiB" or "4242=2GiB,4243=512MiB" (ids default to 1, 2, ...).
    #[arg(long)]
    pub other_processes: Option<String>,
    /// torch.cuda.set_per_process_memory_fraction(F), F in [0, 1].
    #[arg(long)]
    pub memory_fraction: Option<f64>,
    /// CUDA major version of the PyTorch build (11, 12 or 13; default 13, what `pip install torch`
    /// gives): picks the preset's CUDA context (`vramsim gpus --sources`); --context overrides it.
    #[arg(long, value_name = "VERSION", value_parser = cuda_version)]
    pub cuda: Option<u32>,
    /// The CUDA device index messages name (`GPU N`): the recorded device when replaying a snapshot.
    #[arg(skip)]
    pub device_index: u32,
    /// Device memory libraries allocate themselves, outside the caching allocator, counted with the
    /// context (cuBLAS's own workspace pools under PyTorch 1.10: the lowered trace's
    /// `cublas_own_bytes`).
    #[arg(skip)]
    pub library_bytes: u64,
    /// NCCL's own device memory per rank of a parallel layout, outside the caching allocator
    /// (default: 12 MiB per channel × the GPU's NCCL channels × one communicator per parallel
    /// dimension above 1; see `vramsim_api::nccl`), e.g. 1GiB or 0.
    #[arg(long, value_name = "SIZE")]
    pub nccl_memory: Option<String>,
    /// --allocator tf-bfc|jax: grow the allocator's regions on demand instead of preallocating
    /// (TF's set_memory_growth, JAX's XLA_PYTHON_CLIENT_PREALLOCATE=false).
    #[arg(long)]
    pub allow_growth: bool,
    /// --allocator tf-bfc|jax: the allocator's memory limit, e.g. 10GiB (a TF logical device's
    /// memory_limit); the default is TF's free memory less its system reserve, JAX's 75% of the total.
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// --allocator tf-bfc|jax: framework environment variables, e.g. TF_GPU_ALLOCATOR=cuda_malloc_async,
    /// TF_FORCE_GPU_ALLOW_GROWTH=true, XLA_PYTHON_CLIENT_MEM_FRACTION=.5, XLA_PYTHON_CLIENT_ALLOCATOR=platform.
    #[arg(long, value_name = "KEY=VALUE")]
    pub env: Vec<String>,
}

/// `--cuda`: a CUDA major version vramsim has context figures for.
fn cuda_version(s: &str) -> Result<u32, String> {
    parse_cuda(s).map_err(|e| e.to_string())
}

/// A configured allocator with what describes it in reports.
pub struct Machine {
    /// The allocator, ready to replay.
    pub allocator: Box<dyn Allocator>,
    /// The settings string in force.
    pub alloc_conf: String,
    /// The parsed settings in force (the memory fraction included).
    pub config: AllocatorConfig,
    /// The memory fraction in force.
    pub memory_fraction: Option<f64>,
    /// The most bytes the allocator may hold, where it has a limit below the device: PyTorch's
    /// `fraction × total memory` (`set_per_process_memory_fraction`), a BFC allocator's memory limit,
    /// TF's `cuda_malloc_async` pool limit.
    pub memory_limit: Option<u64>,
}

impl MachineArgs {
    /// NCCL's device memory on one rank of `parallel` on this machine's GPU: `--nccl-memory`, or
    /// the estimate from the layout's communicators and the preset's links ([`crate::nccl`]).
    pub fn nccl(&self, parallel: &vramsim_models::Parallel) -> Result<crate::nccl::NcclMemory> {
        let given = match &self.nccl_memory {
            Some(s) => Some(parse_size(s).context("invalid --nccl-memory")?),
            None => None,
        };
        let links = crate::links::links(self.gpu.as_deref());
        Ok(crate::nccl::nccl_memory(parallel, links, given))
    }

    /// The calibration file named by --calibration, read and checked.
    pub fn calibration(&self) -> Result<Option<Calibration>> {
        match &self.calibration {
            Some(path) => Ok(Some(
                Calibration::read(path).context("invalid --calibration")?,
            )),
            None => Ok(None),
        }
    }

    /// The device memory a training step's kernels add to the context (lazy module loading) on
    /// the preset these options name, and where the figure comes from; `None` for a device given by
    /// --capacity or --calibration, and where no figure was measured (`GpuPreset::step_modules`).
    pub fn step_modules_choice(&self) -> Option<ContextChoice> {
        if self.calibration.is_some() || self.capacity.is_some() {
            return None;
        }
        find_preset(self.gpu.as_deref().unwrap_or(DEFAULT_GPU))?
            .step_modules(self.cuda.unwrap_or(DEFAULT_CUDA))
    }

    /// The CUDA context these options give the device, and where the figure comes from.
    pub fn context_choice(&self) -> ContextChoice {
        let cuda = self.cuda.unwrap_or(DEFAULT_CUDA);
        let given = |source: &str| ContextChoice {
            bytes: 0,
            cuda,
            source: source.to_string(),
        };
        if let Some(context) = &self.context {
            return ContextChoice {
                bytes: parse_size(context).unwrap_or(0),
                ..given("given with --context")
            };
        }
        if self.calibration.is_some() {
            return given("measured by vramsim-validate calibrate (--calibration)");
        }
        if self.capacity.is_some() {
            return given("none: --capacity describes memory only (give --context)");
        }
        match find_preset(self.gpu.as_deref().unwrap_or(DEFAULT_GPU)) {
            Some(preset) => preset.context(cuda),
            None => given("unknown preset"),
        }
    }

    /// The device these options describe, with the calibration read from --calibration if any.
    pub fn device(&self, calibration: Option<&Calibration>) -> Result<Device> {
        let mut device = match (calibration, &self.gpu, &self.capacity) {
            (Some(calibration), _, _) => calibration.device(),
            (None, _, Some(capacity)) => {
                Device::with_capacity(parse_size(capacity).context("invalid --capacity")?)
            }
            (None, gpu, None) => {
                let name = gpu.as_deref().unwrap_or(DEFAULT_GPU);
                find_preset(name)
                    .ok_or_else(|| UnknownGpu {
                        name: name.to_string(),
                    })?
                    .device_with_cuda(self.cuda.unwrap_or(DEFAULT_CUDA))
            }
        };
        device.index = self.device_index;
        if let Some(context) = &self.context {
            device.context_bytes = parse_size(context).context("invalid --context")?;
        }
        device.context_bytes = device.context_bytes.saturating_add(self.library_bytes);
        if let Some(others) = &self.other_processes {
            device.other_processes = parse_other_processes(others)?;
        }
        if device.non_allocator_bytes() > device.total_memory {
            bail!(
                "the CUDA context and other processes ({}) exceed the device's {}",
                format_size(device.non_allocator_bytes()),
                format_size(device.total_memory)
            );
        }
        Ok(device)
    }

    /// Builds the allocator these options describe.
    pub fn build(&self) -> Result<Machine> {
        let calibration = self.calibration()?;
        let device = self.device(calibration.as_ref())?;
        if !self.allocator.is_pytorch() {
            return self.build_framework(device);
        }
        if self.allow_growth || self.memory_limit.is_some() || !self.env.is_empty() {
            bail!(
                "--allow-growth, --memory-limit and --env are TensorFlow/JAX settings: use them with --allocator tf-bfc or --allocator jax (PyTorch's allocator reads --alloc-conf and --memory-fraction)"
            );
        }
        let mut config = AllocatorConfig::parse(&self.alloc_conf)
            .map_err(|e| anyhow::anyhow!("invalid --alloc-conf {:?}: {e}", self.alloc_conf))?;
        if let Some(fraction) = self.memory_fraction {
            // torch.cuda.set_per_process_memory_fraction's own check (§12.3).
            if !(0.0..=1.0).contains(&fraction) {
                bail!("invalid --memory-fraction: Invalid fraction value: {fraction}. Allowed range: 0~1");
            }
            config.per_process_memory_fraction = Some(fraction);
        }
        let memory_fraction = config.per_process_memory_fraction;
        // backend:cudaMallocAsync makes PyTorch use the stream-ordered pool instead of its own cache.
        let kind = match (self.allocator, config.backend) {
            (AllocatorKind::Pytorch, Backend::CudaMallocAsync) => AllocatorKind::CudaAsync,
            (kind, _) => kind,
        };
        let vmm = kind == AllocatorKind::Pytorch && config.expandable_segments;
        let device_total = device.total_memory;
        let allocator: Box<dyn Allocator> = match kind {
            AllocatorKind::Pytorch => Box::new(CachingAllocator::new(config.clone(), device)),
            AllocatorKind::TfBfc | AllocatorKind::Jax => {
                unreachable!("TensorFlow's and JAX's allocators are built by build_framework")
            }
            AllocatorKind::CudaMalloc => Box::new(CudaMallocAllocator::new(device)),
            AllocatorKind::CudaAsync => {
                let base = CudaAsyncConfig {
                    memory_fraction,
                    ..CudaAsyncConfig::pytorch()
                };
                let pool = match &calibration {
                    Some(calibration) => calibration.async_config(base),
                    None => base,
                };
                Box::new(CudaAsyncAllocator::new(pool, device))
            }
        };
        // Measured latencies time device allocations (calibration module documentation).
        let allocator = match calibration.as_ref().and_then(|c| c.latency_model(vmm)) {
            Some(latency) => Box::new(TimedAllocator::new(allocator, latency)),
            None => allocator,
        };
        let memory_limit = memory_fraction.map(|f| (f * device_total as f64) as u64);
        Ok(Machine {
            allocator,
            alloc_conf: self.alloc_conf.clone(),
            config,
            memory_fraction,
            memory_limit,
        })
    }
}

impl MachineArgs {
    /// `--allocator tf-bfc|jax`: the framework's allocator on `device` (see [`crate::framework`]).
    fn build_framework(&self, device: Device) -> Result<Machine> {
        use crate::framework::{self, FrameworkAllocator, FrameworkSettings};
        if !self.alloc_conf.is_empty() {
            bail!(
                "--alloc-conf {:?} is PyTorch's PYTORCH_CUDA_ALLOC_CONF: the {} allocator does not read it; use --allow-growth, --memory-limit, --memory-fraction or --env",
                self.alloc_conf,
                self.allocator.name()
            );
        }
        if let Some(fraction) = self.memory_fraction {
            if !(fraction > 0.0 && fraction <= 1.0) {
                bail!("invalid --memory-fraction {fraction}: a fraction in (0, 1]");
            }
        }
        let memory_limit = match &self.memory_limit {
            Some(text) => Some(parse_size(text).context("invalid --memory-limit")?),
            None => None,
        };
        let settings = FrameworkSettings {
            allow_growth: self.allow_growth,
            memory_limit,
            memory_fraction: self.memory_fraction,
            env: &self.env,
        };
        let chosen = if self.allocator == AllocatorKind::TfBfc {
            // MinSystemMemory depends on the compute capability: the preset's, else Hopper's.
            let cc_major = find_preset(self.gpu.as_deref().unwrap_or(DEFAULT_GPU))
                .filter(|_| self.capacity.is_none() && self.calibration.is_none())
                .map_or(9, |p| p.compute_capability.0);
            framework::tensorflow(&settings, &device, cc_major)?
        } else {
            framework::jax(&settings, &device)?
        };
        let memory_limit = match &chosen {
            FrameworkAllocator::Bfc(config) => Some(config.memory_limit),
            FrameworkAllocator::CudaMallocAsync { memory_limit } => Some(*memory_limit),
            FrameworkAllocator::Platform => None,
        };
        let allocator: Box<dyn Allocator> = match chosen {
            FrameworkAllocator::Bfc(config) => Box::new(BfcAllocator::new(config, device)),
            FrameworkAllocator::CudaMallocAsync { memory_limit } => {
                let pool = CudaAsyncConfig {
                    release_threshold: memory_limit,
                    memory_fraction: Some(memory_limit as f64 / device.total_memory as f64),
                    ..CudaAsyncConfig::pytorch()
                };
                Box::new(CudaAsyncAllocator::new(pool, device))
            }
            FrameworkAllocator::Platform => Box::new(CudaMallocAllocator::new(device)),
        };
        Ok(Machine {
            allocator,
            alloc_conf: String::new(),
            config: AllocatorConfig::default(),
            memory_fraction: self.memory_fraction,
            memory_limit,
        })
    }
}

/// Parses `--other-processes`: comma-separated `[PID=]SIZE` items.
fn parse_other_processes(text: &str) -> Result<Vec<OtherProcess>> {
    text.split(',')
        .enumerate()
        .map(|(i, item)| {
            let (pid, size) = match item.split_once('=') {
                Some((pid, size)) => (
                    pid.trim().parse().with_context(|| {
                        format!("invalid --other-processes: {pid:?} is not a process id")
                    })?,
                    size,
                ),
                None => (i as u32 + 1, item),
            };
            let bytes = parse_size(size).context("invalid --other-processes")?;
            Ok(OtherProcess { pid, bytes })
        })
        .collect()
}

/// `vramsim gpus`: the presets, with where each capacity comes from when `sources` is set.
pub fn list_gpus(sources: bool) -> Result<()> {
    println!(
        "{:<14} {:<28} {:>16} {:>11}",
        "name", "device", "total_memory", ""
    );
    for preset in PRESETS {
        let default = if preset.name == DEFAULT_GPU {
            "  (default)"
        } else {
            ""
        };
        println!(
            "{:<14} {:<28} {:>16} {:>11}{default}",
            preset.name,
            preset.device_name,
            preset.total_memory,
            format_size(preset.total_memory)
        );
        if sources {
            println!("    source: {}", preset.source);
            for cuda in vramsim_sim::device::CUDA_VERSIONS {
                let c = preset.context(cuda);
                println!(
                    "    context, CUDA {cuda}: {} ({}){}",
                    format_size(c.bytes),
                    c.source,
                    if cuda == DEFAULT_CUDA {
                        " [default --cuda]"
                    } else {
                        ""
                    }
                );
                if let Some(m) = preset.step_modules(cuda) {
                    println!(
                        "    step kernels, CUDA {cuda}: {} more once a training step has run ({})",
                        format_size(m.bytes),
                        m.source
                    );
                }
            }
        }
    }
    if !sources {
        println!("\ntotal_memory is what torch.cuda.get_device_properties().total_memory reports; --sources says where each figure comes from, and gives the CUDA context per CUDA version ({} measurements; --cuda picks one, default {DEFAULT_CUDA}).", CONTEXT_MEASUREMENTS.len());
    }
    Ok(())
}

/// The GPU presets as JSON, as `vramsim gpus` lists them: name, device, total memory, whether it is the
/// default, its source, and the CUDA context per CUDA major version with its source (and the kernels a
/// training step adds to it, where measured).
pub fn gpus_json() -> serde_json::Value {
    PRESETS
        .iter()
        .map(|preset| {
            serde_json::json!({
                "name": preset.name,
                "device": preset.device_name,
                "total_memory_bytes": preset.total_memory,
                "compute_capability": [preset.compute_capability.0, preset.compute_capability.1],
                "default": preset.name == DEFAULT_GPU,
                "source": preset.source,
                "context": vramsim_sim::device::CUDA_VERSIONS
                    .iter()
                    .map(|&cuda| {
                        let c = preset.context(cuda);
                        let m = preset.step_modules(cuda);
                        serde_json::json!({"cuda": cuda, "bytes": c.bytes, "source": c.source, "default": cuda == DEFAULT_CUDA,
                            "step_modules_bytes": m.as_ref().map(|m| m.bytes), "step_modules_source": m.map(|m| m.source)})
                    })
                    .collect::<Vec<_>>(),
            })
        })
        .collect()
}
