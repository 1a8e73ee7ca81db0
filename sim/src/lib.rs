//! # vramsim-sim
//!
//! Replays allocation traces against simulated GPU allocators, first among them a faithful model of
//! PyTorch's CUDA caching allocator, and reports peaks, statistics, fragmentation and out-of-memory errors
//! in PyTorch's own words.

pub mod allocator;
pub mod calibration;
pub mod check;
pub mod config;
pub mod device;
pub mod engine;
pub mod export;
pub mod format;
pub mod import;
pub mod oom;
pub mod oom_text;
pub mod plot;
pub mod report;
pub mod rounding;
pub mod stats;
pub mod summary;
pub mod timeline;
