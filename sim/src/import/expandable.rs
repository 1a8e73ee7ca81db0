//! The recorded layout of expandable segments replayed forward, for the release classification: how
//! many bytes a request would have had to map at a given moment (§7.2), counted in the allocator's own
//! pages ([`page_size`], [`whole_pages`]).

use std::collections::BTreeMap;

use vramsim_traces::snapshot::{Action, TraceEntry};
use vramsim_traces::{Event, Pool, StreamId};

use crate::allocator::caching::expandable::{page_size, whole_pages};
use crate::config::AllocatorConfig;
use crate::rounding::{round_size, PoolKind};

/// The recorded layout of expandable segments, replayed forward: mapped ranges (by stream and pool) and
/// the live blocks in them (an expandable block is exactly its rounded request, §3.2). Enough to say how
/// many bytes a request would have had to map at a given moment (§7.2).
pub(super) struct ExpandableLayout<'c> {
    /// Mapped ranges: start → (end, stream, pool).
    ranges: BTreeMap<u64, (u64, StreamId, Pool)>,
    /// Live blocks (allocated or waiting for events): start → end.
    blocks: BTreeMap<u64, u64>,
    /// For each entry, the pool of the next request (`alloc` or `oom`) at or after it.
    pub next_pool: Vec<Option<Pool>>,
    /// The settings (rounding, page sizes).
    config: &'c AllocatorConfig,
    /// For each entry, its size, rounded for an `alloc` (§1.2).
    rounded: Vec<u64>,
}

impl<'c> ExpandableLayout<'c> {
    pub fn new(entries: &[TraceEntry], initial: &[Event], config: &'c AllocatorConfig) -> Self {
        let mut layout = ExpandableLayout {
            ranges: BTreeMap::new(),
            blocks: BTreeMap::new(),
            next_pool: vec![None; entries.len()],
            config,
            rounded: entries
                .iter()
                .map(|e| match e.action {
                    Action::Alloc => round_size(e.size, config),
                    _ => e.size,
                })
                .collect(),
        };
        if !entries
            .iter()
            .any(|e| matches!(e.action, Action::SegmentMap | Action::SegmentUnmap))
            && !initial
                .iter()
                .any(|e| matches!(e, Event::Segment(s) if s.expandable))
        {
            return layout; // nothing expandable: the layout stays empty
        }
        let mut pool = None;
        for i in (0..entries.len()).rev() {
            if matches!(entries[i].action, Action::Alloc | Action::Oom) {
                pool = Some(PoolKind::of(layout.rounded[i]).into());
            }
            layout.next_pool[i] = pool;
        }
        for e in initial {
            if let Event::Segment(seg) = e {
                if seg.expandable {
                    layout.map(seg.addr, seg.size, seg.stream, seg.pool);
                    for b in &seg.blocks {
                        layout
                            .blocks
                            .insert(seg.addr + b.offset, seg.addr + b.offset + b.size);
                    }
                }
            }
        }
        layout
    }

    fn map(&mut self, addr: u64, size: u64, stream: StreamId, pool: Pool) {
        let (mut start, mut end) = (addr, addr + size);
        if let Some((&s, &(e, st, p))) = self.ranges.range(..addr).next_back() {
            if e == addr && st == stream && p == pool {
                self.ranges.remove(&s);
                start = s;
            }
        }
        if let Some(&(e, st, p)) = self.ranges.get(&end) {
            if st == stream && p == pool {
                self.ranges.remove(&end);
                end = e;
            }
        }
        self.ranges.insert(start, (end, stream, pool));
    }

    fn unmap(&mut self, addr: u64, size: u64) {
        let end = addr + size;
        let Some((&s, &(e, st, p))) = self.ranges.range(..=addr).next_back() else {
            return;
        };
        if e < end {
            return;
        }
        self.ranges.remove(&s);
        if s < addr {
            self.ranges.insert(s, (addr, st, p));
        }
        if end < e {
            self.ranges.insert(end, (e, st, p));
        }
    }

    /// The pool of the mapped range holding `addr`.
    pub fn pool_at(&self, addr: u64) -> Option<Pool> {
        let (_, &(end, _, pool)) = self.ranges.range(..=addr).next_back()?;
        (addr < end).then_some(pool)
    }

    /// Whether any range of `stream` and `pool` is mapped.
    pub fn has_ranges(&self, stream: StreamId, pool: Pool) -> bool {
        self.ranges
            .values()
            .any(|&(_, st, p)| st == stream && p == pool)
    }

    /// Applies entry `i`.
    pub fn apply(&mut self, entries: &[TraceEntry], i: usize) {
        let e = &entries[i];
        match e.action {
            Action::SegmentMap => {
                let pool = self.next_pool[i].unwrap_or(Pool::Large);
                self.map(e.addr, e.size, e.stream, pool);
            }
            Action::SegmentUnmap => self.unmap(e.addr, e.size),
            Action::Alloc if !self.ranges.is_empty() => {
                self.blocks.insert(e.addr, e.addr + self.rounded[i]);
            }
            Action::FreeCompleted => {
                self.blocks.remove(&e.addr);
            }
            _ => {}
        }
    }

    /// The bytes a request of `rounded` bytes on `stream` would map now (§7.2
    /// `find_expandable_block` + `map_block`), or `None` if a cached block serves it (§3.1) or nothing
    /// expandable is known.
    pub fn mapping_needed(&self, stream: StreamId, rounded: u64) -> Option<u64> {
        let kind = PoolKind::of(rounded);
        let pool = Pool::from(kind);
        let page = page_size(kind, self.config);
        let ranges: Vec<(u64, u64)> = self
            .ranges
            .iter()
            .filter(|(_, &(_, st, p))| st == stream && p == pool)
            .map(|(&s, &(e, _, _))| (s, e))
            .collect();
        // free blocks of the ranges: the gaps between live blocks
        let live_in = |s: u64, e: u64| self.blocks.range(s..e);
        for &(s, e) in &ranges {
            let mut cursor = s;
            for (&b, &be) in live_in(s, e) {
                if b - cursor >= rounded {
                    return None;
                }
                cursor = be.max(cursor);
            }
            if e.saturating_sub(cursor) >= rounded {
                return None;
            }
        }
        let pages = |bytes: u64| whole_pages(bytes, page);
        if ranges.is_empty() {
            return Some(pages(rounded));
        }
        let free_tail = |k: usize| {
            let (s, e) = ranges[k];
            let last_end = live_in(s, e).map(|(_, &be)| be).max().unwrap_or(s);
            e.saturating_sub(last_end)
        };
        let free_prefix = |k: usize| {
            let (s, e) = ranges[k];
            live_in(s, e).next().map_or(e - s, |(&b, _)| b - s)
        };
        // the unmapped blocks in address order: after each range (the last one unbounded)
        'candidates: for k in 0..ranges.len() {
            let mut remaining = rounded.saturating_sub(free_tail(k));
            let mut mapped = 0;
            let mut j = k;
            loop {
                let gap = ranges.get(j + 1).map_or(u64::MAX, |n| n.0 - ranges[j].1);
                let take = gap.min(remaining);
                mapped += pages(take);
                remaining -= take;
                if remaining == 0 {
                    return Some(mapped);
                }
                let next = j + 1;
                let prefix = free_prefix(next);
                if prefix >= remaining {
                    return Some(mapped);
                }
                if prefix < ranges[next].1 - ranges[next].0 {
                    continue 'candidates;
                }
                remaining -= prefix;
                j = next;
            }
        }
        Some(pages(rounded))
    }
}
