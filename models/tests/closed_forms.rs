//! Closed forms where their assumptions hold, with numbers derived by hand or from the papers'
//! formulas (never from this crate's output).

use std::collections::HashMap;
use vramsim_models::zoo::{self, gpt2, nn::AttnImpl};
use vramsim_models::{
    lower, peak_requested, Checkpointing, DType, DTypeSpec, Fidelity, GraphBuilder, OptimizerKind,
    Precision, Recipe,
};
mod common;
use common::{live_at, phase_index};
use vramsim_traces::{AllocId, Category, Event};

fn by_category(live: &[(u64, Category, String)], c: Category) -> u64 {
    live.iter().filter(|x| x.1 == c).map(|x| x.0).sum()
}

#[test]
fn parameter_counts_match_the_published_models() {
    // GPT-2: V h + P h + L (12 h² + 13 h) + 2 h (tied lm_head).
    let gpt = |h: u64, l: u64| 50257 * h + 1024 * h + l * (12 * h * h + 13 * h) + 2 * h;
    // LLaMA: 2 V h (untied) + L (2 h² + 2 h·kv·d + 3 h·i + 2 h) + h.
    let llama = |h: u64, i: u64, l: u64, kvh: u64, heads: u64, v: u64| {
        let d = h / heads;
        2 * v * h + l * (2 * h * h + 2 * h * kvh * d + 3 * h * i + 2 * h) + h
    };
    // torchvision's published counts (`torchvision.models.get_model_weights(...).meta["num_params"]`)
    // and HF BertForMaskedLM's (bert-base-uncased, bert-large-uncased with the MLM head).
    let cases: [(&str, u64); 19] = [
        ("resnet18", 11_689_512),
        ("resnet34", 21_797_672),
        ("resnet50", 25_557_032),
        ("resnet101", 44_549_160),
        ("resnet152", 60_192_808),
        ("vgg16", 138_357_544),
        ("vit-b-16", 86_567_656),
        ("bert-base", 109_514_298),
        ("bert-large", 335_174_458),
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
        ("tinyllama-1.1b", 1_100_048_384),
        ("llama2-7b", 6_738_415_616),
        ("llama2-13b", 13_015_864_320),
        ("llama2-70b", 68_976_648_192),
        ("llama3-8b", 8_030_261_248),
        (
            "mlp",
            1024 * 4096 + 4096 + 2 * (4096 * 4096 + 4096) + 4096 * 1000 + 1000,
        ),
    ];
    assert_eq!(gpt(768, 12), 124_439_808);
    assert_eq!(gpt(1600, 48), 1_557_611_200);
    assert_eq!(llama(4096, 11008, 32, 32, 32, 32000), 6_738_415_616);
    assert_eq!(llama(2048, 5632, 22, 4, 32, 32000), 1_100_048_384);
    for (name, n) in cases {
        let r = Recipe::new(1, if name == "mlp" { 0 } else { 8 });
        assert_eq!(zoo::build(name, &r).unwrap().param_count(), n, "{name}");
    }
}

#[test]
fn zero_sixteen_bytes_per_parameter_for_mixed_precision_adam() {
    // ZeRO §3: mixed-precision Adam keeps 16 Ψ bytes of model states. PyTorch AMP keeps float32
    // parameters (4), float32 gradients (4), exp_avg and exp_avg_sq (4 + 4): also 16 Ψ.
    for precision in [Precision::AmpBf16, Precision::AmpFp16] {
        let mut r = Recipe::new(1, 64);
        r.precision = precision;
        r.optimizer = OptimizerKind::Adam;
        let g = zoo::build("gpt2", &r).unwrap();
        let psi = g.param_count();
        let t = lower(&g, &r).unwrap();
        let live = live_at(&t, phase_index(&t, "zero_grad", 0));
        assert_eq!(by_category(&live, Category::Parameter), 4 * psi);
        assert_eq!(by_category(&live, Category::Gradient), 4 * psi);
        assert_eq!(by_category(&live, Category::OptimizerState), 8 * psi);
        let states: u64 = [
            Category::Parameter,
            Category::Gradient,
            Category::OptimizerState,
        ]
        .iter()
        .map(|&c| by_category(&live, c))
        .sum();
        assert_eq!(states, 16 * psi, "{precision}");
    }
}

#[test]
fn hf_eighteen_bytes_per_parameter_for_amp_adamw() {
    // HF's model_memory_anatomy: AMP + AdamW needs 6 (fp32 weights + 16-bit copies) + 8 (Adam) +
    // 4 (fp32 grads) = 18 bytes per parameter. A bias-free MLP routes every parameter through a
    // matmul, so every parameter has a 16-bit copy in the autocast cache during the forward.
    let dims = [256u64, 512, 512, 10];
    let batch = 32;
    let mut b = GraphBuilder::new("mlp-nobias", batch, 0);
    let x = b.input("x", &[batch, dims[0]], DTypeSpec::Model);
    let y = b.input("y", &[batch], DTypeSpec::Fixed(DType::I64));
    let mut h = x;
    for i in 0..3 {
        h = b.linear(&format!("{i}"), h, dims[i + 1], false);
        if i < 2 {
            h = b.relu(h);
        }
    }
    let loss = b.cross_entropy(h, y);
    b.set_output(loss);
    let g = b.finish().unwrap();
    let psi = g.param_count();
    assert_eq!(psi, 256 * 512 + 512 * 512 + 512 * 10);
    let mut r = Recipe::new(batch, 0);
    r.precision = Precision::AmpFp16;
    let t = lower(&g, &r).unwrap();
    // The second forward just before autocast exits (its last allocation): fp32 parameters, the
    // autocast cache's fp16 copy of every weight, Adam state. (After the exit only the copies the
    // matmuls saved stay: not the first layer's, whose input needs no gradient.)
    let (fw, bw) = (
        phase_index(&t, "forward", 1),
        phase_index(&t, "backward", 1),
    );
    let copy_sizes = [256 * 512 * 2, 512 * 512 * 2, 512 * 10 * 2];
    let mut copies: HashMap<&AllocId, u64> = HashMap::new();
    let mut weights16 = 0;
    for e in &t.events[fw..bw] {
        match e {
            Event::Alloc { id, size, tag, .. }
                if tag.as_deref().is_some_and(|t| t.ends_with("aten._to_copy"))
                    && copy_sizes.contains(size) =>
            {
                copies.insert(id, *size);
                weights16 = weights16.max(copies.values().sum::<u64>());
            }
            Event::Free { id } => {
                copies.remove(id);
            }
            _ => {}
        }
    }
    let live = live_at(&t, bw);
    assert_eq!(by_category(&live, Category::Parameter), 4 * psi);
    assert_eq!(weights16, 2 * psi);
    assert_eq!(by_category(&live, Category::OptimizerState), 8 * psi);
    let grads = by_category(
        &live_at(&t, phase_index(&t, "zero_grad", 1)),
        Category::Gradient,
    );
    assert_eq!(grads, 4 * psi);
    assert_eq!(4 * psi + weights16 + 8 * psi + grads, 18 * psi);
}

#[test]
fn korthikanti_activations_per_layer_for_an_all_16_bit_gpt_layer() {
    // Korthikanti et al. 2022, §4.1: a transformer layer stores sbh(34 + 5as/h) bytes of
    // activations when every saved tensor is 16-bit and dropout masks are 1 byte:
    //   attention 11sbh + 5as²b: QKV input 2sbh, Q and K 4sbh, softmax output 2as²b, its dropout
    //     mask as²b and output 2as²b, V 2sbh, projection input 2sbh, dropout mask sbh;
    //   MLP 19sbh: fc input 2sbh, GeLU input 8sbh, projection input 8sbh, dropout mask sbh;
    //   two LayerNorm inputs 4sbh.
    // The matching configuration: GPT-2 layers in bfloat16 (model cast, so nothing is float32),
    // GeLU as one op that saves its input (the paper's assumption; HF's gelu_new is 8 ops), eager
    // attention. The paper leaves out LayerNorm's mean and rstd: float32 [s·b] each, 16sb per layer.
    let (s, b) = (256u64, 2u64);
    let mut cfg = gpt2::GPT2_MEDIUM.clone();
    cfg.activation = vramsim_models::zoo::nn::Activation::GeluTanh;
    let (h, a) = (cfg.hidden, cfg.heads);
    let g = gpt2::gpt2(&cfg, b, s, AttnImpl::Eager).unwrap();
    let mut r = Recipe::new(b, s);
    r.precision = Precision::Bf16;
    r.iterations = 1;
    let t = lower(&g, &r).unwrap();
    let live = live_at(&t, phase_index(&t, "backward", 0));
    let layer = |i: u64| -> u64 {
        let p1 = format!("transformer.h.{i}.");
        let p2 = format!("transformer.h.{i}:");
        live.iter()
            .filter(|x| {
                x.1 == Category::Activation && (x.2.starts_with(&p1) || x.2.starts_with(&p2))
            })
            .map(|x| x.0)
            .sum()
    };
    let sbh = s * b * h;
    let korthikanti = 34 * sbh + 5 * a * s * s * b;
    let ln_stats = 2 * 2 * 4 * s * b;
    for i in 1..cfg.layers - 1 {
        assert_eq!(layer(i), korthikanti + ln_stats, "layer {i}");
    }
    // Term by term for one layer: attention, MLP, LayerNorm inputs.
    let tagged = |pat: &str| -> u64 {
        live.iter()
            .filter(|x| x.1 == Category::Activation && x.2.starts_with(pat))
            .map(|x| x.0)
            .sum()
    };
    let attn = tagged("transformer.h.5.attn");
    let mlp = tagged("transformer.h.5.mlp");
    let ln = tagged("transformer.h.5.ln_1") + tagged("transformer.h.5.ln_2");
    let adds = tagged("transformer.h.5:");
    // The attention module holds everything but its QKV input (LayerNorm 1's output): 9sbh + 5as²b.
    assert_eq!(attn, 9 * sbh + 5 * a * s * s * b);
    // The MLP holds GeLU input, GeLU output (= projection input) and the dropout mask: 17sbh.
    assert_eq!(mlp, 17 * sbh);
    // LayerNorm outputs (QKV input, fc input) 2 × 2sbh, plus the mean/rstd the paper ignores.
    assert_eq!(ln, 4 * sbh + ln_stats);
    // The two residual sums are the next LayerNorms' inputs: 4sbh.
    assert_eq!(adds, 4 * sbh);
    assert_eq!(
        attn + mlp + ln + adds,
        sbh * 34 + 5 * a * s * s * b + ln_stats
    );
}

#[test]
fn hand_computed_mlp_step() {
    // Linear(8, 16) + ReLU + Linear(16, 10) + cross-entropy, batch 4, fp32, SGD.
    // Parameters 4·(128 + 16 + 160 + 10) = 1256 B; inputs x 128 B, labels 32 B.
    // Forward: addmm 256, relu 256 (saved; addmm freed), logits 160, log_softmax 160 (saved),
    //   loss 4 + total_weight 4; logits freed when cross_entropy returns. Forward peak 2000.
    // Backward: ones 4 (1844) → nll_loss_backward 160 (2004) → total_weight freed (2000) →
    //   log_softmax_backward 160 (2160) → nll grad freed, log_softmax freed (1840) →
    //   AddmmBackward: mat1 grad 256 (2096), W2 grad 640 (2736), b2 = sum_to 40 (2776), incoming
    //   grad freed (2616) → threshold_backward 256 (2872) → mm grad, relu output freed (2360) →
    //   AddmmBackward (x needs no grad): W1 grad 512 (2872), b1 sum 64 (2936). Peak 2936 B.
    // On CUDA every GEMM also takes a workspace for its call (PyTorch 2.15, sm 9.0: 32 MiB for
    // cuBLAS, 1 MiB for the cuBLASLt forward addmms): the largest sum is the W1-gradient mm's,
    // 2872 + 33,554,432 B; the workspaces are gone again at each phase boundary.
    let mut b = GraphBuilder::new("tiny", 4, 0);
    let x = b.input("x", &[4, 8], DTypeSpec::Model);
    let y = b.input("y", &[4], DTypeSpec::Fixed(DType::I64));
    let h = b.linear("0", x, 16, true);
    let h = b.relu(h);
    let logits = b.linear("2", h, 10, true);
    b.push_module("");
    b.hold(logits);
    let loss = b.cross_entropy(logits, y);
    b.pop_module("");
    b.set_output(loss);
    let g = b.finish().unwrap();
    for fidelity in [Fidelity::Cuda, Fidelity::MetaCapture] {
        let mut r = Recipe::new(4, 0);
        r.optimizer = OptimizerKind::Sgd;
        r.fidelity = fidelity;
        let t = lower(&g, &r).unwrap();
        let peak = match fidelity {
            Fidelity::Cuda => 2872 + 33_554_432,
            Fidelity::MetaCapture => 2936,
        };
        assert_eq!(peak_requested(&t), peak);
        let fwd = live_at(&t, phase_index(&t, "backward", 0));
        assert_eq!(fwd.iter().map(|x| x.0).sum::<u64>(), 1840);
        let end = live_at(&t, phase_index(&t, "optimizer", 0));
        assert_eq!(by_category(&end, Category::Gradient), 1256);
        assert_eq!(end.iter().map(|x| x.0).sum::<u64>(), 2512);
    }
}

#[test]
fn checkpointing_keeps_only_block_inputs() {
    // With every block checkpointed, what stays at the end of the forward per block is its input
    // (the previous block's output, 4·sbh bytes in fp32), held by the checkpoint frame.
    let (s, bsz) = (128u64, 2u64);
    let mut r = Recipe::new(bsz, s);
    r.checkpointing = Checkpointing::Full;
    r.iterations = 1;
    let g = zoo::build("gpt2", &r).unwrap();
    let t = lower(&g, &r).unwrap();
    let live = live_at(&t, phase_index(&t, "backward", 0));
    let h5: u64 = live
        .iter()
        .filter(|x| x.1 == Category::Activation && x.2.starts_with("transformer.h.5"))
        .map(|x| x.0)
        .sum();
    assert_eq!(h5, 4 * s * bsz * 768);
}

#[test]
fn timm_parameter_counts_match_the_published_models() {
    // ViT (timm VisionTransformer, class token, no layer scale): cls_token D, pos_embed (N + 1) D,
    // patch_embed 3 p² D + D, per block 12 D² + 13 D, final norm 2 D, head D K + K.
    let vit = |d: u64, l: u64, p: u64, img: u64| {
        let n = (img / p) * (img / p);
        d + (n + 1) * d + (3 * p * p * d + d) + l * (12 * d * d + 13 * d) + 2 * d + d * 1000 + 1000
    };
    // ConvNeXt: stem 4×4 conv + LayerNorm2d, downsample LN + 2×2 conv, per block gamma d +
    // depthwise 49 d + d + LN 2 d + fc1 4 d² + 4 d + fc2 4 d² + d (Linear or 1×1 conv alike), head
    // LN + fc.
    let convnext = |depths: [u64; 4], dims: [u64; 4]| {
        let mut t = 3 * 16 * dims[0] + dims[0] + 2 * dims[0];
        for i in 0..4 {
            if i > 0 {
                t += 2 * dims[i - 1] + 4 * dims[i - 1] * dims[i] + dims[i];
            }
            t += depths[i] * (8 * dims[i] * dims[i] + 58 * dims[i]);
        }
        t + 2 * dims[3] + dims[3] * 1000 + 1000
    };
    // ResNet-26 (Bottleneck [2, 2, 2, 2]), by hand: stem 3·49·64 + BN 128; per stage the
    // bottleneck convs (in·p, 9 p², 4 p²) with three BNs (2p, 2p, 8p), the downsample (in·4p + 8p)
    // in each stage's first block; fc 2048·1000 + 1000.
    let mut rn26 = 3 * 49 * 64 + 128;
    let mut inp = 64;
    for i in 0..4 {
        let p = 64u64 << i;
        for j in 0..2 {
            rn26 += inp * p + 2 * p + 9 * p * p + 2 * p + 4 * p * p + 8 * p;
            if j == 0 {
                rn26 += inp * 4 * p + 8 * p;
            }
            inp = 4 * p;
        }
    }
    rn26 += 2048 * 1000 + 1000;
    // Exact figures published by torchvision for the same architectures (ResNets, vit_b_16,
    // vit_b_32, vit_l_16, convnext_tiny/small/base/large, efficientnet_b0); the others by the
    // formulas above. Every one also rounds to
    // timm's own `param_count` (millions, two decimals) in
    // results/benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv.
    let cases: [(&str, u64, f64); 21] = [
        ("timm/resnet18", 11_689_512, 11.69),
        ("timm/resnet26", rn26, 16.0),
        ("timm/resnet34", 21_797_672, 21.8),
        ("timm/resnet50", 25_557_032, 25.56),
        ("timm/resnet101", 44_549_160, 44.55),
        ("timm/resnet152", 60_192_808, 60.19),
        ("timm/vit_tiny_patch16_224", vit(192, 12, 16, 224), 5.72),
        ("timm/vit_small_patch16_224", vit(384, 12, 16, 224), 22.05),
        ("timm/vit_base_patch32_224", 88_224_232, 88.22),
        ("timm/vit_base_patch16_224", 86_567_656, 86.57),
        ("timm/vit_base_patch16_384", vit(768, 12, 16, 384), 86.86),
        ("timm/vit_large_patch16_224", 304_326_632, 304.33),
        ("timm/deit_tiny_patch16_224", vit(192, 12, 16, 224), 5.72),
        ("timm/deit_small_patch16_224", vit(384, 12, 16, 224), 22.05),
        ("timm/deit_base_patch16_224", 86_567_656, 86.57),
        ("timm/efficientnet_b0", 5_288_548, 5.29),
        (
            "timm/convnext_nano",
            convnext([2, 2, 8, 2], [80, 160, 320, 640]),
            15.59,
        ),
        ("timm/convnext_tiny", 28_589_128, 28.59),
        ("timm/convnext_small", 50_223_688, 50.22),
        ("timm/convnext_base", 88_591_464, 88.59),
        ("timm/convnext_large", 197_767_336, 197.77),
    ];
    assert_eq!(vit(768, 12, 16, 224), 86_567_656);
    assert_eq!(vit(768, 12, 32, 224), 88_224_232);
    assert_eq!(vit(1024, 24, 16, 224), 304_326_632);
    assert_eq!(convnext([3, 3, 9, 3], [96, 192, 384, 768]), 28_589_128);
    assert_eq!(convnext([3, 3, 27, 3], [96, 192, 384, 768]), 50_223_688);
    assert_eq!(convnext([3, 3, 27, 3], [128, 256, 512, 1024]), 88_591_464);
    assert_eq!(convnext([3, 3, 27, 3], [192, 384, 768, 1536]), 197_767_336);
    let r = Recipe::new(2, 1);
    for (name, n, csv_millions) in cases {
        assert_eq!(
            (n as f64 / 1e4).round() / 100.0,
            csv_millions,
            "{name} against timm's CSV"
        );
        assert_eq!(zoo::build(name, &r).unwrap().param_count(), n, "{name}");
    }
    // num_classes and image_size change the head and the position embedding as
    // timm.create_model(name, num_classes=10, img_size=384) does.
    let mut r10 = Recipe::new(2, 1);
    r10.num_classes = Some(10);
    r10.image_size = Some((384, 384));
    let g = zoo::build("timm/vit_base_patch16_224", &r10).unwrap();
    assert_eq!(
        g.param_count(),
        vit(768, 12, 16, 384) - 990 * 768 - 990,
        "vit_base_patch16_224 at 384, 10 classes"
    );
}

#[test]
fn nanogpt_parameter_counts_follow_model_py() {
    use vramsim_models::zoo::nanogpt::NanoGptConfig;
    // model.py with vocab V = 50304 and T = 1024 positions, per layer: c_attn 3d² (+3d), c_proj
    // d² (+d), c_fc 4d² (+4d), mlp.c_proj 4d² (+d), two LayerNorms 2d (+2d); ln_f d (+d); wte
    // V d (tied to lm_head), wpe T d. bias=False: L(12d² + 2d) + d(V + T) + d, erees's formula.
    let count = |l: u64, d: u64, bias: bool| {
        let b = u64::from(bias);
        l * (12 * d * d + 2 * d + b * 11 * d) + d * (50304 + 1024) + d + b * d
    };
    for (name, l, d) in [
        ("nanogpt", 12, 768),
        ("nanogpt-medium", 24, 1024),
        ("nanogpt-large", 36, 1280),
        ("nanogpt-xl", 48, 1600),
    ] {
        for bias in [true, false] {
            let n = if bias {
                name.to_string()
            } else {
                format!("{name}-nobias")
            };
            let cfg = NanoGptConfig::from_name(&n).expect("zoo name");
            let r = Recipe::new(1, 64);
            let g = zoo::build(&n, &r).expect("build");
            assert_eq!(g.param_count(), count(l, d, bias), "{n}");
            assert_eq!(cfg.param_count(), count(l, d, bias), "{n}");
        }
    }
    // erees's published counts (bias=False): 124,373,760 / 354,599,936 / 773,582,080.
    assert_eq!(count(12, 768, false), 124_373_760);
    assert_eq!(count(24, 1024, false), 354_599_936);
    assert_eq!(count(36, 1280, false), 773_582_080);
    // nanoGPT prints "number of parameters: 123.69M" for GPT-2 124M (vocab 50304, bias=True):
    // get_num_params() subtracts wpe.
    let printed = count(12, 768, true) - 1024 * 768;
    assert_eq!(format!("{:.2}M", printed as f64 / 1e6), "123.69M");
}
