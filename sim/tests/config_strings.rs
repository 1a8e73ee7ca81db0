//! `PYTORCH_CUDA_ALLOC_CONF` parsing against PyTorch (fact sheet §12, §13 case 4).
//!
//! The fixture `data/pytorch_text/config_parse_torch-2.15.0.json` holds, for 115 settings strings, what
//! PyTorch 2.15.0's own parser answered (see the README beside it); every case must give the same
//! verdict, exception class and message here. The values a string produces cannot be read back from
//! PyTorch without a GPU: they are checked against the worked examples of the fact sheet and the numbers
//! of `test_allocator_settings`.

use std::path::Path;

use vramsim_sim::config::{
    AllocatorConfig, Backend, ConfigError, PyException, MALLOC_ASYNC_IGNORES_WARNING,
};
use vramsim_sim::rounding::round_size;

const MIB: u64 = 1 << 20;

fn fixture() -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/pytorch_text/config_parse_torch-2.15.0.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("fixture is JSON")
}

fn parse_err(settings: &str) -> ConfigError {
    match AllocatorConfig::parse(settings) {
        Ok(config) => panic!("{settings:?} was accepted: {config:?}"),
        Err(e) => e,
    }
}

#[test]
fn every_fixture_case_matches_pytorch_2_15() {
    let fixture = fixture();
    assert!(fixture["torch"].as_str().unwrap().starts_with("2.15.0"));
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 100);
    let mut failures = Vec::new();
    for case in cases {
        let settings = case["settings"].as_str().unwrap();
        // Each case ran as `_set_allocator_settings(s)` in a fresh process whose backend was native.
        let got = AllocatorConfig::default().apply(settings);
        let ok = case["ok"].as_bool().unwrap();
        match (ok, got) {
            (true, Ok(config)) => assert_eq!(config.settings, settings),
            (false, Err(e)) => {
                let class = match e.exception {
                    PyException::ValueError => "ValueError",
                    PyException::IndexError => "IndexError",
                    PyException::RuntimeError => "RuntimeError",
                };
                if case["message"] != e.message.as_str() || case["type"] != class {
                    failures.push(format!(
                        "{settings:?}: PyTorch {} {:?}, vramsim {class} {:?}",
                        case["type"], case["message"], e.message
                    ));
                }
            }
            (true, Err(e)) => failures.push(format!("{settings:?}: PyTorch accepts, vramsim: {e}")),
            (false, Ok(_)) => failures.push(format!(
                "{settings:?}: PyTorch rejects with {:?}, vramsim accepts",
                case["message"]
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn test_allocator_settings_invalid_strings() {
    // §12.3 / §13 case 4: the strings test_allocator_settings expects to raise, with 2.15.0's messages.
    for (settings, message) in [
        (
            "foo:1,bar:2",
            "Unrecognized key 'foo' in Accelerator allocator config.",
        ),
        (
            "garbage_collection_threshold:1.2",
            "garbage_collect_threshold is invalid, set it in (0.0, 1.0)",
        ),
        (
            "max_split_size_mb:2",
            "CachingAllocator option max_split_size_mb too small, must be >= 20",
        ),
        (
            "release_lock_on_cudamalloc:none",
            "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'none'",
        ),
        (
            "pinned_use_cuda_host_register:none",
            "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'none'",
        ),
        ("pinned_num_register_threads:none", "stoull"),
        (
            "pinned_num_register_threads:1024",
            "Number of register threads should be less than or equal to 128, got 1024",
        ),
        (
            "max_split_size_mb:20,large_segment_size_mb:25",
            "CachingAllocator option max_split_size_mb too small, must be >= 25",
        ),
    ] {
        let e = parse_err(settings);
        assert_eq!(e.message, message, "{settings:?}");
        assert_eq!(e.exception, PyException::ValueError, "{settings:?}");
    }
}

#[test]
fn errors_name_the_key() {
    let e = parse_err("expandable_segments:True,max_split_size_mb:2");
    assert_eq!(e.key.as_deref(), Some("max_split_size_mb"));
    assert_eq!(
        e.describe(),
        "max_split_size_mb: CachingAllocator option max_split_size_mb too small, must be >= 20"
    );
    assert_eq!(e.to_string(), e.message);
    assert_eq!(parse_err("foo:1").key.as_deref(), Some("foo"));
    assert_eq!(
        parse_err("max_split_size_mb").exception,
        PyException::RuntimeError
    );
}

#[test]
fn defaults_and_settings_string() {
    let config = AllocatorConfig::parse("").unwrap();
    assert_eq!(config, AllocatorConfig::default());
    let config = AllocatorConfig::parse(" expandable_segments : True ").unwrap();
    assert!(config.expandable_segments);
    // allocator_settings["PYTORCH_CUDA_ALLOC_CONF"] is the string as given.
    assert_eq!(config.settings, " expandable_segments : True ");
}

#[test]
fn values_in_mib_and_their_clamp() {
    let c = AllocatorConfig::parse("max_split_size_mb:40,max_non_split_rounding_mb:30").unwrap();
    assert_eq!(c.max_split_size, 40 * MIB);
    assert_eq!(c.max_non_split_rounding_size, 30 * MIB);
    // §12.3 clamp to SIZE_MAX / 1 MiB mebibytes; stoull wraps "-1" to 2^64 - 1 first.
    for settings in [
        "max_split_size_mb:-1",
        "max_split_size_mb:18446744073709551615",
    ] {
        let c = AllocatorConfig::parse(settings).unwrap();
        assert_eq!(c.max_split_size, (u64::MAX / MIB) * MIB, "{settings}");
        assert_eq!(c.max_split_size, u64::MAX - (MIB - 1));
    }
    // stoull reads the leading digits only, and a missing ':' is not checked.
    assert_eq!(
        AllocatorConfig::parse("max_split_size_mb:64MB")
            .unwrap()
            .max_split_size,
        64 * MIB
    );
    assert_eq!(
        AllocatorConfig::parse("max_split_size_mb,40")
            .unwrap()
            .max_split_size,
        40 * MIB
    );
}

#[test]
fn large_segment_size_sets_the_minimums_and_the_non_split_default() {
    // D-ann unit test: 15/20/40 MiB and 0.8.
    let c = AllocatorConfig::parse(
        "large_segment_size_mb:15,max_split_size_mb:20,max_non_split_rounding_mb:40,garbage_collection_threshold:0.8",
    )
    .unwrap();
    assert_eq!(c.large_segment_size, 15 * MIB);
    assert_eq!(c.max_split_size, 20 * MIB);
    assert_eq!(c.max_non_split_rounding_size, 40 * MIB);
    assert_eq!(c.garbage_collection_threshold, 0.8);
    // Read before the other keys, wherever it stands; the non-split tolerance follows it.
    let c = AllocatorConfig::parse("max_split_size_mb:12,large_segment_size_mb:12").unwrap();
    assert_eq!(
        (c.max_split_size, c.large_segment_size),
        (12 * MIB, 12 * MIB)
    );
    assert_eq!(c.max_non_split_rounding_size, 12 * MIB);
    // D-ann: the other unit-test string.
    let c = AllocatorConfig::parse(
        "max_split_size_mb:40,max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,\
         roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],expandable_segments:True,\
         pinned_use_background_threads:True",
    )
    .unwrap();
    assert_eq!(
        (
            c.max_split_size,
            c.max_non_split_rounding_size,
            c.large_segment_size
        ),
        (40 * MIB, 30 * MIB, 20 * MIB)
    );
    assert_eq!(c.garbage_collection_threshold, 0.5);
    assert!(c.expandable_segments && c.pinned_use_background_threads);
}

#[test]
fn roundup_power2_divisions_worked_examples() {
    // §12.4 worked examples (NEW semantics: `>` fills from the entry after the last listed one).
    for (settings, entries) in [
        (
            "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]",
            [8, 8, 8, 8, 8, 8, 8, 2, 4, 2, 4, 1, 1, 1, 1, 1],
        ),
        (
            "roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]",
            [8, 8, 8, 8, 8, 8, 8, 8, 16, 1, 0, 8, 2, 2, 2, 2],
        ),
        ("roundup_power2_divisions:4", [4; 16]),
        (
            "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]",
            [8, 8, 8, 8, 8, 8, 8, 2, 2, 2, 1, 1, 1, 1, 1, 1],
        ),
        // `>` first: nothing listed yet, so it fills from entry 1; entry 0 keeps 0.
        (
            "roundup_power2_divisions:[>:4]",
            [0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4],
        ),
        // Keys beyond 32 GiB land in the last entry.
        ("roundup_power2_divisions:[65536:4]", [4; 16]),
        ("roundup_power2_divisions:[]", [0; 16]),
    ] {
        let c = AllocatorConfig::parse(settings).unwrap();
        assert_eq!(c.roundup_power2_divisions, entries, "{settings}");
    }
    let c = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
    for size in [64 * MIB, 256 * MIB, 2048 * MIB] {
        assert_eq!(c.roundup_power2_divisions(size), 4);
    }
}

#[test]
fn test_allocator_settings_deltas() {
    // §13 case 4: nbytes = 21 * 2^20 floats = 88,080,384 B.
    let nbytes = 21 * MIB * 4;
    let big = 100 * MIB * 4;
    let settings = AllocatorConfig::default().apply("").unwrap();
    assert_eq!(round_size(nbytes, &settings), 88_080_384);

    let settings = settings.apply("roundup_power2_divisions:4").unwrap();
    assert_eq!(round_size(nbytes, &settings), 100_663_296);

    // _set_allocator_settings resets the divisions (§12.1 "should have reset the power2 divisions now").
    let settings = settings
        .apply("garbage_collection_threshold:0.5")
        .unwrap()
        .apply("garbage_collection_threshold:0.5,max_split_size_mb:40")
        .unwrap();
    assert_eq!(settings.roundup_power2_divisions, [0; 16]);
    assert_eq!(settings.max_split_size, 40 * MIB);
    assert_eq!(round_size(nbytes, &settings), 88_080_384);

    let settings = settings
        .apply("garbage_collection_threshold:0.5,roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")
        .unwrap();
    // max_split_size went back to its default with this string.
    assert_eq!(settings.max_split_size, u64::MAX);
    assert_eq!(round_size(nbytes, &settings), 92_274_688);
    assert_eq!(round_size(big, &settings), 536_870_912);

    let settings = settings.apply("release_lock_on_cudamalloc:True").unwrap();
    assert!(settings.release_lock_on_cudamalloc);
    assert_eq!(round_size(nbytes, &settings), 88_080_384);
}

#[test]
fn apply_keeps_what_the_string_does_not_reset() {
    let base = AllocatorConfig::parse(
        "expandable_segments:True,large_segment_size_mb:30,per_process_memory_fraction:0.5,max_split_size_mb:64",
    )
    .unwrap();
    let next = base.apply("garbage_collection_threshold:0.6").unwrap();
    assert!(next.expandable_segments);
    assert_eq!(next.per_process_memory_fraction, Some(0.5));
    // large_segment_size persists; max_split_size and the non-split tolerance are reset.
    assert_eq!(next.large_segment_size, 30 * MIB);
    assert_eq!(next.max_split_size, u64::MAX);
    assert_eq!(next.max_non_split_rounding_size, 30 * MIB);
    // The persisted large segment size is the new minimum (as in PyTorch, where it is not reset).
    assert_eq!(
        base.apply("max_split_size_mb:25").unwrap_err().message,
        "CachingAllocator option max_split_size_mb too small, must be >= 30"
    );
}

#[test]
fn backend() {
    let c = AllocatorConfig::parse("backend:cudaMallocAsync").unwrap();
    assert_eq!(c.backend, Backend::CudaMallocAsync);
    assert!(c.warnings.is_empty());
    let c =
        AllocatorConfig::parse("backend:cudaMallocAsync,release_lock_on_cudamalloc:True").unwrap();
    assert_eq!(c.warnings, [MALLOC_ASYNC_IGNORES_WARNING]);
    // 2.15.0's libc10_cuda.so text, missing space included.
    assert_eq!(
        MALLOC_ASYNC_IGNORES_WARNING,
        "backend:cudaMallocAsync ignores max_split_size_mb,roundup_power2_divisions, and garbage_collect_threshold."
    );
    assert_eq!(
        parse_err("backend:foo").message,
        "Unknown allocator backend, options are native and cudaMallocAsync"
    );
    // At run time the backend cannot change.
    let e = c.apply("backend:native").unwrap_err();
    assert_eq!(e.exception, PyException::RuntimeError);
    assert!(e.message.ends_with(
        "Allocator backend parsed at runtime != allocator backend parsed at load time, native != cudaMallocAsync"
    ));
}

#[test]
fn newest_keys_are_accepted() {
    let c = AllocatorConfig::parse(
        "pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:32,pinned_free_catch_all:True,\
         throw_on_cudamalloc_oom:False,pinned_reserve_segment_size_mb:8,graph_capture_record_stream_reuse:True,\
         expandable_segments_reserve_by_class:[a:0.5,b:2G],pinned_num_register_threads:8",
    )
    .unwrap();
    assert_eq!(c.pinned_max_round_threshold_mb, Some(64));
    assert_eq!(c.pinned_max_cached_size_mb, Some(32));
    assert!(c.pinned_free_catch_all && c.graph_capture_record_stream_reuse);
    assert_eq!(c.pinned_reserve_segment_size_mb, 8);
    assert_eq!(c.pinned_num_register_threads, 8);
    assert!(c
        .warnings
        .iter()
        .any(|w| w.contains("expandable_segments_reserve")));
}
