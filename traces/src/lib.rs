//! # vramsim-traces
//!
//! The allocation-trace contract of vramsim: the [`Event`]s a training step issues (allocations, frees,
//! `record_stream`, kernels, synchronisation, `empty_cache`, phase markers), the [`Trace`] that carries
//! them with its metadata, and every file format they travel in.
//!
//! ```
//! use vramsim_traces::{Event, AllocId, Category};
//! let alloc = Event::Alloc { id: AllocId::Int(1), size: 4096, stream: 0,
//!                            category: Category::Activation, tag: None };
//! assert_eq!(alloc.op(), "alloc");
//! ```
//!
//! Reading and writing a trace file takes one call each; the format (whole-document JSON or JSON
//! Lines, gzip-compressed or not) is detected from the content on the way in and chosen by the file
//! name on the way out:
//!
//! ```no_run
//! let trace = vramsim_traces::read_trace("step.json")?;
//! vramsim_traces::write_trace("step.jsonl.gz", &trace)?;
//! for event in vramsim_traces::open_events("step.jsonl.gz")? {
//!     let event = event?; // streamed: memory for one line, not the whole file
//! #   let _ = event;
//! }
//! # Ok::<(), vramsim_traces::TraceError>(())
//! ```
//!
//! The formats are documented in `docs/trace-format.md`. Modules: [`event`] (the contract),
//! [`trace`] ([`Trace`], [`Meta`]), [`json`] and [`jsonl`] (the two formats), [`file`](mod@file) (detection,
//! gzip), [`error`] ([`TraceError`]: every error names its file, line, column and event index),
//! [`pickle`] and [`snapshot`] (PyTorch memory snapshots, read and written).
//!
//! This crate deliberately knows nothing of models or allocators: it only says what happened, in which
//! order, and checks that the text it reads says it well. Turning a snapshot into a trace takes the
//! allocator's rules, so that is `vramsim_sim::import`'s job.

mod codec;
pub mod error;
pub mod event;
pub mod file;
pub mod json;
pub mod jsonl;
pub mod pickle;
pub mod sites;
pub mod snapshot;
pub mod trace;
pub mod view;

pub use error::{BlockProblem, EventProblem, HeaderProblem, Location, TraceError};
pub use event::{AllocId, Category, Event, InitialBlock, InitialSegment, Pool, StreamId, OPS};
pub use file::{
    open_events, open_events_from, read_trace, read_trace_from, write_trace, EventStream, Format,
};
pub use json::{parse_json, read_json, write_json};
pub use jsonl::{read_jsonl, write_jsonl, JsonlReader, JsonlWriter};
pub use trace::{Meta, Trace, FORMAT_NAME, FORMAT_VERSION};
pub use view::{renamed_id, EventView};
