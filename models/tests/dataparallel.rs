//! `--shard dataparallel` (`torch.nn.DataParallel`) lowered device by device, against closed forms
//! derived from PyTorch's rules (`torch/nn/parallel/replicate.py`, `scatter_gather.py`,
//! `_functions.py`, `comm.py`, `torch/csrc/cuda/comm.cpp`), never from vramsim's output:
//!
//! * every forward, devices 1..N-1 receive a copy of every parameter (Ψ × 4 B in fp32) and every
//!   buffer, as flat `broadcast_coalesced` groups that close once they reach 10 MiB; device 0
//!   keeps the originals and copies nothing;
//! * a model that returns its loss (transformers' heads with labels) computes it in every replica:
//!   the output device gathers one loss per replica (`Gather.forward` unsqueezes 0-dim outputs);
//! * a training loop whose criterion is outside the model (`loss = criterion(model(x), y)`, the
//!   zoo's torchvision and timm models) gets the model's returned logits gathered on the output
//!   device for the whole batch (`comm.cpp` `gather`: B × classes × 4 B) and runs the criterion
//!   there once, on the whole batch; `Gather.backward` scatters the logits' gradient: a view of it
//!   on the output device, a copy of its chunk on every other device, which holds no criterion
//!   tensor;
//! * `reduce_add_coalesced` flattens every device's gradients (Ψ × 4 B in all) and device 0 gets
//!   the results (Ψ × 4 B), which become `.grad`; the optimizer (AdamW: 2 × Ψ × 4 B of state)
//!   exists on device 0 only;
//! * with one device `DataParallel.forward` calls the module itself: the single-GPU trace.

mod common;
use common::max_live;

use vramsim_models::dataparallel::{chunk_sizes, criterion_split, device_graph, COALESCE_BYTES};
use vramsim_models::{lower, zoo, Graph, Head, LowerError, Parallel, Recipe, Shard};
use vramsim_traces::{Category, Event, Trace};

fn recipe(batch: u64, seq: u64, dp: u32, device: u32) -> Recipe {
    Recipe {
        parallel: Parallel {
            dp,
            shard: Shard::DataParallel,
            device,
            ..Parallel::default()
        },
        ..Recipe::new(batch, seq)
    }
}

/// The trace of `device`: the graph built for its chunk (cut or completed where the loop's
/// criterion is outside the model: `device_graph`), the step for the whole batch.
fn device_trace(name: &str, batch: u64, seq: u64, dp: u32, device: u32) -> (Trace, u64) {
    device_trace_to(name, batch, seq, dp, device, 0)
}

/// [`device_trace`] with the outputs gathered on `output_device`.
fn device_trace_to(
    name: &str,
    batch: u64,
    seq: u64,
    dp: u32,
    device: u32,
    output_device: u32,
) -> (Trace, u64) {
    let mut r = recipe(batch, seq, dp, device);
    r.parallel.output_device = output_device;
    let g = replica(name, &r);
    let psi = g.param_count();
    let g = device_graph(g, &r.parallel, || {
        zoo::build(name, &r).map_err(Box::<dyn std::error::Error>::from)
    })
    .unwrap();
    (lower(&g, &r).unwrap(), psi)
}

/// The model built for `r`'s device's chunk.
fn replica(name: &str, r: &Recipe) -> Graph {
    let mut gr = r.clone();
    gr.batch = r.parallel.replica_batch(r.batch);
    zoo::build(name, &gr).unwrap()
}

/// Sizes of the allocations whose tag starts with `prefix`.
fn tagged(t: &Trace, prefix: &str) -> Vec<u64> {
    t.events
        .iter()
        .filter_map(|e| match e {
            Event::Alloc { size, tag, .. }
                if tag.as_deref().is_some_and(|t| t.starts_with(prefix)) =>
            {
                Some(*size)
            }
            _ => None,
        })
        .collect()
}

#[test]
fn one_device_is_the_single_gpu_step_to_the_byte() {
    for (name, batch, seq) in [("resnet18", 4, 0), ("gpt2", 2, 64)] {
        let single = Recipe::new(batch, seq);
        let g = zoo::build(name, &single).unwrap();
        let a = lower(&g, &single).unwrap();
        let (b, _) = device_trace(name, batch, seq, 1, 0);
        assert_eq!(
            format!("{:?}", a.events),
            format!("{:?}", b.events),
            "{name}"
        );
    }
}

#[test]
fn replicas_hold_a_copy_of_every_parameter_and_buffer() {
    for (name, batch, seq) in [("resnet50", 8, 0), ("gpt2", 4, 64)] {
        for dp in [2, 4] {
            let (t1, psi) = device_trace(name, batch, seq, dp, 1);
            let (t0, _) = device_trace(name, batch, seq, dp, 0);
            let iterations = Recipe::new(batch, seq).iterations as u64;
            // One fp32 copy of every parameter per forward, in groups that close at 10 MiB.
            let groups = tagged(&t1, "dp_replica_params");
            assert_eq!(
                groups.iter().sum::<u64>(),
                iterations * 4 * psi,
                "{name} dp {dp}"
            );
            let per_step = groups.len() / iterations as usize;
            for g in &groups[..per_step - 1] {
                assert!(*g >= COALESCE_BYTES, "{name}: {groups:?}");
            }
            // All of one forward's copies are alive together: Ψ × 4 B of parameters on device 1,
            // which `model.to(device)` never touched.
            assert_eq!(
                max_live(&t1, Category::Parameter),
                4 * psi,
                "{name} dp {dp}"
            );
            // Buffers: every buffer's bytes, as the graph declares them (BatchNorm's running
            // stats and counters; GPT-2's attention masks, if any).
            let g = zoo::build(name, &Recipe::new(batch / dp as u64, seq)).unwrap();
            let buffer_bytes: u64 = g
                .buffers
                .iter()
                .map(|b| {
                    let v = &g.values[b.value.0 as usize];
                    let d = match v.dtype {
                        vramsim_models::DTypeSpec::Model => 4,
                        vramsim_models::DTypeSpec::Fixed(d) => d.size(),
                    };
                    v.shape.iter().product::<u64>() * d
                })
                .sum();
            assert_eq!(
                tagged(&t1, "dp_replica_buffers").iter().sum::<u64>(),
                iterations * buffer_bytes,
                "{name} dp {dp}"
            );
            // Device 0 keeps the originals: no copies, only the flatten temporaries.
            assert!(tagged(&t0, "dp_replica").is_empty());
            assert_eq!(
                tagged(&t0, "dp_broadcast_flat").iter().sum::<u64>(),
                iterations * 4 * psi
            );
        }
    }
}

#[test]
fn output_device_gathers_the_whole_batch_and_optimizer_is_on_device_0_only() {
    let (batch, dp) = (10, 4);
    // torch.chunk(10, 4) = 3, 3, 3, 1: four replicas, the last one smaller.
    assert_eq!(chunk_sizes(batch, dp), vec![3, 3, 3, 1]);
    let (t0, psi) = device_trace("resnet50", batch, 0, dp, 0);
    let iterations = Recipe::new(batch, 0).iterations as usize;
    // The logits of all ten images, fp32, 1000 classes, gathered once per forward; the loop's
    // criterion runs on them, so no per-replica loss is gathered.
    assert_eq!(
        tagged(&t0, "dp_gather:output"),
        vec![batch * 1000 * 4; iterations]
    );
    assert!(tagged(&t0, "dp_gather:loss").is_empty());
    // AdamW's exp_avg and exp_avg_sq, fp32: on device 0 only.
    assert_eq!(max_live(&t0, Category::OptimizerState), 2 * 4 * psi);
    for device in [1, 3] {
        let (t, _) = device_trace("resnet50", batch, 0, dp, device);
        assert_eq!(max_live(&t, Category::OptimizerState), 0, "device {device}");
        assert!(tagged(&t, "dp_gather").is_empty(), "device {device}");
        // Every device flattens its gradients for the reduce; only device 0 gets the results.
        assert_eq!(
            tagged(&t, "dp_reduce_flat").iter().sum::<u64>(),
            iterations as u64 * 4 * psi
        );
        assert!(tagged(&t, "dp_reduce_result").is_empty());
    }
    assert_eq!(
        tagged(&t0, "dp_reduce_result").iter().sum::<u64>(),
        iterations as u64 * 4 * psi
    );
    // `.grad` on device 0 is the reduce results: Ψ × 4 B when the optimizer runs.
    assert_eq!(max_live(&t0, Category::Gradient), 2 * 4 * psi);
}

/// Sizes of the allocations tagged exactly `tag`.
fn tagged_exactly(t: &Trace, tag: &str) -> Vec<u64> {
    t.events
        .iter()
        .filter_map(|e| match e {
            Event::Alloc {
                size, tag: Some(g), ..
            } if &**g == tag => Some(*size),
            _ => None,
        })
        .collect()
}

/// Tags of allocations that contain `part`.
fn tags_containing(t: &Trace, part: &str) -> Vec<(String, u64)> {
    t.events
        .iter()
        .filter_map(|e| match e {
            Event::Alloc { size, tag, .. } if tag.as_deref().is_some_and(|t| t.contains(part)) => {
                Some((tag.as_deref().unwrap_or_default().to_string(), *size))
            }
            _ => None,
        })
        .collect()
}

/// Index of the event that frees the `k`-th allocation tagged `tag`, and of that allocation.
fn alloc_and_free(t: &Trace, tag: &str, k: usize) -> (usize, usize) {
    let (at, id) = t
        .events
        .iter()
        .enumerate()
        .filter_map(|(i, e)| match e {
            Event::Alloc {
                id, tag: Some(g), ..
            } if &**g == tag => Some((i, id.clone())),
            _ => None,
        })
        .nth(k)
        .unwrap_or_else(|| panic!("no allocation {k} tagged {tag}"));
    let free = t.events[at..]
        .iter()
        .position(|e| matches!(e, Event::Free { id: f } if *f == id))
        .expect("freed")
        + at;
    (at, free)
}

/// Index of the first allocation tagged `tag` after event `from`.
fn first_alloc_after(t: &Trace, tag: &str, from: usize) -> usize {
    t.events[from..]
        .iter()
        .position(|e| matches!(e, Event::Alloc { tag: Some(g), .. } if &**g == tag))
        .expect("allocated")
        + from
}

#[test]
fn the_loops_criterion_runs_once_on_the_output_device_over_the_gathered_logits() {
    // torchvision's loop: `output = model(image)` (DataParallel.forward returns
    // `gather(outputs, output_device)`), then `loss = criterion(output, target)` on device 0.
    // ResNet-50, batch 10 on 2 GPUs: chunks 5 and 5; F.cross_entropy = log_softmax (its output,
    // B × 1000 fp32, saved for backward) + nll_loss; its backward: nll_loss_backward's
    // grad_input and _log_softmax_backward_data's output, both B × 1000 fp32, on device 0 only.
    let (batch, dp, classes) = (10u64, 2u32, 1000u64);
    assert_eq!(chunk_sizes(batch, dp), vec![5, 5]);
    let iterations = Recipe::new(batch, 0).iterations as usize;
    let full = batch * classes * 4;
    let chunk = 5 * classes * 4;
    let (t0, _) = device_trace("resnet50", batch, 0, dp, 0);
    let (t1, _) = device_trace("resnet50", batch, 0, dp, 1);
    // Each replica's fc makes its chunk's logits; the output device gathers the whole batch.
    for t in [&t0, &t1] {
        assert_eq!(tagged(t, "fc:aten.addmm"), vec![chunk; iterations]);
    }
    assert_eq!(tagged(&t0, "dp_gather:output"), vec![full; iterations]);
    assert!(tagged(&t1, "dp_gather").is_empty());
    // The criterion, sized for the whole batch, on device 0 only.
    for tag in [
        "aten._log_softmax",
        "aten.nll_loss_backward",
        "aten._log_softmax_backward_data",
    ] {
        assert_eq!(tagged_exactly(&t0, tag), vec![full; iterations], "{tag}");
    }
    assert_eq!(tagged(&t0, "aten.nll_loss_forward").len(), 2 * iterations);
    for part in ["softmax", "nll_loss", "ones_like"] {
        assert!(tags_containing(&t1, part).is_empty(), "device 1: {part}");
    }
    // The targets (int64, the whole batch) are the loop's, on device 0; never scattered.
    assert_eq!(tagged(&t0, "input:labels"), vec![batch * 8; iterations]);
    assert!(tagged(&t1, "input:labels").is_empty());
    // Gather.backward → Scatter: device 1 receives a copy of its chunk of the logits' gradient,
    // device 0 a view of the whole-batch gradient (no copy).
    assert_eq!(
        tagged(&t1, "dp_scatter:grad_output"),
        vec![chunk; iterations]
    );
    assert!(tagged(&t0, "dp_scatter").is_empty());
    for it in 0..iterations {
        // Each lives in the input buffer of the replica's last node (fc's AddmmBackward0) and
        // dies once it has run: after fc.weight's gradient, before the next node (avgpool's
        // MeanBackward0) allocates.
        let (made, freed) = alloc_and_free(&t1, "dp_scatter:grad_output", it);
        assert!(freed > first_alloc_after(&t1, "grad:fc.weight", made));
        assert!(freed < first_alloc_after(&t1, "avgpool:aten.div", made));
        let (made, freed) = alloc_and_free(&t0, "aten._log_softmax_backward_data", it);
        assert!(freed > first_alloc_after(&t0, "grad:fc.weight", made));
        assert!(freed < first_alloc_after(&t0, "avgpool:aten.div", made));
    }
}

#[test]
fn another_output_device_takes_the_criterion_and_device_0_a_chunk_of_the_gradient() {
    let (batch, dp, classes) = (10u64, 2u32, 1000u64);
    let iterations = Recipe::new(batch, 0).iterations as usize;
    let (t0, psi) = device_trace_to("resnet50", batch, 0, dp, 0, 1);
    let (t1, _) = device_trace_to("resnet50", batch, 0, dp, 1, 1);
    assert_eq!(
        tagged(&t1, "dp_gather:output"),
        vec![batch * classes * 4; iterations]
    );
    assert_eq!(
        tagged_exactly(&t1, "aten._log_softmax"),
        vec![batch * classes * 4; iterations]
    );
    assert!(tags_containing(&t0, "softmax").is_empty());
    // The replica's own logits (the `outputs` list of DataParallel.forward, saved by no node)
    // die once gathered, before the loop's criterion runs; the gathered ones die when the
    // criterion has returned (`loss = criterion(output, target)`, as on one GPU).
    for it in 0..iterations {
        let (made, freed) = alloc_and_free(&t1, "fc:aten.addmm", it);
        let gathered = first_alloc_after(&t1, "dp_gather:output", made);
        assert!(gathered < freed && freed < first_alloc_after(&t1, "aten._log_softmax", made));
        let (made, freed) = alloc_and_free(&t1, "dp_gather:output", it);
        assert!(freed > first_alloc_after(&t1, "aten.nll_loss_forward", made));
    }
    assert_eq!(
        tagged(&t0, "dp_scatter:grad_output"),
        vec![5 * classes * 4; iterations]
    );
    // The module, the optimizer and the reduce results stay on device 0.
    assert_eq!(max_live(&t0, Category::OptimizerState), 2 * 4 * psi);
    assert_eq!(max_live(&t1, Category::OptimizerState), 0);
    assert!(tagged(&t1, "dp_reduce_result").is_empty());
}

#[test]
fn a_model_that_returns_its_loss_computes_it_in_every_replica() {
    // GPT2LMHeadModel with labels: the loss is the replica's; `gather` unsqueezes the 0-dim
    // losses into a vector of one float per replica on the output device, then `.mean()`.
    let (batch, seq, dp) = (4u64, 64u64, 2u32);
    let iterations = Recipe::new(batch, seq).iterations as usize;
    let (t0, _) = device_trace("gpt2", batch, seq, dp, 0);
    let (t1, _) = device_trace("gpt2", batch, seq, dp, 1);
    assert_eq!(
        tagged(&t0, "dp_gather:loss"),
        [dp as u64 * 4, 4].repeat(iterations)
    );
    // Each replica's cross-entropy (ForCausalLMLoss: the labels padded and shifted, the logits
    // upcast to fp32 and kept whole) over its 2 × 64 positions × 50257 classes.
    let rows = 2 * 64 * 50257 * 4;
    for t in [&t0, &t1] {
        assert!(
            tags_containing(t, "_log_softmax")
                .iter()
                .any(|(_, s)| *s == rows),
            "{:?}",
            tags_containing(t, "_log_softmax")
        );
    }
    assert!(tagged(&t1, "dp_scatter").is_empty());
}

#[test]
fn which_zoo_models_run_their_criterion_outside() {
    let split = |name: &str, head: Option<Head>| {
        let text = name.starts_with("gpt2") || name.starts_with("nanogpt");
        let mut r = Recipe::new(2, if text { 32 } else { 0 });
        r.head = head;
        criterion_split(&zoo::build(name, &r).unwrap()).unwrap()
    };
    // torchvision's and timm's loops, the MLP's `F.cross_entropy(model(x), y)`, and a base
    // model's `last_hidden_state.mean()`: the criterion is the loop's.
    for name in ["resnet50", "vgg16", "vit-b-16", "mlp", "timm/resnet50"] {
        assert!(split(name, None).is_some(), "{name}");
    }
    assert!(split("gpt2", Some(Head::None)).is_some());
    // transformers' GPT2LMHeadModel with labels and nanoGPT's GPT return their loss.
    assert!(split("gpt2", None).is_none());
    assert!(split("nanogpt", None).is_none());
}

#[test]
fn the_whole_replica_graph_of_a_loop_criterion_is_refused() {
    let r = recipe(10, 0, 2, 1);
    match lower(&replica("resnet50", &r), &r) {
        Err(LowerError::DataParallel(msg)) => assert!(msg.contains("device_graph"), "{msg}"),
        other => panic!("{:?}", other.map(|t| t.events.len())),
    }
}

#[test]
fn every_returned_tensor_is_gathered_and_dies_within_its_step() {
    // BertModel (`--head none`) returns last_hidden_state and pooler_output; the loop's
    // `out.last_hidden_state.mean()` reads the first. `gather_map` gathers both on the output
    // device (B × S × 768 × 4 B and B × 768 × 4 B); neither outlives its step.
    let (batch, seq, dp) = (4u64, 32u64, 2u32);
    let mut r = recipe(batch, seq, dp, 0);
    r.head = Some(Head::None);
    let g = replica("bert-base", &r);
    let g = device_graph(g, &r.parallel, || {
        zoo::build("bert-base", &r).map_err(Box::<dyn std::error::Error>::from)
    })
    .unwrap();
    let t = lower(&g, &r).unwrap();
    let iterations = r.iterations as usize;
    assert_eq!(
        tagged(&t, "dp_gather:output"),
        [batch * seq * 768 * 4, batch * 768 * 4].repeat(iterations)
    );
    for k in 0..2 * iterations {
        let (made, freed) = alloc_and_free(&t, "dp_gather:output", k);
        let next_step = t.events[made..]
            .iter()
            .position(|e| matches!(e, Event::Phase { name } if &**name == "optimizer"))
            .expect("an optimizer phase")
            + made;
        assert!(freed < next_step, "gathered output {k}");
    }
}
