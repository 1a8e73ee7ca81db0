//! Graphs captured by `vramsim.from_module` (`python/vramsim/_graph_capture.py`, committed under
//! `tests/imported/`) lower to the same step as the zoo's hand-written models of the same torchvision
//! / torch.nn modules, at any batch (the batch is a variable of the document), and under each what-if.

use vramsim_models::imported::{ImportError, ImportedGraph};
use vramsim_models::{lower, peak_requested, zoo, Fidelity, OptimizerKind, Precision, Recipe};

fn load(name: &str) -> ImportedGraph {
    let path = format!("{}/tests/imported/{name}.json", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    ImportedGraph::parse(&text).unwrap()
}

#[test]
fn hand_computed_tiny_mlp_step() {
    // nn.Sequential(Linear(8, 16), ReLU(), Linear(16, 10)) captured at batch 4 with the default
    // loss (F.cross_entropy against int64 labels): the step closed_forms.rs computes by hand,
    // 2936 B under the meta-device capture's rules, 2872 B + the 32 MiB cuBLAS workspace of the
    // W1-gradient mm on CUDA (sm 9.0).
    let g = load("tiny").build(4).unwrap();
    for (fidelity, peak) in [
        (Fidelity::MetaCapture, 2936),
        (Fidelity::Cuda, 2872 + 33_554_432),
    ] {
        let mut r = Recipe::new(4, 0);
        r.optimizer = OptimizerKind::Sgd;
        r.fidelity = fidelity;
        assert_eq!(peak_requested(&lower(&g, &r).unwrap()), peak);
    }
}

#[test]
fn imported_torchvision_models_match_the_zoo() {
    for name in ["mlp", "resnet18", "resnet50", "vgg16"] {
        let imported = load(name);
        for batch in [1, 3, 16] {
            for precision in [Precision::Fp32, Precision::AmpBf16, Precision::Bf16] {
                for fidelity in [Fidelity::Cuda, Fidelity::MetaCapture] {
                    let mut r = Recipe::new(batch, 0);
                    r.precision = precision;
                    r.fidelity = fidelity;
                    let zoo_peak =
                        peak_requested(&lower(&zoo::build(name, &r).unwrap(), &r).unwrap());
                    let g = imported.build(batch).unwrap();
                    assert_eq!(g.param_count(), zoo::build(name, &r).unwrap().param_count());
                    let ours = peak_requested(&lower(&g, &r).unwrap());
                    println!(
                        "{name} batch {batch} {precision:?} {fidelity:?}: {ours} (zoo {zoo_peak})"
                    );
                    assert_eq!(
                        ours, zoo_peak,
                        "{name} batch {batch} {precision:?} {fidelity:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn captured_resnet_blocks_checkpoint_as_the_zoo_blocks() {
    // from_module marks the repeated children of an nn.Sequential (torchvision's BasicBlock /
    // Bottleneck) as blocks, the zoo's ResNet regions: every checkpointing what-if agrees.
    for name in ["resnet18", "resnet50"] {
        let imported = load(name);
        for ck in ["full", "every:2", "sqrt"] {
            let mut r = Recipe::new(8, 0);
            r.checkpointing = ck.parse().unwrap();
            r.precision = Precision::AmpBf16;
            let zoo_graph = zoo::build(name, &r).unwrap();
            let g = imported.build(8).unwrap();
            assert_eq!(g.regions.len(), zoo_graph.regions.len(), "{name}");
            let zoo_peak = peak_requested(&lower(&zoo_graph, &r).unwrap());
            let ours = peak_requested(&lower(&g, &r).unwrap());
            assert_eq!(ours, zoo_peak, "{name} --checkpoint {ck}");
        }
    }
}

#[test]
fn unsupported_calls_are_listed() {
    let path = format!("{}/tests/imported/tiny.json", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).unwrap();
    let text = text.replacen("\"op\":\"relu\"", "\"op\":\"celu\"", 1);
    match ImportedGraph::parse(&text) {
        Err(ImportError::Unsupported(ops)) => {
            assert_eq!(ops, vec![("celu".to_string(), "1".to_string(), 1)])
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    let e = ImportedGraph::parse("{\"format\": \"other\"}").unwrap_err();
    assert!(e.to_string().contains("vramsim-graph"), "{e}");
}

#[test]
fn relu6_saves_its_input_in_and_out_of_place() {
    // nn.Sequential(Linear(8, 16), act, Linear(16, 10)) at batch 4. PyTorch 2.15 autograd:
    // `hardtanh` saves `self`; `hardtanh_` (ReLU6(inplace=True)) has no formula of its own, so
    // it saves `original_self = self.clone()` and runs in place. Either way the step holds two
    // [4, 16] tensors (pre-activation or its clone, and the activation) with the same lifetimes:
    // the two steps agree to the byte. ReLU saves its result instead, so the pre-activation h
    // (4·16·4 = 256 B) is freed when relu returns: at every moment the ReLU6 step holds what the
    // ReLU step holds or 256 B more, so its peak lies in [ReLU's, ReLU's + 256].
    let relu = load("tiny");
    let relu6 = load("tiny_relu6");
    let relu6_ = load("tiny_relu6_inplace");
    for fidelity in [Fidelity::Cuda, Fidelity::MetaCapture] {
        let mut r = Recipe::new(4, 0);
        r.optimizer = OptimizerKind::Sgd;
        r.fidelity = fidelity;
        let peak = |g: &ImportedGraph| peak_requested(&lower(&g.build(4).unwrap(), &r).unwrap());
        let (a, b, c) = (peak(&relu), peak(&relu6), peak(&relu6_));
        println!("{fidelity:?}: relu {a}, relu6 {b}, relu6_ {c}");
        assert_eq!(b, c, "{fidelity:?}");
        assert!(a <= b && b <= a + 256, "{fidelity:?}: {a} vs {b}");
    }
}

#[test]
fn torchvision_mobilenet_v2_lowers() {
    // torchvision 0.29 `mobilenet_v2()` (ReLU6(inplace=True) is `F.hardtanh(x, 0, 6, True)`, the
    // depthwise convolutions are `groups=C`): it lowers at any batch, with the 3,504,872
    // parameters torchvision's model card lists (MobileNet_V2_Weights.IMAGENET1K_V1 `num_params`).
    let g = load("mobilenet_v2");
    let mut last = 0;
    for batch in [1, 3, 16] {
        let built = g.build(batch).unwrap();
        assert_eq!(built.param_count(), 3_504_872);
        for fidelity in [Fidelity::Cuda, Fidelity::MetaCapture] {
            let mut r = Recipe::new(batch, 0);
            r.fidelity = fidelity;
            let peak = peak_requested(&lower(&built, &r).unwrap());
            println!("mobilenet_v2 batch {batch} {fidelity:?}: {peak}");
            if fidelity == Fidelity::MetaCapture {
                assert!(peak > last, "the peak grows with the batch");
                last = peak;
            }
        }
    }
}

#[test]
fn imported_vit_b_16_matches_the_zoo() {
    // torchvision 0.29 `vit_b_16()`: `nn.MultiheadAttention` in training calls
    // `F.multi_head_attention_forward` (lowered by the zoo ViT's own function) and the head takes
    // `x[:, 0]` (`__getitem__`: a select). The same step as the zoo's `vit-b-16` — 86,567,656
    // parameters (torchvision's ViT_B_16_Weights `num_params`) — on each SDPA backend PyTorch
    // picks (memory-efficient for fp32, FlashAttention-2 for bf16 on sm 9.0).
    let imported = load("vit_b_16");
    for batch in [1, 8, 32] {
        for precision in [Precision::Fp32, Precision::AmpBf16, Precision::Bf16] {
            for fidelity in [Fidelity::Cuda, Fidelity::MetaCapture] {
                let mut r = Recipe::new(batch, 0);
                r.precision = precision;
                r.fidelity = fidelity;
                let zoo_graph = zoo::build("vit-b-16", &r).unwrap();
                let zoo_peak = peak_requested(&lower(&zoo_graph, &r).unwrap());
                let g = imported.build_for(batch, &r).unwrap();
                assert_eq!(g.param_count(), 86_567_656);
                assert_eq!(zoo_graph.param_count(), 86_567_656);
                let ours = peak_requested(&lower(&g, &r).unwrap());
                println!(
                    "vit_b_16 batch {batch} {precision:?} {fidelity:?}: {ours} (zoo {zoo_peak})"
                );
                assert_eq!(ours, zoo_peak, "batch {batch} {precision:?} {fidelity:?}");
            }
        }
    }
}

#[test]
fn imported_vit_b_16_chooses_the_zoo_attention_kernel() {
    // The kernel reported for (and shared across GPUs by `target_choices`) a captured
    // nn.MultiheadAttention is the zoo ViT's on every target and precision: cuDNN is preferred
    // only on sm 9.x/10.x (`check_prefer_cudnn_attention`), so sm 8.0 and sm 9.0 differ for bf16.
    let imported = std::sync::Arc::new(load("vit_b_16"));
    let ours = zoo::Arch::Imported(imported.clone());
    let theirs = zoo::Arch::from_name("vit-b-16").unwrap();
    let mut kernels = std::collections::BTreeSet::new();
    for cc in [(8, 0), (9, 0)] {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let mut r = Recipe::new(4, 0);
            r.precision = precision;
            r.target.compute_capability = cc;
            let a = ours.attention_kernel(&r).unwrap().unwrap();
            let b = theirs.attention_kernel(&r).unwrap().unwrap();
            assert_eq!(a.kernel, b.kernel, "sm {cc:?} {precision:?}");
            assert_eq!(
                ours.target_choices(&r).unwrap(),
                theirs.target_choices(&r).unwrap()
            );
            kernels.insert(format!("{:?}", a.kernel));
            let zoo_peak =
                peak_requested(&lower(&zoo::build("vit-b-16", &r).unwrap(), &r).unwrap());
            let g = imported.build_for(4, &r).unwrap();
            assert_eq!(peak_requested(&lower(&g, &r).unwrap()), zoo_peak);
        }
    }
    assert!(kernels.len() >= 3, "{kernels:?}");
}

#[test]
fn torchvision_convnext_tiny_lowers_with_stochastic_depth() {
    // torchvision 0.29 `convnext_tiny()` in training: each CNBlock's StochasticDepth (p up to 0.1,
    // "row") runs `torch.empty([B, 1, 1, 1])`, `bernoulli_`, `div_` and `input * noise`. It lowers
    // at any batch with the 28,589,128 parameters of torchvision's model card
    // (ConvNeXt_Tiny_Weights.IMAGENET1K_V1 `num_params`).
    let g = load("convnext_tiny");
    let mut last = 0;
    for batch in [1, 3, 16] {
        let built = g.build(batch).unwrap();
        assert_eq!(built.param_count(), 28_589_128);
        for precision in [Precision::Fp32, Precision::AmpBf16, Precision::Bf16] {
            let mut r = Recipe::new(batch, 0);
            r.precision = precision;
            let peak = peak_requested(&lower(&g.build_for(batch, &r).unwrap(), &r).unwrap());
            println!("convnext_tiny batch {batch} {precision:?}: {peak}");
            if precision == Precision::Fp32 {
                assert!(peak > last, "the peak grows with the batch");
                last = peak;
            }
        }
    }
}

#[test]
fn silu_in_place_saves_a_clone() {
    // nn.Sequential(Linear(8, 16), SiLU(inplace=True), Linear(16, 10)) against SiLU(): `silu`
    // saves `self`; `silu_` has no formula of its own and saves `original_self = self.clone()`
    // before running in place. Both hold two [4, 16] tensors with the same lifetimes: the same
    // step to the byte.
    let out_of_place = load("tiny_silu");
    let in_place = load("tiny_silu_inplace");
    for fidelity in [Fidelity::Cuda, Fidelity::MetaCapture] {
        for precision in [Precision::Fp32, Precision::AmpBf16] {
            let mut r = Recipe::new(4, 0);
            r.precision = precision;
            r.fidelity = fidelity;
            let peak =
                |g: &ImportedGraph| peak_requested(&lower(&g.build(4).unwrap(), &r).unwrap());
            assert_eq!(
                peak(&out_of_place),
                peak(&in_place),
                "{fidelity:?} {precision:?}"
            );
        }
    }
}

/// Live requested bytes when `phase` first begins (the trace's `phases` metadata).
fn live_at_phase(trace: &vramsim_traces::Trace, phase: &str) -> u64 {
    let at = trace.meta["phases"]
        .as_array()
        .and_then(|p| p.iter().find(|x| x["phase"] == phase))
        .and_then(|x| x["event"].as_u64())
        .expect("the phase is marked") as usize;
    {
        let mut live = std::collections::HashMap::new();
        for e in &trace.events[..at] {
            match e {
                vramsim_traces::Event::Alloc { id, size, .. } => {
                    live.insert(id.clone(), *size);
                }
                vramsim_traces::Event::Free { id } => {
                    live.remove(id);
                }
                _ => {}
            }
        }
        live.values().sum::<u64>()
    }
}

#[test]
fn in_place_dropout_saves_its_noise() {
    // nn.Sequential(Linear(8, 16), Dropout(0.5[, inplace=True]), Linear(16, 10)) at batch 4.
    // Out of place, CUDA's fused `native_dropout` gives y (4·16·4 = 256 B) and a bool mask (64 B),
    // saved by the second Linear and by the node; h dies. In place, ATen's `dropout_`
    // (`_dropout_impl<true>`) writes into h, saved by the second Linear (256 B), and
    // MulBackward0 saves the float noise (256 B). When the forward ends the in-place step holds
    // 512 − 320 = 192 B more.
    let out_of_place = load("tiny_dropout");
    let in_place = load("tiny_dropout_inplace");
    for fidelity in [Fidelity::Cuda, Fidelity::MetaCapture] {
        let mut r = Recipe::new(4, 0);
        r.optimizer = OptimizerKind::Sgd;
        r.iterations = 1;
        r.fidelity = fidelity;
        let live = |g: &ImportedGraph| {
            live_at_phase(&lower(&g.build(4).unwrap(), &r).unwrap(), "backward")
        };
        let (a, b) = (live(&out_of_place), live(&in_place));
        println!("{fidelity:?}: dropout {a}, dropout_ {b}");
        assert_eq!(b, a + 192, "{fidelity:?}");
    }
}

#[test]
fn a_call_without_a_rule_falls_back_on_its_recording() {
    // nn.CELU has no rule: the capture recorded a new output like its input and its input saved
    // (CELU is ATen's `elu`, derivatives.yaml `elu_backward(..., self)`), a node, and the lowering
    // gives one gradient of the input's shape: SiLU's memory behaviour, so the steps agree to the
    // byte.
    let celu = load("tiny_celu");
    assert_eq!(celu.unsupported(), vec![]);
    assert_eq!(
        celu.recorded(),
        vec![("celu".to_string(), "1".to_string(), 1)]
    );
    let silu = load("tiny_silu");
    for fidelity in [Fidelity::Cuda, Fidelity::MetaCapture] {
        for precision in [Precision::Fp32, Precision::Bf16] {
            for batch in [4, 64] {
                let mut r = Recipe::new(batch, 0);
                r.precision = precision;
                r.fidelity = fidelity;
                let peak = |g: &ImportedGraph| {
                    peak_requested(&lower(&g.build(batch).unwrap(), &r).unwrap())
                };
                assert_eq!(peak(&celu), peak(&silu), "{fidelity:?} {precision:?}");
            }
        }
    }
}

#[test]
fn efficientnet_b0_and_mobilenet_v3_large_match_their_recordings() {
    // torchvision 0.29 `efficientnet_b0()` (SiLU(inplace=True), SqueezeExcitation, stochastic depth,
    // `Dropout(0.2, inplace=True)` in the classifier) and `mobilenet_v3_large()` (hardswish,
    // hardsigmoid(inplace=True)), with the parameter counts of torchvision's model cards
    // (`num_params`), against the same step recorded by PyTorch 2.15 with `vramsim.record` at batch
    // 8 (AdamW foreach, 2 iterations; fp32 on the meta device, amp-bf16 on fake CPU tensors under
    // CUDA's autocast policy), peak requested bytes of the recording.
    for (name, params, fp32, amp) in [
        ("efficientnet_b0", 5_288_548, 778_407_744u64, 436_988_656u64),
        ("mobilenet_v3_large", 5_483_032, 431_804_920, 265_590_152),
    ] {
        let g = load(name);
        for (precision, theirs) in [(Precision::Fp32, fp32), (Precision::AmpBf16, amp)] {
            let mut r = Recipe::new(8, 0);
            r.precision = precision;
            r.fidelity = Fidelity::MetaCapture;
            let built = g.build_for(8, &r).unwrap();
            assert_eq!(built.param_count(), params, "{name}");
            let ours = peak_requested(&lower(&built, &r).unwrap());
            let err = (ours as f64 - theirs as f64) / theirs as f64 * 100.0;
            println!("{name} {precision:?}: recorded {theirs}, ours {ours} ({err:+.4}%)");
            assert!(err.abs() <= 1.0, "{name} {precision:?}: {ours} vs {theirs}");
        }
    }
}
