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
use vramsim_models::zoo::Arch;
use vramsim_models::{Graph, Recipe, Shard};
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

/// The graph `recipe.parallel.device`'s lowering takes: the model built for the device's chunk,
/// cut where the training loop's criterion starts on every device but the output device, which
/// gets the gathered outputs and the criterion over the whole batch (the model built for the
/// whole batch supplies the criterion's shapes); see `vramsim_models::dataparallel::device_graph`.
pub fn device_graph(arch: &Arch, recipe: &Recipe) -> Result<Graph> {
    let replica = arch.build(&graph_recipe(recipe))?;
    vramsim_models::dataparallel::device_graph(
        replica,
        &recipe.parallel,
        || Ok(arch.build(recipe)?),
    )
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
            roles.push(RankRole::of(device0, what, ds));
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
        let (report, _) = replay_step(&lowered, &args.machine, 0, false)?;
        roles.push(RankRole::of(&report, what, ds));
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

/// `recommend --dp N --shard dataparallel`: DataParallel against DDP on the same devices for the
/// same global batch (DDP's ranks take `ceil(B / N)` each, DataParallel's largest chunk).
pub struct Comparison {
    /// Devices.
    pub gpus: u32,
    /// The global batch.
    pub global_batch: u64,
    /// DataParallel's device roles (device 0 first).
    pub dataparallel: Vec<RankRole>,
    /// DDP's per-rank batch.
    pub ddp_batch: u64,
    /// DDP's one rank role.
    pub ddp: RankRole,
    /// The two `vramsim predict` command lines (DataParallel, DDP).
    pub commands: [String; 2],
}

/// Evaluates DataParallel and DDP for `fixed` (predict's options, with `--dp N --shard
/// dataparallel`) and `global_batch`.
pub fn compare_with_ddp(
    fixed: &crate::sweep::FixedOptions,
    global_batch: u64,
) -> Result<Comparison> {
    let set = |pairs: &[(&str, String)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    };
    let dp_settings = set(&[("batch", global_batch.to_string())]);
    let dp_args: PredictArgs = crate::parse_args("predict", &fixed.args(&dp_settings))?;
    let gpus = dp_args.dp;
    if gpus < 2 {
        anyhow::bail!("comparing DataParallel with DDP needs --dp 2 or more");
    }
    let dp = crate::predict::predict(&dp_args)?;
    let ddp_batch = global_batch.div_ceil(u64::from(gpus));
    let mut ddp_settings = set(&[
        ("batch", ddp_batch.to_string()),
        ("shard", "ddp".to_string()),
    ]);
    if fixed.has("output-device") {
        // DataParallel's option: DDP has no output device.
        ddp_settings.push(("output-device".to_string(), "0".to_string()));
    }
    let ddp_args: PredictArgs = crate::parse_args("predict", &fixed.args(&ddp_settings))?;
    let ddp = crate::predict::predict(&ddp_args)?;
    let ddp_role = crate::ranks::roles(&ddp.lowered.recipe.parallel, &ddp.report)
        .into_iter()
        .next()
        .expect("one role");
    Ok(Comparison {
        gpus,
        global_batch,
        dataparallel: dp.devices,
        ddp_batch,
        ddp: ddp_role,
        commands: [
            fixed.command_line(&dp_settings),
            fixed.command_line(&ddp_settings),
        ],
    })
}

impl Comparison {
    /// Whether every DataParallel device fits.
    pub fn dataparallel_fits(&self) -> bool {
        self.dataparallel.iter().all(|r| r.fits)
    }

    /// The verdict in one sentence.
    pub fn verdict(&self) -> String {
        let worst = self
            .dataparallel
            .iter()
            .map(|r| r.peak_reserved)
            .max()
            .unwrap_or(0);
        match (self.dataparallel_fits(), self.ddp.fits) {
            (false, true) => format!(
                "DDP fits and DataParallel does not: DataParallel's GPU 0 holds the optimizer state, the reduced gradients and the gathered outputs ({} reserved at its peak, {} on a DDP rank)",
                format_size(self.dataparallel[0].peak_reserved),
                format_size(self.ddp.peak_reserved)
            ),
            (true, true) => format!(
                "both fit; the largest DataParallel device reserves {} at its peak, a DDP rank {}",
                format_size(worst),
                format_size(self.ddp.peak_reserved)
            ),
            (true, false) => "DataParallel fits and DDP does not".to_string(),
            (false, false) => "neither fits".to_string(),
        }
    }

    /// `recommend`'s table for the comparison.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "DataParallel over {} GPUs, batch {}: {}",
            self.gpus,
            self.global_batch,
            if self.dataparallel_fits() {
                "fits"
            } else {
                "out of memory"
            }
        );
        out.push_str(&crate::ranks::to_table_lines(&self.dataparallel));
        let _ = writeln!(out, "  {}", self.commands[0]);
        let _ = writeln!(
            out,
            "DDP over {} GPUs, batch {} per rank: {}",
            self.gpus,
            self.ddp_batch,
            if self.ddp.fits {
                "fits"
            } else {
                "out of memory"
            }
        );
        out.push_str(&crate::ranks::to_table_lines(std::slice::from_ref(
            &self.ddp,
        )));
        let _ = writeln!(out, "  {}", self.commands[1]);
        let _ = writeln!(out, "verdict    {}", self.verdict());
        out
    }

    /// `recommend --json`'s document for the comparison.
    pub fn to_json(&self) -> Value {
        json!({
            "gpus": self.gpus,
            "global_batch": self.global_batch,
            "dataparallel": {
                "fits": self.dataparallel_fits(),
                "roles": crate::ranks::to_json(&self.dataparallel),
                "command": self.commands[0],
            },
            "ddp": {
                "batch_per_rank": self.ddp_batch,
                "fits": self.ddp.fits,
                "roles": crate::ranks::to_json(std::slice::from_ref(&self.ddp)),
                "command": self.commands[1],
            },
            "verdict": self.verdict(),
        })
    }
}
