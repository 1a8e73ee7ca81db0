//! [`Trace`]: a whole trace in memory, its events and the header's free-form metadata.

use crate::event::Event;

/// The header's `meta` object: free-form JSON (model name, batch size, the tool that wrote the trace,
/// ...). Readers keep it as they found it and writers write it back unchanged.
pub type Meta = serde_json::Map<String, serde_json::Value>;

/// The `format` value every trace header carries.
pub const FORMAT_NAME: &str = "vramsim-trace";

/// The trace format version this crate reads and writes.
pub const FORMAT_VERSION: u64 = 1;

/// A whole trace in memory: what the header says and the events in the order the host issued them.
///
/// Big JSON Lines traces need not be held like this: [`crate::open_events`] and
/// [`crate::JsonlReader`] hand events out one at a time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    /// The header's `meta` object (empty when the file had no header or no `meta`).
    pub meta: Meta,
    /// The events, in order.
    pub events: Vec<Event>,
}

impl Trace {
    /// A trace of `events` with empty metadata.
    pub fn from_events(events: Vec<Event>) -> Trace {
        Trace {
            meta: Meta::new(),
            events,
        }
    }
}
