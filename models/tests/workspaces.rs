//! cuBLAS / cuBLASLt / cuDNN workspaces in the lowering, against counts and sizes derived by hand from
//! PyTorch 2.15's rules (`aten/src/ATen/cuda/CublasHandlePool.cpp`, `CUDABlas.cpp`,
//! `native/cuda/Blas.cpp`, `native/cudnn/Conv_v8.cpp`) and the models' code (HF GPT-2, torchvision
//! ResNet).

use std::collections::HashMap;
use vramsim_models::recipe::parse_cublas_workspace_config;
use vramsim_models::*;
use vramsim_traces::{AllocId, Category, Event, Trace};

const MIB: u64 = 1 << 20;

fn gpt2(cc: (u32, u32), mode: CublasWorkspaceMode, iterations: u32) -> Trace {
    let mut r = Recipe::new(2, 64);
    r.attention = Attention::Eager; // the GEMM counts below are eager attention's
    r.iterations = iterations;
    r.target = Target {
        compute_capability: cc,
    };
    r.workspaces.cublas_mode = mode;
    let g = zoo::build("gpt2", &r).unwrap();
    lower(&g, &r).unwrap()
}

/// (size, freed right after: the next event frees it) of every workspace allocation, in order.
fn workspaces(t: &Trace) -> Vec<(u64, bool)> {
    let mut out = Vec::new();
    for (i, e) in t.events.iter().enumerate() {
        if let Event::Alloc {
            id,
            size,
            category: Category::Workspace,
            ..
        } = e
        {
            let freed = matches!(t.events.get(i + 1), Some(Event::Free { id: f }) if f == id);
            out.push((*size, freed));
        }
    }
    out
}

fn live_at_end(t: &Trace) -> Vec<(Category, u64)> {
    let mut live: HashMap<&AllocId, (Category, u64)> = HashMap::new();
    for e in &t.events {
        match e {
            Event::Alloc {
                id, size, category, ..
            } => {
                live.insert(id, (*category, *size));
            }
            Event::Free { id } => {
                live.remove(id);
            }
            _ => {}
        }
    }
    live.into_values()
        .filter(|(c, _)| *c == Category::Workspace)
        .collect()
}

/// GPT-2 small (12 layers) per step, by hand from HF `modeling_gpt2.py` with eager attention:
/// forward, per layer, four `Conv1D`s = `addmm(bias, x, W)` with a 1-D bias (the cuBLASLt path) and
/// two eager-attention `matmul`s = `bmm` (cuBLAS); plus `lm_head` (no bias: `mm`, cuBLAS) → 48 cuBLASLt
/// and 12 × 2 + 1 = 25 cuBLAS GEMMs. Backward: each `addmm` and `mm` gives two `mm`s and each `bmm` two
/// `bmm`s → 12 × (4 × 2 + 2 × 2) + 2 = 146 cuBLAS GEMMs. The optimizer has none.
const GPT2_LT: usize = 48;
const GPT2_CUBLAS_FWD: usize = 25;
const GPT2_CUBLAS_BWD: usize = 146;

#[test]
fn per_call_workspaces_on_a100_and_h100() {
    // CublasHandlePool.cpp parseChosenWorkspaceSize: `:4096:2:16:8` = 2·4096 KiB + 8·16 KiB on sm 8.0;
    // 4096 KiB · 8 on compute capability major 9–12. cuBLASLt: CUBLASLT_WORKSPACE_SIZE = 1024 KiB.
    for (cc, cublas) in [((8, 0), 8_519_680u64), ((9, 0), 33_554_432)] {
        let t = gpt2(cc, CublasWorkspaceMode::PerCall, 1);
        let ws = workspaces(&t);
        assert!(
            ws.iter().all(|&(_, freed)| freed),
            "2.15 frees each workspace when the GEMM returns"
        );
        let n_cublas = ws.iter().filter(|&&(s, _)| s == cublas).count();
        let n_lt = ws.iter().filter(|&&(s, _)| s == 1_048_576).count();
        assert_eq!(n_lt, GPT2_LT, "cc {cc:?}");
        assert_eq!(n_cublas, GPT2_CUBLAS_FWD + GPT2_CUBLAS_BWD, "cc {cc:?}");
        assert_eq!(ws.len(), n_lt + n_cublas);
        assert!(live_at_end(&t).is_empty());
    }
}

#[test]
fn persistent_workspaces_one_per_thread() {
    // TORCH_CUBLAS_WORKSPACE_CACHE=1 (or PyTorch ≤ 2.14): one per (handle, stream); the forward runs
    // on the main thread, the backward on the autograd engine's device thread: two, never freed, for
    // any number of steps (erees measured 2 × 8,519,680 B on an A100).
    for iterations in [1, 3] {
        let t = gpt2((8, 0), CublasWorkspaceMode::Persistent, iterations);
        assert_eq!(workspaces(&t), vec![(8_519_680, false), (8_519_680, false)]);
        let mut end = live_at_end(&t);
        end.sort();
        assert_eq!(
            end,
            vec![
                (Category::Workspace, 8_519_680),
                (Category::Workspace, 8_519_680)
            ]
        );
    }
    // The first is allocated in the forward, the second in the backward.
    let t = gpt2((9, 0), CublasWorkspaceMode::Persistent, 1);
    let phase_of = |pos: usize| {
        t.events[..pos]
            .iter()
            .rev()
            .find_map(|e| match e {
                Event::Phase { name } => Some(name.to_string()),
                _ => None,
            })
            .unwrap()
    };
    let at: Vec<usize> = t
        .events
        .iter()
        .enumerate()
        .filter(|(_, e)| {
            matches!(
                e,
                Event::Alloc {
                    category: Category::Workspace,
                    ..
                }
            )
        })
        .map(|(i, _)| i)
        .collect();
    assert_eq!(at.len(), 2);
    assert_eq!(phase_of(at[0]), "forward");
    assert_eq!(phase_of(at[1]), "backward");
}

#[test]
fn workspace_config_sizes() {
    // parseChosenWorkspaceSize: Σ SIZE·1024·COUNT over the matches of `:([0-9]+):([0-9]+)`.
    assert_eq!(
        parse_cublas_workspace_config(":4096:8").unwrap(),
        Some(32 * MIB)
    );
    assert_eq!(
        parse_cublas_workspace_config(":16:8").unwrap(),
        Some(128 * 1024)
    );
    assert_eq!(
        parse_cublas_workspace_config(":4096:2:16:8").unwrap(),
        Some(8_519_680)
    );
    assert_eq!(parse_cublas_workspace_config(":0:0").unwrap(), Some(0));
    // No match: PyTorch warns and takes its default.
    assert_eq!(parse_cublas_workspace_config("4096x8").unwrap(), None);
    let w = Workspaces {
        cublas_workspace_config: Some("garbage".into()),
        ..Workspaces::default()
    };
    let (bytes, warning) = w.cublas_workspace_bytes((8, 0));
    assert_eq!(bytes, 8_519_680);
    assert_eq!(
        warning.unwrap(),
        "Could not parse CUBLAS_WORKSPACE_CONFIG, using default workspace size of 8519680 bytes."
    );
    // std::stoull throws on a number beyond 64 bits: an error, listed as such.
    assert!(parse_cublas_workspace_config(":99999999999999999999999:1").is_err());
    let mut r = Recipe::new(1, 64);
    r.attention = Attention::Eager; // the GEMM counts below are eager attention's
    r.workspaces.cublas_workspace_config = Some(":99999999999999999999999:1".into());
    assert!(r.validate().is_err());
    // `:4096:8` on an A100 gives 32 MiB per GEMM; `:0:0` no workspace at all.
    for (config, size) in [(":4096:8", 32 * MIB), (":0:0", 0)] {
        let mut r = Recipe::new(2, 64);
        r.attention = Attention::Eager; // the GEMM counts below are eager attention's
        r.iterations = 1;
        r.target = Target {
            compute_capability: (8, 0),
        };
        r.workspaces.cublas_workspace_config = Some(config.into());
        let t = lower(&zoo::build("gpt2", &r).unwrap(), &r).unwrap();
        let ws = workspaces(&t);
        let n = ws.iter().filter(|&&(s, _)| s == size).count();
        let expected = if size == 0 {
            0
        } else {
            GPT2_CUBLAS_FWD + GPT2_CUBLAS_BWD
        };
        assert_eq!(n, expected, "{config}");
        // cuBLASLt keeps its own 1 MiB (not unified while caching is off).
        assert_eq!(ws.iter().filter(|&&(s, _)| s == MIB).count(), GPT2_LT);
    }
}

#[test]
fn meta_capture_sees_no_workspace() {
    let mut r = Recipe::new(2, 64);
    r.attention = Attention::Eager; // the GEMM counts below are eager attention's
    r.fidelity = Fidelity::MetaCapture;
    r.workspaces.cublas_mode = CublasWorkspaceMode::Persistent;
    r.workspaces.cudnn_benchmark = true;
    let t = lower(&zoo::build("gpt2", &r).unwrap(), &r).unwrap();
    assert!(workspaces(&t).is_empty());
    let mut r = Recipe::new(1, 0);
    r.fidelity = Fidelity::MetaCapture;
    r.workspaces.cudnn_benchmark = true;
    let t = lower(&zoo::build("resnet18", &r).unwrap(), &r).unwrap();
    assert!(!t.events.iter().any(|e| matches!(e, Event::EmptyCache)));
}

#[test]
fn cudnn_benchmark_empties_the_cache_once_per_new_convolution() {
    // torchvision resnet18 at 224×224: distinct forward convolution configurations (input shape,
    // weight shape, stride/padding): conv1 7×7/2; layer1 3×3 64→64 at 56²; layer2: 3×3/2 64→128,
    // 3×3 128→128 at 28², 1×1/2 downsample; layer3 and layer4 the same three → 1 + 1 + 3·3 = 11.
    // Backward: data and filter convolutions per configuration, except conv1, whose input (the
    // image) needs no gradient: 11 + 10 = 21. Benchmarks happen in the first step only.
    let mut r = Recipe::new(2, 0);
    r.workspaces.cudnn_benchmark = true;
    let t = lower(&zoo::build("resnet18", &r).unwrap(), &r).unwrap();
    let empties = t
        .events
        .iter()
        .filter(|e| matches!(e, Event::EmptyCache))
        .count();
    assert_eq!(empties, 11 + 21);
    // With every block checkpointed, the autograd thread recomputes the blocks' forward
    // convolutions, and cuDNN v8's benchmark cache is thread-local: the 10 forward configurations
    // inside blocks (all but the stem's conv1) are benchmarked again.
    r.checkpointing = Checkpointing::Full;
    let t = lower(&zoo::build("resnet18", &r).unwrap(), &r).unwrap();
    let empties = t
        .events
        .iter()
        .filter(|e| matches!(e, Event::EmptyCache))
        .count();
    assert_eq!(empties, 11 + 21 + 10);
    r.checkpointing = Checkpointing::None;
    r.workspaces.cudnn_benchmark = false;
    let t = lower(&zoo::build("resnet18", &r).unwrap(), &r).unwrap();
    assert!(!t.events.iter().any(|e| matches!(e, Event::EmptyCache)));
}
