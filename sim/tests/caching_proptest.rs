//! Random programs against the caching allocator under several settings. After every step: the §8.4
//! invariants between `stats()` and `segments()` hold, blocks tile their segments and segments do not
//! overlap, allocated ≤ reserved ≤ what the device leaves us, current ≤ peak for every stat, every live
//! allocation is an `active_allocated` block of at least its size. And the same program replayed twice gives
//! the same stats, segments and history.

use proptest::prelude::*;
use vramsim_sim::allocator::caching::{check_snapshot, CachingAllocator};
use vramsim_sim::allocator::{Allocator, BlockRef, BlockState, HistoryEntry, SegmentInfo};
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::Device;
use vramsim_sim::stats::MemoryStats;
use vramsim_sim::timeline::Timeline;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const STREAMS: u64 = 3;

/// One step of a program.
#[derive(Clone, Debug)]
enum Op {
    /// malloc(size, stream)
    Alloc { size: u64, stream: u64 },
    /// free a live block (index modulo the number of live blocks)
    Free { pick: usize },
    /// record_stream on a live block
    RecordStream { pick: usize, stream: u64 },
    /// empty_cache()
    EmptyCache,
    /// queue work on a stream
    Compute { stream: u64, ns: u64 },
    /// synchronize a stream, or the device
    Sync { stream: Option<u64> },
    /// reset_peak_memory_stats()
    ResetPeak,
}

fn op() -> impl Strategy<Value = Op> {
    // Sizes log-uniform from 1 B to 64 MiB: [2^e, 2^(e+1)) for e in 0..26.
    let size = (0u32..26, any::<u64>()).prop_map(|(e, r)| (1u64 << e) + r % (1u64 << e));
    prop_oneof![
        8 => (size, 0..STREAMS).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        6 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), 0..STREAMS).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => Just(Op::EmptyCache),
        2 => (0..STREAMS, 1u64..2_000_000).prop_map(|(stream, ns)| Op::Compute { stream, ns }),
        1 => prop::option::of(0..STREAMS).prop_map(|stream| Op::Sync { stream }),
        1 => Just(Op::ResetPeak),
    ]
}

fn program() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..150)
}

/// A device and settings to run programs on.
struct Machine {
    config: AllocatorConfig,
    capacity: u64,
    context: u64,
}

impl Machine {
    fn new(config: AllocatorConfig, capacity: u64, context: u64) -> Machine {
        Machine {
            config,
            capacity,
            context,
        }
    }

    fn allocator(&self) -> CachingAllocator {
        let mut device = Device::with_capacity(self.capacity);
        device.context_bytes = self.context;
        CachingAllocator::new(self.config.clone(), device)
    }
}

type Outcome = (MemoryStats, Vec<SegmentInfo>, Vec<HistoryEntry>);

fn run(machine: &Machine, ops: &[Op]) -> Result<Outcome, TestCaseError> {
    let mut a = machine.allocator();
    a.set_record_history(true);
    let mut tl = Timeline::new();
    let mut live: Vec<(BlockRef, u64)> = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc { size, stream } => {
                let ooms = a.stats().num_ooms;
                match a.malloc(size, stream, &mut tl) {
                    Ok(block) => live.push((block, size)),
                    Err(e) => {
                        prop_assert_eq!(e.requested, size);
                        prop_assert!(e.alloc_size >= size);
                        prop_assert_eq!(a.stats().num_ooms, ooms + 1);
                    }
                }
            }
            Op::Free { pick } => {
                if !live.is_empty() {
                    let (block, _) = live.swap_remove(pick % live.len());
                    a.free(block, &mut tl);
                }
            }
            Op::RecordStream { pick, stream } => {
                if !live.is_empty() {
                    a.record_stream(live[pick % live.len()].0, stream);
                }
            }
            Op::EmptyCache => {
                let before = a.stats().reserved_bytes.all;
                a.empty_cache(&mut tl);
                let after = a.stats().reserved_bytes.all;
                prop_assert!(after.current <= before.current, "empty_cache grew reserved");
                prop_assert_eq!(after.peak, before.peak, "empty_cache moved the peak");
            }
            Op::Compute { stream, ns } => tl.enqueue(stream, ns),
            Op::Sync {
                stream: Some(stream),
            } => tl.synchronize_stream(stream),
            Op::Sync { stream: None } => tl.synchronize(),
            Op::ResetPeak => a.reset_peak_stats(),
        }
        check(machine, &a, &live)
            .map_err(|e| TestCaseError::fail(format!("after step {step} ({op:?}): {e}")))?;
    }
    Ok((a.stats().clone(), a.segments(), a.take_history()))
}

fn check(machine: &Machine, a: &CachingAllocator, live: &[(BlockRef, u64)]) -> Result<(), String> {
    let stats = a.stats();
    let segments = a.segments();
    check_snapshot(stats, &segments)?;
    let allocated = stats.allocated_bytes.all.current as u64;
    let reserved = stats.reserved_bytes.all.current as u64;
    if allocated > reserved || reserved > machine.capacity - machine.context {
        return Err(format!(
            "allocated {allocated} ≤ reserved {reserved} ≤ usable {} violated",
            machine.capacity - machine.context
        ));
    }
    if reserved != a.total_allocated_memory() {
        return Err(format!(
            "reserved {reserved} but total_allocated_memory {}",
            a.total_allocated_memory()
        ));
    }
    if !machine.config.expandable_segments {
        if let Some(allowed) = a.allowed_memory_maximum() {
            if reserved > allowed {
                return Err(format!("reserved {reserved} above the allowed {allowed}"));
            }
        }
    }
    let allocated_blocks: Vec<_> = segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == BlockState::ActiveAllocated)
        .collect();
    if allocated_blocks.len() != live.len() {
        return Err(format!(
            "{} live allocations but {} allocated blocks",
            live.len(),
            allocated_blocks.len()
        ));
    }
    for &(block, size) in live {
        let address = a.block_address(block);
        let info = allocated_blocks
            .iter()
            .find(|b| b.address == address)
            .ok_or_else(|| format!("live block at {address:#x} is not an allocated block"))?;
        if info.requested_size != size || info.size < size {
            return Err(format!(
                "live block at {address:#x}: requested {size}, snapshot {info:?}"
            ));
        }
    }
    Ok(())
}

fn check_program(machine: &Machine, ops: &[Op]) -> Result<(), TestCaseError> {
    let first = run(machine, ops)?;
    let second = run(machine, ops)?;
    prop_assert!(first == second, "replaying the same program differs");
    Ok(())
}

fn cases() -> ProptestConfig {
    ProptestConfig {
        cases: 64,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn default_settings(ops in program()) {
        check_program(&Machine::new(AllocatorConfig::default(), 8 * GIB, 0), &ops)?;
    }

    #[test]
    fn max_split_size_40_mib(ops in program()) {
        let config = AllocatorConfig { max_split_size: 40 * MIB, ..Default::default() };
        check_program(&Machine::new(config, 8 * GIB, 0), &ops)?;
    }

    #[test]
    fn max_split_size_on_a_small_device(ops in program()) {
        let config = AllocatorConfig { max_split_size: 40 * MIB, ..Default::default() };
        check_program(&Machine::new(config, 256 * MIB, 0), &ops)?;
    }

    #[test]
    fn roundup_power2_divisions_4(ops in program()) {
        let config = AllocatorConfig { roundup_power2_divisions: [4; 16], ..Default::default() };
        check_program(&Machine::new(config, 8 * GIB, 0), &ops)?;
    }

    #[test]
    fn expandable_segments(ops in program()) {
        let config = AllocatorConfig { expandable_segments: true, ..Default::default() };
        check_program(&Machine::new(config, 8 * GIB, 0), &ops)?;
    }

    #[test]
    fn expandable_segments_on_a_small_device(ops in program()) {
        let config = AllocatorConfig { expandable_segments: true, ..Default::default() };
        check_program(&Machine::new(config, 300 * MIB, 60 * MIB), &ops)?;
    }

    #[test]
    fn garbage_collection_with_a_memory_fraction(ops in program()) {
        let config = AllocatorConfig {
            garbage_collection_threshold: 0.5,
            per_process_memory_fraction: Some(0.5),
            ..Default::default()
        };
        check_program(&Machine::new(config, GIB, 0), &ops)?;
    }

    #[test]
    fn small_device_out_of_memory(ops in program()) {
        check_program(&Machine::new(AllocatorConfig::default(), 400 * MIB, 100 * MIB), &ops)?;
    }
}
