//! Host and stream clocks of the discrete-event engine.
//!
//! The host issues work and runs ahead of the GPU: a `compute` event queues work on a stream and returns at
//! once; only a synchronisation (or an allocator that waits on CUDA events) brings the host clock forward to
//! the GPU. Each stream executes its queue in order, so the work queued on a stream up to a point finishes at
//! that stream's `busy_until` as it stood then: that is when a CUDA event recorded there fires (§4.3).
//! Times are integer nanoseconds so replay is exact and deterministic.

use vramsim_traces::StreamId;

/// Host time and one clock per stream, in nanoseconds.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    host_ns: u64,
    /// (stream, time its queued work finishes); few streams, so a linear scan beats a map.
    streams: Vec<(StreamId, u64)>,
}

impl Timeline {
    /// A timeline at host time zero with idle streams.
    pub fn new() -> Self {
        Self::default()
    }

    /// The host's current time.
    #[inline]
    pub fn now(&self) -> u64 {
        self.host_ns
    }

    /// When the work queued so far on `stream` finishes (never earlier than now).
    #[inline]
    pub fn stream_idle_at(&self, stream: StreamId) -> u64 {
        let busy = self
            .streams
            .iter()
            .find(|(s, _)| *s == stream)
            .map_or(0, |&(_, t)| t);
        busy.max(self.host_ns)
    }

    /// Queues `ns` of work on `stream` (a kernel launch: the host does not wait).
    pub fn enqueue(&mut self, stream: StreamId, ns: u64) {
        let start = self.stream_idle_at(stream);
        let end = start.saturating_add(ns);
        match self.streams.iter_mut().find(|(s, _)| *s == stream) {
            Some(entry) => entry.1 = end,
            None => self.streams.push((stream, end)),
        }
    }

    /// Records a CUDA event on `stream` and returns the time at which it fires.
    #[inline]
    pub fn record_event(&self, stream: StreamId) -> u64 {
        self.stream_idle_at(stream)
    }

    /// `cudaEventQuery`: whether an event firing at `fires_at` has fired by now.
    #[inline]
    pub fn has_fired(&self, fires_at: u64) -> bool {
        fires_at <= self.host_ns
    }

    /// The host blocks until time `t` (`cudaEventSynchronize`).
    #[inline]
    pub fn wait_until(&mut self, t: u64) {
        self.host_ns = self.host_ns.max(t);
    }

    /// `stream.synchronize()`.
    pub fn synchronize_stream(&mut self, stream: StreamId) {
        self.wait_until(self.stream_idle_at(stream));
    }

    /// Writes the host clock and every stream's clock (a replay's steady-state check compares them).
    pub fn steady_state_key(&self, key: &mut Vec<u64>) {
        key.push(self.host_ns);
        key.push(self.streams.len() as u64);
        for &(stream, t) in &self.streams {
            key.extend([stream, t]);
        }
    }

    /// `torch.cuda.synchronize()`: waits for every stream.
    pub fn synchronize(&mut self) {
        let last = self.streams.iter().map(|&(_, t)| t).max().unwrap_or(0);
        self.wait_until(last);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_fire_when_the_stream_reaches_them() {
        let mut t = Timeline::new();
        t.enqueue(1, 100);
        let fires = t.record_event(1);
        t.enqueue(1, 50);
        assert_eq!(fires, 100);
        assert!(!t.has_fired(fires));
        t.synchronize_stream(0);
        assert!(
            !t.has_fired(fires),
            "waiting for another stream does not wait for stream 1"
        );
        t.synchronize_stream(1);
        assert_eq!(t.now(), 150);
        assert!(t.has_fired(fires));
    }

    #[test]
    fn work_queued_after_the_host_moved_on_starts_then() {
        let mut t = Timeline::new();
        t.enqueue(0, 10);
        t.synchronize();
        t.enqueue(0, 5);
        assert_eq!(t.stream_idle_at(0), 15);
    }
}
