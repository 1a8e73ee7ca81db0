//! Times `zoo::build` + `lower` for the benchmark cases (release build):
//! `cargo run --release -p vramsim-models --example lower_bench`.
//!
//! Targets (issue 4): Llama-2-70B at seq 4096 with full checkpointing under 100 ms, GPT-2 small
//! under 10 ms. The cases after those are the models of the lowering-speed table in
//! `models/README.md` (Performance); each is timed warm, in one process, as a sweep lowers.

use std::time::Instant;
use vramsim_models::{lower, peak_requested, zoo, Checkpointing, Precision, Recipe};

fn time(name: &str, batch: u64, seq: u64, ckpt: Checkpointing) {
    time_at(name, batch, seq, ckpt, Precision::Fp32);
}

fn time_at(name: &str, batch: u64, seq: u64, ckpt: Checkpointing, precision: Precision) {
    let mut r = Recipe::new(batch, seq);
    r.checkpointing = ckpt;
    r.precision = precision;
    // Warm up once, then take the best of five.
    let mut best = f64::INFINITY;
    let mut info = (0usize, 0u64);
    for _ in 0..6 {
        let t0 = Instant::now();
        let g = zoo::build(name, &r).expect("zoo model");
        let t = lower(&g, &r).expect("lowers");
        let dt = t0.elapsed().as_secs_f64() * 1e3;
        best = best.min(dt);
        info = (t.events.len(), peak_requested(&t));
    }
    println!(
        "{name:16} batch {batch:2} seq {seq:5} {precision:5} checkpoint {ckpt:5}: {best:8.2} ms  ({} events, {:.2} µs each, peak requested {:.2} GiB)",
        info.0,
        best * 1e3 / info.0 as f64,
        info.1 as f64 / (1u64 << 30) as f64
    );
}

fn main() {
    time("gpt2", 8, 1024, Checkpointing::None);
    time("gpt2", 1, 1024, Checkpointing::None);
    time("llama2-70b", 1, 4096, Checkpointing::Full);
    time("llama2-7b", 1, 4096, Checkpointing::None);
    time_at("gpt2", 4, 1024, Checkpointing::Full, Precision::Bf16);
    time("gpt2-medium", 4, 1024, Checkpointing::None);
    time_at("llama2-7b", 1, 4096, Checkpointing::Full, Precision::Bf16);
    time_at("llama2-70b", 1, 4096, Checkpointing::Full, Precision::Bf16);
    time("resnet50", 32, 0, Checkpointing::None);
}
