//! Calibration files: what `vramsim-validate calibrate` measured on a real GPU, read back into the
//! simulator.
//!
//! A `calibration.json` describes one GPU under one driver: its name and total memory (`cuMemGetInfo`), the
//! bytes its CUDA context takes, the driver's allocation granularity, optionally what the stream-ordered
//! pool's growth looked like, and the latency of `cuMemAlloc`/`cuMemFree` and of VMM map/unmap at several
//! sizes. `vramsim replay --calibration FILE` uses it:
//!
//! - **Device model** ([`Calibration::device`]): the capacity becomes the measured `total_memory` and the
//!   CUDA context the measured `context_bytes` (instead of a preset and [`crate::device::DEFAULT_CONTEXT_BYTES`]).
//! - **cuda-async pool** ([`Calibration::async_config`]): the measured page size and alignment replace the
//!   model's unconfirmed defaults.
//! - **Event timing** ([`TimedAllocator`]): each time reserved memory grows or shrinks, the host clock moves
//!   on by the measured latency of a device allocation or free of that many bytes (map/unmap for
//!   expandable segments), interpolated linearly between measured sizes. The clock decides when
//!   `record_stream`-deferred frees complete (an event fires when its stream's work is done, compared with
//!   the host's time) and the reported host time. It is a first-order model: one call's latency per change
//!   of reserved memory, whatever the number of segments behind it.
//!
//! The reader checks everything it uses and says which field is wrong and what would be valid; a file
//! marked `"synthetic": true` is a hand-made fixture, never a measurement.
//!
//! ```
//! use vramsim_sim::calibration::Calibration;
//!
//! let text = r#"{"format":"vramsim-calibration","version":1,"synthetic":true,
//!   "gpu":{"name":"NVIDIA H100 80GB HBM3","index":0,"total_memory":85017755648,"free_after_context":84490059776},
//!   "context_bytes":527695872,
//!   "granularity":{"cu_mem_alloc":2097152,"cu_mem_create_minimum":2097152,"cu_mem_create_recommended":2097152},
//!   "versions":{"driver":12060,"cudarc":"0.19.10","vramsim":"0.1.0"}}"#;
//! let calibration = Calibration::from_json(text, "calibration.json").unwrap();
//! let device = calibration.device();
//! assert_eq!(device.total_memory, 85_017_755_648);
//! assert_eq!(device.context_bytes, 527_695_872);
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};
use vramsim_traces::StreamId;

use crate::allocator::cuda_async::CudaAsyncConfig;
use crate::allocator::{Allocator, BlockRef, HistoryEntry, OutOfMemory, SegmentInfo};
use crate::device::Device;
use crate::stats::MemoryStats;
use crate::timeline::Timeline;

/// The value of the `format` key.
pub const CALIBRATION_FORMAT: &str = "vramsim-calibration";
/// The version of the format this reader accepts.
pub const CALIBRATION_VERSION: u64 = 1;

/// One GPU's measured figures (the content of `calibration.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// Always [`CALIBRATION_FORMAT`].
    pub format: String,
    /// Always [`CALIBRATION_VERSION`].
    pub version: u64,
    /// True for hand-made fixtures: the figures were not measured on a device.
    #[serde(default)]
    pub synthetic: bool,
    /// Free text: where, when, how.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
    /// The device.
    pub gpu: GpuInfo,
    /// Bytes the process's CUDA context takes: total − free right after the primary context was created,
    /// before any allocation (other processes on the GPU would be counted too; calibrate on an idle GPU).
    pub context_bytes: u64,
    /// How `context_bytes` was measured (`"total-minus-free"`, or `"nvidia-smi"` when the used memory
    /// before and after creating the context was read from `nvidia-smi`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub context_method: String,
    /// The driver's allocation granularity.
    pub granularity: Granularity,
    /// The stream-ordered pool's growth, when it was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub async_pool: Option<AsyncPoolCalibration>,
    /// Latencies of device allocation calls, when measured.
    #[serde(default)]
    pub latencies: Latencies,
    /// Software versions.
    pub versions: Versions,
}

/// The measured device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuInfo {
    /// `cuDeviceGetName` (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// The CUDA device ordinal.
    pub index: u32,
    /// `cuMemGetInfo` total = `torch.cuda.get_device_properties().total_memory`.
    pub total_memory: u64,
    /// `cuMemGetInfo` free right after the primary context was created.
    pub free_after_context: u64,
}

/// Allocation granularities in bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Granularity {
    /// Inferred from free-memory deltas of `cuMemAlloc` calls: the unit device memory moves by.
    pub cu_mem_alloc: u64,
    /// `cuMemGetAllocationGranularity(..., CU_MEM_ALLOC_GRANULARITY_MINIMUM)` for device memory.
    pub cu_mem_create_minimum: u64,
    /// `cuMemGetAllocationGranularity(..., CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)`.
    pub cu_mem_create_recommended: u64,
}

/// What a fresh stream-ordered pool did with small requests.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AsyncPoolCalibration {
    /// `RESERVED_MEM_CURRENT` after one 1-byte `cuMemAllocFromPoolAsync` on an empty pool: the growth unit.
    pub page_size: u64,
    /// The smallest address difference between consecutive small allocations.
    pub alignment: u64,
    /// `USED_MEM_CURRENT` after that 1-byte allocation (1 if used bytes are exact).
    pub used_after_one_byte: u64,
}

/// Measured latencies, each a curve over sizes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Latencies {
    /// `cuMemAlloc`.
    #[serde(default)]
    pub cu_mem_alloc: Vec<LatencyPoint>,
    /// `cuMemFree`.
    #[serde(default)]
    pub cu_mem_free: Vec<LatencyPoint>,
    /// `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` of one page (the VA already reserved).
    #[serde(default)]
    pub map: Vec<LatencyPoint>,
    /// `cuMemUnmap` + `cuMemRelease` of one page.
    #[serde(default)]
    pub unmap: Vec<LatencyPoint>,
}

/// The latency of a call at one size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatencyPoint {
    /// The size in bytes.
    pub bytes: u64,
    /// The median host time of the call, in microseconds.
    pub median_us: f64,
    /// How many calls the median is over.
    #[serde(default)]
    pub samples: u32,
}

/// Versions of what measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Versions {
    /// `cuDriverGetVersion` (e.g. 12060 for CUDA 12.6).
    pub driver: i32,
    /// The cudarc crate.
    pub cudarc: String,
    /// vramsim.
    pub vramsim: String,
}

/// Why a calibration file was refused.
#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    /// The file could not be read.
    #[error("{path}: cannot read the calibration file: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not JSON of the calibration's shape.
    #[error("{path}:{line}:{column}: {message}")]
    Json {
        /// The file.
        path: String,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// serde_json's description (unknown or missing field, wrong type...).
        message: String,
    },
    /// Well-formed, but a value is impossible.
    #[error("{path}: `{field}` {problem}")]
    Invalid {
        /// The file.
        path: String,
        /// The field, as a JSON path (`gpu.total_memory`, `latencies.map[2].bytes`).
        field: String,
        /// What is wrong and what would be valid.
        problem: String,
    },
}

impl Calibration {
    /// Reads and checks a calibration file.
    pub fn read(path: &Path) -> Result<Calibration, CalibrationError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| CalibrationError::Io {
            path: name.clone(),
            source,
        })?;
        Calibration::from_json(&text, &name)
    }

    /// Parses and checks calibration JSON; `path` names it in errors.
    pub fn from_json(text: &str, path: &str) -> Result<Calibration, CalibrationError> {
        let calibration: Calibration =
            serde_json::from_str(text).map_err(|e| CalibrationError::Json {
                path: path.to_string(),
                line: e.line(),
                column: e.column(),
                message: e
                    .to_string()
                    .split(" at line ")
                    .next()
                    .unwrap_or("")
                    .to_string(),
            })?;
        calibration.validate(path)?;
        Ok(calibration)
    }

    /// The JSON text of this calibration (pretty-printed, one trailing newline).
    pub fn to_json(&self) -> String {
        let mut text = serde_json::to_string_pretty(self).expect("a calibration serializes");
        text.push('\n');
        text
    }

    /// Checks every value the simulator relies on; `path` names the file in errors.
    pub fn validate(&self, path: &str) -> Result<(), CalibrationError> {
        let invalid = |field: &str, problem: String| CalibrationError::Invalid {
            path: path.to_string(),
            field: field.to_string(),
            problem,
        };
        if self.format != CALIBRATION_FORMAT {
            return Err(invalid(
                "format",
                format!(
                    "is {:?}; a calibration file has \"{CALIBRATION_FORMAT}\"",
                    self.format
                ),
            ));
        }
        if self.version != CALIBRATION_VERSION {
            return Err(invalid(
                "version",
                format!(
                    "is {}; this vramsim reads version {CALIBRATION_VERSION}",
                    self.version
                ),
            ));
        }
        if self.gpu.name.trim().is_empty() {
            return Err(invalid(
                "gpu.name",
                "is empty; give the device name cuDeviceGetName reported".into(),
            ));
        }
        let total = self.gpu.total_memory;
        if total == 0 {
            return Err(invalid(
                "gpu.total_memory",
                "is 0; it is cuMemGetInfo's total, in bytes".into(),
            ));
        }
        if self.gpu.free_after_context > total {
            return Err(invalid(
                "gpu.free_after_context",
                format!(
                    "is {} bytes, more than gpu.total_memory ({total} bytes)",
                    self.gpu.free_after_context
                ),
            ));
        }
        if self.context_bytes >= total {
            return Err(invalid(
                "context_bytes",
                format!(
                    "is {} bytes, not less than gpu.total_memory ({total} bytes)",
                    self.context_bytes
                ),
            ));
        }
        let g = &self.granularity;
        for (field, value) in [
            ("granularity.cu_mem_alloc", g.cu_mem_alloc),
            ("granularity.cu_mem_create_minimum", g.cu_mem_create_minimum),
            (
                "granularity.cu_mem_create_recommended",
                g.cu_mem_create_recommended,
            ),
        ] {
            if !value.is_power_of_two() {
                return Err(invalid(
                    field,
                    format!("is {value}; a granularity is a power of two bytes (e.g. 2097152)"),
                ));
            }
        }
        if let Some(pool) = &self.async_pool {
            if pool.page_size == 0 {
                return Err(invalid(
                    "async_pool.page_size",
                    "is 0; it is the pool's growth unit in bytes (e.g. 2097152)".into(),
                ));
            }
            if !pool.alignment.is_power_of_two() {
                return Err(invalid(
                    "async_pool.alignment",
                    format!(
                        "is {}; an alignment is a power of two bytes (e.g. 256)",
                        pool.alignment
                    ),
                ));
            }
            if pool.alignment > pool.page_size {
                return Err(invalid(
                    "async_pool.alignment",
                    format!(
                        "is {} bytes, larger than async_pool.page_size ({} bytes)",
                        pool.alignment, pool.page_size
                    ),
                ));
            }
        }
        let l = &self.latencies;
        for (name, curve) in [
            ("cu_mem_alloc", &l.cu_mem_alloc),
            ("cu_mem_free", &l.cu_mem_free),
            ("map", &l.map),
            ("unmap", &l.unmap),
        ] {
            let mut previous = 0;
            for (i, point) in curve.iter().enumerate() {
                let at = format!("latencies.{name}[{i}]");
                if point.bytes <= previous {
                    return Err(invalid(
                        &format!("{at}.bytes"),
                        format!(
                            "is {}; sizes must be positive and increasing within a curve (the previous one is {previous})",
                            point.bytes
                        ),
                    ));
                }
                previous = point.bytes;
                if !point.median_us.is_finite() || point.median_us < 0.0 {
                    return Err(invalid(
                        &format!("{at}.median_us"),
                        format!(
                            "is {}; a latency is a finite number of microseconds, 0 or more",
                            point.median_us
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The device these figures describe: measured name, total memory and context, no other processes.
    pub fn device(&self) -> Device {
        Device {
            index: self.gpu.index,
            name: self.gpu.name.clone(),
            total_memory: self.gpu.total_memory,
            context_bytes: self.context_bytes,
            other_processes: Vec::new(),
        }
    }

    /// `base` with the measured page size and alignment of the stream-ordered pool, when measured.
    pub fn async_config(&self, base: CudaAsyncConfig) -> CudaAsyncConfig {
        match &self.async_pool {
            Some(pool) => CudaAsyncConfig {
                page_size: pool.page_size,
                alignment: pool.alignment,
                ..base
            },
            None => base,
        }
    }

    /// The timing model for an allocator that obtains memory with `cuMemAlloc`/`cuMemFree`
    /// (`vmm = false`) or by mapping pages (`vmm = true`, expandable segments); `None` when those curves
    /// were not measured.
    pub fn latency_model(&self, vmm: bool) -> Option<LatencyModel> {
        let (grow, shrink) = if vmm {
            (&self.latencies.map, &self.latencies.unmap)
        } else {
            (&self.latencies.cu_mem_alloc, &self.latencies.cu_mem_free)
        };
        if grow.is_empty() || shrink.is_empty() {
            return None;
        }
        Some(LatencyModel {
            grow: LatencyCurve::new(grow),
            shrink: LatencyCurve::new(shrink),
        })
    }
}

/// A latency as a function of size: linear between measured points, the nearest segment's line beyond
/// them, never negative.
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyCurve {
    /// (bytes, nanoseconds), increasing sizes.
    points: Vec<(u64, f64)>,
}

impl LatencyCurve {
    /// A curve through measured points (sizes increasing, as [`Calibration::validate`] checks).
    pub fn new(points: &[LatencyPoint]) -> Self {
        LatencyCurve {
            points: points
                .iter()
                .map(|p| (p.bytes, p.median_us * 1000.0))
                .collect(),
        }
    }

    /// The latency of a call of `bytes`, in nanoseconds.
    pub fn at(&self, bytes: u64) -> u64 {
        let p = &self.points;
        match p.len() {
            0 => 0,
            1 => p[0].1.round() as u64,
            n => {
                // The segment containing `bytes`, or the first/last one for sizes outside.
                let i = p.partition_point(|&(b, _)| b < bytes).clamp(1, n - 1);
                let (x0, y0) = (p[i - 1].0 as f64, p[i - 1].1);
                let (x1, y1) = (p[i].0 as f64, p[i].1);
                let y = y0 + (y1 - y0) * (bytes as f64 - x0) / (x1 - x0);
                y.max(0.0).round() as u64
            }
        }
    }
}

/// Latencies charged when reserved memory grows and shrinks.
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyModel {
    /// Obtaining memory from the device.
    pub grow: LatencyCurve,
    /// Returning it.
    pub shrink: LatencyCurve,
}

/// An allocator whose device allocations and frees take measured time: after each call that changes
/// reserved memory by *d* bytes, the host clock moves on by the latency of a call of *d* bytes (see the
/// module documentation).
#[derive(Clone, Debug)]
pub struct TimedAllocator<A> {
    inner: A,
    latency: LatencyModel,
}

impl<A: Allocator> TimedAllocator<A> {
    /// `inner`, timed by `latency`.
    pub fn new(inner: A, latency: LatencyModel) -> Self {
        TimedAllocator { inner, latency }
    }

    /// The wrapped allocator.
    pub fn into_inner(self) -> A {
        self.inner
    }

    fn charge(&self, before: i64, timeline: &mut Timeline) {
        let after = self.inner.stats().reserved_bytes.all.current;
        let ns = match after.cmp(&before) {
            std::cmp::Ordering::Greater => self.latency.grow.at((after - before) as u64),
            std::cmp::Ordering::Less => self.latency.shrink.at((before - after) as u64),
            std::cmp::Ordering::Equal => 0,
        };
        if ns > 0 {
            timeline.wait_until(timeline.now().saturating_add(ns));
        }
    }

    fn reserved(&self) -> i64 {
        self.inner.stats().reserved_bytes.all.current
    }
}

impl<A: Allocator> Allocator for TimedAllocator<A> {
    fn malloc(
        &mut self,
        size: u64,
        stream: StreamId,
        timeline: &mut Timeline,
    ) -> Result<BlockRef, OutOfMemory> {
        let before = self.reserved();
        let result = self.inner.malloc(size, stream, timeline);
        self.charge(before, timeline);
        result
    }
    fn free(&mut self, block: BlockRef, timeline: &mut Timeline) {
        let before = self.reserved();
        self.inner.free(block, timeline);
        self.charge(before, timeline);
    }
    fn record_stream(&mut self, block: BlockRef, stream: StreamId) {
        self.inner.record_stream(block, stream)
    }
    fn empty_cache(&mut self, timeline: &mut Timeline) {
        let before = self.reserved();
        self.inner.empty_cache(timeline);
        self.charge(before, timeline);
    }
    fn adopt_segment(
        &mut self,
        segment: &vramsim_traces::InitialSegment,
    ) -> Result<Vec<BlockRef>, crate::allocator::AdoptError> {
        self.inner.adopt_segment(segment)
    }
    fn stats(&self) -> &MemoryStats {
        self.inner.stats()
    }
    fn reset_peak_stats(&mut self) {
        self.inner.reset_peak_stats()
    }
    fn device(&self) -> &Device {
        self.inner.device()
    }
    fn device_used(&self) -> u64 {
        self.inner.device_used()
    }
    fn segments(&self) -> Vec<SegmentInfo> {
        self.inner.segments()
    }
    fn set_record_history(&mut self, enabled: bool) {
        self.inner.set_record_history(enabled)
    }
    fn take_history(&mut self) -> Vec<HistoryEntry> {
        self.inner.take_history()
    }
}
