//! Round trip: a trace replayed and exported as a PyTorch snapshot (`vramsim_sim::export`), written as a
//! pickle, read back, imported (`vramsim_sim::import`) and replayed again under the snapshot's own
//! `allocator_settings`, gives the same statistics, the same final segments and the same history.
//!
//! History was recorded from the first event, so the import starts from an empty allocator, and the
//! simulated allocator is deterministic: nothing may differ but `time_us` (the importer drops time;
//! deferred frees become explicit synthetic streams, which move the host clock differently).

use std::io::Cursor;

use vramsim_sim::allocator::caching::CachingAllocator;
use vramsim_sim::allocator::Allocator;
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::Device;
use vramsim_sim::engine::{Flow, Replay, ReplayOptions, ReplayOutcome};
use vramsim_sim::export::{snapshot_of, ExportOptions};
use vramsim_sim::import::{import_device, ImportOptions};
use vramsim_traces::snapshot::Snapshot;
use vramsim_traces::{Event, TraceError};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn replay_and_export<I>(
    events: I,
    config: &AllocatorConfig,
    capacity: u64,
) -> (ReplayOutcome, Snapshot)
where
    I: IntoIterator<Item = Result<Event, TraceError>>,
{
    let mut allocator = CachingAllocator::new(config.clone(), Device::with_capacity(capacity));
    allocator.set_record_history(true);
    let mut replay = Replay::new(allocator, &ReplayOptions::default());
    for event in events {
        if replay.apply(event.unwrap()).unwrap() == Flow::Stopped {
            break;
        }
    }
    let (outcome, mut allocator) = replay.into_parts();
    let snapshot = snapshot_of(&mut allocator, config, &ExportOptions::default());
    (outcome, snapshot)
}

/// The snapshot without its times, which the importer drops by design.
fn timeless(mut snapshot: Snapshot) -> Snapshot {
    for trace in &mut snapshot.device_traces {
        for entry in trace {
            entry.time_us = None;
        }
    }
    snapshot
}

/// export → pickle → read → import → replay, and the comparison.
fn round_trip(name: &str, events: Vec<Result<Event, TraceError>>, alloc_conf: &str, capacity: u64) {
    let config = AllocatorConfig::parse(alloc_conf).unwrap();
    let (first, exported) = replay_and_export(events, &config, capacity);

    let read = Snapshot::from_bytes(&exported.to_pickle()).unwrap();
    assert_eq!(read, exported, "{name}: the pickle reads back");
    let imported = import_device(&read, 0, &ImportOptions::from_snapshot(&read)).unwrap();
    let settings = read.allocator_settings.as_ref().unwrap();
    let config2 =
        AllocatorConfig::parse(settings.pytorch_cuda_alloc_conf.as_deref().unwrap()).unwrap();
    assert_eq!(config2, config, "{name}: the settings string round-trips");
    let (second, reexported) = replay_and_export(
        imported.trace.events.into_iter().map(Ok),
        &config2,
        capacity,
    );

    assert_eq!(
        second.stats, first.stats,
        "{name}: the imported trace replays to the same memory_stats"
    );
    assert_eq!(second.oom.is_some(), first.oom.is_some(), "{name}: OOM");
    assert_eq!(
        reexported.segments, exported.segments,
        "{name}: the same final segments"
    );
    assert_eq!(
        timeless(reexported),
        timeless(exported),
        "{name}: the same history"
    );
}

fn jsonl(lines: &[&str]) -> Vec<Result<Event, TraceError>> {
    let text = lines.join("\n") + "\n";
    vramsim_traces::open_events_from(Cursor::new(text.into_bytes()))
        .unwrap()
        .collect()
}

#[test]
fn three_8_mib_requests_and_frees() {
    round_trip(
        "three8",
        jsonl(&[
            r#"{"op":"alloc","id":1,"size":8388508}"#,
            r#"{"op":"alloc","id":2,"size":8388508}"#,
            r#"{"op":"alloc","id":3,"size":8388508}"#,
            r#"{"op":"free","id":2}"#,
            r#"{"op":"alloc","id":4,"size":500}"#,
            r#"{"op":"free","id":1}"#,
        ]),
        "",
        80 * GIB,
    );
}

#[test]
fn record_stream_deferred_frees_and_empty_cache() {
    round_trip(
        "deferred",
        jsonl(&[
            r#"{"op":"alloc","id":1,"size":8388508}"#,
            r#"{"op":"alloc","id":2,"size":8388508}"#,
            r#"{"op":"alloc","id":3,"size":3000000,"stream":3}"#,
            r#"{"op":"record_stream","id":2,"stream":1}"#,
            r#"{"op":"compute","stream":1,"us":250}"#,
            r#"{"op":"free","id":2}"#,
            r#"{"op":"free","id":1}"#,
            r#"{"op":"sync"}"#,
            r#"{"op":"alloc","id":4,"size":700}"#,
            r#"{"op":"free","id":3}"#,
            r#"{"op":"empty_cache"}"#,
            r#"{"op":"alloc","id":5,"size":12000000}"#,
        ]),
        "",
        80 * GIB,
    );
}

#[test]
fn an_oom() {
    let mib30 = (30 * MIB - 1000).to_string();
    let alloc = |id: u32| format!(r#"{{"op":"alloc","id":{id},"size":{mib30}}}"#);
    let lines = [alloc(1), alloc(2), alloc(3)];
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    round_trip("oom", jsonl(&lines), "", 64 * MIB);
}

#[test]
fn expandable_segments() {
    round_trip(
        "expandable",
        jsonl(&[
            r#"{"op":"alloc","id":1,"size":8388508}"#,
            r#"{"op":"alloc","id":2,"size":8388508}"#,
            r#"{"op":"alloc","id":3,"size":8388508}"#,
            r#"{"op":"alloc","id":4,"size":1000}"#,
            r#"{"op":"free","id":3}"#,
            r#"{"op":"free","id":1}"#,
            r#"{"op":"alloc","id":5,"size":30000000}"#,
        ]),
        "expandable_segments:True",
        80 * GIB,
    );
}

/// `empty_cache` unmaps the free 20 MiB page; the next 8 MiB request maps it again. The released page
/// could have served that request, so a `malloc` would not have released it: the importer must read the
/// run as the program's `empty_cache`. Taking it for the allocator's own last-resort release would drop
/// the `empty_cache` and keep the page mapped, and reserved_bytes.allocated, num_device_free and
/// num_sync_all_streams would differ.
#[test]
fn expandable_segments_empty_cache() {
    round_trip(
        "expandable_empty_cache",
        jsonl(&[
            r#"{"op":"alloc","id":1,"size":8388508}"#,
            r#"{"op":"alloc","id":2,"size":8388508}"#,
            r#"{"op":"alloc","id":3,"size":8388508}"#,
            r#"{"op":"alloc","id":4,"size":1000}"#,
            r#"{"op":"free","id":3}"#,
            r#"{"op":"empty_cache"}"#,
            r#"{"op":"alloc","id":5,"size":8388508}"#,
        ]),
        "expandable_segments:True",
        80 * GIB,
    );
}

#[test]
fn the_shipped_example() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/cs336-medium-train-step.jsonl"
    );
    let events = vramsim_traces::open_events(path).unwrap().collect();
    round_trip("example", events, "", 24 * GIB);
}
