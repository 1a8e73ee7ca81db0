//! `torch.cuda.memory_summary()`: the 75-column statistics table (fact sheet §9).
//!
//! [`memory_summary`] reproduces `torch/cuda/memory.py`'s `memory_summary` byte for byte: the same
//! header, rows, unit choice and trailing newline. The function has been the same from 2.9.0 to 2.15.0
//! (only comments changed); the golden texts in `sim/tests/data/pytorch_text/` were printed by PyTorch
//! 2.15.0 and 2.9.0 themselves, from the statistics in `summary_cases.json`.
//!
//! ```text
//! |===========================================================================|
//! |                  PyTorch CUDA memory summary, device ID 1                 |
//! |---------------------------------------------------------------------------|
//! |            CUDA OOMs: 0            |        cudaMalloc retries: 0         |
//! |===========================================================================|
//! |        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |
//! |---------------------------------------------------------------------------|
//! | Allocated memory      |    768 KiB | 786431 B   |    768 MiB | 786431 KiB |
//! |       from large pool |    767 KiB | 786431 B   |    767 MiB | 785408 KiB |
//! |       from small pool |      0 KiB |      0 B   |      0 MiB |      0 KiB |
//! ...
//! ```
//!
//! The unit of a size column is chosen from the "all" row of its metric and then used for the pool rows
//! too, so a pool row can read "0 KiB" for a few hundred bytes. Integer division floors, as Python's `//`.

use crate::stats::{MemoryStats, Stat, StatArray};

/// Width of the table between the outer bars.
const WIDTH: usize = 75;

/// Formats the statistics of one device as `torch.cuda.memory_summary(device, abbreviated)` does.
///
/// The text ends with a newline. With `abbreviated` the "from large pool" / "from small pool" rows are
/// left out.
pub fn memory_summary(stats: &MemoryStats, device: u32, abbreviated: bool) -> String {
    let metrics: [(&StatArray, &str, Formatter); 9] = [
        (&stats.allocated_bytes, "Allocated memory", format_size),
        (&stats.active_bytes, "Active memory", format_size),
        (&stats.requested_bytes, "Requested memory", format_size),
        (&stats.reserved_bytes, "GPU reserved memory", format_size),
        (
            &stats.inactive_split_bytes,
            "Non-releasable memory",
            format_size,
        ),
        (&stats.allocation, "Allocations", format_count),
        (&stats.active, "Active allocs", format_count),
        (&stats.segment, "GPU reserved segments", format_count),
        (&stats.inactive_split, "Non-releasable allocs", format_count),
    ];

    let mut lines: Vec<String> = Vec::new();
    lines.push("=".repeat(WIDTH));
    // §9 header: " {_:16} PyTorch CUDA memory summary, device ID {device:<17d} ".
    lines.push(format!(
        " {:16} PyTorch CUDA memory summary, device ID {device:<17} ",
        ""
    ));
    lines.push("-".repeat(WIDTH));
    lines.push(format!(
        "  {:9} CUDA OOMs: {:<12} | {:6} cudaMalloc retries: {:<8}  ",
        "", stats.num_ooms, "", stats.num_alloc_retries
    ));
    lines.push("=".repeat(WIDTH));
    lines.push(
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ".to_string(),
    );

    for (array, name, formatter) in metrics {
        lines.push("-".repeat(WIDTH));
        // §9 the "all" row's values choose the unit of each column, pool rows included.
        let pref = &array.all;
        lines.push(row(name, &array.all, pref, formatter));
        if !abbreviated {
            lines.push(row(
                "      from large pool",
                &array.large_pool,
                pref,
                formatter,
            ));
            lines.push(row(
                "      from small pool",
                &array.small_pool,
                pref,
                formatter,
            ));
        }
    }

    for (stat, name) in [
        (&stats.oversize_allocations, "Oversize allocations"),
        (&stats.oversize_segments, "Oversize GPU segments"),
    ] {
        lines.push("-".repeat(WIDTH));
        // §9 oversize rows: counts, each value its own unit reference.
        lines.push(row(name, stat, stat, format_count));
    }
    lines.push("=".repeat(WIDTH));

    // "|" + "|\n|".join(lines) + "|\n"
    let mut out = String::with_capacity(lines.len() * (WIDTH + 3));
    for line in &lines {
        out.push('|');
        out.push_str(line);
        out.push_str("|\n");
    }
    out
}

/// A cell formatter: the value and the value that picks its unit.
type Formatter = fn(i64, i64) -> String;

/// `f" {name:<21} | {cur} | {peak} | {alloc} | {freed} "`.
fn row(name: &str, stat: &Stat, pref: &Stat, formatter: Formatter) -> String {
    format!(
        " {name:<21} | {} | {} | {} | {} ",
        formatter(stat.current, pref.current),
        formatter(stat.peak, pref.peak),
        formatter(stat.allocated, pref.allocated),
        formatter(stat.freed, pref.freed),
    )
}

/// `_format_size`: `f"{sz:6d} {prefix}"`. §9 the unit steps up (B, KiB, ... PiB) while the reference value
/// is at least 768 KiB of the current unit; the value is floor-divided by 1024 at each step.
fn format_size(size: i64, pref: i64) -> String {
    const PREFIXES: [&str; 6] = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let (value, unit) = scale(size, pref, 768 * 1024, 1024, PREFIXES.len());
    format!("{value:6} {}", PREFIXES[unit])
}

/// `_format_count`: `f"{cnt:7d} {prefix} "`. §9 the unit steps up (" ", K, M) while the reference value
/// is at least 750 thousand of the current unit; the value is floor-divided by 1000 at each step.
fn format_count(count: i64, pref: i64) -> String {
    const PREFIXES: [&str; 3] = [" ", "K", "M"];
    let (value, unit) = scale(count, pref, 750 * 1000, 1000, PREFIXES.len());
    format!("{value:7} {} ", PREFIXES[unit])
}

/// The unit loop shared by both formatters: returns the scaled value and the index of the unit.
///
/// Python compares the reference as an `int` first and as a `float` after its first true division
/// (`pref /= step`); both are reproduced. The division of a reference beyond 2^53 by 1000 can differ
/// from Python's correctly rounded `int / int` in the last bit, which no real statistic reaches.
fn scale(value: i64, pref: i64, threshold: i64, step: i64, units: usize) -> (i64, usize) {
    let mut value = value;
    let mut unit = 0;
    // First comparison: Python int against int.
    if pref < threshold {
        return (value, unit);
    }
    unit += 1;
    value = value.div_euclid(step);
    let mut pref = pref as f64 / step as f64;
    while unit + 1 < units {
        if pref < threshold as f64 {
            break;
        }
        unit += 1;
        value = value.div_euclid(step);
        pref /= step as f64;
    }
    (value, unit)
}
