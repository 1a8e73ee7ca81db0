//! The library and the command line are one: each command's function, given the command line's
//! arguments through `parse_args`, returns the document the binary prints with `--json` (less the
//! wall-clock timings), and a bad option is the same message.

mod common;
use common::{json, stderr, vramsim};

use serde_json::Value;
use vramsim_api::{maxbatch, parse_args, predict, recommend, whatif};

/// `doc` without the wall-clock figures two runs may disagree on.
fn untimed(mut doc: Value) -> Value {
    match &mut doc {
        Value::Array(items) => {
            for item in items {
                *item = untimed(item.take());
            }
        }
        Value::Object(map) => {
            map.remove("timing");
            map.remove("seconds");
            if let Some(recipes) = map.get_mut("recipes") {
                *recipes = untimed(recipes.take());
            }
        }
        _ => {}
    }
    doc
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

#[test]
fn predict_is_the_command_lines_json() {
    let args = [
        "--model",
        "gpt2",
        "--batch",
        "2",
        "--seq",
        "128",
        "--precision",
        "amp-bf16",
        "--gpu",
        "rtx4090",
    ];
    let options: predict::PredictArgs = parse_args("predict", &strings(&args)).unwrap();
    let library = predict::predict(&options).unwrap().to_json();
    let mut cli = vec!["predict"];
    cli.extend(args);
    assert_eq!(untimed(library), untimed(json(&cli)));
}

#[test]
fn sweeps_are_the_command_lines_json() {
    let args = [
        "--model",
        "mlp",
        "--batch",
        "4",
        "--vary",
        "precision=fp32,bf16",
    ];
    let options: whatif::WhatifArgs = parse_args("whatif", &strings(&args)).unwrap();
    let library = whatif::whatif(&options, true, |_| vramsim_api::sweep::Progress::hidden())
        .unwrap()
        .to_json();
    let mut cli = vec!["whatif"];
    cli.extend(args);
    assert_eq!(untimed(library), untimed(json(&cli)));

    let args = ["--model", "mlp", "--capacity", "1GiB", "--limit", "4096"];
    let options: maxbatch::MaxBatchArgs = parse_args("max-batch", &strings(&args)).unwrap();
    let library = maxbatch::max_batch(&options).unwrap().to_json();
    let mut cli = vec!["max-batch"];
    cli.extend(args);
    assert_eq!(untimed(library), untimed(json(&cli)));

    let args = [
        "--model",
        "mlp",
        "--global-batch",
        "8",
        "--capacity",
        "1GiB",
    ];
    let options: recommend::RecommendArgs = parse_args("recommend", &strings(&args)).unwrap();
    let library = recommend::recommend(&options).unwrap().to_json();
    let mut cli = vec!["recommend"];
    cli.extend(args);
    assert_eq!(untimed(library), untimed(json(&cli)));
}

#[test]
fn defaults_and_errors_are_the_command_lines() {
    let options: predict::PredictArgs =
        parse_args("predict", &strings(&["--model=gpt2", "--batch=1"])).unwrap();
    assert_eq!(options.precision.to_string(), "fp32");
    assert_eq!(options.accum, 1);
    assert_eq!(options.iterations, 2);
    assert_eq!(options.machine.alloc_conf, "");

    let bad = ["--model", "gpt2", "--batch", "1", "--precision", "fp64"];
    let Err(error) = parse_args::<predict::PredictArgs>("predict", &strings(&bad)) else {
        panic!("fp64 is refused");
    };
    let mut cli = vec!["predict"];
    cli.extend(bad);
    let output = vramsim(&cli);
    assert_eq!(output.status.code(), Some(2));
    let message = format!("{error:#}");
    assert!(
        stderr(&output).contains(&message),
        "{message:?} not in {:?}",
        stderr(&output)
    );
}
