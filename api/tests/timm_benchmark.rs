//! timm's RTX 3090 training benchmark (`results/benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv`,
//! rows copied to `models/tests/published/timm_rtx3090_train.csv`) against vramsim's prediction.
//!
//! `benchmark.py` (timm 0.6.6, commit c865028c, the commit that wrote the CSV) runs each model from
//! the requested batch (512: the largest recorded) and on a `RuntimeError` (CUDA out of memory)
//! retries with `decay_batch_step(batch)` (`_try_run`); `train_batch_size` is the first batch of that
//! sequence that ran. So the record is consistent with a prediction when the recorded batch fits and
//! the batch tried just before it (the next larger of the sequence) does not.
//!
//! The setup, read from that `benchmark.py` and PyTorch 1.12 (`pt112-cu113`), as `vramsim predict`
//! options (the test builds the recipe and device `predict` builds from them; `predict_agrees`
//! runs the binary on one row):
//! * `torch.backends.cudnn.benchmark = True` at module level → `--cudnn-benchmark`;
//! * `--amp`: `torch.cuda.amp.autocast()` (float16) around `model(x)`, the loss and `backward()`,
//!   and `self.loss(output, target).backward()` with no `GradScaler` → `--precision amp-fp16
//!   --grad-scaler false`; float32 NCHW `example_inputs` of the CSV's `train_img_size`
//!   (`--image-size`); `create_model(num_classes=None)`: the model's 1000 classes;
//! * `create_optimizer_v2(model, opt='sgd', lr=1e-4)` (its `weight_decay=0.`, `momentum=0.9`
//!   defaults; the parser's `--weight-decay` is not passed): timm 0.6.6 `optim_factory.py` maps `sgd`
//!   to `optim.SGD(momentum=momentum, nesterov=True)` → `--optimizer sgd-nesterov`; torch 1.12
//!   `optim/sgd.py` `sgd()`: `foreach=None` → `False` → `--optimizer-impl for-loop`;
//! * `optimizer.zero_grad()`: torch 1.12 `Optimizer.zero_grad(set_to_none=False)` →
//!   `--zero-grad zero`; 10 warm-up and 40 timed steps per attempt → `--iterations 50`;
//! * cuBLAS: PyTorch 1.12 gives cuBLAS no workspace (its `ATen/cuda/CUDAContext.h` declares none;
//!   PR #83461, in 1.13, made `CublasHandlePool.cpp` allocate one per (handle, stream) from the
//!   caching allocator), so cuBLAS keeps its own per-handle workspace for good →
//!   `--cublas-workspace-cache`, the nearest description (one 8,519,680 B workspace per thread,
//!   kept; 1.12's came from cuBLAS's own `cudaMalloc`, outside the allocator's segments). A cu113
//!   build should never take addmm's cuBLASLt path (`Blas.cpp` guards it with CUDA 11.4, "for cuda
//!   11.4, cublasLtMatmul is activated"; 1.12's own `Blas.cpp` not read: its `CUDABlas.h` declares
//!   `gemm_and_bias` from CUDA 11.0); with the cache on, vramsim's Lt GEMMs share the one workspace
//!   anyway;
//! * CUDA 11.3 on an RTX 3090 → `--gpu rtx3090 --cuda 11`: the preset's CUDA 11 context, 1687 MB
//!   after `torch.Tensor(1).cuda()` with torch 1.8.2+cu111 (pytorch/pytorch issue #55277). CUDA
//!   11.1 and 11.3 both predate lazy module loading (CUDA 11.7; PyTorch turned it on in 1.13, PR
//!   #86509), so both load every sm_86 kernel of libtorch_cuda when the context is created: the
//!   same mechanism on the same GPU, the nearest measurement there is. It is not 1.12's own figure
//!   (1.12's libtorch_cuda is another binary), and like any "after one tensor" figure it leaves out
//!   the cuDNN and cuBLAS kernels their first calls load.
//!
//! Fits = `vramsim predict`'s verdict: the replay raises no out-of-memory error, i.e. device used
//! (reserved + context) stays within the card's `total_memory`. Not described by any option: the
//! previous, failed attempt's `bench` object (`_try_run` drops it only when the next one has been
//! constructed), cuDNN's convolution workspaces (benchmark and per call) and the kernels cuDNN and
//! cuBLAS load into the context at their first call.

use std::path::Path;
use std::process::Command;
use vramsim_models::{
    lower, zoo, CublasWorkspaceMode, OptimizerImpl, OptimizerKind, Precision, Recipe, Target,
    ZeroGrad,
};
use vramsim_sim::allocator::caching::CachingAllocator;
use vramsim_sim::config::AllocatorConfig;
use vramsim_sim::device::find_preset;
use vramsim_sim::engine::{Replay, ReplayOptions};

/// The benchmark's GPU preset.
const GPU: &str = "rtx3090";

/// The CUDA major version of the benchmark's PyTorch build (`cu113`).
const CUDA: u32 = 11;

/// Optimizer steps of one attempt: `num_warm_iter` (10) + `num_bench_iter` (40), benchmark.py's
/// parser defaults (`--iterations 50`); an out-of-memory error in any of them fails the attempt. The
/// allocator's cache keeps changing for a few steps (EfficientNet-B0 at 512 fits 4 steps, not 5),
/// so all 50 are replayed.
const STEPS: u32 = 50;

/// A CUDA version with lazy module loading (the rtx3090's CUDA 12 context, 256 MiB measured with
/// torch 2.7.1+cu128): the what-if column of the table, how much the rows depend on the context.
const LAZY_CUDA: u32 = 12;

/// The batch benchmark.py starts from (the largest `train_batch_size` in the CSV).
const START: u64 = 512;

/// `timm.utils.decay_batch.decay_batch_step(batch_size, num_intra_steps=2, no_odd=False)`:
/// `base = 2 ** floor(log(b - 1) / log(2))`, `step = max(base // 2, 1)`,
/// `base + ((b - base - 1) // step) * step`; 0 when `b <= 1`. (Python computes the logarithm in
/// floating point; for the batches of this sequence it equals the integer `floor(log2(b - 1))`.)
fn decay_batch_step(b: u64) -> u64 {
    if b <= 1 {
        return 0;
    }
    let base = 1u64 << (63 - (b - 1).leading_zeros());
    let step = (base / 2).max(1);
    base + ((b - base - 1) / step) * step
}

/// The batches benchmark.py tries from [`START`], in order.
fn sequence() -> Vec<u64> {
    let mut v = vec![START];
    while let Some(&b) = v.last() {
        let n = decay_batch_step(b);
        if n == 0 {
            break;
        }
        v.push(n);
    }
    v
}

#[test]
fn decay_batch_step_follows_timm_docstring() {
    // decay_batch.py's docstring: "num_steps == 2 --> 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1".
    let mut b = 64;
    let mut seq = vec![b];
    while decay_batch_step(b) > 0 {
        b = decay_batch_step(b);
        seq.push(b);
    }
    assert_eq!(seq, [64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1]);
    assert_eq!(&sequence()[..6], [512, 384, 256, 192, 128, 96]);
}

/// One row of the CSV.
struct Row {
    model: String,
    batch: u64,
    img: u64,
}

fn rows() -> Vec<Row> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/published/timm_rtx3090_train.csv");
    let text = std::fs::read_to_string(&path).expect("timm_rtx3090_train.csv");
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).expect(name);
    let (m, b, i) = (col("model"), col("train_batch_size"), col("train_img_size"));
    lines
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            Row {
                model: f[m].to_string(),
                batch: f[b].parse().expect("batch"),
                img: f[i].parse().expect("img"),
            }
        })
        .collect()
}

/// The benchmark's step at `batch` on `img`×`img` images: what `vramsim predict --precision
/// amp-fp16 --grad-scaler false --optimizer sgd-nesterov --optimizer-impl for-loop --zero-grad zero
/// --cudnn-benchmark --cublas-workspace-cache --iterations 50 --image-size IMG --gpu rtx3090` builds.
fn recipe(batch: u64, img: u64) -> Recipe {
    let mut r = Recipe::new(batch, 1);
    r.iterations = STEPS;
    r.precision = Precision::AmpFp16;
    r.grad_scaler = Some(false);
    r.optimizer = OptimizerKind::SgdNesterov;
    r.optimizer_impl = OptimizerImpl::ForLoop;
    r.zero_grad = ZeroGrad::Zero;
    r.workspaces.cudnn_benchmark = true;
    r.workspaces.cublas_mode = CublasWorkspaceMode::Persistent;
    r.image_size = Some((img, img));
    r.target = Target {
        compute_capability: find_preset(GPU).expect("preset").compute_capability,
    };
    r
}

/// The `vramsim predict` arguments of [`recipe`] on the benchmark's machine (`--cuda 11`).
fn predict_args(model: &str, batch: u64, img: u64) -> Vec<String> {
    let (model, batch, img) = (format!("timm/{model}"), batch.to_string(), img.to_string());
    let (cuda, steps) = (CUDA.to_string(), STEPS.to_string());
    [
        "predict",
        "--model",
        &model,
        "--batch",
        &batch,
        "--image-size",
        &img,
        "--precision",
        "amp-fp16",
        "--grad-scaler",
        "false",
        "--optimizer",
        "sgd-nesterov",
        "--optimizer-impl",
        "for-loop",
        "--zero-grad",
        "zero",
        "--cudnn-benchmark",
        "--cublas-workspace-cache",
        "--iterations",
        &steps,
        "--gpu",
        GPU,
        "--cuda",
        &cuda,
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Whether timm model `model` trains at `batch` on the RTX 3090 (CUDA 11 context) without running
/// out of memory.
fn fits(model: &str, batch: u64, img: u64) -> bool {
    fits_with(model, batch, img, CUDA)
}

/// [`fits`] with the preset's context for CUDA major version `cuda`. As `vramsim predict`: the
/// replay stops at an out-of-memory error; one that runs to its end never held more than the card
/// (reserved + context ≤ `total_memory`), which is asserted.
fn fits_with(model: &str, batch: u64, img: u64, cuda: u32) -> bool {
    let r = recipe(batch, img);
    let graph = zoo::build(&format!("timm/{model}"), &r).expect("build");
    let trace = lower(&graph, &r).expect("lower");
    let device = find_preset(GPU).expect("preset").device_with_cuda(cuda);
    let total = device.total_memory;
    let alloc = CachingAllocator::new(AllocatorConfig::default(), device);
    let replay = Replay::new(alloc, &ReplayOptions { timeline_points: 0 });
    let outcome = replay
        .run(trace.events.into_iter().map(Ok))
        .expect("replay");
    let fits = outcome.oom.is_none();
    if fits {
        assert!(
            outcome.peak_device_used <= total,
            "{model} b{batch}: device used {} > {total}",
            outcome.peak_device_used
        );
    }
    fits
}

/// The largest batch that fits, by doubling and bisection (for the table).
fn max_batch(model: &str, img: u64, cuda: u32) -> u64 {
    let fits = |b: u64| fits_with(model, b, img, cuda);
    let (mut lo, mut hi) = (0u64, 1u64);
    while fits(hi) {
        lo = hi;
        hi *= 2;
        if hi > 8192 {
            return lo;
        }
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Rows whose record vramsim does not reproduce (see `models/README.md`, "timm's RTX 3090 training
/// benchmark"): none with the benchmark's setup. Three did with the earlier description
/// (`sgd-momentum`, a GradScaler, 2 steps, vramsim's default 512 MiB context): convnext_tiny and
/// resnet152 now hold through the CUDA 11 context, efficientnet_b0 through the 50 steps (512 fits 4
/// steps; in the 5th the cache's segments no longer hold the head's 64,225,280 B `silu_backward`;
/// 511–514 fail, 516 fits): a verdict of fragmentation, not of a margin. ResNet-50 has the least
/// margin (512 recorded, 515 fits). Not tuned: the list is the record.
const KNOWN_INCONSISTENT: &[&str] = &[];

/// A row's position in timm's sequence: the batch tried before the recorded one (`None` for the
/// start batch).
fn tried_before(row: &Row) -> Option<u64> {
    let seq = sequence();
    let pos = seq
        .iter()
        .position(|&b| b == row.batch)
        .unwrap_or_else(|| panic!("{}: {} is not in timm's sequence", row.model, row.batch));
    (pos > 0).then(|| seq[pos - 1])
}

/// Whether vramsim reproduces the row: its recorded batch fits and the batch tried before it does
/// not; else which half fails.
fn verdict(row: &Row) -> &'static str {
    if !fits(&row.model, row.batch, row.img) {
        "NO (recorded batch does not fit)"
    } else if tried_before(row).is_some_and(|b| fits(&row.model, b, row.img)) {
        "NO (failed batch fits)"
    } else {
        "yes"
    }
}

#[test]
fn timm_rtx3090_batches_are_consistent() {
    let mut inconsistent = Vec::new();
    for row in rows() {
        let v = verdict(&row);
        if v != "yes" {
            eprintln!("{}: {v}", row.model);
            inconsistent.push(row.model.clone());
        }
    }
    let known: Vec<String> = KNOWN_INCONSISTENT.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        inconsistent, known,
        "the inconsistent rows changed: update KNOWN_INCONSISTENT and the README table \
         (cargo test --release -p vramsim-sim --test timm_benchmark -- --ignored --nocapture)"
    );
}

/// The README's table: per row the first batch of timm's sequence that fits, the largest batch
/// that fits with the CUDA 11 context and with the CUDA 12 one, and the verdict. Slow in a debug
/// build (hundreds of 50-step replays): `cargo test --release -p vramsim-sim --test
/// timm_benchmark -- --ignored --nocapture`.
#[test]
#[ignore]
fn timm_rtx3090_table() {
    let seq = sequence();
    let mut table = String::from(
        "model | recorded | batch tried before | predicted (first of the sequence that fits) | predicted max batch | max batch, CUDA 12 context | consistent\n",
    );
    for row in rows() {
        let predicted = seq
            .iter()
            .copied()
            .find(|&b| fits(&row.model, b, row.img))
            .unwrap_or(0);
        table.push_str(&format!(
            "{} | {} | {} | {} | {} | {} | {}\n",
            row.model,
            row.batch,
            tried_before(&row).map_or("(start)".into(), |b| b.to_string()),
            predicted,
            max_batch(&row.model, row.img, CUDA),
            max_batch(&row.model, row.img, LAZY_CUDA),
            verdict(&row)
        ));
    }
    println!("{table}");
}

/// `vramsim predict` with the benchmark's options gives the verdict the test computes, on a row
/// whose recorded batch fits and whose failed batch does not (ConvNeXt-T: 256 ran, 384 did not).
#[test]
fn predict_agrees() {
    for batch in [256, 384] {
        let output = Command::new(env!("CARGO_BIN_EXE_vramsim"))
            .args(predict_args("convnext_tiny", batch, 224))
            .output()
            .expect("the vramsim binary runs");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let j: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
        assert_eq!(j["fits"], fits("convnext_tiny", batch, 224), "b{batch}");
        assert_eq!(j["context"]["cuda"], CUDA);
        assert_eq!(j["recipe"]["grad_scaler"], false);
        assert_eq!(j["workspaces"]["cublas_mode"], "persistent");
        assert_eq!(j["workspaces"]["cudnn_benchmark"], true);
        assert_eq!(j["recipe"]["optimizer"], "sgd-nesterov");
        let used = j["peak_device_used_bytes"].as_u64().unwrap();
        let total = j["device"]["total_memory_bytes"].as_u64().unwrap();
        assert!(used <= total, "b{batch}: {used} > {total}");
    }
}
