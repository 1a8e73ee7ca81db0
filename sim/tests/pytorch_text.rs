//! PyTorch's texts byte for byte: `torch.cuda.memory_summary()` (fact sheet §9) and the out-of-memory
//! message (§6.2).
//!
//! The summaries are compared with what PyTorch 2.15.0 printed for the same statistics
//! (`data/pytorch_text/`, see its README). The OOM messages are real ones that people posted, rebuilt
//! from byte counts chosen to round to every figure they show.

use std::path::{Path, PathBuf};

use vramsim_sim::device::{Device, OtherProcess};
use vramsim_sim::oom::{
    out_of_memory_message, out_of_memory_message_with, OomContext, OomFacts, MORE_THAN_1EB_MESSAGE,
    OOM_HINT,
};
use vramsim_sim::stats::{MemoryStats, Stat, StatArray};
use vramsim_sim::summary::memory_summary;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/pytorch_text")
}

fn stat(values: &serde_json::Value) -> Stat {
    let v: Vec<i64> = values
        .as_array()
        .map(|a| a.iter().map(|x| x.as_i64().unwrap()).collect())
        .unwrap_or_else(|| vec![0; 4]);
    Stat {
        current: v[0],
        peak: v[1],
        allocated: v[2],
        freed: v[3],
    }
}

/// Builds the statistics `gen_summary.py` handed to PyTorch (missing entries are 0).
fn stats_of(spec: &serde_json::Value) -> MemoryStats {
    let array = |name: &str| StatArray {
        all: stat(&spec[name]["all"]),
        small_pool: stat(&spec[name]["small_pool"]),
        large_pool: stat(&spec[name]["large_pool"]),
    };
    let scalar = |name: &str, default: i64| spec[name].as_i64().unwrap_or(default);
    MemoryStats {
        allocation: array("allocation"),
        segment: array("segment"),
        active: array("active"),
        inactive_split: array("inactive_split"),
        allocated_bytes: array("allocated_bytes"),
        reserved_bytes: array("reserved_bytes"),
        active_bytes: array("active_bytes"),
        inactive_split_bytes: array("inactive_split_bytes"),
        requested_bytes: array("requested_bytes"),
        num_alloc_retries: scalar("num_alloc_retries", 0),
        num_ooms: scalar("num_ooms", 0),
        num_sync_all_streams: scalar("num_sync_all_streams", 0),
        num_device_alloc: scalar("num_device_alloc", 0),
        num_device_free: scalar("num_device_free", 0),
        max_split_size: scalar("max_split_size", -1),
        oversize_allocations: stat(&spec["oversize_allocations"]),
        oversize_segments: stat(&spec["oversize_segments"]),
    }
}

#[test]
fn memory_summary_matches_pytorch_golden_texts() {
    let dir = data_dir();
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary_cases.json")).unwrap())
            .unwrap();
    let cases = cases.as_array().unwrap();
    assert_eq!(cases.len(), 3);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let device = case["device"].as_u64().unwrap() as u32;
        let stats = stats_of(&case["stats"]);
        for abbreviated in [false, true] {
            let file = format!(
                "summary_{name}{}.txt",
                if abbreviated { "_abbrev" } else { "" }
            );
            let expected = std::fs::read_to_string(dir.join(&file)).unwrap();
            let got = memory_summary(&stats, device, abbreviated);
            if got != expected {
                for (i, (g, e)) in got.lines().zip(expected.lines()).enumerate() {
                    assert_eq!(g, e, "{file} line {}", i + 1);
                }
                assert_eq!(got, expected, "{file}");
            }
        }
    }
}

#[test]
fn memory_summary_layout() {
    let text = memory_summary(&MemoryStats::default(), 0, false);
    // Every line is 77 characters ("|" + 75 + "|"), and the text ends with a newline.
    assert!(text.ends_with("|\n"));
    assert!(text.lines().all(|l| l.len() == 77), "{text}");
    // 6 header lines, 9 metrics × 4, 2 oversize × 2, the closing line.
    assert_eq!(text.lines().count(), 6 + 9 * 4 + 2 * 2 + 1);
    assert_eq!(
        memory_summary(&MemoryStats::default(), 0, true)
            .lines()
            .count(),
        6 + 9 * 2 + 2 * 2 + 1
    );
}

#[test]
fn memory_summary_size_units() {
    // §9: 786,432 B is the first value shown in KiB; one byte less stays in bytes.
    let mut stats = MemoryStats::default();
    stats.allocated_bytes.all.current = 786_432;
    stats.allocated_bytes.all.peak = 786_431;
    let text = memory_summary(&stats, 0, true);
    let row = text
        .lines()
        .find(|l| l.starts_with("| Allocated memory"))
        .unwrap();
    assert_eq!(
        row,
        "| Allocated memory      |    768 KiB | 786431 B   |      0 B   |      0 B   |"
    );
}

fn h100_79_18() -> Device {
    Device {
        index: 0,
        name: "NVIDIA H100 80GB HBM3".to_string(),
        total_memory: 85_017_755_648,
        context_bytes: 0,
        other_processes: Vec::new(),
    }
}

#[test]
fn oom_message_h200_with_memory_fraction() {
    // Posted from an H200 run with a memory fraction (a recent release: docs.pytorch.org link); the post
    // cut the link short, so the tail is checked against OOM_HINT separately.
    let posted = "CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 139.79 GiB \
        of which 20.59 GiB is free. Including non-PyTorch memory, this process has 119.20 GiB memory in use. \
        118.82 GiB allowed; Of the allocated memory 117.83 GiB is allocated by PyTorch, and 640.95 MiB is \
        reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting \
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for \
        Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda";
    let device = Device {
        index: 0,
        name: "NVIDIA H200".to_string(),
        total_memory: 143_146 * MIB, // 139.79 GiB
        context_bytes: 762 * MIB,
        other_processes: Vec::new(),
    };
    let reserved = 127_190_171_648; // 118.46 GiB of 2 MiB-multiple segments
    let allocated = 126_518_086_656; // 117.83 GiB
    let allowed = (0.85 * device.total_memory as f64) as u64; // set_per_process_memory_fraction(0.85)
                                                              // The numbers are consistent: this is the fraction check failing (§3.3), not the device.
    assert!(reserved + 512 * MIB > allowed);
    let message = out_of_memory_message(&OomFacts {
        device: &device,
        alloc_size: 512 * MIB,
        device_free: device.free_memory(reserved),
        allowed: Some(allowed),
        allocated_bytes: allocated,
        reserved_bytes: reserved,
    });
    assert!(message.starts_with(posted), "{message}");
    assert!(message.ends_with(OOM_HINT));
    assert!(!message.contains('\n'));
}

#[test]
fn oom_message_other_process_first_and_private_pools() {
    // Posted from GPU 4 of an 80 GB H100, complete.
    let posted = "CUDA out of memory. Tried to allocate 25.96 GiB. GPU 4 has a total capacity of 79.18 GiB of \
        which 23.04 GiB is free. Process 7478 has 4.08 GiB memory in use. Including non-PyTorch memory, this \
        process has 52.02 GiB memory in use. Of the allocated memory 45.89 GiB is allocated by PyTorch, with \
        1.38 MiB allocated in private pools (e.g., CUDA Graphs), and 3.01 GiB is reserved by PyTorch but \
        unallocated. If reserved but unallocated memory is large try setting \
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for \
        Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";
    let mut device = h100_79_18();
    device.index = 4;
    device.context_bytes = 3_351_248_896;
    device.other_processes.push(OtherProcess {
        pid: 7478,
        bytes: 4_379_901_952,
    });
    let facts = OomFacts {
        device: &device,
        alloc_size: 26_584 * MIB,
        device_free: 24_739_011_584,
        allowed: None,
        allocated_bytes: 49_272_564_736,
        reserved_bytes: 52_504_297_472,
    };
    let context = OomContext {
        allocated_in_private_pools: 2827 * 512,
        this_process_position: 1,
        nvml_available: true,
    };
    assert_eq!(out_of_memory_message_with(&facts, &context), posted);
    // NVML may list this process first instead.
    let first = out_of_memory_message_with(
        &facts,
        &OomContext {
            this_process_position: 0,
            ..context.clone()
        },
    );
    assert!(first.contains(
        "is free. Including non-PyTorch memory, this process has 52.02 GiB memory in use. Process 7478 has \
         4.08 GiB memory in use. Of the allocated"
    ));
    // Without NVML there is no process list at all.
    let no_nvml = out_of_memory_message_with(
        &facts,
        &OomContext {
            nvml_available: false,
            ..context
        },
    );
    assert!(no_nvml.contains("23.04 GiB is free. Of the allocated memory 45.89 GiB"));
}

#[test]
fn oom_message_small_card() {
    // Posted from a 4 GB card, complete.
    let posted = "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 3.68 GiB of \
        which 3.48 GiB is free. Including non-PyTorch memory, this process has 154.00 MiB memory in use. Of \
        the allocated memory 55.37 MiB is allocated by PyTorch, and 16.63 MiB is reserved by PyTorch but \
        unallocated. If reserved but unallocated memory is large try setting \
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for \
        Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";
    let device = Device {
        index: 0,
        name: "4 GB".to_string(),
        total_memory: 3_951_034_368,
        context_bytes: 82 * MIB,
        other_processes: Vec::new(),
    };
    let message = out_of_memory_message(&OomFacts {
        device: &device,
        alloc_size: 2 * MIB,
        device_free: 3_736_076_288,
        allowed: None,
        allocated_bytes: 113_397 * 512,
        reserved_bytes: 72 * MIB,
    });
    assert_eq!(message, posted);
}

#[test]
fn oom_message_structure() {
    // §13 case 5: test_out_of_memory's regex on a 800000000 GiB request.
    let device = h100_79_18();
    let message = out_of_memory_message(&OomFacts {
        device: &device,
        alloc_size: 800_000_000 * GIB,
        device_free: device.free_memory(0),
        allowed: None,
        allocated_bytes: 0,
        reserved_bytes: 0,
    });
    assert!(message.starts_with(
        "CUDA out of memory. Tried to allocate 800000000.00 GiB. GPU 0 has a total capacity of"
    ));
    // The two double spaces of the hint.
    assert!(message.contains("fragmentation.  See documentation for Memory Management  (https://"));
    assert_eq!(message.matches("  ").count(), 2);
    // Small sizes print as bytes, and the figures follow format_size's rounding.
    assert!(message.contains(
        "this process has 0 bytes memory in use. Of the allocated memory 0 bytes is allocated by PyTorch, and \
         0 bytes is reserved"
    ));
    // The literal as it sits in 2.15.0's libc10_cuda.so (`strings`), on one line.
    assert_eq!(
        OOM_HINT,
        concat!(
            " If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            " to avoid fragmentation.  See documentation for Memory Management  ",
            "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
        )
    );
    assert_eq!(
        MORE_THAN_1EB_MESSAGE,
        "CUDA out of memory. Tried to allocate more than 1EB memory."
    );
}
