//! What can go wrong when validating on a GPU.

use thiserror::Error;

/// The text that ends every "no GPU" message.
pub const NEEDS_GPU: &str = "validation needs an NVIDIA GPU";

/// Why a validation command could not run, or stopped.
#[derive(Debug, Error)]
pub enum ValidateError {
    /// The CUDA driver library (`libcuda.so`, `nvcuda.dll`) cannot be loaded: no NVIDIA driver here.
    #[error("no CUDA driver found: {reason}; {NEEDS_GPU}")]
    NoDriver {
        /// What was looked for.
        reason: String,
    },
    /// The driver loaded but offers no usable device (`cuInit` or `cuDeviceGet` failed).
    #[error("no CUDA device available: {reason}; {NEEDS_GPU}")]
    NoDevice {
        /// The driver's answer.
        reason: String,
    },
    /// A driver call failed.
    #[error("{call} failed: {error}")]
    Driver {
        /// The call (`cuMemAlloc(2097152)`).
        call: String,
        /// The driver's error name and text.
        error: String,
    },
    /// A driver call panicked inside cudarc (a symbol missing from an old driver, for instance).
    #[error("the CUDA driver could not be used: {0}")]
    Panicked(String),
    /// The trace could not be read or replayed.
    #[error(transparent)]
    Trace(#[from] vramsim_traces::TraceError),
    /// The simulator refused the trace or the settings.
    #[error("{0}")]
    Sim(String),
}

impl ValidateError {
    /// A failed driver call.
    pub fn driver(call: impl Into<String>, error: cudarc::driver::DriverError) -> Self {
        let text = match (error.error_name(), error.error_string()) {
            (Ok(name), Ok(text)) => {
                format!("{} ({})", name.to_string_lossy(), text.to_string_lossy())
            }
            _ => format!("{:?}", error.0),
        };
        ValidateError::Driver {
            call: call.into(),
            error: text,
        }
    }
}
