//! `TorchVersion::V1_10` (`--torch-version 1.10`) against counts derived by hand from PyTorch 1.10's
//! rules: `_softmax`/`_log_softmax` save their input besides the result (derivatives.yaml
//! `_softmax_backward_data(grad, result, dim, self)`, pytorch/pytorch#64000), and GEMMs take no
//! workspace from the caching allocator (cuBLAS uses its own default pool per handle).

use std::collections::HashMap;
use vramsim_models::*;
use vramsim_traces::{AllocId, Category, Event, Trace};

/// Requested bytes live when the first `backward` marker is reached.
fn live_at_first_backward(t: &Trace) -> u64 {
    let mut live: HashMap<&AllocId, u64> = HashMap::new();
    for e in &t.events {
        match e {
            Event::Phase { name } if &**name == "backward" => break,
            Event::Alloc { id, size, .. } => {
                live.insert(id, *size);
            }
            Event::Free { id } => {
                live.remove(id);
            }
            _ => {}
        }
    }
    live.values().sum()
}

fn bert(version: TorchVersion) -> Trace {
    let mut r = Recipe::new(2, 128);
    r.attention = Attention::Eager;
    r.head = Some("seq-cls:2".parse().unwrap());
    r.torch_version = version;
    r.target = Target {
        compute_capability: (7, 0),
    };
    lower(&zoo::build("bert-base", &r).unwrap(), &r).unwrap()
}

#[test]
fn softmax_keeps_its_input_and_gemms_take_no_allocator_workspace() {
    let new = bert(TorchVersion::V2_15);
    let old = bert(TorchVersion::V1_10);
    // At the end of the forward, 1.10 holds in addition, per layer, the softmax input: the scaled
    // scores [2, 12, 128, 128] float32 (in 2.15 they die once softmax has read them: `* scaling`
    // by a Python float saves nothing), and the logits [2, 2] float32 that log_softmax read (in 2.15
    // they die with the model's output object when the forward returns). Workspaces are freed by
    // then in both.
    let scores = 2 * 12 * 128 * 128 * 4;
    let logits = 2 * 2 * 4;
    assert_eq!(
        live_at_first_backward(&old) - live_at_first_backward(&new),
        12 * scores + logits
    );
    // No cuBLAS/cuBLASLt workspace from the allocator; two handles (the forward's thread and the
    // autograd engine's device thread) with cuBLAS's default 4 MiB pool each (sm 7.0).
    let workspaces = |t: &Trace| {
        t.events
            .iter()
            .filter(
                |e| matches!(e, Event::Alloc { category, .. } if *category == Category::Workspace),
            )
            .count()
    };
    assert!(workspaces(&new) > 0);
    assert_eq!(workspaces(&old), 0);
    assert_eq!(old.meta["cublas_own_bytes"], 2 * 4 * 1048576);
    assert!(new.meta.get("cublas_own_bytes").is_none());
    // A bad version is an error listing the choices.
    let e = "1.9".parse::<TorchVersion>().unwrap_err().to_string();
    assert!(e.contains("2.15, 1.10"), "{e}");
}
