//! Repeated events with an exact steady state (`Replay::apply_repeated`): skipping the repetitions that
//! follow a steady state gives the same report, statistics and segments as replaying every event, on
//! random programs under random allocator settings (expandable segments, max_split_size_mb, the GC
//! threshold with a memory fraction), devices small enough to run out of memory, and bodies that never
//! reach a steady state (leaks, clocks that move, stream uses).

use proptest::prelude::*;
use vramsim_sim::allocator::caching::CachingAllocator;
use vramsim_sim::allocator::Allocator;
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::Device;
use vramsim_sim::engine::{EventView, Flow, Repeat, Replay, ReplayOptions};
use vramsim_traces::{AllocId, Category, Event};

const MIB: u64 = 1 << 20;
/// Ids of the repeated body start here (the prefix's are below).
const FROM: u64 = 1_000_000;

/// One step of the repeated body.
#[derive(Clone, Debug)]
enum Op {
    /// An allocation and what becomes of it: freed later in the body (`Some(false)`), freed by the
    /// next repetition (`Some(true)`, what a kept output does), or never (`None`, a leak).
    Alloc {
        size: u64,
        stream: u64,
        kept: Option<bool>,
    },
    /// Frees the earliest body allocation not yet freed that the body frees itself.
    FreeOwn,
    /// Frees the earliest of the previous repetition's kept allocations not yet freed.
    FreeKept,
    EmptyCache,
    Phase(&'static str),
    Compute,
    RecordStream,
}

fn op() -> impl Strategy<Value = Op> {
    // sizes log-uniform from 1 B to 64 MiB
    let size = (0u32..26, any::<u64>()).prop_map(|(e, r)| (1u64 << e) + r % (1u64 << e));
    let kept = prop_oneof![8 => Just(Some(false)), 3 => Just(Some(true)), 1 => Just(None)];
    prop_oneof![
        10 => (size, prop_oneof![9 => Just(0u64), 1 => Just(1u64)], kept)
            .prop_map(|(size, stream, kept)| Op::Alloc { size, stream, kept }),
        7 => Just(Op::FreeOwn),
        3 => Just(Op::FreeKept),
        1 => Just(Op::EmptyCache),
        2 => prop_oneof![Just("forward"), Just("backward")].prop_map(Op::Phase),
        1 => Just(Op::Compute),
        1 => Just(Op::RecordStream),
    ]
}

/// The settings a program runs under.
fn settings() -> impl Strategy<Value = String> {
    (
        any::<bool>(),
        prop::option::of(prop_oneof![Just(20u64), Just(40), Just(100)]),
        prop::option::of(prop_oneof![Just(0.5f64), Just(0.8)]),
    )
        .prop_map(|(expandable, max_split, gc)| {
            let mut parts = Vec::new();
            if expandable {
                parts.push("expandable_segments:True".to_string());
            }
            if let Some(mb) = max_split {
                parts.push(format!("max_split_size_mb:{mb}"));
            }
            if let Some(threshold) = gc {
                parts.push(format!(
                    "garbage_collection_threshold:{threshold},per_process_memory_fraction:0.9"
                ));
            }
            parts.join(",")
        })
}

fn alloc(id: u64, size: u64, stream: u64) -> Event {
    Event::Alloc {
        id: AllocId::Int(id),
        size,
        stream,
        category: Category::Activation,
        tag: None,
    }
}

fn free(id: u64) -> Event {
    Event::Free {
        id: AllocId::Int(id),
    }
}

/// A program: prefix, the kept allocations of a repetition before the first, the body to repeat
/// `times` times (repetition 0's ids), and a suffix that frees the last repetition's kept
/// allocations and asks for one more block.
struct Program {
    prefix: Vec<Event>,
    warmup: Vec<Event>,
    body: Vec<Event>,
    /// The lowest id renamed from one repetition to the next.
    renamed_from: u64,
    shift: u64,
    times: u64,
    suffix: Vec<Event>,
}

fn program(prefix_sizes: &[u64], ops: &[Op], times: u64, last: u64) -> Program {
    let prefix: Vec<Event> = prefix_sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| alloc(i as u64, s, 0))
        .collect();
    let allocs: Vec<(u64, u64, Option<bool>)> = ops
        .iter()
        .filter_map(|o| match o {
            Op::Alloc { size, stream, kept } => Some((*size, *stream, *kept)),
            _ => None,
        })
        .collect();
    let shift = allocs.len() as u64;
    let kept: Vec<usize> = (0..allocs.len())
        .filter(|&j| allocs[j].2 == Some(true))
        .collect();
    // the repetition before the first leaves its kept allocations live
    let warmup: Vec<Event> = kept
        .iter()
        .map(|&j| alloc(FROM + j as u64, allocs[j].0, allocs[j].1))
        .collect();
    let mut body = Vec::new();
    let mut made = 0usize;
    let mut own_live: Vec<u64> = Vec::new();
    let mut kept_left: Vec<u64> = kept.iter().map(|&j| FROM + j as u64).collect();
    for o in ops {
        match o {
            Op::Alloc { size, stream, kept } => {
                let id = FROM + shift + made as u64;
                body.push(alloc(id, *size, *stream));
                if *kept == Some(false) {
                    own_live.push(id);
                }
                made += 1;
            }
            Op::FreeOwn if !own_live.is_empty() => body.push(free(own_live.remove(0))),
            Op::FreeKept if !kept_left.is_empty() => body.push(free(kept_left.remove(0))),
            Op::EmptyCache => body.push(Event::EmptyCache),
            Op::Phase(name) => body.push(Event::Phase {
                name: (*name).into(),
            }),
            Op::Compute => body.push(Event::Compute { stream: 0, us: 1.5 }),
            Op::RecordStream if !own_live.is_empty() => body.push(Event::RecordStream {
                id: AllocId::Int(own_live[0]),
                stream: 1,
            }),
            _ => {}
        }
    }
    // what the body allocates for itself dies in it; the previous repetition's kept ones too
    body.extend(own_live.into_iter().map(free));
    body.extend(kept_left.into_iter().map(free));
    // the last repetition's kept allocations (the warmup's with no repetition)
    let mut suffix: Vec<Event> = kept
        .iter()
        .map(|&j| free(FROM + j as u64 + times * shift))
        .collect();
    suffix.push(Event::Phase {
        name: "optimizer".into(),
    });
    // more requests after the repetitions: new segments (where the GC may run, reading the ages the
    // repetitions left), a cached block taken, the cache emptied
    let big = u64::MAX / 2;
    suffix.extend([
        alloc(big, 7 * MIB, 0),
        alloc(big + 1, last, 0),
        free(big),
        alloc(big + 2, last / 2 + 1, 0),
        alloc(big + 3, 13 * MIB, 0),
        free(big + 3),
        Event::EmptyCache,
        alloc(big + 4, 2 * last, 0),
    ]);
    Program {
        prefix,
        warmup,
        body,
        renamed_from: FROM,
        shift,
        times,
        suffix,
    }
}

/// [`program`] whose warmup also holds one repetition, as a compact lowering's does (the first
/// micro-batch's kept outputs, then the second micro-batch, which the repeated third equals): the
/// body repeated `times` times after it.
fn warm_program(prefix_sizes: &[u64], ops: &[Op], times: u64, last: u64) -> Program {
    let mut p = program(prefix_sizes, ops, times + 1, last);
    p.warmup.extend(p.body.iter().cloned());
    p.body = moved_ids(&p.body, FROM..u64::MAX / 2, p.shift);
    p.renamed_from = FROM + p.shift;
    p.times = times;
    p
}

fn allocator(settings: &str, capacity: u64) -> CachingAllocator {
    let config = AllocatorConfig::parse(settings).expect("valid settings");
    CachingAllocator::new(config, Device::with_capacity(capacity))
}

/// Replays the program, the body through `apply_repeated` (`skip`) or event by event; the report and
/// the allocator's final statistics and segments, as text.
fn replay(p: &Program, settings: &str, capacity: u64, skip: bool) -> String {
    let mut r = Replay::new(allocator(settings, capacity), &ReplayOptions::default());
    let repeat = Repeat {
        view: EventView {
            events: &p.body,
            ..Default::default()
        },
        times: p.times,
        renamed_from: p.renamed_from,
        shift: p.shift,
    };
    let run = |r: &mut Replay<CachingAllocator>| -> Result<Flow, String> {
        for e in p.prefix.iter().chain(&p.warmup) {
            if r.apply(e.clone()).map_err(|e| e.to_string())? == Flow::Stopped {
                return Ok(Flow::Stopped);
            }
        }
        if skip {
            if r.apply_repeated(&repeat).map_err(|e| e.to_string())? == Flow::Stopped {
                return Ok(Flow::Stopped);
            }
        } else {
            for e in repeat.expand() {
                if r.apply(e).map_err(|e| e.to_string())? == Flow::Stopped {
                    return Ok(Flow::Stopped);
                }
            }
        }
        for e in &p.suffix {
            if r.apply(e.clone()).map_err(|e| e.to_string())? == Flow::Stopped {
                return Ok(Flow::Stopped);
            }
        }
        Ok(Flow::Continue)
    };
    let flow = run(&mut r);
    let (outcome, allocator) = r.into_parts();
    format!(
        "{flow:?}\n{outcome:#?}\n{:#?}\n{:#?}",
        allocator.stats(),
        allocator.segments()
    )
}

/// The programs of `counts` (one program at several repetition counts: the same prefix and body)
/// replayed at once: prefix and warm-up once, the body for every count through
/// `apply_repeated_each`, then each copy its own count's suffix; the texts of [`replay`], by count.
fn replay_each(programs: &[Program], settings: &str, capacity: u64) -> Vec<String> {
    let p = &programs[0];
    let counts: Vec<u64> = programs.iter().map(|q| q.times).collect();
    let text = |flow: Flow, r: Replay<CachingAllocator>| {
        let (outcome, allocator) = r.into_parts();
        // as `replay` writes its flow
        let flow: Result<Flow, String> = Ok(flow);
        format!(
            "{flow:?}\n{outcome:#?}\n{:#?}\n{:#?}",
            allocator.stats(),
            allocator.segments()
        )
    };
    let mut r = Replay::new(allocator(settings, capacity), &ReplayOptions::default());
    for e in p.prefix.iter().chain(&p.warmup) {
        if r.apply(e.clone()).unwrap() == Flow::Stopped {
            return programs.iter().map(|_| String::new()).collect();
        }
    }
    let repeat = Repeat {
        view: EventView {
            events: &p.body,
            ..Default::default()
        },
        times: 0,
        renamed_from: p.renamed_from,
        shift: p.shift,
    };
    let each = r
        .apply_repeated_each(&repeat, &counts, CachingAllocator::clone)
        .unwrap();
    assert_eq!(each.len(), programs.len());
    each.into_iter()
        .zip(programs)
        .map(|((mut r, flow), q)| {
            if flow == Flow::Stopped {
                return text(flow, r);
            }
            for e in &q.suffix {
                if r.apply(e.clone()).unwrap() == Flow::Stopped {
                    return text(Flow::Stopped, r);
                }
            }
            text(Flow::Continue, r)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, .. ProptestConfig::default() })]

    #[test]
    fn skipping_repetitions_equals_replaying_them(
        settings in settings(),
        capacity in prop_oneof![Just(256 * MIB), Just(1024 * MIB), Just(16384 * MIB)],
        prefix in prop::collection::vec(1u64..(64 * MIB), 0..6),
        ops in prop::collection::vec(op(), 1..40),
        times in 1u64..12,
        last in prop_oneof![Just(1u64), Just(30 * MIB), Just(90 * MIB), Just(4096 * MIB)],
    ) {
        let p = program(&prefix, &ops, times, last);
        let full = replay(&p, &settings, capacity, false);
        let skipped = replay(&p, &settings, capacity, true);
        prop_assert_eq!(full, skipped);
    }

    /// One replay for several accumulation counts (`apply_repeated_each`) leaves, for each count,
    /// what a replay of that count alone, every event applied, leaves.
    #[test]
    fn repeating_for_several_counts_at_once_equals_each_alone(
        settings in settings(),
        capacity in prop_oneof![Just(256 * MIB), Just(1024 * MIB), Just(16384 * MIB)],
        prefix in prop::collection::vec(1u64..(64 * MIB), 0..6),
        ops in prop::collection::vec(op(), 1..40),
        counts in prop::collection::btree_set(1u64..14, 1..5),
        last in prop_oneof![Just(1u64), Just(30 * MIB), Just(90 * MIB), Just(4096 * MIB)],
    ) {
        let programs: Vec<Program> =
            counts.iter().map(|&c| program(&prefix, &ops, c, last)).collect();
        let prefix_fits = {
            let mut r = Replay::new(allocator(&settings, capacity), &ReplayOptions::default());
            programs[0].prefix.iter().chain(&programs[0].warmup)
                .all(|e| r.apply(e.clone()).unwrap() == Flow::Continue)
        };
        prop_assume!(prefix_fits);
        let each = replay_each(&programs, &settings, capacity);
        for (q, text) in programs.iter().zip(each) {
            prop_assert_eq!(replay(q, &settings, capacity, false), text, "count {}", q.times);
        }
    }
}

/// A steady body repeated a billion times replays in a moment (it is skipped after two repetitions),
/// and its counters are the body's times a billion: worked out by hand from one repetition.
#[test]
fn a_billion_repetitions_are_carried_exactly() {
    // one repetition: a 3 MiB block (rounded to 3 MiB, from a 20 MiB segment) and a 100-byte block
    // (512 B, from a 2 MiB small segment), both freed
    let body = vec![
        Event::Phase {
            name: "forward".into(),
        },
        alloc(FROM, 3 * MIB, 0),
        alloc(FROM + 1, 100, 0),
        free(FROM),
        free(FROM + 1),
    ];
    let times = 1_000_000_000u64;
    let repeat = Repeat {
        view: EventView {
            events: &body,
            ..Default::default()
        },
        times,
        renamed_from: FROM,
        shift: 2,
    };
    // every setting reaches the steady state (a replay of every event would take minutes)
    for settings in [
        "expandable_segments:True",
        "max_split_size_mb:40",
        "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
    ] {
        let mut r = Replay::new(allocator(settings, 80 << 30), &ReplayOptions::default());
        assert_eq!(r.apply_repeated(&repeat).unwrap(), Flow::Continue);
        assert_eq!(r.finish().events, 5 * times, "{settings}");
    }
    let mut r = Replay::new(allocator("", 80 << 30), &ReplayOptions::default());
    assert_eq!(r.apply_repeated(&repeat).unwrap(), Flow::Continue);
    // the last repetition's ids are live no more: an alloc may take the first repetition's again
    r.apply(alloc(FROM, 1, 0)).unwrap();
    let outcome = r.finish();
    assert_eq!(outcome.events, 5 * times + 1);
    assert_eq!(outcome.allocs, 2 * times + 1);
    assert_eq!(outcome.frees, 2 * times);
    let s = &outcome.stats;
    assert_eq!(s.allocation.all.allocated, 2 * times as i64 + 1);
    assert_eq!(s.allocation.all.freed, 2 * times as i64);
    assert_eq!(
        s.allocated_bytes.all.allocated,
        (3 * MIB as i64 + 512) * times as i64 + 512
    );
    assert_eq!(s.allocated_bytes.all.peak, 3 * MIB as i64 + 512);
    // segments are made once: 20 MiB large, 2 MiB small
    assert_eq!(s.num_device_alloc, 2);
    assert_eq!(s.reserved_bytes.all.current, 22 * MIB as i64);
    assert_eq!(outcome.phases[0].occurrences, times);
    assert_eq!(
        outcome.phase_marks.len(),
        vramsim_sim::engine::MAX_PHASE_MARKS
    );
    assert_eq!(outcome.phase_marks[999].0, 999 * 5);
}

/// `events` with every integer id in `ids` moved by `by` (wrapping: a negative `by`).
fn moved_ids(events: &[Event], ids: std::ops::Range<u64>, by: u64) -> Vec<Event> {
    events
        .iter()
        .map(|e| {
            e.with_id(|id| match id {
                AllocId::Int(i) if ids.contains(i) => AllocId::Int(i.wrapping_add(by)),
                other => other.clone(),
            })
        })
        .collect()
}

/// How far the second repeat's ids are moved from the first's: above every id before them (the
/// first suffix's large ones included), as a lowering hands ids out in order.
const SECOND: u64 = u64::MAX / 2 + (1 << 40) - FROM;

/// A program of two iterations: the program's prefix, warm-up and body repeated `p.times` times,
/// its suffix, then a second warm-up and body (ids moved up by [`SECOND`]) repeated as often, and
/// the suffix again for them. Replayed with `apply_repeated` (`skip`) or every event applied;
/// returns the replay, finished or not.
fn two_iterations(
    p: &Program,
    settings: &str,
    capacity: u64,
    skip: bool,
) -> Replay<CachingAllocator> {
    let big = u64::MAX / 2;
    let repeated_ids = FROM..big;
    let warmup2 = moved_ids(&p.warmup, repeated_ids.clone(), SECOND);
    let body2 = moved_ids(&p.body, repeated_ids.clone(), SECOND);
    // the second suffix frees the second body's kept ids, and its own large ids come after them
    let suffix2 = moved_ids(
        &moved_ids(&p.suffix, repeated_ids, SECOND),
        big..big + 100,
        (u64::MAX - 100).wrapping_sub(big),
    );
    let mut r = Replay::new(allocator(settings, capacity), &ReplayOptions::default());
    r.keep_stretch_peaks();
    let plain = |r: &mut Replay<CachingAllocator>, events: &[Event]| -> Flow {
        for e in events {
            if r.apply(e.clone()).unwrap() == Flow::Stopped {
                return Flow::Stopped;
            }
        }
        Flow::Continue
    };
    let repeated = |r: &mut Replay<CachingAllocator>, body: &[Event], from: u64| -> Flow {
        let repeat = Repeat {
            view: EventView {
                events: body,
                ..Default::default()
            },
            times: p.times,
            renamed_from: from,
            shift: p.shift,
        };
        if skip {
            r.apply_repeated(&repeat).unwrap()
        } else {
            let all: Vec<Event> = repeat.expand().collect();
            plain(r, &all)
        }
    };
    let _ = plain(&mut r, &p.prefix) == Flow::Continue
        && plain(&mut r, &p.warmup) == Flow::Continue
        && repeated(&mut r, &p.body, p.renamed_from) == Flow::Continue
        && plain(&mut r, &p.suffix) == Flow::Continue
        && plain(&mut r, &warmup2) == Flow::Continue
        && repeated(&mut r, &body2, p.renamed_from + SECOND) == Flow::Continue
        && plain(&mut r, &suffix2) == Flow::Continue;
    r
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, .. ProptestConfig::default() })]

    /// A replay that carried its repeats tells the outcome of the same run with more repetitions
    /// (`outcome_with_more`), exactly as a replay of that run, every event applied, ends.
    #[test]
    fn more_repetitions_follow_from_the_carried_ones(
        settings in settings(),
        capacity in prop_oneof![Just(256 * MIB), Just(1024 * MIB), Just(16384 * MIB)],
        prefix in prop::collection::vec(1u64..(64 * MIB), 0..6),
        ops in prop::collection::vec(op(), 1..40),
        times in 2u64..10,
        more in 1u64..9,
        last in prop_oneof![Just(1u64), Just(30 * MIB), Just(90 * MIB), Just(4096 * MIB)],
    ) {
        let few = program(&prefix, &ops, times, last);
        let many = program(&prefix, &ops, times + more, last);
        let carried = two_iterations(&few, &settings, capacity, true);
        if let Some(derived) = carried.outcome_with_more(more as i64, 2) {
            let full = two_iterations(&many, &settings, capacity, false).finish();
            prop_assert_eq!(format!("{derived:#?}"), format!("{full:#?}"));
        }
    }

    /// ... and with fewer repetitions, down to none, where it tells them (the repetitions replayed
    /// before the steady state showed, or one fewer where the last raised no peak), exactly as a
    /// replay of that run ends.
    #[test]
    fn fewer_repetitions_follow_from_the_carried_ones(
        settings in settings(),
        capacity in prop_oneof![Just(256 * MIB), Just(1024 * MIB), Just(16384 * MIB)],
        prefix in prop::collection::vec(1u64..(64 * MIB), 0..6),
        ops in prop::collection::vec(op(), 1..40),
        times in 1u64..10,
        fewer in 1u64..10,
        last in prop_oneof![Just(1u64), Just(30 * MIB), Just(90 * MIB), Just(4096 * MIB)],
        warm in any::<bool>(),
    ) {
        let fewer = fewer.min(times);
        let make = if warm { warm_program } else { program };
        let many = make(&prefix, &ops, times, last);
        let few = make(&prefix, &ops, times - fewer, last);
        let carried = two_iterations(&many, &settings, capacity, true);
        if let Some(derived) = carried.outcome_with_more(-(fewer as i64), 2) {
            let full = two_iterations(&few, &settings, capacity, false).finish();
            prop_assert_eq!(format!("{derived:#?}"), format!("{full:#?}"));
        }
    }
}

/// A body that reaches its steady state in both iterations: the outcome with more repetitions is
/// told (not `None`), and is the full replay's.
#[test]
fn a_steady_run_tells_the_outcome_of_a_longer_one() {
    let ops = [
        Op::Phase("forward"),
        Op::Alloc {
            size: 3 * MIB,
            stream: 0,
            kept: Some(false),
        },
        Op::Alloc {
            size: 100,
            stream: 0,
            kept: Some(false),
        },
        Op::FreeOwn,
        Op::FreeOwn,
    ];
    for settings in [
        "",
        "expandable_segments:True",
        "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
    ] {
        let few = program(&[5 * MIB], &ops, 4, 30 * MIB);
        let many = program(&[5 * MIB], &ops, 4 + 57, 30 * MIB);
        let derived = two_iterations(&few, settings, 16384 * MIB, true)
            .outcome_with_more(57, 2)
            .expect("both repeats carried");
        let full = two_iterations(&many, settings, 16384 * MIB, false).finish();
        assert_eq!(format!("{derived:#?}"), format!("{full:#?}"), "{settings}");
        // and with fewer, down to none where the warmup holds a repetition: the repetition
        // replayed in each iteration raised no peak (the warmup's reached the same)
        let few = warm_program(&[5 * MIB], &ops, 4, 30 * MIB);
        for times in [0, 1, 3] {
            let shorter = warm_program(&[5 * MIB], &ops, times, 30 * MIB);
            let derived = two_iterations(&few, settings, 16384 * MIB, true)
                .outcome_with_more(times as i64 - 4, 2)
                .expect("the steady state holds from the first repetition on");
            let full = two_iterations(&shorter, settings, 16384 * MIB, false).finish();
            assert_eq!(
                format!("{derived:#?}"),
                format!("{full:#?}"),
                "{settings}, {times}"
            );
        }
    }
}

/// A repetition that reaches a peak the run before it did not: a run without it is not told.
#[test]
fn a_run_without_a_repetition_that_raised_a_peak_is_not_told() {
    // the warmup keeps nothing, so the first repetition holds more than anything before it
    let ops = [
        Op::Alloc {
            size: 40 * MIB,
            stream: 0,
            kept: Some(false),
        },
        Op::FreeOwn,
    ];
    let few = program(&[], &ops, 4, 1);
    let carried = two_iterations(&few, "", 16384 * MIB, true);
    assert!(carried.outcome_with_more(-3, 2).is_some(), "down to one");
    assert!(carried.outcome_with_more(-4, 2).is_none(), "none at all");
}
