//! `vramsim predict` end to end: the report (table and JSON), agreement with PyTorch's own
//! meta-device captures (the peaks below are `peak_requested_bytes` of the committed fixtures in
//! models/tests/fixtures/capture/, never vramsim's own output), out-of-memory reports, HuggingFace
//! config.json import, and a clear error (exit status 2, no panic) for every kind of bad input.

mod common;
use common::{stderr, stdout, succeeds, vramsim};

/// Asserts that `vramsim predict ARGS` fails cleanly (see `common::assert_fails`).
fn assert_fails(args: &[&str], fragments: &[&str]) {
    let mut all = vec!["predict"];
    all.extend_from_slice(args);
    common::assert_fails(&all, fragments);
}

use std::path::PathBuf;

/// `vramsim predict ARGS --json`.
fn predict_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["predict"];
    all.extend_from_slice(args);
    common::json(&all)
}

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("predict");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn peaks_agree_with_pytorch_captures() {
    // (args, PyTorch's peak_requested_bytes from the capture fixture of the same recipe); the
    // captures ran HF's eager attention, so the language models pin it.
    let cases: [(&[&str], u64); 4] = [
        // gpt2__b8s1024__fp32-adamw.json
        (
            &[
                "--model",
                "gpt2",
                "--batch",
                "8",
                "--seq",
                "1024",
                "--attention",
                "eager",
            ],
            25_970_555_912,
        ),
        // bert-base__b16s512__fp32-adamw.json
        (
            &[
                "--model",
                "bert-base",
                "--batch",
                "16",
                "--seq",
                "512",
                "--attention",
                "eager",
            ],
            14_867_225_280,
        ),
        // resnet18__b64__fp32-adamw.json
        (&["--model", "resnet18", "--batch", "64"], 1_577_642_024),
        // tinyllama-1.1b__b2s1024__bf16-adamw.json
        (
            &[
                "--model",
                "tinyllama-1.1b",
                "--batch",
                "2",
                "--seq",
                "1024",
                "--precision",
                "bf16",
                "--attention",
                "eager",
            ],
            20_523_962_504,
        ),
    ];
    // The captures run on the meta device, which has no cuBLAS: compare under the PyTorch settings
    // that take no workspace either (CUBLAS_WORKSPACE_CONFIG=:0:0, CUBLASLT_WORKSPACE_SIZE=0).
    let no_workspaces = [
        "--cublas-workspace-config",
        ":0:0",
        "--cublaslt-workspace-size",
        "0",
    ];
    for (args, pytorch) in cases {
        let args = [args, &no_workspaces[..]].concat();
        let args = &args[..];
        let j = predict_json(args);
        assert_eq!(j["peak_requested_bytes"], pytorch, "{args:?}");
        assert_eq!(j["breakdown"]["peak_requested_bytes"], pytorch, "{args:?}");
        assert_eq!(j["fits"], true, "{args:?}");
        assert!(j["oom"].is_null());
    }
}

#[test]
fn json_has_the_documented_fields() {
    let j = predict_json(&[
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--attention",
        "eager",
    ]);
    for key in [
        "peak_allocated_bytes",
        "peak_requested_bytes",
        "peak_reserved_bytes",
        "peak_device_used_bytes",
        "params",
        "breakdown",
        "peak_phase",
        "oom",
        "recipe",
        "model",
        "timing",
    ] {
        assert!(j.get(key).is_some(), "missing {key}");
    }
    assert_eq!(j["params"], 124_439_808u64);
    assert_eq!(j["model"], "gpt2");
    assert_eq!(j["recipe"]["seq"], 128);
    assert_eq!(j["recipe"]["precision"], "fp32");
    // gpt2__b2s128__fp32-adamw.json: PyTorch's peak is in the optimizer step.
    assert_eq!(j["peak_phase"], "optimizer");
    assert_eq!(j["peak_requested_bytes"], 2_488_796_160u64);
    let b = &j["breakdown"];
    let by_cat = b["by_category"].as_object().unwrap();
    let sum: u64 = by_cat.values().map(|v| v.as_u64().unwrap()).sum();
    assert_eq!(sum, 2_488_796_160, "the categories add up to the peak");
    assert_eq!(by_cat["parameter"], 124_439_808u64 * 4);
    assert_eq!(by_cat["optimizer_state"], 124_439_808u64 * 8);
    let modules = b["by_module"].as_array().unwrap();
    let msum: u64 = modules.iter().map(|m| m["bytes"].as_u64().unwrap()).sum();
    assert_eq!(msum, 2_488_796_160, "the modules add up to the peak");
    assert!(modules.iter().any(|m| m["module"] == "transformer.h.11"));
    let allocated = j["peak_allocated_bytes"].as_u64().unwrap();
    let reserved = j["peak_reserved_bytes"].as_u64().unwrap();
    assert!(allocated >= 2_488_796_160 && reserved >= allocated);
}

#[test]
fn the_table_says_what_fits_and_where_the_memory_goes() {
    let output = succeeds(&[
        "predict", "--model", "resnet50", "--batch", "8", "--gpu", "t4",
    ]);
    let text = stdout(&output);
    for fragment in [
        "model      resnet50: torchvision 0.29 resnet50",
        "25,557,032 parameters",
        "recipe     batch 8, fp32, adamw (foreach), checkpoint none",
        "result     fits",
        "peak phase ",
        "at peak requested, by category",
        "at peak requested, top modules",
        "layer1.0",
        "at peak requested, largest allocations",
    ] {
        assert!(text.contains(fragment), "{fragment:?} not in\n{text}");
    }
}

#[test]
fn out_of_memory_names_the_op_and_pytorchs_message() {
    // Eager attention's [B, H, S, S] scores do not fit a 24 GB card at this size.
    let j = predict_json(&[
        "--model",
        "gpt2",
        "--batch",
        "8",
        "--seq",
        "1024",
        "--gpu",
        "rtx4090",
        "--attention",
        "eager",
    ]);
    assert_eq!(j["fits"], false);
    let oom = &j["oom"];
    assert!(oom["message"]
        .as_str()
        .unwrap()
        .starts_with("CUDA out of memory. Tried to allocate"));
    assert!(oom["tag"].as_str().unwrap().contains("aten."), "{oom}");
    assert!(oom["event_index"].as_u64().unwrap() > 0);
    assert_eq!(j["breakdown"]["at"], "oom");
    assert_eq!(
        j["breakdown"]["event_index"], oom["event_index"],
        "the breakdown is what is live when the error is raised"
    );
    let output = vramsim(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "8",
        "--seq",
        "1024",
        "--gpu",
        "rtx4090",
        "--attention",
        "eager",
    ]);
    assert_eq!(
        output.status.code(),
        Some(0),
        "running out of memory is an answer"
    );
    let text = stdout(&output);
    assert!(text.contains("OUT OF MEMORY"), "{text}");
    assert!(text.contains("oom op     aten."), "{text}");
    assert!(
        text.contains("at the out-of-memory error, top modules"),
        "{text}"
    );
}

#[test]
fn hf_configs_predict_like_the_zoo() {
    let j = predict_json(&[
        "--hf-config",
        "models/tests/hf/Mistral-7B-v0.1.json",
        "--batch",
        "1",
        "--seq",
        "256",
        "--precision",
        "bf16",
        "--checkpoint",
        "full",
        "--capacity",
        "1TiB",
    ]);
    assert_eq!(j["params"], 7_241_732_096u64);
    assert_eq!(j["model"], "Mistral-7B-v0.1");
    assert!(j["reference"]
        .as_str()
        .unwrap()
        .contains("MistralForCausalLM"));
    // The TinyLlama config.json gives the zoo's tinyllama-1.1b, byte for byte.
    let args = ["--batch", "2", "--seq", "128", "--precision", "bf16"];
    let mut a = vec![
        "--hf-config",
        "models/tests/hf/TinyLlama-1.1B-intermediate-step-1431k-3T.json",
    ];
    a.extend_from_slice(&args);
    let mut b = vec!["--model", "tinyllama-1.1b"];
    b.extend_from_slice(&args);
    let (ja, jb) = (predict_json(&a), predict_json(&b));
    for key in [
        "peak_requested_bytes",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
    ] {
        assert_eq!(ja[key], jb[key], "{key}");
    }
    // tinyllama-1.1b__b2s128__bf16-adamw.json
    assert_eq!(ja["peak_requested_bytes"], 11_000_483_968u64);
    // The config's torch_dtype is reported, not obeyed.
    let output = succeeds(&[
        "predict",
        "--hf-config",
        "models/tests/hf/Llama-2-7b-hf.json",
        "--batch",
        "1",
        "--seq",
        "64",
        "--capacity",
        "1TiB",
    ]);
    assert!(stderr(&output).contains("warning: the config's torch_dtype is float16"));
}

#[test]
fn trace_out_replays_to_the_same_peaks_and_plots_draw() {
    let trace = tmp("bert.jsonl.gz");
    let plot = tmp("bert.png");
    let j = predict_json(&[
        "--model",
        "bert-base",
        "--batch",
        "2",
        "--seq",
        "128",
        "--checkpoint",
        "full",
        "--trace-out",
        trace.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
    ]);
    let output = succeeds(&["replay", trace.to_str().unwrap(), "--json"]);
    let r: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    for key in [
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "peak_requested_bytes",
    ] {
        assert_eq!(r[key], j[key], "{key}");
    }
    // bert-base__b2s128__fp32-adamw-ckptfull.json
    assert_eq!(j["peak_requested_bytes"], 2_190_294_152u64);
    assert!(std::fs::metadata(&plot).unwrap().len() > 1000);
}

#[test]
fn inference_and_image_models() {
    let j = predict_json(&["--model", "vit-b-16", "--batch", "4", "--inference"]);
    let phases: Vec<&str> = j["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(phases, ["setup", "forward"]);
    assert!(j["breakdown"]["by_category"].get("gradient").is_none());
    assert_eq!(j["params"], 86_567_656u64);
    let output = succeeds(&["predict", "--model", "vgg16", "--batch", "2", "--seq", "77"]);
    assert!(stderr(&output).contains("--seq is ignored"));
}

#[test]
fn bad_input_is_a_clear_error() {
    assert_fails(
        &["--model", "resnet1000", "--batch", "1"],
        &[
            "unknown model \"resnet1000\"",
            "resnet152",
            "vit-b-16",
            "llama3-8b",
        ],
    );
    assert_fails(
        &["--model", "gpt2", "--batch", "0"],
        &["batch must be a whole number from 1", "got 0"],
    );
    assert_fails(&["--model", "gpt2", "--batch", "-3"], &["batch", "got -3"]);
    assert_fails(
        &["--model", "gpt2", "--batch", "99999999999999999999999"],
        &["batch", "18446744073709551615"],
    );
    assert_fails(
        &["--model", "gpt2", "--batch", "1", "--seq", "2048"],
        &["seq 2048 is longer than gpt2's 1024 positions"],
    );
    assert_fails(&["--model", "gpt2", "--batch", "1", "--seq", "0"], &["seq"]);
    assert_fails(
        &[
            "--model",
            "llama2-70b",
            "--batch",
            "4000000000000",
            "--seq",
            "4096",
        ],
        &["would take more than", "bytes"],
    );
    assert_fails(&["--batch", "1"], &["--model", "--hf-config"]);
    assert_fails(
        &["--model", "gpt2", "--hf-config", "x.json", "--batch", "1"],
        &["cannot be used with"],
    );
    assert_fails(
        &["--model", "gpt2", "--batch", "1", "--precision", "fp64"],
        &["fp64", "fp32, bf16, amp-fp16, amp-bf16"],
    );
    assert_fails(
        &["--model", "gpt2", "--batch", "1", "--checkpoint", "every:0"],
        &["every:K"],
    );
    assert_fails(
        &["--model", "gpt2", "--batch", "1", "--gpu", "h9000"],
        &["h9000"],
    );
    assert_fails(
        &["--hf-config", "no/such/config.json", "--batch", "1"],
        &["cannot import no/such/config.json", "cannot read"],
    );
    let t5 = tmp("t5.json");
    std::fs::write(&t5, r#"{"model_type": "t5", "d_model": 512}"#).unwrap();
    assert_fails(
        &["--hf-config", t5.to_str().unwrap(), "--batch", "1"],
        &[
            "model_type \"t5\" is not supported",
            "gpt2, bert, llama, mistral, qwen2",
        ],
    );
    let relu = tmp("relu.json");
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../models/tests/hf/Llama-2-7b-hf.json"
    ))
    .unwrap()
    .replace("\"silu\"", "\"quick_gelu\"");
    std::fs::write(&relu, text).unwrap();
    assert_fails(
        &["--hf-config", relu.to_str().unwrap(), "--batch", "1"],
        &["hidden_act", "\"quick_gelu\""],
    );
    let odd = tmp("odd.json");
    std::fs::write(
        &odd,
        std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../models/tests/hf/Qwen2-0.5B.json"
        ))
        .unwrap()
        .replace("\"use_cache\"", "\"num_experts\": 8, \"use_cache\""),
    )
    .unwrap();
    assert_fails(
        &[
            "--hf-config",
            odd.to_str().unwrap(),
            "--batch",
            "1",
            "--seq",
            "64",
        ],
        &["num_experts", "--hf-allow-unknown"],
    );
    let output = succeeds(&[
        "predict",
        "--hf-config",
        odd.to_str().unwrap(),
        "--hf-allow-unknown",
        "--batch",
        "1",
        "--seq",
        "64",
    ]);
    assert!(stderr(&output).contains("warning: field \"num_experts\""));
}

#[test]
fn training_loop_knobs() {
    let base = ["--model", "mlp", "--batch", "64"];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        a
    }
    for (extra, fragments) in [
        (
            vec!["--clip-grad-norm", "-1"],
            vec!["clip-grad-norm", "positive", "got -1"],
        ),
        (
            vec!["--clip-grad-norm", "0"],
            vec!["clip-grad-norm", "got 0"],
        ),
        (vec!["--clip-grad-norm", "inf"], vec!["clip-grad-norm"]),
        (vec!["--clip-grad-norm", "x"], vec!["clip-grad-norm"]),
        (
            vec!["--zero-grad", "maybe"],
            vec!["\"maybe\"", "valid values are none, zero"],
        ),
        (
            vec!["--grad-scaler", "maybe"],
            vec!["grad-scaler must be true or false", "maybe"],
        ),
        (
            vec!["--optimizer", "nesterov"],
            vec!["sgd-nesterov", "adafactor-hf"],
        ),
        (
            vec!["--optimizer", "adafactor-hf", "--optimizer-impl", "fused"],
            vec!["no fused implementation"],
        ),
        (
            vec!["--optimizer", "adamw-hf", "--optimizer-impl", "fused"],
            vec!["no fused implementation"],
        ),
        (
            vec!["--checkpoint-impl", "sometimes"],
            vec!["non-reentrant, reentrant"],
        ),
        (vec!["--torch-version", "1.9"], vec!["2.15, 1.10"]),
        (vec!["--transformers-version", "4.15"], vec!["5.23, 4.16"]),
    ] {
        assert_fails(&with(&base, &extra), &fragments);
    }
    // The JSON recipe says what ran; the scaler follows the precision unless given.
    let j = predict_json(&with(&base, &["--precision", "amp-fp16"]));
    assert_eq!(j["recipe"]["grad_scaler"], true);
    assert_eq!(j["recipe"]["zero_grad"], "none");
    assert_eq!(j["recipe"]["clip_grad_norm"], serde_json::Value::Null);
    let j = predict_json(&with(
        &base,
        &[
            "--precision",
            "amp-fp16",
            "--grad-scaler",
            "false",
            "--zero-grad",
            "zero",
            "--clip-grad-norm",
            "1.0",
            "--optimizer",
            "sgd-nesterov",
        ],
    ));
    assert_eq!(j["recipe"]["grad_scaler"], false);
    assert_eq!(j["recipe"]["zero_grad"], "zero");
    assert_eq!(j["recipe"]["clip_grad_norm"], 1.0);
    assert_eq!(j["recipe"]["optimizer"], "sgd-nesterov");
    // zero_grad(set_to_none=False) with plain SGD: the peak is in iteration 2, where every
    // gradient (4 bytes for each of the MLP's 41,858,024 parameters) is still allocated.
    let zero = predict_json(&with(&base, &["--zero-grad", "zero", "--optimizer", "sgd"]));
    let none = predict_json(&with(&base, &["--optimizer", "sgd"]));
    assert_eq!(
        zero["breakdown"]["by_category"]["gradient"],
        41_858_024u64 * 4
    );
    assert!(
        zero["peak_requested_bytes"].as_u64().unwrap()
            >= none["peak_requested_bytes"].as_u64().unwrap()
    );
    // transformers' Adafactor on a bf16 model runs end to end.
    predict_json(&with(
        &base,
        &["--optimizer", "adafactor-hf", "--precision", "bf16"],
    ));
    // Sweepable like every predict option.
    let out = succeeds(&[
        "whatif",
        "--model",
        "mlp",
        "--batch",
        "64",
        "--vary",
        "zero-grad=none,zero",
        "--vary",
        "grad-scaler=true,false",
        "--json",
    ]);
    let rows: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(rows.as_array().map(Vec::len), Some(4));
}

#[test]
fn workspaces_and_context_in_the_report() {
    // gpt2 b2 s128 fp32 peaks in the optimizer step (gpt2__b2s128__fp32-adamw.json). There no GEMM
    // runs: 2.15's per-call workspaces are all freed, while TORCH_CUBLAS_WORKSPACE_CACHE=1 keeps one
    // per thread (forward, backward) of :4096:2:16:8 = 8,519,680 B on an A100: 17,039,360 B.
    let base = [
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--gpu",
        "a100-80gb",
    ];
    let j = predict_json(&base);
    assert_eq!(j["peak_phase"], "optimizer");
    assert!(j["breakdown"]["by_category"].get("workspace").is_none());
    assert_eq!(j["workspaces"]["cublas_bytes"], 8_519_680);
    assert_eq!(j["workspaces"]["cublaslt_bytes"], 1_048_576);
    assert_eq!(j["workspaces"]["cublas_mode"], "per-call");
    let j = predict_json(&[&base[..], &["--cublas-workspace-cache"]].concat());
    assert_eq!(j["workspaces"]["cublas_mode"], "persistent");
    assert_eq!(j["breakdown"]["by_category"]["workspace"], 17_039_360);
    // On an H100 (sm 9.0) the default is 32 MiB; CUBLAS_WORKSPACE_CONFIG=:4096:8 is 32 MiB anywhere.
    let j = predict_json(&["--model", "gpt2", "--batch", "2", "--seq", "128"]);
    assert_eq!(j["workspaces"]["cublas_bytes"], 33_554_432);
    let j = predict_json(&[&base[..], &["--cublas-workspace-config", ":4096:8"]].concat());
    assert_eq!(j["workspaces"]["cublas_bytes"], 33_554_432);
    // The table says what the kernels take and where the context figure comes from.
    let out = vramsim(&[&["predict"], &base[..]].concat());
    let table = stdout(&out);
    assert!(
        table.contains("kernels    cuBLAS workspace 8.12 MiB per GEMM call"),
        "{table}"
    );
    assert!(
        table.contains("context    512.00 MiB, CUDA 13: assumption"),
        "{table}"
    );
    // --cuda 11 on a V100: the HF docs' measurement, 1343 MB used less 2 + 2 MiB (see
    // device_presets.rs) = 1339 MiB; --context still wins.
    let v100 = [
        "--model",
        "bert-base",
        "--batch",
        "1",
        "--seq",
        "128",
        "--gpu",
        "v100-16gb",
    ];
    let j = predict_json(&[&v100[..], &["--cuda", "11"]].concat());
    assert_eq!(j["context"]["bytes"], 1339u64 << 20);
    assert_eq!(j["device"]["context_bytes"], 1339u64 << 20);
    assert_eq!(j["context"]["cuda"], 11);
    assert!(j["context"]["source"]
        .as_str()
        .unwrap()
        .starts_with("measured: HF transformers docs"));
    let j = predict_json(&[&v100[..], &["--cuda", "11", "--context", "700MiB"]].concat());
    assert_eq!(j["device"]["context_bytes"], 700u64 << 20);
    assert_eq!(j["context"]["source"], "given with --context");
}

#[test]
fn bad_workspace_and_cuda_options() {
    let base = ["--model", "gpt2", "--batch", "1", "--seq", "64"];
    assert_fails(
        &[&base[..], &["--cuda", "14"]].concat(),
        &[
            "unknown CUDA version \"14\"",
            "valid versions are 11, 12, 13",
        ],
    );
    assert_fails(
        &[
            &base[..],
            &["--cublas-workspace-config", ":99999999999999999999999:1"],
        ]
        .concat(),
        &["invalid cublas-workspace-config", "does not fit in 64 bits"],
    );
    // No `:SIZE:COUNT` at all: PyTorch warns and keeps its default; so does vramsim.
    let mut all = vec!["predict"];
    all.extend_from_slice(&base);
    all.extend_from_slice(&["--cublas-workspace-config", "garbage"]);
    let out = vramsim(&all);
    assert!(out.status.success());
    assert!(stderr(&out).contains(
        "Could not parse CUBLAS_WORKSPACE_CONFIG, using default workspace size of 33554432 bytes."
    ));
}

#[test]
fn heads_losses_and_image_sizes() {
    // Published: bert-base-uncased as BertForSequenceClassification(num_labels=2) has 109,483,778
    // parameters (BertModel's 109,482,240 + Linear(768, 2)).
    let j = predict_json(&[
        "--model",
        "bert-base",
        "--batch",
        "2",
        "--seq",
        "64",
        "--head",
        "seq-cls:2",
    ]);
    assert_eq!(j["params"], 109_483_778u64);
    assert_eq!(j["recipe"]["head"], "seq-cls:2");
    assert_eq!(j["recipe"]["loss"], "hf");
    assert!(j["reference"]
        .as_str()
        .unwrap()
        .contains("BertForSequenceClassification"));
    // The zoo's defaults are the families' own heads.
    let j = predict_json(&["--model", "gpt2", "--batch", "1", "--seq", "32"]);
    assert_eq!(j["recipe"]["head"], "lm");
    assert_eq!(j["recipe"]["keep_outputs"], false);
    let j = predict_json(&[
        "--model",
        "gpt2",
        "--batch",
        "1",
        "--seq",
        "32",
        "--loss",
        "plain",
        "--keep-outputs",
    ]);
    assert_eq!(j["recipe"]["loss"], "plain");
    assert_eq!(j["recipe"]["keep_outputs"], true);
    // An imported config takes a head too: TinyLlama's LlamaModel is its 1,100,048,384
    // parameters less the untied lm_head (32000 × 2048), plus score Linear(2048, 2, bias=False).
    let j = predict_json(&[
        "--hf-config",
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../models/tests/hf/TinyLlama-1.1B-intermediate-step-1431k-3T.json"
        ),
        "--batch",
        "2",
        "--seq",
        "64",
        "--head",
        "seq-cls:2",
    ]);
    assert_eq!(j["params"], 1_100_048_384u64 - 32000 * 2048 + 2048 * 2);
    // torchvision's resnet50(num_classes=10): 25,557,032 − (2048·1000 + 1000) + (2048·10 + 10).
    let output = succeeds(&[
        "predict",
        "--model",
        "resnet50",
        "--batch",
        "4",
        "--image-size",
        "160",
        "--num-classes",
        "10",
    ]);
    let text = stdout(&output);
    assert!(text.contains("23,528,522 parameters"), "{text}");
    assert!(text.contains("3×160×160 images, 10 classes"), "{text}");
    let output = succeeds(&[
        "predict",
        "--model",
        "bert-base",
        "--batch",
        "2",
        "--seq",
        "64",
        "--head",
        "token-cls:9",
        "--keep-outputs",
    ]);
    assert!(stdout(&output).contains("head token-cls:9, hf loss, loop keeps outputs"));
}

#[test]
fn bad_heads_and_sizes_list_the_valid_choices() {
    let lm = ["--model", "gpt2", "--batch", "1", "--seq", "32"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut v: Vec<&str> = lm.to_vec();
        v.extend_from_slice(extra);
        v
    };
    assert_fails(
        &with(&["--head", "seq-cls:0"]),
        &["seq-cls:0", "lm, masked-lm, seq-cls:N, token-cls:N, none"],
    );
    assert_fails(
        &with(&["--head", "classifier"]),
        &["lm, masked-lm, seq-cls:N, token-cls:N, none"],
    );
    assert_fails(&with(&["--loss", "mse"]), &["hf, plain"]);
    assert_fails(&with(&["--num-classes", "3"]), &["seq-cls:3"]);
    assert_fails(
        &["--model", "resnet50", "--batch", "2", "--head", "lm"],
        &["--head", "--num-classes", "seq-cls:N"],
    );
    assert_fails(
        &[
            "--model",
            "tinyllama-1.1b",
            "--batch",
            "2",
            "--head",
            "masked-lm",
        ],
        &["masked-lm", "lm, seq-cls:N, token-cls:N, none"],
    );
    assert_fails(
        &["--model", "bert-base", "--batch", "2", "--head", "lm"],
        &["masked-lm, seq-cls:N, token-cls:N, none"],
    );
    assert_fails(
        &["--model", "resnet50", "--batch", "2", "--image-size", "0"],
        &["image-size", "1 or more"],
    );
    assert_fails(
        &[
            "--model",
            "resnet50",
            "--batch",
            "2",
            "--image-size",
            "224x",
        ],
        &["image-size", "384x256"],
    );
    assert_fails(
        &["--model", "resnet50", "--batch", "2", "--num-classes", "0"],
        &["num-classes"],
    );
    assert_fails(
        &[
            "--model",
            "vit-b-16",
            "--batch",
            "2",
            "--image-size",
            "384x256",
        ],
        &["square"],
    );
    assert_fails(
        &["--model", "vit-b-16", "--batch", "2", "--image-size", "200"],
        &["patch size 16"],
    );
    assert_fails(
        &["--model", "mlp", "--batch", "2", "--image-size", "224"],
        &["features"],
    );
}

#[test]
fn attention_defaults_to_what_transformers_and_pytorch_pick() {
    // Llama-3-8B, bf16 autocast on an H100 (sm 9.0): transformers' default attn_implementation is
    // "sdpa" (LlamaPreTrainedModel._supports_sdpa) and PyTorch 2.15 with its bundled cuDNN puts
    // cuDNN attention first on sm 9.0 (sdp_utils.cpp check_prefer_cudnn_attention); bf16, head
    // dim 128, no mask, no dropout pass every cuDNN check.
    let llama = [
        "--model",
        "llama3-8b",
        "--batch",
        "2",
        "--seq",
        "8192",
        "--precision",
        "amp-bf16",
    ];
    let with = |extra: &[&str]| {
        let mut args = llama.to_vec();
        args.extend_from_slice(extra);
        predict_json(&args)
    };
    let h100 = with(&["--gpu", "h100-80gb"]);
    assert_eq!(
        h100["attention"]["kernel"], "sdpa-cudnn",
        "{}",
        h100["attention"]
    );
    let reason = h100["attention"]["reason"].as_str().unwrap();
    for fragment in [
        "_supports_sdpa",
        "cuDNN attention",
        "check_prefer_cudnn_attention",
        "bf16",
        "head dim 128",
    ] {
        assert!(reason.contains(fragment), "{fragment:?} not in {reason}");
    }
    assert_eq!(h100["recipe"]["attention"], "auto");
    // Eager attention materializes [2, 32, 8192, 8192] scores (4 GiB in bf16, 8 GiB as the
    // float32 softmax) per layer and runs out of memory inside the first layers' attention; the
    // fused kernel does not. (The step itself cannot fit 80 GB: float32 weights, gradients and
    // AdamW's two moments take 16 bytes × 8.03 B parameters = 128 GB.)
    let eager = with(&["--gpu", "h100-80gb", "--attention", "eager"]);
    let eager_tag = eager["oom"]["tag"].as_str().unwrap();
    assert!(eager_tag.contains("self_attn"), "{eager_tag}");
    assert!(
        h100["oom"].is_null() || !h100["oom"]["tag"].as_str().unwrap().contains("self_attn"),
        "{}",
        h100["oom"]
    );
    assert!(
        h100["breakdown"]["event_index"].as_u64() > eager["breakdown"]["event_index"].as_u64(),
        "the SDPA step gets further than the eager one"
    );
    // The table says which kernel and why.
    let mut args = vec!["predict"];
    args.extend_from_slice(&llama);
    args.extend_from_slice(&["--gpu", "h100-80gb"]);
    let text = stdout(&vramsim(&args));
    assert!(text.contains("sdpa-cudnn attention"), "{text}");
    assert!(
        text.contains("attention  transformers attn_implementation None"),
        "{text}"
    );

    // A100 (sm 8.0): the default order, FlashAttention-2 first.
    let a100 = with(&["--gpu", "a100-80gb"]);
    assert_eq!(
        a100["attention"]["kernel"], "sdpa-flash",
        "{}",
        a100["attention"]
    );
    // fp32 on the H100: neither cuDNN nor flash take fp32; memory-efficient attention does.
    let mut args = llama.to_vec();
    args[7] = "fp32";
    args.extend_from_slice(&["--gpu", "h100-80gb"]);
    let fp32 = predict_json(&args);
    assert_eq!(fp32["attention"]["kernel"], "sdpa-mem-efficient");
    // Models without attention have none.
    let r = predict_json(&["--model", "resnet18", "--batch", "2"]);
    assert!(r["attention"].is_null());
}

#[test]
fn gpt2_medium_max_batch_is_no_longer_limited_by_eager_attention() {
    let max_batch = |attention: &str| {
        let output = succeeds(&[
            "max-batch",
            "--model",
            "gpt2-medium",
            "--gpu",
            "rtx4090",
            "--attention",
            attention,
            "--json",
        ]);
        let j: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
        j["max_batch"].as_u64().unwrap()
    };
    let (eager, auto) = (max_batch("eager"), max_batch("auto"));
    assert!(auto > eager, "auto {auto} vs eager {eager}");
    // At the default's largest batch, eager attention runs out of memory in an attention op.
    let b = auto.to_string();
    let j = predict_json(&[
        "--model",
        "gpt2-medium",
        "--batch",
        &b,
        "--gpu",
        "rtx4090",
        "--attention",
        "eager",
    ]);
    assert_eq!(j["fits"], false);
    // fp32 on sm 8.9: memory-efficient attention (FlashAttention needs 16-bit inputs).
    let j = predict_json(&["--model", "gpt2-medium", "--batch", &b, "--gpu", "rtx4090"]);
    assert_eq!(j["attention"]["kernel"], "sdpa-mem-efficient");
    assert_eq!(j["fits"], true);
}

#[test]
fn bad_attention_values_are_clear_errors() {
    assert_fails(
        &["--model", "gpt2", "--batch", "1", "--attention", "flash"],
        &[
            "unknown attention \"flash\"",
            "auto, eager, sdpa, sdpa-flash, sdpa-mem-efficient, sdpa-math, sdpa-cudnn",
        ],
    );
    // FlashAttention takes fp16/bf16 only (check_dtypes_flash_attention): PyTorch raises.
    assert_fails(
        &[
            "--model",
            "gpt2",
            "--batch",
            "1",
            "--attention",
            "sdpa-flash",
        ],
        &["--attention sdpa-flash", "fp32", "No available kernel"],
    );
    // No FlashAttention or cuDNN attention below sm80 (a T4 is sm 7.5).
    assert_fails(
        &[
            "--model",
            "gpt2",
            "--batch",
            "1",
            "--precision",
            "amp-fp16",
            "--gpu",
            "t4",
            "--attention",
            "sdpa-cudnn",
        ],
        &["sm 7.5", "check_cudnn_hardware_support"],
    );
}

#[test]
fn timm_models_take_image_size_and_num_classes() {
    // timm 0.6 create_model('vit_small_patch16_224', img_size=384, num_classes=10): 22,050,664
    // parameters at 224×224 with 1000 classes; the head loses 384·990 + 990 and pos_embed grows
    // from 1 + 14·14 to 1 + 24·24 tokens of width 384.
    let j = predict_json(&[
        "--model",
        "timm/vit_small_patch16_224",
        "--batch",
        "2",
        "--image-size",
        "384",
        "--num-classes",
        "10",
    ]);
    assert_eq!(
        j["params"],
        22_050_664u64 - (384 * 990 + 990) + (576 - 196) * 384
    );
    assert_eq!(j["recipe"]["image_size"], serde_json::json!([384, 384]));
    assert_eq!(j["recipe"]["num_classes"], 10);
    // The float32 batch 2×3×384×384 and its int64 labels.
    assert_eq!(
        j["breakdown"]["by_category"]["input"],
        2 * 3 * 384 * 384 * 4 + 2 * 8
    );
    // PatchEmbed takes any H×W (0.6 has no square check): 384×256 gives 24·16 patches.
    let j = predict_json(&[
        "--model",
        "timm/vit_small_patch16_224",
        "--batch",
        "2",
        "--image-size",
        "384x256",
    ]);
    assert_eq!(j["params"], 22_050_664u64 + (384 - 196) * 384);
    // timm resnet50(num_classes=10) on 160×128 images: 25,557,032 − (2048·1000 + 1000) + (2048·10 + 10).
    let output = succeeds(&[
        "predict",
        "--model",
        "timm/resnet50",
        "--batch",
        "2",
        "--image-size",
        "160x128",
        "--num-classes",
        "10",
    ]);
    let text = stdout(&output);
    assert!(text.contains("23,528,522 parameters"), "{text}");
    assert!(text.contains("3×160×128 images, 10 classes"), "{text}");
    assert_fails(
        &[
            "--model",
            "timm/convnext_tiny",
            "--batch",
            "2",
            "--image-size",
            "0",
        ],
        &["image-size", "1 or more"],
    );
}

#[test]
fn forced_attention_on_models_without_sdpa_is_refused() {
    // timm 0.6's Attention.forward computes attention explicitly and the CNNs have none: a forced
    // SDPA kernel describes no run of their code.
    assert_fails(
        &[
            "--model",
            "timm/vit_base_patch16_224",
            "--batch",
            "2",
            "--attention",
            "sdpa-flash",
        ],
        &["never calls scaled_dot_product_attention", "auto, eager"],
    );
    assert_fails(
        &[
            "--model",
            "resnet18",
            "--batch",
            "2",
            "--attention",
            "sdpa-math",
        ],
        &["has no attention", "valid values are auto"],
    );
    let j = predict_json(&["--model", "timm/vit_base_patch16_224", "--batch", "2"]);
    assert_eq!(j["attention"]["kernel"], "eager");
    // Image models take nn.CrossEntropyLoss: --loss does not apply.
    assert_eq!(j["recipe"]["loss"], serde_json::Value::Null);
}

/// `--inference` with transformers' default `use_cache=True`: TinyLlama's forward keeps a
/// `torch.cat` copy of every layer's keys and values in the output's DynamicCache, so at the
/// peak (the head, after the last layer: the default attention is SDPA, whose scores are never
/// materialized) all 22 layers' copies are alive: 22 × 2 × [B 2, Hkv 4, S 1024, D 64] float32
/// (each a multiple of 512 bytes, so the requested and the allocated peaks grow alike).
/// `--use-cache false` is the loop that passes `use_cache=False`; a bad value is exit 2.
#[test]
fn inference_keeps_the_kv_cache_unless_use_cache_is_false() {
    let base = [
        "--model",
        "tinyllama-1.1b",
        "--batch",
        "2",
        "--seq",
        "1024",
        "--inference",
    ];
    let on = predict_json(&base);
    let mut off_args = base.to_vec();
    off_args.extend(["--use-cache", "false"]);
    let off = predict_json(&off_args);
    let cache = 22 * 2 * (2 * 4 * 1024 * 64 * 4);
    assert_eq!(
        on["peak_allocated_bytes"].as_u64().unwrap(),
        off["peak_allocated_bytes"].as_u64().unwrap() + cache
    );
    let mut bad = base.to_vec();
    bad.extend(["--use-cache", "maybe"]);
    assert_fails(&bad, &["use-cache must be true or false", "maybe"]);
}
