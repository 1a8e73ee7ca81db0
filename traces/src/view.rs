//! Events written once and read as others: a borrowed slice of events with its integer ids renamed
//! and some allocation sizes replaced, so that a step lowered once stands for the same step at another
//! batch size (its sizes) or later in a longer run (its ids) without a copy of its events. A replay
//! reads one through `vramsim_sim::engine::Replay::apply_view`.

use crate::event::Event;

/// Borrowed events as the events they stand for.
#[derive(Clone, Copy, Debug, Default)]
pub struct EventView<'a> {
    /// The events as written.
    pub events: &'a [Event],
    /// (index, bytes) of the allocations whose size is not the one written, by index; an index
    /// counts from `sizes_from` (the index it gives `events[0]`).
    pub sizes: &'a [(usize, u64)],
    /// The index `sizes` gives the first event.
    pub sizes_from: usize,
    /// (from, by): every integer id written at or above `from` stands for the id `by` higher (each
    /// pair applies, compared with the id as written: [`renamed_id`]).
    pub renames: &'a [(u64, u64)],
}

/// `id` as `renames` name it: moved up by every `by` whose `from` it reaches, modulo 2^64 (so that a
/// `by` of 2^64 − n moves it down by n: the ids after a repetition done no time).
#[inline]
pub fn renamed_id(id: u64, renames: &[(u64, u64)]) -> u64 {
    let mut out = id;
    for &(from, by) in renames {
        if id >= from {
            out = out.wrapping_add(by);
        }
    }
    out
}

impl<'a> EventView<'a> {
    /// The view's events, each with the size its allocation stands for (`None`: as written).
    pub fn sized(&self) -> impl Iterator<Item = (&'a Event, Option<u64>)> + 'a {
        let mut sizes = self.sizes.iter().peekable();
        let from = self.sizes_from;
        self.events.iter().enumerate().map(move |(i, e)| {
            let size = match sizes.peek() {
                Some(&&(at, bytes)) if at == from + i => {
                    sizes.next();
                    Some(bytes)
                }
                _ => None,
            };
            (e, size)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{AllocId, Category};

    #[test]
    fn a_view_replaces_the_sizes_it_lists_and_renames_ids() {
        let alloc = |id: u64, size: u64| Event::Alloc {
            id: AllocId::Int(id),
            size,
            stream: 0,
            category: Category::Activation,
            tag: None,
        };
        let events = [alloc(1, 10), alloc(2, 20), alloc(3, 30)];
        // the sizes of events 11 and 12 of some longer trace whose events 10..13 these are
        let sizes = [(11, 200), (12, 300)];
        let view = EventView {
            events: &events,
            sizes: &sizes,
            sizes_from: 10,
            renames: &[],
        };
        let got: Vec<Option<u64>> = view.sized().map(|(_, s)| s).collect();
        assert_eq!(got, [None, Some(200), Some(300)]);
        // ids from 2 on move by 5, from 3 on by 100 more
        assert_eq!(renamed_id(1, &[(2, 5), (3, 100)]), 1);
        assert_eq!(renamed_id(2, &[(2, 5), (3, 100)]), 7);
        assert_eq!(renamed_id(3, &[(2, 5), (3, 100)]), 108);
    }
}
