//! The peaks a replay reports, over a stretch of its events: the whole replay's, and those since the
//! last carried steady state (from which a run with fewer repetitions is told: its peaks are those of
//! the stretches it keeps, one after the other).

use vramsim_traces::Category;

/// The highest figures seen over a stretch of events (every peak a report shows but the allocator
/// statistics' own).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Peaks {
    /// Highest allocated bytes.
    pub allocated: u64,
    /// The event where allocated bytes first reached it.
    pub allocated_event: u64,
    /// Live requested bytes by category at that event.
    pub categories: [u64; Category::ALL.len()],
    /// Highest reserved bytes.
    pub reserved: u64,
    /// The highest allocated bytes seen while reserved bytes stood at that peak.
    pub allocated_at_reserved: u64,
    /// Highest `reserved + context` of the process.
    pub device_used: u64,
    /// (highest allocated, highest reserved bytes) in each phase, by phase slot.
    pub phases: Vec<(u64, u64)>,
}

impl Peaks {
    /// Folds the figures after event `index` in (in phase slot `phase`, if any).
    #[inline]
    pub fn observe(
        &mut self,
        index: u64,
        allocated: u64,
        reserved: u64,
        device_used: u64,
        categories: &[u64; Category::ALL.len()],
        phase: Option<usize>,
    ) {
        if allocated > self.allocated {
            self.allocated = allocated;
            self.allocated_event = index;
            self.categories = *categories;
        }
        if reserved > self.reserved {
            self.reserved = reserved;
            self.allocated_at_reserved = allocated;
        } else if reserved == self.reserved {
            self.allocated_at_reserved = self.allocated_at_reserved.max(allocated);
        }
        self.device_used = self.device_used.max(device_used);
        if let Some(slot) = phase {
            if slot >= self.phases.len() {
                self.phases.resize(slot + 1, (0, 0));
            }
            let (a, r) = &mut self.phases[slot];
            *a = (*a).max(allocated);
            *r = (*r).max(reserved);
        }
    }

    /// The peaks of this stretch followed by `later` (the next stretch, its event indices renumbered
    /// by `moved`): each the higher, an earlier event keeping a tie, as one stretch observed through
    /// both would have it.
    pub fn then(&self, later: &Peaks, moved: impl Fn(u64) -> u64) -> Peaks {
        let mut out = self.clone();
        if later.allocated > out.allocated {
            out.allocated = later.allocated;
            out.allocated_event = moved(later.allocated_event);
            out.categories = later.categories;
        }
        if later.reserved > out.reserved {
            out.reserved = later.reserved;
            out.allocated_at_reserved = later.allocated_at_reserved;
        } else if later.reserved == out.reserved {
            out.allocated_at_reserved = out.allocated_at_reserved.max(later.allocated_at_reserved);
        }
        out.device_used = out.device_used.max(later.device_used);
        if later.phases.len() > out.phases.len() {
            out.phases.resize(later.phases.len(), (0, 0));
        }
        for (mine, theirs) in out.phases.iter_mut().zip(&later.phases) {
            mine.0 = mine.0.max(theirs.0);
            mine.1 = mine.1.max(theirs.1);
        }
        out
    }
}
