//! vramsim's commands as a library: what the `vramsim` command line does, callable from Rust (and from
//! Python through the `vramsim` package in `python/`), so that every front end gives the same answer.
//!
//! Each command has its options as a clap-derived struct (the command line's options, with its
//! defaults and its parsers: [`predict::PredictArgs`], [`whatif::WhatifArgs`],
//! [`maxbatch::MaxBatchArgs`], [`recommend::RecommendArgs`], [`replay::ReplayArgs`],
//! [`import::ImportArgs`], [`check::CheckArgs`], [`explain::ExplainArgs`]), built from an argument
//! list by [`parse_args`] (as the command line parses it, with its error messages), and a function that
//! computes the result as a typed value whose `to_json` is the document the command prints with
//! `--json`. The `run` functions are the
//! command line's: they compute, then print.
//!
//! This crate depends on `vramsim-sim` (the replay) and `vramsim-models` (the lowering); `vramsim-sim`
//! itself knows no model internals.

pub mod check;
pub mod commtime;
pub mod context_parallel;
pub mod dataparallel;
pub mod diagnose;
pub mod explain;
pub mod framework;
pub mod import;
pub mod layouts;
pub mod links;
pub mod machine;
pub mod maxbatch;
pub mod nccl;
pub mod pipeline;
pub mod predict;
pub mod presets;
pub mod ranks;
pub mod recommend;
pub mod replay;
pub mod step_replay;
pub mod steptime;
pub mod sweep;
pub mod whatif;

use anyhow::Result;
use clap::{Args, Command, FromArgMatches};

/// Parses a command's arguments (without the program name) into its options struct `A`, as the
/// command line parses them: same names, defaults and parsers; a bad argument is an error carrying
/// clap's message on one line (without the usage).
pub fn parse_args<A: Args + FromArgMatches>(command: &'static str, args: &[String]) -> Result<A> {
    let matches = A::augment_args(Command::new(command))
        .no_binary_name(true)
        .try_get_matches_from(args.iter().cloned())
        .map_err(|e| anyhow::anyhow!(sweep::clap_message(&e)))?;
    A::from_arg_matches(&matches).map_err(|e| anyhow::anyhow!(sweep::clap_message(&e)))
}
