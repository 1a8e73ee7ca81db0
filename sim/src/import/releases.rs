//! Who released: a run of `segment_free`/`segment_unmap` entries is the program's `empty_cache` or the
//! allocator's own release inside a `malloc` (see *Releases* in the module doc of [`super`]), and the
//! deferred completions around such runs.

use std::collections::HashMap;

use vramsim_traces::snapshot::{Action, TraceEntry};
use vramsim_traces::{Event, Pool};

use crate::config::AllocatorConfig;
use crate::rounding::{round_size, PoolKind};

use super::expandable::ExpandableLayout;
use super::{segment_pool, Recorded, Release, ReleaseCause};

/// Classifies every run of releases of the history (and every `empty_cache` that released nothing) into
/// `rec.releases`.
pub(super) fn classify_releases(
    entries: &[TraceEntry],
    initial: &[Event],
    reserved_before: &[u64],
    config: &AllocatorConfig,
    rec: &mut Recorded,
) {
    let is_release =
        |e: &TraceEntry| matches!(e.action, Action::SegmentFree | Action::SegmentUnmap);
    let mut layout = ExpandableLayout::new(entries, initial, config);
    // Completions just before a release may be that release's own synchronize_and_free_events (§5.3),
    // after the cache search: a run is judged with them still waiting.
    let mut held: Vec<usize> = Vec::new();
    let leading = leading_completions(entries);
    let mut i = 0;
    while i < entries.len() {
        if !is_release(&entries[i]) {
            if i >= leading
                && is_deferred_completion(entries, i)
                && ends_silent_empty_cache(entries, i)
            {
                // deferred frees returned to the cache outside any malloc: only empty_cache does that
                let mut start = i;
                while start > 0 && is_deferred_completion(entries, start - 1) {
                    start -= 1;
                }
                rec.releases.push(Release {
                    entry: start,
                    len: i + 1 - start,
                    bytes: 0,
                    reserved_before: reserved_before[i],
                    followed_by_segment: None,
                    cause: ReleaseCause::EmptyCache,
                    reason: "deferred frees completed outside any malloc, which only empty_cache does (§5.3); it released no segment".to_owned(),
                });
            }
            if entries[i].action == Action::FreeCompleted {
                held.push(i);
            } else {
                for j in held.drain(..) {
                    layout.apply(entries, j);
                }
                layout.apply(entries, i);
            }
            i += 1;
            continue;
        }
        let start = i;
        while i < entries.len() && is_release(&entries[i]) {
            i += 1;
        }
        let run = &entries[start..i];
        let bytes = run.iter().map(|e| e.size).sum();
        let before = reserved_before[start];
        let waiting: Vec<u64> = held.iter().map(|&j| entries[j].addr).collect();
        let (cause, reason, followed_by_segment) = classify_run(
            entries,
            (start, i),
            before,
            config,
            rec.peak_reserved,
            (&layout, &waiting),
        );
        for j in held.drain(..).chain(start..i) {
            layout.apply(entries, j);
        }
        rec.releases.push(Release {
            entry: start,
            len: i - start,
            bytes,
            reserved_before: before,
            followed_by_segment,
            cause,
            reason,
        });
    }
}

/// The `free_completed` entries the ring buffer starts with: they may complete frees whose
/// `free_requested` just missed the buffer, or belong to the `malloc` or release that follows.
pub(super) fn leading_completions(entries: &[TraceEntry]) -> usize {
    entries
        .iter()
        .take_while(|e| e.action == Action::FreeCompleted)
        .count()
}

/// Whether the entry at `i` is the `free_completed` of a deferred free (not right after its own
/// `free_requested`).
fn is_deferred_completion(entries: &[TraceEntry], i: usize) -> bool {
    let e = &entries[i];
    e.action == Action::FreeCompleted
        && !(i > 0
            && entries[i - 1].action == Action::FreeRequested
            && entries[i - 1].addr == e.addr)
}

/// Whether the deferred completion at `i` is the last of a run that no `malloc` or release follows
/// (the run belongs to an `empty_cache` that found nothing to release).
fn ends_silent_empty_cache(entries: &[TraceEntry], i: usize) -> bool {
    match entries.get(i + 1).map(|e| &e.action) {
        Some(Action::FreeCompleted) => !is_deferred_completion(entries, i + 1),
        Some(
            Action::Alloc
            | Action::SegmentAlloc
            | Action::SegmentMap
            | Action::SegmentFree
            | Action::SegmentUnmap
            | Action::Oom,
        ) => false,
        _ => true,
    }
}

/// Whether the `free_completed` at `i` belongs to a run of completions followed by a release the
/// allocator made inside a `malloc`, or by an `oom`.
pub(super) fn completes_in_release(
    entries: &[TraceEntry],
    i: usize,
    releases: &HashMap<usize, &Release>,
) -> bool {
    let mut j = i;
    while j < entries.len() && entries[j].action == Action::FreeCompleted {
        j += 1;
    }
    match entries.get(j).map(|e| &e.action) {
        Some(Action::Oom) => true,
        Some(Action::SegmentFree | Action::SegmentUnmap) => releases
            .get(&j)
            .is_some_and(|r| r.cause == ReleaseCause::Allocator),
        _ => false,
    }
}

/// Who made the release `entries[start..end]` (see the module doc of [`super`]), why, and the bytes of the new
/// segment that follows it.
/// `waiting`: blocks whose completion right before the run may belong to it (see the caller).
fn classify_run(
    entries: &[TraceEntry],
    (start, end): (usize, usize),
    before: u64,
    config: &AllocatorConfig,
    peak: u64,
    (layout, waiting): (&ExpandableLayout, &[u64]),
) -> (ReleaseCause, String, Option<u64>) {
    let mut j = end;
    while j < entries.len() && entries[j].action == Action::Snapshot {
        j += 1;
    }
    let Some(next) = entries.get(j) else {
        return (
            ReleaseCause::EmptyCache,
            "nothing follows it: no request was waiting".to_owned(),
            None,
        );
    };
    if next.action == Action::Oom {
        return (
            ReleaseCause::Allocator,
            format!("the out-of-memory at entry {j} follows it (§3 step 4e release before the last retry)"),
            None,
        );
    }
    if !matches!(next.action, Action::SegmentAlloc | Action::SegmentMap) {
        return (
            ReleaseCause::EmptyCache,
            format!(
                "entry {j} ({}) follows it, not a new segment for a waiting request",
                next.action
            ),
            None,
        );
    }
    let mut need = 0u64;
    let mut k = j;
    while k < entries.len()
        && matches!(entries[k].action, Action::SegmentAlloc | Action::SegmentMap)
    {
        need = need.saturating_add(entries[k].size);
        k += 1;
    }
    let Some(request) = entries.get(k).filter(|e| e.action == Action::Alloc) else {
        return (
            ReleaseCause::EmptyCache,
            "the new segment after it serves no recorded request".to_owned(),
            Some(need),
        );
    };
    if config.garbage_collection_enabled() || config.max_split_size != u64::MAX {
        return (
            ReleaseCause::Allocator,
            "garbage collection (§5.4) or the oversize release (§5.2) may release inside a malloc"
                .to_owned(),
            Some(need),
        );
    }
    let rounded = round_size(request.size, config);
    let pool: Pool = PoolKind::of(rounded).into();
    if entries[j].action == Action::SegmentMap {
        // expandable segments: what the first attempt, before the release, would have mapped
        return match layout.mapping_needed(request.stream, rounded) {
            None => (
                ReleaseCause::EmptyCache,
                format!(
                    "a free block could have served the next request of {} bytes from the cache (§3.1)",
                    request.size
                ),
                Some(need),
            ),
            Some(first) if before.saturating_add(first) <= peak => (
                ReleaseCause::EmptyCache,
                format!(
                    "before the release the next request would have mapped {first} bytes (§7.2), which fitted next to the {before} bytes reserved (the device held {peak} bytes at its peak)"
                ),
                Some(need),
            ),
            Some(first) => (
                ReleaseCause::Allocator,
                format!(
                    "before the release the next request needed {first} more bytes mapped (§7.2), which did not fit next to the {before} bytes reserved (§3 step 4e)"
                ),
                Some(first),
            ),
        };
    }
    let servable = entries[start..end].iter().find(|e| {
        e.action == Action::SegmentFree
            && e.stream == request.stream
            && segment_pool(e.size) == pool
            && e.size >= rounded
            // a segment freed by a completion of the release itself was not in the cache before
            && !waiting.iter().any(|&w| w >= e.addr && w - e.addr < e.size)
    });
    if let Some(s) = servable {
        return (
            ReleaseCause::EmptyCache,
            format!(
                "the released segment {:#x} ({} bytes) could have served the next request of {} bytes from the cache (§3.1)",
                s.addr, s.size, request.size
            ),
            Some(need),
        );
    }
    if before.saturating_add(need) <= peak {
        return (
            ReleaseCause::EmptyCache,
            format!(
                "the new {need}-byte segment fitted next to the {before} bytes reserved before it (the device held {peak} bytes at its peak)"
            ),
            Some(need),
        );
    }
    (
        ReleaseCause::Allocator,
        format!(
            "the next request needed a new {need}-byte segment that did not fit next to the {before} bytes reserved before (§3 step 4e)"
        ),
        Some(need),
    )
}
