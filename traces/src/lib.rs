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
//! This crate deliberately knows nothing of models or allocators: it only says what happened, in which
//! order, and checks that the text it reads says it well.

pub mod event;

pub use event::{AllocId, Category, Event, StreamId, OPS};
