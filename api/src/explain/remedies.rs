//! What to do about an out-of-memory error, tied to its verdict: the remedies that address the cause the
//! rule found (and only those), with the figures from the message that make them apply.

use vramsim_sim::format::format_size;
use vramsim_sim::oom_text::{Format, ParsedOom};

use super::figures::Figures;
use super::verdict::{Cause, Verdict};

/// One remedy.
#[derive(Clone, Debug, PartialEq)]
pub struct Remedy {
    /// A short key: `shape_bug`, `expandable_segments`, `max_split_size_mb`, `shed_bytes`,
    /// `other_processes`, `memory_fraction`, `whatif`, `max_batch`.
    pub kind: &'static str,
    /// What to do, and why it applies here.
    pub text: String,
    /// For checked remedies: the `vramsim predict` command that shows it.
    pub command: Option<String>,
    /// For checked remedies: the peak device memory the replay predicts.
    pub peak_device_used_bytes: Option<u64>,
}

impl Remedy {
    fn text(kind: &'static str, text: String) -> Remedy {
        Remedy {
            kind,
            text,
            command: None,
            peak_device_used_bytes: None,
        }
    }
}

/// The remedies for `verdict` (unchecked: what the message alone supports).
/// `checked` says the what-ifs are replayed (a model or a recorded run was given), so the text does not
/// ask for one.
pub fn for_verdict(oom: &ParsedOom, f: &Figures, verdict: &Verdict, checked: bool) -> Vec<Remedy> {
    let mut out = Vec::new();
    let size = |b: u64| format_size(b);
    let requested = f.requested.bytes;
    for cause in &verdict.possible {
        match cause {
            Cause::ExceedsDevice => {
                let tensor = match &oom.tensor {
                    Some(t) => format!(
                        " (a tensor of shape [{}] of {}, {} bytes each)",
                        t.shape
                            .iter()
                            .map(u64::to_string)
                            .collect::<Vec<_>>()
                            .join(","),
                        t.dtype,
                        t.element_bytes
                    ),
                    None => String::new(),
                };
                out.push(Remedy::text(
                    "shape_bug",
                    format!(
                        "one request of {} ({} bytes){tensor} is larger than the device{}: no allocator \
                         setting or cache flush can place it. A single tensor larger than the GPU usually \
                         means a shape bug (a batch or sequence dimension multiplied in twice, a missing \
                         reduction, a broadcast over the wrong axis, attention over an unexpected length): \
                         find the operation that asks for it",
                        size(requested),
                        requested,
                        match f.limit {
                            Some(l) => format!(" ({})", size(l.bytes)),
                            None => String::new(),
                        }
                    ),
                ));
            }
            Cause::Fragmentation if oom.format == Format::TensorFlow => {
                out.push(Remedy::text(
                    "allocator",
                    "TensorFlow's BFC allocator may hold the bytes in pieces: TF_GPU_ALLOCATOR=cuda_malloc_async \
                     hands allocation to CUDA's stream-ordered pool; tf.config.experimental.set_memory_growth \
                     changes how the BFC region grows"
                        .into(),
                ));
            }
            Cause::Fragmentation if oom.format == Format::Xla => {
                out.push(Remedy::text(
                    "allocator",
                    "XLA's client allocator may hold the bytes in pieces, or other processes the rest: \
                     XLA_PYTHON_CLIENT_PREALLOCATE=false, XLA_PYTHON_CLIENT_MEM_FRACTION, or \
                     XLA_PYTHON_CLIENT_ALLOCATOR=platform (JAX's GPU memory allocation notes)"
                        .into(),
                ));
            }
            Cause::Fragmentation => {
                let unallocated = f.reserved_unallocated.map_or(0, |u| u.bytes);
                out.push(Remedy::text(
                    "expandable_segments",
                    format!(
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the allocator maps pages into \
                         one growing segment per stream and unmaps free pages on demand, so the {} free \
                         on the device and the {} reserved but unallocated can serve one request of {} \
                         (fact sheet §7)",
                        size(f.free.map_or(0, |x| x.bytes)),
                        size(unallocated),
                        size(requested)
                    ),
                ));
                out.push(Remedy::text(
                    "max_split_size_mb",
                    format!(
                        "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N: cached blocks of N MiB or more are \
                         never split, so a freed large block stays whole for the next large request \
                         (one within 20 MiB of its size) instead of being carved into slivers; it helps \
                         when large requests of varied sizes fragment the cache (N at or below {} MiB \
                         keeps blocks of this request's size whole), at the cost of more cudaMalloc calls. \
                         torch.cuda.empty_cache() does not help: the allocator already released every \
                         wholly free segment before raising",
                        requested >> 20
                    ),
                ));
            }
            Cause::Capacity => {
                let short = verdict
                    .shortfall
                    .map(|s| {
                        if s.min == s.max {
                            format!("{} ({} bytes)", size(s.bytes), s.bytes)
                        } else {
                            format!(
                                "{} ({}..={} bytes by the printed rounding)",
                                size(s.bytes),
                                s.min,
                                s.max
                            )
                        }
                    })
                    .unwrap_or_else(|| "the difference".into());
                out.push(Remedy::text(
                    "shed_bytes",
                    format!(
                        "the device is full: at least {short} must go at the moment of this request \
                         (more if the peak comes later). The usual levers: a smaller batch or sequence \
                         with gradient accumulation to keep the effective batch, mixed precision (AMP), \
                         activation checkpointing, an optimizer with less state, offloading{}",
                        if checked {
                            " (replayed below: only the changes that fit are listed)"
                        } else {
                            "; give --model or --hf-config with the recipe to check which of them fit"
                        }
                    ),
                ));
            }
        }
    }
    let short_min = verdict.shortfall.map_or(0, |s| s.min);
    if let Some(others) = f.other_processes {
        if others.bytes > 0 {
            let pids: Vec<String> = oom.processes.iter().map(|p| p.pid.to_string()).collect();
            let enough = verdict.possible.contains(&Cause::Capacity) && others.min >= short_min;
            out.push(Remedy::text(
                "other_processes",
                format!(
                    "other processes hold {} on this device (pid {}){}",
                    size(others.bytes),
                    pids.join(", "),
                    if enough {
                        ": stopping them (or moving them to another GPU) frees enough for this request"
                    } else {
                        ""
                    }
                ),
            ));
        }
    }
    if let (Some(allowed), Some(capacity)) = (oom.allowed.as_ref(), oom.capacity.as_ref()) {
        out.push(Remedy::text(
            "memory_fraction",
            format!(
                "the process is held to {} of the device's {} by torch.cuda.set_per_process_memory_fraction \
                 (or per_process_memory_fraction in PYTORCH_CUDA_ALLOC_CONF): raising the fraction makes \
                 more of the device usable",
                allowed.printed, capacity.printed
            ),
        ));
    }
    out
}
