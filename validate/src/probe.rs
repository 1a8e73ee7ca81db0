//! `vramsim-validate probe` and `calibrate`: what a GPU and its driver do with memory, measured.
//!
//! A [`ProbeReport`] holds raw observations — free memory before and after each `cuMemAlloc`, the pool
//! attributes after each `cuMemAllocFromPoolAsync`, call latencies — and the figures derived from them are
//! computed by pure functions ([`ProbeReport::cu_mem_alloc_granularity`], [`ProbeReport::async_page_size`],
//! [`compare_async_model`], ...) that are tested on committed probe outputs without a GPU.
//! [`ProbeReport::to_calibration`] turns a probe into the `calibration.json` the simulator reads.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use vramsim_sim::allocator::cuda_async::{CudaAsyncAllocator, CudaAsyncConfig};
use vramsim_sim::allocator::Allocator;
use vramsim_sim::calibration::{
    AsyncPoolCalibration, Calibration, GpuInfo, Granularity, Latencies, LatencyPoint, Versions,
    CALIBRATION_FORMAT, CALIBRATION_VERSION,
};
use vramsim_sim::device::Device;
use vramsim_sim::timeline::Timeline;

use crate::driver::{Gpu, CUDARC_VERSION};
use crate::error::ValidateError;
use crate::plan::{gcd_of, median};

/// The value of a probe report's `format` key.
pub const PROBE_FORMAT: &str = "vramsim-probe";

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Sizes allocated one at a time with `cuMemAlloc` to see how device free memory steps.
pub const CU_MEM_ALLOC_STEP_SIZES: [u64; 8] = [
    1,
    512 << 10,
    MIB + 1,
    2 * MIB,
    2 * MIB + 1,
    3 * MIB,
    20 * MIB + 1,
    64 * MIB + 1,
];

/// Sizes allocated in this order, never freed, from a fresh stream-ordered pool.
pub const ASYNC_POOL_SIZES: [u64; 11] = [
    1,
    1,
    100,
    4096,
    512 << 10,
    MIB,
    MIB + 1,
    2 * MIB,
    3 * MIB,
    20 * MIB + 1,
    64 * MIB,
];

/// Sizes of the `cuMemAlloc`/`cuMemFree` latency curve (those above a quarter of free memory are skipped).
pub const LATENCY_SIZES: [u64; 4] = [2 * MIB, 20 * MIB, 200 * MIB, 2 * GIB];

/// Page sizes of the map/unmap latency curve: PyTorch's expandable segment pages.
pub const PAGE_SIZES: [u64; 2] = [2 * MIB, 20 * MIB];

/// Everything `probe` observed on one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeReport {
    /// Always [`PROBE_FORMAT`].
    pub format: String,
    /// Always 1.
    pub version: u64,
    /// True for hand-made fixtures (no device measured).
    #[serde(default)]
    pub synthetic: bool,
    /// Free text.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
    /// The device.
    pub device: ProbeDevice,
    /// `cuDriverGetVersion`.
    pub driver_version: i32,
    /// The cudarc version.
    pub cudarc: String,
    /// The vramsim version.
    pub vramsim: String,
    /// `cuMemGetAllocationGranularity` for device memory.
    pub vmm_granularity: VmmGranularity,
    /// One `cuMemAlloc` at a time, each freed before the next.
    pub cu_mem_alloc_steps: Vec<AllocStep>,
    /// Allocations from a fresh stream-ordered pool (release threshold `UINT64_MAX`), in order.
    pub async_pool: Vec<PoolSample>,
    /// Call latencies.
    pub latencies: Latencies,
}

/// The device as the probe saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeDevice {
    /// CUDA ordinal.
    pub index: u32,
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuMemGetInfo` total.
    pub total_memory: u64,
    /// `cuMemGetInfo` free right after the primary context was created.
    pub free_after_context: u64,
    /// `nvidia-smi` used memory (bytes, from MiB) before the context was created, if available.
    #[serde(default)]
    pub nvidia_smi_used_before_context: Option<u64>,
    /// `nvidia-smi` used memory after the context was created, if available.
    #[serde(default)]
    pub nvidia_smi_used_after_context: Option<u64>,
}

/// `cuMemGetAllocationGranularity` results.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmmGranularity {
    /// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
    pub minimum: u64,
    /// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`.
    pub recommended: u64,
}

/// One `cuMemAlloc(requested)` and how much device free memory it took.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocStep {
    /// Bytes asked for.
    pub requested: u64,
    /// `cuMemGetInfo` free before − after.
    pub free_delta: u64,
}

/// The pool after one more `cuMemAllocFromPoolAsync`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSample {
    /// Bytes asked for.
    pub requested: u64,
    /// The address returned.
    pub address: u64,
    /// `RESERVED_MEM_CURRENT` after the call (stream synchronized).
    pub reserved_after: u64,
    /// `USED_MEM_CURRENT` after the call.
    pub used_after: u64,
}

/// A pool sample as the cuda-async model predicts it next to what was measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolComparison {
    /// Bytes asked for.
    pub requested: u64,
    /// Model's reserved bytes.
    pub predicted_reserved: u64,
    /// Measured `RESERVED_MEM_CURRENT`.
    pub measured_reserved: u64,
    /// Model's used bytes.
    pub predicted_used: u64,
    /// Measured `USED_MEM_CURRENT`.
    pub measured_used: u64,
}

impl PoolComparison {
    /// Whether model and device agree on both figures.
    pub fn agrees(&self) -> bool {
        self.predicted_reserved == self.measured_reserved
            && self.predicted_used == self.measured_used
    }
}

impl ProbeReport {
    /// Reads a probe report (the JSON `probe --json` prints).
    pub fn from_json(text: &str) -> Result<ProbeReport, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Bytes in use on the device before any allocation: total − free after the context was created
    /// (the context, plus whatever other processes hold: probe an idle GPU).
    pub fn context_bytes(&self) -> u64 {
        self.device
            .total_memory
            .saturating_sub(self.device.free_after_context)
    }

    /// The context's cost as `nvidia-smi` saw it (used after − used before), when both were read.
    pub fn context_bytes_nvidia_smi(&self) -> Option<u64> {
        match (
            self.device.nvidia_smi_used_before_context,
            self.device.nvidia_smi_used_after_context,
        ) {
            (Some(before), Some(after)) => Some(after.saturating_sub(before)),
            _ => None,
        }
    }

    /// The unit `cuMemAlloc` moves free memory by: the gcd of the observed steps (`None` if none moved it).
    pub fn cu_mem_alloc_granularity(&self) -> Option<u64> {
        Some(gcd_of(self.cu_mem_alloc_steps.iter().map(|s| s.free_delta))).filter(|&g| g > 0)
    }

    /// The pool's growth unit: the gcd of the steps of `RESERVED_MEM_CURRENT`.
    pub fn async_page_size(&self) -> Option<u64> {
        let mut previous = 0;
        let steps = self.async_pool.iter().map(|s| {
            let step = s.reserved_after.saturating_sub(previous);
            previous = s.reserved_after;
            step
        });
        Some(gcd_of(steps.collect::<Vec<_>>())).filter(|&g| g > 0)
    }

    /// The alignment of small pool allocations: the largest power of two dividing every address
    /// difference between consecutive allocations smaller than a page.
    pub fn async_alignment(&self) -> Option<u64> {
        let page = self.async_page_size()?;
        let diffs: Vec<u64> = self
            .async_pool
            .windows(2)
            .filter(|w| w[0].requested < page && w[1].requested < page)
            .map(|w| w[0].address.abs_diff(w[1].address))
            .collect();
        let g = gcd_of(diffs);
        (g > 0).then(|| g & g.wrapping_neg())
    }

    /// `USED_MEM_CURRENT` after the first 1-byte allocation.
    pub fn used_after_one_byte(&self) -> Option<u64> {
        self.async_pool
            .iter()
            .find(|s| s.requested == 1)
            .map(|s| s.used_after)
    }

    /// The calibration file this probe gives.
    pub fn to_calibration(&self) -> Result<Calibration, ValidateError> {
        let alloc = self.cu_mem_alloc_granularity().ok_or_else(|| {
            ValidateError::Sim(
                "the probe saw no cuMemAlloc change free memory: no granularity to infer".into(),
            )
        })?;
        let async_pool = match (self.async_page_size(), self.async_alignment()) {
            (Some(page_size), Some(alignment)) => Some(AsyncPoolCalibration {
                page_size,
                alignment: alignment.min(page_size),
                used_after_one_byte: self.used_after_one_byte().unwrap_or(0),
            }),
            _ => None,
        };
        let calibration = Calibration {
            format: CALIBRATION_FORMAT.to_string(),
            version: CALIBRATION_VERSION,
            synthetic: self.synthetic,
            note: if self.synthetic {
                format!("SYNTHETIC probe: {}", self.note)
            } else {
                self.note.clone()
            },
            gpu: GpuInfo {
                name: self.device.name.clone(),
                index: self.device.index,
                total_memory: self.device.total_memory,
                free_after_context: self.device.free_after_context,
            },
            context_bytes: self.context_bytes(),
            context_method: "total-minus-free".to_string(),
            granularity: Granularity {
                cu_mem_alloc: alloc & alloc.wrapping_neg(),
                cu_mem_create_minimum: self.vmm_granularity.minimum,
                cu_mem_create_recommended: self.vmm_granularity.recommended,
            },
            async_pool,
            latencies: self.latencies.clone(),
            versions: Versions {
                driver: self.driver_version,
                cudarc: self.cudarc.clone(),
                vramsim: self.vramsim.clone(),
            },
        };
        calibration
            .validate("the probe")
            .map_err(|e| ValidateError::Sim(e.to_string()))?;
        Ok(calibration)
    }
}

/// The probe's pool samples replayed through the cuda-async model, configured with the page size and
/// alignment the probe measured (the model's defaults where it could not): where model and device differ.
pub fn compare_async_model(probe: &ProbeReport) -> Vec<PoolComparison> {
    let mut config = CudaAsyncConfig::pytorch();
    if let Some(page) = probe.async_page_size() {
        config.page_size = page;
    }
    if let Some(alignment) = probe.async_alignment() {
        config.alignment = alignment.min(config.page_size);
    }
    let device = Device {
        index: probe.device.index,
        name: probe.device.name.clone(),
        total_memory: probe.device.total_memory,
        context_bytes: probe.context_bytes(),
        other_processes: Vec::new(),
    };
    let mut model = CudaAsyncAllocator::new(config, device);
    let mut timeline = Timeline::new();
    probe
        .async_pool
        .iter()
        .map(|sample| {
            let _ = model.malloc(sample.requested, 0, &mut timeline);
            PoolComparison {
                requested: sample.requested,
                predicted_reserved: model.reserved(),
                measured_reserved: sample.reserved_after,
                predicted_used: model.used(),
                measured_used: sample.used_after,
            }
        })
        .collect()
}

/// Reads `nvidia-smi`'s `memory.used` (MiB) output as bytes.
pub fn parse_nvidia_smi_used(text: &str) -> Option<u64> {
    text.lines()
        .next()?
        .trim()
        .trim_end_matches("MiB")
        .trim()
        .parse::<u64>()
        .ok()
        .map(|mib| mib * MIB)
}

/// Device `index`'s used memory according to `nvidia-smi`, if it runs here.
pub fn nvidia_smi_used(index: u32) -> Option<u64> {
    let output = std::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=memory.used",
            "--format=csv,noheader,nounits",
            &format!("--id={index}"),
        ])
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    parse_nvidia_smi_used(&String::from_utf8_lossy(&output.stdout))
}

/// Runs every measurement on an open device. `reps` is the number of calls each latency is the median of.
pub fn run_probe(
    gpu: &Gpu,
    used_before_context: Option<u64>,
    reps: u32,
) -> Result<ProbeReport, ValidateError> {
    let used_after_context = nvidia_smi_used(gpu.ordinal as u32);
    let (minimum, recommended) = gpu.vmm_granularity()?;

    let mut cu_mem_alloc_steps = Vec::new();
    for requested in CU_MEM_ALLOC_STEP_SIZES {
        let before = gpu.free_memory()?;
        let ptr = gpu.mem_alloc(requested)?;
        let after = gpu.free_memory()?;
        gpu.mem_free(ptr)?;
        cu_mem_alloc_steps.push(AllocStep {
            requested,
            free_delta: before.saturating_sub(after),
        });
    }

    let pool = gpu.new_pool(u64::MAX)?;
    let stream = crate::driver::Stream::null();
    let mut async_pool = Vec::new();
    let mut pointers = Vec::new();
    for requested in ASYNC_POOL_SIZES {
        let address = gpu.pool_alloc(pool, requested, stream)?;
        gpu.stream_synchronize(stream)?;
        let (reserved_after, used_after) = gpu.pool_usage(pool)?;
        pointers.push(address);
        async_pool.push(PoolSample {
            requested,
            address,
            reserved_after,
            used_after,
        });
    }
    for ptr in pointers {
        gpu.free_async(ptr, stream)?;
    }
    gpu.synchronize()?;
    gpu.trim_pool(pool, 0)?;
    gpu.destroy_pool(pool)?;

    let free = gpu.free_memory()?;
    let mut latencies = Latencies::default();
    for bytes in LATENCY_SIZES.into_iter().filter(|&b| b <= free / 4) {
        let n = if bytes >= GIB {
            (reps / 4).max(3)
        } else {
            reps
        };
        let (mut alloc, mut dealloc) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let t0 = Instant::now();
            let ptr = gpu.mem_alloc(bytes)?;
            let t1 = Instant::now();
            gpu.mem_free(ptr)?;
            let t2 = Instant::now();
            alloc.push((t1 - t0).as_secs_f64() * 1e6);
            dealloc.push((t2 - t1).as_secs_f64() * 1e6);
        }
        latencies.cu_mem_alloc.push(point(bytes, &mut alloc));
        latencies.cu_mem_free.push(point(bytes, &mut dealloc));
    }
    for bytes in PAGE_SIZES {
        let va = gpu.reserve_va(bytes)?;
        let (mut map, mut unmap) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let t0 = Instant::now();
            let handle = gpu.map_page(va, bytes)?;
            let t1 = Instant::now();
            gpu.unmap_page(va, bytes, handle)?;
            let t2 = Instant::now();
            map.push((t1 - t0).as_secs_f64() * 1e6);
            unmap.push((t2 - t1).as_secs_f64() * 1e6);
        }
        gpu.free_va(va, bytes)?;
        latencies.map.push(point(bytes, &mut map));
        latencies.unmap.push(point(bytes, &mut unmap));
    }

    Ok(ProbeReport {
        format: PROBE_FORMAT.to_string(),
        version: 1,
        synthetic: false,
        note: String::new(),
        device: ProbeDevice {
            index: gpu.ordinal as u32,
            name: gpu.name.clone(),
            total_memory: gpu.total,
            free_after_context: gpu.free_after_context,
            nvidia_smi_used_before_context: used_before_context,
            nvidia_smi_used_after_context: used_after_context,
        },
        driver_version: gpu.driver_version,
        cudarc: CUDARC_VERSION.to_string(),
        vramsim: env!("CARGO_PKG_VERSION").to_string(),
        vmm_granularity: VmmGranularity {
            minimum,
            recommended,
        },
        cu_mem_alloc_steps,
        async_pool,
        latencies,
    })
}

fn point(bytes: u64, samples: &mut [f64]) -> LatencyPoint {
    LatencyPoint {
        bytes,
        median_us: (median(samples) * 1000.0).round() / 1000.0,
        samples: samples.len() as u32,
    }
}

/// The probe as text for people.
pub fn probe_text(probe: &ProbeReport) -> String {
    use std::fmt::Write;
    use vramsim_sim::format::format_size;
    let mut out = String::new();
    let d = &probe.device;
    let _ = writeln!(out, "device       {} (CUDA device {})", d.name, d.index);
    let _ = writeln!(
        out,
        "driver       {}.{} (cuDriverGetVersion {}), cudarc {}",
        probe.driver_version / 1000,
        probe.driver_version % 1000 / 10,
        probe.driver_version,
        probe.cudarc
    );
    let _ = writeln!(
        out,
        "memory       total {} ({} B), free after context {} ({} B)",
        format_size(d.total_memory),
        d.total_memory,
        format_size(d.free_after_context),
        d.free_after_context
    );
    let _ = write!(
        out,
        "context      {} ({} B, total - free)",
        format_size(probe.context_bytes()),
        probe.context_bytes()
    );
    match probe.context_bytes_nvidia_smi() {
        Some(bytes) => {
            let _ = writeln!(
                out,
                "; nvidia-smi: {} more used after creating it",
                format_size(bytes)
            );
        }
        None => out.push_str("; nvidia-smi not available\n"),
    }
    let _ = writeln!(
        out,
        "granularity  cuMemCreate minimum {} recommended {}; cuMemAlloc {}",
        format_size(probe.vmm_granularity.minimum),
        format_size(probe.vmm_granularity.recommended),
        probe
            .cu_mem_alloc_granularity()
            .map_or("not seen".to_string(), format_size)
    );
    for s in &probe.cu_mem_alloc_steps {
        let _ = writeln!(
            out,
            "  cuMemAlloc({:>9}) took {:>9} B of free memory",
            s.requested, s.free_delta
        );
    }
    let _ = writeln!(
        out,
        "async pool   growth unit {}, alignment {}, used after 1 B: {}",
        probe.async_page_size().map_or("-".into(), format_size),
        probe
            .async_alignment()
            .map_or("-".into(), |a| format!("{a} B")),
        probe
            .used_after_one_byte()
            .map_or("-".into(), |u| format!("{u} B"))
    );
    let _ = writeln!(
        out,
        "  {:>10} {:>12} {:>12} {:>12} {:>12}",
        "requested", "reserved", "model", "used", "model"
    );
    for c in compare_async_model(probe) {
        let _ = writeln!(
            out,
            "  {:>10} {:>12} {:>12} {:>12} {:>12}{}",
            c.requested,
            c.measured_reserved,
            c.predicted_reserved,
            c.measured_used,
            c.predicted_used,
            if c.agrees() { "" } else { "  <- differs" }
        );
    }
    let curves = [
        ("cuMemAlloc", &probe.latencies.cu_mem_alloc),
        ("cuMemFree", &probe.latencies.cu_mem_free),
        ("map page", &probe.latencies.map),
        ("unmap page", &probe.latencies.unmap),
    ];
    out.push_str("latency (median µs)\n");
    for (name, curve) in curves {
        let points: Vec<String> = curve
            .iter()
            .map(|p| format!("{} {:.1}", format_size(p.bytes), p.median_us))
            .collect();
        let _ = writeln!(out, "  {name:<11} {}", points.join(", "));
    }
    out
}
