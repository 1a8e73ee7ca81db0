//! Allocator statistics in the vocabulary of `torch.cuda.memory_stats()` (fact sheet §8).

use std::collections::BTreeMap;

use crate::rounding::PoolKind;

/// One statistic: PyTorch's `Stat` (§8.1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// The value now.
    pub current: i64,
    /// The highest `current` since the last peak reset.
    pub peak: i64,
    /// Sum of all increases since the last accumulated reset.
    pub allocated: i64,
    /// Sum of all decreases since the last accumulated reset.
    pub freed: i64,
}

impl Stat {
    /// `increase_stat`: current += n, peak follows, allocated += n.
    #[inline]
    pub fn increase(&mut self, n: u64) {
        let n = n as i64;
        self.current += n;
        self.peak = self.peak.max(self.current);
        self.allocated += n;
    }

    /// `decrease_stat`: current −= n, freed += n.
    #[inline]
    pub fn decrease(&mut self, n: u64) {
        let n = n as i64;
        self.current -= n;
        self.freed += n;
    }

    /// `reset_peak_stat`: peak = current.
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// `reset_accumulated_stat`: allocated = freed = 0.
    pub fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}

/// A statistic kept for `all`, `small_pool` and `large_pool` (PyTorch's `StatArray`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray {
    /// Both pools together (`.all.`).
    pub all: Stat,
    /// The small pool (`.small_pool.`).
    pub small_pool: Stat,
    /// The large pool (`.large_pool.`).
    pub large_pool: Stat,
}

impl StatArray {
    /// Increases the aggregate and the given pool's stat (PyTorch's `for_each_selected_stat_type`).
    #[inline]
    pub fn increase(&mut self, pool: PoolKind, n: u64) {
        self.all.increase(n);
        self.pool_mut(pool).increase(n);
    }

    /// Decreases the aggregate and the given pool's stat.
    #[inline]
    pub fn decrease(&mut self, pool: PoolKind, n: u64) {
        self.all.decrease(n);
        self.pool_mut(pool).decrease(n);
    }

    /// The stat of one pool.
    #[inline]
    pub fn pool_mut(&mut self, pool: PoolKind) -> &mut Stat {
        match pool {
            PoolKind::Small => &mut self.small_pool,
            PoolKind::Large => &mut self.large_pool,
        }
    }

    /// The stat of one pool.
    pub fn pool(&self, pool: PoolKind) -> &Stat {
        match pool {
            PoolKind::Small => &self.small_pool,
            PoolKind::Large => &self.large_pool,
        }
    }

    fn each_mut(&mut self) -> [&mut Stat; 3] {
        [&mut self.all, &mut self.small_pool, &mut self.large_pool]
    }

    fn named(&self) -> [(&'static str, &Stat); 3] {
        [
            ("all", &self.all),
            ("small_pool", &self.small_pool),
            ("large_pool", &self.large_pool),
        ]
    }
}

/// Everything `torch.cuda.memory_stats()` reports for one device (§8.2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryStats {
    /// `allocation`: live allocations (blocks handed out).
    pub allocation: StatArray,
    /// `segment`: cudaMalloc segments (not counted for expandable mappings).
    pub segment: StatArray,
    /// `active`: blocks allocated or waiting for stream events.
    pub active: StatArray,
    /// `inactive_split`: free blocks inside split segments.
    pub inactive_split: StatArray,
    /// `allocated_bytes`: bytes of allocated blocks (rounded sizes).
    pub allocated_bytes: StatArray,
    /// `reserved_bytes`: bytes obtained from the device.
    pub reserved_bytes: StatArray,
    /// `active_bytes`: bytes of active blocks.
    pub active_bytes: StatArray,
    /// `inactive_split_bytes`: bytes of inactive split blocks.
    pub inactive_split_bytes: StatArray,
    /// `requested_bytes`: unrounded requested bytes of active blocks.
    pub requested_bytes: StatArray,
    /// `num_alloc_retries`: retried `alloc_block` calls (§3.3).
    pub num_alloc_retries: i64,
    /// `num_ooms`: out-of-memory errors raised.
    pub num_ooms: i64,
    /// `num_sync_all_streams`: calls of `synchronize_and_free_events`.
    pub num_sync_all_streams: i64,
    /// `num_device_alloc`: cudaMalloc and map calls.
    pub num_device_alloc: i64,
    /// `num_device_free`: cudaFree and unmap calls.
    pub num_device_free: i64,
    /// `max_split_size`: the setting at allocator construction (SIZE_MAX shows as −1).
    pub max_split_size: i64,
    /// `oversize_allocations`: allocations of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// `oversize_segments`: segments of at least `max_split_size`.
    pub oversize_segments: Stat,
}

impl Default for MemoryStats {
    fn default() -> Self {
        MemoryStats {
            allocation: StatArray::default(),
            segment: StatArray::default(),
            active: StatArray::default(),
            inactive_split: StatArray::default(),
            allocated_bytes: StatArray::default(),
            reserved_bytes: StatArray::default(),
            active_bytes: StatArray::default(),
            inactive_split_bytes: StatArray::default(),
            requested_bytes: StatArray::default(),
            num_alloc_retries: 0,
            num_ooms: 0,
            num_sync_all_streams: 0,
            num_device_alloc: 0,
            num_device_free: 0,
            max_split_size: -1,
            oversize_allocations: Stat::default(),
            oversize_segments: Stat::default(),
        }
    }
}

impl MemoryStats {
    /// The stat arrays with their PyTorch names, in declaration order.
    pub fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// Moves the statistics on by `n` repetitions of what they did since `before`, a state with the
    /// same blocks (so the same current values): each running total (`allocated`, `freed`, the
    /// `num_*` counters) grows by `n` times its growth since then; peaks stay, since the repetitions
    /// reach what the last one reached.
    pub fn carry_repetitions(&mut self, before: &MemoryStats, n: u64) {
        let now = self.clone();
        self.add_repetitions(before, &now, n as i64);
    }

    /// Whether every statistic's peak equals `other`'s.
    pub fn same_peaks(&self, other: &MemoryStats) -> bool {
        fn peaks(s: &MemoryStats) -> impl Iterator<Item = i64> + '_ {
            s.arrays()
                .into_iter()
                .flat_map(|(_, a)| a.named().map(|(_, stat)| stat.peak))
                .chain([s.oversize_allocations.peak, s.oversize_segments.peak])
        }
        peaks(self).eq(peaks(other))
    }

    /// Adds `n` repetitions of the growth from `before` to `after` (two states with the same blocks)
    /// to each running total (`allocated`, `freed`, the `num_*` counters); peaks and current values
    /// stay. A negative `n` takes repetitions away.
    pub fn add_repetitions(&mut self, before: &MemoryStats, after: &MemoryStats, n: i64) {
        let carry = |now: &mut Stat, after: &Stat, then: &Stat| {
            now.allocated += (after.allocated - then.allocated) * n;
            now.freed += (after.freed - then.freed) * n;
        };
        for ((now, after), then) in self
            .arrays_mut()
            .into_iter()
            .zip(after.arrays())
            .zip(before.arrays())
        {
            let after = [&after.1.all, &after.1.small_pool, &after.1.large_pool];
            let then = [&then.1.all, &then.1.small_pool, &then.1.large_pool];
            for ((now, after), then) in now.each_mut().into_iter().zip(after).zip(then) {
                carry(now, after, then);
            }
        }
        carry(
            &mut self.oversize_allocations,
            &after.oversize_allocations,
            &before.oversize_allocations,
        );
        carry(
            &mut self.oversize_segments,
            &after.oversize_segments,
            &before.oversize_segments,
        );
        for (now, after, then) in [
            (
                &mut self.num_alloc_retries,
                after.num_alloc_retries,
                before.num_alloc_retries,
            ),
            (&mut self.num_ooms, after.num_ooms, before.num_ooms),
            (
                &mut self.num_sync_all_streams,
                after.num_sync_all_streams,
                before.num_sync_all_streams,
            ),
            (
                &mut self.num_device_alloc,
                after.num_device_alloc,
                before.num_device_alloc,
            ),
            (
                &mut self.num_device_free,
                after.num_device_free,
                before.num_device_free,
            ),
        ] {
            *now += (after - then) * n;
        }
    }

    /// `reset_peak_memory_stats`: every peak becomes the current value.
    pub fn reset_peak(&mut self) {
        for array in self.arrays_mut() {
            array.each_mut().into_iter().for_each(Stat::reset_peak);
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// `reset_accumulated_memory_stats`: allocated/freed totals and counters go to zero
    /// (`max_split_size` is kept).
    pub fn reset_accumulated(&mut self) {
        for array in self.arrays_mut() {
            array
                .each_mut()
                .into_iter()
                .for_each(Stat::reset_accumulated);
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }

    /// The flat, sorted dictionary `torch.cuda.memory_stats()` returns
    /// (`"reserved_bytes.all.peak"`, `"num_ooms"`, ...).
    pub fn to_flat(&self) -> BTreeMap<String, i64> {
        let mut out = BTreeMap::new();
        let mut put_stat = |prefix: &str, stat: &Stat| {
            for (field, value) in [
                ("current", stat.current),
                ("peak", stat.peak),
                ("allocated", stat.allocated),
                ("freed", stat.freed),
            ] {
                out.insert(format!("{prefix}.{field}"), value);
            }
        };
        for (name, array) in self.arrays() {
            for (pool, stat) in array.named() {
                put_stat(&format!("{name}.{pool}"), stat);
            }
        }
        put_stat("oversize_allocations", &self.oversize_allocations);
        put_stat("oversize_segments", &self.oversize_segments);
        for (name, value) in [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_sync_all_streams", self.num_sync_all_streams),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
            ("max_split_size", self.max_split_size),
        ] {
            out.insert(name.to_string(), value);
        }
        out
    }
}
