//! Deferred frees: the streams recorded on a block (`stream_uses`) and the per-stream FIFOs of CUDA events
//! that hold freed blocks back until the streams that used them have finished (§4.1, §4.3).
//!
//! A CUDA event is modelled by the host time at which it fires: the time the recording stream's queued work
//! ends (`Timeline::record_event`). PyTorch keeps `cuda_events` in a hash map keyed by stream; here the queues
//! are visited in ascending stream order so that replays are deterministic (the order only affects the order
//! of history entries, never the resulting memory layout).
//!
//! *Invariant:* nothing here allocates once the queues and slots have grown to the workload's high-water mark.

use std::collections::VecDeque;

use vramsim_traces::StreamId;

use super::block::NIL;

/// The `stream_uses` sets of blocks, in reusable slots (a block holds a slot index, or `NIL` when empty).
#[derive(Clone, Debug, Default)]
pub(crate) struct StreamUses {
    slots: Vec<Vec<StreamId>>,
    vacant: Vec<u32>,
}

impl StreamUses {
    /// Adds `stream` to the set in `slot` (allocating a slot if `slot` is `NIL`); returns the slot.
    pub fn insert(&mut self, slot: u32, stream: StreamId) -> u32 {
        let slot = if slot == NIL {
            match self.vacant.pop() {
                Some(slot) => slot,
                None => {
                    self.slots.push(Vec::new());
                    (self.slots.len() - 1) as u32
                }
            }
        } else {
            slot
        };
        let set = &mut self.slots[slot as usize];
        if !set.contains(&stream) {
            set.push(stream);
        }
        slot
    }

    /// The streams in `slot`, in the order they were recorded.
    pub fn streams(&self, slot: u32) -> &[StreamId] {
        &self.slots[slot as usize]
    }

    /// Empties and frees `slot` (its capacity is kept for the next block).
    pub fn release(&mut self, slot: u32) {
        self.slots[slot as usize].clear();
        self.vacant.push(slot);
    }
}

/// One stream's outstanding events: (time the event fires, block it holds back), oldest first.
#[derive(Clone, Debug)]
pub(crate) struct StreamEvents {
    /// The stream the events were recorded on.
    pub stream: StreamId,
    /// FIFO of (fires_at, block index).
    pub queue: VecDeque<(u64, u32)>,
}

/// `cuda_events`: per-stream FIFOs of deferred frees, streams ascending.
#[derive(Clone, Debug, Default)]
pub(crate) struct EventQueues {
    /// The queues (never removed, so their buffers are reused).
    pub streams: Vec<StreamEvents>,
    /// Events outstanding over all streams (lets `process_events` return at once when zero).
    pub pending: usize,
}

impl EventQueues {
    /// Enqueues an event recorded on `stream` that fires at `fires_at` and holds back `block`.
    pub fn push(&mut self, stream: StreamId, fires_at: u64, block: u32) {
        let pos = match self.streams.iter().position(|s| s.stream == stream) {
            Some(pos) => pos,
            None => {
                let pos = self.streams.partition_point(|s| s.stream < stream);
                self.streams.insert(
                    pos,
                    StreamEvents {
                        stream,
                        queue: VecDeque::new(),
                    },
                );
                pos
            }
        };
        self.streams[pos].queue.push_back((fires_at, block));
        self.pending += 1;
    }
}
