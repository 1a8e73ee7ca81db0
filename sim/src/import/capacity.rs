//! Reserved bytes over the history, the recorded out-of-memory errors, and what they imply of the
//! device's capacity (see *Device capacity* in the module doc of [`super`]).

use vramsim_traces::snapshot::{Action, TraceEntry};

use super::{Capacity, Recorded, RecordedOom, ReleaseCause};

/// Follows the reserved bytes from the initial state through the history: sets the peak and the
/// recorded out-of-memory errors of `rec`, and returns the bytes reserved before each entry.
pub(super) fn reservations(entries: &[TraceEntry], rec: &mut Recorded) -> Vec<u64> {
    let mut reserved = rec.initial.reserved;
    rec.peak_reserved = reserved;
    let mut reserved_before = Vec::with_capacity(entries.len());
    for e in entries {
        reserved_before.push(reserved);
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => {
                reserved = reserved.saturating_add(e.size);
                rec.peak_reserved = rec.peak_reserved.max(reserved);
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                reserved = reserved.saturating_sub(e.size)
            }
            _ => {}
        }
    }
    for (i, e) in entries.iter().enumerate() {
        if e.action == Action::Oom {
            rec.ooms.push(RecordedOom {
                entry: i,
                size: e.size,
                device_free: e.addr,
                reserved: reserved_before[i],
                stream: e.stream,
            });
        }
    }
    reserved_before
}

/// What the history implies about the device's capacity.
pub(super) fn capacity(rec: &Recorded) -> Capacity {
    if let Some(oom) = rec.ooms.first() {
        return Capacity::Oom {
            usable: oom.device_free.saturating_add(oom.reserved),
            entry: oom.entry,
            device_free: oom.device_free,
            reserved: oom.reserved,
        };
    }
    // A malloc that had to release first did not fit: capacity < reserved before + the new segment.
    let tightest = rec
        .releases
        .iter()
        .filter(|r| r.cause == ReleaseCause::Allocator)
        .filter_map(|r| {
            Some((
                r.reserved_before.saturating_add(r.followed_by_segment?),
                r.entry,
            ))
        })
        .min();
    match tightest {
        Some((below, entry)) if below > rec.peak_reserved => Capacity::Window {
            at_least: rec.peak_reserved,
            below,
            entry,
        },
        _ => Capacity::AtLeast {
            bytes: rec.peak_reserved,
        },
    }
}
