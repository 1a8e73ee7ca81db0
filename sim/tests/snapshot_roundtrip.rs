//! Snapshots of runs the simulator itself recorded, with what the shipped snapshots lack: deferred frees
//! (`record_stream` on other streams), several allocation streams, explicit `empty_cache` calls between the
//! allocator's own releases, out-of-memory errors the program survives, and ring buffers that begin in
//! the middle of the run (blocks allocated, freed or waiting for stream events before recording began).
//! Importing such a snapshot and checking it must reproduce every recorded action: the model is the
//! same on both sides, so any difference is the importer's or the checker's.

use vramsim_sim::allocator::caching::CachingAllocator;
use vramsim_sim::allocator::{Allocator, BlockState as SimState};
use vramsim_sim::check::{check_device, CheckOptions};
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::Device;
use vramsim_sim::engine::{Replay, ReplayOptions};
use vramsim_sim::import::{import_device, ImportOptions, ReleaseCause};
use vramsim_sim::rounding::PoolKind;
use vramsim_traces::snapshot::{
    Action, AllocatorSettings, Block, BlockState, Segment, SegmentType, Snapshot, TraceEntry,
};
use vramsim_traces::{AllocId, Category, Event};

const MIB: u64 = 1 << 20;

/// Runs `events` (going on after out-of-memory errors) and returns the snapshot PyTorch would dump.
fn record(conf: &str, capacity: u64, events: &[Event]) -> Snapshot {
    let config = AllocatorConfig::parse(conf).unwrap();
    let mut allocator = CachingAllocator::new(config, Device::with_capacity(capacity));
    allocator.set_record_history(true);
    let mut replay = Replay::new(allocator, &ReplayOptions::default());
    for e in events {
        // a failed alloc leaves its id unknown: the program's later free of it is skipped too
        let _ = replay.apply(e.clone());
    }
    let (_, mut allocator) = replay.into_parts();
    let history = allocator.take_history();
    let entries = history
        .iter()
        .map(|h| TraceEntry {
            action: Action::from_name(h.action.name()),
            addr: h.addr,
            size: h.size,
            stream: h.stream,
            time_us: Some((h.time_ns / 1000) as i64),
            compile_context: None,
            user_metadata: None,
            extra: vec![],
        })
        .collect();
    let segments = allocator
        .segments()
        .into_iter()
        .map(|s| Segment {
            device: 0,
            address: s.address,
            total_size: s.total_size,
            allocated_size: s.allocated_size,
            active_size: s.active_size,
            requested_size: s.requested_size,
            stream: s.stream,
            segment_type: match s.pool {
                PoolKind::Small => SegmentType::Small,
                PoolKind::Large => SegmentType::Large,
            },
            segment_pool_id: (0, 0),
            is_expandable: s.is_expandable,
            blocks: s
                .blocks
                .iter()
                .map(|b| Block {
                    address: b.address,
                    size: b.size,
                    requested_size: b.requested_size,
                    state: match b.state {
                        SimState::ActiveAllocated => BlockState::ActiveAllocated,
                        SimState::ActivePendingFree => BlockState::ActivePendingFree,
                        SimState::Inactive => BlockState::Inactive,
                    },
                    extra: vec![],
                })
                .collect(),
            extra: vec![],
        })
        .collect();
    Snapshot {
        segments,
        device_traces: vec![entries],
        allocator_settings: Some(AllocatorSettings {
            pytorch_cuda_alloc_conf: Some(conf.to_owned()),
            ..AllocatorSettings::default()
        }),
        external_annotations: None,
        extra: vec![],
    }
}

/// The snapshot with only the last entries of its ring buffer.
fn ring(snapshot: &Snapshot, keep_from: usize) -> Snapshot {
    let mut s = snapshot.clone();
    let n = s.device_traces[0].len();
    s.device_traces[0].drain(..keep_from.min(n));
    s
}

/// A deterministic program: allocations of mixed sizes on two streams, blocks used on a third stream,
/// kernels, synchronisations, `empty_cache` calls, and requests too big for the device.
fn program(seed: u64, steps: usize, small_only: bool) -> Vec<Event> {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        state >> 33
    };
    let mut live: Vec<u64> = Vec::new();
    let mut events = Vec::new();
    let mut id = 0u64;
    for _ in 0..steps {
        match next() % 20 {
            0..=8 => {
                id += 1;
                let size = match (small_only, next() % 4) {
                    (true, _) | (false, 0) => 1 + next() % MIB,
                    (false, 1) => MIB + next() % (9 * MIB),
                    (false, 2) => 10 * MIB + next() % (40 * MIB),
                    _ => 512 * (1 + next() % 64),
                };
                let stream = if next() % 3 == 0 { 5 } else { 0 };
                events.push(Event::Alloc {
                    id: AllocId::Int(id),
                    size,
                    stream,
                    category: Category::Other,
                    tag: None,
                });
                live.push(id);
            }
            9..=15 if !live.is_empty() => {
                let victim = live.swap_remove((next() as usize) % live.len());
                if next() % 3 == 0 {
                    // used on the side stream: its free waits for that stream's work
                    events.push(Event::RecordStream {
                        id: AllocId::Int(victim),
                        stream: 9,
                    });
                    events.push(Event::Compute {
                        stream: 9,
                        us: (next() % 50) as f64,
                    });
                }
                events.push(Event::Free {
                    id: AllocId::Int(victim),
                });
            }
            16 => events.push(Event::Sync {
                stream: Some(9).filter(|_| next() % 2 == 0),
            }),
            17 => events.push(Event::EmptyCache),
            18 => {
                // host time passes: some deferred frees complete at the next malloc
                events.push(Event::Compute {
                    stream: 0,
                    us: 20.0,
                });
                events.push(Event::Sync { stream: Some(0) });
            }
            _ => {
                id += 1;
                events.push(Event::Alloc {
                    id: AllocId::Int(id),
                    size: if small_only { 700 * 1024 } else { 200 * MIB },
                    stream: 0,
                    category: Category::Other,
                    tag: None,
                });
                live.push(id);
            }
        }
    }
    events
}

fn assert_reproduced(snapshot: &Snapshot, what: &str) {
    let report = check_device(snapshot, 0, &CheckOptions::default()).unwrap();
    let entries = &snapshot.device_traces[0];
    let count = |a: Action| entries.iter().filter(|e| e.action == a).count() as u64;
    let segment_events = count(Action::SegmentAlloc)
        + count(Action::SegmentFree)
        + count(Action::SegmentMap)
        + count(Action::SegmentUnmap);
    assert_eq!(
        report.first_divergence,
        None,
        "{what}: {}\nnotes: {:?}",
        report.to_table(),
        report.notes
    );
    assert_eq!(report.segment_events_matched, segment_events, "{what}");
    assert_eq!(report.segment_events_simulated, segment_events, "{what}");
    assert_eq!(report.same_offset_allocs, count(Action::Alloc), "{what}");
    assert_eq!(report.ooms_matched() as u64, count(Action::Oom), "{what}");
    assert_eq!(
        report.final_reserved_simulated,
        snapshot.segments.iter().map(|s| s.total_size).sum::<u64>(),
        "{what}"
    );
    assert_eq!(
        report.final_segments_matched,
        snapshot.segments.len(),
        "{what}"
    );
}

#[test]
fn deferred_frees_releases_and_ooms_are_reproduced() {
    for (conf, small_only, capacity) in [
        ("", false, 600 * MIB),
        ("expandable_segments:True", false, 600 * MIB),
        ("", true, 40 * MIB),
        ("expandable_segments:True", true, 40 * MIB),
    ] {
        for seed in 1..=4 {
            let snapshot = record(conf, capacity, &program(seed, 1500, small_only));
            let entries = &snapshot.device_traces[0];
            let count = |a: Action| entries.iter().filter(|e| e.action == a).count();
            assert!(
                count(Action::Oom) > 0 && count(Action::Alloc) > 300,
                "{seed}"
            );
            let import =
                import_device(&snapshot, 0, &ImportOptions::from_snapshot(&snapshot)).unwrap();
            assert!(
                import.recorded.deferred_frees > 10,
                "seed {seed}: record_stream used"
            );
            if !small_only {
                assert!(import
                    .recorded
                    .releases
                    .iter()
                    .any(|r| r.cause == ReleaseCause::EmptyCache));
            }
            assert_reproduced(&snapshot, &format!("{conf:?} seed {seed}"));
        }
    }
}

/// Recording that begins mid-run: blocks allocated before it (freed during it, or still live), segments
/// made before it, and blocks whose deferred free was requested before it and completes during it.
#[test]
fn ring_buffers_that_begin_mid_run_are_reproduced() {
    for (conf, small_only) in [("", true), ("expandable_segments:True", false), ("", false)] {
        let snapshot = record(conf, 600 * MIB, &program(11, 1500, small_only));
        let n = snapshot.device_traces[0].len();
        let mut pending_seen = 0;
        for keep_from in (1..n).step_by(n / 23) {
            let cut = ring(&snapshot, keep_from);
            let import = import_device(&cut, 0, &ImportOptions::from_snapshot(&cut)).unwrap();
            pending_seen += import.recorded.initial.pending_frees;
            assert!(
                import.recorded.notes.is_empty(),
                "{:?}",
                import.recorded.notes
            );
            assert_reproduced(&cut, &format!("{conf:?} from entry {keep_from}"));
        }
        assert!(
            pending_seen > 0,
            "{conf:?}: some cut falls inside a deferred free"
        );
    }
}

/// The import writes a deferred free as `record_stream` + `compute` + `free` on a synthetic stream and
/// its completion as a `sync` of that stream, so the block is cached at the recorded malloc.
#[test]
fn a_deferred_free_is_a_synthetic_stream() {
    let a = |id: u64, size| Event::Alloc {
        id: AllocId::Int(id),
        size,
        stream: 0,
        category: Category::Other,
        tag: None,
    };
    let events = vec![
        a(1, 4 * MIB),
        Event::RecordStream {
            id: AllocId::Int(1),
            stream: 3,
        },
        Event::Compute {
            stream: 3,
            us: 100.0,
        },
        Event::Free {
            id: AllocId::Int(1),
        },
        a(2, 4 * MIB), // the block is still held: a new one
        Event::Sync { stream: Some(3) },
        a(3, 4 * MIB), // processes the event first: block 1 is cached and reused
    ];
    let snapshot = record("", 1 << 30, &events);
    let actions: Vec<_> = snapshot.device_traces[0]
        .iter()
        .map(|e| e.action.as_str().to_owned())
        .collect();
    assert_eq!(
        actions,
        [
            "segment_alloc",
            "alloc",
            "free_requested",
            "alloc",
            "free_completed",
            "alloc"
        ]
    );
    let import = import_device(&snapshot, 0, &ImportOptions::from_snapshot(&snapshot)).unwrap();
    let ops: Vec<&str> = import.trace.events.iter().map(Event::op).collect();
    assert_eq!(
        ops,
        [
            "alloc",
            "record_stream",
            "compute",
            "free",
            "alloc",
            "sync",
            "alloc"
        ]
    );
    let Event::RecordStream { stream, .. } = import.trace.events[1] else {
        unreachable!()
    };
    assert_eq!(stream, vramsim_sim::import::FIRST_SYNTHETIC_STREAM);
    assert_reproduced(&snapshot, "one deferred free");
}

/// What a replay refuses about `segment` events, with the event's index.
#[test]
fn segments_come_first_and_fit() {
    use vramsim_traces::{InitialBlock, InitialSegment, Pool};
    let seg = |addr: u64, ids: &[u64]| {
        Event::Segment(Box::new(InitialSegment {
            addr,
            size: 20 * MIB,
            stream: 0,
            pool: Pool::Large,
            expandable: false,
            base: None,
            blocks: ids
                .iter()
                .enumerate()
                .map(|(i, &id)| InitialBlock {
                    id: AllocId::Int(id),
                    offset: i as u64 * 4 * MIB,
                    size: 4 * MIB,
                    requested: 4 * MIB,
                    category: Category::Other,
                    tag: None,
                })
                .collect(),
        }))
    };
    let replay_on = |capacity: u64, events: Vec<Event>| {
        let a = CachingAllocator::new(AllocatorConfig::default(), Device::with_capacity(capacity));
        let mut r = Replay::new(a, &ReplayOptions::default());
        events
            .into_iter()
            .map(|e| r.apply(e).map(|_| ()).map_err(|e| e.to_string()))
            .collect::<Vec<_>>()
    };
    let replay = |events| replay_on(30 * MIB, events);
    let free1 = Event::Free {
        id: AllocId::Int(1),
    };
    assert!(replay(vec![seg(0x1000_0000, &[1, 2]), free1.clone()])
        .iter()
        .all(Result::is_ok));
    let errors = replay(vec![free1.clone(), seg(0x1000_0000, &[1])]);
    assert_eq!(
        errors[1].as_ref().unwrap_err(),
        "event 1: op `segment` after op `free` (event 0): segments declare the state a trace starts from, so they come before every other op"
    );
    let errors = replay(vec![seg(0x1000_0000, &[1, 1])]);
    assert_eq!(
        errors[0].as_ref().unwrap_err(),
        "event 0: alloc of id 1, which is already live (allocated at event 0); ids must be unique among live allocations"
    );
    let errors = replay_on(
        100 * MIB,
        vec![seg(0x1000_0000, &[1]), seg(0x1000_0000 + 8 * MIB, &[2])],
    );
    assert!(errors[1]
        .as_ref()
        .unwrap_err()
        .starts_with("event 1: cannot start from this segment: the segment at 0x10800000 (20971520 bytes) overlaps the one at 0x10000000"));
    let errors = replay(vec![seg(0x1000_0000, &[1]), seg(0x4000_0000, &[2])]);
    assert_eq!(
        errors[1].as_ref().unwrap_err(),
        "event 1: cannot start from this segment: the segment at 0x40000000 needs 20971520 bytes but the device has 10485760 bytes free: give a larger capacity"
    );
    // without caching, each block is an allocation of its requested bytes
    let mut r = Replay::new(
        vramsim_sim::allocator::cuda_malloc::CudaMallocAllocator::new(Device::with_capacity(
            30 * MIB,
        )),
        &ReplayOptions::default(),
    );
    r.apply(seg(0x1000_0000, &[1, 2])).unwrap();
    assert_eq!(r.allocator().stats().reserved_bytes.all.current, 8 << 20);
    r.apply(free1).unwrap();
    assert_eq!(r.allocator().stats().reserved_bytes.all.current, 4 << 20);
}
