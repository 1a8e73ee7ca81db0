//! `vramsim bench`: replay speed, JSON Lines parsing speed and streaming memory, on synthetic
//! training-like traces; with `--sweep`, what-if sweeps through `predict` (`crate::whatif`); with
//! `--layouts`, `predict` on large parallel layouts (`vramsim_api::pipeline::bench_layouts`).
//! Performance targets live here, not in timed tests.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use vramsim_sim::allocator::caching::CachingAllocator;
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::{Device, DEFAULT_GPU};
use vramsim_sim::engine::{Flow, Replay, ReplayOptions};
use vramsim_sim::import::{import_device, ImportOptions};
use vramsim_traces::{AllocId, Category, Event, JsonlWriter, Meta};

/// Options of `vramsim bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Events in each synthetic trace.
    #[arg(long, default_value_t = 10_000_000)]
    pub events: u64,
    /// Where to write the synthetic JSON Lines trace (default: the system's temp dir).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
    /// Internal: stream-replay this file and print the process's peak RSS in bytes.
    #[arg(long, hide = true)]
    pub rss_of: Option<PathBuf>,
    /// Time what-if sweeps instead: four grids of 1,000 gpt2-medium configurations through `predict`,
    /// with rayon's default pool and on one thread, best of 3 (target: under 5 s on 2 cores; issue 11's
    /// grid with accumulation 1-16, under 1 s), accumulation 64 against 2 (target ≤ 1.5×), and
    /// max-batch of Llama-2-70B at seq 4096 (target < 100 ms), best of 15.
    #[arg(long)]
    pub sweep: bool,
    /// Time the import of this PyTorch memory snapshot instead (`vramsim import`'s work: gunzip, unpickle,
    /// typed model, state reconstruction of every device), best of 5 (target for a 22,000-entry, 4 MB
    /// snapshot: under 200 ms).
    #[arg(long, value_name = "SNAPSHOT")]
    pub snapshot: Option<PathBuf>,
    /// Time `predict` on large parallel layouts instead (Llama-3.1-405B, TP 8 × PP 8 on H100s: one
    /// replay per pipeline stage), best of 3, with the worst rank's peak (target: under 1 s on 2
    /// cores).
    #[arg(long)]
    pub layouts: bool,
}

/// Runs `vramsim bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    if let Some(path) = &args.rss_of {
        return print_streaming_rss(path);
    }
    if args.sweep {
        return vramsim_api::whatif::print_bench(args.json);
    }
    if args.layouts {
        return vramsim_api::pipeline::print_layout_bench(args.json);
    }
    if let Some(path) = &args.snapshot {
        return bench_import(path, args.json);
    }
    let replay_rate = bench_replay(args.events)?;
    let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let path = dir.join(format!("vramsim-bench-{}.jsonl", std::process::id()));
    let write = write_synthetic(&path, args.events)?;
    let parse = bench_parse(&path, args.events);
    let rss = measure_streaming_rss(&path);
    let _ = std::fs::remove_file(&path);
    let (parse_rate, rss) = (parse?, rss?);
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "events": args.events,
                "replay_events_per_second": replay_rate,
                "jsonl_parse_events_per_second": parse_rate,
                "jsonl_bytes": write,
                "streaming_replay_peak_rss_bytes": rss,
            }))?
        );
    } else {
        println!("synthetic training-like trace, {} events", args.events);
        println!(
            "  replay (pytorch allocator, in memory)   {:>8.2} M events/s   target >= 10",
            replay_rate / 1e6
        );
        println!(
            "  JSON Lines parsing ({:.0} MB)           {:>8.2} M events/s   target >= 2",
            write as f64 / 1e6,
            parse_rate / 1e6
        );
        println!(
            "  streaming replay of that file, peak RSS {:>8.1} MB           target < 100",
            rss as f64 / 1e6
        );
    }
    Ok(())
}

fn allocator() -> Result<CachingAllocator> {
    Ok(CachingAllocator::new(
        AllocatorConfig::default(),
        Device::preset(DEFAULT_GPU)?,
    ))
}

/// Replays `events` synthetic events in memory and returns events per second (generation excluded).
fn bench_replay(events: u64) -> Result<f64> {
    const CHUNK: usize = 1 << 20;
    let mut replay = Replay::new(allocator()?, &ReplayOptions::default());
    let mut generator = Synthetic::new();
    let mut chunk = Vec::with_capacity(CHUNK);
    let mut done = 0u64;
    let mut seconds = 0.0;
    while done < events {
        chunk.clear();
        chunk.extend(generator.by_ref().take(CHUNK.min((events - done) as usize)));
        done += chunk.len() as u64;
        let start = Instant::now();
        for event in chunk.drain(..) {
            if replay.apply(event)? == Flow::Stopped {
                bail!("the synthetic trace ran out of memory on {DEFAULT_GPU}");
            }
        }
        seconds += start.elapsed().as_secs_f64();
    }
    Ok(events as f64 / seconds)
}

fn write_synthetic(path: &Path, events: u64) -> Result<u64> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut writer = JsonlWriter::new(BufWriter::new(file), &Meta::default())?;
    for event in Synthetic::new().take(events as usize) {
        writer.write_event(&event)?;
    }
    writer.finish()?;
    Ok(std::fs::metadata(path)?.len())
}

fn bench_parse(path: &Path, events: u64) -> Result<f64> {
    let start = Instant::now();
    let mut count = 0u64;
    for event in vramsim_traces::open_events(path)? {
        event?;
        count += 1;
    }
    if count != events {
        bail!("parsed {count} events, wrote {events}");
    }
    Ok(count as f64 / start.elapsed().as_secs_f64())
}

/// Runs this binary on the file in a child process so that the RSS measured is the streaming replay's alone.
fn measure_streaming_rss(path: &Path) -> Result<u64> {
    let output = Command::new(std::env::current_exe()?)
        .args(["bench", "--rss-of"])
        .arg(path)
        .output()?;
    if !output.status.success() {
        bail!(
            "streaming replay failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8(output.stdout)?.trim().parse()?)
}

fn print_streaming_rss(path: &Path) -> Result<()> {
    let outcome = Replay::new(allocator()?, &ReplayOptions::default())
        .run(vramsim_traces::open_events(path)?)?;
    if outcome.oom.is_some() {
        bail!("the synthetic trace ran out of memory");
    }
    let status = std::fs::read_to_string("/proc/self/status")
        .context("peak RSS needs /proc/self/status (Linux)")?;
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/self/status")?;
    println!("{}", kib * 1024);
    Ok(())
}

/// An endless, deterministic, training-like event stream: steps of a 48-layer network with a forward pass
/// that keeps activations and frees temporaries, a backward pass that frees activations in reverse and
/// allocates gradients, small-pool bookkeeping tensors, a side stream with `record_stream`, and phases.
struct Synthetic {
    layers: Vec<(u64, u64)>,
    queue: std::collections::VecDeque<Event>,
    next_id: u64,
    step: u64,
}

impl Synthetic {
    const LAYERS: usize = 48;

    fn new() -> Self {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            // splitmix64
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        // Log-uniform sizes from 512 B to 64 MiB, plus odd byte counts so that rounding matters.
        let mut size = move || {
            let exp = 9 + next() % 18;
            (1u64 << exp) + next() % (1u64 << exp)
        };
        let layers = (0..Self::LAYERS).map(|_| (size(), size())).collect();
        Synthetic {
            layers,
            queue: Default::default(),
            next_id: 0,
            step: 0,
        }
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn alloc(&mut self, size: u64, stream: u64, category: Category) -> u64 {
        let id = self.id();
        self.queue.push_back(Event::Alloc {
            id: AllocId::Int(id),
            size,
            stream,
            category,
            tag: None,
        });
        id
    }

    fn free(&mut self, id: u64) {
        self.queue.push_back(Event::Free {
            id: AllocId::Int(id),
        });
    }

    fn refill(&mut self) {
        let layers = self.layers.clone();
        self.queue.push_back(Event::Phase {
            name: "forward".into(),
        });
        let mut saved = Vec::with_capacity(layers.len());
        for (i, &(activation, temporary)) in layers.iter().enumerate() {
            saved.push(self.alloc(activation, 0, Category::Activation));
            let tmp = self.alloc(temporary, 0, Category::Temporary);
            let bookkeeping = self.alloc(512 + (i as u64 % 7) * 512, 0, Category::AutogradDetail);
            self.free(tmp);
            self.free(bookkeeping);
        }
        self.queue.push_back(Event::Phase {
            name: "backward".into(),
        });
        let mut grad = self.alloc(layers[layers.len() - 1].0, 0, Category::Temporary);
        for (i, &(activation, _)) in layers.iter().enumerate().rev() {
            let next = self.alloc(activation, 0, Category::Temporary);
            if i % 16 == 0 {
                // A gradient bucket handed to a communication stream.
                self.queue.push_back(Event::RecordStream {
                    id: AllocId::Int(grad),
                    stream: 1,
                });
                self.queue.push_back(Event::Compute {
                    stream: 1,
                    us: 50.0,
                });
            }
            self.free(grad);
            self.free(saved[i]);
            grad = next;
        }
        self.free(grad);
        self.queue.push_back(Event::Compute {
            stream: 0,
            us: 1000.0,
        });
        if self.step % 8 == 7 {
            self.queue.push_back(Event::Sync { stream: None });
        }
        self.step += 1;
    }
}

impl Iterator for Synthetic {
    type Item = Event;

    fn next(&mut self) -> Option<Event> {
        if self.queue.is_empty() {
            self.refill();
        }
        self.queue.pop_front()
    }
}

/// Times loading and importing a snapshot, best of 5 runs.
fn bench_import(path: &Path, json: bool) -> Result<()> {
    let mut best = (f64::INFINITY, f64::INFINITY);
    let mut entries = 0;
    for _ in 0..5 {
        let start = Instant::now();
        let snapshot = vramsim_api::import::load_snapshot(path)?;
        let loaded = start.elapsed().as_secs_f64();
        let options = ImportOptions::from_snapshot(&snapshot);
        for device in snapshot.devices_with_data() {
            import_device(&snapshot, device, &options)?;
        }
        let total = start.elapsed().as_secs_f64();
        entries = snapshot.device_traces.iter().map(Vec::len).sum();
        best = (best.0.min(loaded), best.1.min(total));
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "snapshot": path.display().to_string(),
                "trace_entries": entries,
                "load_ms": best.0 * 1e3,
                "load_and_import_ms": best.1 * 1e3,
            }))?
        );
    } else {
        println!(
            "snapshot {} ({entries} trace entries), best of 5",
            path.display()
        );
        println!(
            "  load (gunzip, unpickle, typed model)   {:>8.1} ms",
            best.0 * 1e3
        );
        println!(
            "  load + import of every device          {:>8.1} ms   target < 200",
            best.1 * 1e3
        );
    }
    Ok(())
}
