//! `--dp` / `--shard` / `--world-size` on `predict` (and so on whatif and max-batch, which share
//! its options): the single-GPU layout is today's predict to the byte, data-parallel layouts give a
//! per-rank report, and bad layouts fail with the reason (exit status 2).

mod common;
use common::{json, stdout, succeeds};

use serde_json::Value;
use vramsim_api::{parse_args, predict};

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// The table without its one wall-clock line (`lowered ... in X ms, replayed in Y ms`).
fn untimed_table(t: &str) -> String {
    t.lines()
        .filter(|l| !l.starts_with("lowered "))
        .collect::<Vec<_>>()
        .join("\n")
}

fn untimed(mut doc: Value) -> Value {
    if let Value::Object(map) = &mut doc {
        map.remove("timing");
    }
    doc
}

/// `--dp 1 --shard none --tp 1` is the single-GPU step: the same trace, table and JSON for every
/// zoo model.
#[test]
fn dp1_shard_none_is_todays_predict_for_every_zoo_model() {
    for name in vramsim_models::zoo::NAMES {
        let base = ["--model", name, "--batch", "1", "--seq", "64"];
        let plain: predict::PredictArgs = parse_args("predict", &strings(&base)).unwrap();
        let mut with = base.to_vec();
        with.extend(["--dp", "1", "--shard", "none", "--tp", "1"]);
        let layout: predict::PredictArgs = parse_args("predict", &strings(&with)).unwrap();
        let a = predict::predict(&plain).unwrap();
        let b = predict::predict(&layout).unwrap();
        assert_eq!(a.lowered.trace(), b.lowered.trace(), "{name}: trace");
        assert_eq!(
            serde_json::to_string(&untimed(a.to_json())).unwrap(),
            serde_json::to_string(&untimed(b.to_json())).unwrap(),
            "{name}: JSON"
        );
        assert_eq!(
            untimed_table(&a.to_table()),
            untimed_table(&b.to_table()),
            "{name}: table"
        );
    }
}

#[test]
fn data_parallel_reports_one_role_for_all_ranks() {
    let doc = json(&[
        "predict", "--model", "gpt2", "--batch", "2", "--seq", "128", "--dp", "8", "--shard", "ddp",
    ]);
    let ranks = doc["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 1);
    assert_eq!(
        ranks[0]["ranks"],
        serde_json::json!([0, 1, 2, 3, 4, 5, 6, 7])
    );
    // The top-level peaks are the worst (here the only) role's.
    assert_eq!(
        ranks[0]["peak_allocated_bytes"], doc["peak_allocated_bytes"],
        "{doc}"
    );
    assert_eq!(ranks[0]["fits"], doc["fits"]);
    assert!(ranks[0]["by_category"]["communication"].as_u64().unwrap() > 0);
    assert_eq!(doc["layout"]["world_size"], 8);
    let table = stdout(&succeeds(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--precision",
        "bf16",
        "--dp",
        "4",
        "--shard",
        "zero2",
    ]));
    assert!(table.contains("ranks 0-3"), "{table}");
    let doc = json(&[
        "predict", "--model", "gpt2", "--batch", "2", "--seq", "128", "--dp", "8", "--shard",
        "fsdp2",
    ]);
    assert_eq!(doc["layout"]["shard"], "fsdp2");
    assert!(doc["ranks"][0]["role"].as_str().unwrap().contains("FSDP2"));
    // An OOM on every rank: PyTorch's message in the role.
    let doc = json(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--dp",
        "2",
        "--shard",
        "ddp",
        "--capacity",
        "1GiB",
    ]);
    assert_eq!(doc["ranks"][0]["fits"], false);
    assert!(doc["ranks"][0]["oom_message"]
        .as_str()
        .unwrap()
        .contains("CUDA out of memory"));
}

#[test]
fn bad_layouts_fail_with_the_reason() {
    let base = ["predict", "--model", "gpt2", "--batch", "1", "--seq", "64"];
    let fails = |extra: &[&str], fragments: &[&str]| {
        let mut all = base.to_vec();
        all.extend_from_slice(extra);
        common::assert_fails(&all, fragments);
    };
    fails(
        &["--dp", "4"],
        &["--shard ddp, zero1, zero2, zero3, zero1-torch or fsdp2"],
    );
    // Fine-tuning runs with --tp and --dp (ddp, zero1, zero2, zero3, fsdp2, with --offload); what
    // is not lowered with frozen parameters is refused with its reason.
    for (extra, fragments) in [
        (
            &["--pp", "2", "--pp-schedule", "gpipe", "--quant", "nf4"][..],
            &[
                "--pp 2 with --quant nf4",
                "not modelled yet",
                "QLoRA with --pp 1",
            ][..],
        ),
        (
            &["--dp", "2", "--shard", "dataparallel"][..],
            &["--shard dataparallel with fine-tuning"][..],
        ),
    ] {
        let mut all = extra.to_vec();
        all.extend(["--lora", "r=8,targets=c_attn"]);
        fails(&all, fragments);
    }
    // QLoRA with the data-parallel modes other than DDP, FSDP2 and ZeRO-3: refused with the
    // source's reason.
    for (shard, why) in [
        ("zero2", "_configure_distributed_model"),
        ("zero1-torch", "ZeroRedundancyOptimizer"),
    ] {
        fails(
            &[
                "--precision",
                "bf16",
                "--dp",
                "2",
                "--shard",
                shard,
                "--quant",
                "nf4",
                "--lora",
                "r=8,targets=c_attn",
            ],
            &[
                &format!("--quant nf4 with --shard {shard} is not modelled yet"),
                why,
                "--dp N --shard ddp",
            ],
        );
    }
    fails(
        &["--dp", "4", "--shard", "ddp", "--world-size", "8"],
        &["world-size", "8 does not match", "4 ranks"],
    );
    fails(
        &[
            "--precision",
            "bf16",
            "--dp",
            "4",
            "--shard",
            "zero2",
            "--optimizer",
            "sgd",
        ],
        &["sgd (no momentum) keeps none"],
    );
    fails(
        &["--dp", "4", "--shard", "zero1", "--precision", "amp-bf16"],
        &["--precision bf16", "--precision fp32", "torch_autocast"],
    );
    fails(
        &["--dp", "4", "--shard", "zero4"],
        &["valid values are none, ddp, zero1, zero2, zero3, zero1-torch"],
    );
    fails(
        &[
            "--precision",
            "bf16",
            "--dp",
            "4",
            "--shard",
            "zero3",
            "--optimizer",
            "sgd",
        ],
        &["--shard zero3", "sgd (no momentum) keeps none"],
    );
    fails(
        &["--dp", "4", "--shard", "zero3", "--precision", "amp-fp16"],
        &["--precision bf16", "torch_autocast", "module classes"],
    );
    fails(
        &["--dp", "4", "--shard", "zero1-torch", "--optimizer", "sgd"],
        &["ZeroRedundancyOptimizer", "sgd (no momentum) keeps none"],
    );
    fails(
        &[
            "--precision",
            "bf16",
            "--dp",
            "4",
            "--shard",
            "zero3",
            "--clip-grad-norm",
            "1.0",
        ],
        &["DeepSpeed clips"],
    );
    fails(&["--dp", "0", "--shard", "ddp"], &["dp must be"]);
    // nn.DataParallel is one process: it cannot be split by TP or PP (issue 18).
    fails(
        &["--dp", "2", "--shard", "dataparallel", "--tp", "2"],
        &["nn.DataParallel", "tensor (--tp 2)", "--shard ddp or fsdp2"],
    );
    fails(
        &["--dp", "2", "--shard", "dataparallel", "--pp", "2"],
        &["nn.DataParallel", "pipeline (--pp 2)"],
    );
    fails(
        &[
            "--dp",
            "2",
            "--shard",
            "ddp",
            "--world-size",
            "2",
            "--pp",
            "2",
        ],
        &["2 does not match", "dp 2 × tp 1 × pp 2 × cp 1 = 4 ranks"],
    );
    fails(&["--sp"], &["--tp 2 or more"]);
    // Tensor parallelism: what --tp must divide, and the models it splits (issue 12).
    fails(&["--tp", "5"], &["5 does not divide n_head (12)"]);
    // QLoRA under --tp: no framework quantizes a tensor-parallel shard.
    fails(
        &[
            "--tp",
            "2",
            "--quant",
            "nf4",
            "--lora",
            "r=8,targets=c_attn",
        ],
        &["--tp 2 with --quant nf4", "Linear4bit"],
    );
    // LoRA under --tp: Megatron-Bridge's column-parallel linear_in splits r over the ranks.
    fails(
        &["--tp", "4", "--lora", "r=6,targets=c_attn"],
        &["r % tp == 0", "multiple of 4"],
    );
    // A pipeline stage that trains nothing cannot be a DDP module (PyTorch raises).
    fails(
        &[
            "--tp",
            "2",
            "--pp",
            "2",
            "--dp",
            "2",
            "--shard",
            "ddp",
            "--pp-schedule",
            "gpipe",
            "--freeze",
            "transformer.wte,transformer.wpe,transformer.h.0-5",
        ],
        &[
            "stage 0 of gpt2 trains no parameter",
            "DistributedDataParallel is not needed",
            "--shard fsdp2 or none",
        ],
    );
    fails(
        &["--tp", "2", "--loss", "plain"],
        &["vocab_parallel_cross_entropy", "--loss hf"],
    );
    let model = |name: &str, seq: &str, extra: &[&str], fragments: &[&str]| {
        let mut all = vec!["predict", "--model", name, "--batch", "1", "--seq", seq];
        all.extend_from_slice(extra);
        common::assert_fails(&all, fragments);
    };
    model(
        "gpt2",
        "66",
        &["--tp", "4", "--sp"],
        &["seq 66 does not divide by 4"],
    );
    model(
        "tinyllama-1.1b",
        "64",
        &["--tp", "8"],
        &["8 does not divide num_key_value_heads (4)"],
    );
    model(
        "resnet50",
        "64",
        &["--tp", "2"],
        &["GPT-2, LLaMA and BERT families", "--tp 1"],
    );
    fails(&["--pp-schedule", "gpipe"], &["--pp 2 or more"]);
    fails(
        &["--pp", "2", "--pp-schedule", "interleaved:1"],
        &["gpipe, 1f1b, interleaved:V"],
    );
    fails(&["--tp", "0"], &["tp must be"]);
    fails(
        &[
            "--dp", "65536", "--tp", "65536", "--pp", "2", "--shard", "ddp",
        ],
        &["8589934592 ranks"],
    );
    fails(
        &["--offload", "params", "--dp", "2", "--shard", "ddp"],
        &["--offload params", "not ddp"],
    );
    fails(
        &["--offload", "optimizer", "--dp", "2", "--shard", "fsdp2"],
        &["CPUOffloadPolicy", "--offload params"],
    );
    fails(&["--offload", "cpu"], &["none, optimizer, params"]);
    fails(
        &[
            "--offload",
            "optimizer",
            "--dp",
            "2",
            "--shard",
            "zero2",
            "--precision",
            "bf16",
            "--optimizer",
            "sgd-momentum",
        ],
        &["DeepSpeedCPUAdam", "adamw or adam"],
    );
    fails(
        &[
            "--offload",
            "params",
            "--dp",
            "2",
            "--shard",
            "fsdp2",
            "--precision",
            "amp-fp16",
        ],
        &["GradScaler", "not modelled"],
    );
    // `--precision fp16` is DeepSpeed's fp16 mode; autocast under ZeRO is its torch_autocast mode.
    fails(
        &["--dp", "2", "--shard", "ddp", "--precision", "fp16"],
        &[
            "DeepSpeed's fp16 mode",
            "--shard zero1, zero2 or zero3, not ddp",
        ],
    );
    fails(
        &["--dp", "2", "--shard", "zero2", "--precision", "amp-fp16"],
        &[
            "--precision fp16",
            "torch_autocast mode, which is not modelled",
        ],
    );
    fails(
        &[
            "--dp",
            "2",
            "--shard",
            "ddp",
            "--reshard-after-forward",
            "false",
        ],
        &["reshard_after_forward", "--shard fsdp2, not ddp"],
    );
    fails(
        &[
            "--dp",
            "8",
            "--shard",
            "fsdp2",
            "--reshard-after-forward",
            "3",
        ],
        &["3 is not a world size", "divide --dp 8"],
    );
    fails(
        &[
            "--dp",
            "8",
            "--shard",
            "fsdp2",
            "--reshard-after-forward",
            "8",
        ],
        &["below it", "--reshard-after-forward true"],
    );
    fails(
        &[
            "--dp",
            "8",
            "--shard",
            "fsdp2",
            "--reshard-after-forward",
            "0",
        ],
        &["0 is not a world size"],
    );
    fails(
        &[
            "--dp",
            "8",
            "--shard",
            "fsdp2",
            "--reshard-after-forward",
            "yes",
        ],
        &["true, false, N"],
    );
    fails(
        &["--offload", "params", "--dp", "2", "--shard", "zero2"],
        &["--offload params", "--shard zero3 or fsdp2", "not zero2"],
    );
    fails(
        &["--dp", "2", "--shard", "fsdp2", "--ddp-bucket-view"],
        &["gradient_as_bucket_view", "--shard ddp"],
    );
    fails(
        &["--dp", "2", "--shard", "ddp", "--fsdp-param-dtype", "bf16"],
        &["MixedPrecisionPolicy", "--shard fsdp2"],
    );
    fails(
        &[
            "--dp",
            "2",
            "--shard",
            "fsdp2",
            "--fsdp-reduce-dtype",
            "int8",
        ],
        &["valid values are fp32, bf16, fp16"],
    );
    fails(
        &[
            "--dp",
            "2",
            "--shard",
            "fsdp2",
            "--fsdp-param-dtype",
            "bf16",
            "--precision",
            "amp-bf16",
        ],
        &["autocast"],
    );
    fails(
        &["--dp", "2", "--shard", "ddp", "--inference"],
        &["--inference"],
    );
    common::assert_fails(
        &[
            "recommend",
            "--model",
            "gpt2",
            "--global-batch",
            "8",
            "--dp",
            "4",
            "--shard",
            "ddp",
        ],
        &["give --gpus N to search parallel layouts"],
    );
}

/// max-batch and whatif take the layout through predict's options: Llama-2-7B in fp32 with AdamW
/// cannot fit one 80 GB GPU (16 B per parameter of model states alone), while FSDP2 over 8 ranks
/// (2 + 14 B per parameter spread over 8 ranks, plus the unsharded blocks) leaves room for a batch;
/// the effective batch counts every rank.
/// Fine-tuning under --tp with data parallelism (Megatron-Bridge's LoRA with Megatron-core's DDP
/// or distributed optimizer, or FSDP2): one role for every rank, and LoRA's rank holds less than
/// full training's in the same layout (its gradients, buckets and optimizer state are the
/// adapters' only).
#[test]
fn finetuning_under_tp_with_data_parallelism() {
    let base = [
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--precision",
        "bf16",
        "--tp",
        "2",
        "--dp",
        "2",
    ];
    for shard in ["ddp", "zero1", "zero2", "zero1-torch", "fsdp2"] {
        let run = |extra: &[&str]| {
            let mut all = base.to_vec();
            all.extend(["--shard", shard]);
            all.extend_from_slice(extra);
            json(&all)
        };
        let lora = run(&["--lora", "r=8,targets=c_attn"]);
        let full = run(&[]);
        let ranks = lora["ranks"].as_array().expect("ranks");
        assert_eq!(ranks.len(), 1, "{shard}: {lora}");
        assert_eq!(
            ranks[0]["ranks"],
            serde_json::json!([0, 1, 2, 3]),
            "{shard}"
        );
        assert_eq!(lora["layout"]["world_size"], 4);
        let peak = |d: &Value| d["peak_allocated_bytes"].as_u64().unwrap();
        assert!(peak(&lora) < peak(&full), "{shard}: {lora} vs {full}");
    }
}

/// The data-parallel traffic of LoRA under --tp by the ring rules (`commtime.rs`'s table), by
/// hand: GPT-2 at tp 2 with `c_attn` adapters of r 8 holds per rank Ψ = 12 × (8/2·768 +
/// 3·768/2·8) = 147,456 trainable elements (Megatron-Bridge's column-parallel split) in bf16.
/// DDP all-reduces only them, `2(n−1)/n·2Ψ` over n = 4; FSDP2 reduce-scatters only them,
/// `(n−1)/n·2Ψ`, but all-gathers every shard, frozen ones too, in forward and backward:
/// `2(n−1)/n·2Ψ_all`.
#[test]
fn finetuning_data_parallel_traffic_is_the_trainable_gradients() {
    use vramsim_api::commtime::CommWork;
    use vramsim_models::{finetune::LoraConfig, zoo, Precision, Recipe, Shard};
    let psi = 12.0 * (8.0 / 2.0 * 768.0 + 3.0 * 768.0 / 2.0 * 8.0);
    assert_eq!(psi, 147_456.0);
    let n = 4.0;
    for shard in [Shard::Ddp, Shard::Fsdp2] {
        let mut r = Recipe::new(2, 128);
        r.precision = Precision::Bf16;
        r.parallel.tp = 2;
        r.parallel.dp = 4;
        r.parallel.shard = shard;
        r.lora = Some("r=8,targets=c_attn".parse::<LoraConfig>().unwrap());
        let g = zoo::build("gpt2", &r).unwrap();
        let all: f64 = g
            .params
            .iter()
            .map(|p| p.shape.iter().product::<u64>() as f64)
            .sum();
        let w = CommWork::of(&g, &r);
        let expect = match shard {
            Shard::Ddp => 2.0 * (n - 1.0) / n * 2.0 * psi,
            _ => 2.0 * (n - 1.0) / n * 2.0 * all + (n - 1.0) / n * 2.0 * psi,
        };
        assert!(
            (w.dp_overlapped - expect).abs() < 1e-6 * expect,
            "{shard}: {} vs {expect}",
            w.dp_overlapped
        );
        assert_eq!(w.dp_exposed, 0.0, "{shard}");
    }
}

#[test]
fn max_batch_and_whatif_take_the_layout() {
    let single = common::vramsim(&["max-batch", "--model", "llama2-7b", "--seq", "512"]);
    assert_eq!(single.status.code(), Some(2));
    assert!(common::stderr(&single).contains("even batch 1 does not fit"));
    let doc = json(&[
        "max-batch",
        "--model",
        "llama2-7b",
        "--seq",
        "512",
        "--dp",
        "8",
        "--shard",
        "fsdp2",
        "--fsdp-param-dtype",
        "bf16",
        "--fsdp-reduce-dtype",
        "fp32",
    ]);
    let b = doc["max_batch"].as_u64().unwrap();
    assert!(b >= 1, "{doc}");
    assert_eq!(doc["effective_batch"].as_u64(), Some(8 * b));
    let rows = json(&[
        "whatif",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--precision",
        "bf16",
        "--dp",
        "4",
        "--vary",
        "shard=ddp,zero1,zero2,fsdp2",
    ]);
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 4);
    for r in rows {
        assert_eq!(r["effective_batch"], 8, "{r}");
        assert_eq!(r["ranks"][0]["ranks"], serde_json::json!([0, 1, 2, 3]));
    }
    // The ranks of a tensor-parallel group share their samples: the effective batch counts the
    // data-parallel ranks only, the ranks list every rank.
    let rows = json(&[
        "whatif",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--precision",
        "bf16",
        "--dp",
        "2",
        "--shard",
        "ddp",
        "--vary",
        "tp=1,2,4",
    ]);
    for r in rows.as_array().unwrap() {
        let tp = r["ranks"][0]["ranks"].as_array().unwrap().len() / 2;
        assert_eq!(r["effective_batch"], 4, "{r}");
        assert!([1, 2, 4].contains(&tp), "{r}");
    }
}

/// NCCL's buffers sit outside the caching allocator: a DDP rank's device used exceeds the same
/// step's with `--nccl-memory 0` by 32 channels × (10 MiB receiver + 2 MiB sender) on an H100
/// (NVIDIA/nccl `p2pRecvSetup`/`p2pSendSetup`: sizeof(ncclRecvMem) 4 KiB + LL 512 KiB + LL128
/// 4,915,200 B + Simple 4 MiB rounded up to CUDA_IPC_MIN 2 MiB; sizeof(ncclSendMem) 4 KiB rounded
/// up to 2 MiB), and leaves reserved alone; 4 channels over PCIe; one GPU has none.
#[test]
fn nccl_buffers_count_in_device_used_only() {
    let run = |extra: &[&str]| {
        let mut a = vec!["predict", "--model", "gpt2", "--batch", "2", "--seq", "128"];
        a.extend_from_slice(extra);
        json(&a)
    };
    let used = |d: &Value| d["peak_device_used_bytes"].as_u64().unwrap();
    let reserved = |d: &Value| d["peak_reserved_bytes"].as_u64().unwrap();
    let channel = 10 * 1024 * 1024 + 2 * 1024 * 1024;
    for (gpu, channels) in [("h100-80gb", 32), ("rtx4090", 4)] {
        let ddp = run(&["--dp", "2", "--shard", "ddp", "--gpu", gpu]);
        let none = run(&[
            "--dp",
            "2",
            "--shard",
            "ddp",
            "--gpu",
            gpu,
            "--nccl-memory",
            "0",
        ]);
        assert_eq!(used(&ddp) - used(&none), channels * channel, "{gpu}");
        assert_eq!(reserved(&ddp), reserved(&none), "{gpu}");
        assert_eq!(ddp["layout"]["nccl"]["bytes"], channels * channel);
    }
    let single = run(&[]);
    let single0 = run(&["--nccl-memory", "1GiB"]);
    assert_eq!(used(&single), used(&single0));
}

/// `--plot` on a layout draws the worst role's step and, beside it, a bar per role; DataParallel's
/// device 0 (module, gradients, optimizer, gathered outputs) is the worst.
#[test]
fn plot_draws_a_bar_per_role() {
    let dir = std::env::temp_dir().join(format!("vramsim-roles-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("step.svg");
    let p = path.to_str().unwrap();
    succeeds(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "4",
        "--seq",
        "128",
        "--dp",
        "2",
        "--shard",
        "dataparallel",
        "--plot",
        p,
    ]);
    let bars = std::fs::read_to_string(dir.join("step-roles.svg")).unwrap();
    assert!(bars.contains("device 0 (module"), "{bars}");
    assert!(bars.contains("replica (parameter and buffer copies"));
    let timeline = std::fs::read_to_string(&path).unwrap();
    assert!(timeline.contains("gpt2"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The step-time model's communication term, by hand from ring collectives (nccl-tests'
/// bus-bandwidth convention): ZeRO-2 reduce-scatters the gradients every micro-batch and all-gathers
/// the bf16 parameters after the step, `(accum + 1) · (n−1)/n · 2Ψ` bytes, none of it overlapped;
/// 8 ranks fit in one H100 node (NVLink 900 GB/s both ways: 450 GB/s per direction), 64 do not
/// (one 400 Gb/s NIC per GPU: 50 GB/s).
#[test]
fn zero2_communication_is_priced_at_the_links() {
    for (dp, accum, gbs) in [(8u32, 1u32, 450.0), (8, 3, 450.0), (64, 1, 50.0)] {
        let rows = json(&[
            "whatif",
            "--model",
            "gpt2",
            "--batch",
            "2",
            "--seq",
            "128",
            "--precision",
            "bf16",
            "--shard",
            "zero2",
            "--dp",
            &dp.to_string(),
            "--vary",
            &format!("accum={accum}"),
        ]);
        let row = &rows[0];
        let psi = row["trainable_params"].as_u64().unwrap() as f64;
        let n = f64::from(dp);
        let bytes = f64::from(accum + 1) * (n - 1.0) / n * 2.0 * psi;
        let expected_ms = bytes / (gbs * 1e9) * 1e3;
        let got = row["step_time"]["comm_ms"].as_f64().unwrap();
        assert!(
            (got - expected_ms).abs() < 1e-9 * expected_ms.max(1.0),
            "dp {dp} accum {accum}: {got} ms, by hand {expected_ms} ms"
        );
    }
}

/// `--offload` and `--reshard-after-forward` reach the per-rank report: ZeRO-Offload and FSDP2's
/// CPUOffloadPolicy leave no optimizer state on the GPU (the latter also lowers GPT-2's peak,
/// ZeRO-Offload what stays allocated between steps); keeping the blocks
/// unsharded after forward raises it; the layout names both options.
#[test]
fn offload_and_reshard_after_forward_change_the_rank() {
    let base = [
        "predict", "--model", "gpt2", "--batch", "2", "--seq", "128", "--dp", "8",
    ];
    let run = |extra: &[&str]| {
        let mut all = base.to_vec();
        all.extend_from_slice(extra);
        json(&all)
    };
    let zero = ["--shard", "zero2", "--precision", "bf16"];
    let plain = run(&zero);
    let off = run(&[&zero[..], &["--offload", "optimizer"]].concat());
    assert_eq!(off["layout"]["offload"], "optimizer");
    assert!(
        off["ranks"][0]["by_category"]["optimizer_state"].is_null(),
        "{off}"
    );
    // Between steps the fp32 master partition and Adam's moments are gone from the GPU (the
    // peak need not drop: the boundary's overflow check of a whole gradient is GPU work).
    assert!(
        off["final_allocated_bytes"].as_u64() < plain["final_allocated_bytes"].as_u64(),
        "{off}"
    );
    let fsdp = run(&["--shard", "fsdp2"]);
    let off = run(&["--shard", "fsdp2", "--offload", "params"]);
    assert_eq!(off["layout"]["offload"], "params");
    assert!(
        off["ranks"][0]["by_category"]["optimizer_state"].is_null(),
        "{off}"
    );
    assert!(off["peak_allocated_bytes"].as_u64() < fsdp["peak_allocated_bytes"].as_u64());
    let kept = run(&["--shard", "fsdp2", "--reshard-after-forward", "false"]);
    assert_eq!(kept["layout"]["reshard_after_forward"], "false");
    assert!(kept["peak_allocated_bytes"].as_u64() > fsdp["peak_allocated_bytes"].as_u64());
    let half = run(&["--shard", "fsdp2", "--reshard-after-forward", "4"]);
    assert_eq!(half["layout"]["reshard_after_forward"], "4");
    assert!(half["peak_allocated_bytes"].as_u64() > fsdp["peak_allocated_bytes"].as_u64());
    assert!(half["peak_allocated_bytes"].as_u64() < kept["peak_allocated_bytes"].as_u64());
}

/// The new sharding modes run with one rank (and report it), as every layout must.
#[test]
fn zero3_and_zero_redundancy_run_with_one_rank() {
    for (shard, role) in [
        ("zero3", "ZeRO-3"),
        ("zero1-torch", "ZeroRedundancyOptimizer"),
    ] {
        let doc = json(&[
            "predict",
            "--model",
            "gpt2",
            "--batch",
            "1",
            "--seq",
            "64",
            "--precision",
            "bf16",
            "--dp",
            "1",
            "--shard",
            shard,
        ]);
        assert_eq!(doc["layout"]["shard"], shard, "{doc}");
        assert_eq!(doc["layout"]["world_size"], 1, "{doc}");
        let ranks = doc["ranks"].as_array().expect("ranks");
        assert_eq!(ranks.len(), 1);
        assert!(ranks[0]["role"].as_str().unwrap().contains(role), "{doc}");
        assert_eq!(ranks[0]["fits"], true, "{doc}");
    }
    // ZeRO-3's CPU offload: the optimizer's states, then the partitions too, leave the GPU.
    let peak = |offload: &str| {
        json(&[
            "predict",
            "--model",
            "gpt2",
            "--batch",
            "1",
            "--seq",
            "64",
            "--precision",
            "bf16",
            "--dp",
            "4",
            "--shard",
            "zero3",
            "--offload",
            offload,
        ])["peak_allocated_bytes"]
            .as_u64()
            .unwrap()
    };
    let (none, optimizer, params) = (peak("none"), peak("optimizer"), peak("params"));
    assert!(
        params < optimizer && optimizer < none,
        "{none} {optimizer} {params}"
    );
    // And over 8 ranks, as whatif varies them.
    let rows = json(&[
        "whatif",
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--precision",
        "bf16",
        "--dp",
        "8",
        "--vary",
        "shard=zero3,zero1-torch",
    ]);
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        assert_eq!(r["ranks"][0]["ranks"].as_array().unwrap().len(), 8, "{r}");
    }
}

/// FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)` on an fp32 model runs attention in bf16 (the
/// all-gathered parameters and the root's cast inputs are bf16), so PyTorch 2.15 picks cuDNN
/// attention on sm 9.0 (`check_prefer_cudnn_attention`), as it does for a bf16 model.
#[test]
fn fsdp2_param_dtype_decides_the_attention_kernel() {
    let doc = json(&[
        "predict",
        "--model",
        "tinyllama-1.1b",
        "--batch",
        "1",
        "--seq",
        "256",
        "--dp",
        "2",
        "--shard",
        "fsdp2",
        "--fsdp-param-dtype",
        "bf16",
    ]);
    assert_eq!(
        doc["attention"]["kernel"], "sdpa-cudnn",
        "{}",
        doc["attention"]
    );
}

/// `--cp` with `--pp` (torchtitan applies context parallelism inside each pipeline stage): every
/// (stage, cp rank) pair is its own role, whose global ranks follow torchtitan's mesh order
/// `[pp, dp_replicate, dp_shard, cp, tp]` (`ParallelDims`, `parallel_dims.py`): stage `s`, data-
/// parallel rank `d` and cp rank `c` of pp 2 × dp 2 × cp 2 are global rank `s·4 + d·2 + c`.
#[test]
fn pipeline_with_context_parallelism_replays_every_stage_and_cp_rank() {
    let doc = json(&[
        "predict",
        "--model",
        "gpt2",
        "--batch",
        "4",
        "--seq",
        "256",
        "--precision",
        "bf16",
        "--shard",
        "fsdp2",
        "--dp",
        "2",
        "--cp",
        "2",
        "--pp",
        "2",
    ]);
    let ranks: Vec<Vec<u64>> = doc["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect()
        })
        .collect();
    let mut expected = Vec::new();
    for s in 0..2u64 {
        for c in 0..2u64 {
            expected.push((0..2u64).map(|d| s * 4 + d * 2 + c).collect::<Vec<_>>());
        }
    }
    assert_eq!(ranks, expected);
    assert_eq!(doc["pipeline"]["pp"], 2);
    assert_eq!(doc["context_parallel"]["seq_per_rank"], 128);
    assert_eq!(doc["context_parallel"]["fsdp_shards"], 4);
}

/// QLoRA under DDP (`accelerate`/HF Trainer's default on several GPUs), by hand: TinyLlama's
/// default PEFT adapters (`q_proj` 2048 → 2048, `v_proj` 2048 → 256, r 8, 22 layers, float32)
/// are Ψa = 1,126,400 trainable elements, the only parameters `_build_params_for_reducer` buckets
/// (the Params4bit weights are frozen): 4Ψa bytes of communication buffers per rank at the peak,
/// every rank one role, and each rank holds what one GPU holds of the quantized model.
#[test]
fn qlora_under_ddp_is_one_role_with_the_adapters_buckets() {
    let base = [
        "predict",
        "--model",
        "tinyllama-1.1b",
        "--seq",
        "512",
        "--batch",
        "4",
        "--precision",
        "bf16",
        "--quant",
        "nf4",
        "--lora",
        "r=8",
    ];
    let mut ddp = base.to_vec();
    ddp.extend(["--dp", "2", "--shard", "ddp"]);
    let d = json(&ddp);
    let one = json(&base);
    let ranks = d["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 1, "{d}");
    assert_eq!(ranks[0]["ranks"], serde_json::json!([0, 1]));
    let at_peak = |d: &Value, c: &str| d["allocated_by_category_at_peak_bytes"][c].as_u64();
    assert_eq!(at_peak(&d, "communication"), Some(4 * 1_126_400));
    assert_eq!(at_peak(&d, "parameter"), at_peak(&one, "parameter"));
    assert_eq!(d["trainable_params"].as_u64(), Some(1_126_400));
}

/// DeepSpeed's fp16 mode runs under every ZeRO stage, and its rank holds what the bf16 mode's
/// does plus the overflow check's temporaries: a peak no lower than bf16's. Its fp32 mode (no
/// bf16/fp16 section) runs too, with fp32 parameters, gradients and IPG buffer: a higher peak.
#[test]
fn deepspeed_fp16_mode_runs_under_zero() {
    for shard in ["zero1", "zero2", "zero3"] {
        let peak = |precision: &str| {
            let doc = json(&[
                "predict",
                "--model",
                "gpt2",
                "--batch",
                "1",
                "--seq",
                "64",
                "--precision",
                precision,
                "--dp",
                "2",
                "--shard",
                shard,
            ]);
            assert_eq!(doc["layout"]["shard"], shard, "{doc}");
            doc["ranks"][0]["peak_allocated_bytes"]
                .as_u64()
                .unwrap_or_else(|| panic!("{doc}"))
        };
        assert!(peak("fp16") >= peak("bf16"), "{shard}");
        assert!(peak("fp32") > peak("bf16"), "{shard}");
    }
}

/// FSDP-QLoRA on the command line (`--quant nf4 --quant-storage bf16 --shard fsdp2`), by hand:
/// TinyLlama's PEFT adapters (Ψa = 1,126,400 float32 elements) are the only parameters with
/// optimizer state, AdamW's two float32 moments of a rank's half (`fully_shard` over 2 ranks:
/// every adapter's dim 0 is even), 4Ψa bytes per rank; the ranks are one role; the recipe echoes
/// the storage. A bad `--quant-storage` lists the valid ones (exit 2).
#[test]
fn fsdp_qlora_is_one_role_with_half_the_adapters_state() {
    let base = [
        "predict",
        "--model",
        "tinyllama-1.1b",
        "--seq",
        "512",
        "--batch",
        "4",
        "--precision",
        "bf16",
        "--quant",
        "nf4",
        "--lora",
        "r=8",
        "--dp",
        "2",
        "--shard",
        "fsdp2",
    ];
    let mut args = base.to_vec();
    args.extend(["--quant-storage", "bf16"]);
    let d = json(&args);
    let ranks = d["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 1, "{d}");
    assert_eq!(ranks[0]["ranks"], serde_json::json!([0, 1]));
    assert_eq!(d["recipe"]["quant_storage"], "bf16");
    assert_eq!(
        d["allocated_by_category_at_peak_bytes"]["optimizer_state"].as_u64(),
        Some(4 * 1_126_400)
    );
    let mut bad = base.to_vec();
    bad.extend(["--quant-storage", "int4"]);
    common::assert_fails(&bad, &["int4", "uint8, bf16, fp16, fp32"]);
    // The default uint8 codes stay whole on every rank (accelerate's `ignored_params`): the
    // parameters at the peak exceed the bf16-stored shards'.
    let u = json(&base);
    assert_eq!(u["recipe"]["quant_storage"], "uint8");
    let params = |d: &Value| d["allocated_by_category_at_peak_bytes"]["parameter"].as_u64();
    assert!(params(&u) > params(&d), "{u}");
}

/// ZeRO-3 QLoRA (`--quant nf4 --quant-storage bf16 --lora r=8 --dp 2 --shard zero3`): one role;
/// the engine casts PEFT's float32 adapters of the non-`zero.Init` quantized model to bf16, so the
/// optimizer states are the stage-3 optimizer's fp32 master and Adam moments of the bf16 adapters'
/// partitions, 12 bytes × Ψa/2 (Ψa = 22 × 8 × (2048 + 2048 + 2048 + 256) = 1,126,400, every
/// adapter even-sized). LLM.int8 and codes stored in a float dtype other than the mode's are
/// refused with the reason.
#[test]
fn zero3_qlora_is_one_role_with_the_bf16_adapters_master_and_moments() {
    let base = [
        "predict",
        "--model",
        "tinyllama-1.1b",
        "--seq",
        "512",
        "--batch",
        "4",
        "--precision",
        "bf16",
        "--lora",
        "r=8",
        "--dp",
        "2",
        "--shard",
        "zero3",
    ];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        args
    };
    let d = json(&with(&["--quant", "nf4", "--quant-storage", "bf16"]));
    let ranks = d["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 1, "{d}");
    assert_eq!(ranks[0]["ranks"], serde_json::json!([0, 1]));
    assert_eq!(
        d["allocated_by_category_at_peak_bytes"]["optimizer_state"].as_u64(),
        Some(12 * 1_126_400 / 2)
    );
    common::assert_fails(
        &with(&["--quant", "int8"]),
        &["--quant int8 with --shard zero3", "Int8Params", "self.CB"],
    );
    common::assert_fails(
        &with(&["--quant", "nf4", "--quant-storage", "fp32"]),
        &["_cast_module_mixed_precision", "give --quant-storage bf16"],
    );
}
