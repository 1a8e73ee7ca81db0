//! Streams, deferred frees (§4.1, §4.3) and the recorded history (§10.2).

use vramsim_sim::allocator::caching::{check_snapshot, CachingAllocator};
use vramsim_sim::allocator::{Action, Allocator, BlockState, HistoryEntry};
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::Device;
use vramsim_sim::timeline::Timeline;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn allocator() -> CachingAllocator {
    CachingAllocator::new(AllocatorConfig::default(), Device::with_capacity(8 * GIB))
}

fn consistent(a: &CachingAllocator) {
    if let Err(e) = check_snapshot(a.stats(), &a.segments()) {
        panic!("stats and snapshot disagree: {e}");
    }
}

/// §4.1: a block recorded on another stream stays active (pending free) until that stream passes the
/// free; until then it is not reused; afterwards the next malloc reuses it at the same address.
#[test]
fn record_stream_defers_reuse_until_the_stream_passes() {
    let mut a = allocator();
    let mut tl = Timeline::new();
    let x = a.malloc(4 * MIB, 0, &mut tl).unwrap();
    let address = a.block_address(x);
    a.record_stream(x, 1);
    tl.enqueue(1, 1_000);
    a.free(x, &mut tl);
    let s = a.stats();
    assert_eq!(s.allocation.all.current, 0, "allocation drops at once");
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(
        s.active.all.current, 1,
        "still active until the event fires"
    );
    assert_eq!(s.active_bytes.all.current, (4 * MIB) as i64);
    assert_eq!(s.requested_bytes.all.current, (4 * MIB) as i64);
    let block = &a.segments()[0].blocks[0];
    assert_eq!(
        (block.state, block.requested_size),
        (BlockState::ActivePendingFree, 4 * MIB)
    );
    consistent(&a);

    let y = a.malloc(4 * MIB, 0, &mut tl).unwrap();
    assert_ne!(
        a.block_address(y),
        address,
        "not reused before the stream passes"
    );
    tl.synchronize_stream(1);
    let z = a.malloc(4 * MIB, 0, &mut tl).unwrap();
    assert_eq!(
        a.block_address(z),
        address,
        "reused after the stream passed"
    );
    consistent(&a);
}

/// §4.1: record_stream with the allocation stream is ignored.
#[test]
fn record_stream_on_the_allocation_stream_is_ignored() {
    let mut a = allocator();
    let mut tl = Timeline::new();
    let x = a.malloc(MIB, 3, &mut tl).unwrap();
    a.record_stream(x, 3);
    tl.enqueue(3, 1_000_000);
    a.free(x, &mut tl);
    assert_eq!(a.stats().active.all.current, 0);
}

/// §4.1: one event per recorded stream; the block is cached when the last one fires.
#[test]
fn every_recorded_stream_must_pass() {
    let mut a = allocator();
    let mut tl = Timeline::new();
    let x = a.malloc(MIB, 0, &mut tl).unwrap();
    a.record_stream(x, 1);
    a.record_stream(x, 2);
    a.record_stream(x, 1);
    tl.enqueue(1, 100);
    tl.enqueue(2, 300);
    a.free(x, &mut tl);
    tl.synchronize_stream(1);
    a.malloc(512, 5, &mut tl).unwrap(); // process_events runs at every malloc
    assert_eq!(
        a.stats().active.all.current,
        2,
        "stream 2 has not passed yet"
    );
    tl.synchronize_stream(2);
    a.malloc(512, 5, &mut tl).unwrap();
    assert_eq!(
        a.stats().active.all.current,
        2,
        "x cached, two 512 B blocks active"
    );
    consistent(&a);
}

/// §4.3: streams are independent: an early event on one stream frees its block while another stream's
/// later event still holds its block back.
#[test]
fn events_are_processed_per_stream() {
    let mut a = allocator();
    let mut tl = Timeline::new();
    let slow = a.malloc(MIB, 0, &mut tl).unwrap();
    let fast = a.malloc(MIB, 0, &mut tl).unwrap();
    a.record_stream(slow, 1);
    a.record_stream(fast, 2);
    tl.enqueue(1, 10_000);
    tl.enqueue(2, 10);
    a.free(slow, &mut tl);
    a.free(fast, &mut tl);
    tl.wait_until(10);
    a.malloc(2 * MIB, 7, &mut tl).unwrap();
    let states: Vec<BlockState> = a.segments()[0].blocks.iter().map(|b| b.state).collect();
    assert_eq!(states[0], BlockState::ActivePendingFree);
    assert_eq!(states[1], BlockState::Inactive);
    consistent(&a);
}

/// §5.3: empty_cache waits for every pending free (the host clock moves to the last event) and counts
/// one num_sync_all_streams.
#[test]
fn empty_cache_waits_for_pending_frees() {
    let mut a = allocator();
    let mut tl = Timeline::new();
    let x = a.malloc(30 * MIB, 0, &mut tl).unwrap();
    a.record_stream(x, 1);
    tl.enqueue(1, 123_456);
    a.free(x, &mut tl);
    a.empty_cache(&mut tl);
    assert_eq!(tl.now(), 123_456);
    let s = a.stats();
    assert_eq!(s.num_sync_all_streams, 1);
    assert_eq!(s.reserved_bytes.all.current, 0);
    assert_eq!(s.active.all.current, 0);
    consistent(&a);
}

fn entry(action: Action, addr: u64, size: u64, stream: u64, time_ns: u64) -> HistoryEntry {
    HistoryEntry {
        action,
        addr,
        size,
        stream,
        time_ns,
    }
}

/// §10.2: every action with its address, its size (requested size for block actions, bytes for segment
/// actions, the rounded request for an OOM whose address is the device's free bytes) and the host time.
#[test]
fn history_records_every_action() {
    let mut a = CachingAllocator::new(AllocatorConfig::default(), Device::with_capacity(GIB));
    let mut tl = Timeline::new();
    a.set_record_history(true);
    tl.wait_until(5);
    let x = a.malloc(1000, 2, &mut tl).unwrap();
    let x_addr = a.block_address(x);
    a.record_stream(x, 1);
    tl.enqueue(1, 100);
    a.free(x, &mut tl);
    tl.synchronize();
    let y = a.malloc(3000, 2, &mut tl).unwrap();
    a.free(y, &mut tl);
    a.empty_cache(&mut tl);
    let err = a.malloc(GIB + 1, 2, &mut tl).unwrap_err();
    assert_eq!(err.device_free, GIB);
    let expected = [
        entry(Action::SegmentAlloc, x_addr, 2 * MIB, 2, 5),
        entry(Action::Alloc, x_addr, 1000, 2, 5),
        entry(Action::FreeRequested, x_addr, 1000, 2, 5),
        // y's malloc: x's event fired (t = 105), x is cached, then y reuses its address.
        entry(Action::FreeCompleted, x_addr, 1000, 2, 105),
        entry(Action::Alloc, x_addr, 3000, 2, 105),
        entry(Action::FreeRequested, x_addr, 3000, 2, 105),
        entry(Action::FreeCompleted, x_addr, 3000, 2, 105),
        entry(Action::SegmentFree, x_addr, 2 * MIB, 2, 105),
        entry(Action::Oom, GIB, GIB + 512, 2, 105),
    ];
    assert_eq!(a.take_history(), expected);
    assert!(a.take_history().is_empty(), "taken");
    a.malloc(1, 0, &mut tl).unwrap();
    a.set_record_history(false);
    assert!(a.take_history().is_empty(), "disabling clears the history");
}

/// Splitting and merging never move an allocated block, and determinism: the same calls give the same
/// addresses.
#[test]
fn replays_are_deterministic() {
    let run = || {
        let mut a = allocator();
        let mut tl = Timeline::new();
        a.set_record_history(true);
        let mut live = Vec::new();
        for i in 0..200u64 {
            let size = (i * 7919 % 5000 + 1) * 1024;
            live.push(a.malloc(size, i % 3, &mut tl).unwrap());
            if i % 3 == 0 {
                let b = live.remove((i as usize * 31) % live.len());
                a.free(b, &mut tl);
            }
            if i % 50 == 49 {
                a.empty_cache(&mut tl);
            }
        }
        (a.stats().clone(), a.segments(), a.take_history())
    };
    assert_eq!(run(), run());
}
