//! `vramsim-validate replay TRACE --backend raw|async|vmm`: a trace on a real GPU, next to the simulator.
//!
//! - **raw** — the simulated PyTorch caching allocator replays the trace with history on; every
//!   `segment_alloc`/`segment_free` it decides is performed as `cuMemAlloc`/`cuMemFree`, and after each event
//!   that made device calls the device's free memory (`cuMemGetInfo`) is compared with the simulator's
//!   reserved bytes. A deviation means the driver charged more (or less) than the segment sizes: its
//!   granularity, or bookkeeping of its own.
//! - **vmm** — the same with `expandable_segments:True`: each `segment_map` becomes, page by page (2 MiB small,
//!   20 MiB large), `cuMemCreate` + `cuMemAddressReserve` + `cuMemMap` + `cuMemSetAccess`, each
//!   `segment_unmap` the reverse. (PyTorch reserves one virtual range per segment and maps pages into it;
//!   here each page gets its own range, which moves no physical memory.)
//! - **async** — the trace's allocations themselves go to `cuMemAllocFromPoolAsync` on a fresh pool (release
//!   threshold `UINT64_MAX` unless `--release-threshold` says otherwise, every reuse policy on), one CUDA
//!   stream per trace stream (0 is the legacy default stream), frees as PyTorch's cudaMallocAsync backend
//!   does them (on the allocation stream, or on a unifying stream after event waits when `record_stream`
//!   was used); `RESERVED_MEM_CURRENT`/`USED_MEM_CURRENT` after each event and the `*_HIGH` marks at the end
//!   are compared with the `cuda-async` model.
//!
//! No kernels run: `compute` events are skipped on the GPU, and the async model skips them too so that both
//! see idle streams (raw and vmm keep them: there the simulator decides and the GPU only executes).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Instant;

use cudarc::driver::sys;
use serde::Serialize;
use vramsim_sim::allocator::caching::CachingAllocator;
use vramsim_sim::allocator::cuda_async::{CudaAsyncAllocator, CudaAsyncConfig};
use vramsim_sim::allocator::Allocator;
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::Device;
use vramsim_sim::rounding::SMALL_BUFFER;
use vramsim_traces::{AllocId, Event, StreamId};

use crate::driver::{Gpu, Stream};
use crate::error::ValidateError;
use crate::plan::{gcd_of, map_pages, median, DeviceAction, SimDriver, SimStep};

/// Which device API the replay uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// `cuMemAlloc`/`cuMemFree` of the simulated caching allocator's segments.
    Raw,
    /// `cuMemAllocFromPoolAsync` of every allocation, compared with the cuda-async model.
    Async,
    /// Page maps of the simulated expandable segments.
    Vmm,
}

impl Backend {
    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Raw => "raw",
            Backend::Async => "async",
            Backend::Vmm => "vmm",
        }
    }
}

/// Settings of a replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// The backend.
    pub backend: Backend,
    /// `PYTORCH_CUDA_ALLOC_CONF` for the simulated caching allocator (raw, vmm).
    pub alloc_conf: String,
    /// The pool's release threshold (async).
    pub release_threshold: u64,
    /// The pool model's page size and alignment (async); the model's defaults if `None`.
    pub async_config: Option<CudaAsyncConfig>,
    /// Stop after this many events.
    pub max_events: Option<u64>,
}

/// One comparison after an event: simulated against measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Check {
    /// 0-based event index.
    pub event_index: u64,
    /// Device calls the event made on the GPU.
    pub device_calls: u32,
    /// Simulated reserved bytes.
    pub predicted_reserved: u64,
    /// Measured: device free memory consumed since the start (raw, vmm) or `RESERVED_MEM_CURRENT` (async).
    pub measured_reserved: u64,
    /// Simulated used bytes (async only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_used: Option<u64>,
    /// `USED_MEM_CURRENT` (async only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured_used: Option<u64>,
}

impl Check {
    /// measured − predicted reserved bytes.
    pub fn deviation(&self) -> i64 {
        self.measured_reserved as i64 - self.predicted_reserved as i64
    }

    /// Whether the two sides agree on everything compared.
    pub fn agrees(&self) -> bool {
        self.deviation() == 0 && self.predicted_used == self.measured_used
    }
}

/// High-water marks at the end of an async replay.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolHighs {
    /// The release threshold used.
    pub release_threshold: u64,
    /// The model's peak reserved bytes.
    pub predicted_reserved_high: u64,
    /// `RESERVED_MEM_HIGH`.
    pub measured_reserved_high: u64,
    /// The model's peak used bytes.
    pub predicted_used_high: u64,
    /// `USED_MEM_HIGH`.
    pub measured_used_high: u64,
}

/// What a replay found.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    /// The backend.
    pub backend: Backend,
    /// The trace file.
    pub trace: String,
    /// The device name.
    pub device: String,
    /// `cuMemGetInfo` total.
    pub total_memory: u64,
    /// `cuMemGetInfo` free before the first event.
    pub free_at_start: u64,
    /// The caching allocator settings simulated (raw, vmm).
    pub alloc_conf: String,
    /// Events replayed.
    pub events: u64,
    /// Device allocation/free/map/unmap calls made.
    pub device_calls: u64,
    /// One entry per event that changed device memory on either side.
    pub checks: Vec<Check>,
    /// Events whose comparison differed.
    pub events_with_deviation: u64,
    /// The largest |measured − predicted| reserved bytes.
    pub max_abs_deviation: u64,
    /// The highest simulated reserved bytes.
    pub peak_predicted_reserved: u64,
    /// The highest measured reserved bytes.
    pub peak_measured_reserved: u64,
    /// The unit device free memory moved by on each allocation call (gcd of the steps), if any moved it.
    pub granularity_seen: Option<u64>,
    /// Median latency of the allocation calls, µs.
    pub median_alloc_us: f64,
    /// Median latency of the free calls, µs.
    pub median_free_us: f64,
    /// Pool high-water marks (async).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolHighs>,
    /// Why the replay stopped early: the simulator's out-of-memory error or a failed device call.
    pub stopped: Option<String>,
}

/// Accumulates checks and timings.
struct Tally {
    events: u64,
    stopped: Option<String>,
    checks: Vec<Check>,
    steps: Vec<u64>,
    alloc_us: Vec<f64>,
    free_us: Vec<f64>,
    calls: u64,
}

impl Tally {
    fn new() -> Self {
        Tally {
            events: 0,
            stopped: None,
            checks: Vec::new(),
            steps: Vec::new(),
            alloc_us: Vec::new(),
            free_us: Vec::new(),
            calls: 0,
        }
    }

    fn report(
        mut self,
        options: &ReplayOptions,
        trace: &Path,
        gpu: &Gpu,
        free_at_start: u64,
        pool: Option<PoolHighs>,
    ) -> ReplayReport {
        let events_with_deviation = self.checks.iter().filter(|c| !c.agrees()).count() as u64;
        let max_abs_deviation = self
            .checks
            .iter()
            .map(|c| c.deviation().unsigned_abs())
            .max()
            .unwrap_or(0);
        ReplayReport {
            backend: options.backend,
            trace: trace.display().to_string(),
            device: gpu.name.clone(),
            total_memory: gpu.total,
            free_at_start,
            alloc_conf: options.alloc_conf.clone(),
            events: self.events,
            device_calls: self.calls,
            events_with_deviation,
            max_abs_deviation,
            peak_predicted_reserved: self
                .checks
                .iter()
                .map(|c| c.predicted_reserved)
                .max()
                .unwrap_or(0),
            peak_measured_reserved: self
                .checks
                .iter()
                .map(|c| c.measured_reserved)
                .max()
                .unwrap_or(0),
            granularity_seen: Some(gcd_of(self.steps.iter().copied())).filter(|&g| g > 0),
            median_alloc_us: median(&mut self.alloc_us),
            median_free_us: median(&mut self.free_us),
            pool,
            stopped: self.stopped,
            checks: self.checks,
        }
    }
}

/// The simulated device matching the real one: its total, and everything already used on it counted as
/// the context, so that the simulator runs out of memory where the GPU would.
fn device_of(gpu: &Gpu, free_at_start: u64) -> Device {
    Device {
        index: gpu.ordinal as u32,
        name: gpu.name.clone(),
        total_memory: gpu.total,
        context_bytes: gpu.total.saturating_sub(free_at_start),
        other_processes: Vec::new(),
    }
}

fn allocator_config(options: &ReplayOptions) -> Result<AllocatorConfig, ValidateError> {
    let mut config = AllocatorConfig::parse(&options.alloc_conf).map_err(|e| {
        ValidateError::Sim(format!(
            "invalid --alloc-conf {:?}: {e}",
            options.alloc_conf
        ))
    })?;
    match options.backend {
        Backend::Raw if config.expandable_segments => {
            return Err(ValidateError::Sim(
                "--alloc-conf has expandable_segments:True, which maps pages: use --backend vmm"
                    .into(),
            ))
        }
        Backend::Vmm => config.expandable_segments = true,
        _ => {}
    }
    Ok(config)
}

/// Replays `trace` on `gpu` with `options`.
pub fn replay(
    gpu: &Gpu,
    trace: &Path,
    options: &ReplayOptions,
) -> Result<ReplayReport, ValidateError> {
    match options.backend {
        Backend::Raw | Backend::Vmm => replay_segments(gpu, trace, options),
        Backend::Async => replay_async(gpu, trace, options),
    }
}

/// A physical page mapped for the vmm backend.
struct MappedPage {
    va: u64,
    size: u64,
    handle: u64,
}

fn replay_segments(
    gpu: &Gpu,
    trace: &Path,
    options: &ReplayOptions,
) -> Result<ReplayReport, ValidateError> {
    let config = allocator_config(options)?;
    let large_page = config.large_segment_size;
    let free_at_start = gpu.free_memory()?;
    let allocator = CachingAllocator::new(config, device_of(gpu, free_at_start));
    let mut sim = SimDriver::new(allocator, true);
    let mut segments: HashMap<u64, u64> = HashMap::new(); // simulated address -> device pointer
    let mut pages: BTreeMap<u64, MappedPage> = BTreeMap::new(); // simulated page address -> page
    let mut tally = Tally::new();
    let result = (|| -> Result<(), ValidateError> {
        for event in vramsim_traces::open_events(trace)? {
            if options.max_events.is_some_and(|max| tally.events >= max) {
                break;
            }
            let event = event?;
            tally.events += 1;
            let step = sim.step(&event)?;
            let calls = perform(
                gpu,
                &step,
                &mut segments,
                &mut pages,
                large_page,
                &mut tally,
            )?;
            if calls > 0 {
                let measured = free_at_start.saturating_sub(gpu.free_memory()?);
                tally.checks.push(Check {
                    event_index: step.index,
                    device_calls: calls,
                    predicted_reserved: step.reserved,
                    measured_reserved: measured,
                    predicted_used: None,
                    measured_used: None,
                });
            }
            if let Some(oom) = step.oom {
                tally.stopped = Some(format!(
                    "event {}: the simulator ran out of memory: {}",
                    step.index,
                    oom.message.lines().next().unwrap_or("")
                ));
                break;
            }
        }
        Ok(())
    })();
    // A bad trace is an error (after cleaning up); a failed device call is a finding, reported.
    let mut bad_input = None;
    match result {
        Err(error @ (ValidateError::Trace(_) | ValidateError::Sim(_))) => bad_input = Some(error),
        Err(error) => tally.stopped = Some(error.to_string()),
        Ok(()) => {}
    }
    // Give everything back, whatever happened.
    for (_, ptr) in segments.drain() {
        let _ = gpu.mem_free(ptr);
    }
    for (_, page) in std::mem::take(&mut pages) {
        let _ = gpu.unmap_page(page.va, page.size, page.handle);
        let _ = gpu.free_va(page.va, page.size);
    }
    if let Some(error) = bad_input {
        return Err(error);
    }
    Ok(tally.report(options, trace, gpu, free_at_start, None))
}

/// Performs one step's device calls; returns how many.
fn perform(
    gpu: &Gpu,
    step: &SimStep,
    segments: &mut HashMap<u64, u64>,
    pages: &mut BTreeMap<u64, MappedPage>,
    large_page: u64,
    tally: &mut Tally,
) -> Result<u32, ValidateError> {
    let mut calls = 0;
    for action in &step.actions {
        match *action {
            DeviceAction::Malloc { addr, size } => {
                let before = gpu.free_memory()?;
                let t0 = Instant::now();
                let ptr = gpu.mem_alloc(size)?;
                tally.alloc_us.push(t0.elapsed().as_secs_f64() * 1e6);
                tally.steps.push(before.saturating_sub(gpu.free_memory()?));
                segments.insert(addr, ptr);
            }
            DeviceAction::Free { addr, .. } => {
                let ptr = segments.remove(&addr).ok_or_else(|| {
                    ValidateError::Sim(format!(
                        "event {}: segment_free of {addr:#x}, never allocated",
                        step.index
                    ))
                })?;
                let t0 = Instant::now();
                gpu.mem_free(ptr)?;
                tally.free_us.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            DeviceAction::Map { addr, size } => {
                let (page, count) = map_pages(size, SMALL_BUFFER, large_page)?;
                for i in 0..count {
                    let va = gpu.reserve_va(page)?;
                    let before = gpu.free_memory()?;
                    let t0 = Instant::now();
                    let handle = gpu.map_page(va, page)?;
                    tally.alloc_us.push(t0.elapsed().as_secs_f64() * 1e6);
                    tally.steps.push(before.saturating_sub(gpu.free_memory()?));
                    pages.insert(
                        addr + i * page,
                        MappedPage {
                            va,
                            size: page,
                            handle,
                        },
                    );
                }
            }
            DeviceAction::Unmap { addr, size } => {
                let inside: Vec<u64> = pages.range(addr..addr + size).map(|(&a, _)| a).collect();
                if inside.is_empty() {
                    return Err(ValidateError::Sim(format!(
                        "event {}: segment_unmap of {addr:#x} ({size} bytes), nothing mapped there",
                        step.index
                    )));
                }
                for a in inside {
                    let page = pages.remove(&a).expect("a page just listed");
                    let t0 = Instant::now();
                    gpu.unmap_page(page.va, page.size, page.handle)?;
                    tally.free_us.push(t0.elapsed().as_secs_f64() * 1e6);
                    gpu.free_va(page.va, page.size)?;
                }
            }
        }
        calls += 1;
    }
    tally.calls += u64::from(calls);
    Ok(calls)
}

/// A live allocation of the async replay.
struct Live {
    ptr: u64,
    stream: StreamId,
    recorded: Vec<StreamId>,
}

fn replay_async(
    gpu: &Gpu,
    trace: &Path,
    options: &ReplayOptions,
) -> Result<ReplayReport, ValidateError> {
    let free_at_start = gpu.free_memory()?;
    let config = CudaAsyncConfig {
        release_threshold: options.release_threshold,
        ..options
            .async_config
            .clone()
            .unwrap_or_else(CudaAsyncConfig::pytorch)
    };
    let model = CudaAsyncAllocator::new(config, device_of(gpu, free_at_start));
    let mut sim = SimDriver::new(model, false)
        .with_sync_hook(|model, timeline| model.synchronize(timeline))
        .with_segments_as_allocs();
    let pool = gpu.new_pool(options.release_threshold)?;
    let mut streams: HashMap<StreamId, Stream> = HashMap::new();
    streams.insert(0, Stream::null());
    let mut unifying: Option<Stream> = None;
    let mut live: HashMap<AllocId, Live> = HashMap::new();
    let mut tally = Tally::new();

    let mut stream_of = |id: StreamId| -> Result<Stream, ValidateError> {
        if let Some(&s) = streams.get(&id) {
            return Ok(s);
        }
        let s = gpu.new_stream()?;
        streams.insert(id, s);
        Ok(s)
    };

    let result = (|| -> Result<(), ValidateError> {
        for event in vramsim_traces::open_events(trace)? {
            if options.max_events.is_some_and(|max| tally.events >= max) {
                break;
            }
            let event = event?;
            tally.events += 1;
            let mut calls = 0u32;
            let mut device_alloc =
                |id: &AllocId, size: u64, stream: StreamId, tally: &mut Tally| {
                    let s = stream_of(stream)?;
                    let t0 = Instant::now();
                    let ptr = gpu.pool_alloc(pool, size, s)?;
                    tally.alloc_us.push(t0.elapsed().as_secs_f64() * 1e6);
                    live.insert(
                        id.clone(),
                        Live {
                            ptr,
                            stream,
                            recorded: Vec::new(),
                        },
                    );
                    Ok::<(), ValidateError>(())
                };
            // The GPU side first, as PyTorch's backend would issue it.
            match &event {
                Event::Alloc {
                    id, size, stream, ..
                } if *size > 0 => {
                    device_alloc(id, *size, *stream, &mut tally)?;
                    calls += 1;
                }
                Event::Segment(segment) => {
                    for b in segment.blocks.iter().filter(|b| b.requested > 0) {
                        device_alloc(&b.id, b.requested, segment.stream, &mut tally)?;
                        calls += 1;
                    }
                }
                Event::Free { id } => {
                    if let Some(l) = live.remove(id) {
                        let creation = stream_of(l.stream)?;
                        let t0 = Instant::now();
                        if l.recorded.is_empty() {
                            gpu.free_async(l.ptr, creation)?;
                        } else {
                            // free_impl: a unifying stream waits for every usage stream, then frees.
                            let u = match unifying {
                                Some(u) => u,
                                None => *unifying.insert(gpu.new_stream()?),
                            };
                            gpu.stream_wait(creation, u)?;
                            for s in &l.recorded {
                                gpu.stream_wait(stream_of(*s)?, u)?;
                            }
                            gpu.free_async(l.ptr, u)?;
                        }
                        tally.free_us.push(t0.elapsed().as_secs_f64() * 1e6);
                        calls += 1;
                    }
                }
                Event::RecordStream { id, stream } => {
                    if let Some(l) = live.get_mut(id) {
                        if *stream != l.stream && !l.recorded.contains(stream) {
                            l.recorded.push(*stream);
                        }
                    }
                }
                Event::Sync { stream: Some(s) } => gpu.stream_synchronize(stream_of(*s)?)?,
                Event::Sync { stream: None } => gpu.synchronize()?,
                Event::EmptyCache => {
                    gpu.synchronize()?;
                    gpu.trim_pool(pool, 0)?;
                }
                _ => {}
            }
            tally.calls += u64::from(calls);
            let step = sim.step(&event)?;
            let (reserved, used) = gpu.pool_usage(pool)?;
            let model = sim.allocator();
            let changed = calls > 0
                || matches!(event, Event::Sync { .. } | Event::EmptyCache)
                || tally.checks.last().is_some_and(|c| {
                    c.measured_reserved != reserved || c.predicted_reserved != model.reserved()
                });
            if changed {
                if let Some(last) = tally.checks.last() {
                    if reserved > last.measured_reserved {
                        tally.steps.push(reserved - last.measured_reserved);
                    }
                } else if reserved > 0 {
                    tally.steps.push(reserved);
                }
                tally.checks.push(Check {
                    event_index: step.index,
                    device_calls: calls,
                    predicted_reserved: model.reserved(),
                    measured_reserved: reserved,
                    predicted_used: Some(model.used()),
                    measured_used: Some(used),
                });
            }
            if let Some(oom) = step.oom {
                tally.stopped = Some(format!(
                    "event {}: the model ran out of memory: {}",
                    step.index,
                    oom.message.lines().next().unwrap_or("")
                ));
                break;
            }
        }
        Ok(())
    })();
    // A bad trace is an error (after cleaning up); a failed device call is a finding, reported.
    let mut bad_input = None;
    match result {
        Err(error @ (ValidateError::Trace(_) | ValidateError::Sim(_))) => bad_input = Some(error),
        Err(error) => tally.stopped = Some(error.to_string()),
        Ok(()) => {}
    }
    let highs = (|| -> Result<PoolHighs, ValidateError> {
        use sys::CUmemPool_attribute::*;
        let stats = sim.allocator().stats();
        Ok(PoolHighs {
            release_threshold: options.release_threshold,
            predicted_reserved_high: stats.reserved_bytes.all.peak as u64,
            measured_reserved_high: gpu.pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            predicted_used_high: stats.allocated_bytes.all.peak as u64,
            measured_used_high: gpu.pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        })
    })();
    // Give everything back (after the device is idle: the leftovers are freed on the default stream).
    let _ = gpu.synchronize();
    for (_, l) in live.drain() {
        let _ = gpu.free_async(l.ptr, Stream::null());
    }
    let _ = gpu.synchronize();
    let _ = gpu.trim_pool(pool, 0);
    let _ = gpu.destroy_pool(pool);
    for (id, s) in streams {
        if id != 0 {
            let _ = gpu.destroy_stream(s);
        }
    }
    if let Some(u) = unifying {
        let _ = gpu.destroy_stream(u);
    }
    if let Some(error) = bad_input {
        return Err(error);
    }
    let highs = match highs {
        Ok(h) => Some(h),
        Err(e) => {
            tally.stopped.get_or_insert(e.to_string());
            None
        }
    };
    Ok(tally.report(options, trace, gpu, free_at_start, highs))
}

/// The report as text for people: a summary, then the events where the two sides differ (all of them
/// with `all_events`).
pub fn report_text(report: &ReplayReport, all_events: bool) -> String {
    use std::fmt::Write;
    use vramsim_sim::format::format_size;
    let mut out = String::new();
    let _ = writeln!(out, "trace        {}", report.trace);
    let _ = writeln!(
        out,
        "backend      {}{}",
        report.backend.name(),
        if report.alloc_conf.is_empty() || report.backend == Backend::Async {
            String::new()
        } else {
            format!(" ({})", report.alloc_conf)
        }
    );
    let _ = writeln!(
        out,
        "device       {}, {} total, {} free at start",
        report.device,
        format_size(report.total_memory),
        format_size(report.free_at_start)
    );
    let _ = writeln!(
        out,
        "events       {} replayed, {} device calls, {} compared, {} differ",
        report.events,
        report.device_calls,
        report.checks.len(),
        report.events_with_deviation
    );
    let _ = writeln!(
        out,
        "reserved     peak predicted {} ({} B), measured {} ({} B); largest deviation {} B",
        format_size(report.peak_predicted_reserved),
        report.peak_predicted_reserved,
        format_size(report.peak_measured_reserved),
        report.peak_measured_reserved,
        report.max_abs_deviation
    );
    if let Some(pool) = &report.pool {
        let _ = writeln!(
            out,
            "pool highs   reserved predicted {} measured {}; used predicted {} measured {} (release threshold {})",
            pool.predicted_reserved_high,
            pool.measured_reserved_high,
            pool.predicted_used_high,
            pool.measured_used_high,
            if pool.release_threshold == u64::MAX { "UINT64_MAX".to_string() } else { pool.release_threshold.to_string() }
        );
    }
    let _ = writeln!(
        out,
        "granularity  {}",
        report.granularity_seen.map_or(
            "no allocation moved device memory".to_string(),
            |g| format!(
                "device memory moved in multiples of {} ({g} B)",
                format_size(g)
            )
        )
    );
    let _ = writeln!(
        out,
        "latency      median allocation {:.1} µs, free {:.1} µs",
        report.median_alloc_us, report.median_free_us
    );
    if let Some(reason) = &report.stopped {
        let _ = writeln!(out, "stopped      {reason}");
    }
    let shown: Vec<&Check> = report
        .checks
        .iter()
        .filter(|c| all_events || !c.agrees())
        .collect();
    if !shown.is_empty() {
        let _ = writeln!(
            out,
            "\n{:>8} {:>6} {:>16} {:>16} {:>14}{}",
            "event",
            "calls",
            "predicted",
            "measured",
            "deviation",
            if report.backend == Backend::Async {
                "   used predicted / measured"
            } else {
                ""
            }
        );
        for c in shown {
            let _ = write!(
                out,
                "{:>8} {:>6} {:>16} {:>16} {:>14}",
                c.event_index,
                c.device_calls,
                c.predicted_reserved,
                c.measured_reserved,
                c.deviation()
            );
            if let (Some(p), Some(m)) = (c.predicted_used, c.measured_used) {
                let _ = write!(out, "   {p} / {m}");
            }
            out.push('\n');
        }
    }
    out
}
