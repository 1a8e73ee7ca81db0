//! Size rounding and segment sizing: PyTorch's `round_size` and `get_allocation_size` (fact sheet §1).

use vramsim_traces::Pool;

use crate::config::AllocatorConfig;

/// `kMinBlockSize`: every request is rounded up to a multiple of 512 bytes (§1.1).
pub const MIN_BLOCK_SIZE: u64 = 512;
/// `kSmallSize`: rounded sizes up to 1 MiB are served from the small pool (§1.1).
pub const SMALL_SIZE: u64 = 1 << 20;
/// `kSmallBuffer`: segment size of the small pool, 2 MiB (§1.1).
pub const SMALL_BUFFER: u64 = 2 << 20;
/// `kMinLargeAlloc`: large requests below 10 MiB get a whole `large_segment_size` segment (§1.1).
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// `kLargeBuffer`: 20 MiB, the default large segment size and non-split rounding tolerance (§1.1).
pub const LARGE_BUFFER: u64 = 20 << 20;
/// `kRoundLarge`: large requests of 10 MiB or more are cudaMalloc'd in multiples of 2 MiB (§1.1).
pub const ROUND_LARGE: u64 = 2 << 20;
/// PyTorch refuses requests of 2^60 bytes or more outright ("more than 1EB memory", §3).
pub const MAX_REQUEST: u64 = 1 << 60;

/// Which of the two default block pools a rounded size belongs to (§1.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// Rounded sizes ≤ 1 MiB, carved from 2 MiB segments.
    Small,
    /// Everything larger.
    Large,
}

impl PoolKind {
    /// §1.3 `get_pool`: small iff the rounded size is at most 1 MiB.
    pub fn of(rounded: u64) -> PoolKind {
        if rounded <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// The name PyTorch uses in stats keys and snapshots (`small_pool`, `large_pool`).
    pub fn stat_name(self) -> &'static str {
        match self {
            PoolKind::Small => "small_pool",
            PoolKind::Large => "large_pool",
        }
    }
}

/// A trace's pool (`segment` events) is the allocator's pool kind.
impl From<Pool> for PoolKind {
    fn from(pool: Pool) -> PoolKind {
        match pool {
            Pool::Small => PoolKind::Small,
            Pool::Large => PoolKind::Large,
        }
    }
}

impl From<PoolKind> for Pool {
    fn from(kind: PoolKind) -> Pool {
        match kind {
            PoolKind::Small => Pool::Small,
            PoolKind::Large => Pool::Large,
        }
    }
}

/// §1.2 `round_size`: the block size a request of `size` bytes occupies.
pub fn round_size(size: u64, config: &AllocatorConfig) -> u64 {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    let divisions = config.roundup_power2_divisions(size);
    // saturating: nothing bounds divisions (a power of two of 2^55 or more would overflow)
    if divisions > 1 && size > MIN_BLOCK_SIZE.saturating_mul(divisions) {
        roundup_power2_next_division(size, divisions)
    } else {
        size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
    }
}

/// §1.2 `roundup_power2_next_division`: rounds `size` up to the next of `divisions` equal steps between
/// two powers of two (a non-power-of-two `divisions` acts as its power-of-two floor).
pub fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> (63 - divisions.leading_zeros());
    if step == 0 {
        return floor * 2;
    }
    let rounded_down = size - size % step;
    if rounded_down == size {
        size
    } else {
        rounded_down + step
    }
}

/// §1.4 `get_allocation_size`: the cudaMalloc size of a new segment for a block of `rounded` bytes.
pub fn get_allocation_size(rounded: u64, config: &AllocatorConfig) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        config.large_segment_size
    } else {
        rounded.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}
