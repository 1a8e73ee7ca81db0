//! Reentrant activation checkpointing (`--checkpoint-impl reentrant`, `use_reentrant=True`):
//! against an allocation sequence derived by hand from `torch/utils/checkpoint.py`
//! (`CheckpointFunction`), and against meta-device captures of PyTorch 2.15 running it
//! (`traces/python/make_reentrant_captures.py`), event for event.

mod common;

use std::collections::HashMap;
use vramsim_models::*;
use vramsim_traces::Trace;

/// `(+size | -size)` for each alloc and free from the first `forward` marker on, and the same for
/// the `backward` phase of iteration 1 only.
fn sequences(t: &Trace) -> (Vec<i64>, Vec<i64>) {
    common::signed_sizes(t, "backward", Some(1))
}

/// The highest live requested bytes.
fn peak(t: &Trace) -> u64 {
    common::peak_between(t, 0, t.events.len())
}

fn reentrant(model: &str, batch: u64, seq: u64) -> (Recipe, Trace) {
    let mut r = Recipe::new(batch, seq);
    r.checkpointing = Checkpointing::Full;
    r.checkpoint_impl = CheckpointImpl::Reentrant;
    r.attention = Attention::Eager;
    r.fidelity = Fidelity::MetaCapture;
    // The capture tool builds its HF configs with `use_cache=False`.
    r.use_cache = Some(false);
    let t = lower(&zoo::build(model, &r).unwrap(), &r).unwrap();
    (r, t)
}

#[test]
fn reentrant_mlp_backward_by_hand() {
    // The zoo's mlp at batch 64 (Linear 1024→4096 + ReLU three times, then Linear 4096→1000),
    // each Linear+ReLU a checkpointed block, the last Linear not. With use_reentrant=True the
    // first block's only tensor input (the batch) does not require grad, so `Function.apply`
    // records no node: its output does not require grad, nor does anything the next blocks make
    // from it. No gradient reaches the three blocks (PyTorch warns "None of the inputs have
    // requires_grad=True"); only the last Linear is trained. Nothing is recomputed.
    let (_, t) = reentrant("mlp", 64, 0);
    let (_, bwd) = sequences(&t);
    let h = 64 * 4096 * 4i64; // the last block's output, [64, 4096] float32
    let logits = 64 * 1000 * 4i64;
    let expected = vec![
        4,                // ones_like(loss)
        logits,           // NllLossBackward0: grad of the log-probabilities
        -4,               // its saved total_weight goes
        logits,           // LogSoftmaxBackward0: grad of the logits
        -logits,          // NllLossBackward0's gradient released
        -logits,          // log_softmax's saved result released
        1000 * 4096 * 4,  // AddmmBackward0: grad of the weight (no grad of the input: none needed)
        1000 * 4,         // grad of the bias
        -logits,          // the logits' gradient released
        -h,               // addmm's saved mat1 (the last block's output) released
        -4,               // ones_like(loss) when backward returns
        -4,               // the loss
        -(64 * 8),        // the targets
        -(64 * 1024 * 4), // the batch
    ];
    assert_eq!(bwd, expected);
    // Non-reentrant checkpointing has no such condition: every block is trained and recomputed.
    let mut r = Recipe::new(64, 0);
    r.checkpointing = Checkpointing::Full;
    r.fidelity = Fidelity::MetaCapture;
    // The capture tool builds its HF configs with `use_cache=False`.
    r.use_cache = Some(false);
    let t = lower(&zoo::build("mlp", &r).unwrap(), &r).unwrap();
    assert!(sequences(&t).1.len() > 3 * expected.len());
}

#[test]
fn reentrant_agrees_with_pytorch_meta_captures() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reentrant_captures");
    // GPT-2: transformers 5.23 passes `position_ids` ([1, 128] int64) to each block as a keyword,
    // which `GradientCheckpointingLayer` binds into `partial(forward, self, **kwargs)`, the
    // `run_function` that ctx keeps until the graph is freed; the lowering treats it as a region
    // input released with the node's saved tensors, 1,024 B some events earlier. (As in
    // loop_knobs.rs, the lowering also summarizes GPT-2's mask and position-id temporaries of the
    // forward, so only the peak and the backward's allocations and frees are compared.)
    for (file, model, batch, seq, identical) in [
        ("mlp", "mlp", 64, 0, true),
        ("bert-base", "bert-base", 2, 128, true),
        ("gpt2", "gpt2", 2, 128, false),
    ] {
        let theirs = vramsim_traces::read_trace(dir.join(format!("{file}.jsonl.gz"))).unwrap();
        let (_, ours) = reentrant(model, batch, seq);
        let (a, ab) = sequences(&ours);
        let (b, bb) = sequences(&theirs);
        assert_eq!(peak(&ours), peak(&theirs), "{file}: peak requested");
        if !identical {
            let mut diff: HashMap<i64, i64> = HashMap::new();
            for x in &ab {
                *diff.entry(*x).or_default() += 1;
            }
            for x in &bb {
                *diff.entry(*x).or_default() -= 1;
            }
            diff.retain(|_, c| *c != 0);
            assert!(diff.is_empty(), "{file}: (size, ours - theirs): {diff:?}");
            continue;
        }
        if ab != bb {
            let i = ab
                .iter()
                .zip(&bb)
                .position(|(x, y)| x != y)
                .unwrap_or(ab.len().min(bb.len()));
            panic!(
                "{file}: backward differs at event {i} of {} / {}:\n ours   {:?}\n theirs {:?}",
                ab.len(),
                bb.len(),
                &ab[i.saturating_sub(5)..(i + 10).min(ab.len())],
                &bb[i.saturating_sub(5)..(i + 10).min(bb.len())]
            );
        }
        assert_eq!(a.len(), b.len(), "{file}: event counts");
        assert_eq!(a, b, "{file}");
    }
}
