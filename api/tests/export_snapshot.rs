//! `vramsim_sim::export`: a replay exported as the snapshot `torch.cuda.memory._snapshot()` would have
//! returned. Expected values come from PyTorch's rules (rounding §1, segment sizes §1.4, splitting §3.2,
//! deferred frees §4, trace actions §10.2) and from real snapshots' `allocator_settings`, not from
//! vramsim's output; the last tests check the §8.4 sums and the trace against a real workload's replay.

use std::io::Cursor;
use std::path::{Path, PathBuf};

use vramsim_sim::allocator::caching::CachingAllocator;
use vramsim_sim::allocator::Allocator;
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::Device;
use vramsim_sim::engine::{Flow, Replay, ReplayOptions, ReplayOutcome};
use vramsim_sim::export::{allocator_settings, snapshot_of, ExportOptions};
use vramsim_traces::snapshot::{
    load_snapshot_file, write_snapshot_file, Action, Block, BlockState, Segment, SegmentType,
    Snapshot, TraceEntry,
};
use vramsim_traces::Event;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// 8 MiB − 100: rounded up to a multiple of 512 it is 8 MiB (§1.2), so each block shows 100 bytes of
/// rounding between `size` and `requested_size`.
const REQ: u64 = 8 * MIB - 100;

/// Replays a JSON Lines trace with history recorded from the first event, as `replay --snapshot-out`
/// does, and exports the result.
fn export(trace: &str, alloc_conf: &str, capacity: u64) -> (ReplayOutcome, Snapshot) {
    let events = vramsim_traces::open_events_from(Cursor::new(trace.as_bytes().to_vec())).unwrap();
    replay_and_export(events, alloc_conf, capacity)
}

fn replay_and_export<I>(events: I, alloc_conf: &str, capacity: u64) -> (ReplayOutcome, Snapshot)
where
    I: IntoIterator<Item = Result<Event, vramsim_traces::TraceError>>,
{
    let config = AllocatorConfig::parse(alloc_conf).unwrap();
    let mut allocator = CachingAllocator::new(config.clone(), Device::with_capacity(capacity));
    allocator.set_record_history(true);
    let mut replay = Replay::new(allocator, &ReplayOptions::default());
    for event in events {
        if replay.apply(event.unwrap()).unwrap() == Flow::Stopped {
            break;
        }
    }
    let (outcome, mut allocator) = replay.into_parts();
    let snapshot = snapshot_of(&mut allocator, &config, &ExportOptions::default());
    assert!(allocator.take_history().is_empty(), "the history was taken");
    (outcome, snapshot)
}

fn alloc(id: u32, size: u64) -> String {
    format!("{{\"op\":\"alloc\",\"id\":{id},\"size\":{size}}}\n")
}

fn line(json: &str) -> String {
    format!("{json}\n")
}

/// A trace entry as PyTorch 2.9+ records it on the default stream (no stacks, outside torch.compile).
fn entry(action: Action, addr: u64, size: u64, time_us: i64) -> TraceEntry {
    TraceEntry {
        action,
        addr,
        size,
        stream: 0,
        time_us: Some(time_us),
        compile_context: Some("N/A".to_string()),
        user_metadata: Some(String::new()),
        extra: Vec::new(),
    }
}

fn block(address: u64, size: u64, requested_size: u64, state: BlockState) -> Block {
    Block {
        address,
        size,
        requested_size,
        state,
        extra: Vec::new(),
    }
}

/// A default-pool segment on device 0, stream 0, its sizes summed from its blocks.
fn segment(segment_type: SegmentType, blocks: Vec<Block>) -> Segment {
    let mut s = Segment {
        device: 0,
        address: blocks[0].address,
        total_size: 0,
        allocated_size: 0,
        active_size: 0,
        requested_size: 0,
        stream: 0,
        segment_type,
        segment_pool_id: (0, 0),
        is_expandable: false,
        blocks,
        extra: Vec::new(),
    };
    let sums = s.sums_from_blocks();
    s.total_size = sums.total_size;
    s.allocated_size = sums.allocated_size;
    s.active_size = sums.active_size;
    s.requested_size = sums.requested_size;
    s
}

/// The addresses of the trace's `segment_alloc` entries, in order.
fn segment_allocs(snapshot: &Snapshot) -> Vec<u64> {
    snapshot.device_traces[0]
        .iter()
        .filter(|e| e.action == Action::SegmentAlloc)
        .map(|e| e.addr)
        .collect()
}

#[test]
fn three_8_mib_requests_export_two_20_mib_segments_field_by_field() {
    // §1.4: a rounded 8 MiB request is < 10 MiB, so its segment is 20 MiB. §3.2: the 12 MiB tail is
    // split off (> 1 MiB remains). The second request takes 8 MiB of that tail, leaving 4 MiB; the
    // third finds no cached block of 8 MiB and gets a second 20 MiB segment.
    let trace = [alloc(1, REQ), alloc(2, REQ), alloc(3, REQ)].concat();
    let (_, snap) = export(&trace, "", 80 * GIB);
    let [a, b] = segment_allocs(&snap)[..] else {
        panic!(
            "two segment_alloc entries expected: {:?}",
            snap.device_traces
        )
    };
    assert!(
        a + 20 * MIB <= b,
        "segments do not overlap and come in address order"
    );
    let expected_segments = vec![
        segment(
            SegmentType::Large,
            vec![
                block(a, 8 * MIB, REQ, BlockState::ActiveAllocated),
                block(a + 8 * MIB, 8 * MIB, REQ, BlockState::ActiveAllocated),
                block(a + 16 * MIB, 4 * MIB, 0, BlockState::Inactive),
            ],
        ),
        segment(
            SegmentType::Large,
            vec![
                block(b, 8 * MIB, REQ, BlockState::ActiveAllocated),
                block(b + 8 * MIB, 12 * MIB, 0, BlockState::Inactive),
            ],
        ),
    ];
    assert_eq!(snap.segments, expected_segments);
    assert_eq!(
        (snap.segments[0].total_size, snap.segments[0].allocated_size),
        (20 * MIB, 16 * MIB)
    );
    assert_eq!(snap.segments[0].requested_size, 2 * REQ);
    assert_eq!(
        snap.device_traces,
        vec![vec![
            entry(Action::SegmentAlloc, a, 20 * MIB, 0),
            entry(Action::Alloc, a, REQ, 0),
            entry(Action::Alloc, a + 8 * MIB, REQ, 0),
            entry(Action::SegmentAlloc, b, 20 * MIB, 0),
            entry(Action::Alloc, b, REQ, 0),
        ]]
    );
    assert_eq!(snap.external_annotations, Some(Vec::new()));
    assert!(snap.extra.is_empty());
}

#[test]
fn frees_come_in_pairs_and_record_stream_leaves_a_pending_block_until_its_stream_is_done() {
    // b is used on stream 1, which has 250 µs of work queued when b is freed (§4.1): only
    // free_requested is recorded and b stays active_pending_free. a is freed at once: free_requested
    // then free_completed (§4.2; it cannot merge, b next to it is not free). After the sync, the next
    // malloc processes events (§4.3): free_completed for b, which merges a, b and the 4 MiB tail into
    // one 20 MiB inactive block. That malloc is small (500 B → 512 B, §1.2) and gets a 2 MiB segment of
    // the small pool (§1.4), split (§3.2).
    let trace = [
        alloc(1, REQ),
        alloc(2, REQ),
        alloc(3, REQ),
        line(r#"{"op":"record_stream","id":2,"stream":1}"#),
        line(r#"{"op":"compute","stream":1,"us":250}"#),
        line(r#"{"op":"free","id":2}"#),
        line(r#"{"op":"free","id":1}"#),
    ]
    .concat();

    // Before the sync: the pending state.
    let (_, pending) = export(&trace, "", 80 * GIB);
    let [a, b] = segment_allocs(&pending)[..] else {
        panic!("two segment_alloc entries expected")
    };
    assert_eq!(
        pending.segments[0],
        segment(
            SegmentType::Large,
            vec![
                block(a, 8 * MIB, 0, BlockState::Inactive),
                block(a + 8 * MIB, 8 * MIB, REQ, BlockState::ActivePendingFree),
                block(a + 16 * MIB, 4 * MIB, 0, BlockState::Inactive),
            ],
        )
    );
    assert_eq!(pending.segments[0].active_size, 8 * MIB);
    assert_eq!(pending.segments[0].allocated_size, 0);
    let tail: Vec<_> = pending.device_traces[0][5..].to_vec();
    assert_eq!(
        tail,
        vec![
            entry(Action::FreeRequested, a + 8 * MIB, REQ, 0),
            entry(Action::FreeRequested, a, REQ, 0),
            entry(Action::FreeCompleted, a, REQ, 0),
        ]
    );

    // After the sync and one more malloc: b's free completes at 250 µs.
    let trace = [trace, line(r#"{"op":"sync"}"#), alloc(4, 500)].concat();
    let (_, done) = export(&trace, "", 80 * GIB);
    let [a2, b2, s] = segment_allocs(&done)[..] else {
        panic!("three segment_alloc entries expected")
    };
    assert_eq!((a2, b2), (a, b), "replays are deterministic");
    assert_eq!(
        done.segments,
        vec![
            segment(
                SegmentType::Large,
                vec![block(a, 20 * MIB, 0, BlockState::Inactive)]
            ),
            segment(
                SegmentType::Large,
                vec![
                    block(b, 8 * MIB, REQ, BlockState::ActiveAllocated),
                    block(b + 8 * MIB, 12 * MIB, 0, BlockState::Inactive),
                ],
            ),
            segment(
                SegmentType::Small,
                vec![
                    block(s, 512, 500, BlockState::ActiveAllocated),
                    block(s + 512, 2 * MIB - 512, 0, BlockState::Inactive),
                ],
            ),
        ]
    );
    assert_eq!(
        done.device_traces[0][8..].to_vec(),
        vec![
            entry(Action::FreeCompleted, a + 8 * MIB, REQ, 250),
            entry(Action::SegmentAlloc, s, 2 * MIB, 250),
            entry(Action::Alloc, s, 500, 250),
        ]
    );
}

#[test]
fn an_oom_is_the_last_entry_with_device_free_and_the_rounded_size() {
    // 64 MiB device, no context: requests of 30 MiB − 1000 round to 30 MiB − 512 (§1.2) and, being
    // ≥ 10 MiB, get segments of that size rounded up to 2 MiB: 30 MiB (§1.4). Two leave 4 MiB free; the
    // third cannot get 30 MiB. Nothing is cached, so the release paths free nothing and the oom entry
    // follows (§6.1; §10.2: addr = device_free, size = the rounded request, not the segment size).
    let req = 30 * MIB - 1000;
    let trace = [alloc(1, req), alloc(2, req), alloc(3, req)].concat();
    let (outcome, snap) = export(&trace, "", 64 * MIB);
    assert!(outcome.oom.is_some());
    let trace = &snap.device_traces[0];
    let actions: Vec<&str> = trace.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(
        actions,
        ["segment_alloc", "alloc", "segment_alloc", "alloc", "oom"]
    );
    assert_eq!(trace[4], entry(Action::Oom, 4 * MIB, 30 * MIB - 512, 0));
    assert_eq!((trace[0].size, trace[1].size), (30 * MIB, req));
    // In the pickle the oom's address field is named device_free.
    let value = snap.to_value();
    let oom = &value.get("device_traces").unwrap().as_sequence().unwrap()[0]
        .as_sequence()
        .unwrap()[4];
    assert_eq!(
        oom.get("device_free").and_then(|v| v.as_int()),
        Some(4 * MIB as i64)
    );
    assert!(oom.get("addr").is_none());
    assert_eq!(snap.segments.len(), 2);
}

#[test]
fn expandable_segments_export_mapped_ranges_and_map_entries() {
    // §7: with expandable_segments:True the pool grows by mapping pages; snapshots show each contiguous
    // mapped range as one segment with is_expandable, and the trace has segment_map, not segment_alloc.
    let trace = [
        alloc(1, REQ),
        alloc(2, REQ),
        alloc(3, REQ),
        line(r#"{"op":"free","id":3}"#),
        line(r#"{"op":"empty_cache"}"#),
    ]
    .concat();
    let (outcome, snap) = export(&trace, "expandable_segments:True", 80 * GIB);
    assert!(!snap.segments.is_empty());
    assert!(snap.segments.iter().all(|s| s.is_expandable));
    let trace = &snap.device_traces[0];
    assert!(trace.iter().all(|e| e.action != Action::SegmentAlloc));
    let mapped: u64 = trace
        .iter()
        .filter(|e| e.action == Action::SegmentMap)
        .map(|e| e.size)
        .sum();
    let unmapped: u64 = trace
        .iter()
        .filter(|e| e.action == Action::SegmentUnmap)
        .map(|e| e.size)
        .sum();
    assert!(mapped > 0);
    let reserved: u64 = snap.segments.iter().map(|s| s.total_size).sum();
    assert_eq!(mapped - unmapped, reserved);
    assert_eq!(
        reserved, outcome.stats.reserved_bytes.all.current as u64,
        "§8.4 reserved_bytes = Σ total_size"
    );
    let settings = snap.allocator_settings.unwrap();
    assert_eq!(settings.expandable_segments, Some(true));
    assert_eq!(
        settings.pytorch_cuda_alloc_conf.as_deref(),
        Some("expandable_segments:True")
    );
}

#[test]
fn allocator_settings_follow_the_settings_string() {
    let config = AllocatorConfig::parse(
        "max_split_size_mb:128,garbage_collection_threshold:0.6,roundup_power2_divisions:4",
    )
    .unwrap();
    let s = allocator_settings(&config);
    assert_eq!(
        s.pytorch_cuda_alloc_conf.as_deref(),
        Some("max_split_size_mb:128,garbage_collection_threshold:0.6,roundup_power2_divisions:4")
    );
    assert_eq!(s.max_split_size, Some(128 << 20));
    assert_eq!(s.garbage_collection_threshold, Some(0.6));
    assert_eq!(s.expandable_segments, Some(false));
    let divisions = s.roundup_power2_divisions.unwrap();
    assert_eq!(divisions.len(), 16);
    assert!(divisions
        .iter()
        .enumerate()
        .all(|(k, &(start, d))| start == 1 << k && d == 4));
}

const SNAPSHOTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/snapshots");

/// A real snapshot's `allocator_settings` (the test fails if the file is missing).
fn real_settings(prefix: &str) -> Option<vramsim_traces::snapshot::AllocatorSettings> {
    let dir = Path::new(SNAPSHOTS);
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| {
        panic!(
            "{} is missing ({e}): the test data is not there",
            dir.display()
        )
    });
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    files.sort();
    let file = files.first().unwrap_or_else(|| {
        panic!(
            "no {prefix}* snapshot in {}: the test data is not there",
            dir.display()
        )
    });
    let snap = load_snapshot_file(file).unwrap();
    snap.allocator_settings
}

#[test]
fn default_allocator_settings_are_those_of_real_pytorch_snapshots() {
    // Recorded with PyTorch 2.9+ (graph_capture_record_stream_reuse present), PYTORCH_CUDA_ALLOC_CONF
    // unset: vramsim's export for "" must be the same dict, value for value and in the same key order.
    let real = real_settings("Wedsonlin__assignment2-systems__results_medium_128_training")
        .expect("the snapshot records allocator_settings");
    let ours = allocator_settings(&AllocatorConfig::default());
    assert_eq!(ours, real);
    assert_eq!(ours.to_value(), real.to_value());

    // Recorded with expandable_segments:True by an older PyTorch (no graph_capture key).
    let mut real =
        real_settings("Constructor-Sun").expect("the snapshot records allocator_settings");
    let mut ours = allocator_settings(&AllocatorConfig::parse("expandable_segments:True").unwrap());
    assert_eq!(real.graph_capture_record_stream_reuse, None);
    ours.graph_capture_record_stream_reuse = None;
    real.extra.clear();
    assert_eq!(ours, real);
}

#[test]
fn the_shipped_example_exports_a_snapshot_consistent_with_its_replay() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/cs336-medium-train-step.jsonl"
    );
    let events = vramsim_traces::open_events(path).unwrap();
    let (outcome, snap) = replay_and_export(events, "", 24 * GIB);

    // What the file holds is what was exported (pickle writer and reader agree).
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("export_example.pickle.gz");
    write_snapshot_file(&file, &snap).unwrap();
    assert_eq!(load_snapshot_file(&file).unwrap(), snap);

    // §8.4: the final segments against the replay's statistics.
    let stats = &outcome.stats;
    let sum = |f: fn(&Segment) -> u64| snap.segments.iter().map(f).sum::<u64>() as i64;
    let blocks = || snap.segments.iter().flat_map(|s| s.blocks.iter());
    assert_eq!(stats.segment.all.current, snap.segments.len() as i64);
    assert_eq!(stats.reserved_bytes.all.current, sum(|s| s.total_size));
    assert_eq!(stats.allocated_bytes.all.current, sum(|s| s.allocated_size));
    assert_eq!(stats.active_bytes.all.current, sum(|s| s.active_size));
    assert_eq!(stats.requested_bytes.all.current, sum(|s| s.requested_size));
    let count = |state| blocks().filter(|b| b.state == state).count() as i64;
    assert_eq!(
        stats.allocation.all.current,
        count(BlockState::ActiveAllocated)
    );
    assert_eq!(
        stats.active.all.current,
        blocks().filter(|b| b.state.is_active()).count() as i64
    );
    let inactive_split = snap
        .segments
        .iter()
        .filter(|s| s.blocks.len() > 1)
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.state == BlockState::Inactive);
    assert_eq!(
        stats.inactive_split_bytes.all.current,
        inactive_split.map(|b| b.size).sum::<u64>() as i64
    );
    for s in &snap.segments {
        let sums = s.sums_from_blocks();
        assert_eq!(
            (
                sums.total_size,
                sums.allocated_size,
                sums.active_size,
                sums.requested_size
            ),
            (
                s.total_size,
                s.allocated_size,
                s.active_size,
                s.requested_size
            )
        );
        let small = s.segment_type == SegmentType::Small;
        assert_eq!(small, s.total_size == 2 * MIB, "§1.4 segment sizes by pool");
    }

    // The trace: one alloc per trace alloc (none of this trace's sizes is 0), one free_requested per
    // free, free_completed after its free_requested, each alloc inside a segment allocated before it.
    let trace = &snap.device_traces[0];
    let n = |a: Action| trace.iter().filter(|e| e.action == a).count() as u64;
    assert_eq!(n(Action::Alloc), outcome.allocs);
    assert_eq!(n(Action::FreeRequested), outcome.frees);
    assert_eq!(n(Action::SegmentAlloc), stats.num_device_alloc as u64);
    assert_eq!(n(Action::SegmentFree), stats.num_device_free as u64);
    let mut segments: Vec<(u64, u64)> = Vec::new();
    let mut requested = std::collections::HashSet::new();
    for (i, e) in trace.iter().enumerate() {
        match e.action {
            Action::SegmentAlloc => segments.push((e.addr, e.addr + e.size)),
            Action::SegmentFree => segments.retain(|&(start, _)| start != e.addr),
            Action::Alloc => assert!(
                segments.iter().any(|&(s, end)| s <= e.addr && e.addr < end),
                "entry {i}: alloc at {:#x} before its segment_alloc",
                e.addr
            ),
            Action::FreeRequested => assert!(requested.insert(e.addr)),
            Action::FreeCompleted => assert!(
                requested.remove(&e.addr),
                "entry {i}: free_completed without free_requested"
            ),
            _ => {}
        }
    }
    assert_eq!(segments.len(), snap.segments.len());
}

#[test]
fn replay_snapshot_out_writes_what_the_library_exports_and_fails_cleanly() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("export_cli");
    std::fs::create_dir_all(&dir).unwrap();
    let text = [
        alloc(1, REQ),
        alloc(2, 500),
        line(r#"{"op":"free","id":1}"#),
    ]
    .concat();
    let trace = dir.join("small.jsonl");
    std::fs::write(&trace, &text).unwrap();
    let (_, expected) = export(&text, "roundup_power2_divisions:4", 80 * GIB);
    let vramsim = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_vramsim"))
            .args(args)
            .output()
            .unwrap()
    };
    for name in ["small.pickle", "small.pickle.gz"] {
        let out = dir.join(name);
        let output = vramsim(&[
            "replay",
            trace.to_str().unwrap(),
            "--capacity",
            "80GiB",
            "--alloc-conf",
            "roundup_power2_divisions:4",
            "--snapshot-out",
            out.to_str().unwrap(),
        ]);
        assert!(output.status.success(), "{output:?}");
        assert!(String::from_utf8_lossy(&output.stdout).contains("snapshot   "));
        let bytes = std::fs::read(&out).unwrap();
        assert_eq!(bytes.starts_with(&[0x1f, 0x8b]), name.ends_with(".gz"));
        assert_eq!(load_snapshot_file(&out).unwrap(), expected, "{name}");
    }

    let output = vramsim(&[
        "replay",
        trace.to_str().unwrap(),
        "--snapshot-out",
        "/nonexistent-dir/x.pickle",
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with("error: cannot write the snapshot: /nonexistent-dir/x.pickle: "),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"));
}
