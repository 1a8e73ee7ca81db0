//! `--allocator tf-bfc` and `--allocator jax` end to end: the reservation with and without growth,
//! the frameworks' default memory limits, their environment variables, and bad input.

use std::path::PathBuf;
use std::process::{Command, Output};

const EXAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/cs336-medium-train-step.jsonl"
);
const MIB: u64 = 1 << 20;

fn vramsim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vramsim"))
        .args(args)
        .output()
        .expect("the vramsim binary runs")
}

fn replay(extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["replay", EXAMPLE, "--gpu", "rtx4090", "--json"];
    args.extend_from_slice(extra);
    let output = vramsim(&args);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

fn u(json: &serde_json::Value, key: &str) -> u64 {
    json[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} in {json}"))
}

fn fails(args: &[&str], fragments: &[&str]) {
    let output = vramsim(args);
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("error: ") && !err.contains("panicked"),
        "{err}"
    );
    for f in fragments {
        assert!(err.contains(f), "{f:?} not in {err}");
    }
}

/// The largest multiple of 256 not above `bytes` (`Extend` rounds the available bytes down).
fn floor256(bytes: u64) -> u64 {
    bytes / 256 * 256
}

#[test]
fn tensorflow_preallocates_unless_memory_growth_is_set() {
    let pre = replay(&["--allocator", "tf-bfc"]);
    let device = &pre["device"];
    let free = u(device, "total_memory_bytes") - u(device, "context_bytes");
    // RTX 4090: compute capability 8.9, so MinSystemMemory keeps 1536 MiB; one region of the rest
    assert_eq!(u(&pre, "peak_reserved_bytes"), floor256(free - 1536 * MIB));
    assert_eq!(u(&pre, "device_allocations"), 1);
    assert_eq!(pre["allocator"], "tf-bfc");

    let grown = replay(&["--allocator", "tf-bfc", "--allow-growth"]);
    let reserved = u(&grown, "peak_reserved_bytes");
    assert!(reserved < u(&pre, "peak_reserved_bytes") / 2, "{reserved}");
    assert!(reserved >= u(&grown, "peak_allocated_bytes"));
    assert!(u(&grown, "device_allocations") > 1);
    // TF_FORCE_GPU_ALLOW_GROWTH=true is the same setting
    let forced = replay(&[
        "--allocator",
        "tf-bfc",
        "--env",
        "TF_FORCE_GPU_ALLOW_GROWTH=true",
    ]);
    assert_eq!(u(&forced, "peak_reserved_bytes"), reserved);
    // per_process_gpu_memory_fraction: that share of the total
    let half = replay(&["--allocator", "tf-bfc", "--memory-fraction", "0.5"]);
    assert_eq!(
        u(&half, "peak_reserved_bytes"),
        floor256(u(device, "total_memory_bytes") / 2)
    );
    // a logical device's memory_limit
    let limited = replay(&["--allocator", "tf-bfc", "--memory-limit", "10GiB"]);
    assert_eq!(u(&limited, "peak_reserved_bytes"), 10 << 30);
}

#[test]
fn get_memory_info_counts_whole_chunks() {
    // 4 bytes and 1000 bytes are chunks of 256 and 1024 bytes (RoundedBytes); the first is freed
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join("tf_small.jsonl");
    std::fs::write(
        &path,
        concat!(
            "{\"format\":\"vramsim-trace\",\"version\":1,\"meta\":{}}\n",
            "{\"op\":\"alloc\",\"id\":1,\"size\":4}\n",
            "{\"op\":\"alloc\",\"id\":2,\"size\":1000}\n",
            "{\"op\":\"free\",\"id\":1}\n"
        ),
    )
    .unwrap();
    let output = vramsim(&[
        "replay",
        path.to_str().unwrap(),
        "--allocator",
        "tf-bfc",
        "--json",
    ]);
    assert!(output.status.success());
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        json["get_memory_info"],
        serde_json::json!({"current": 1024, "peak": 1280})
    );
    let output = vramsim(&[
        "replay",
        path.to_str().unwrap(),
        "--allocator",
        "jax",
        "--json",
    ]);
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json["memory_stats"]["peak_bytes_in_use"], 1280);
}

#[test]
fn tensorflow_oom_under_a_small_memory_limit() {
    let json = replay(&["--allocator", "tf-bfc", "--memory-limit", "2GiB"]);
    assert_eq!(json["fits"], false);
    let message = json["oom"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("ResourceExhaustedError: OOM when allocating tensor with shape["),
        "{message}"
    );
    assert!(message.ends_with("by allocator GPU_0_bfc"), "{message}");
}

#[test]
fn jax_preallocates_three_quarters_of_the_total() {
    let json = replay(&["--allocator", "jax"]);
    let total = u(&json["device"], "total_memory_bytes");
    assert_eq!(
        u(&json, "peak_reserved_bytes"),
        floor256((total as f64 * 0.75) as u64)
    );
    let half = replay(&[
        "--allocator",
        "jax",
        "--env",
        "XLA_PYTHON_CLIENT_MEM_FRACTION=.5",
    ]);
    assert_eq!(u(&half, "peak_reserved_bytes"), floor256(total / 2));
    let grown = replay(&[
        "--allocator",
        "jax",
        "--env",
        "XLA_PYTHON_CLIENT_PREALLOCATE=false",
    ]);
    assert!(u(&grown, "peak_reserved_bytes") < u(&json, "peak_reserved_bytes") / 2);
    // platform: no caching, reserved = allocated requests
    let platform = replay(&[
        "--allocator",
        "jax",
        "--env",
        "XLA_PYTHON_CLIENT_ALLOCATOR=platform",
    ]);
    assert_eq!(
        u(&platform, "peak_reserved_bytes"),
        u(&platform, "peak_allocated_bytes")
    );
}

#[test]
fn tensorflow_cuda_malloc_async_replaces_bfc() {
    let json = replay(&[
        "--allocator",
        "tf-bfc",
        "--env",
        "TF_GPU_ALLOCATOR=cuda_malloc_async",
    ]);
    // the stream-ordered pool reserves what it hands out (in pages), far below BFC's preallocation
    let pre = replay(&["--allocator", "tf-bfc"]);
    assert!(u(&json, "peak_reserved_bytes") < u(&pre, "peak_reserved_bytes") / 2);
}

#[test]
fn pytorch_settings_are_refused_with_the_other_frameworks() {
    fails(
        &[
            "replay",
            EXAMPLE,
            "--allocator",
            "tf-bfc",
            "--alloc-conf",
            "expandable_segments:True",
        ],
        &["--alloc-conf \"expandable_segments:True\"", "tf-bfc"],
    );
    fails(
        &[
            "replay",
            EXAMPLE,
            "--allocator",
            "jax",
            "--alloc-conf",
            "max_split_size_mb:128",
        ],
        &["--alloc-conf", "jax"],
    );
    fails(
        &["replay", EXAMPLE, "--allow-growth"],
        &["--allocator tf-bfc"],
    );
    fails(
        &["replay", EXAMPLE, "--allocator", "jax", "--env", "FOO=1"],
        &["FOO=1", "XLA_PYTHON_CLIENT_PREALLOCATE"],
    );
    fails(
        &[
            "replay",
            EXAMPLE,
            "--allocator",
            "tf-bfc",
            "--env",
            "TF_GPU_ALLOCATOR=magic",
        ],
        &["cuda_malloc_async"],
    );
    fails(
        &[
            "replay",
            EXAMPLE,
            "--allocator",
            "tf-bfc",
            "--env",
            "XLA_PYTHON_CLIENT_PREALLOCATE=false",
        ],
        &["JAX setting"],
    );
}
