//! `predict --freeze / --lora / --quant / --recipe`, `whatif --vary lora.r=… --vary quant=…` and
//! `recommend --finetune` end to end: the JSON fields and clear errors (exit 2) for bad input.

mod common;
use common::{assert_fails, json};

#[test]
fn predict_reports_all_and_trainable_parameters() {
    let j = json(&["predict", "--model", "gpt2", "--batch", "1", "--seq", "128"]);
    assert_eq!(j["params"], 124_439_808);
    assert_eq!(j["trainable_params"], 124_439_808);
    // LoRA r 8 on GPT-2's c_attn: 12 layers × 8 × (768 + 2304).
    let j = json(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "1",
        "--seq",
        "128",
        "--lora",
        "r=8,alpha=16,targets=c_attn",
    ]);
    assert_eq!(j["trainable_params"], 12 * 8 * (768 + 2304));
    assert_eq!(j["params"], 124_439_808 + 12 * 8 * (768 + 2304));
    assert_eq!(j["recipe"]["lora"], "r=8,alpha=16,dropout=0,targets=c_attn");
    // PEFT's defaults for LLaMA: q_proj and v_proj, r 8.
    let j = json(&[
        "predict",
        "--model",
        "llama2-7b",
        "--batch",
        "1",
        "--seq",
        "128",
        "--precision",
        "bf16",
        "--recipe",
        "peft-lora",
        "--quant",
        "nf4-dq",
        "--optimizer",
        "paged-adamw8bit",
    ]);
    assert_eq!(j["trainable_params"], 4_194_304);
    assert_eq!(j["recipe"]["quant"], "nf4-dq");
    // the adapters' states are under 1e5 elements: none paged
    assert_eq!(j["paged_optimizer_bytes"], 0);
}

#[test]
fn bad_finetuning_input_exits_2_with_the_reason() {
    assert_fails(
        &[
            "predict",
            "--model",
            "llama2-7b",
            "--batch",
            "1",
            "--lora",
            "targets=query",
        ],
        &[
            "matches no linear layer",
            "model.layers.0-31.self_attn.q_proj",
            "lm_head",
        ],
    );
    assert_fails(
        &[
            "predict", "--model", "gpt2", "--batch", "1", "--lora", "r=0",
        ],
        &["rank must be an integer ≥ 1"],
    );
    assert_fails(
        &[
            "predict",
            "--model",
            "gpt2",
            "--batch",
            "1",
            "--freeze",
            "transformer.h.12",
        ],
        &["matches no parameter", "transformer.h.0-11.attn.c_attn"],
    );
    assert_fails(
        &[
            "predict", "--model", "resnet18", "--batch", "1", "--quant", "nf4",
        ],
        &["resnet18 has no linear layer"],
    );
    assert_fails(
        &[
            "predict", "--model", "gpt2", "--batch", "1", "--quant", "nf3",
        ],
        &["nf4, fp4, nf4-dq, fp4-dq, int8"],
    );
    assert_fails(
        &[
            "predict",
            "--model",
            "resnet18",
            "--batch",
            "1",
            "--recipe",
            "peft-lora",
        ],
        &["no default target_modules"],
    );
    assert_fails(
        &[
            "predict", "--model", "gpt2", "--batch", "1", "--recipe", "unsloth",
        ],
        &["peft-lora, torchtune-qlora, litgpt-lora"],
    );
}

#[test]
fn whatif_varies_rank_and_quantization() {
    let j = json(&[
        "whatif",
        "--model",
        "tinyllama-1.1b",
        "--batch",
        "1",
        "--seq",
        "128",
        "--precision",
        "bf16",
        "--recipe",
        "peft-lora",
        "--vary",
        "lora.r=8,64",
        "--vary",
        "quant=none,nf4",
    ]);
    let rows = j.as_array().expect("one document per configuration");
    assert_eq!(rows.len(), 4);
    // TinyLlama q_proj + v_proj: 22 × r × ((2048 + 2048) + (2048 + 256)); rows come sorted by
    // device use.
    let per_rank = 22 * (2048 + 2048 + 2048 + 256);
    let mut got: Vec<(u64, String)> = rows
        .iter()
        .map(|r| {
            (
                r["trainable_params"].as_u64().unwrap(),
                r["recipe"]["quant"].as_str().unwrap_or("none").to_string(),
            )
        })
        .collect();
    got.sort();
    let want: Vec<(u64, String)> = [(8, "nf4"), (8, "none"), (64, "nf4"), (64, "none")]
        .iter()
        .map(|&(r, q)| (r * per_rank, q.to_string()))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn recommend_proposes_full_lora_and_qlora() {
    let j = json(&[
        "recommend",
        "--model",
        "gpt2",
        "--seq",
        "128",
        "--global-batch",
        "4",
        "--finetune",
        "--precision",
        "bf16",
        "--checkpoint",
        "none",
    ]);
    let mut methods: Vec<&str> = j["recipes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["method"].as_str().unwrap())
        .collect();
    methods.sort();
    assert_eq!(methods, ["full", "lora", "qlora"]);
    assert_eq!(j["recipes_tried"], 3);
    assert_fails(
        &[
            "recommend",
            "--model",
            "gpt2",
            "--global-batch",
            "4",
            "--finetune",
            "--quant",
            "nf4",
        ],
        &["--finetune tries full fine-tuning, LoRA and QLoRA itself"],
    );
}
