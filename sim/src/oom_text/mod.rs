//! Out-of-memory messages read back: the figures a pasted PyTorch, TensorFlow or JAX/XLA message holds,
//! each as the interval of byte counts its printed value stands for.
//!
//! This is the inverse of [`crate::oom`], which writes PyTorch's message, and it reads every version of
//! that message people paste (the templates, with their sources, are in [`pytorch`]), TensorFlow's
//! `ResourceExhaustedError` ([`tensorflow`]) and XLA's `RESOURCE_EXHAUSTED` ([`xla`]). Text is made one
//! line first ([`normalize`]), so wraps, indentation, comment markers and prefixes do not matter. What
//! the figures mean (is it fragmentation? how many bytes must go?) is decided by the caller.

pub mod normalize;
pub mod pytorch;
pub mod scan;
pub mod sizes;
pub mod tensorflow;
pub mod xla;

pub use sizes::Size;

/// Which message template the text follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// PyTorch ≤ 1.3: `(GPU N; C total capacity; A already allocated; F free; X cached)`.
    PyTorchCached,
    /// PyTorch 1.4–2.0: `(GPU N; C total capacity; A already allocated; F free; [L allowed; ]R reserved in
    /// total by PyTorch)`.
    PyTorchReserved,
    /// Ascend's `torch_npu`: the 1.4–2.0 text with `N current active; ` after `already allocated`.
    AscendNpu,
    /// PyTorch ≥ 2.1: `GPU N has a total capacity of C of which F is free. ...`.
    PyTorchCapacityOf,
    /// PyTorch's message for requests of 2^60 bytes or more: `Tried to allocate more than 1EB memory.`
    PyTorchMoreThan1Eb,
    /// TensorFlow: `OOM when allocating tensor with shape[...] and type T on DEVICE by allocator A`.
    TensorFlow,
    /// XLA (JAX): `RESOURCE_EXHAUSTED: Out of memory while trying to allocate N bytes.` and kin.
    Xla,
}

impl Format {
    /// A name for people and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Format::PyTorchCached => "pytorch<=1.3 (cached)",
            Format::PyTorchReserved => "pytorch 1.4-2.0 (reserved in total by PyTorch)",
            Format::AscendNpu => "torch_npu (current active)",
            Format::PyTorchCapacityOf => {
                "pytorch>=2.1 (total capacity of ... of which ... is free)"
            }
            Format::PyTorchMoreThan1Eb => "pytorch (more than 1EB)",
            Format::TensorFlow => "tensorflow (OOM when allocating tensor)",
            Format::Xla => "xla (RESOURCE_EXHAUSTED)",
        }
    }

    /// The framework that raised it: `pytorch`, `tensorflow` or `jax`.
    pub fn framework(self) -> &'static str {
        match self {
            Format::TensorFlow => "tensorflow",
            Format::Xla => "jax",
            _ => "pytorch",
        }
    }
}

/// Another process on the device, as NVML listed it (`Process P has B memory in use.`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Process {
    /// Its process id.
    pub pid: u64,
    /// What NVML said it holds.
    pub bytes: Size,
}

/// The tensor a TensorFlow message names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRequest {
    /// Its shape.
    pub shape: Vec<u64>,
    /// Its dtype as TensorFlow's `DataTypeString` writes it (`float`, `half`, ...).
    pub dtype: String,
    /// Bytes per element.
    pub element_bytes: u64,
}

/// Everything an out-of-memory message says, each size with its rounding interval.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedOom {
    /// The template.
    pub format: Format,
    /// The backend named before "out of memory" (`CUDA`, `HIP`, `NPU`), or the device kind.
    pub backend: String,
    /// The device as named (`GPU 0`, `NPU 0`, `/job:localhost/replica:0/task:0/device:GPU:0`).
    pub device: Option<String>,
    /// The request: PyTorch's segment size (`Tried to allocate`), the tensor's bytes, XLA's request.
    pub requested: Size,
    /// Total device memory (`cudaMemGetInfo`'s total).
    pub capacity: Option<Size>,
    /// Free device memory (`cudaMemGetInfo`'s free).
    pub free: Option<Size>,
    /// The per-process limit a memory fraction sets (`L allowed;`).
    pub allowed: Option<Size>,
    /// Bytes allocated by PyTorch (`already allocated`, or `is allocated by PyTorch`, which includes
    /// the free cached blocks of private pools).
    pub allocated: Option<Size>,
    /// Bytes reserved by PyTorch (`reserved in total by PyTorch`), where the message says it.
    pub reserved: Option<Size>,
    /// Reserved but unallocated bytes, where the message says them (`is reserved by PyTorch but
    /// unallocated`; ≤ 1.3's `cached`).
    pub reserved_unallocated: Option<Size>,
    /// Active bytes (`current active`, Ascend).
    pub active: Option<Size>,
    /// Free cached bytes of private pools (`with X allocated in private pools`).
    pub private_pools: Option<Size>,
    /// NVML's figure for this process (`Including non-PyTorch memory, this process has B memory in use`).
    pub this_process: Option<Size>,
    /// Other processes NVML listed.
    pub processes: Vec<Process>,
    /// The tensor (TensorFlow).
    pub tensor: Option<TensorRequest>,
    /// The allocator named (TensorFlow's `GPU_0_bfc`).
    pub allocator: Option<String>,
    /// PyTorch 2.1's spelling `total capacty`.
    pub capacty_spelling: bool,
}

impl ParsedOom {
    /// An empty record of `format` for a request (the readers fill in the rest).
    fn new(format: Format, backend: &str, requested: Size) -> ParsedOom {
        ParsedOom {
            format,
            backend: backend.to_string(),
            device: None,
            requested,
            capacity: None,
            free: None,
            allowed: None,
            allocated: None,
            reserved: None,
            reserved_unallocated: None,
            active: None,
            private_pools: None,
            this_process: None,
            processes: Vec::new(),
            tensor: None,
            allocator: None,
            capacty_spelling: false,
        }
    }
}

/// Why a text could not be read as an out-of-memory message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// No message of any known framework in the text.
    #[error(
        "no out-of-memory message found: looked for PyTorch's \"out of memory. Tried to allocate\", \
         TensorFlow's \"OOM when allocating tensor\" and XLA's \"Out of memory while trying to allocate\" \
         (or \"Out of memory allocating\", \"Failed to allocate request for\")"
    )]
    NotFound,
    /// CUDA's own error, raised outside PyTorch's caching allocator: it carries no figures.
    #[error(
        "\"CUDA error: out of memory\" is CUDA's own error (cudaErrorMemoryAllocation raised outside \
         PyTorch's caching allocator: the CUDA context, a library's handle or workspace, another \
         allocator), and it carries no figures to explain; the device was full when it was raised"
    )]
    RawCudaError,
    /// A message whose template is known but which lacks figures it must have.
    #[error("{format} message without {}", missing.join(", "))]
    Missing {
        /// The template's name.
        format: &'static str,
        /// What was not found, in words (with the phrase looked for).
        missing: Vec<String>,
    },
    /// A figure that is there but cannot be read.
    #[error("{format} message: {what}")]
    Bad {
        /// The template's name.
        format: &'static str,
        /// What is wrong.
        what: String,
    },
}

/// Reads the first out-of-memory message in `text` (PyTorch, TensorFlow or XLA, in whichever comes
/// first).
pub fn parse(text: &str) -> Result<ParsedOom, ParseError> {
    let line = normalize::one_line(text);
    let candidates = [
        pytorch::locate(&line),
        tensorflow::locate(&line),
        xla::locate(&line),
    ];
    let first = candidates
        .iter()
        .enumerate()
        .filter_map(|(i, at)| at.map(|at| (at, i)))
        .min();
    match first {
        Some((at, 0)) => pytorch::read(&line, at),
        Some((at, 1)) => tensorflow::read(&line, at),
        Some((at, _)) => xla::read(&line, at),
        None if line.contains("CUDA error: out of memory") => Err(ParseError::RawCudaError),
        None => Err(ParseError::NotFound),
    }
}
