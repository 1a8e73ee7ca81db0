//! Heads, losses, kept outputs and image sizes: every expected number below is derived by hand from
//! PyTorch's and transformers' rules (which tensors autograd saves, what `logits.float()` copies,
//! torchvision's parameter formulas), never read off vramsim's output.

mod common;

use std::collections::HashMap;
use vramsim_models::*;
use vramsim_traces::{AllocId, Category, Event, Trace};

/// Live bytes by category just before the first event of phase `phase` in iteration `it`
/// (micro-batch 0).
fn live_at_phase(t: &Trace, phase: &str, it: u64) -> HashMap<Category, u64> {
    common::live_by_category(t, phase_event(t, phase, it))
}

/// Index of the `phase` marker of iteration `it`, micro-batch 0.
fn phase_event(t: &Trace, phase: &str, it: u64) -> usize {
    t.meta["phases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["phase"] == phase && p["iteration"] == it && p["micro_batch"] == 0)
        .unwrap_or_else(|| panic!("no {phase} in iteration {it}"))["event"]
        .as_u64()
        .unwrap() as usize
}

fn cat(m: &HashMap<Category, u64>, c: Category) -> i64 {
    m.get(&c).copied().unwrap_or(0) as i64
}

fn build(model: &str, r: &Recipe) -> (Graph, Trace) {
    let g = zoo::build(model, r).unwrap_or_else(|e| panic!("{model}: {e}"));
    let t = lower(&g, r).unwrap_or_else(|e| panic!("{model}: {e}"));
    (g, t)
}

/// `BertModel(bert-base-uncased)` parameters with its pooler, from the config: embeddings
/// (word, position, token type, LayerNorm), 12 layers (q, k, v, attention output dense, two
/// LayerNorms, intermediate and output dense), pooler dense.
fn bert_base_model_params() -> u64 {
    let (h, i, v, p) = (768u64, 3072u64, 30522u64, 512u64);
    let emb = v * h + p * h + 2 * h + 2 * h;
    let layer = 4 * (h * h + h) + 2 * (2 * h) + (h * i + i) + (i * h + h);
    let pooler = h * h + h;
    emb + 12 * layer + pooler
}

#[test]
fn bert_sequence_classification_adds_the_pooler_classifier_and_their_saved_tensors() {
    // Published: bert-base-uncased's BertModel has 109,482,240 parameters.
    assert_eq!(bert_base_model_params(), 109_482_240);
    let (b, s, n) = (4u64, 128u64, 2u64);
    let mut r = Recipe::new(b, s);
    r.head = Some(Head::SeqCls(n));
    let (g, t) = build("bert-base", &r);
    // BertForSequenceClassification = BertModel + classifier Linear(768, N).
    assert_eq!(g.param_count(), bert_base_model_params() + 768 * n + n);
    r.head = Some(Head::None);
    let (g0, t0) = build("bert-base", &r);
    assert_eq!(g0.param_count(), bert_base_model_params());
    // What is alive when backward starts (float32), seq-cls over the base model: dropout's output
    // [B, 768] (saved by the classifier's addmm) and its bool mask (saved by the dropout), the
    // log_softmax output [B, N] (saved), nll_loss's total_weight (a float32 scalar; both losses
    // are one float32 scalar). The logits [B, N] themselves die with forward's locals (nothing
    // saves addmm's output). And the pooler's saved tensors: tanh's result [B, 768] and the
    // dense's input, a `[:, 0]` view of the last hidden state [B, S, 768]. Under the base model's
    // `last_hidden_state.mean()` the loss does not reach the pooler, so its autograd nodes, and
    // what they saved, die with the output object when the forward returns (mean saves
    // nothing). The labels [B] int64 are an input.
    let with = live_at_phase(&t, "backward", 0);
    let base = live_at_phase(&t0, "backward", 0);
    let head = b * 768 * 4 + b * 768 + b * n * 4 + 4;
    let pooler = b * 768 * 4 + b * s * 768 * 4;
    assert_eq!(
        cat(&with, Category::Activation) - cat(&base, Category::Activation),
        (head + pooler) as i64
    );
    assert_eq!(
        cat(&with, Category::Input) - cat(&base, Category::Input),
        (b * 8) as i64
    );
}

#[test]
fn bert_regression_and_token_classification_parameters() {
    let mut r = Recipe::new(2, 64);
    r.head = Some(Head::SeqCls(1));
    let (g, t) = build("bert-base", &r);
    assert_eq!(g.param_count(), bert_base_model_params() + 768 + 1);
    // MSELoss: float32 labels [B] (an input), mse_loss's scalar result.
    assert!(t.events.iter().any(|e| matches!(
        e,
        Event::Alloc { tag: Some(tag), size: 4, .. } if tag.ends_with("aten.mse_loss")
    )));
    r.head = Some(Head::TokenCls(9));
    let (g, _) = build("bert-base", &r);
    // BertForTokenClassification: BertModel(add_pooling_layer=False) + Linear(768, 9).
    assert_eq!(
        g.param_count(),
        bert_base_model_params() - (768 * 768 + 768) + 768 * 9 + 9
    );
}

#[test]
fn hf_loss_upcasts_gpt2_logits_and_plain_does_not() {
    let (b, s, v) = (2u64, 64u64, 50257u64);
    let mut r = Recipe::new(b, s);
    r.precision = Precision::Bf16;
    let (_, hf) = build("gpt2", &r);
    r.loss = Loss::Plain;
    let (_, plain) = build("gpt2", &r);
    let copy = b * s * v * 4;
    // ForCausalLMLoss: `logits.float()` is a float32 copy of the bfloat16 logits, a local of the
    // loss function: allocated and freed inside the forward (a temporary).
    let end_fwd = phase_event(&hf, "backward", 0);
    let start_fwd = phase_event(&hf, "forward", 0);
    let copies: Vec<usize> = hf.events[start_fwd..end_fwd]
        .iter()
        .enumerate()
        .filter_map(|(i, e)| match e {
            Event::Alloc {
                size,
                tag: Some(tag),
                category,
                ..
            } if *size == copy && &**tag == "aten._to_copy" => {
                assert_eq!(*category, Category::Temporary);
                Some(i + start_fwd)
            }
            _ => None,
        })
        .collect();
    assert_eq!(copies.len(), 1, "one float copy of the logits");
    let id = match &hf.events[copies[0]] {
        Event::Alloc { id, .. } => id.clone(),
        _ => unreachable!(),
    };
    assert!(hf.events[copies[0]..end_fwd]
        .iter()
        .any(|e| matches!(e, Event::Free { id: f } if *f == id)));
    // The plain loss copies nothing: no allocation of the copy's size at all, and its
    // log_softmax runs (and saves its result) in bfloat16.
    assert!(!plain
        .events
        .iter()
        .any(|e| matches!(e, Event::Alloc { size, .. } if *size == copy)));
    let log_softmax = |t: &Trace| -> Vec<u64> {
        t.events
            .iter()
            .filter_map(|e| match e {
                Event::Alloc {
                    size,
                    tag: Some(tag),
                    ..
                } if &**tag == "aten._log_softmax" => Some(*size),
                _ => None,
            })
            .collect()
    };
    assert_eq!(log_softmax(&hf), vec![b * s * v * 4; 2]);
    assert_eq!(log_softmax(&plain), vec![b * s * v * 2; 2]);
    // Alive when backward starts: HF saves the float32 log-probabilities, the shifted labels
    // [B, S] int64 (nll_loss's target) and two float32 scalars; plain saves bfloat16
    // log-probabilities and two bfloat16 scalars (its target is a view of the labels input).
    let a = cat(&live_at_phase(&hf, "backward", 0), Category::Activation);
    let p = cat(&live_at_phase(&plain, "backward", 0), Category::Activation);
    assert_eq!(a - p, (b * s * v * 2 + b * s * 8 + (8 - 4)) as i64);
}

#[test]
fn keep_outputs_holds_the_previous_logits_through_the_next_forward() {
    let (b, s, v) = (2u64, 64u64, 50257u64);
    let mut r = Recipe::new(b, s);
    let (_, plain) = build("gpt2", &r);
    r.keep_outputs = true;
    let (_, kept) = build("gpt2", &r);
    let fwd_peak = |t: &Trace, it: u64| {
        common::peak_between(
            t,
            phase_event(t, "forward", it),
            phase_event(t, "backward", it),
        )
    };
    // `outputs = model(**batch)`: the first forward runs with nothing kept yet.
    assert_eq!(fwd_peak(&kept, 0), fwd_peak(&plain, 0));
    // The second runs while the loop still holds the first step's float32 logits [B, S, V], loss
    // (a float32 scalar) and, with transformers' default `use_cache=True`, past_key_values: the
    // DynamicCache's keys and values of GPT-2's 12 layers, [B, 12, S, 64] float32 each. All are
    // rebound only when the forward returns.
    let cache = 12 * 2 * b * 12 * s * 64 * 4;
    assert_eq!(
        fwd_peak(&kept, 1),
        fwd_peak(&plain, 1) + b * s * v * 4 + 4 + cache
    );
    // And they are alive through the step's own backward too.
    let live = |t: &Trace| {
        live_at_phase(t, "optimizer", 0)
            .values()
            .copied()
            .sum::<u64>()
    };
    assert_eq!(live(&kept), live(&plain) + b * s * v * 4 + 4 + cache);
}

#[test]
fn resnet50_activations_scale_with_the_image_area() {
    // At 160 × 160 every feature map is 5/7 of its 224 × 224 side (160 / 32 = 5, 224 / 32 = 7:
    // every stride divides evenly), so every spatial tensor autograd saves scales by 25/49. What
    // does not scale: the BatchNorm statistics (save_mean, save_invstd: 2 × C float32 per layer,
    // C summed over ResNet-50's 53 BatchNorms), the pooled features [B, 2048] (saved by fc's
    // addmm), the log-probabilities [B, 1000] and nll_loss's two scalars.
    let b = 2u64;
    let bn_channels: u64 = {
        let mut c = 64;
        for (blocks, planes) in [(3u64, 64u64), (4, 128), (6, 256), (3, 512)] {
            c += blocks * (planes + planes + 4 * planes) + 4 * planes;
        }
        c
    };
    assert_eq!(bn_channels, 26_560);
    let fixed = (2 * bn_channels * 4 + b * 2048 * 4 + b * 1000 * 4 + 8) as i64;
    let act = |side: u64| {
        let mut r = Recipe::new(b, 0);
        r.image_size = Some((side, side));
        let (_, t) = build("resnet50", &r);
        let live = live_at_phase(&t, "backward", 0);
        assert_eq!(
            cat(&live, Category::Input),
            (b * 3 * side * side * 4 + b * 8) as i64
        );
        cat(&live, Category::Activation)
    };
    let (a224, a160) = (act(224), act(160));
    assert_eq!((a160 - fixed) * 49, (a224 - fixed) * 25);
    // The default is 224 × 224.
    let (_, t) = build("resnet50", &Recipe::new(b, 0));
    assert_eq!(
        cat(&live_at_phase(&t, "backward", 0), Category::Activation),
        a224
    );
}

#[test]
fn num_classes_changes_the_classifier_as_torchvision_counts_it() {
    let count = |model: &str, classes: Option<u64>, size: Option<(u64, u64)>| {
        let mut r = Recipe::new(2, 0);
        r.num_classes = classes;
        r.image_size = size;
        zoo::build(model, &r).unwrap().param_count()
    };
    // torchvision: the classifier is Linear(features, num_classes), features 512 (ResNet-18),
    // 2048 (ResNet-50), 4096 (VGG-16's last Linear), 768 (ViT-B/16's head). Published totals at
    // 1000 classes: 11,689,512; 25,557,032; 138,357,544; 86,567,656.
    for (model, total, features) in [
        ("resnet18", 11_689_512u64, 512u64),
        ("resnet50", 25_557_032, 2048),
        ("vgg16", 138_357_544, 4096),
        ("vit-b-16", 86_567_656, 768),
    ] {
        assert_eq!(count(model, None, None), total, "{model}");
        assert_eq!(
            count(model, Some(10), None),
            total - (features * 1000 + 1000) + features * 10 + 10,
            "{model}"
        );
    }
    assert_eq!(count("resnet50", Some(10), None), 23_528_522);
    // vit_b_16(image_size=384): pos_embedding [1, (384/16)² + 1, 768].
    assert_eq!(
        count("vit-b-16", None, Some((384, 384))),
        86_567_656 + (577 - 197) * 768
    );
    // ResNets and VGG take other sizes without new parameters (adaptive pools).
    assert_eq!(count("resnet50", None, Some((384, 256))), 25_557_032);
    assert_eq!(count("vgg16", None, Some((32, 48))), 138_357_544);
}

#[test]
fn heads_lower_to_consistent_traces() {
    for model in ["gpt2", "tinyllama-1.1b", "bert-base"] {
        let heads: &[&str] = if model == "bert-base" {
            &["masked-lm", "seq-cls:3", "seq-cls:1", "token-cls:5", "none"]
        } else {
            &["lm", "seq-cls:3", "seq-cls:1", "token-cls:5", "none"]
        };
        for head in heads {
            for (i, precision) in ["fp32", "bf16", "amp-fp16", "amp-bf16"].iter().enumerate() {
                let mut r = Recipe::new(2, 16);
                r.head = Some(head.parse().unwrap());
                r.precision = precision.parse().unwrap();
                r.loss = if i % 2 == 0 { Loss::Hf } else { Loss::Plain };
                r.checkpointing = ["none", "full"][i / 2].parse().unwrap();
                let (g, t) = build(model, &r);
                // Every id allocated once and freed once; at the end only parameters, buffers,
                // optimizer state (and the GradScaler's scalars) remain.
                let mut live: HashMap<&AllocId, (u64, Category)> = HashMap::new();
                for e in &t.events {
                    match e {
                        Event::Alloc {
                            id, size, category, ..
                        } => assert!(live.insert(id, (*size, *category)).is_none()),
                        Event::Free { id } => assert!(live.remove(id).is_some()),
                        _ => {}
                    }
                }
                let params: u64 = live
                    .values()
                    .filter(|(_, c)| *c == Category::Parameter)
                    .map(|(s, _)| s)
                    .sum();
                let width = if r.precision == Precision::Bf16 { 2 } else { 4 };
                assert_eq!(params, g.param_count() * width, "{model} {head}");
                for (_, c) in live.values() {
                    assert!(
                        matches!(
                            c,
                            Category::Parameter | Category::OptimizerState | Category::Other
                        ),
                        "{model} {head} {precision}: {c} left at the end"
                    );
                }
            }
        }
    }
}

#[test]
fn decoder_sequence_classification_pools_the_last_token() {
    // GPT2ForSequenceClassification: score Linear(768, N, bias=False) on every token, then
    // `logits[arange(B), last_non_pad_token]`: the [B, S, N] logits, the int32 mask and
    // product [B, S], the int32 arange [S], the int64 indices [B] and the [B, N] gather.
    let (b, s, n) = (4u64, 32u64, 3u64);
    let mut r = Recipe::new(b, s);
    r.head = Some(Head::SeqCls(n));
    let (g, t) = build("gpt2", &r);
    assert_eq!(g.param_count(), 124_439_808 + 768 * n);
    let sizes = |tag: &str| -> Vec<u64> {
        let fwd_end = phase_event(&t, "backward", 0);
        t.events[..fwd_end]
            .iter()
            .filter_map(|e| match e {
                Event::Alloc {
                    size, tag: Some(x), ..
                } if &**x == tag => Some(*size),
                _ => None,
            })
            .collect()
    };
    assert_eq!(sizes("aten.ne"), vec![b * s]);
    assert_eq!(sizes("aten.argmax"), vec![b * 8]);
    assert_eq!(sizes("aten.arange"), vec![s * 4, b * 8]);
    assert_eq!(sizes("aten.index"), vec![b * n * 4]);
    // IndexBackward0: zeros_like(logits) [B, S, N], filled in place by index_put_.
    assert!(t.events.iter().any(|e| matches!(
        e,
        Event::Alloc { size, tag: Some(x), .. } if *size == b * s * n * 4 && x.ends_with("aten.zeros_like")
    )));
}

#[test]
fn heads_and_sizes_say_what_is_valid() {
    let err = |model: &str, f: &dyn Fn(&mut Recipe)| {
        let mut r = Recipe::new(2, 16);
        f(&mut r);
        zoo::build(model, &r).unwrap_err().to_string()
    };
    let e = err("resnet50", &|r| r.head = Some(Head::Lm));
    assert!(
        e.contains("--num-classes") && e.contains("seq-cls:N"),
        "{e}"
    );
    let e = err("tinyllama-1.1b", &|r| r.head = Some(Head::MaskedLm));
    assert!(e.contains("lm, seq-cls:N, token-cls:N, none"), "{e}");
    let e = err("bert-base", &|r| r.head = Some(Head::Lm));
    assert!(e.contains("masked-lm, seq-cls:N, token-cls:N, none"), "{e}");
    let e = err("gpt2", &|r| r.num_classes = Some(3));
    assert!(e.contains("seq-cls:3"), "{e}");
    let e = err("gpt2", &|r| r.image_size = Some((224, 224)));
    assert!(e.contains("--seq"), "{e}");
    let e = err("mlp", &|r| r.image_size = Some((224, 224)));
    assert!(e.contains("features"), "{e}");
    let e = err("vit-b-16", &|r| r.image_size = Some((384, 256)));
    assert!(e.contains("square"), "{e}");
    let e = err("vit-b-16", &|r| r.image_size = Some((200, 200)));
    assert!(e.contains("patch size 16"), "{e}");
    let e = err("vgg16", &|r| r.image_size = Some((31, 64)));
    assert!(e.contains("32 pixels"), "{e}");
    let e = err("resnet18", &|r| {
        r.batch = 1;
        r.image_size = Some((32, 32))
    });
    assert!(e.contains("more than 1 value per channel"), "{e}");
    let mut r = Recipe::new(1, 0);
    r.image_size = Some((0, 224));
    assert!(r.validate().is_err());
}
