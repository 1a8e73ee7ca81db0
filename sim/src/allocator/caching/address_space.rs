//! The simulated virtual address space: where `cudaMalloc` and `cuMemAddressReserve` put things.
//!
//! Addresses only need to be unique, ordered and deterministic: PyTorch's behaviour depends on address
//! order (ties in best fit, the `unmapped` set) but never on the values. A bump pointer that never reuses
//! addresses, starting at a typical CUDA user address and aligned to the 2 MiB granularity of the driver,
//! gives all three.
//!
//! Two things place ranges elsewhere: segments that exist before a trace starts (adopted at the addresses a
//! snapshot recorded), and *address hints*, the addresses a real GPU gave the segments of a recorded run
//! (`check-snapshot` replays with them, so that best-fit ties are broken by the same address order as on
//! the GPU: the driver's placement is not the allocator's to decide). From the first such range on, every
//! live range is remembered until it is released; a hint is taken only where its range overlaps no live
//! range (nor the untracked bump region before that), and the bump pointer stays above every range placed
//! so far, so that a segment the record gives no address for (one made in a `malloc` that then failed)
//! lands above the others, as a growing driver address space puts it.

use std::collections::BTreeMap;

/// Where the first segment goes (a typical CUDA device pointer on Linux x86-64).
pub const ADDRESS_SPACE_START: u64 = 0x7f00_0000_0000;
/// Alignment of every reservation: the driver's 2 MiB allocation granularity.
pub const ADDRESS_ALIGNMENT: u64 = 2 << 20;

/// A bump allocator of virtual addresses, with ranges placed at given addresses.
#[derive(Clone, Debug)]
pub struct AddressSpace {
    next: u64,
    /// Live ranges, once tracking has started: start → end.
    placed: BTreeMap<u64, u64>,
    /// Addresses the next reservations should get, in order of preference.
    hints: Vec<u64>,
    /// Whether live ranges are tracked (from the first placed range or hint on).
    tracking: bool,
    /// End of the bump region handed out before tracking started (never reused).
    untracked_end: u64,
}

impl Default for AddressSpace {
    fn default() -> Self {
        AddressSpace {
            next: ADDRESS_SPACE_START,
            placed: BTreeMap::new(),
            hints: Vec::new(),
            tracking: false,
            untracked_end: ADDRESS_SPACE_START,
        }
    }
}

/// `bytes` rounded up to the driver's granularity (at least one granule).
fn span(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(ADDRESS_ALIGNMENT) * ADDRESS_ALIGNMENT
}

impl AddressSpace {
    /// Reserves `bytes` (> 0) and returns the start of the range: the first usable hint, else the next
    /// 2 MiB-aligned address of the bump region that overlaps no placed range.
    #[inline]
    pub fn reserve(&mut self, bytes: u64) -> u64 {
        let span = span(bytes);
        if !self.hints.is_empty() {
            if let Some(pos) = self
                .hints
                .iter()
                .position(|&h| self.conflict(h, span).is_none())
            {
                let addr = self.hints.remove(pos);
                self.track(addr, addr + span);
                return addr;
            }
        }
        let addr = self.next;
        let end = addr
            .checked_add(span)
            .expect("simulated address space exhausted");
        if self.tracking {
            self.track(addr, end);
        } else {
            self.next = end;
            self.untracked_end = end;
        }
        addr
    }

    /// Remembers a live range; the bump pointer moves above it.
    fn track(&mut self, addr: u64, end: u64) {
        self.tracking = true;
        self.placed.insert(addr, end);
        self.next = self
            .next
            .max(end.div_ceil(ADDRESS_ALIGNMENT) * ADDRESS_ALIGNMENT);
    }

    /// Places `[addr, addr + bytes)` at its own address (an adopted segment or reservation); on overlap,
    /// the range in the way as (start, end).
    pub fn place(&mut self, addr: u64, bytes: u64) -> Result<(), (u64, u64)> {
        let end = addr.checked_add(bytes.max(1)).ok_or((addr, u64::MAX))?;
        if let Some(other) = self.conflict(addr, end - addr) {
            return Err(other);
        }
        self.track(addr, end);
        Ok(())
    }

    /// Writes what decides where the next reservations go (for a replay's steady-state check); false
    /// once ranges are placed at given addresses or hints wait (then no two states are compared).
    pub fn steady_state_key(&self, key: &mut Vec<u64>) -> bool {
        if self.tracking || !self.hints.is_empty() {
            return false;
        }
        key.extend([self.next, self.untracked_end]);
        true
    }

    /// Forgets a placed range (its segment was freed); ranges from the bump region are never reused.
    #[inline]
    pub fn release(&mut self, addr: u64) {
        if self.tracking {
            self.placed.remove(&addr);
        }
    }

    /// Sets the addresses the next reservations should get (replacing earlier hints).
    pub fn set_hints(&mut self, hints: &[u64]) {
        self.hints.clear();
        self.hints.extend_from_slice(hints);
    }

    /// The range `[addr, addr + span)` would overlap: a live range, or the bump region handed out
    /// before tracking began (or any of the bump region, when nothing is tracked).
    fn conflict(&self, addr: u64, span: u64) -> Option<(u64, u64)> {
        let Some(end) = addr.checked_add(span) else {
            return Some((addr, u64::MAX));
        };
        if addr < self.untracked_end && end > ADDRESS_SPACE_START {
            return Some((ADDRESS_SPACE_START, self.untracked_end));
        }
        self.placed_overlap(addr, end)
    }

    /// The placed range overlapping `[addr, end)`, if any.
    fn placed_overlap(&self, addr: u64, end: u64) -> Option<(u64, u64)> {
        if self.placed.is_empty() {
            return None;
        }
        // the last range starting before `end` is the only candidate that can reach past `addr`
        let (&start, &stop) = self.placed.range(..end).next_back()?;
        (stop > addr).then_some((start, stop))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_are_taken_when_free_and_the_bump_stays_above_placed_ranges() {
        let mut space = AddressSpace::default();
        assert_eq!(space.reserve(2 << 20), ADDRESS_SPACE_START);
        let at = ADDRESS_SPACE_START + (4 << 20);
        assert!(space.place(ADDRESS_SPACE_START, 512).is_err(), "handed out");
        space.place(at, 2 << 20).unwrap();
        assert_eq!(
            space.reserve(4 << 20),
            at + (2 << 20),
            "above the placed range"
        );
        space.release(at);
        space.set_hints(&[at]);
        assert_eq!(space.reserve(2 << 20), at, "free again once released");
        space.set_hints(&[0x1000_0000, 0x1000_0000]);
        assert_eq!(space.reserve(20 << 20), 0x1000_0000);
        assert_ne!(
            space.reserve(20 << 20),
            0x1000_0000,
            "taken: the overlap falls back"
        );
        space.release(0x1000_0000);
        space.set_hints(&[0x1000_0000]);
        assert_eq!(
            space.reserve(20 << 20),
            0x1000_0000,
            "free again once released"
        );
        assert!(space.place(0x1000_0000 + (2 << 20), 512).is_err());
    }
}
