//! `--shard dataparallel` (`torch.nn.DataParallel`), device by device: each device plays its own
//! role (device 0 holds the module, its gradients, the optimizer and the reduce results; the
//! output device the gathered outputs; the others per-forward replicas), so each distinct role is
//! lowered and replayed once and the layout fits only if every device fits. Devices 1..N-1 are
//! alike unless `torch.chunk` gives the last one a smaller chunk; devices the batch does not reach
//! (a batch smaller than N) hold nothing.

use std::fmt::Write as _;

use anyhow::Result;
use serde_json::{json, Value};
use vramsim_models::dataparallel::chunk_sizes;
use vramsim_models::{Recipe, Shard};
use vramsim_sim::format::format_size;
use vramsim_sim::report::Report;
use vramsim_traces::Category;

use crate::predict::{lower_step_device, replay_step, PredictArgs};
use crate::ranks::RankRole;

/// The recipe the graph of the recipe's device is built with: its `torch.chunk` piece of the batch.
pub fn graph_recipe(recipe: &Recipe) -> Recipe {
    let mut r = recipe.clone();
    r.batch = r.parallel.replica_batch(r.batch);
    r
}

/// Whether `recipe` is DataParallel over two or more devices.
pub fn is_multi(recipe: &Recipe) -> bool {
    recipe.parallel.shard == Shard::DataParallel && recipe.parallel.dp > 1
}

/// The devices that play the same role, and the one whose trace stands for them: device 0, the
/// output device, then the other devices grouped by chunk size, then the idle ones.
pub fn device_groups(recipe: &Recipe) -> Vec<(u32, Vec<u32>)> {
    let p = &recipe.parallel;
    let chunks = chunk_sizes(recipe.batch, p.dp);
    let mut groups: Vec<(u32, Vec<u32>)> = vec![(0, vec![0])];
    if p.output_device != 0 {
        groups.push((p.output_device, vec![p.output_device]));
    }
    let mut by_chunk: Vec<(u64, Vec<u32>)> = Vec::new();
    for d in 1..p.dp {
        if d == p.output_device {
            continue;
        }
        let c = chunks.get(d as usize).copied().unwrap_or(0);
        match by_chunk.iter_mut().find(|(k, _)| *k == c) {
            Some((_, ds)) => ds.push(d),
            None => by_chunk.push((c, vec![d])),
        }
    }
    groups.extend(by_chunk.into_iter().map(|(_, ds)| (ds[0], ds)));
    groups
}

fn role_of(report: &Report, role: String, ranks: Vec<u32>) -> RankRole {
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

/// Lowers and replays every distinct device role of `args`' DataParallel layout; `device0` is the
/// replay of device 0 (`predict`'s own).
pub fn device_roles(
    args: &PredictArgs,
    recipe: &Recipe,
    device0: &Report,
) -> Result<Vec<RankRole>> {
    let chunks = chunk_sizes(recipe.batch, recipe.parallel.dp);
    let out = recipe.parallel.output_device;
    let mut roles = Vec::new();
    for (d, ds) in device_groups(recipe) {
        let chunk = chunks.get(d as usize).copied().unwrap_or(0);
        let what = match (d, d == out) {
            (0, true) => format!("device 0 (module, .grad, optimizer, reduce results, gathered outputs; chunk {chunk})"),
            (0, false) => format!("device 0 (module, .grad, optimizer, reduce results; chunk {chunk})"),
            (_, true) => format!("output device (replica copies, gathered outputs; chunk {chunk})"),
            _ if chunk == 0 => "not reached by the batch (torch.chunk made fewer pieces): nothing".to_string(),
            _ => format!("replica (parameter and buffer copies; chunk {chunk})"),
        };
        if d == 0 {
            roles.push(role_of(device0, what, ds));
            continue;
        }
        if chunk == 0 {
            roles.push(RankRole {
                role: what,
                ranks: ds,
                peak_allocated: 0,
                peak_reserved: 0,
                peak_device_used: 0,
                by_category: Vec::new(),
                fits: true,
                oom_message: None,
            });
            continue;
        }
        let lowered = lower_step_device(args, d)?;
        let (report, _) = replay_step(&lowered, &args.machine, 0)?;
        roles.push(role_of(&report, what, ds));
    }
    Ok(roles)
}

/// The device that decides (the largest peak reserved, an out-of-memory one first) and by how much
/// device 0's peak allocated exceeds the largest other device's, with the categories that differ most.
fn verdict(roles: &[RankRole]) -> (usize, i128, Vec<(Category, i128)>) {
    let decides = (0..roles.len())
        .max_by_key(|&i| (!roles[i].fits, roles[i].peak_reserved))
        .unwrap_or(0);
    let other = (1..roles.len()).max_by_key(|&i| roles[i].peak_allocated);
    let Some(o) = other else {
        return (decides, 0, Vec::new());
    };
    let excess = roles[0].peak_allocated as i128 - roles[o].peak_allocated as i128;
    let get = |r: &RankRole, c: Category| {
        r.by_category
            .iter()
            .find(|(k, _)| *k == c)
            .map(|(_, b)| *b as i128)
            .unwrap_or(0)
    };
    let mut diffs: Vec<(Category, i128)> = Category::ALL
        .iter()
        .map(|&c| (c, get(&roles[0], c) - get(&roles[o], c)))
        .filter(|(_, d)| *d != 0)
        .collect();
    diffs.sort_by_key(|(_, d)| -d.abs());
    (decides, excess, diffs)
}

fn signed(b: i128) -> String {
    if b < 0 {
        format!("-{}", format_size(b.unsigned_abs() as u64))
    } else {
        format!("+{}", format_size(b as u64))
    }
}

/// `predict`'s lines for a DataParallel layout: one per device role, then which device decides.
pub fn to_table(recipe: &Recipe, roles: &[RankRole]) -> String {
    let p = &recipe.parallel;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "layout     nn.DataParallel over devices 0-{} (output device {}), batch {} in chunks {:?}; fits only if every device fits",
        p.dp - 1,
        p.output_device,
        recipe.batch,
        chunk_sizes(recipe.batch, p.dp)
    );
    out.push_str(&crate::ranks::to_table_lines(roles));
    let (decides, excess, diffs) = verdict(roles);
    let why = diffs
        .iter()
        .take(4)
        .map(|(c, d)| format!("{} {}", c.name(), signed(*d)))
        .collect::<Vec<_>>()
        .join(", ");
    let _ = writeln!(
        out,
        "decides    devices {:?} ({}); device 0's peak allocated is {} against the largest other device (at the peaks: {})",
        roles[decides].ranks,
        if roles.iter().all(|r| r.fits) { "every device fits" } else { "out of memory" },
        signed(excess),
        why
    );
    out
}

/// The `devices` object of `predict --json` for a DataParallel layout.
pub fn to_json(recipe: &Recipe, roles: &[RankRole]) -> Value {
    let (decides, excess, diffs) = verdict(roles);
    json!({
        "chunks": chunk_sizes(recipe.batch, recipe.parallel.dp),
        "output_device": recipe.parallel.output_device,
        "roles": crate::ranks::to_json(roles),
        "fits": roles.iter().all(|r| r.fits),
        "deciding_devices": roles[decides].ranks,
        "device0_excess_allocated_bytes": excess as i64,
        "device0_excess_by_category": Value::Object(diffs.iter().map(|(c, d)| (c.name().to_string(), json!(*d as i64))).collect()),
    })
}
