//! `--graph FILE` (a module captured by `vramsim.from_module`) through the library's commands: the
//! torchvision ResNet-18 captured on the meta device predicts what the zoo's `resnet18` predicts, and
//! what-ifs apply to it.

use vramsim_api::{maxbatch, parse_args, predict};

fn graph() -> String {
    format!(
        "{}/../models/tests/imported/resnet18.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn args(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn a_captured_resnet18_predicts_as_the_zoo_model() {
    let g = graph();
    for extra in [
        &["--precision", "fp32"][..],
        &["--precision", "amp-bf16", "--accum", "2"][..],
        &["--precision", "bf16", "--optimizer", "sgd-momentum"][..],
    ] {
        let mut a = args(&["--batch", "24", "--gpu", "a100-80gb"]);
        a.extend(args(extra));
        let mut zoo = a.clone();
        zoo.extend(args(&["--model", "resnet18"]));
        let mut ours = a.clone();
        ours.extend(args(&["--graph", &g]));
        let z = predict::predict(&parse_args::<predict::PredictArgs>("predict", &zoo).unwrap())
            .unwrap();
        let o = predict::predict(&parse_args::<predict::PredictArgs>("predict", &ours).unwrap())
            .unwrap();
        let (z, o) = (z.to_json(), o.to_json());
        for key in [
            "peak_requested_bytes",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
        ] {
            assert_eq!(z[key], o[key], "{key} with {extra:?}");
        }
    }
    let m = args(&["--gpu", "rtx4090", "--precision", "amp-bf16"]);
    let mut zoo = m.clone();
    zoo.extend(args(&["--model", "resnet18"]));
    let mut ours = m;
    ours.extend(args(&["--graph", &g]));
    let z = maxbatch::max_batch(&parse_args("max-batch", &zoo).unwrap()).unwrap();
    let o = maxbatch::max_batch(&parse_args("max-batch", &ours).unwrap()).unwrap();
    assert_eq!(z.to_json()["max_batch"], o.to_json()["max_batch"]);
}

#[test]
fn a_bad_graph_is_an_error_naming_the_file() {
    let a = args(&["--batch", "2", "--graph", "/nonexistent/graph.json"]);
    let Err(e) = predict::predict(&parse_args::<predict::PredictArgs>("predict", &a).unwrap())
    else {
        panic!("a missing graph file was accepted");
    };
    assert!(
        format!("{e:#}").contains("/nonexistent/graph.json"),
        "{e:#}"
    );
}
