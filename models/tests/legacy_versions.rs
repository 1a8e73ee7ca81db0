//! `TorchVersion::V1_10` (`--torch-version 1.10`) and `TransformersVersion::V4_16`
//! (`--transformers-version 4.16`) against counts derived by hand from those releases' rules:
//! `_softmax`/`_log_softmax` save their input besides the result (derivatives.yaml
//! `_softmax_backward_data(grad, result, dim, self)`, pytorch/pytorch#64000), GEMMs take no
//! workspace from the caching allocator (cuBLAS uses its own default pool per handle), and BERT adds
//! an all-ones float32 extended attention mask to its scores.

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
    bert_with(version, TransformersVersion::V5_23, Precision::Fp32)
}

fn bert_with(version: TorchVersion, hf: TransformersVersion, precision: Precision) -> Trace {
    let mut r = Recipe::new(2, 128);
    r.transformers_version = hf;
    r.precision = precision;
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
    // autograd engine's device thread) with cuBLAS's default pool each, `:4096:2:16:8` (sm 7.0).
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
    assert_eq!(
        old.meta["cublas_own_bytes"],
        2 * (4096 * 1024 * 2 + 16 * 1024 * 8)
    );
    assert!(new.meta.get("cublas_own_bytes").is_none());
    // A bad version is an error listing the choices.
    let e = "1.9".parse::<TorchVersion>().unwrap_err().to_string();
    assert!(e.contains("2.15, 1.10"), "{e}");
}

#[test]
fn transformers_4_16_bert_adds_a_float32_all_ones_mask() {
    use TransformersVersion::{V4_16, V5_23};
    let allocs = |t: &Trace| -> Vec<u64> {
        t.events
            .iter()
            .filter_map(|e| match e {
                Event::Alloc { size, .. } => Some(*size),
                _ => None,
            })
            .collect()
    };
    // fp32: `torch.ones((2, 128))` (1,024 B), `1.0 - m` and `* -10000.0` ([2, 1, 1, 128], 1,024 B
    // each) once per forward, and per layer the `scores + mask` result [2, 12, 128, 128] float32.
    let new = bert_with(TorchVersion::V2_15, V5_23, Precision::Fp32);
    let old = bert_with(TorchVersion::V2_15, V4_16, Precision::Fp32);
    let forwards: u64 = 2; // two iterations of one micro-batch
    assert_eq!(
        (allocs(&old).len() - allocs(&new).len()) as u64,
        forwards * (3 + 12)
    );
    assert_eq!(
        allocs(&old).iter().sum::<u64>() - allocs(&new).iter().sum::<u64>(),
        forwards * (3 * 1024 + 12 * 2 * 12 * 128 * 128 * 4)
    );
    // float16 autocast under PyTorch 1.10: the float32 mask promotes the float16 scores, so the
    // softmax input that 1.10 saves is float32 [2, 12, 128, 128] instead of float16: 786,432 B more
    // per layer at the end of the forward (the mask itself is a local of BertModel.forward, gone).
    let new = bert_with(TorchVersion::V1_10, V5_23, Precision::AmpFp16);
    let old = bert_with(TorchVersion::V1_10, V4_16, Precision::AmpFp16);
    assert_eq!(
        live_at_first_backward(&old) - live_at_first_backward(&new),
        12 * 2 * 12 * 128 * 128 * 2
    );
    let e = "4.15"
        .parse::<TransformersVersion>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("5.23, 4.16"), "{e}");
}
