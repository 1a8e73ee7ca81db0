//! GPU presets and size parsing (`sim/src/device.rs`).
//!
//! The preset table below restates every figure with the way its source printed it, so that a typo in
//! `PRESETS` cannot go unnoticed: `deviceQuery` prints `totalGlobalMem / 2^20` rounded ("MBytes"), the
//! `_CudaDeviceProperties` repr prints it floored ("MB"), and an OOM message prints PyTorch's
//! `format_size` ("GiB", two decimals).

use vramsim_sim::device::{
    find_preset, parse_cuda, parse_size, Device, SizeError, DEFAULT_CONTEXT_BYTES, DEFAULT_GPU,
    PRESETS,
};
use vramsim_sim::format::format_size;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// How the cited source printed the figure.
#[derive(Clone, Copy, Debug)]
enum Printed {
    /// Exact bytes (`deviceQuery`'s "(N bytes)" or XLA's `device_memory_size`).
    Bytes(u64),
    /// `deviceQuery`'s "N MBytes": bytes / 2^20, rounded.
    DeviceQueryMBytes(u64),
    /// The torch repr's `total_memory=NMB` (or hipDeviceProp's MB): bytes / 2^20, floored.
    ReprMb(u64),
    /// Only an OOM message: the figure is `format_size` of the preset, checked below.
    OomOnly,
}

/// `(name, device name, total_memory, how the source printed it, what PyTorch's OOM message says,
/// whether a cited OOM message shows exactly that figure)`.
#[rustfmt::skip]
const TABLE: &[(&str, &str, u64, Printed, &str, bool)] = &[
    // LandonTClipp.github.io deviceQuery (driver 13.0); OOM on 1xH100 HBM3 in prime-rl BENCHMARKS.md.
    ("h100-80gb", "NVIDIA H100 80GB HBM3", 85_017_755_648, Printed::DeviceQueryMBytes(81_079), "79.18 GiB", true),
    ("h100-pcie", "NVIDIA H100 PCIe", 84_942_979_072, Printed::Bytes(84_942_979_072), "79.11 GiB", false),
    ("h100-nvl", "NVIDIA H100 NVL", 99_861_594_112, Printed::DeviceQueryMBytes(95_235), "93.00 GiB", false),
    // achatbot repr; OOM on 8xH200 in prime-rl BENCHMARKS.md.
    ("h200", "NVIDIA H200", 143_156 * MIB, Printed::ReprMb(143_156), "139.80 GiB", true),
    // achatbot repr; OOM on 8xB200 in shyampathak22/prime-rl BENCHMARKS.md.
    ("b200", "NVIDIA B200", 182_642 * MIB, Printed::ReprMb(182_642), "178.36 GiB", true),
    ("a100-40gb", "NVIDIA A100-SXM4-40GB", 42_331_013_120, Printed::Bytes(42_331_013_120), "39.42 GiB", false),
    ("a100-80gb", "NVIDIA A100-SXM4-80GB", 85_100_068_864, Printed::DeviceQueryMBytes(81_158), "79.26 GiB", false),
    ("v100-16gb", "Tesla V100-SXM2-16GB", 16_935_419_904, Printed::Bytes(16_935_419_904), "15.77 GiB", false),
    // liucongg/ChatGLM-Finetuning#73: "31.74 GiB total capacity".
    ("v100-32gb", "Tesla V100-SXM2-32GB", 32_502 * MIB, Printed::OomOnly, "31.74 GiB", true),
    // XavierXiao/Dreambooth-Stable-Diffusion#18: "22.20 GiB total capacity".
    ("a10g", "NVIDIA A10G", 22_733 * MIB, Printed::OomOnly, "22.20 GiB", true),
    ("a10", "NVIDIA A10", 23_609_475_072, Printed::Bytes(23_609_475_072), "21.99 GiB", false),
    ("l4", "NVIDIA L4", 23_570_219_008, Printed::DeviceQueryMBytes(22_478), "21.95 GiB", false),
    ("l40s", "NVIDIA L40S", 47_803_596_800, Printed::DeviceQueryMBytes(45_589), "44.52 GiB", false),
    ("a40", "NVIDIA A40", 47_608_692_736, Printed::DeviceQueryMBytes(45_403), "44.34 GiB", false),
    ("a6000", "NVIDIA RTX A6000", 51_041_271_808, Printed::Bytes(51_041_271_808), "47.54 GiB", false),
    ("rtx6000-ada", "NVIDIA RTX 6000 Ada Generation", 51_002_867_712, Printed::DeviceQueryMBytes(48_640), "47.50 GiB", false),
    ("t4", "Tesla T4", 15_095 * MIB, Printed::ReprMb(15_095), "14.74 GiB", false),
    // Stable-X/StableNormal#33: "GPU 0 has a total capacity of 23.59 GiB" on an RTX 3090.
    ("rtx3090", "NVIDIA GeForce RTX 3090", 25_327_697_920, Printed::DeviceQueryMBytes(24_154), "23.59 GiB", true),
    // 3DTopia/Phidias-Diffusion#8 and TMElyralab/MuseTalk#76: 23.64 GiB on RTX 4090s.
    ("rtx4090", "NVIDIA GeForce RTX 4090", 25_386_352_640, Printed::DeviceQueryMBytes(24_210), "23.64 GiB", true),
    ("rtx5090", "NVIDIA GeForce RTX 5090", 33_677_180_928, Printed::DeviceQueryMBytes(32_117), "31.36 GiB", false),
    ("mi300x", "AMD Instinct MI300X", 196_592 * MIB, Printed::ReprMb(196_592), "191.98 GiB", false),
];

#[test]
fn every_preset_matches_its_source_and_oom_figure() {
    for &(name, device_name, bytes, printed, oom_gib, _) in TABLE {
        let preset = find_preset(name).unwrap_or_else(|| panic!("{name} is not a preset"));
        assert_eq!(preset.name, name);
        assert_eq!(preset.device_name, device_name, "{name}");
        assert_eq!(preset.total_memory, bytes, "{name}");
        match printed {
            Printed::Bytes(b) => assert_eq!(bytes, b, "{name}"),
            Printed::DeviceQueryMBytes(n) => {
                assert_eq!((bytes as f64 / MIB as f64).round() as u64, n, "{name}")
            }
            Printed::ReprMb(n) => assert_eq!(bytes / MIB, n, "{name}"),
            Printed::OomOnly => {}
        }
        // What "GPU 0 has a total capacity of X" would say for this device.
        assert_eq!(format_size(bytes), oom_gib, "{name}");
        assert!(!preset.source.trim().is_empty(), "{name} has no source");
    }
}

#[test]
fn the_table_covers_every_preset_and_names_are_unique() {
    for preset in PRESETS {
        assert!(
            TABLE.iter().any(|row| row.0 == preset.name),
            "preset {} has no row in this test's table",
            preset.name
        );
        assert_eq!(
            PRESETS.iter().filter(|p| p.name == preset.name).count(),
            1,
            "{} appears twice",
            preset.name
        );
    }
    assert_eq!(TABLE.len(), PRESETS.len());
    // At least the most used presets are cross-checked against a cited OOM message.
    for name in ["h100-80gb", "h200", "b200", "rtx3090", "rtx4090"] {
        assert!(TABLE.iter().any(|row| row.0 == name && row.5), "{name}");
    }
}

#[test]
fn every_preset_loads_as_a_device() {
    for preset in PRESETS {
        let device = Device::preset(preset.name).unwrap();
        assert_eq!(device.total_memory, preset.total_memory);
        assert_eq!(device.name, preset.device_name);
        assert_eq!(device.index, 0);
        // The default CUDA is 13: the CUDA 13 measurements are 426 MiB on an RTX 6000 Ada
        // (unsloth-zoo PR #1053), which the other sm 8.9 presets take by rule, and 552,402,944 B on
        // an H100 80GB and an H200 (vramsim's own validation run, torch 2.11.0+cu130), which the other
        // sm 9.0 presets take by rule; 512 MiB elsewhere.
        let context = match preset.compute_capability {
            (8, 9) => 426 * MIB,
            (9, 0) => 552_402_944,
            _ => DEFAULT_CONTEXT_BYTES,
        };
        assert_eq!(device.context_bytes, context, "{}", preset.name);
        assert!(device.other_processes.is_empty());
        // Every real board keeps some memory back: a total is never a round number of GiB above it.
        assert!(device.total_memory > DEFAULT_CONTEXT_BYTES);
        assert_eq!(device.free_memory(0), preset.total_memory - context);
    }
}

#[test]
fn context_by_cuda_version() {
    let ctx = |gpu: &str, cuda: u32| find_preset(gpu).unwrap().context(cuda);
    // HF "Model training anatomy": NVML used 1343 MB on a V100 16GB (CUDA 11.2 driver) with one 1×1
    // float tensor (a 2 MiB small-pool segment), and its nvidia-smi shows 2 MiB more used than the
    // process holds (2631 vs 2629 MiB): 1343 − 2 − 2 = 1339 MiB.
    let v100 = ctx("v100-16gb", 11);
    assert_eq!(v100.bytes, 1339 * MIB);
    assert!(v100.source.starts_with("measured:"), "{}", v100.source);
    // The 32 GB V100 is the same chip: the same figure, by rule.
    let v100_32 = ctx("v100-32gb", 11);
    assert_eq!(v100_32.bytes, 1339 * MIB);
    assert!(v100_32.source.starts_with("rule:"));
    // InvokeAI #9413: 256 MiB on an RTX 3090 with torch 2.7.1+cu128; the A10 is sm 8.6 too.
    assert_eq!(ctx("rtx3090", 12).bytes, 256 * MIB);
    assert_eq!(ctx("a10", 12).bytes, 256 * MIB);
    // No CUDA 12 figure for sm 8.0 or 9.0: the 512 MiB assumption.
    assert_eq!(ctx("a100-80gb", 12).bytes, DEFAULT_CONTEXT_BYTES);
    assert!(ctx("h100-80gb", 12).source.starts_with("assumption:"));
    // CUDA 13 on the H100 80GB: total - free after torch.cuda.mem_get_info() as a process's first CUDA
    // call, torch 2.11.0+cu130, driver 580.159.04 (testdata/h100-train-steps); the H200 is sm 9.0 too.
    assert_eq!(ctx("h100-80gb", 13).bytes, 552_402_944);
    assert!(ctx("h100-80gb", 13).source.starts_with("measured:"));
    assert_eq!(ctx("h200", 13).bytes, 552_402_944);
    assert!(ctx("h200", 13).source.starts_with("measured:"));
    // sm 9.0 presets without a measurement of their own take the H100's by rule
    assert_eq!(ctx("h100-nvl", 13).bytes, 552_402_944);
    assert!(ctx("h100-nvl", 13).source.starts_with("rule:"));
    assert!(ctx("a100-80gb", 13).source.starts_with("assumption:"));
    // #55277: 1687 MB with one 1-element tensor (2 MiB segment) on an RTX 3090, torch 1.8.2+cu111.
    assert_eq!(ctx("rtx3090", 11).bytes, 1685 * MIB);
    assert_eq!(ctx("a6000", 11).bytes, 1685 * MIB);
    // CUDA 11 loads modules eagerly: the nearest compute capability measured stands in. sm 9.0 and
    // 8.0 are nearer 8.6 than 7.0; sm 7.5 is nearer 7.0.
    assert_eq!(ctx("h100-80gb", 11).bytes, 1685 * MIB);
    assert_eq!(ctx("a100-80gb", 11).bytes, 1685 * MIB);
    assert_eq!(ctx("t4", 11).bytes, 1339 * MIB);
    assert!(ctx("t4", 11).source.starts_with("rule:"));
    assert_eq!(
        find_preset("v100-16gb")
            .unwrap()
            .device_with_cuda(11)
            .context_bytes,
        1339 * MIB
    );
    // --cuda takes 11, 12 or 13 (or major.minor); anything else lists the valid versions.
    assert_eq!(parse_cuda("12.8"), Ok(12));
    assert_eq!(parse_cuda("13"), Ok(13));
    for bad in ["14", "10", "12.x", "", "cuda12"] {
        let e = parse_cuda(bad).unwrap_err().to_string();
        assert!(e.contains("valid versions are 11, 12, 13"), "{bad}: {e}");
    }
}

#[test]
fn kernels_loaded_during_a_step_by_preset_and_cuda() {
    let modules = |gpu: &str, cuda: u32| find_preset(gpu).unwrap().step_modules(cuda);
    // Measured on an H100 80GB with torch 2.11.0+cu130: 787,283,968 B outside the allocator after
    // two training steps, of which 552,402,944 B were the bare context (testdata/h100-train-steps).
    let h100 = modules("h100-80gb", 13).unwrap();
    assert_eq!(h100.bytes, 787_283_968 - 552_402_944);
    assert!(h100.source.starts_with("measured:"));
    // Measured on an H200 too: the same bytes (the same kernel images for sm 9.0).
    let h200 = modules("h200", 13).unwrap();
    assert_eq!(h200.bytes, h100.bytes);
    assert!(h200.source.starts_with("measured:"));
    // Other sm 9.0 presets by rule.
    let nvl = modules("h100-nvl", 13).unwrap();
    assert_eq!(nvl.bytes, h100.bytes);
    assert!(nvl.source.starts_with("rule:"));
    // Nothing measured elsewhere; CUDA 11 loads every module eagerly, into the context.
    assert!(modules("a100-80gb", 13).is_none());
    assert!(modules("h100-80gb", 12).is_none());
    assert!(modules("h100-80gb", 11).is_none());
}

#[test]
fn the_default_is_the_80gb_h100() {
    assert_eq!(DEFAULT_GPU, "h100-80gb");
    let device = Device::preset(DEFAULT_GPU).unwrap();
    assert_eq!(device.name, "NVIDIA H100 80GB HBM3");
    assert!(device.total_memory > 79 * GIB && device.total_memory < 80 * GIB);
}

#[test]
fn default_context_is_within_the_lazy_loading_range() {
    // Fact sheet §14.1: about 300-600 MiB with lazy module loading (CUDA >= 12.2).
    assert!((300 * MIB..=600 * MIB).contains(&DEFAULT_CONTEXT_BYTES));
}

#[test]
fn names_match_loosely_and_aliases_resolve() {
    for (asked, meant) in [
        ("H100-80GB", "h100-80gb"),
        ("h100_80gb", "h100-80gb"),
        ("h100", "h100-80gb"),
        ("H100-SXM", "h100-80gb"),
        ("rtx-4090", "rtx4090"),
        ("RTX 3090", "rtx3090"),
        (" a100-40gb ", "a100-40gb"),
        ("rtx6000ada", "rtx6000-ada"),
    ] {
        assert_eq!(find_preset(asked).map(|p| p.name), Some(meant), "{asked}");
    }
    // A prefix is not a match: "a100" is ambiguous between 40 and 80 GB.
    assert!(find_preset("a100").is_none());
    assert!(find_preset("a1").is_none());
}

#[test]
fn an_unknown_name_lists_the_valid_ones() {
    let err = Device::preset("h300").unwrap_err();
    assert_eq!(err.name, "h300");
    let message = err.to_string();
    assert!(message.contains("\"h300\""), "{message}");
    for preset in PRESETS {
        assert!(
            message.contains(preset.name),
            "{message} lacks {}",
            preset.name
        );
    }
    // It is an ordinary error, usable with `?` in anyhow code.
    let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(err);
    assert!(boxed.to_string().starts_with("unknown GPU preset"));
}

#[test]
fn parse_size_reads_numbers_and_units() {
    let cases: &[(&str, u64)] = &[
        ("512", 512),
        ("0", 0),
        ("+5", 5),
        ("24GiB", 24 * GIB),
        ("24GB", 24_000_000_000),
        ("24 gib", 24 * GIB),
        ("24gb", 24_000_000_000),
        ("80e9", 80_000_000_000),
        ("8E+10", 80_000_000_000),
        ("1024MiB", GIB),
        ("1.5GiB", 3 * GIB / 2),
        (".5KiB", 512),
        ("1KB", 1_000),
        ("1kib", 1_024),
        ("1MB", 1_000_000),
        ("2TB", 2_000_000_000_000),
        ("1TiB", 1 << 40),
        ("3B", 3),
        ("  17179869184  ", 17_179_869_184),
        // Exact decimal arithmetic, rounded to the nearest byte, halves up.
        ("1.1GiB", 1_181_116_006), // 1181116006.4
        ("0.5", 1),
        ("0.4", 0),
        ("2.5e-3KB", 3),
        ("1e-400", 0),
        ("18446744073709551615", u64::MAX),
        ("1.00000000000000000000000000000000000000000000001GiB", GIB),
    ];
    for &(input, expected) in cases {
        assert_eq!(parse_size(input), Ok(expected), "{input:?}");
    }
}

#[test]
fn parse_size_rejects_what_is_not_a_size() {
    assert_eq!(parse_size(""), Err(SizeError::Empty));
    assert_eq!(parse_size("   "), Err(SizeError::Empty));
    assert!(matches!(parse_size("-1GiB"), Err(SizeError::Negative(_))));
    assert!(matches!(parse_size("-0"), Err(SizeError::Negative(_))));
    assert!(matches!(parse_size("NaN"), Err(SizeError::NotFinite(_))));
    assert!(matches!(parse_size("nanGiB"), Err(SizeError::NotFinite(_))));
    assert!(matches!(parse_size("inf"), Err(SizeError::NotFinite(_))));
    assert!(matches!(parse_size("GiB"), Err(SizeError::BadNumber(_))));
    assert!(matches!(parse_size("e9"), Err(SizeError::BadNumber(_))));
    assert!(matches!(parse_size("."), Err(SizeError::BadNumber(_))));
    assert!(matches!(
        parse_size("1.2.3GB"),
        Err(SizeError::BadNumber(_))
    ));
    for overflow in [
        "18446744073709551616",
        "17179869184GiB", // exactly 2^64
        "1e400",
        "99999999999999999999999999999999999999999TiB",
    ] {
        assert!(
            matches!(parse_size(overflow), Err(SizeError::Overflow(_))),
            "{overflow}"
        );
    }
    assert!(matches!(
        parse_size("16EB"),
        Err(SizeError::UnknownUnit { .. })
    ));
    assert!(matches!(
        parse_size("12 GB extra"),
        Err(SizeError::UnknownUnit { .. })
    ));

    let err = parse_size("24G").unwrap_err();
    assert_eq!(
        err,
        SizeError::UnknownUnit {
            input: "24G".into(),
            unit: "G".into()
        }
    );
    let message = err.to_string();
    for unit in ["B", "KB", "KiB", "MB", "MiB", "GB", "GiB", "TB", "TiB"] {
        assert!(message.contains(unit), "{message}");
    }
    assert!(parse_size("18446744073709551616")
        .unwrap_err()
        .to_string()
        .contains("2^64"));
    assert!(parse_size("-3MiB")
        .unwrap_err()
        .to_string()
        .contains("negative"));
}
