//! Every recipe option lowers to a consistent trace: ids allocated once and freed once, and at
//! the end only parameters, buffers, optimizer state (and gradients with `zero_grad=zero`, the
//! GradScaler's two scalars when a scaler runs) remain. Plus the errors a person gets.

use std::collections::HashMap;
use vramsim_models::*;
use vramsim_traces::{AllocId, Category, Event, Trace};

fn end_state(t: &Trace) -> HashMap<Category, u64> {
    let mut live: HashMap<&AllocId, (u64, Category)> = HashMap::new();
    for e in &t.events {
        match e {
            Event::Alloc {
                id, size, category, ..
            } => assert!(
                live.insert(id, (*size, *category)).is_none(),
                "{id} allocated twice"
            ),
            Event::Free { id } => assert!(live.remove(id).is_some(), "{id} freed but not live"),
            _ => {}
        }
    }
    let mut out = HashMap::new();
    for (s, c) in live.into_values() {
        *out.entry(c).or_insert(0) += s;
    }
    out
}

#[test]
fn every_option_lowers_to_a_consistent_trace() {
    let precisions = ["fp32", "bf16", "amp-fp16", "amp-bf16"];
    let ckpts = ["none", "full", "every:2", "selective", "sqrt"];
    let optims = [
        "sgd",
        "sgd-momentum",
        "adam",
        "adamw",
        "adafactor",
        "sgd-nesterov",
        "adafactor-hf",
    ];
    let models = [
        "mlp",
        "gpt2",
        "tinyllama-1.1b",
        "bert-base",
        "resnet18",
        "resnet50",
        "vgg16",
        "vit-b-16",
        "timm/vit_tiny_patch16_224",
        "timm/convnext_tiny",
        "timm/resnet26",
        "timm/efficientnet_b0",
    ];
    for model in models {
        let seq = zoo::Arch::from_name(model)
            .unwrap()
            .max_positions()
            .map_or(0, |_| 32);
        for (i, p) in precisions.iter().enumerate() {
            for (j, c) in ckpts.iter().enumerate() {
                let mut r = Recipe::new(1, seq);
                r.precision = p.parse().unwrap();
                r.checkpointing = c.parse().unwrap();
                r.optimizer = optims[(i + j) % optims.len()].parse().unwrap();
                // Every attention the default H100 target can run for every precision (flash
                // and cuDNN refuse fp32: see `forced_backends_lower_consistently`).
                r.attention = ["eager", "auto", "sdpa-mem-efficient", "sdpa-math"][(i + 2 * j) % 4]
                    .parse()
                    .unwrap();
                // A model that never calls SDPA refuses a forced kernel (tested below).
                if zoo::Arch::from_name(model).unwrap().sdpa_call(&r).is_none() {
                    r.attention = Attention::Auto;
                }
                r.zero_grad = if (i + j) % 2 == 0 {
                    ZeroGrad::SetToNone
                } else {
                    ZeroGrad::Zero
                };
                r.accum = 1 + (j as u32 % 2);
                r.optimizer_impl = if matches!(
                    r.optimizer,
                    OptimizerKind::Adafactor | OptimizerKind::AdafactorHf
                ) {
                    OptimizerImpl::Foreach
                } else {
                    ["foreach", "fused", "for-loop"][i % 3].parse().unwrap()
                };
                r.clip_grad_norm = if (i + j) % 3 == 0 { Some(1.0) } else { None };
                r.grad_scaler = match (i + 2 * j) % 3 {
                    0 => None,
                    1 => Some(true),
                    _ => Some(false),
                };
                let g = zoo::build(model, &r).unwrap();
                let t = lower(&g, &r).unwrap_or_else(|e| panic!("{model} {}: {e}", r.name()));
                let end = end_state(&t);
                let params = g.param_count() * if r.precision == Precision::Bf16 { 2 } else { 4 };
                assert_eq!(
                    end.get(&Category::Parameter).copied().unwrap_or(0),
                    params,
                    "{model} {}",
                    r.name()
                );
                let grads = end.get(&Category::Gradient).copied().unwrap_or(0);
                // ViT at batch 1: `class_token.expand(1, -1, -1)` keeps the shape, so its gradient
                // is a narrow view of cat's; when AccumulateGrad steals it, `.grad` keeps the
                // whole [1, 197, 768] buffer alive (PyTorch steals by tensor use count, the
                // lowering by storage references: README, "Not modelled").
                // The same for timm's cls_token (`torch.cat((cls_token.expand(B, -1, -1), x), 1)`).
                let b = if r.precision == Precision::Bf16 { 2 } else { 4 };
                let stolen_view = match model {
                    "vit-b-16" => 196 * 768 * b,
                    "timm/vit_tiny_patch16_224" => 196 * 192 * b,
                    _ => 0,
                };
                let expected = if r.zero_grad == ZeroGrad::Zero {
                    params
                } else {
                    0
                };
                assert!(
                    grads == expected || (expected > 0 && grads == expected + stolen_view),
                    "{model} {}: gradients {grads}, parameters {params}",
                    r.name()
                );
                for c in [Category::Activation, Category::Temporary, Category::Input] {
                    assert_eq!(
                        end.get(&c).copied().unwrap_or(0),
                        0,
                        "{model} {}: {c} left at the end",
                        r.name()
                    );
                }
                assert!(peak_requested(&t) > params);
            }
        }
    }
}

#[test]
fn inference_saves_nothing() {
    let mut r = Recipe::new(2, 128);
    r.inference = true;
    let g = zoo::build("gpt2", &r).unwrap();
    let t = lower(&g, &r).unwrap();
    assert!(t.events.iter().all(|e| !matches!(
        e,
        Event::Alloc {
            category: Category::Activation | Category::Gradient | Category::OptimizerState,
            ..
        }
    )));
    assert!(!t
        .events
        .iter()
        .any(|e| matches!(e, Event::Phase { name } if &**name == "backward")));
}

#[test]
fn checkpointing_lowers_the_peak_and_sqrt_sits_between() {
    let peak = |c: &str| {
        let mut r = Recipe::new(4, 512);
        r.checkpointing = c.parse().unwrap();
        r.optimizer = OptimizerKind::Sgd;
        r.iterations = 1;
        peak_requested(&lower(&zoo::build("gpt2-medium", &r).unwrap(), &r).unwrap())
    };
    let (none, full, sqrt, sel, every2) = (
        peak("none"),
        peak("full"),
        peak("sqrt"),
        peak("selective"),
        peak("every:2"),
    );
    assert!(
        full < sqrt && sqrt < none,
        "full {full} sqrt {sqrt} none {none}"
    );
    assert!(sel < none && full < sel, "selective {sel}");
    assert!(full < every2 && every2 < none, "every:2 {every2}");
}

#[test]
fn errors_say_what_is_wrong_and_what_is_valid() {
    let r = Recipe::new(1, 128);
    let e = zoo::build("gpt3", &r).unwrap_err().to_string();
    assert!(
        e.contains("unknown model \"gpt3\"")
            && e.contains("gpt2-medium")
            && e.contains("llama2-70b"),
        "{e}"
    );
    let e = zoo::build("gpt2", &Recipe::new(0, 128))
        .unwrap_err()
        .to_string();
    assert_eq!(e, "batch must be 1 or more, got 0");
    let e = zoo::build("gpt2", &Recipe::new(1, 2048))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "seq 2048 is longer than gpt2's 1024 positions (max_position_embeddings)"
    );
    let e = zoo::build("llama2-7b", &Recipe::new(1, 0))
        .unwrap_err()
        .to_string();
    assert_eq!(e, "seq must be 1 or more for llama2-7b, got 0");
    let e = "every:x".parse::<Checkpointing>().unwrap_err().to_string();
    assert_eq!(
        e,
        "unknown checkpoint \"every:x\": valid values are none, full, every:K, selective, sqrt, selective-op"
    );
    let e = "fp8".parse::<Precision>().unwrap_err().to_string();
    assert_eq!(
        e,
        "unknown precision \"fp8\": valid values are fp32, bf16, amp-fp16, amp-bf16, fp16"
    );
    // A graph built for other shapes than the recipe's.
    let g = zoo::build("gpt2", &r).unwrap();
    let e = lower(&g, &Recipe::new(2, 128)).unwrap_err();
    assert!(matches!(e, LowerError::ShapeMismatch { .. }), "{e}");
    let mut bad = Recipe::new(1, 128);
    bad.batch = 0;
    assert_eq!(
        lower(&g, &bad).unwrap_err().to_string(),
        "batch must be 1 or more, got 0"
    );
    // Tensors past 2^50 bytes (1 PiB): refused when the graph is built...
    let e = zoo::mlp::mlp(&[1 << 31, 1 << 31, 1 << 31, 10], 1).unwrap_err();
    assert!(e.to_string().contains("more than 2^50 bytes"), "{e}");
    // ...and by the lowering, for a graph edited by hand.
    let mut g = zoo::mlp::mlp(&zoo::mlp::MLP_DIMS, 1).unwrap();
    g.values[0].shape = vec![1 << 40, 1 << 20];
    let e = lower(&g, &Recipe::new(1, 0)).unwrap_err();
    assert!(matches!(e, LowerError::Overflow { .. }), "{e}");
    assert!(e.to_string().contains("more than 2^50 bytes"));
    // Shapes that do not fit.
    let mut b = GraphBuilder::new("bad", 1, 0);
    let x = b.input("x", &[2, 3], DTypeSpec::Model);
    let w = b.param("w", &[4, 5]);
    let _ = b.mm(x, w);
    let e = b.finish().unwrap_err().to_string();
    assert_eq!(e, "mm: cannot multiply [2, 3] by [4, 5]");
}

#[test]
fn autocast_runs_matmuls_in_16_bit_and_softmax_layer_norm_loss_in_float32() {
    // autocast_mode.cpp: addmm/mm/bmm are lower_precision_fp; softmax/log_softmax are
    // fp32_set_opt_dtype; layer_norm is fp32. Weights are cast once per forward (cached).
    let (b, s, h, heads, v) = (2u64, 64u64, 768u64, 12u64, 50257u64);
    let mut r = Recipe::new(b, s);
    r.precision = Precision::AmpBf16;
    r.iterations = 1;
    // Eager attention: its softmax is one of the ops checked.
    r.attention = Attention::Eager;
    let t = lower(&zoo::build("gpt2", &r).unwrap(), &r).unwrap();
    let first = |tag: &str| -> u64 {
        t.events
            .iter()
            .find_map(|e| match e {
                Event::Alloc {
                    size, tag: Some(x), ..
                } if &**x == tag => Some(*size),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no alloc tagged {tag}"))
    };
    assert_eq!(
        first("transformer.h.0.attn.c_attn:aten.addmm"),
        b * s * 3 * h * 2
    );
    assert_eq!(
        first("transformer.h.0.attn:aten.bmm"),
        b * heads * s * s * 2
    );
    assert_eq!(
        first("transformer.h.0.attn:aten._softmax"),
        b * heads * s * s * 4
    );
    assert_eq!(
        first("transformer.h.0.ln_1:aten.native_layer_norm"),
        b * s * h * 4
    );
    assert_eq!(first("lm_head:aten.mm"), b * s * v * 2);
    assert_eq!(first("aten._log_softmax"), b * s * v * 4);
    // One bfloat16 copy of c_attn's weight per forward (the autocast cache).
    let copies = t
        .events
        .iter()
        .filter(|e| matches!(e, Event::Alloc { size, tag: Some(x), .. } if &**x == "transformer.h.0.attn.c_attn:aten._to_copy" && *size == h * 3 * h * 2))
        .count();
    assert_eq!(copies, 1);
}

/// The allocations of layer 0's attention tagged `op`, in order, from the first iteration's
/// forward (`fwd = true`) or backward.
fn layer0_allocs(t: &Trace, op: &str, fwd: bool) -> Vec<u64> {
    let mut phase = String::new();
    let mut out = Vec::new();
    for e in &t.events {
        match e {
            Event::Phase { name, .. } => phase = name.to_string(),
            Event::Alloc {
                size, tag: Some(x), ..
            } if x.contains("layers.0.self_attn:")
                && x.ends_with(op)
                && (phase == "forward") == fwd
                && (phase == "forward" || phase == "backward") =>
            {
                out.push(*size);
            }
            _ => {}
        }
    }
    out
}

#[test]
fn sdpa_backends_allocate_what_pytorch_allocates() {
    // TinyLlama: 32 query heads, 4 kv heads, head dim 64; amp-bf16, one iteration.
    let (b, s, h, hkv, d) = (2u64, 128u64, 32u64, 4u64, 64u64);
    let arch = zoo::Arch::from_name("tinyllama-1.1b").unwrap();
    let mut r = Recipe::new(b, s);
    r.precision = Precision::AmpBf16;
    r.iterations = 1;
    let lowered = |r: &Recipe| lower(&arch.build(r).unwrap(), r).unwrap();

    // H100 (sm 9.0): cuDNN. MHA.cpp: seed and offset int64 [1], output bf16 in q's layout,
    // softmax stats float32 [B, H, L, 1]; backward dq [B, H, L, D], dk and dv at the kv heads
    // (cuDNN does GQA itself), no modelled workspace.
    let k = arch.attention_kernel(&r).unwrap().unwrap();
    assert_eq!(
        k.kernel,
        zoo::Kernel::Sdpa(SdpaBackend::Cudnn),
        "{}",
        k.reason
    );
    let t = lowered(&r);
    let op = "aten._scaled_dot_product_cudnn_attention";
    assert_eq!(
        layer0_allocs(&t, op, true),
        [8, 8, 2 * b * s * h * d, 4 * b * h * s]
    );
    let bwd = "aten._scaled_dot_product_cudnn_attention_backward";
    assert_eq!(
        layer0_allocs(&t, bwd, false),
        [2 * b * h * s * d, 2 * b * hkv * s * d, 2 * b * hkv * s * d]
    );

    // A100 (sm 8.0): FlashAttention-2. mha_fwd: output, softmax_lse float32 [B, H, L], rng_state
    // uint64 [2], an unused uint64 scalar; mha_bwd: dq, dk, dv, softmax_d [B, H, ⌈L⌉₁₂₈],
    // dq_accum [B, ⌈L⌉₁₂₈, H, ⌈D⌉₃₂] float32, dk/dv expanded to the query heads.
    r.target = Target {
        compute_capability: (8, 0),
    };
    let t = lowered(&r);
    let op = "aten._scaled_dot_product_flash_attention";
    assert_eq!(
        layer0_allocs(&t, op, true),
        [2 * b * s * h * d, 4 * b * h * s, 16, 8]
    );
    let bwd = "aten._scaled_dot_product_flash_attention_backward";
    assert_eq!(
        layer0_allocs(&t, bwd, false),
        [
            2 * b * h * s * d,
            2 * b * hkv * s * d,
            2 * b * hkv * s * d,
            4 * b * h * 128,
            4 * b * 128 * h * 64,
            2 * b * s * h * d,
            2 * b * s * h * d
        ]
    );

    // V100 (sm 7.0): no flash or cuDNN, and memory-efficient attention takes no bf16 below
    // sm80: the math composite. Its forward makes float32 copies of q, k, v ([B, H, L, D] and
    // [B, Hkv, L, D]), the causal mask float32 [L, S], k and v repeated to the query heads, the
    // float32 scores and softmax [B, H, L, S], and no fused op at all.
    r.target = Target {
        compute_capability: (7, 0),
    };
    let k = arch.attention_kernel(&r).unwrap().unwrap();
    assert_eq!(
        k.kernel,
        zoo::Kernel::Sdpa(SdpaBackend::Math),
        "{}",
        k.reason
    );
    let t = lowered(&r);
    assert!(layer0_allocs(&t, "attention", true).is_empty());
    let to_copy = layer0_allocs(&t, "aten._to_copy", true);
    for want in [4 * b * h * s * d, 4 * b * hkv * s * d] {
        assert!(to_copy.contains(&want), "{to_copy:?} lacks {want}");
    }
    // ones().tril() and its logical_not (bool [L, S]) are live with where()'s float32 result.
    assert_eq!(
        layer0_allocs(&t, "aten.where", true),
        [s * s, s * s, 4 * s * s]
    );
    let softmax = layer0_allocs(&t, "aten._softmax", true);
    assert_eq!(softmax, [4 * b * h * s * s]);

    // Under no_grad cuDNN computes no softmax stats (compute_logsumexp is false).
    r.target = Target::default();
    r.inference = true;
    let t = lowered(&r);
    let op = "aten._scaled_dot_product_cudnn_attention";
    assert_eq!(layer0_allocs(&t, op, true), [8, 8, 2 * b * s * h * d]);
    r.inference = false;

    // fp32 on the H100: memory-efficient attention (logsumexp padded to 32).
    r.precision = Precision::Fp32;
    let t = lowered(&r);
    let op = "aten._scaled_dot_product_efficient_attention";
    assert_eq!(
        layer0_allocs(&t, op, true),
        [4 * b * s * h * d, 4 * b * h * s.div_ceil(32) * 32]
    );
}

#[test]
fn forced_backends_lower_consistently_or_say_why_not() {
    let arch = zoo::Arch::from_name("gpt2").unwrap();
    let mut r = Recipe::new(1, 64);
    r.precision = Precision::Bf16;
    for a in ["sdpa-flash", "sdpa-mem-efficient", "sdpa-math"] {
        r.attention = a.parse().unwrap();
        let g = arch.build(&r).unwrap();
        lower(&g, &r).unwrap();
    }
    // GPT-2's attention dropout 0.1 is not a multiple of 1/16: cuDNN refuses it in training
    // (check_cudnn_dropout) but runs it in eval (no dropout); the auto choice on the H100 in
    // training is FlashAttention.
    r.attention = Attention::SdpaCudnn;
    let e = arch.build(&r).unwrap_err().to_string();
    assert!(e.contains("check_cudnn_dropout"), "{e}");
    r.inference = true;
    lower(&arch.build(&r).unwrap(), &r).unwrap();
    r.inference = false;
    r.attention = Attention::Auto;
    let k = arch.attention_kernel(&r).unwrap().unwrap();
    assert_eq!(
        k.kernel,
        zoo::Kernel::Sdpa(SdpaBackend::Flash),
        "{}",
        k.reason
    );
    assert!(k.reason.contains("check_cudnn_dropout"), "{}", k.reason);
    // Forced flash on fp32: PyTorch's "No available kernel", with the failing check.
    r.precision = Precision::Fp32;
    r.attention = Attention::SdpaFlash;
    let e = arch.build(&r).unwrap_err().to_string();
    assert!(e.contains("sdpa-flash") && e.contains("fp32"), "{e}");
    assert!(e.contains("No available kernel"), "{e}");
    // Eager stays eager for the HF models, and models without attention have no kernel.
    r.attention = Attention::Eager;
    let k = arch.attention_kernel(&r).unwrap().unwrap();
    assert_eq!(k.kernel, zoo::Kernel::Eager);
    assert!(zoo::Arch::from_name("resnet18")
        .unwrap()
        .attention_kernel(&r)
        .unwrap()
        .is_none());
}

#[test]
fn timm_models_reject_impossible_image_sizes_and_class_counts() {
    let mut r = Recipe::new(2, 1);
    r.image_size = Some((8, 224));
    let e = zoo::build("timm/vit_base_patch16_224", &r)
        .unwrap_err()
        .to_string();
    assert!(e.contains("image-size") && e.contains("16x16 patch"), "{e}");
    r.image_size = Some((0, 0));
    let e = zoo::build("timm/convnext_tiny", &r)
        .unwrap_err()
        .to_string();
    assert!(e.contains("image-size") && e.contains("32x32"), "{e}");
    r.image_size = Some((16, 16));
    let e = zoo::build("timm/convnext_tiny", &r)
        .unwrap_err()
        .to_string();
    assert!(e.contains("image-size") && e.contains("32x32"), "{e}");
    r.image_size = None;
    r.num_classes = Some(0);
    let e = zoo::build("timm/resnet50", &r).unwrap_err().to_string();
    assert!(e.contains("num-classes"), "{e}");
    let e = zoo::build("timm/resnet51", &Recipe::new(2, 1))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("timm/resnet50") && e.contains("timm/convnext_tiny"),
        "{e}"
    );
    // A non-square image builds (timm's PatchEmbed takes an (h, w) img_size).
    r.num_classes = None;
    r.image_size = Some((224, 320));
    let g = zoo::build("timm/vit_small_patch16_224", &r).unwrap();
    let t = lower(&g, &r).unwrap();
    assert!(peak_requested(&t) > 0);
}
