//! The per-rank view of a parallel layout (`--dp`, `--shard`): which ranks play which role, and
//! each role's peaks, breakdown by category and verdict. Ranks that play the same role have the
//! same trace, so each role is replayed once; the layout fits only if every role fits.
//!
//! Data parallelism alone has one role: every data-parallel rank holds the same shapes (DDP:
//! everything; ZeRO-1/2/3: equal padded partitions), so rank 0's replay stands for all of them;
//! `ZeroRedundancyOptimizer` (`zero1-torch`) gives whole parameters to ranks, and the rank with
//! the most optimizer state (the worst) stands for all.

use std::fmt::Write as _;

use serde_json::{json, Value};
use vramsim_models::{Parallel, Shard};
use vramsim_sim::format::format_size;
use vramsim_sim::report::Report;
use vramsim_traces::Category;

/// One role of a layout: the ranks that play it and what its replay measured.
#[derive(Clone, Debug)]
pub struct RankRole {
    /// What the role is (`data-parallel rank`).
    pub role: String,
    /// The global ranks playing it.
    pub ranks: Vec<u32>,
    /// Peak allocated bytes.
    pub peak_allocated: u64,
    /// Peak reserved bytes.
    pub peak_reserved: u64,
    /// Peak device memory used (reserved + CUDA context + what else the machine says is used).
    pub peak_device_used: u64,
    /// Allocated bytes by category at the peak allocated.
    pub by_category: Vec<(Category, u64)>,
    /// Whether the role's step fits.
    pub fits: bool,
    /// PyTorch's out-of-memory message when it does not.
    pub oom_message: Option<String>,
}

impl RankRole {
    /// The role `role` played by `ranks`, with what the replay `report` of its trace measured.
    pub fn of(report: &Report, role: String, ranks: Vec<u32>) -> RankRole {
        RankRole {
            role,
            ranks,
            peak_allocated: report.peak_allocated(),
            peak_reserved: report.peak_reserved(),
            peak_device_used: report.outcome.peak_device_used,
            by_category: Category::ALL
                .iter()
                .copied()
                .zip(report.outcome.categories_at_peak)
                .filter(|(_, b)| *b > 0)
                .collect(),
            fits: report.fits(),
            oom_message: report.outcome.oom.as_ref().map(|o| o.message.clone()),
        }
    }
}

/// The roles of `parallel`, each with the replay `report` of its trace (one role for data
/// parallelism).
pub fn roles(parallel: &Parallel, report: &Report) -> Vec<RankRole> {
    let role = match parallel.shard {
        Shard::None => "single GPU",
        Shard::Ddp => "data-parallel rank (DDP replica)",
        Shard::Zero1 => "data-parallel rank (ZeRO-1 partition)",
        Shard::Zero2 => "data-parallel rank (ZeRO-2 partition)",
        Shard::Zero3 => "data-parallel rank (ZeRO-3 partition, parameters gathered per submodule)",
        // The greedy partition gives ranks unequal state: the lowered rank holds the most.
        Shard::ZeroRedundancy => {
            "data-parallel rank (ZeroRedundancyOptimizer; the rank with the most optimizer state)"
        }
        // torch.chunk gives rank 0 the largest shards: its trace is the worst rank's.
        Shard::Fsdp2 => "data-parallel rank (FSDP2 shard; rank 0, the largest shards)",
        // One device: DataParallel calls the module itself (`crate::dataparallel` for more).
        Shard::DataParallel => "device 0 (DataParallel)",
    };
    // Tensor parallelism: every rank of the group holds equal shards (one role).
    let role = match (parallel.tp > 1, parallel.shard) {
        (false, _) => role.to_string(),
        (true, Shard::None) => tp_role(parallel),
        (true, _) => format!("{role} × {}", tp_role(parallel)),
    };
    vec![RankRole::of(
        report,
        role.to_string(),
        (0..parallel.world_size()).collect(),
    )]
}

/// The role of a tensor-parallel rank.
pub(crate) fn tp_role(parallel: &Parallel) -> String {
    format!(
        "tensor-parallel rank (1/{} of the attention, MLP, embedding and logits{})",
        parallel.tp,
        if parallel.sp {
            ", sequence-parallel norms and dropouts"
        } else {
            ""
        }
    )
}

/// `0-7`, or `0, 2, 5` for ranks that are not a run.
fn rank_list(ranks: &[u32]) -> String {
    match (ranks.first(), ranks.last()) {
        (Some(a), Some(b)) if ranks.len() > 2 && (b - a) as usize + 1 == ranks.len() => {
            format!("{a}-{b}")
        }
        _ => ranks
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// The `ranks` array of `predict --json`.
pub fn to_json(roles: &[RankRole]) -> Value {
    Value::Array(
        roles
            .iter()
            .map(|r| {
                json!({
                    "role": r.role,
                    "ranks": r.ranks,
                    "peak_allocated_bytes": r.peak_allocated,
                    "peak_reserved_bytes": r.peak_reserved,
                    "peak_device_used_bytes": r.peak_device_used,
                    "by_category": Value::Object(r.by_category.iter().map(|(c, b)| (c.name().to_string(), json!(b))).collect()),
                    "fits": r.fits,
                    "oom_message": r.oom_message,
                })
            })
            .collect(),
    )
}

/// The layout's lines of `predict`'s table: one per role.
pub fn to_table(parallel: &Parallel, roles: &[RankRole]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "layout     dp {} × --shard {}{} = {} ranks; {} distinct role{} replayed; fits only if every rank fits",
        parallel.dp,
        parallel.shard,
        match (parallel.tp, parallel.sp) {
            (1, _) => String::new(),
            (t, false) => format!(" × tp {t}"),
            (t, true) => format!(" × tp {t} --sp"),
        },
        parallel.world_size(),
        roles.len(),
        if roles.len() == 1 { "" } else { "s" }
    );
    out.push_str(&to_table_lines(roles));
    out
}

/// The line that says what NCCL holds on each rank (nothing on one GPU).
pub fn nccl_line(nccl: &crate::nccl::NcclMemory) -> String {
    if nccl.communicators.is_empty() {
        return String::new();
    }
    let groups = nccl
        .communicators
        .iter()
        .map(|(d, n)| format!("{d} ({n} ranks)"))
        .collect::<Vec<_>>()
        .join(", ");
    if nccl.given {
        format!(
            "nccl       {} per rank outside the caching allocator (--nccl-memory); communicators: {groups}\n",
            format_size(nccl.bytes)
        )
    } else {
        format!(
            "nccl       {} per rank outside the caching allocator, in device used: {} communicator{} × {} channels × 12 MiB (estimate; --nccl-memory overrides): {groups}\n",
            format_size(nccl.bytes),
            nccl.communicators.len(),
            if nccl.communicators.len() == 1 { "" } else { "s" },
            nccl.channels
        )
    }
}

/// The ranks of the role that decides: out of memory first, then the largest peak reserved.
pub fn worst_ranks(roles: &[RankRole]) -> Vec<u32> {
    roles
        .iter()
        .max_by_key(|r| (!r.fits, r.peak_reserved))
        .map(|r| r.ranks.clone())
        .unwrap_or_default()
}

/// The table's `decides` line for rank-by-rank layouts: the deciding ranks, whose step the report
/// above shows, and whether every rank fits.
pub fn decides_line(roles: &[RankRole]) -> String {
    format!(
        "decides    rank {:?} ({}); the report above is its step\n",
        worst_ranks(roles),
        if roles.iter().all(|r| r.fits) {
            "every rank fits"
        } else {
            "out of memory"
        }
    )
}

/// One line per role: its ranks, peaks, verdict and categories at the peak allocated.
pub fn to_table_lines(roles: &[RankRole]) -> String {
    let mut out = String::new();
    for r in roles {
        let cats = r
            .by_category
            .iter()
            .map(|(c, b)| format!("{} {}", c.name(), format_size(*b)))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            out,
            "ranks {:<5}{}: peak allocated {}, reserved {}, device used {}, {}; at peak allocated: {}",
            // A list wider than the column (a pipeline stage's `40-47`) keeps a space before the role.
            format!("{} ", rank_list(&r.ranks)),
            r.role,
            format_size(r.peak_allocated),
            format_size(r.peak_reserved),
            format_size(r.peak_device_used),
            if r.fits { "fits" } else { "out of memory" },
            cats
        );
    }
    out
}

/// Where `--plot PATH` puts the bars per role: `NAME-roles.EXT` beside `PATH`.
pub fn roles_plot_path(path: &std::path::Path) -> std::path::PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}-roles.{}", ext.to_string_lossy()),
        None => format!("{stem}-roles"),
    };
    path.with_file_name(name)
}

/// Draws a bar per role (its peak device use, with allocated and reserved) against the device's
/// `total` memory, to `path` (PNG or SVG by extension).
pub fn plot_roles(
    title: &str,
    roles: &[RankRole],
    total: u64,
    path: &std::path::Path,
) -> Result<(), vramsim_sim::plot::PlotError> {
    let bars: Vec<vramsim_sim::plot::Bar> = roles
        .iter()
        .map(|r| vramsim_sim::plot::Bar {
            label: format!("ranks {} · {}", rank_list(&r.ranks), r.role),
            allocated: r.peak_allocated,
            reserved: r.peak_reserved,
            device_used: r.peak_device_used,
            fits: r.fits,
        })
        .collect();
    vramsim_sim::plot::plot_bars(
        &vramsim_sim::plot::BarPlot {
            title,
            bars: &bars,
            capacity: Some(total),
            note: Some("each role is replayed once and stands for the ranks it lists; the layout fits only if every role fits"),
        },
        path,
    )
}
