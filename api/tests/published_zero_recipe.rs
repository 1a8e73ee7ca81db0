//! PyTorch's recipe "Shard Optimizer States with ZeroRedundancyOptimizer" (`pytorch/tutorials`,
//! `recipes_source/zero_redundancy_optimizer.rst`, read at commit 01c63024aba9; written for PyTorch
//! 1.8, 2021) against `vramsim predict`.
//!
//! The run: two processes (gloo process group, one GPU each), on each
//! `nn.Sequential(*[nn.Linear(2000, 2000).to(rank) for _ in range(20)])`, `DDP(model,
//! device_ids=[rank])`, `torch.optim.Adam(lr=0.01)` or `ZeroRedundancyOptimizer(optimizer_class=
//! torch.optim.Adam, lr=0.01)`, one forward of `torch.randn(20, 2000)`, `nn.MSELoss()` against
//! `torch.randn(20, 2000)` labels, backward, `optimizer.step()` (no `zero_grad`). Rank 0 prints
//! `torch.cuda.max_memory_allocated(0) // 1e6` followed by "MB" after creating the model, after
//! creating DDP, before the step and after it. The recipe's printed output (both layouts):
//! 335.0 / 656.0 / 992.0 MB, then 1361.0 MB with ZeroRedundancyOptimizer and 1697.0 MB without.
//!
//! vramsim's description: the model captured by `vramsim.from_module`
//! (`models/tools/make_published_parallel_captures.py` →
//! `models/tests/imported/zero_recipe_linear20.json`), `--dp 2 --shard zero1-torch|ddp --optimizer
//! adam --iterations 1`; `--optimizer-impl for-loop` because Adam had no foreach path by default before
//! PyTorch 2.0 (1.8's `torch.optim.functional.adam` is the per-parameter loop 2.15's
//! `_single_tensor_adam` still is: `exp_avg_sq.sqrt()` and its division by the bias correction live at
//! once); `--torch-version 1.10` because cuBLAS kept its own workspace outside the caching allocator
//! until PyTorch 1.13 (PR #83461), so no GEMM adds to `max_memory_allocated`. The checkpoints map onto vramsim's
//! phases: after the model = the trace replayed up to DDP's first allocation (its constructor's
//! broadcast); after DDP = the `setup` phase (`model.to`, DDP's broadcast and buckets; `ZeroRedundancyOptimizer` allocates its state at the first step);
//! before the step = the peak through `backward`; after it = the peak through `optimizer`.
//!
//! Tolerance: the recipe floors to whole decimal megabytes (`// 1e6`), so a printed P means
//! P·10⁶ ≤ peak < (P + 1)·10⁶: vramsim's peak must floor to the printed figure. PyTorch 1.8's DDP
//! constructor, as `--torch-version 1.10` lowers it: the module states broadcast through two flat
//! temporaries (`_sync_module_states`, `broadcast_coalesced`, 250 MiB buckets), then the first
//! iteration bucketed at [1 MiB, 25 MiB] (one bucket only from PyTorch 1.12), the buckets split out
//! of the cached broadcast segments; see `models/README.md`, "Published multi-GPU measurements".

mod common;
use common::json;

use serde_json::Value;

/// The captured recipe model.
fn graph() -> String {
    format!(
        "{}/../models/tests/imported/zero_recipe_linear20.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// `predict` describing the recipe's run with `shard`, plus `extra`.
fn recipe(shard: &str, extra: &[&str]) -> Value {
    let g = graph();
    let mut args = vec![
        "predict",
        "--graph",
        g.as_str(),
        "--batch",
        "20",
        "--optimizer",
        "adam",
        "--optimizer-impl",
        "for-loop",
        "--iterations",
        "1",
        "--dp",
        "2",
        "--shard",
        shard,
        "--torch-version",
        "1.10",
    ];
    args.extend(extra);
    json(&args)
}

/// The peak allocated bytes of the phases up to and including `last`, in step order.
fn peak_through(doc: &Value, last: &str) -> u64 {
    let mut peak = 0;
    for phase in doc["phases"].as_array().expect("phases") {
        peak = peak.max(phase["peak_allocated_bytes"].as_u64().unwrap());
        if phase["name"] == last {
            return peak;
        }
    }
    panic!("no phase {last}: {}", doc["phases"]);
}

/// `max_memory_allocated` once the model is on the GPU: the lowered trace replayed up to DDP's
/// first allocation (category `communication`: the constructor's broadcast, then its buckets).
fn peak_after_model(shard: &str) -> u64 {
    let dir = std::env::temp_dir().join(format!(
        "vramsim-zero-recipe-{}-{shard}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let full = dir.join("step.json");
    recipe(shard, &["--trace-out", full.to_str().unwrap()]);
    let mut trace: Value = serde_json::from_str(&std::fs::read_to_string(&full).unwrap()).unwrap();
    let events = trace["events"].as_array_mut().expect("events");
    let first_bucket = events
        .iter()
        .position(|e| e["op"] == "alloc" && e["category"] == "communication")
        .expect("DDP allocates its buckets");
    events.truncate(first_bucket);
    let prefix = dir.join("model.json");
    std::fs::write(&prefix, trace.to_string()).unwrap();
    let replayed = json(&["replay", prefix.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).unwrap();
    replayed["peak_allocated_bytes"].as_u64().unwrap()
}

/// The recipe's four printed figures (MB, floored) for each optimizer, rank 0: after creating the
/// model, after creating DDP, before `optimizer.step()`, after it.
const PUBLISHED: [(&str, [u64; 4]); 2] = [
    ("zero1-torch", [335, 656, 992, 1361]),
    ("ddp", [335, 656, 992, 1697]),
];

#[test]
fn zero_redundancy_optimizer_recipe_matches_its_printed_peaks() {
    for (shard, printed) in PUBLISHED {
        let doc = recipe(shard, &[]);
        // Rank 0 is the one printed; every rank owns the same share here (10 weights and 10
        // biases each), so the reported role is rank 0's.
        assert_eq!(
            doc["ranks"][0]["ranks"],
            serde_json::json!([0, 1]),
            "{shard}"
        );
        let predicted = [
            peak_after_model(shard),
            peak_through(&doc, "setup"),
            peak_through(&doc, "backward"),
            peak_through(&doc, "optimizer"),
        ];
        let floored = predicted.map(|b| b / 1_000_000);
        assert_eq!(
            floored, printed,
            "{shard}: vramsim {predicted:?} B against the recipe's {printed:?} MB (floored)"
        );
    }
}
