//! Reports: what a replay measured, as a table for people and JSON for programs.

use std::fmt::Write as _;

use serde_json::{json, Value};
use vramsim_traces::Category;

use crate::device::Device;
use crate::engine::ReplayOutcome;
use crate::format::format_size;
use crate::plot::{plot_timeline, PlotError, TimelinePlot, TimelineSample};

/// A replay's outcome with what it ran on.
#[derive(Clone, Debug)]
pub struct Report {
    /// Where the trace came from (a path, or a description).
    pub source: String,
    /// The allocator model (`pytorch`, `cuda-malloc`).
    pub allocator: String,
    /// The `PYTORCH_CUDA_ALLOC_CONF` string in force.
    pub alloc_conf: String,
    /// The memory fraction in force, if any.
    pub memory_fraction: Option<f64>,
    /// The device.
    pub device: Device,
    /// What the replay measured.
    pub outcome: ReplayOutcome,
}

impl Report {
    /// `allocated_bytes.all.peak`.
    pub fn peak_allocated(&self) -> u64 {
        self.outcome.stats.allocated_bytes.all.peak as u64
    }

    /// `reserved_bytes.all.peak`.
    pub fn peak_reserved(&self) -> u64 {
        self.outcome.stats.reserved_bytes.all.peak as u64
    }

    /// `active_bytes.all.peak`.
    pub fn peak_active(&self) -> u64 {
        self.outcome.stats.active_bytes.all.peak as u64
    }

    /// `requested_bytes.all.peak`.
    pub fn peak_requested(&self) -> u64 {
        self.outcome.stats.requested_bytes.all.peak as u64
    }

    /// Highest memory this process held on the device: reserved plus the CUDA context.
    pub fn peak_device_used(&self) -> u64 {
        self.outcome.peak_device_used
    }

    /// Share of the reserved peak that was never allocated while reserved memory stood at its peak
    /// (0 when nothing was reserved): the memory fragmentation and rounding cost at the worst moment.
    pub fn fragmentation(&self) -> f64 {
        let reserved = self.peak_reserved();
        if reserved == 0 {
            0.0
        } else {
            1.0 - self.outcome.allocated_at_reserved_peak as f64 / reserved as f64
        }
    }

    /// Memory the allocator can have: the device's total less the CUDA context and other processes.
    pub fn usable_capacity(&self) -> u64 {
        self.device.total_memory - self.device.non_allocator_bytes()
    }

    /// The phase starts for plots, as (event index, name).
    pub fn phase_bands(&self) -> Vec<(f64, String)> {
        self.outcome
            .phase_marks
            .iter()
            .map(|(index, name)| (*index as f64, name.clone()))
            .collect()
    }

    /// Draws allocated and reserved memory over the trace (needs a replay with timeline points), with its
    /// phases, the usable capacity and the OOM point, to a `.png` or `.svg` file.
    pub fn plot_timeline(&self, title: &str, path: &std::path::Path) -> Result<(), PlotError> {
        let samples: Vec<TimelineSample> = self
            .outcome
            .timeline
            .iter()
            .map(|p| TimelineSample {
                x: p.event_index as f64,
                allocated: p.allocated,
                reserved: p.reserved,
            })
            .collect();
        plot_timeline(
            &TimelinePlot {
                title,
                x_label: "event",
                samples: &samples,
                capacity: Some(self.usable_capacity()),
                oom_at: self.outcome.oom.as_ref().map(|o| o.event_index as f64),
                phases: &self.phase_bands(),
            },
            path,
        )
    }

    /// Whether the trace ran to its end without running out of memory.
    pub fn fits(&self) -> bool {
        self.outcome.oom.is_none()
    }

    /// The machine-readable report (`--json`).
    pub fn to_json(&self) -> Value {
        let stats = &self.outcome.stats;
        let categories: serde_json::Map<String, Value> = Category::ALL
            .iter()
            .zip(self.outcome.categories_at_peak)
            .filter(|(_, bytes)| *bytes > 0)
            .map(|(category, bytes)| (category.name().to_string(), json!(bytes)))
            .collect();
        let phases: Vec<Value> = self
            .outcome
            .phases
            .iter()
            .map(|p| {
                json!({
                    "name": p.name,
                    "occurrences": p.occurrences,
                    "peak_allocated_bytes": p.peak_allocated,
                    "peak_reserved_bytes": p.peak_reserved,
                })
            })
            .collect();
        let oom = self.outcome.oom.as_ref().map(|oom| {
            json!({
                "event_index": oom.event_index,
                "message": oom.message,
                "requested_bytes": oom.requested_bytes,
                "id": oom.id.to_string(),
            })
        });
        json!({
            "source": self.source,
            "allocator": self.allocator,
            "alloc_conf": self.alloc_conf,
            "memory_fraction": self.memory_fraction,
            "device": {
                "name": self.device.name,
                "total_memory_bytes": self.device.total_memory,
                "context_bytes": self.device.context_bytes,
                "other_processes_bytes": self.device.non_allocator_bytes() - self.device.context_bytes,
            },
            "fits": self.fits(),
            "events": self.outcome.events,
            "allocs": self.outcome.allocs,
            "frees": self.outcome.frees,
            "peak_allocated_bytes": self.peak_allocated(),
            "peak_reserved_bytes": self.peak_reserved(),
            "peak_active_bytes": self.peak_active(),
            "peak_requested_bytes": self.peak_requested(),
            "peak_device_used_bytes": self.peak_device_used(),
            "peak_allocated_event_index": self.outcome.peak_allocated_event,
            "final_allocated_bytes": stats.allocated_bytes.all.current,
            "final_reserved_bytes": stats.reserved_bytes.all.current,
            "peak_segments": stats.segment.all.peak,
            "device_allocations": stats.num_device_alloc,
            "device_frees": stats.num_device_free,
            "alloc_retries": stats.num_alloc_retries,
            "fragmentation_at_reserved_peak": self.fragmentation(),
            "allocated_by_category_at_peak_bytes": categories,
            "phases": phases,
            "host_time_us": self.outcome.host_time_ns as f64 / 1000.0,
            "stats": stats.to_flat(),
            "oom": oom,
        })
    }

    /// The human-readable report (the default output).
    pub fn to_table(&self) -> String {
        let stats = &self.outcome.stats;
        let mut out = String::new();
        let _ = writeln!(out, "trace      {}", self.source);
        let mut allocator = self.allocator.clone();
        if !self.alloc_conf.is_empty() {
            let _ = write!(allocator, " ({})", self.alloc_conf);
        }
        if let Some(fraction) = self.memory_fraction {
            let _ = write!(allocator, ", memory fraction {fraction}");
        }
        let _ = writeln!(out, "allocator  {allocator}");
        let _ = writeln!(
            out,
            "device     {}, {} total, CUDA context {}{}",
            self.device.name,
            format_size(self.device.total_memory),
            format_size(self.device.context_bytes),
            match self.device.non_allocator_bytes() - self.device.context_bytes {
                0 => String::new(),
                others => format!(", other processes {}", format_size(others)),
            }
        );
        let _ = writeln!(
            out,
            "events     {} ({} allocs, {} frees)",
            self.outcome.events, self.outcome.allocs, self.outcome.frees
        );
        out.push('\n');
        let _ = writeln!(out, "{:<22}{:>14}{:>20}", "peak", "", "bytes");
        for (name, bytes) in [
            ("allocated", self.peak_allocated()),
            ("reserved", self.peak_reserved()),
            ("active", self.peak_active()),
            ("requested", self.peak_requested()),
            ("device used", self.peak_device_used()),
        ] {
            let _ = writeln!(
                out,
                "  {name:<20}{:>14}{:>20}",
                format_size(bytes),
                group_digits(bytes)
            );
        }
        out.push('\n');
        for (name, value) in [
            ("segments (peak)", stats.segment.all.peak),
            ("device allocations", stats.num_device_alloc),
            ("device frees", stats.num_device_free),
            ("alloc retries", stats.num_alloc_retries),
        ] {
            let _ = writeln!(out, "  {name:<20}{value:>14}");
        }
        let _ = writeln!(
            out,
            "  {:<20}{:>13.1}%  of the reserved peak never allocated at that time",
            "fragmentation",
            self.fragmentation() * 100.0
        );
        let total: u64 = self.outcome.categories_at_peak.iter().sum();
        if total > 0 {
            out.push('\n');
            let _ = writeln!(
                out,
                "at peak allocated (event {}), by category (requested bytes)",
                self.outcome.peak_allocated_event
            );
            for (category, bytes) in Category::ALL.iter().zip(self.outcome.categories_at_peak) {
                if bytes > 0 {
                    let _ = writeln!(
                        out,
                        "  {:<20}{:>14}{:>8.1}%",
                        category.name(),
                        format_size(bytes),
                        bytes as f64 * 100.0 / total as f64
                    );
                }
            }
        }
        if !self.outcome.phases.is_empty() {
            out.push('\n');
            let _ = writeln!(
                out,
                "{:<22}{:>14}{:>16}",
                "by phase", "peak allocated", "peak reserved"
            );
            for phase in &self.outcome.phases {
                let _ = writeln!(
                    out,
                    "  {:<20}{:>14}{:>16}",
                    phase.name,
                    format_size(phase.peak_allocated),
                    format_size(phase.peak_reserved)
                );
            }
        }
        out.push('\n');
        match &self.outcome.oom {
            None => {
                let _ = writeln!(
                    out,
                    "result     fits: peak device use {} of {}",
                    format_size(self.peak_device_used()),
                    format_size(self.device.total_memory)
                );
            }
            Some(oom) => {
                let _ = writeln!(
                    out,
                    "result     OUT OF MEMORY at event {} (alloc of id {}, {} bytes):\n           {}",
                    oom.event_index, oom.id, oom.requested_bytes, oom.message
                );
            }
        }
        out
    }
}

/// `1234567` → `"1,234,567"`.
pub fn group_digits(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_are_grouped_in_threes() {
        for (n, text) in [
            (0, "0"),
            (999, "999"),
            (1000, "1,000"),
            (1_048_576, "1,048,576"),
        ] {
            assert_eq!(group_digits(n), text);
        }
    }
}
