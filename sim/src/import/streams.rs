//! Deferred frees (`record_stream`) as synthetic streams: which frees were deferred, and the streams and
//! `compute` durations that make each one complete where the recorded one did (see the module doc of
//! [`super`]).

use std::collections::HashMap;

use vramsim_traces::snapshot::{Action, TraceEntry};
use vramsim_traces::{AllocId, Event, StreamId};

/// The synthetic stream of the first deferred free; later ones count down.
pub const FIRST_SYNTHETIC_STREAM: StreamId = u64::MAX;
/// Microseconds between the completion times given to consecutive deferred frees.
const DEFERRED_STEP_US: u64 = 1_000_000;

/// For each `free_requested` entry whose `free_completed` does not follow at once, the index of that
/// `free_completed` (`Some(usize::MAX)` if it never comes); `None` elsewhere.
pub(super) fn deferred_completions(entries: &[TraceEntry]) -> Vec<Option<usize>> {
    let mut out = vec![None; entries.len()];
    let mut waiting: HashMap<u64, usize> = HashMap::new();
    for (i, e) in entries.iter().enumerate() {
        match e.action {
            Action::FreeRequested => {
                let next = entries.get(i + 1);
                if !next.is_some_and(|n| n.action == Action::FreeCompleted && n.addr == e.addr) {
                    waiting.insert(e.addr, i);
                    out[i] = Some(usize::MAX);
                }
            }
            Action::FreeCompleted => {
                if let Some(free) = waiting.remove(&e.addr) {
                    out[free] = Some(i);
                }
            }
            _ => {}
        }
    }
    out
}

/// The synthetic streams of deferred frees and the host clock the replay will have (in µs), so that
/// each stream's work ends at its block's recorded completion.
#[derive(Default)]
pub(super) struct SyntheticStreams {
    /// Streams free for reuse.
    free: Vec<StreamId>,
    /// Streams handed out so far.
    made: u64,
    /// Block address → (stream, completion time).
    pending: HashMap<u64, (StreamId, u64)>,
    /// Stream → its completion time (for `duration_us`).
    ends: HashMap<StreamId, u64>,
    /// The replay's host clock, as far as these events move it.
    host_us: u64,
}

impl SyntheticStreams {
    /// A stream for the deferred free of `addr`, completing at the recorded entry `completion` (never,
    /// for `None`).
    fn defer(&mut self, addr: u64, completion: Option<usize>) -> StreamId {
        let s = self.free.pop().unwrap_or_else(|| {
            self.made += 1;
            FIRST_SYNTHETIC_STREAM - (self.made - 1)
        });
        // Completion times increase with the entry index of the recorded completion, so the streams
        // finish in the recorded order; a free that never completes finishes after all of them.
        let end = match completion {
            Some(c) => (c as u64 + 1).saturating_mul(DEFERRED_STEP_US),
            None => u64::MAX / 4_000,
        };
        self.pending.insert(addr, (s, end));
        self.ends.insert(s, end);
        s
    }

    /// The deferred free of block `addr`, completing at the recorded entry `completion` (never, for
    /// `None`): `record_stream` on a synthetic stream, `compute` on it until the completion, `free`.
    pub fn deferred_free(&mut self, addr: u64, completion: Option<usize>) -> [Event; 3] {
        let id = AllocId::Int(addr);
        let s = self.defer(addr, completion);
        [
            Event::RecordStream {
                id: id.clone(),
                stream: s,
            },
            Event::Compute {
                stream: s,
                us: self.duration_us(s),
            },
            Event::Free { id },
        ]
    }

    /// The `compute` duration that makes stream `s` finish at its completion time.
    fn duration_us(&self, s: StreamId) -> f64 {
        self.ends[&s].saturating_sub(self.host_us) as f64
    }

    /// The recorded completion of `addr`: the stream to `sync` (if the free was deferred).
    pub fn complete(&mut self, addr: u64) -> Option<StreamId> {
        let (s, end) = self.pending.remove(&addr)?;
        self.host_us = self.host_us.max(end);
        self.ends.remove(&s);
        self.free.push(s);
        Some(s)
    }

    /// A release waits for every pending event: the host moves past every completion time.
    pub fn release_all(&mut self) {
        if let Some(&end) = self.ends.values().max() {
            self.host_us = self.host_us.max(end);
        }
    }
}
