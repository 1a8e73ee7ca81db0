//! Importing PyTorch memory snapshots: the state recording began from, the inferences the importer makes
//! (block sizes, releases, deferred frees, capacity), bad input, and the 17 real snapshots of
//! `testdata/snapshots/` (a missing file fails the test).

use std::path::Path;
use std::time::Instant;

use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::import::{
    import_device, Capacity, DeviceImport, ImportError, ImportOptions, ReleaseCause,
};
use vramsim_sim::rounding::round_size;
use vramsim_traces::snapshot::{
    is_snapshot_file, load_snapshot_file, Action, AllocatorSettings, Block, BlockState, Segment,
    SegmentType, Snapshot, TraceEntry,
};
use vramsim_traces::{read_jsonl, write_jsonl, AllocId, Event, Pool};

const MIB: u64 = 1 << 20;
const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/snapshots");

fn entry(action: &str, addr: u64, size: u64) -> TraceEntry {
    TraceEntry {
        action: Action::from_name(action),
        addr,
        size,
        stream: 0,
        time_us: None,
        compile_context: None,
        user_metadata: None,
        extra: vec![],
    }
}

fn block(address: u64, size: u64, requested: u64, state: BlockState) -> Block {
    Block {
        address,
        size,
        requested_size: requested,
        state,
        extra: vec![],
    }
}

fn segment(address: u64, total_size: u64, blocks: Vec<Block>) -> Segment {
    let mut s = Segment {
        device: 0,
        address,
        total_size,
        allocated_size: 0,
        active_size: 0,
        requested_size: 0,
        stream: 0,
        segment_type: if total_size <= 2 * MIB {
            SegmentType::Small
        } else {
            SegmentType::Large
        },
        segment_pool_id: (0, 0),
        is_expandable: false,
        blocks,
        extra: vec![],
    };
    s.allocated_size = s.sums_from_blocks().allocated_size;
    s
}

fn snapshot(segments: Vec<Segment>, trace: Vec<TraceEntry>) -> Snapshot {
    Snapshot {
        segments,
        device_traces: vec![trace],
        allocator_settings: Some(AllocatorSettings::default()),
        external_annotations: None,
        extra: vec![],
    }
}

fn import(s: &Snapshot) -> DeviceImport {
    import_device(s, 0, &ImportOptions::from_snapshot(s)).unwrap()
}

/// The `segment` events of an import.
fn initial(s: &Snapshot) -> Vec<vramsim_traces::InitialSegment> {
    import(s)
        .trace
        .events
        .into_iter()
        .filter_map(|e| match e {
            Event::Segment(s) => Some(*s),
            _ => None,
        })
        .collect()
}

const SEG: u64 = 0x7f00_0000_0000;

#[test]
fn blocks_freed_before_their_allocation_was_recorded_get_inferred_sizes() {
    // A 20 MiB segment existed before recording began, with three blocks the history only frees.
    let trace = vec![
        // rule 3: 4 MiB rounded, 0.5 MiB to the next block: not split (§3.2), so 4.5 MiB
        entry("free_requested", SEG, 4 * MIB),
        entry("free_completed", SEG, 4 * MIB),
        // rule 3: 2 MiB rounded, 2.5 MiB left before the next block: split, 2 MiB
        entry("free_requested", SEG + 9 * MIB / 2, 2 * MIB),
        entry("free_completed", SEG + 9 * MIB / 2, 2 * MIB),
        // rule 1: the next allocation in the room behind it, while it lives, shows where it ends
        entry("alloc", SEG + 16 * MIB, 2 * MIB),
        entry("free_requested", SEG + 9 * MIB, 3 * MIB),
        entry("free_completed", SEG + 9 * MIB, 3 * MIB),
        entry("free_requested", SEG + 16 * MIB, 2 * MIB),
        entry("free_completed", SEG + 16 * MIB, 2 * MIB),
    ];
    let s = snapshot(
        vec![segment(
            SEG,
            20 * MIB,
            vec![block(SEG, 20 * MIB, 0, BlockState::Inactive)],
        )],
        trace,
    );
    let segs = initial(&s);
    assert_eq!(segs.len(), 1);
    let sizes: Vec<(u64, u64)> = segs[0].blocks.iter().map(|b| (b.offset, b.size)).collect();
    assert_eq!(
        sizes,
        [
            (0, 9 * MIB / 2),
            (9 * MIB / 2, 2 * MIB),
            (9 * MIB, 7 * MIB) // ends where the 16 MiB allocation begins
        ]
    );
    let rec = import(&s).recorded;
    assert_eq!(rec.initial.inferred_block_sizes, 3);
    assert_eq!(rec.initial.reserved, 20 * MIB);
    assert_eq!(rec.initial.allocated, (9 * MIB / 2) + 2 * MIB + 7 * MIB);
}

#[test]
fn small_pool_blocks_are_exactly_their_rounded_request() {
    let small = SEG + 64 * MIB;
    let s = snapshot(
        vec![segment(
            small,
            2 * MIB,
            vec![block(small, 2 * MIB, 0, BlockState::Inactive)],
        )],
        vec![
            entry("free_requested", small, 1000),
            entry("free_completed", small, 1000),
        ],
    );
    let segs = initial(&s);
    assert_eq!(segs[0].pool, Pool::Small);
    assert_eq!(
        (segs[0].blocks[0].size, segs[0].blocks[0].requested),
        (1024, 1000)
    );
    assert_eq!(round_size(1000, &AllocatorConfig::default()), 1024);
}

/// The importer sizes a block it sees only freed (here in an expandable segment, where the remainder is
/// always split off, §3.2) as the simulator's §1.2 `round_size` of its request, with and without
/// `roundup_power2_divisions`.
#[test]
fn the_importer_rounds_as_the_allocator_does() {
    for conf in [
        "",
        "roundup_power2_divisions:4",
        "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]",
    ] {
        let config = AllocatorConfig::parse(conf).unwrap();
        let options = ImportOptions {
            config: config.clone(),
        };
        let mut size = 1u64;
        while size < 1 << 36 {
            for s in [size - 1, size, size + 1, size * 3 / 2] {
                let mut reservation = segment(
                    SEG,
                    1 << 38,
                    vec![block(SEG, 1 << 38, 0, BlockState::Inactive)],
                );
                reservation.is_expandable = true;
                let snapshot = snapshot(
                    vec![reservation],
                    vec![
                        entry("free_requested", SEG, s.max(1)),
                        entry("free_completed", SEG, s.max(1)),
                    ],
                );
                let import = import_device(&snapshot, 0, &options).unwrap();
                let Event::Segment(segment) = &import.trace.events[0] else {
                    panic!("{conf:?} {s}: no initial segment")
                };
                assert_eq!(
                    segment.blocks[0].size,
                    round_size(s.max(1), &config),
                    "{conf:?} {s}"
                );
            }
            size = size * 2 + 7;
        }
    }
}

#[test]
fn segments_made_and_freed_during_recording_are_undone() {
    let (a, b) = (SEG, SEG + 100 * MIB);
    let s = snapshot(
        vec![segment(
            b,
            20 * MIB,
            vec![block(b, 20 * MIB, 5 * MIB, BlockState::ActiveAllocated)],
        )],
        vec![
            // `a` existed before: freed by an explicit empty_cache at the end
            entry("segment_alloc", b, 20 * MIB),
            entry("alloc", b, 5 * MIB),
            entry("segment_free", a, 40 * MIB),
        ],
    );
    let imp = import(&s);
    let segs = initial(&s);
    assert_eq!(segs.len(), 1);
    assert_eq!(
        (segs[0].addr, segs[0].size, segs[0].blocks.len()),
        (a, 40 * MIB, 0)
    );
    assert_eq!(imp.recorded.releases.len(), 1);
    assert_eq!(imp.recorded.releases[0].cause, ReleaseCause::EmptyCache);
    let ops: Vec<&str> = imp.trace.events.iter().map(Event::op).collect();
    assert_eq!(ops, ["segment", "alloc", "empty_cache"]);
    assert_eq!(imp.origins, [None, Some(1), Some(2)]);
}

#[test]
fn releases_inside_a_malloc_are_the_allocators() {
    // 60 MiB reserved, a 40 MiB request: the first cudaMalloc fails, 20 MiB are released, it fits.
    let (a, b, c) = (SEG, SEG + 100 * MIB, SEG + 200 * MIB);
    let s = snapshot(
        vec![
            segment(
                a,
                40 * MIB,
                vec![block(a, 40 * MIB, 40 * MIB, BlockState::ActiveAllocated)],
            ),
            segment(
                c,
                40 * MIB,
                vec![block(c, 40 * MIB, 40 * MIB, BlockState::ActiveAllocated)],
            ),
        ],
        vec![
            entry("segment_free", b, 20 * MIB),
            entry("segment_alloc", c, 40 * MIB),
            entry("alloc", c, 40 * MIB),
            // later a request that does not fit even after releasing: out of memory
            entry("oom", 4 * MIB, 100 * MIB),
        ],
    );
    let imp = import(&s);
    assert_eq!(imp.recorded.releases[0].cause, ReleaseCause::Allocator);
    let ops: Vec<&str> = imp.trace.events.iter().map(Event::op).collect();
    assert_eq!(ops, ["segment", "segment", "alloc", "alloc"]);
    assert_eq!(
        imp.trace.events[3],
        Event::Alloc {
            id: AllocId::from("oom@3"),
            size: 100 * MIB,
            stream: 0,
            category: Default::default(),
            tag: None
        }
    );
    assert_eq!(
        imp.recorded.capacity,
        Capacity::Oom {
            usable: 84 * MIB,
            entry: 3,
            device_free: 4 * MIB,
            reserved: 80 * MIB
        }
    );
}

#[test]
fn a_release_that_leaves_room_is_an_empty_cache() {
    // 120 MiB reserved at the start; an empty_cache frees 60 MiB, a later one 20 MiB before a request
    // for a new 40 MiB segment: 60 + 40 MiB fits where 120 MiB once did, so nothing forced it.
    let (a, b, c, e) = (SEG, SEG + 100 * MIB, SEG + 200 * MIB, SEG + 300 * MIB);
    let s = snapshot(
        vec![
            segment(
                a,
                40 * MIB,
                vec![block(a, 40 * MIB, 40 * MIB, BlockState::ActiveAllocated)],
            ),
            segment(
                c,
                40 * MIB,
                vec![block(c, 40 * MIB, 40 * MIB, BlockState::ActiveAllocated)],
            ),
        ],
        vec![
            entry("segment_free", e, 60 * MIB),
            entry("alloc", a + 30 * MIB, 5 * MIB),
            entry("free_requested", a + 30 * MIB, 5 * MIB),
            entry("free_completed", a + 30 * MIB, 5 * MIB),
            entry("segment_free", b, 20 * MIB),
            entry("segment_alloc", c, 40 * MIB),
            entry("alloc", c, 40 * MIB),
        ],
    );
    let imp = import(&s);
    assert_eq!(imp.recorded.peak_reserved, 120 * MIB);
    let causes: Vec<_> = imp.recorded.releases.iter().map(|r| r.cause).collect();
    assert_eq!(causes, [ReleaseCause::EmptyCache, ReleaseCause::EmptyCache]);
    assert!(
        imp.recorded.releases[1].reason.contains("fitted"),
        "{}",
        imp.recorded.releases[1].reason
    );
    assert_eq!(
        imp.recorded.capacity,
        Capacity::AtLeast { bytes: 120 * MIB }
    );
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let s = snapshot(vec![], vec![]);
    assert_eq!(s.devices(), [0]);
    let err = import_device(&s, 3, &ImportOptions::default()).unwrap_err();
    assert_eq!(
        err,
        ImportError::NoSuchDevice {
            device: 3,
            present: vec![0]
        }
    );
    assert_eq!(
        err.to_string(),
        "the snapshot has no device 3: it holds device 0"
    );
    // a state-only snapshot: its segments, no history
    let state_only = Snapshot {
        device_traces: vec![],
        ..snapshot(
            vec![segment(
                SEG,
                2 * MIB,
                vec![block(SEG, 512, 100, BlockState::ActiveAllocated)],
            )],
            vec![],
        )
    };
    let imp = import(&state_only);
    assert_eq!(imp.recorded.entries, 0);
    assert_eq!(imp.trace.events.len(), 1);
    // a history that contradicts itself: noted, replayable
    let s = snapshot(
        vec![],
        vec![
            entry("free_requested", SEG, 512),
            entry("alloc", SEG + MIB, 512),
            entry("alloc", SEG + MIB, 512),
        ],
    );
    let imp = import(&s);
    assert!(!imp.recorded.notes.is_empty());
    let no_devices = Snapshot {
        device_traces: vec![],
        ..snapshot(vec![], vec![])
    };
    assert_eq!(
        import_device(&no_devices, 0, &ImportOptions::default())
            .unwrap_err()
            .to_string(),
        "the snapshot holds no device (no segments and no history), so there is no device 0"
    );
}

/// What each real snapshot's import says, checked against sums taken from the snapshot directly.
#[test]
fn real_snapshots_import_to_replayable_traces() {
    let files = std::fs::read_dir(DIR)
        .unwrap_or_else(|e| panic!("{DIR} is missing ({e}): the test data is not there"));
    let mut paths: Vec<_> = files
        .filter_map(|f| f.ok().map(|f| f.path()))
        .filter(|p| p.to_string_lossy().ends_with(".pickle.gz"))
        .collect();
    paths.sort();
    assert_eq!(paths.len(), 17);
    for path in &paths {
        let snapshot = load_snapshot_file(path).unwrap();
        assert!(is_snapshot_file(path).unwrap());
        for device in snapshot.devices() {
            let imp =
                import_device(&snapshot, device, &ImportOptions::from_snapshot(&snapshot)).unwrap();
            let name = path.file_name().unwrap().to_string_lossy();
            assert!(
                imp.recorded.notes.is_empty(),
                "{name}: {:?}",
                imp.recorded.notes
            );
            // reserved at the start = at the end, less what the history added, plus what it released
            let trace = &snapshot.device_traces[device as usize];
            let (mut added, mut released) = (0, 0);
            for e in trace {
                match e.action {
                    Action::SegmentAlloc | Action::SegmentMap => added += e.size,
                    Action::SegmentFree | Action::SegmentUnmap => released += e.size,
                    _ => {}
                }
            }
            let final_reserved: u64 = snapshot
                .segments
                .iter()
                .filter(|s| s.device == device)
                .map(|s| s.total_size)
                .sum();
            assert_eq!(
                imp.recorded.initial.reserved,
                final_reserved + released - added,
                "{name}"
            );
            // one event per recorded alloc and free, plus the initial segments and inferred calls
            let allocs = trace.iter().filter(|e| e.action == Action::Alloc).count();
            let count = |op| imp.trace.events.iter().filter(|e| e.op() == op).count();
            assert_eq!(count("alloc"), allocs + imp.recorded.ooms.len(), "{name}");
            assert_eq!(count("segment"), imp.recorded.initial.segments, "{name}");
            // the trace survives its own file format
            let mut text = Vec::new();
            write_jsonl(&mut text, &imp.trace).unwrap();
            assert_eq!(read_jsonl(text.as_slice()).unwrap(), imp.trace, "{name}");
        }
    }
}

/// Import of the largest shipped snapshot (about 4 MB of pickle, 22,000 entries); the 200 ms target
/// applies to release builds (`cargo test --release -p vramsim-sim --test import_snapshots -- --nocapture`).
#[test]
fn time_to_import_the_largest_snapshot() {
    let path = Path::new(DIR).join(
        "Wedsonlin__assignment2-systems__results_medium_512_training_memory_snapshot.pickle__61dcd14d.pickle.gz",
    );
    assert!(
        path.exists(),
        "{} is missing: the test data is not there",
        path.display()
    );
    let started = Instant::now();
    let snapshot = load_snapshot_file(&path).unwrap();
    let loaded = started.elapsed();
    let imp = import_device(&snapshot, 0, &ImportOptions::from_snapshot(&snapshot)).unwrap();
    let total = started.elapsed();
    assert_eq!(imp.recorded.entries, 22332);
    eprintln!(
        "largest snapshot: load {loaded:.1?}, import {:.1?}, total {total:.1?} ({} events)",
        total - loaded,
        imp.trace.events.len()
    );
    if !cfg!(debug_assertions) {
        assert!(total.as_millis() < 200, "{total:?}");
    }
}
