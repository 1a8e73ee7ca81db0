//! HuggingFace `config.json` import, on the published configs of six models (tests/hf/, with their
//! model ids in tests/hf/README.md): the architecture each maps to, the parameter count against the
//! published figure, agreement with the zoo's own presets, and the errors a person gets.

use std::path::PathBuf;
use vramsim_models::hf::{self, HfError, ImportOptions};
use vramsim_models::zoo::{self, Arch};
use vramsim_models::{lower, peak_requested, Attention, OpKind, Recipe, ZeroGrad};
use vramsim_traces::{Category, Event, Trace};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/hf")
        .join(name)
}

fn import(name: &str) -> hf::HfConfig {
    hf::read(&fixture(name), &ImportOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn published_configs_import_with_their_parameter_counts() {
    // (file, model_type, published parameter count, dtype the weights were saved in)
    let cases: [(&str, &str, u64, Option<&str>); 6] = [
        ("gpt2.json", "gpt2", 124_439_808, None),
        ("bert-base-uncased.json", "bert", 109_514_298, None),
        (
            "TinyLlama-1.1B-intermediate-step-1431k-3T.json",
            "llama",
            1_100_048_384,
            Some("float32"),
        ),
        (
            "Llama-2-7b-hf.json",
            "llama",
            6_738_415_616,
            Some("float16"),
        ),
        (
            "Mistral-7B-v0.1.json",
            "mistral",
            7_241_732_096,
            Some("bfloat16"),
        ),
        ("Qwen2-0.5B.json", "qwen2", 494_032_768, Some("bfloat16")),
    ];
    println!("| config.json | model_type | parameters | published | torch_dtype |");
    println!("| --- | --- | ---: | ---: | --- |");
    for (file, model_type, published, dtype) in cases {
        let cfg = import(file);
        assert_eq!(cfg.model_type, model_type, "{file}");
        assert_eq!(cfg.torch_dtype.as_deref(), dtype, "{file}");
        assert!(cfg.warnings.is_empty(), "{file}: {:?}", cfg.warnings);
        let g = cfg.arch.build(&Recipe::new(1, 16)).unwrap();
        println!(
            "| {file} | {model_type} | {} | {published} | {} |",
            g.param_count(),
            dtype.unwrap_or("-")
        );
        assert_eq!(g.param_count(), published, "{file}");
    }
}

#[test]
fn imported_configs_equal_the_zoo_presets() {
    let same = |file: &str, zoo_name: &str| {
        let mut imported = import(file).arch;
        // Names differ (the import takes `_name_or_path` or `hf-MODEL_TYPE`); nothing else may.
        let zoo_arch = Arch::from_name(zoo_name).unwrap();
        match (&mut imported, &zoo_arch) {
            (Arch::Gpt2(a), Arch::Gpt2(b)) => a.name = b.name.clone(),
            (Arch::Bert(a), Arch::Bert(b)) => a.name = b.name.clone(),
            (Arch::Llama(a), Arch::Llama(b)) => a.name = b.name.clone(),
            _ => panic!("{file} is not a {zoo_name}"),
        }
        assert_eq!(imported, zoo_arch, "{file}");
    };
    same("gpt2.json", "gpt2");
    same("bert-base-uncased.json", "bert-base");
    same(
        "TinyLlama-1.1B-intermediate-step-1431k-3T.json",
        "tinyllama-1.1b",
    );
    same("Llama-2-7b-hf.json", "llama2-7b");
    // ...so the lowering is the same trace.
    let r = Recipe::new(2, 128);
    let a = import("TinyLlama-1.1B-intermediate-step-1431k-3T.json")
        .arch
        .build(&r)
        .unwrap();
    let b = zoo::build("tinyllama-1.1b", &r).unwrap();
    assert_eq!(
        peak_requested(&lower(&a, &r).unwrap()),
        peak_requested(&lower(&b, &r).unwrap())
    );
}

#[test]
fn family_differences_are_built() {
    let Arch::Llama(q) = import("Qwen2-0.5B.json").arch else {
        panic!("qwen2 is LLaMA-like")
    };
    assert!(q.qkv_bias && !q.o_bias && q.tie_embeddings);
    assert_eq!((q.heads, q.kv_heads, q.head_dim()), (14, 2, 64));
    assert_eq!(q.sliding_window, None, "use_sliding_window is false");
    let Arch::Llama(m) = import("Mistral-7B-v0.1.json").arch else {
        panic!("mistral is LLaMA-like")
    };
    assert_eq!(m.sliding_window, Some(4096));
    assert!(!m.qkv_bias && !m.o_bias && !m.tie_embeddings);
    assert_eq!(m.name, "hf-mistral");
    let named = hf::read(
        &fixture("Mistral-7B-v0.1.json"),
        &ImportOptions {
            name: Some("mistral-7b".into()),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(named.arch.name(), "mistral-7b");
    assert_eq!(
        import("Llama-2-7b-hf.json").arch.name(),
        "meta-llama/Llama-2-7b-hf"
    );
    // Qwen2's q/k/v biases get gradients: every parameter is trained.
    let r = Recipe::new(1, 32);
    let g = Arch::Llama(q).build(&r).unwrap();
    assert!(g.params.iter().any(|p| p.name.ends_with("q_proj.bias")));
    assert!(!g.params.iter().any(|p| p.name.ends_with("o_proj.bias")));
    lower(&g, &r).unwrap();
}

#[test]
fn sliding_window_is_modelled_where_memory_does_not_depend_on_it() {
    let m = import("Mistral-7B-v0.1.json").arch;
    let mut r = Recipe::new(1, 8192);
    r.attention = Attention::Eager;
    assert!(m.build(&r).is_ok(), "eager: the same [B,1,S,S] mask");
    r.seq = 4096;
    r.attention = Attention::Auto;
    assert!(m.build(&r).is_ok(), "SDPA within the window: causal kernel");
    r.seq = 8192;
    let e = m.build(&r).unwrap_err().to_string();
    assert!(e.contains("sliding_window") && e.contains("4096"), "{e}");
    r.seq = 32769;
    r.attention = Attention::Eager;
    let e = m.build(&r).unwrap_err().to_string();
    assert!(e.contains("32768 positions"), "{e}");
}

/// Keys to set (or remove, with `null`) in a config.
type Patch<'a> = Vec<(&'a str, serde_json::Value)>;

/// The base TinyLlama config with `patch` applied (keys set to the given JSON, or removed if null).
fn patched(patch: &[(&str, serde_json::Value)]) -> String {
    let text =
        std::fs::read_to_string(fixture("TinyLlama-1.1B-intermediate-step-1431k-3T.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (k, val) in patch {
        if val.is_null() {
            v.as_object_mut().unwrap().remove(*k);
        } else {
            v[*k] = val.clone();
        }
    }
    v.to_string()
}

#[test]
fn bad_configs_name_the_field() {
    use serde_json::json;
    let opts = ImportOptions::default();
    let cases: Vec<(Patch, Vec<&str>)> = vec![
        (
            vec![("model_type", json!("t5"))],
            vec!["\"t5\"", "gpt2, bert, llama, mistral, qwen2"],
        ),
        (
            vec![("model_type", serde_json::Value::Null)],
            vec!["model_type", "gpt2, bert"],
        ),
        (
            vec![("hidden_act", json!("quick_gelu"))],
            vec!["hidden_act", "\"quick_gelu\"", "silu, gelu"],
        ),
        (
            vec![("attention_dropout", json!(1.0))],
            vec!["attention_dropout", "[0, 1)"],
        ),
        (vec![("pretraining_tp", json!(2))], vec!["pretraining_tp"]),
        (
            vec![("rope_scaling", json!({"type": "mrope", "factor": 2.0}))],
            vec!["rope_scaling.rope_type", "\"mrope\""],
        ),
        (
            vec![("hidden_size", serde_json::Value::Null)],
            vec!["\"hidden_size\" is missing"],
        ),
        (
            vec![("num_hidden_layers", json!(0))],
            vec!["num_hidden_layers", "positive integer"],
        ),
        (vec![("vocab_size", json!(-5))], vec!["vocab_size"]),
        (
            vec![("num_key_value_heads", json!(5))],
            vec!["num_key_value_heads", "multiple"],
        ),
        (
            vec![
                ("quantization_config", json!({"load_in_4bit": true})),
                ("num_experts", json!(8)),
            ],
            vec!["num_experts, quantization_config", "--hf-allow-unknown"],
        ),
    ];
    for (patch, fragments) in cases {
        let e = hf::parse(&patched(&patch), &opts).unwrap_err().to_string();
        for f in &fragments {
            assert!(e.contains(f), "{patch:?}: {e:?} lacks {f:?}");
        }
    }
    assert!(matches!(
        hf::parse("[1, 2]", &opts),
        Err(HfError::NotAnObject("an array"))
    ));
    assert!(matches!(
        hf::read(&fixture("absent.json"), &opts),
        Err(HfError::Io { .. })
    ));
    // Allowed unknown fields become warnings.
    let ok = hf::parse(
        &patched(&[("my_flag", json!(true))]),
        &ImportOptions {
            allow_unknown_fields: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(ok.warnings.len(), 1);
    assert!(ok.warnings[0].contains("my_flag"));
    // BERT and GPT-2 specifics.
    let bert = std::fs::read_to_string(fixture("bert-base-uncased.json")).unwrap();
    let e = hf::parse(&bert.replace("\"absolute\"", "\"relative_key\""), &opts).unwrap_err();
    assert!(e.to_string().contains("position_embedding_type"), "{e}");
    let gpt = std::fs::read_to_string(fixture("gpt2.json")).unwrap();
    let e = hf::parse(&gpt.replace("\"gelu_new\"", "\"quick_gelu\""), &opts).unwrap_err();
    assert!(e.to_string().contains("activation_function"), "{e}");
}

#[test]
fn huge_configs_fail_cleanly() {
    // 2^40 hidden: the import succeeds (the numbers are valid), building or lowering reports the
    // overflow instead of panicking.
    let text = patched(&[
        ("hidden_size", serde_json::json!(1u64 << 40)),
        ("num_attention_heads", serde_json::json!(1)),
        ("num_key_value_heads", serde_json::json!(1)),
    ]);
    let cfg = hf::parse(&text, &ImportOptions::default()).unwrap();
    let r = Recipe::new(1, 8);
    match cfg.arch.build(&r) {
        Err(e) => assert!(!e.to_string().is_empty()),
        Ok(g) => assert!(lower(&g, &r).is_err()),
    }
}

#[test]
fn absurd_layer_counts_are_refused_before_building() {
    let text = patched(&[("num_hidden_layers", serde_json::json!(1_000_000_000u64))]);
    let cfg = hf::parse(&text, &ImportOptions::default()).unwrap();
    let e = cfg.arch.build(&Recipe::new(1, 8)).unwrap_err().to_string();
    assert!(e.contains("num_hidden_layers") && e.contains("4096"), "{e}");
}

/// A published config with `patch` applied.
fn patch_file(file: &str, patch: &[(&str, serde_json::Value)]) -> hf::HfConfig {
    let text = std::fs::read_to_string(fixture(file)).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (k, val) in patch {
        v[*k] = val.clone();
    }
    hf::parse(&v.to_string(), &ImportOptions::default()).unwrap_or_else(|e| panic!("{e}"))
}

/// GPT-2's parameters by formula: wte `V·h`, wpe `P·h`, per layer ln_1, c_attn `h·3h + 3h`, c_proj
/// `h·h + h`, ln_2, c_fc `h·4h + 4h`, mlp.c_proj `4h·h + h` (`12h² + 13h`), ln_f `2h`; plus an
/// untied lm_head `V·h`.
fn gpt2_params(v: u64, p: u64, h: u64, l: u64, tied: bool) -> u64 {
    v * h + p * h + l * (12 * h * h + 13 * h) + 2 * h + if tied { 0 } else { v * h }
}

fn dropouts(g: &vramsim_models::Graph) -> usize {
    g.ops
        .iter()
        .filter(|o| matches!(o.kind, OpKind::Dropout { .. }))
        .count()
}

/// Requested bytes live when the first `backward` phase starts (the end of the first forward).
fn live_at_first_backward(t: &Trace) -> u64 {
    let mut live = std::collections::HashMap::new();
    let mut cur = 0u64;
    for e in &t.events {
        match e {
            Event::Alloc { id, size, .. } => {
                live.insert(id.clone(), *size);
                cur += size;
            }
            Event::Free { id } => cur -= live.remove(id).unwrap_or(0),
            Event::Phase { name } if &**name == "backward" => return cur,
            _ => {}
        }
    }
    cur
}

#[test]
fn config_fields_that_change_memory_are_honoured() {
    use serde_json::json;
    // tie_word_embeddings: false gives GPT2LMHeadModel its own lm_head (transformers 5.23 ties only
    // when the config says so).
    let base = import("gpt2.json");
    // Eager attention: its dropouts are graph ops (under SDPA, attn_pdrop is the kernel's dropout_p).
    let mut r = Recipe::new(1, 16);
    r.attention = Attention::Eager;
    let tied = base.arch.build(&r).unwrap().param_count();
    assert_eq!(tied, gpt2_params(50257, 1024, 768, 12, true));
    let untied = patch_file("gpt2.json", &[("tie_word_embeddings", json!(false))]);
    let g = untied.arch.build(&r).unwrap();
    assert_eq!(g.param_count(), gpt2_params(50257, 1024, 768, 12, false));
    assert_eq!(g.param_count(), 163_037_184);
    assert!(g.params.iter().any(|p| p.name == "lm_head.weight"));
    // vocab_size and n_positions.
    let small = patch_file(
        "gpt2.json",
        &[("vocab_size", json!(1000)), ("n_positions", json!(256))],
    );
    assert_eq!(
        small.arch.build(&r).unwrap().param_count(),
        gpt2_params(1000, 256, 768, 12, true)
    );
    assert_eq!(small.arch.max_positions(), Some(256));
    // Dropouts: each p > 0 is one native_dropout (embd_pdrop once; attn_pdrop and twice
    // resid_pdrop per block); p = 0 is no op at all (ATen `dropout` returns its input).
    assert_eq!(dropouts(&base.arch.build(&r).unwrap()), 1 + 3 * 12);
    let no_drop = patch_file(
        "gpt2.json",
        &[
            ("embd_pdrop", json!(0.0)),
            ("attn_pdrop", json!(0.0)),
            ("resid_pdrop", json!(0.0)),
        ],
    );
    assert_eq!(dropouts(&no_drop.arch.build(&r).unwrap()), 0);
    let attn_only = patch_file(
        "gpt2.json",
        &[("embd_pdrop", json!(0.0)), ("resid_pdrop", json!(0.0))],
    );
    assert_eq!(dropouts(&attn_only.arch.build(&r).unwrap()), 12);

    // BERT untied: the decoder gets its own weight [V, h] and bias [V]; cls.predictions.bias stays
    // a parameter that the forward never uses.
    let bert = patch_file(
        "bert-base-uncased.json",
        &[("tie_word_embeddings", json!(false))],
    );
    let mut r = Recipe::new(1, 16);
    r.zero_grad = ZeroGrad::Zero;
    r.attention = Attention::Eager;
    let g = bert.arch.build(&r).unwrap();
    assert_eq!(g.param_count(), 109_514_298 + 30522 * 768 + 30522);
    let t = lower(&g, &r).unwrap();
    // With zero_grad(set_to_none=False) every gradient stays: all but the unused bias's.
    let grads: u64 = live_by_category(&t, Category::Gradient);
    assert_eq!(grads, (g.param_count() - 30522) * 4);
    // BERT's dropouts: hidden_dropout_prob after the embeddings and twice per layer,
    // attention_probs_dropout_prob once per layer; hidden_act relu is one op per use.
    let b0 = patch_file(
        "bert-base-uncased.json",
        &[
            ("hidden_dropout_prob", json!(0.0)),
            ("hidden_act", json!("relu")),
        ],
    );
    let g = b0.arch.build(&r).unwrap();
    assert_eq!(dropouts(&g), 12);
    let relus = g
        .ops
        .iter()
        .filter(|o| matches!(o.kind, OpKind::Relu))
        .count();
    assert_eq!(
        relus,
        12 + 1,
        "intermediate per layer + the MLM head's transform"
    );

    // LLaMA's attention_dropout: with eager attention, each layer's probabilities [B, H, S, S]
    // get a dropout output (float32 here) and a bool mask, both saved for backward: 5 bytes per
    // element more at the end of the forward.
    let (b, s) = (1u64, 32u64);
    let mut r = Recipe::new(b, s);
    r.attention = Attention::Eager;
    let plain = import("TinyLlama-1.1B-intermediate-step-1431k-3T.json");
    let dropped = hf::parse(
        &patched(&[("attention_dropout", json!(0.1))]),
        &ImportOptions::default(),
    )
    .unwrap();
    let g0 = plain.arch.build(&r).unwrap();
    let g1 = dropped.arch.build(&r).unwrap();
    assert_eq!(dropouts(&g0), 0);
    assert_eq!(dropouts(&g1), 22);
    let extra = live_at_first_backward(&lower(&g1, &r).unwrap())
        - live_at_first_backward(&lower(&g0, &r).unwrap());
    assert_eq!(extra, 22 * b * 32 * s * s * (4 + 1));
}

/// Bytes of `category` still live at the end of the trace.
fn live_by_category(t: &Trace, category: Category) -> u64 {
    let mut live = std::collections::HashMap::new();
    for e in &t.events {
        match e {
            Event::Alloc {
                id,
                size,
                category: c,
                ..
            } if *c == category => {
                live.insert(id.clone(), *size);
            }
            Event::Free { id } => {
                live.remove(id);
            }
            _ => {}
        }
    }
    live.values().sum()
}

/// `use_cache` is no longer ignored: GPT-2's published config has none (transformers' default),
/// TinyLlama's sets it true, a patched false is kept, anything else is an error naming the field.
#[test]
fn use_cache_is_read_from_the_config() {
    assert_eq!(patch_file("gpt2.json", &[]).use_cache, None);
    let tiny = patch_file("TinyLlama-1.1B-intermediate-step-1431k-3T.json", &[]);
    assert_eq!(tiny.use_cache, Some(true));
    let off = patch_file(
        "TinyLlama-1.1B-intermediate-step-1431k-3T.json",
        &[("use_cache", serde_json::json!(false))],
    );
    assert_eq!(off.use_cache, Some(false));
    let text = std::fs::read_to_string(fixture("gpt2.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["use_cache"] = serde_json::json!("yes");
    let e = hf::parse(&v.to_string(), &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("use_cache") && e.contains("true or false"),
        "{e}"
    );
}
