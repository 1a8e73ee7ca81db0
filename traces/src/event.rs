//! The events of an allocation trace: the one contract between the lowering, import and replay stages.

use std::fmt;

/// A CUDA stream, named by the integer a trace gives it (PyTorch snapshots use the stream handle; the
/// default stream is 0). Blocks cached for one stream are never handed to another (PyTorch §2.3), and the
/// allocator orders its pools by this value, so it is kept as the raw integer.
pub type StreamId = u64;

/// The name of an allocation: an integer or a string, unique among the allocations live at one time.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AllocId {
    /// An integer id (`"id": 42`).
    Int(u64),
    /// A string id (`"id": "layer3.out"`).
    Str(Box<str>),
}

impl fmt::Display for AllocId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocId::Int(n) => write!(f, "{n}"),
            AllocId::Str(s) => write!(f, "{s:?}"),
        }
    }
}

impl From<u64> for AllocId {
    fn from(n: u64) -> Self {
        AllocId::Int(n)
    }
}

impl From<&str> for AllocId {
    fn from(s: &str) -> Self {
        AllocId::Str(s.into())
    }
}

/// What the bytes of an allocation are for: the vocabulary of PyTorch's memory profiler
/// (`torch.profiler._memory_profiler.Category`), plus `other`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Category {
    /// Model weights (`nn.Parameter`).
    Parameter,
    /// Gradients of parameters.
    Gradient,
    /// Optimizer state (momentum, Adam's moments).
    OptimizerState,
    /// Activations saved for backward.
    Activation,
    /// Short-lived intermediates.
    Temporary,
    /// Library workspaces (cuBLAS, cuDNN).
    Workspace,
    /// Inputs and labels.
    Input,
    /// Autograd bookkeeping buffers.
    AutogradDetail,
    /// Collective-communication buffers.
    Communication,
    /// Anything else, and allocations with no category.
    #[default]
    Other,
}

impl Category {
    /// Every category, in the order reports list them.
    pub const ALL: [Category; 10] = [
        Category::Parameter,
        Category::Gradient,
        Category::OptimizerState,
        Category::Activation,
        Category::Temporary,
        Category::Workspace,
        Category::Input,
        Category::AutogradDetail,
        Category::Communication,
        Category::Other,
    ];

    /// The name used in trace files and reports (`optimizer_state`).
    pub fn name(self) -> &'static str {
        match self {
            Category::Parameter => "parameter",
            Category::Gradient => "gradient",
            Category::OptimizerState => "optimizer_state",
            Category::Activation => "activation",
            Category::Temporary => "temporary",
            Category::Workspace => "workspace",
            Category::Input => "input",
            Category::AutogradDetail => "autograd_detail",
            Category::Communication => "communication",
            Category::Other => "other",
        }
    }

    /// Parses a category name as written in trace files.
    pub fn from_name(name: &str) -> Option<Category> {
        Category::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Position of this category in [`Category::ALL`], for per-category arrays.
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One step of a trace, as the host program issues it.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// `{"op":"alloc","id":ID,"size":BYTES,"stream":S,"category":C,"tag":T}`: a tensor's storage is
    /// allocated on `stream` (the caching allocator's `malloc(size, stream)`).
    Alloc {
        /// Name of the allocation, unique among live allocations.
        id: AllocId,
        /// Requested bytes, unrounded. Sizes of 2^60 or more are legal input: PyTorch answers them with
        /// "Tried to allocate more than 1EB memory".
        size: u64,
        /// Allocation stream (default 0).
        stream: StreamId,
        /// What the bytes are for (default `other`).
        category: Category,
        /// Free-form label (a module path, a tensor name).
        tag: Option<Box<str>>,
    },
    /// `{"op":"free","id":ID}`: the storage is released (the caching allocator's `free`).
    Free {
        /// The allocation being freed.
        id: AllocId,
    },
    /// `{"op":"record_stream","id":ID,"stream":S}`: `tensor.record_stream(S)`; a later free is deferred
    /// until the work queued on `S` so far has finished.
    RecordStream {
        /// The allocation used on another stream.
        id: AllocId,
        /// The stream that uses it.
        stream: StreamId,
    },
    /// `{"op":"empty_cache"}`: `torch.cuda.empty_cache()`.
    EmptyCache,
    /// `{"op":"compute","stream":S,"us":MICROSECONDS}`: a kernel keeps `stream` busy that long.
    Compute {
        /// The stream the work is queued on.
        stream: StreamId,
        /// Duration in microseconds (finite, non-negative).
        us: f64,
    },
    /// `{"op":"sync"}` (`torch.cuda.synchronize()`) or `{"op":"sync","stream":S}`
    /// (`stream.synchronize()`): the host waits.
    Sync {
        /// The stream waited for, or `None` for the whole device.
        stream: Option<StreamId>,
    },
    /// `{"op":"phase","name":"..."}`: a marker (`forward`, `backward`, `optimizer`, ...) that reports
    /// use to break peaks down by phase.
    Phase {
        /// The phase that starts here.
        name: Box<str>,
    },
}

impl Event {
    /// The `op` string of this event in trace files.
    pub fn op(&self) -> &'static str {
        match self {
            Event::Alloc { .. } => "alloc",
            Event::Free { .. } => "free",
            Event::RecordStream { .. } => "record_stream",
            Event::EmptyCache => "empty_cache",
            Event::Compute { .. } => "compute",
            Event::Sync { .. } => "sync",
            Event::Phase { .. } => "phase",
        }
    }
}

/// The `op` values every reader accepts, as listed in error messages.
pub const OPS: [&str; 7] = [
    "alloc",
    "free",
    "record_stream",
    "empty_cache",
    "compute",
    "sync",
    "phase",
];
