//! The `vramsim` binary end to end: reports, JSON fields, and a clear error (exit status 2, no panic)
//! for every kind of bad input.

mod common;
use common::{assert_fails, json, stderr, stdout, succeeds, vramsim};

use std::path::PathBuf;

/// Writes `text` to a fresh file in the target's temp dir and returns its path.
fn trace_file(name: &str, text: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn replay_json(path: &std::path::Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["replay", path.to_str().unwrap()];
    args.extend_from_slice(extra);
    json(&args)
}

#[test]
fn the_shipped_example_replays_to_a_table() {
    let output = succeeds(&[
        "replay",
        "examples/cs336-medium-train-step.jsonl",
        "--gpu",
        "rtx4090",
    ]);
    let table = stdout(&output);
    for label in [
        "allocated",
        "reserved",
        "device used",
        "fragmentation",
        "result",
    ] {
        assert!(table.contains(label), "table lacks {label}:\n{table}");
    }
}

#[test]
fn three_8_mib_requests_reserve_two_segments() {
    // §13 derived case: 8 MiB → a 20 MiB segment split 8 + 12; the second reuses it (8 + 4); the third
    // needs a new 20 MiB segment. Allocated 24 MiB, reserved 40 MiB.
    let path = trace_file(
        "three8.jsonl",
        "{\"op\":\"alloc\",\"id\":1,\"size\":8388608}\n\
         {\"op\":\"alloc\",\"id\":2,\"size\":8388608}\n\
         {\"op\":\"alloc\",\"id\":3,\"size\":8388608}\n",
    );
    let json = replay_json(&path, &[]);
    assert_eq!(json["peak_allocated_bytes"], 3 * 8 * 1048576u64);
    assert_eq!(json["peak_reserved_bytes"], 40 * 1048576u64);
    assert_eq!(json["stats"]["segment.all.current"], 2);
    assert_eq!(
        json["stats"]["inactive_split_bytes.all.current"],
        16 * 1048576u64
    );
    assert_eq!(
        json["peak_device_used_bytes"],
        json["peak_reserved_bytes"].as_u64().unwrap()
            + json["device"]["context_bytes"].as_u64().unwrap()
    );
    assert!(json["oom"].is_null());
}

#[test]
fn an_oom_stops_the_replay_at_the_failing_event_with_pytorchs_message() {
    // 1 GiB device, no context: 600 MiB fits, a second 600 MiB does not (§6).
    let path = trace_file(
        "oom.jsonl",
        "{\"op\":\"phase\",\"name\":\"forward\"}\n\
         {\"op\":\"alloc\",\"id\":\"a\",\"size\":629145600}\n\
         {\"op\":\"alloc\",\"id\":\"b\",\"size\":629145600}\n\
         {\"op\":\"free\",\"id\":\"a\"}\n",
    );
    let json = replay_json(&path, &["--capacity", "1GiB", "--context", "0"]);
    assert_eq!(json["fits"], false);
    assert_eq!(json["oom"]["event_index"], 2);
    let message = json["oom"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("CUDA out of memory. Tried to allocate 600.00 MiB. GPU 0 has a total capacity of 1024.00 MiB of which 424.00 MiB is free."),
        "{message}"
    );
    assert_eq!(json["events"], 3, "the replay stops at the OOM");
    assert_eq!(json["stats"]["num_ooms"], 1);
}

#[test]
fn requests_of_an_exbibyte_get_pytorchs_1eb_message() {
    let path = trace_file(
        "huge.jsonl",
        "{\"op\":\"alloc\",\"id\":1,\"size\":1152921504606846976}\n",
    );
    let json = replay_json(&path, &[]);
    assert_eq!(
        json["oom"]["message"],
        "CUDA out of memory. Tried to allocate more than 1EB memory."
    );
    assert_eq!(json["stats"]["num_ooms"], 0, "no stats are touched (§3)");
}

#[test]
fn summary_and_plot_are_produced() {
    let path = trace_file(
        "small.jsonl",
        "{\"op\":\"alloc\",\"id\":1,\"size\":1024}\n{\"op\":\"free\",\"id\":1}\n",
    );
    let plot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli/small.svg");
    let output = succeeds(&[
        "replay",
        path.to_str().unwrap(),
        "--summary",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert!(stdout(&output).contains("PyTorch CUDA memory summary, device ID 0"));
    assert!(std::fs::read_to_string(&plot).unwrap().contains("<svg"));
}

#[test]
fn bad_traces_are_named_with_their_line_or_event() {
    let cases: &[(&str, &str, &[&str])] = &[
        ("malformed.jsonl", "{\"op\":\"alloc\",\"id\":1,\"size\":512}\n{\"op\":\"free\",\n", &["malformed.jsonl", "2"]),
        ("unknown_op.jsonl", "{\"op\":\"allocate\",\"id\":1,\"size\":5}\n", &["allocate", "record_stream"]),
        ("double_free.jsonl", "{\"op\":\"alloc\",\"id\":1,\"size\":5}\n{\"op\":\"free\",\"id\":1}\n{\"op\":\"free\",\"id\":1}\n", &["event 2", "free of id 1", "not a live allocation"]),
        ("unknown_id.jsonl", "{\"op\":\"free\",\"id\":\"x\"}\n", &["event 0", "\"x\""]),
        ("duplicate.jsonl", "{\"op\":\"alloc\",\"id\":7,\"size\":5}\n{\"op\":\"alloc\",\"id\":7,\"size\":5}\n", &["event 1", "already live"]),
        ("negative.jsonl", "{\"op\":\"alloc\",\"id\":1,\"size\":-5}\n", &["size", "negative"]),
        ("fractional.jsonl", "{\"op\":\"alloc\",\"id\":1,\"size\":1.5}\n", &["size", "integer"]),
        ("overflow.jsonl", "{\"op\":\"alloc\",\"id\":1,\"size\":18446744073709551616}\n", &["size"]),
        ("empty.jsonl", "", &["empty"]),
        ("truncated.json", "{\"format\":\"vramsim-trace\",\"version\":1,\"events\":[{\"op\":\"alloc\",\"id\":1,", &["truncated.json"]),
    ];
    for (name, text, fragments) in cases {
        let path = trace_file(name, text);
        assert_fails(&["replay", path.to_str().unwrap()], fragments);
    }
    assert_fails(&["replay", "no/such/trace.jsonl"], &["no/such/trace.jsonl"]);
}

#[test]
fn bad_options_say_what_is_valid() {
    let path = trace_file("ok.jsonl", "{\"op\":\"alloc\",\"id\":1,\"size\":5}\n");
    let trace = path.to_str().unwrap();
    // PyTorch's own parser message (§12).
    assert_fails(
        &[
            "replay",
            trace,
            "--alloc-conf",
            "garbage_collection_threshold:1.2",
        ],
        &["garbage_collect_threshold is invalid"],
    );
    assert_fails(
        &["replay", trace, "--gpu", "h1000"],
        &["h1000", "h100-80gb", "rtx4090"],
    );
    assert_fails(&["replay", trace, "--capacity", "lots"], &["--capacity"]);
    assert_fails(
        &["replay", trace, "--memory-fraction", "1.5"],
        &["Invalid fraction value"],
    );
    assert_fails(
        &["replay", trace, "--capacity", "1GiB", "--context", "2GiB"],
        &["exceed"],
    );
    // clap's own message for an unknown allocator lists the valid ones.
    let output = vramsim(&["replay", trace, "--allocator", "bfc"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr(&output).contains("pytorch") && stderr(&output).contains("cuda-malloc"));
}

#[test]
fn other_processes_are_named_in_the_oom_message() {
    // 1 GiB device, 512 MiB held by process 4242: a 600 MiB request cannot fit.
    let path = trace_file(
        "others.jsonl",
        "{\"op\":\"alloc\",\"id\":1,\"size\":629145600}\n",
    );
    let json = replay_json(
        &path,
        &[
            "--capacity",
            "1GiB",
            "--context",
            "0",
            "--other-processes",
            "4242=512MiB",
        ],
    );
    let message = json["oom"]["message"].as_str().unwrap();
    assert!(
        message.contains("of which 512.00 MiB is free. Including non-PyTorch memory, this process has 0 bytes memory in use. Process 4242 has 512.00 MiB memory in use."),
        "{message}"
    );
}
