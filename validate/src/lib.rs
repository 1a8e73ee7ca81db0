//! # vramsim-validate
//!
//! Checks the simulator against hardware. It replays a vramsim trace on a real NVIDIA GPU through the CUDA
//! driver API (the `cudarc` crate, loaded at run time), measures what the device did, compares it with
//! what the simulator predicted, and measures the figures that calibrate the simulator:
//!
//! - `vramsim-validate probe`: device name, total and free memory, the CUDA context's cost, the allocation
//!   granularity of `cuMemAlloc`, `cuMemCreate` and the stream-ordered pool, and call latencies
//!   ([`probe`]).
//! - `vramsim-validate replay TRACE --backend raw|async|vmm`: the trace on the GPU, event by event, against
//!   the simulator ([`replay`]).
//! - `vramsim-validate calibrate`: `calibration.json` for `vramsim replay --calibration`.
//!
//! ```no_run
//! use vramsim_validate::driver::Gpu;
//! use vramsim_validate::replay::{replay, Backend, ReplayOptions};
//!
//! let gpu = Gpu::open(0)?; // ValidateError::NoDriver on a machine without an NVIDIA driver
//! let options = ReplayOptions { backend: Backend::Raw, alloc_conf: String::new(),
//!     release_threshold: u64::MAX, async_config: None, max_events: None };
//! let report = replay(&gpu, "step.jsonl".as_ref(), &options)?;
//! println!("{} events differ", report.events_with_deviation);
//! # Ok::<(), vramsim_validate::error::ValidateError>(())
//! ```
//!
//! It builds, and its non-GPU tests run, on machines without CUDA: the driver library is looked for at
//! run time, and without it every command exits with status 2 and one line, `error: no CUDA driver
//! found: ...; validation needs an NVIDIA GPU`. What it deliberately does not do: launch kernels (`compute`
//! events are not executed), or replay through PyTorch itself (that is `python/replay_torch.py`).

pub mod cli;
pub mod driver;
pub mod error;
pub mod plan;
pub mod probe;
pub mod replay;
