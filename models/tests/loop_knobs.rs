//! The training-loop knobs against byte counts derived by hand from PyTorch's rules:
//! `zero_grad(set_to_none=False)`, SGD with Nesterov momentum, `clip_grad_norm_`, HF's Adafactor and
//! the GradScaler switch. The model is the zoo's `mlp` (torchvision-style `Sequential` of four
//! `nn.Linear`), whose parameters are, in order, `[4096, 1024]`, `[4096]`, `[4096, 4096]`, `[4096]`,
//! `[4096, 4096]`, `[4096]`, `[1000, 4096]`, `[1000]`.

mod common;

use std::collections::HashMap;
use vramsim_models::*;
use vramsim_traces::{AllocId, Category, Event, Trace};

/// The MLP's parameter shapes, in `model.parameters()` order.
const SHAPES: [&[u64]; 8] = [
    &[4096, 1024],
    &[4096],
    &[4096, 4096],
    &[4096],
    &[4096, 4096],
    &[4096],
    &[1000, 4096],
    &[1000],
];

fn numel(s: &[u64]) -> u64 {
    s.iter().product()
}

fn params() -> u64 {
    SHAPES.iter().map(|s| numel(s)).sum()
}

fn lowered(r: &Recipe) -> Trace {
    lower(&zoo::build("mlp", r).unwrap(), r).unwrap()
}

/// Event index of the `phase` marker of `iteration` (from `meta.phases`).
fn marker(t: &Trace, phase: &str, iteration: u64) -> usize {
    t.meta["phases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["phase"] == phase && p["iteration"] == iteration)
        .unwrap_or_else(|| panic!("no {phase} in iteration {iteration}"))["event"]
        .as_u64()
        .unwrap() as usize
}

/// Requested bytes live just before event `end`, in all and by category.
fn live_at(t: &Trace, end: usize) -> (u64, HashMap<Category, u64>) {
    let by = common::live_by_category(t, end);
    (by.values().sum(), by)
}

/// The highest live requested bytes within events `[start, end)`, over what was live at `start`.
fn rise(t: &Trace, start: usize, end: usize) -> u64 {
    let (base, _) = live_at(t, start);
    common::peak_between(t, start, end).max(base) - base
}

/// `(+size | -size)` for each alloc and free within `[start, end)`.
fn ops(t: &Trace, start: usize, end: usize) -> Vec<i64> {
    let mut sizes: HashMap<&AllocId, u64> = HashMap::new();
    for e in &t.events[..start] {
        if let Event::Alloc { id, size, .. } = e {
            sizes.insert(id, *size);
        }
    }
    let mut out = Vec::new();
    for e in &t.events[start..end] {
        match e {
            Event::Alloc { id, size, .. } => {
                sizes.insert(id, *size);
                out.push(*size as i64);
            }
            Event::Free { id } => out.push(-(sizes[id] as i64)),
            _ => {}
        }
    }
    out
}

#[test]
fn zero_grad_zero_keeps_gradients_into_the_next_step() {
    let mut r = Recipe::new(64, 0);
    r.optimizer = OptimizerKind::Sgd;
    let none = lowered(&r);
    r.zero_grad = ZeroGrad::Zero;
    let zero = lowered(&r);
    // At the start of iteration 2's forward: set_to_none=True left no gradient; set_to_none=False
    // (`_foreach_zero_` in place, nothing allocated) left every one, 4 bytes per parameter.
    let (total_none, by_none) = live_at(&none, marker(&none, "forward", 1));
    let (total_zero, by_zero) = live_at(&zero, marker(&zero, "forward", 1));
    assert_eq!(by_none.get(&Category::Gradient), None);
    assert_eq!(by_zero[&Category::Gradient], params() * 4);
    assert_eq!(total_zero - total_none, 41_858_024 * 4);
    // The zero_grad phase itself allocates nothing either way.
    for t in [&none, &zero] {
        let z = marker(t, "zero_grad", 0);
        assert!(ops(t, z, marker(t, "forward", 1)).iter().all(|&x| x < 0));
    }
    // Iteration 2's backward adds into the kept `.grad` in place (accumulate_grad.h,
    // `variable_grad += new_grad`): no gradient is allocated for .grad again.
    let b = marker(&zero, "backward", 1);
    let e = marker(&zero, "optimizer", 1);
    let (_, at_opt) = live_at(&zero, e);
    assert_eq!(at_opt[&Category::Gradient], params() * 4);
    assert!(zero.events[b..e].iter().all(|ev| !matches!(
        ev,
        Event::Alloc {
            category: Category::Gradient,
            ..
        }
    )));
}

#[test]
fn nesterov_adds_in_place_in_foreach_and_one_temporary_at_a_time_in_the_loop() {
    let mut r = Recipe::new(64, 0);
    r.optimizer = OptimizerKind::SgdMomentum;
    let momentum = lowered(&r);
    r.optimizer = OptimizerKind::SgdNesterov;
    let nesterov = lowered(&r);
    // foreach: `torch._foreach_add_(device_grads, bufs, alpha=momentum)` writes into the gradients.
    let sizes = |t: &Trace| ops(t, 0, t.events.len());
    assert_eq!(sizes(&momentum), sizes(&nesterov));
    // for-loop, iteration 2 (buffers exist): `grad = grad.add(buf, alpha=momentum)` per parameter,
    // dropped when `grad` is rebound to the next gradient: one parameter-sized temporary at a time.
    r.optimizer_impl = OptimizerImpl::ForLoop;
    let looped = lowered(&r);
    let (s, e) = (
        marker(&looped, "optimizer", 1),
        marker(&looped, "zero_grad", 1),
    );
    let expected: Vec<i64> = SHAPES
        .iter()
        .flat_map(|s| {
            let b = (numel(s) * 4) as i64;
            [b, -b]
        })
        .collect();
    assert_eq!(ops(&looped, s, e), expected);
    assert_eq!(rise(&looped, s, e), 4096 * 4096 * 4);
    // Iteration 1: the momentum buffer (`grad.detach().clone()`) comes before each temporary.
    let (s, e) = (
        marker(&looped, "optimizer", 0),
        marker(&looped, "zero_grad", 0),
    );
    let mut expected = Vec::new();
    let mut prev = 0i64;
    for s in SHAPES {
        let b = (numel(s) * 4) as i64;
        if prev > 0 {
            expected.push(-prev);
        }
        expected.extend([b, b]);
        prev = b;
    }
    expected.push(-prev);
    assert_eq!(ops(&looped, s, e), expected);
}

#[test]
fn clip_grad_norm_makes_foreach_norm_temporaries() {
    let mut r = Recipe::new(64, 0);
    r.optimizer = OptimizerKind::Sgd; // SGD allocates nothing itself
    r.clip_grad_norm = Some(1.0);
    for (precision, e) in [(Precision::Fp32, 4i64), (Precision::Bf16, 2)] {
        r.precision = precision;
        let t = lowered(&r);
        let (s, end) = (marker(&t, "optimizer", 1), marker(&t, "zero_grad", 1));
        // _foreach_norm: output_per_tensor float32 [8 tensors × ceil(4096·4096 / 65536) = 256
        // chunks], eight 0-d norms in the gradients' dtype, output_per_tensor freed; stack [8];
        // vector_norm 0-d; stack freed; the norms freed last first; `total + 1e-6`, `reciprocal`,
        // `* max_norm`, reciprocal and sum freed, `clamp`, clip_coef and clamped freed, total freed.
        let per_tensor = 8 * 256 * 4;
        let mut expected = vec![per_tensor];
        expected.extend([e; 8]);
        expected.push(-per_tensor);
        expected.extend([8 * e, e, -8 * e]);
        expected.extend([-e; 8]);
        expected.extend([e, e, e, -e, -e, e, -e, -e, -e]);
        assert_eq!(ops(&t, s, end), expected, "{precision}");
        assert_eq!(rise(&t, s, end), (per_tensor + 8 * e) as u64);
    }
}

#[test]
fn hf_adafactor_keeps_factored_float32_state() {
    // exp_avg_sq_row [R] + exp_avg_sq_col [C] for matrices, exp_avg_sq for vectors, an RMS scalar
    // per parameter; all float32 (grad.float() first for 16-bit gradients), no exp_avg (beta1=None).
    let factored: u64 = (4096 + 1024) + (4096 + 4096) * 2 + (1000 + 4096);
    let vectors: u64 = 4096 * 3 + 1000;
    let state = (factored + vectors + 8) * 4;
    let mut r = Recipe::new(64, 0);
    r.optimizer = OptimizerKind::AdafactorHf;
    for precision in [Precision::Fp32, Precision::Bf16] {
        r.precision = precision;
        let t = lowered(&r);
        let (_, by) = live_at(&t, t.events.len());
        assert_eq!(by[&Category::OptimizerState], state, "{precision}");
    }
    // Iteration 2 of fp32, the first parameter [4096, 1024], in Adafactor.step's order.
    r.precision = Precision::Fp32;
    let t = lowered(&r);
    let (s, e) = (marker(&t, "optimizer", 1), marker(&t, "zero_grad", 1));
    let first: Vec<i64> = ops(&t, s, e).into_iter().take(20).collect();
    let full = 4096 * 1024 * 4i64;
    assert_eq!(
        first,
        vec![
            4,        // norm(2) of p
            4,        // / sqrt(numel): the new RMS
            -4,       // norm freed
            -4,       // the previous RMS replaced
            full,     // grad**2
            full,     // + eps
            -full,    // pow freed
            4096 * 4, // update.mean(dim=-1)
            -4096 * 4,
            1024 * 4, // update.mean(dim=-2)
            -1024 * 4,
            4,        // row.mean(dim=-1, keepdim=True)
            4096 * 4, // row / mean
            -4,
            1024 * 4, // col.unsqueeze(-2).rsqrt()
            full,     // torch.mul(r_factor, c_factor)
            -4096 * 4,
            -1024 * 4,
            -full, // the `grad**2 + eps` update rebound
            4,     // _rms(update): norm
        ]
    );
}

#[test]
fn hf_adamw_creates_state_in_its_loop_and_one_denom_per_parameter() {
    // transformers.optimization.AdamW.step (4.16), per parameter: at the first step
    // `exp_avg = zeros_like(p)`, `exp_avg_sq = zeros_like(p)`; then `denom =
    // exp_avg_sq.sqrt().add_(eps)` (one new tensor, p's size; `add_` in place), the previous
    // parameter's denom dying when the name is rebound, the last when `step` returns.
    let mut r = Recipe::new(64, 0);
    r.optimizer = OptimizerKind::AdamWHf;
    r.optimizer_impl = OptimizerImpl::ForLoop;
    let t = lowered(&r);
    let (s, e) = (marker(&t, "optimizer", 0), marker(&t, "zero_grad", 0));
    let mut expected = Vec::new();
    let mut prev = 0i64;
    for sh in SHAPES {
        let b = (numel(sh) * 4) as i64;
        expected.extend([b, b, b]); // exp_avg, exp_avg_sq, denom
        if prev > 0 {
            expected.push(-prev);
        }
        prev = b;
    }
    expected.push(-prev);
    assert_eq!(ops(&t, s, e), expected);
    // Iteration 2: only the denoms.
    let (s, e) = (marker(&t, "optimizer", 1), marker(&t, "zero_grad", 1));
    let mut expected = Vec::new();
    let mut prev = 0i64;
    for sh in SHAPES {
        let b = (numel(sh) * 4) as i64;
        expected.push(b);
        if prev > 0 {
            expected.push(-prev);
        }
        prev = b;
    }
    expected.push(-prev);
    assert_eq!(ops(&t, s, e), expected);
    // Two float32 moments per parameter, nothing else (`state["step"]` is a Python int).
    let (_, by) = live_at(&t, t.events.len());
    assert_eq!(by[&Category::OptimizerState], 2 * 4 * params());
    // The default --optimizer-impl (foreach) runs the same loop: transformers has no other.
    r.optimizer_impl = OptimizerImpl::Foreach;
    assert_eq!(
        ops(&lowered(&r), 0, t.events.len()),
        ops(&t, 0, t.events.len())
    );
}

#[test]
fn grad_scaler_is_a_switch_defaulting_to_amp_fp16() {
    let mut r = Recipe::new(64, 0);
    r.optimizer = OptimizerKind::Sgd;
    r.precision = Precision::AmpFp16;
    assert!(r.uses_grad_scaler());
    let on = lowered(&r);
    r.grad_scaler = Some(false);
    assert!(!r.uses_grad_scaler());
    let off = lowered(&r);
    let scaler_tags = |t: &Trace| {
        t.events
            .iter()
            .filter(
                |e| matches!(e, Event::Alloc { tag: Some(tag), .. } if tag.contains("GradScaler")),
            )
            .count()
    };
    assert_eq!(scaler_tags(&on), 2, "_scale and _growth_tracker");
    assert_eq!(scaler_tags(&off), 0);
    // Off: the optimizer phase of plain SGD allocates nothing; on: unscale_'s
    // `_scale.double().reciprocal().float()` (8, 8, double freed, 4, reciprocal freed), found_inf
    // (4), _MultiDeviceReplicator copies of found_inf then inv_scale (4, 4), inv_scale's copy, then
    // inv_scale and found_inf freed when unscale_ returns; found_inf's copy freed by update().
    let phase = |t: &Trace| ops(t, marker(t, "optimizer", 1), marker(t, "zero_grad", 1));
    assert!(phase(&off).is_empty());
    assert_eq!(phase(&on), vec![8, 8, -8, 4, -8, 4, 4, 4, -4, -4, -4, -4]);
    // The scaled loss: one more 0-d float32 per micro-batch (`loss * _scale`) and the two scalars
    // for good: 8 bytes left at the end.
    let (end_on, _) = live_at(&on, on.events.len());
    let (end_off, _) = live_at(&off, off.events.len());
    assert_eq!(end_on - end_off, 4 + 4);
    // Fused AdamW (`_step_supports_amp_scaling`): `_check_inf_per_device` with `dummy_inv_scale =
    // torch.full((), 1.0)` and found_inf (4, 4), the replicator copies (4, 4), the inv_scale copy,
    // the dummy and found_inf freed; `found_inf = sum([...])` (`0 + t`: 4), `optimizer.grad_scale =
    // scaler * 1` (4); the fused step (no temporaries at iteration 2); `del optimizer.grad_scale`,
    // `found_inf` at return, the found_inf copy at update().
    let mut f = Recipe::new(64, 0);
    f.precision = Precision::AmpFp16;
    f.optimizer_impl = OptimizerImpl::Fused;
    let fused = lowered(&f);
    assert_eq!(
        phase(&fused),
        vec![4, 4, 4, 4, -4, -4, -4, 4, 4, -4, -4, -4]
    );
    // PyTorch allows a scaler without float16 autocast: `--grad-scaler true` on fp32.
    let mut r = Recipe::new(64, 0);
    r.optimizer = OptimizerKind::Sgd;
    r.grad_scaler = Some(true);
    let fp32 = lowered(&r);
    assert_eq!(scaler_tags(&fp32), 2);
    assert_eq!(phase(&fp32), phase(&on));
}

#[test]
fn bad_knobs_are_errors_listing_the_choices() {
    let e = "maybe".parse::<ZeroGrad>().unwrap_err().to_string();
    assert!(e.contains("none, zero"), "{e}");
    let e = "nesterov".parse::<OptimizerKind>().unwrap_err().to_string();
    assert!(
        e.contains("sgd-nesterov") && e.contains("adafactor-hf"),
        "{e}"
    );
    let mut r = Recipe::new(1, 0);
    for bad in [-1.0, 0.0, f64::NAN, f64::INFINITY] {
        r.clip_grad_norm = Some(bad);
        let e = r.validate().unwrap_err().to_string();
        assert!(e.contains("clip-grad-norm"), "{e}");
    }
    r.clip_grad_norm = None;
    r.optimizer = OptimizerKind::AdafactorHf;
    r.optimizer_impl = OptimizerImpl::Fused;
    assert!(r.validate().is_err());
}

/// `(+size | -size)` of every alloc and free from the first `forward` marker on, and the same for
/// the events of the `optimizer` phases only.
fn sequences(t: &Trace) -> (Vec<i64>, Vec<i64>) {
    common::signed_sizes(t, "optimizer", None)
}

#[test]
fn knobs_agree_with_pytorch_meta_captures() {
    // traces/python/make_knob_captures.py: torch 2.15, transformers 5.23, torchvision 0.29 on the
    // meta device. (file, model, batch, seq, precision, optimizer, impl, zero_grad, whole trace
    // event-identical; GPT-2's captures summarize mask and position-id temporaries)
    let cases = [
        (
            "mlp__b64__fp32-sgd-nesterov",
            "mlp",
            64,
            0,
            "fp32",
            "sgd-nesterov",
            "foreach",
            "none",
            true,
        ),
        (
            "mlp__b64__fp32-sgd-nesterov-for-loop",
            "mlp",
            64,
            0,
            "fp32",
            "sgd-nesterov",
            "for-loop",
            "none",
            true,
        ),
        (
            "mlp__b64__fp32-adamw-zero",
            "mlp",
            64,
            0,
            "fp32",
            "adamw",
            "foreach",
            "zero",
            true,
        ),
        (
            "mlp__b64__fp32-adafactor-hf",
            "mlp",
            64,
            0,
            "fp32",
            "adafactor-hf",
            "foreach",
            "none",
            true,
        ),
        (
            "mlp__b64__bf16-adafactor-hf",
            "mlp",
            64,
            0,
            "bf16",
            "adafactor-hf",
            "foreach",
            "none",
            true,
        ),
        (
            "resnet18__b2__fp32-adafactor-hf",
            "resnet18",
            2,
            0,
            "fp32",
            "adafactor-hf",
            "foreach",
            "none",
            true,
        ),
        (
            "gpt2__b2s128__bf16-adafactor-hf",
            "gpt2",
            2,
            128,
            "bf16",
            "adafactor-hf",
            "foreach",
            "none",
            false,
        ),
    ];
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/knob_captures");
    for (file, model, batch, seq, precision, optimizer, imp, zero, identical) in cases {
        let theirs = vramsim_traces::read_trace(dir.join(format!("{file}.jsonl.gz"))).unwrap();
        let mut r = Recipe::new(batch, seq);
        r.precision = precision.parse().unwrap();
        r.optimizer = optimizer.parse().unwrap();
        r.optimizer_impl = imp.parse().unwrap();
        r.zero_grad = zero.parse().unwrap();
        r.fidelity = Fidelity::MetaCapture;
        // The capture tool builds its HF configs with `use_cache=False`.
        r.use_cache = Some(false);
        let ours = lower(&zoo::build(model, &r).unwrap(), &r).unwrap();
        assert_eq!(peak_requested(&ours), peak_requested(&theirs), "{file}");
        let (a, oa) = sequences(&ours);
        let (b, ob) = sequences(&theirs);
        assert_eq!(oa, ob, "{file}: optimizer phases");
        if identical {
            assert_eq!(a, b, "{file}: events");
        }
    }
}
