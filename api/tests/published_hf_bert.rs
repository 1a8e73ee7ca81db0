//! The HuggingFace guide "Efficient Training on a Single GPU" (transformers
//! `docs/source/en/perf_train_gpu_one.mdx`, runs of about 2022-01-11; rows copied to
//! `models/tests/published/hf_bert_large_v100.csv`) against `vramsim predict`.
//!
//! The runs: HF `Trainer` (transformers ≈ 4.16, its default `optim="adamw_hf"`, `max_grad_norm=1.0`,
//! `model.zero_grad()` with PyTorch 1.10's `set_to_none=False`), PyTorch 1.10 on a Tesla
//! V100-SXM2-16GB (driver 460.91.03, CUDA 11.2), `AutoModelForSequenceClassification` of
//! `bert-large-uncased` (two labels) on 512 random sequences of 512 tokens, one epoch; fp16 is native
//! AMP with a GradScaler, gradient checkpointing is transformers 4.16's `torch.utils.checkpoint`
//! call, reentrant (the only kind in PyTorch 1.10). The figure is NVML's used memory (MiB, floored)
//! after `trainer.train()` returns: the CUDA context plus everything the caching allocator still
//! reserves (nothing calls `empty_cache`) plus what cuBLAS allocated itself. vramsim's counterpart
//! is `peak_device_used_bytes`: reserved memory never shrinks in these steps, so the peak is the
//! end, and the lowering adds cuBLAS's own pools to the context under `--torch-version 1.10`.
//! `--transformers-version 4.16` gives BERT the all-ones float32 extended attention mask 4.16 adds
//! to the scores when no mask is passed.
//!
//! Each describable row must be within 5% of the published figure, except the known misses listed
//! in `KNOWN_MISSES` with the mechanism vramsim lacks; the two 8-bit Adam rows (bitsandbytes
//! `Adam8bit`) are not describable (no 8-bit optimizer yet).

mod common;
use common::{stderr, stdout, vramsim};

/// Rows vramsim misses by more than 5%, with the likely missing mechanism (none at present; H5
/// was one, at −8.9%, until `--transformers-version 4.16` gave BERT its float32 all-ones mask).
const KNOWN_MISSES: [(&str, &str); 0] = [];

/// One CSV line, with double-quoted fields that may hold commas.
fn fields(line: &str) -> Vec<String> {
    let (mut out, mut cur, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    out.push(cur);
    out
}

#[test]
fn hf_guide_bert_large_v100_within_5_percent() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/published/hf_bert_large_v100.csv");
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    let header = fields(lines.next().unwrap());
    let col = |name: &str| header.iter().position(|h| h == name).unwrap();
    let mut table = Vec::new();
    let mut failures = Vec::new();
    let mut described = 0;
    for line in lines {
        let f = fields(line);
        let row = f[col("row")].as_str();
        let published: f64 = f[col("published_mib")].parse().unwrap();
        let optimizer = match f[col("optimizer")].as_str() {
            "adamw_hf" => "adamw-hf",
            "adafactor" => "adafactor-hf",
            "bnb_adam8bit" => {
                table.push(format!(
                    "| {row} | {published} | not describable (8-bit Adam) |"
                ));
                continue;
            }
            other => panic!("unknown optimizer {other}"),
        };
        let (batch, accum) = (&f[col("batch")], &f[col("accum")]);
        let precision = match f[col("precision")].as_str() {
            "fp16" => "amp-fp16",
            other => other,
        };
        let mut args = vec![
            "predict",
            "--model",
            "bert-large",
            "--head",
            "seq-cls:2",
            "--seq",
            "512",
            "--gpu",
            "v100-16gb",
            "--cuda",
            "11",
            "--torch-version",
            "1.10",
            "--transformers-version",
            "4.16",
            "--zero-grad",
            "zero",
            "--clip-grad-norm",
            "1.0",
            "--attention",
            "eager",
            "--optimizer",
            optimizer,
            "--precision",
            precision,
            "--batch",
            batch,
            "--accum",
            accum,
            "--json",
        ];
        if f[col("gradient_checkpointing")] == "true" {
            args.extend(["--checkpoint", "full", "--checkpoint-impl", "reentrant"]);
        }
        let out = vramsim(&args);
        assert!(out.status.success(), "{row}: {}", stderr(&out));
        let j: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        // Reserved memory never shrinks here: the end of training is the peak.
        assert_eq!(j["final_reserved_bytes"], j["peak_reserved_bytes"], "{row}");
        let predicted = j["peak_device_used_bytes"].as_u64().unwrap() as f64 / 1048576.0;
        let err = (predicted - published) / published * 100.0;
        described += 1;
        table.push(format!(
            "| {row} | {published} | {predicted:.0} | {err:+.2}% |"
        ));
        let known = KNOWN_MISSES.iter().find(|(r, _)| *r == row);
        match known {
            Some((_, why)) => {
                assert!(
                    err.abs() > 5.0,
                    "{row} is within 5% ({err:+.2}%): take it off KNOWN_MISSES"
                );
                table.push(format!("|   | known miss: {why} | | |"));
            }
            None if err.abs() > 5.0 => failures.push(format!("{row}: {err:+.2}%")),
            None => {}
        }
    }
    println!("| row | published MiB | predicted MiB | error |\n| --- | ---: | ---: | ---: |");
    for t in &table {
        println!("{t}");
    }
    assert_eq!(described, 7);
    assert!(failures.is_empty(), "outside 5%: {failures:?}");
}
