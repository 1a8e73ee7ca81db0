//! `--shard dataparallel` (`torch.nn.DataParallel`) lowered device by device, against closed forms
//! derived from PyTorch's rules (`torch/nn/parallel/replicate.py`, `scatter_gather.py`,
//! `_functions.py`, `comm.py`, `torch/csrc/cuda/comm.cpp`), never from vramsim's output:
//!
//! * every forward, devices 1..N-1 receive a copy of every parameter (Ψ × 4 B in fp32) and every
//!   buffer, as flat `broadcast_coalesced` groups that close once they reach 10 MiB; device 0
//!   keeps the originals and copies nothing;
//! * the output device gathers the model's returned logits for the whole batch (B × classes × 4 B)
//!   and one loss per replica;
//! * `reduce_add_coalesced` flattens every device's gradients (Ψ × 4 B in all) and device 0 gets
//!   the results (Ψ × 4 B), which become `.grad`; the optimizer (AdamW: 2 × Ψ × 4 B of state)
//!   exists on device 0 only;
//! * with one device `DataParallel.forward` calls the module itself: the single-GPU trace.

use std::collections::HashMap;

use vramsim_models::dataparallel::{chunk_sizes, COALESCE_BYTES};
use vramsim_models::{lower, zoo, Parallel, Recipe, Shard};
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

/// The trace of `device`: the graph built for its chunk, the step for the whole batch.
fn device_trace(name: &str, batch: u64, seq: u64, dp: u32, device: u32) -> (Trace, u64) {
    let r = recipe(batch, seq, dp, device);
    let mut gr = r.clone();
    gr.batch = r.parallel.replica_batch(batch);
    let g = zoo::build(name, &gr).unwrap();
    let psi = g.param_count();
    (lower(&g, &r).unwrap(), psi)
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

/// The largest number of live bytes of `category` at any point of the trace.
fn max_live(t: &Trace, category: Category) -> u64 {
    let mut live: HashMap<String, u64> = HashMap::new();
    let (mut now, mut max) = (0u64, 0u64);
    for e in &t.events {
        match e {
            Event::Alloc {
                id,
                size,
                category: c,
                ..
            } if *c == category => {
                live.insert(id.to_string(), *size);
                now += size;
                max = max.max(now);
            }
            Event::Free { id } => {
                if let Some(s) = live.remove(&id.to_string()) {
                    now -= s;
                }
            }
            _ => {}
        }
    }
    max
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
    // The logits of all ten images, fp32, 1000 classes; one loss per replica.
    assert_eq!(
        tagged(&t0, "dp_gather:output"),
        vec![batch * 1000 * 4; iterations]
    );
    // `gather` of the four 0-dim losses (unsqueezed): a vector of 4 floats, then its `.mean()`.
    assert_eq!(
        tagged(&t0, "dp_gather:loss"),
        [dp as u64 * 4, 4].repeat(iterations)
    );
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
