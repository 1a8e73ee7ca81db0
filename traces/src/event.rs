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
        tag: Option<std::sync::Arc<str>>,
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
    /// `{"op":"segment","addr":A,"size":S,"pool":"large","blocks":[...]}`: a segment the allocator
    /// already holds when the trace starts, with its live blocks (the state a PyTorch snapshot's history
    /// begins from). Only allowed before every other op.
    Segment(Box<InitialSegment>),
}

/// The pool a segment belongs to: PyTorch's `segment_type` (§1.3 of the fact sheet: rounded requests of
/// at most 1 MiB are served from the small pool, larger ones from the large pool).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
    /// `"small"`: 2 MiB segments (expandable: 2 MiB pages) for rounded requests of at most 1 MiB.
    Small,
    /// `"large"`: everything bigger.
    Large,
}

impl Pool {
    /// The name used in trace files and snapshots (`"small"`, `"large"`).
    pub fn name(self) -> &'static str {
        match self {
            Pool::Small => "small",
            Pool::Large => "large",
        }
    }

    /// Parses a pool name as written in trace files.
    pub fn from_name(name: &str) -> Option<Pool> {
        match name {
            "small" => Some(Pool::Small),
            "large" => Some(Pool::Large),
            _ => None,
        }
    }
}

impl fmt::Display for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A segment the allocator holds before the first event of a trace (`{"op":"segment",...}`).
///
/// For an ordinary segment, `addr`/`size` are the `cudaMalloc`ed range; for an expandable one
/// (`expandable_segments:True`), one contiguous mapped range of the stream's reservation, as a snapshot
/// lists it. `blocks` are the live (allocated) blocks, in address order; every byte of the segment not
/// covered by a block is free (cached), and free neighbours form one block, as they always do in the
/// caching allocator (§4.2).
#[derive(Clone, Debug, PartialEq)]
pub struct InitialSegment {
    /// Device address of the segment's first byte.
    pub addr: u64,
    /// Bytes reserved from the device (> 0).
    pub size: u64,
    /// The stream the segment belongs to (default 0).
    pub stream: StreamId,
    /// The pool.
    pub pool: Pool,
    /// Whether this is a mapped range of an expandable segment (default false).
    pub expandable: bool,
    /// Expandable ranges only: where the stream's reservation for the pool begins, at or below `addr`
    /// (default: the lowest range declared for the same stream and pool). Unmapped space below the first
    /// mapped range is where an expandable segment grows first (§7.2).
    pub base: Option<u64>,
    /// The live blocks, in address order, not overlapping, inside the segment (default none).
    pub blocks: Vec<InitialBlock>,
}

/// A live block of an [`InitialSegment`]: an allocation made before the trace starts, known by `id`
/// until a `free` names it.
#[derive(Clone, Debug, PartialEq)]
pub struct InitialBlock {
    /// Name of the allocation, as in `alloc`.
    pub id: AllocId,
    /// Bytes from the segment's start to the block's first byte.
    pub offset: u64,
    /// The block's size (rounded, possibly unsplit: what the allocator handed out; > 0).
    pub size: u64,
    /// The requested (unrounded) bytes, at most `size` (default: `size`).
    pub requested: u64,
    /// What the bytes are for (default `other`).
    pub category: Category,
    /// Free-form label.
    pub tag: Option<Box<str>>,
}

impl Event {
    /// This event without an allocation's tag (what a replay reads: the tag only names the site).
    pub fn without_tag(self) -> Event {
        match self {
            Event::Alloc {
                id,
                size,
                stream,
                category,
                ..
            } => Event::Alloc {
                id,
                size,
                stream,
                category,
                tag: None,
            },
            other => other,
        }
    }

    /// This event with the id it names (an `alloc`'s, a `free`'s, a `record_stream`'s) replaced by
    /// `rename` of it: the same event of a repetition whose ids are renamed.
    pub fn with_id(&self, rename: impl Fn(&AllocId) -> AllocId) -> Event {
        match self {
            Event::Alloc {
                id,
                size,
                stream,
                category,
                tag,
            } => Event::Alloc {
                id: rename(id),
                size: *size,
                stream: *stream,
                category: *category,
                tag: tag.clone(),
            },
            Event::Free { id } => Event::Free { id: rename(id) },
            Event::RecordStream { id, stream } => Event::RecordStream {
                id: rename(id),
                stream: *stream,
            },
            other => other.clone(),
        }
    }

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
            Event::Segment(_) => "segment",
        }
    }
}

/// The `op` values every reader accepts, as listed in error messages.
pub const OPS: [&str; 8] = [
    "alloc",
    "free",
    "record_stream",
    "empty_cache",
    "compute",
    "sync",
    "phase",
    "segment",
];
