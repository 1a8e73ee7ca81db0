//! The trace's events and `meta`: the initial state, then one event per recorded request, deferred frees
//! on their synthetic streams, and the releases read as `empty_cache` (the table in the module doc of
//! [`super`]).

use std::collections::HashMap;

use vramsim_traces::snapshot::{Action, Snapshot, TraceEntry};
use vramsim_traces::{AllocId, Category, Event, Meta};

use super::initial::Initial;
use super::releases::{completes_in_release, leading_completions};
use super::streams::{deferred_completions, SyntheticStreams};
use super::{Capacity, Recorded, Release, ReleaseCause};

/// The events of the trace (the initial state's first) and, for each, the recorded entry it stands for.
pub(super) fn events(
    entries: &[TraceEntry],
    initial: Initial,
    rec: &mut Recorded,
) -> (Vec<Event>, Vec<Option<u32>>) {
    let Initial {
        events: initial_events,
        pending: pending_at_start,
        live: mut live_ids,
    } = initial;
    let mut events = initial_events;
    let mut origins = vec![None; events.len()];
    let deferred = deferred_completions(entries);
    rec.deferred_frees = deferred.iter().filter(|d| d.is_some()).count() as u64;
    let mut streams = SyntheticStreams::default();
    let release_at: HashMap<usize, &Release> = rec.releases.iter().map(|r| (r.entry, r)).collect();
    // runs of deferred completions that are an empty_cache releasing nothing: entry → last entry
    let silent: HashMap<usize, usize> = rec
        .releases
        .iter()
        .filter(|r| r.bytes == 0 && entries[r.entry].action == Action::FreeCompleted)
        .flat_map(|r| (r.entry..r.entry + r.len).map(move |j| (j, r.entry + r.len - 1)))
        .collect();
    // blocks waiting at the start: freed now, through their synthetic streams (those the buffer starts
    // by completing, unless a release follows, as if their free had been immediate)
    let leading = leading_completions(entries);
    for &baddr in &pending_at_start {
        let completion = entries
            .iter()
            .position(|e| e.action == Action::FreeCompleted && e.addr == baddr);
        let id = AllocId::Int(baddr);
        if completion.is_some_and(|c| c < leading && !completes_in_release(entries, c, &release_at))
        {
            events.push(Event::Free { id });
            origins.push(None);
            live_ids.remove(&baddr);
            continue;
        }
        events.extend(streams.deferred_free(baddr, completion));
        origins.extend([None, None, None]);
        live_ids.remove(&baddr);
    }
    let mut i = 0;
    while i < entries.len() {
        let e = &entries[i];
        let origin = Some(i as u32);
        match e.action {
            Action::Alloc => {
                if !live_ids.insert(e.addr) {
                    rec.notes.push(format!(
                        "entry {i}: alloc of {:#x}, which is already live: its free was not recorded, freed here",
                        e.addr
                    ));
                    events.push(Event::Free {
                        id: AllocId::Int(e.addr),
                    });
                    origins.push(origin);
                }
                events.push(Event::Alloc {
                    id: AllocId::Int(e.addr),
                    size: e.size,
                    stream: e.stream,
                    category: Category::Other,
                    tag: None,
                });
                origins.push(origin);
            }
            Action::FreeRequested => {
                if !live_ids.remove(&e.addr) {
                    rec.notes.push(format!(
                        "entry {i}: free_requested of {:#x}, which is not live: left out",
                        e.addr
                    ));
                } else if let Some(completion) = deferred[i].or_else(|| {
                    // Completed at once, but right before the allocator's own release or an oom: the
                    // block may have waited for stream events that only that release's
                    // synchronize_and_free_events completed (§5.3). Replaying it as waiting is
                    // equivalent when it did not wait (the failed search failed with it cached too).
                    let next = entries.get(i + 1)?;
                    (next.action == Action::FreeCompleted
                        && next.addr == e.addr
                        && completes_in_release(entries, i + 1, &release_at))
                    .then_some(i + 1)
                }) {
                    let completion = (completion != usize::MAX).then_some(completion);
                    events.extend(streams.deferred_free(e.addr, completion));
                    origins.extend([origin, origin, origin]);
                } else {
                    events.push(Event::Free {
                        id: AllocId::Int(e.addr),
                    });
                    origins.push(origin);
                    let completed_next = entries
                        .get(i + 1)
                        .is_some_and(|n| n.action == Action::FreeCompleted && n.addr == e.addr);
                    if completed_next {
                        i += 1; // its free_completed
                    }
                }
            }
            Action::FreeCompleted if silent.contains_key(&i) => {
                streams.complete(e.addr);
                if silent[&i] == i {
                    streams.release_all();
                    events.push(Event::EmptyCache);
                    origins.push(origin);
                }
            }
            Action::FreeCompleted => {
                if let Some(s) = streams.complete(e.addr) {
                    // Completions right before the allocator's own release (or an oom) may be that
                    // release's synchronize_and_free_events (§5.3), which runs after the cache search:
                    // the replayed release completes them itself.
                    if !completes_in_release(entries, i, &release_at) {
                        events.push(Event::Sync { stream: Some(s) });
                        origins.push(origin);
                    }
                }
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                if let Some(run) = release_at.get(&i) {
                    // the allocator's own releases wait for every deferred free (§5.3)
                    streams.release_all();
                    let last = run.entry + run.len - 1;
                    if run.cause == ReleaseCause::EmptyCache {
                        events.push(Event::EmptyCache);
                        origins.push(Some(last as u32));
                    }
                    i = last;
                }
            }
            Action::Oom => {
                streams.release_all();
                events.push(Event::Alloc {
                    id: AllocId::Str(format!("oom@{i}").into()),
                    size: e.size,
                    stream: e.stream,
                    category: Category::Other,
                    tag: None,
                });
                origins.push(origin);
            }
            Action::SegmentAlloc | Action::SegmentMap | Action::Snapshot | Action::Other(_) => {}
        }
        i += 1;
    }
    (events, origins)
}

/// The trace's `meta`: where it came from and what the importer read and inferred.
pub(super) fn meta_of(snapshot: &Snapshot, device: u32, rec: &Recorded) -> Meta {
    use serde_json::json;
    let mut meta = Meta::new();
    meta.insert("source".into(), json!("pytorch-snapshot"));
    meta.insert("device".into(), json!(device));
    meta.insert("recorded_entries".into(), json!(rec.entries));
    if let Some(span) = rec.time_span_us {
        meta.insert("time_span_us".into(), json!(span));
    }
    if let Some(conf) = snapshot
        .allocator_settings
        .as_ref()
        .and_then(|s| s.pytorch_cuda_alloc_conf.as_ref())
    {
        meta.insert("alloc_conf".into(), json!(conf));
    }
    let i = &rec.initial;
    meta.insert(
        "initial_state".into(),
        json!({
            "segments": i.segments, "reserved_bytes": i.reserved, "allocated_bytes": i.allocated,
            "live_blocks": i.live_blocks, "inferred_block_sizes": i.inferred_block_sizes,
            "pending_frees": i.pending_frees,
        }),
    );
    meta.insert(
        "final_state".into(),
        json!({
            "segments": rec.final_segments, "reserved_bytes": rec.final_reserved,
            "allocated_bytes": rec.final_allocated,
        }),
    );
    let entries = |cause| {
        rec.releases
            .iter()
            .filter(|r| r.cause == cause)
            .map(|r| r.entry)
            .collect::<Vec<_>>()
    };
    meta.insert(
        "empty_cache_inferred".into(),
        json!(entries(ReleaseCause::EmptyCache)),
    );
    meta.insert(
        "allocator_releases".into(),
        json!(entries(ReleaseCause::Allocator)),
    );
    meta.insert("deferred_frees".into(), json!(rec.deferred_frees));
    meta.insert(
        "ooms".into(),
        json!(rec
            .ooms
            .iter()
            .map(|o| json!({"entry": o.entry, "size": o.size, "device_free": o.device_free, "reserved_bytes": o.reserved}))
            .collect::<Vec<_>>()),
    );
    meta.insert(
        "capacity".into(),
        match &rec.capacity {
            Capacity::Oom { usable, entry, .. } => {
                json!({"kind": "oom", "usable_bytes": usable, "entry": entry})
            }
            Capacity::Window {
                at_least,
                below,
                entry,
            } => json!({"kind": "window", "at_least": at_least, "below": below, "entry": entry}),
            Capacity::AtLeast { bytes } => json!({"kind": "at_least", "bytes": bytes}),
        },
    );
    if !rec.notes.is_empty() {
        meta.insert("notes".into(), json!(rec.notes));
    }
    meta
}
