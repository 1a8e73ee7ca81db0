//! Lowering once per structure over the batch and the sequence length
//! (`seq_template::SeqBatchTemplate`): a template fitted through the lowerings at batch 2 and 3 × three
//! sequence lengths of one residue modulo 128 writes, at other batches and lengths of that residue,
//! the step a fresh lowering writes, byte for byte (events, repeats and `meta`), for every zoo language
//! model (the image models take no sequence length: `batch_templates` covers them), under float32
//! (the memory-efficient kernel, whose logsumexp pads the length to 32) and bfloat16
//! (FlashAttention, whose backward pads it to 128), at lengths that are multiples of 128 and at lengths
//! that are not; and under the recipe options that change which tensors a step holds and how they
//! are sized by the length (eager attention's `B·H·S·S` scores, AMP, checkpointing, accumulation,
//! kept outputs, LoRA, tensor and sequence parallelism) on four models.

use vramsim_models::compact::{lower_compact, CompactTrace};
use vramsim_models::recipe::Attention;
use vramsim_models::seq_template::SeqBatchTemplate;
use vramsim_models::zoo::{self, NAMES};
use vramsim_models::{Checkpointing, Precision, Recipe};

fn lowered(name: &str, r: &Recipe) -> CompactTrace {
    let g = zoo::build(name, r).unwrap_or_else(|e| panic!("{name}: {e}"));
    lower_compact(&g, r).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// (precision, compute capability, the three lengths of the fit, the (batch, length) points
/// checked): lengths of residue 0 (every rounding exact) and of residues 40 and 100
/// (FlashAttention's `round(S, 128)` adds 88 and 28, the logsumexp's `ceil(S, 32)` adds 24 and 28),
/// all within BERT's 512 positions. bfloat16 on sm 9.0 takes cuDNN where the model has no dropout
/// (Llama), FlashAttention where it has (GPT-2's 0.1, not a multiple of cuDNN's 1/16); on sm 8.0
/// FlashAttention for all (`sdp_utils.cpp`'s priority order).
type Case = (Precision, (u32, u32), [u64; 3], [(u64, u64); 2]);
const CASES: [Case; 4] = [
    (
        Precision::Fp32,
        (9, 0),
        [128, 256, 384],
        [(4, 512), (7, 256)],
    ),
    (
        Precision::Bf16,
        (9, 0),
        [40, 168, 296],
        [(4, 424), (6, 168)],
    ),
    (
        Precision::Fp32,
        (9, 0),
        [100, 228, 356],
        [(5, 484), (9, 100)],
    ),
    (
        Precision::Bf16,
        (8, 0),
        [100, 228, 356],
        [(4, 484), (5, 228)],
    ),
];

fn check(name: &str, (precision, cc, seqs, points): Case) {
    check_with(name, (precision, cc, seqs, points), |_| {});
}

/// [`check`] with `change` applied to every recipe.
fn check_with(name: &str, (precision, cc, seqs, points): Case, change: impl Fn(&mut Recipe)) {
    let at = |batch: u64, seq: u64| {
        let mut r = Recipe::new(batch, seq);
        r.precision = precision;
        r.target.compute_capability = cc;
        change(&mut r);
        lowered(name, &r)
    };
    let fit: Vec<Vec<CompactTrace>> = [2, 3]
        .iter()
        .map(|&b| seqs.iter().map(|&s| at(b, s)).collect())
        .collect();
    let template = SeqBatchTemplate::fit(
        [
            [&fit[0][0], &fit[0][1], &fit[0][2]],
            [&fit[1][0], &fit[1][1], &fit[1][2]],
        ],
        [2, 3],
        seqs,
    )
    .unwrap_or_else(|why| panic!("{name} {precision:?} sm {cc:?} {seqs:?}: no template: {why}"));
    for (batch, seq) in points {
        let fresh = at(batch, seq);
        let made = template
            .instantiate(batch, seq)
            .unwrap_or_else(|| panic!("{name} {precision:?} batch {batch} seq {seq}: no instance"));
        assert!(
            made.same_as(&fresh),
            "{name} {precision:?} batch {batch} seq {seq}: the instance differs from a fresh lowering"
        );
        let json = |t: &CompactTrace| {
            let mut out = Vec::new();
            vramsim_traces::write_json(&mut out, &t.expand()).unwrap();
            out
        };
        assert!(
            json(&made) == json(&fresh),
            "{name} batch {batch} seq {seq}: JSON"
        );
    }
}

fn language(name: &str) -> bool {
    zoo::Arch::from_name(name)
        .unwrap()
        .max_positions()
        .is_some()
}

#[test]
fn every_zoo_language_model_instantiates_its_fresh_lowering() {
    let names: Vec<&str> = NAMES.into_iter().filter(|n| language(n)).collect();
    assert!(names.len() >= 20, "{names:?}");
    for name in names {
        for case in CASES {
            check(name, case);
        }
    }
}

#[test]
fn lengths_that_round_otherwise_are_no_family() {
    let at = |seq: u64| {
        lowered("gpt2", &{
            let mut r = Recipe::new(2, seq);
            r.precision = Precision::Bf16;
            r
        })
    };
    let (a, b, c) = (at(128), at(256), at(300));
    let at3 = |seq: u64| {
        lowered("gpt2", &{
            let mut r = Recipe::new(3, seq);
            r.precision = Precision::Bf16;
            r
        })
    };
    let (d, e, f) = (at3(128), at3(256), at3(300));
    let why =
        SeqBatchTemplate::fit([[&a, &b, &c], [&d, &e, &f]], [2, 3], [128, 256, 300]).unwrap_err();
    assert!(why.contains("residues"), "{why}");
    // a template of residue 0 does not reach 424 (residue 40): FlashAttention's backward pads 424
    // to 512, which no polynomial through 128, 256 and 384 gives
    let (g, h) = (at(384), at3(384));
    let template =
        SeqBatchTemplate::fit([[&a, &b, &g], [&d, &e, &h]], [2, 3], [128, 256, 384]).unwrap();
    assert!(template.instantiate(4, 424).is_none());
    assert!(template.instantiate(4, 512).is_some());
}

#[test]
fn recipe_options_instantiate_their_fresh_lowering() {
    type Change = fn(&mut Recipe);
    let changes: [(&str, Change); 9] = [
        ("eager attention", |r| r.attention = Attention::Eager),
        ("amp-bf16", |r| r.precision = Precision::AmpBf16),
        ("full checkpointing", |r| {
            r.checkpointing = Checkpointing::Full
        }),
        ("selective checkpointing", |r| {
            r.checkpointing = Checkpointing::Selective
        }),
        ("accumulation 6", |r| r.accum = 6),
        ("kept outputs", |r| r.keep_outputs = true),
        ("LoRA", |r| {
            r.lora = Some("r=16,alpha=32,targets=all-linear".parse().unwrap())
        }),
        ("tensor parallel 2", |r| r.parallel.tp = 2),
        ("tensor and sequence parallel 2", |r| {
            r.parallel.tp = 2;
            r.parallel.sp = true;
        }),
    ];
    for name in ["gpt2", "llama2-7b", "bert-base", "nanogpt"] {
        for (what, change) in changes {
            if name == "nanogpt" && what.starts_with("tensor") {
                continue; // no tensor-parallel split modelled for nanoGPT
            }
            eprintln!("{name}: {what}");
            // residue 40: both roundings add to the length
            check_with(name, CASES[1], change);
        }
    }
}
