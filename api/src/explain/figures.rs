//! The figures an out-of-memory message gives or implies, each a byte interval: what the message printed
//! (rounded by `format_size`) and what follows from it (reserved minus allocated, the free bytes a
//! memory fraction leaves).

use vramsim_sim::oom_text::{Format, ParsedOom, Size};

/// NVML's "value not available" (`u64::MAX`), which PyTorch prints as `17179869184.00 GiB`.
const NVML_UNAVAILABLE: u64 = u64::MAX;

/// A byte count known to lie in `[min, max]`, with the value the printed figures give (`bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    /// The value from the printed figures taken at face value.
    pub bytes: u64,
    /// The smallest value consistent with the printed figures.
    pub min: u64,
    /// The largest.
    pub max: u64,
}

impl Range {
    /// The interval a printed size stands for.
    pub fn of(size: &Size) -> Range {
        Range {
            bytes: size.bytes,
            min: size.min,
            max: size.max,
        }
    }

    /// `self + other`.
    pub fn plus(self, other: Range) -> Range {
        Range {
            bytes: self.bytes.saturating_add(other.bytes),
            min: self.min.saturating_add(other.min),
            max: self.max.saturating_add(other.max),
        }
    }

    /// `self - other`, clamped at zero.
    pub fn minus(self, other: Range) -> Range {
        Range {
            bytes: self.bytes.saturating_sub(other.bytes),
            min: self.min.saturating_sub(other.max),
            max: self.max.saturating_sub(other.min),
        }
    }

    /// The smaller of two quantities.
    pub fn min_of(self, other: Range) -> Range {
        Range {
            bytes: self.bytes.min(other.bytes),
            min: self.min.min(other.min),
            max: self.max.min(other.max),
        }
    }

    /// Whether the value is known to the byte.
    pub fn is_exact(self) -> bool {
        self.min == self.max
    }
}

/// What the message gives, and what follows from it.
#[derive(Clone, Debug)]
pub struct Figures {
    /// The request.
    pub requested: Range,
    /// The device's total memory, when the message (or the command line) says it.
    pub capacity: Option<Range>,
    /// The limit the request is held to: the memory-fraction limit when one is set, else the capacity.
    pub limit: Option<Range>,
    /// Free device memory (`cudaMemGetInfo`).
    pub free: Option<Range>,
    /// Allocated by PyTorch.
    pub allocated: Option<Range>,
    /// Reserved by PyTorch (given ≤ 2.0; allocated + unallocated ≥ 2.1; allocated + cached ≤ 1.3).
    pub reserved: Option<Range>,
    /// Reserved but unallocated (given ≥ 2.1 and as `cached` ≤ 1.3; reserved − allocated 1.4–2.0).
    pub reserved_unallocated: Option<Range>,
    /// Bytes a new segment can take: free, and under a memory fraction no more than the limit less what
    /// is reserved.
    pub obtainable: Option<Range>,
    /// NVML's figure for this process (`None` when NVML could not say).
    pub this_process: Option<Range>,
    /// This process's memory outside PyTorch's allocator: NVML's figure less the reserved bytes (CUDA
    /// context, cuBLAS/cuDNN workspaces, other libraries).
    pub non_pytorch: Option<Range>,
    /// The sum of what NVML lists for other processes.
    pub other_processes: Option<Range>,
    /// Remarks on figures that could not be taken at face value.
    pub notes: Vec<String>,
}

impl Figures {
    /// The figures of `oom`; `capacity` stands in for a device size the message does not give.
    pub fn of(oom: &ParsedOom, capacity: Option<u64>) -> Figures {
        let r = |s: &Option<Size>| s.as_ref().map(Range::of);
        let mut notes = Vec::new();
        let allocated = r(&oom.allocated);
        let (reserved, reserved_unallocated) = match oom.format {
            // ≤ 1.3: "cached" = amount_cached − amount_allocated
            Format::PyTorchCached => {
                let u = r(&oom.reserved_unallocated);
                (allocated.zip(u).map(|(a, u)| a.plus(u)), u)
            }
            // 1.4–2.0, Ascend: reserved given, unallocated = reserved − allocated
            Format::PyTorchReserved | Format::AscendNpu => {
                let res = r(&oom.reserved);
                (res, res.zip(allocated).map(|(res, a)| res.minus(a)))
            }
            // ≥ 2.1: "allocated" includes the private pools' free blocks; reserved = both sentences
            _ => {
                let u = r(&oom.reserved_unallocated);
                (allocated.zip(u).map(|(a, u)| a.plus(u)), u)
            }
        };
        let message_capacity = r(&oom.capacity);
        let capacity = message_capacity.or(capacity.map(|c| Range {
            bytes: c,
            min: c,
            max: c,
        }));
        let allowed = r(&oom.allowed);
        let limit = match (capacity, allowed) {
            (Some(c), Some(a)) => Some(c.min_of(a)),
            (c, a) => c.or(a),
        };
        let free = r(&oom.free);
        // PyTorch refuses a new segment past the fraction's limit (`allowed_memory_maximum`) even when
        // the device has it free.
        let obtainable = match (free, allowed, reserved) {
            (Some(f), Some(a), Some(res)) => Some(f.min_of(a.minus(res))),
            (f, _, _) => f,
        };
        let this_process = match &oom.this_process {
            Some(s) if s.max == NVML_UNAVAILABLE => {
                notes.push(format!(
                    "NVML could not report this process's memory ({} is its \"not available\" value)",
                    s.printed
                ));
                None
            }
            Some(s) => Some(Range::of(s)),
            None => None,
        };
        let non_pytorch = match (this_process, reserved) {
            (Some(p), Some(res)) if p.max >= res.min => Some(p.minus(res)),
            (Some(p), Some(_)) => {
                notes.push(format!(
                    "NVML's figure for this process ({} bytes) is below PyTorch's reserved bytes: NVML \
                     does not see this process's memory (Windows WDDM reports 0; a container may hide \
                     the process), so memory outside PyTorch is unknown",
                    p.bytes
                ));
                None
            }
            _ => None,
        };
        let other_processes = (!oom.processes.is_empty()).then(|| {
            oom.processes.iter().map(|p| Range::of(&p.bytes)).fold(
                Range {
                    bytes: 0,
                    min: 0,
                    max: 0,
                },
                Range::plus,
            )
        });
        if !oom.processes.is_empty()
            && oom.this_process.is_none()
            && oom.format == Format::PyTorchCapacityOf
        {
            notes.push(
                "no \"this process\" line: in a container NVML's process ids are the host's, so this \
                 process may be one of the \"Process P\" lines"
                    .to_string(),
            );
        }
        Figures {
            requested: Range::of(&oom.requested),
            capacity,
            limit,
            free,
            allocated,
            reserved,
            reserved_unallocated,
            obtainable,
            this_process,
            non_pytorch,
            other_processes,
            notes,
        }
    }
}
