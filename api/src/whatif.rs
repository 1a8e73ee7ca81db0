//! `vramsim whatif`: `predict` over a grid of options (`--vary precision=fp32,amp-bf16 --vary
//! batch=8,16,32 ...`), evaluated in parallel, reported as a table sorted by peak, JSON, CSV or a bar
//! chart, with a step-time estimate for each configuration (see [`crate::steptime`]).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use vramsim_sim::format::format_size;
use vramsim_sim::plot::{plot_bars, Bar, BarPlot};

use crate::sweep::{
    self, Evaluated, FixedOptions, OptionSet, Progress, Setting, Wants, MAX_POINTS,
};

/// Bars drawn at most in a what-if chart (the lowest peaks first).
const MAX_BARS: usize = 60;

/// Options of `vramsim whatif`.
#[derive(Args, Debug)]
pub struct WhatifArgs {
    /// Vary a `predict` option over values: KEY=V1,V2,... (repeat for more options; the grid is their
    /// cartesian product). Any option of `vramsim predict` can be varied, e.g. precision, checkpoint,
    /// accum, batch, seq, optimizer, model, gpu, alloc-conf; flags take true,false. Separate the values
    /// with ';' instead when they contain commas, e.g.
    /// --vary 'alloc-conf=;max_split_size_mb:128,garbage_collection_threshold:0.6'.
    #[arg(long, value_name = "KEY=V1,V2,...")]
    pub vary: Vec<String>,
    /// Print one JSON object per configuration (a list): its options, `predict --json`'s fields, the
    /// effective batch and the step-time estimate.
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// Print the table as CSV.
    #[arg(long)]
    pub csv: bool,
    /// Draw the peaks as a bar chart to a .png or .svg file.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Print the step-time model's per-GPU figures (peak TFLOP/s, bandwidth, sources) and exit.
    #[arg(long)]
    pub gpu_figures: bool,
    /// The options of `vramsim predict` that stay fixed (`--model` or `--hf-config` is required).
    #[command(flatten)]
    pub predict: FixedOptions,
}

/// One option varied over values.
#[derive(Clone, Debug, PartialEq)]
pub struct Axis {
    /// The option's long name.
    pub key: String,
    /// Its values, in order.
    pub values: Vec<String>,
}

/// A grid of configurations: the cartesian product of its axes, the first axis varying slowest.
#[derive(Clone, Debug, PartialEq)]
pub struct Grid {
    /// The axes.
    pub axes: Vec<Axis>,
}

impl Grid {
    /// Reads `--vary` specifications, checking the keys against `predict`'s options, the values with
    /// `predict`'s own parsers, and the size against [`MAX_POINTS`].
    pub fn parse(specs: &[String], fixed: &FixedOptions) -> Result<Grid> {
        let set = OptionSet::predict();
        if specs.is_empty() {
            bail!(
                "empty grid: nothing is varied; give --vary KEY=V1,V2,... for one or more of predict's options: {}",
                set.names()
            );
        }
        let mut axes: Vec<Axis> = Vec::new();
        for spec in specs {
            let Some((key, list)) = spec.split_once('=') else {
                bail!("--vary {spec:?}: expected KEY=V1,V2,... (e.g. --vary batch=8,16,32)");
            };
            let option = set.find(key).with_context(|| {
                format!(
                    "unknown --vary key {:?}: the options of predict that can be varied are {}",
                    key.trim(),
                    set.names()
                )
            })?;
            if fixed.has(&option.long) {
                bail!(
                    "--{} is both fixed and varied (--vary {spec}); give it once",
                    option.long
                );
            }
            let values = split_values(list);
            if values.is_empty() {
                bail!(
                    "empty grid: --vary {spec} lists no values (e.g. --vary {}=V1,V2)",
                    option.long
                );
            }
            if option.flag {
                if let Some(bad) = values.iter().find(|v| *v != "true" && *v != "false") {
                    bail!(
                        "invalid value {bad:?} for --vary {}: it is a flag; valid values are true, false",
                        option.long
                    );
                }
            }
            match axes.iter_mut().find(|a| a.key == option.long) {
                // repeating a key adds values (a way to give values that hold both ',' and ';')
                Some(axis) => axis.values.extend(values),
                None => axes.push(Axis {
                    key: option.long.clone(),
                    values,
                }),
            }
        }
        let grid = Grid { axes };
        let points = grid.len();
        if points > MAX_POINTS {
            bail!(
                "the grid has {} configurations ({}), more than the {} a sweep evaluates; vary fewer options or fewer values",
                group(points),
                grid.axes
                    .iter()
                    .map(|a| format!("{} {}", a.values.len(), a.key))
                    .collect::<Vec<_>>()
                    .join(" × "),
                group(MAX_POINTS)
            );
        }
        grid.check_values(fixed)?;
        Ok(grid)
    }

    /// Whether the grid has no configuration (an axis without values).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Configurations in the grid.
    pub fn len(&self) -> u128 {
        self.axes
            .iter()
            .map(|a| a.values.len() as u128)
            .fold(1u128, |n, k| n.saturating_mul(k))
    }

    /// Each value parses as `predict` parses it and names a known model and a valid machine (checked with
    /// the other axes at their first values); the first configuration must be complete.
    fn check_values(&self, fixed: &FixedOptions) -> Result<()> {
        let set = OptionSet::predict();
        let firsts: Vec<Setting> = self
            .axes
            .iter()
            .map(|a| (a.key.clone(), a.values[0].clone()))
            .collect();
        for (i, axis) in self.axes.iter().enumerate() {
            for value in &axis.values {
                let mut settings = firsts.clone();
                settings[i].1 = value.clone();
                let args = set
                    .parse(&fixed.args(&settings))
                    .and_then(|args| sweep::check(&args).map(|()| args));
                if let Err(e) = args {
                    let message = format!("{e:#}");
                    // clap's own complaints name the option; a missing one is about the fixed options
                    if message.contains("required") {
                        bail!("{message}");
                    }
                    bail!("invalid value {value:?} for --vary {}: {message}", axis.key);
                }
            }
        }
        Ok(())
    }

    /// Every configuration's settings, the first axis varying slowest.
    pub fn points(&self) -> Vec<Vec<Setting>> {
        let mut points: Vec<Vec<Setting>> = vec![Vec::new()];
        for axis in &self.axes {
            points = points
                .into_iter()
                .flat_map(|p| {
                    axis.values.iter().map(move |v| {
                        let mut q = p.clone();
                        q.push((axis.key.clone(), v.clone()));
                        q
                    })
                })
                .collect();
        }
        points
    }
}

/// `a,b,c` → `[a, b, c]`; with a `;` anywhere, `;` separates instead. `""` and `''` stand for the empty
/// value; a list that is empty altogether has no values.
fn split_values(list: &str) -> Vec<String> {
    if list.trim().is_empty() {
        return Vec::new();
    }
    let separator = if list.contains(';') { ';' } else { ',' };
    list.split(separator)
        .map(|v| {
            let v = v.trim();
            if v == "\"\"" || v == "''" {
                String::new()
            } else {
                v.to_string()
            }
        })
        .collect()
}

/// `1234567` → `1,234,567`.
fn group(n: u128) -> String {
    vramsim_sim::report::group_digits(u64::try_from(n).unwrap_or(u64::MAX))
}

/// One row of the result: a configuration's settings and what `predict` made of it.
pub struct Row {
    /// The varied settings.
    pub settings: Vec<Setting>,
    /// The evaluation, or why `predict` refused the configuration.
    pub result: Result<Evaluated, String>,
}

/// The result of a what-if sweep: the grid and its rows, sorted as [`sort_rows`] sorts them.
pub struct Whatif {
    /// The grid of varied options.
    pub grid: Grid,
    /// One row per configuration.
    pub rows: Vec<Row>,
}

impl Whatif {
    /// `vramsim whatif --json`'s document (its rows have `predict --json`'s fields only when the
    /// sweep was asked for them: `--json`, or [`Wants::json`]).
    pub fn to_json(&self) -> Value {
        Value::Array(self.rows.iter().map(row_json).collect())
    }

    /// `vramsim whatif --csv`'s document.
    pub fn to_csv(&self) -> String {
        to_csv(&self.rows, &self.grid)
    }
}

/// `vramsim whatif` without the printing: evaluates the grid (with `predict --json`'s document for
/// every configuration when `json` is set) and draws `--plot` when given. `progress` makes the
/// progress reporter for a number of configurations ([`Progress::new`], or [`Progress::hidden`]).
pub fn whatif(
    args: &WhatifArgs,
    json: bool,
    progress: impl FnOnce(u64) -> Progress,
) -> Result<Whatif> {
    let grid = Grid::parse(&args.vary, &args.predict)?;
    let points = grid.points();
    let configs: Vec<Vec<String>> = points.iter().map(|p| args.predict.args(p)).collect();
    let wants = Wants {
        json,
        timeline_points: 0,
    };
    let progress = progress(configs.len() as u64);
    let results = sweep::evaluate(&configs, wants, &progress);
    progress.finish();
    let mut rows: Vec<Row> = points
        .into_iter()
        .zip(results)
        .map(|(settings, result)| Row { settings, result })
        .collect();
    sort_rows(&mut rows);
    if rows.iter().all(|r| r.result.is_err()) {
        let first = rows[0].result.as_ref().err().cloned().unwrap_or_default();
        bail!("predict refused every configuration; the first: {first}");
    }
    if let Some(path) = &args.plot {
        draw(&rows, &args.predict, path)?;
    }
    Ok(Whatif { grid, rows })
}

/// Runs `vramsim whatif`.
pub fn run(args: WhatifArgs) -> Result<()> {
    if args.gpu_figures {
        print!("{}", crate::steptime::perf_table());
        println!("\n(dense TFLOP/s; GB/s of memory bandwidth; see `vramsim whatif --help` for the model)");
        return Ok(());
    }
    let result = whatif(&args, args.json, |n| Progress::new(n, "whatif"))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result.to_json())?);
    } else if args.csv {
        print!("{}", result.to_csv());
    } else {
        print!("{}", to_table(&result.rows, &result.grid, &args.predict));
        if let Some(path) = &args.plot {
            println!("plot     {}", path.display());
        }
    }
    Ok(())
}

/// Fitting configurations by peak device use, then those that run out of memory (their peaks stop at
/// the failure) by peak, then those `predict` refused; ties keep grid order.
pub fn sort_rows(rows: &mut [Row]) {
    rows.sort_by_key(|r| match &r.result {
        Ok(e) if e.fits() => (0, e.report.peak_device_used()),
        Ok(e) => (1, e.report.peak_device_used()),
        Err(_) => (2, 0),
    });
}

/// The JSON object of one row: `options`, then `predict --json`'s fields, the effective batch and the
/// step time.
pub fn row_json(row: &Row) -> Value {
    let options: serde_json::Map<String, Value> = row
        .settings
        .iter()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    match &row.result {
        Err(message) => json!({ "options": options, "error": message }),
        Ok(e) => {
            let mut object = serde_json::Map::new();
            object.insert("options".into(), Value::Object(options));
            if let Some(Value::Object(fields)) = &e.json {
                object.extend(fields.clone());
            }
            object.insert("effective_batch".into(), json!(e.effective_batch()));
            object.insert("step_time".into(), step_json(e));
            Value::Object(object)
        }
    }
}

/// The step-time estimate as JSON.
pub fn step_json(e: &Evaluated) -> Value {
    json!({
        "step_ms": e.step.step_ms,
        "factor": e.step.factor,
        "samples_per_s": e.samples_per_s(),
        "forward_ms": e.step.forward_ms,
        "backward_ms": e.step.backward_ms,
        "recompute_ms": e.step.recompute_ms,
        "optimizer_ms": e.step.optimizer_ms,
        "flops": e.step.flops,
        "comm_ms": e.step.comm_ms,
        "gpu_figures": e.perf_preset,
        "gpu_figures_are_the_devices": e.perf_own,
    })
}

/// The CSV document: the varied options, then fixed columns.
pub fn to_csv(rows: &[Row], grid: &Grid) -> String {
    let mut out = String::new();
    let mut header: Vec<String> = grid.axes.iter().map(|a| a.key.clone()).collect();
    header.extend(
        [
            "model",
            "batch",
            "seq",
            "precision",
            "optimizer",
            "checkpoint",
            "accum",
            "device",
            "alloc_conf",
            "fits",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "peak_device_used_bytes",
            "peak_requested_bytes",
            "effective_batch",
            "step_ms",
            "step_time_factor",
            "samples_per_s",
            "oom_message",
            "error",
        ]
        .map(String::from),
    );
    let _ = writeln!(
        out,
        "{}",
        header.iter().map(|h| csv(h)).collect::<Vec<_>>().join(",")
    );
    for row in rows {
        let mut cells: Vec<String> = row.settings.iter().map(|(_, v)| v.clone()).collect();
        match &row.result {
            Ok(e) => {
                let r = &e.prediction.recipe;
                cells.extend([
                    e.prediction.arch.name().to_string(),
                    r.batch.to_string(),
                    r.seq.to_string(),
                    r.precision.to_string(),
                    r.optimizer.to_string(),
                    r.checkpointing.to_string(),
                    r.accum.to_string(),
                    e.report.device.name.clone(),
                    e.report.alloc_conf.clone(),
                    e.fits().to_string(),
                    e.report.peak_allocated().to_string(),
                    e.report.peak_reserved().to_string(),
                    e.report.peak_device_used().to_string(),
                    e.report.peak_requested().to_string(),
                    e.effective_batch().to_string(),
                    format!("{:.3}", e.step.step_ms),
                    format!("{:.3}", e.step.factor),
                    format!("{:.1}", e.samples_per_s()),
                    e.oom_message().unwrap_or("").to_string(),
                    String::new(),
                ]);
            }
            Err(message) => {
                cells.extend(std::iter::repeat_n(String::new(), 19));
                cells.push(message.clone());
            }
        }
        let _ = writeln!(
            out,
            "{}",
            cells.iter().map(|c| csv(c)).collect::<Vec<_>>().join(",")
        );
    }
    out
}

/// A CSV field, quoted when it needs to be (RFC 4180).
fn csv(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_string()
    }
}

/// The table for people.
pub fn to_table(rows: &[Row], grid: &Grid, fixed: &FixedOptions) -> String {
    let mut out = String::new();
    let fixed_text = fixed
        .given
        .iter()
        .map(|(k, v)| match v {
            Some(v) if v.is_empty() => format!("--{k} ''"),
            Some(v) => format!("--{k} {v}"),
            None => format!("--{k}"),
        })
        .collect::<Vec<_>>()
        .join(" ");
    let _ = writeln!(
        out,
        "whatif   {} configurations: {}",
        rows.len(),
        grid.axes
            .iter()
            .map(|a| format!("{} ({})", a.key, a.values.len()))
            .collect::<Vec<_>>()
            .join(" × ")
    );
    let _ = writeln!(
        out,
        "fixed    {}",
        if fixed_text.is_empty() {
            "(nothing)"
        } else {
            &fixed_text
        }
    );
    if let Some(e) = rows.iter().find_map(|r| r.result.as_ref().ok()) {
        let devices: std::collections::BTreeSet<&str> = rows
            .iter()
            .filter_map(|r| r.result.as_ref().ok())
            .map(|e| e.report.device.name.as_str())
            .collect();
        let _ = writeln!(
            out,
            "model    {}, {} parameters; device {}",
            e.prediction.arch.name(),
            vramsim_sim::report::group_digits(e.prediction.params),
            devices.into_iter().collect::<Vec<_>>().join(", ")
        );
    }
    out.push('\n');
    let mut header: Vec<String> = grid.axes.iter().map(|a| a.key.clone()).collect();
    header.extend(
        [
            "allocated",
            "reserved",
            "device used",
            "result",
            "eff. batch",
            "step (ms)",
            "× plain",
            "samples/s",
        ]
        .map(String::from),
    );
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            let mut cells: Vec<String> = row
                .settings
                .iter()
                .map(|(_, v)| if v.is_empty() { "''".into() } else { v.clone() })
                .collect();
            match &row.result {
                Ok(e) => cells.extend([
                    format_size(e.report.peak_allocated()),
                    format_size(e.report.peak_reserved()),
                    format_size(e.report.peak_device_used()),
                    if e.fits() {
                        "fits".into()
                    } else {
                        "OOM".into()
                    },
                    e.effective_batch().to_string(),
                    format!("{:.1}", e.step.step_ms),
                    format!("{:.2}", e.step.factor),
                    format!("{:.1}", e.samples_per_s()),
                ]),
                Err(message) => {
                    cells.extend(std::iter::repeat_n("-".to_string(), 3));
                    cells.push(format!("error: {message}"));
                }
            }
            cells
        })
        .collect();
    let columns = header.len();
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            body.iter()
                .filter_map(|r| r.get(c))
                .chain(std::iter::once(&header[c]))
                .filter(|cell| !cell.starts_with("error: "))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let axes = grid.axes.len();
    let line = |cells: &[String]| -> String {
        let mut s = String::new();
        for (c, cell) in cells.iter().enumerate() {
            if c > 0 {
                s.push_str("  ");
            }
            let pad = widths[c].saturating_sub(cell.chars().count());
            // settings and the result left-aligned, figures right-aligned
            if c < axes || c == axes + 3 {
                s.push_str(cell);
                if c + 1 < cells.len() {
                    s.push_str(&" ".repeat(pad));
                }
            } else {
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            }
        }
        s.trim_end().to_string()
    };
    let _ = writeln!(out, "{}", line(&header));
    for cells in &body {
        let _ = writeln!(out, "{}", line(cells));
    }
    let ooms: Vec<&Evaluated> = rows
        .iter()
        .filter_map(|r| r.result.as_ref().ok())
        .filter(|e| !e.fits())
        .collect();
    out.push('\n');
    let fits = rows
        .iter()
        .filter(|r| r.result.as_ref().is_ok_and(Evaluated::fits))
        .count();
    let _ = writeln!(
        out,
        "{fits} of {} fit; sorted by peak device use (reserved + CUDA context), those that run out of memory last (their peaks stop at the failure)",
        rows.len()
    );
    if let Some(e) = ooms.first() {
        let _ = writeln!(out, "first OOM message: {}", e.oom_message().unwrap_or(""));
    }
    let borrowed = rows
        .iter()
        .filter_map(|r| r.result.as_ref().ok())
        .find(|e| !e.perf_own);
    let _ = writeln!(
        out,
        "step     estimated with a FLOP/bandwidth model{}; × plain = step time over one micro-batch's forward, backward and optimizer without recomputation (see `vramsim whatif --help`)",
        match borrowed {
            Some(e) => format!(" ({} figures: the device is a bare capacity)", e.perf_preset),
            None => String::new(),
        }
    );
    out
}

fn draw(rows: &[Row], fixed: &FixedOptions, path: &std::path::Path) -> Result<()> {
    let evaluated: Vec<(&Row, &Evaluated)> = rows
        .iter()
        .filter_map(|r| r.result.as_ref().ok().map(|e| (r, e)))
        .collect();
    let bars: Vec<Bar> = evaluated
        .iter()
        .take(MAX_BARS)
        .map(|(row, e)| Bar {
            label: row
                .settings
                .iter()
                .map(|(k, v)| match k.as_str() {
                    "alloc-conf" if v.is_empty() => "default allocator".to_string(),
                    "alloc-conf" | "precision" | "model" | "gpu" | "optimizer" => v.clone(),
                    _ => format!("{k} {v}"),
                })
                .collect::<Vec<_>>()
                .join(" · "),
            allocated: e.report.peak_allocated(),
            reserved: e.report.peak_reserved(),
            device_used: e.report.peak_device_used(),
            fits: e.fits(),
        })
        .collect();
    let Some((_, first)) = evaluated.first() else {
        bail!("nothing to plot: predict refused every configuration");
    };
    let devices: std::collections::BTreeSet<u64> = evaluated
        .iter()
        .map(|(_, e)| e.report.device.total_memory)
        .collect();
    let title = format!(
        "{}: what if{}",
        first.prediction.arch.name(),
        if devices.len() == 1 {
            format!(" · {}", first.report.device.name)
        } else {
            String::new()
        }
    );
    let note = format!(
        "{} of {} configurations, lowest peak first{}",
        bars.len(),
        rows.len(),
        match fixed.given.is_empty() {
            true => String::new(),
            false => format!(
                "; fixed: {}",
                fixed
                    .given
                    .iter()
                    .map(|(k, v)| format!("--{k} {}", v.as_deref().unwrap_or("")))
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
        }
    );
    plot_bars(
        &BarPlot {
            title: &title,
            bars: &bars,
            capacity: (devices.len() == 1).then_some(first.report.device.total_memory),
            note: Some(&note),
        },
        path,
    )
    .with_context(|| format!("cannot draw {}", path.display()))
}

/// What `vramsim bench --sweep` measured for one grid.
pub struct SweepBench {
    /// The grid's name.
    pub name: &'static str,
    /// Configurations evaluated.
    pub configurations: usize,
    /// Distinct steps among them (configurations that differ in more than the machine): what one
    /// lowering per step would lower; templates lower fewer ([`crate::sweep::evaluate`]).
    pub lowerings: usize,
    /// Seconds with rayon's default pool.
    pub seconds: f64,
    /// Threads in that pool.
    pub threads: usize,
    /// Seconds on one thread.
    pub seconds_one_thread: f64,
    /// Configurations that fit.
    pub fits: usize,
}

/// The benchmark grids, GPT-2 medium at seq 1024, 1,000 configurations each: a what-if across GPUs
/// (5 batch sizes × 4 precisions × 5 checkpointing policies × 2 accumulation steps × 5 GPUs; the GPUs
/// share each lowering, so 200 lowerings), 1,000 distinct lowerings (10 batch sizes × 4
/// precisions × 5 checkpointing policies × 5 optimizers), issue 11's grid (10 batch sizes × 5
/// accumulation steps × 4 precisions × 5 checkpointing policies) and a grid of parallel layouts
/// (10 batch sizes × 4 ways to shard × 5 data-parallel degrees × 5 checkpointing policies).
pub const BENCH_GRIDS: &[(&str, &[&str])] = &[
    (
        "across GPUs",
        &[
            "batch=1,2,4,8,16",
            "precision=fp32,bf16,amp-fp16,amp-bf16",
            "checkpoint=none,full,selective,sqrt,every:2",
            "accum=1,2",
            "gpu=rtx4090,l40s,a100-40gb,a100-80gb,h100-80gb",
        ],
    ),
    (
        "every lowering distinct",
        &[
            "batch=1,2,3,4,5,6,7,8,9,10",
            "precision=fp32,bf16,amp-fp16,amp-bf16",
            "checkpoint=none,full,selective,sqrt,every:2",
            "optimizer=adamw,adam,sgd,sgd-momentum,adafactor",
        ],
    ),
    (
        "issue 11: with accumulation",
        &[
            "batch=1,2,3,4,5,6,7,8,9,10",
            "accum=1,2,4,8,16",
            "precision=fp32,bf16,amp-fp16,amp-bf16",
            "checkpoint=none,full,selective,sqrt,every:2",
        ],
    ),
    (
        "parallel layouts",
        &[
            "batch=1,2,3,4,5,6,7,8,9,10",
            "shard=ddp,zero1,zero2,fsdp2",
            "dp=2,4,8,16,32",
            "checkpoint=none,full,selective,sqrt,every:2",
        ],
    ),
];

/// The fastest of `runs` runs of `run` (seconds) and what that run returned: the run the machine's
/// other work disturbed least.
fn fastest<T>(runs: usize, mut run: impl FnMut() -> Result<T>) -> Result<(f64, T)> {
    let mut best: Option<(f64, T)> = None;
    for _ in 0..runs {
        let t0 = Instant::now();
        let out = run()?;
        let seconds = t0.elapsed().as_secs_f64();
        if best.as_ref().is_none_or(|(b, _)| seconds < *b) {
            best = Some((seconds, out));
        }
    }
    best.ok_or_else(|| anyhow::anyhow!("no run timed"))
}

/// Runs of each grid of [`bench_sweeps`] (on both threads, and on one), the best kept.
const GRID_BEST_OF: usize = 3;

/// Runs of each timed case of [`AccumBench`], the best kept: the fastest run is the one other work on
/// the machine disturbed least (single runs of a few milliseconds vary by half on a shared machine).
const BEST_OF: usize = 15;

/// What `vramsim bench --sweep` measured besides the grids: one configuration at accumulation 2 and 64
/// (gpt2-medium, seq 1024, batch 4; best of [`BEST_OF`], seconds) as a sweep evaluates it and as
/// `predict --json` does (with the breakdown at the peak), and `max-batch` of Llama-2-70B at seq
/// 4096, bf16, full checkpointing on 1 TiB (seconds, best of [`BEST_OF`], and the answer).
pub struct AccumBench {
    /// Seconds for accumulation 2.
    pub accum2: f64,
    /// Seconds for accumulation 64.
    pub accum64: f64,
    /// Seconds for accumulation 2, `predict --json`'s document.
    pub accum2_document: f64,
    /// Seconds for accumulation 64, `predict --json`'s document.
    pub accum64_document: f64,
    /// Seconds for the max-batch search.
    pub max_batch: f64,
    /// The batch it found.
    pub max_batch_found: u64,
}

/// Times [`AccumBench`]'s cases through the sweep's evaluation (lowering and replay, no JSON).
pub fn bench_accumulation() -> Result<AccumBench> {
    let args = |accum: u32| -> Vec<String> {
        [
            "--model=gpt2-medium",
            "--seq=1024",
            "--batch=4",
            &format!("--accum={accum}"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    // the two counts timed in turn, so that the machine's other work disturbs both alike; the best
    // run of each kept
    let best_pair = |wants: Wants| -> Result<(f64, f64)> {
        let (two, sixty_four) = (args(2), args(64));
        let (mut best2, mut best64) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..BEST_OF {
            for (args, best) in [(&two, &mut best2), (&sixty_four, &mut best64)] {
                let t0 = Instant::now();
                sweep::evaluate_one(args, wants)?;
                *best = best.min(t0.elapsed().as_secs_f64());
            }
        }
        Ok((best2, best64))
    };
    let table = Wants::default();
    let document = Wants {
        json: true,
        ..Wants::default()
    };
    let (accum2, accum64) = best_pair(table)?;
    let (accum2_document, accum64_document) = best_pair(document)?;
    let fixed = FixedOptions {
        given: [
            ("model", "llama2-70b"),
            ("seq", "4096"),
            ("precision", "bf16"),
            ("checkpoint", "full"),
            ("capacity", "1TiB"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), Some(v.to_string())))
        .collect(),
    };
    let (max_batch, search) = fastest(BEST_OF, || {
        crate::maxbatch::search(&fixed, "batch", &[], None, None)
    })?;
    Ok(AccumBench {
        accum2,
        accum64,
        accum2_document,
        accum64_document,
        max_batch,
        max_batch_found: search.largest.size,
    })
}

/// Times each of [`BENCH_GRIDS`] with rayon's default pool, then on one thread (best of
/// [`GRID_BEST_OF`] each).
pub fn bench_sweeps() -> Result<Vec<SweepBench>> {
    let fixed = FixedOptions {
        given: vec![
            ("model".into(), Some("gpt2-medium".into())),
            ("seq".into(), Some("1024".into())),
        ],
    };
    let set = OptionSet::predict();
    let mut out = Vec::new();
    for (name, specs) in BENCH_GRIDS {
        let specs: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
        let grid = Grid::parse(&specs, &fixed)?;
        let configs: Vec<Vec<String>> = grid.points().iter().map(|p| fixed.args(p)).collect();
        let lowerings = grid
            .axes
            .iter()
            .filter(|a| !set.find(&a.key).is_some_and(|o| o.machine))
            .map(|a| a.values.len())
            .product();
        let run = || {
            Ok(sweep::evaluate(
                &configs,
                Wants::default(),
                &Progress::hidden(),
            ))
        };
        let (seconds, results) = fastest(GRID_BEST_OF, run)?;
        let fits = results
            .iter()
            .filter(|r| r.as_ref().is_ok_and(Evaluated::fits))
            .count();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
        let (seconds_one_thread, _) = pool.install(|| fastest(GRID_BEST_OF, run))?;
        out.push(SweepBench {
            name,
            configurations: configs.len(),
            lowerings,
            seconds,
            threads: rayon::current_num_threads(),
            seconds_one_thread,
            fits,
        });
    }
    Ok(out)
}

/// `vramsim bench --sweep`: prints [`bench_sweeps`] as text or JSON.
pub fn print_bench(as_json: bool) -> Result<()> {
    let results = bench_sweeps()?;
    let accum = bench_accumulation()?;
    if as_json {
        let list: Vec<Value> = results
            .iter()
            .map(|b| {
                json!({
                    "grid": b.name,
                    "configurations": b.configurations,
                    "lowerings": b.lowerings,
                    "threads": b.threads,
                    "seconds": b.seconds,
                    "seconds_one_thread": b.seconds_one_thread,
                    "speedup": b.seconds_one_thread / b.seconds,
                    "fits": b.fits,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "sweeps": list,
                "accum2_seconds": accum.accum2,
                "accum64_seconds": accum.accum64,
                "accum64_over_accum2": accum.accum64 / accum.accum2,
                "accum2_document_seconds": accum.accum2_document,
                "accum64_document_seconds": accum.accum64_document,
                "accum64_over_accum2_document": accum.accum64_document / accum.accum2_document,
                "max_batch_llama2_70b_seconds": accum.max_batch,
                "max_batch_llama2_70b": accum.max_batch_found,
            }))?
        );
        return Ok(());
    }
    println!("what-if sweeps of gpt2-medium, seq 1024 (targets on 2 cores: 1,000 configurations in < 5 s; the issue 11 grid in < 1 s)");
    for b in &results {
        println!(
            "  {:<28} {} configurations, {} distinct steps: {:>6.2} s on {} threads, {:>6.2} s on one ({:.2}× speed-up); {} fit",
            b.name,
            b.configurations,
            b.lowerings,
            b.seconds,
            b.threads,
            b.seconds_one_thread,
            b.seconds_one_thread / b.seconds,
            b.fits
        );
    }
    println!(
        "gpt2-medium seq 1024 batch 4: accumulation 2 {:.1} ms, accumulation 64 {:.1} ms ({:.2}×; target ≤ 1.5×); with predict --json's document {:.1} ms and {:.1} ms ({:.2}×)",
        accum.accum2 * 1e3,
        accum.accum64 * 1e3,
        accum.accum64 / accum.accum2,
        accum.accum2_document * 1e3,
        accum.accum64_document * 1e3,
        accum.accum64_document / accum.accum2_document
    );
    println!(
        "max-batch llama2-70b seq 4096 bf16 full checkpointing on 1 TiB: batch {} in {:.0} ms (target < 100 ms)",
        accum.max_batch_found,
        accum.max_batch * 1e3
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed() -> FixedOptions {
        FixedOptions {
            given: vec![("model".into(), Some("gpt2".into()))],
        }
    }

    #[test]
    fn values_split_on_commas_or_semicolons() {
        assert_eq!(split_values("8,16, 32"), ["8", "16", "32"]);
        assert_eq!(
            split_values(",expandable_segments:True"),
            ["", "expandable_segments:True"]
        );
        assert_eq!(
            split_values("\"\";max_split_size_mb:128,garbage_collection_threshold:0.6"),
            ["", "max_split_size_mb:128,garbage_collection_threshold:0.6"]
        );
        assert!(split_values("").is_empty());
    }

    #[test]
    fn the_grid_is_the_cartesian_product_first_axis_slowest() {
        let specs = vec![
            "precision=fp32,amp-bf16".to_string(),
            "batch=1,2,4".to_string(),
        ];
        let grid = Grid::parse(&specs, &fixed()).unwrap();
        assert_eq!(grid.len(), 6);
        let points = grid.points();
        assert_eq!(points.len(), 6);
        assert_eq!(
            points[1],
            [
                ("precision".to_string(), "fp32".to_string()),
                ("batch".to_string(), "2".to_string())
            ]
        );
        assert_eq!(points[5][0].1, "amp-bf16");
    }

    #[test]
    fn bad_grids_say_what_is_wrong() {
        let complete = FixedOptions {
            given: vec![
                ("model".into(), Some("gpt2".into())),
                ("batch".into(), Some("1".into())),
            ],
        };
        let err_with = |fixed: &FixedOptions, specs: &[&str]| {
            let specs: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
            format!("{:#}", Grid::parse(&specs, fixed).unwrap_err())
        };
        let err = |specs: &[&str]| err_with(&complete, specs);
        assert!(err(&[]).contains("empty grid"));
        assert!(err(&["accum="]).contains("empty grid"));
        let unknown = err(&["colour=red"]);
        assert!(
            unknown.contains("\"colour\"") && unknown.contains("precision"),
            "{unknown}"
        );
        let value = err(&["precision=fp64"]);
        assert!(value.contains("fp32, bf16, amp-fp16, amp-bf16"), "{value}");
        let batch_only = FixedOptions {
            given: vec![("batch".into(), Some("1".into()))],
        };
        assert!(err_with(&batch_only, &["model=gpt5"]).contains("gpt2-medium"));
        assert!(err(&["gpu=rtx9999"]).contains("rtx4090"));
        assert!(err(&["inference=maybe"]).contains("true, false"));
        assert!(err(&["batch=2"]).contains("both fixed and varied"));
        assert!(err_with(&fixed(), &["accum=1"]).contains("--batch"));
        let huge = err(&[
            "seq=1,2,3,4,5,6,7,8,9,10,11",
            "accum=1,2,3,4,5,6,7,8,9,10",
            "iterations=1,2,3,4,5,6,7,8,9,10",
            "alloc-conf=a,b,c,d,e,f,g,h,i,j",
            "context=1,2,3,4,5,6,7,8,9,10",
            "memory-fraction=1,2,3,4,5,6,7,8,9,10",
        ]);
        assert!(
            huge.contains("1,100,000 configurations") && huge.contains("11 seq × 10 accum"),
            "{huge}"
        );
    }
}
