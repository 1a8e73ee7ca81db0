//! Fine-tuning (`--freeze`, `--lora`) under pipeline (`--pp`) and context (`--cp`) parallelism,
//! against closed forms derived by hand from the models' shapes and the frameworks' rules (never
//! from vramsim's output):
//!
//! * A pipeline stage keeps its own frozen parameters and adapters (torchtitan splits the model,
//!   `_split_module` keeps each stage's modules), so its optimizer state and gradients are those
//!   of its trainable parameters only: AdamW's two moments per trainable element, a gradient per
//!   trainable element, none for a frozen one.
//! * A fully frozen first stage (`PipelineStage` in PyTorch 2.15's `stage.py`): its output does
//!   not require grad, so metadata inference gives the next stage an input without
//!   `requires_grad` (`_forward_metadata_inference`: `extract_tensor_metas(outputs)`;
//!   `_retrieve_recv_activations`: `requires_grad_(tensor_meta.requires_grad)`), that stage gets no
//!   input gradient to send (`_backward_metadata_inference`: grad meta `None`; `get_bwd_send_ops`
//!   skips it), and the frozen stage allocates no gradient receive buffer (`_create_grad_recv_info`
//!   with `tensor_meta=None`; `_get_recv_ops` skips it) and runs an empty backward
//!   (`stage_backward` skips an output that neither requires grad nor has a `grad_fn`).
//! * A DDP stage that trains nothing cannot be built: `DistributedDataParallel.__init__` raises
//!   "DistributedDataParallel is not needed when a module doesn't have any parameter that requires
//!   a gradient." (`torch/nn/parallel/distributed.py`).
//! * FSDP2 over the data-parallel (× context-parallel) ranks shards every parameter, frozen or not
//!   (`FSDPParam._init_sharded_param`: ⌈dim0/N⌉ × rest), and keeps gradients and optimizer state
//!   for the trainable ones only.

mod common;
use common::live_at_phase;

use vramsim_models::pipeline::rank_graph;
use vramsim_models::{lower, zoo, Parallel, PpSchedule, Precision, Recipe, Shard};
use vramsim_traces::{Category, Event, Trace};

/// TinyLlama-1.1B by hand: hidden 2048, 32 heads, 4 KV heads (256 wide), intermediate 5632,
/// vocabulary 32000, 22 layers. One layer: q and o 2048², k and v 2048 × 256, gate, up and down
/// 3 × 2048 × 5632, two RMSNorms of 2048.
const TL_LAYER: u64 = 2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048;
/// TinyLlama's final norm and untied lm_head.
const TL_HEAD: u64 = 2048 + 32000 * 2048;
/// PEFT LoRA r 16 on all seven linear layers of one TinyLlama layer: r × (in + out) each.
const TL_LORA_LAYER: u64 =
    16 * ((2048 + 2048) + 2 * (2048 + 256) + (2048 + 2048) + 2 * (2048 + 5632) + (5632 + 2048));

/// The torchtitan split of TinyLlama over 2 stages: 24 effective layers, 12 each: stage 0 the
/// embeddings and layers 0–10, stage 1 layers 11–21, the norm and the head.
const TL_STAGE_LAYERS: u64 = 11;

fn recipe(pp: u32, m: u32, rank: u32) -> Recipe {
    Recipe {
        parallel: Parallel {
            pp,
            pp_schedule: PpSchedule::OneFOneB,
            microbatches: Some(m),
            stage: rank,
            ..Parallel::default()
        },
        ..Recipe::new(u64::from(m), 64)
    }
}

fn lower_rank(name: &str, r: &Recipe) -> Trace {
    let mut gr = r.clone();
    gr.batch = r.parallel.replica_batch(r.batch);
    let g = zoo::build(name, &gr).unwrap_or_else(|e| panic!("{name}: {e}"));
    let h = rank_graph(&g, &r.parallel).unwrap_or_else(|e| panic!("{name}: {e}"));
    lower(&h, r).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn tagged(t: &Trace, prefix: &str) -> usize {
    t.events
        .iter()
        .filter(|e| matches!(e, Event::Alloc { tag: Some(x), .. } if x.starts_with(prefix)))
        .count()
}

fn get(live: &std::collections::HashMap<Category, u64>, c: Category) -> u64 {
    live.get(&c).copied().unwrap_or(0)
}

/// A frozen first stage (embeddings and layers 0–10 of TinyLlama, fp32, AdamW): rank 0 keeps
/// no gradient and no optimizer state, allocates no gradient receive buffer; rank 1 receives a
/// hidden state that does not require grad, sends nothing back, and keeps gradients and AdamW
/// state for its 11 layers, the norm and the head.
#[test]
fn a_frozen_first_stage_trains_nothing_and_exchanges_no_gradient() {
    let mut r0 = recipe(2, 2, 0);
    r0.freeze = vec!["model.embed_tokens".into(), "model.layers.0-10".into()];
    let mut r1 = r0.clone();
    r1.parallel.stage = 1;
    let t0 = lower_rank("tinyllama-1.1b", &r0);
    let t1 = lower_rank("tinyllama-1.1b", &r1);
    let l0 = live_at_phase(&t0, "optimizer", 1);
    let l1 = live_at_phase(&t1, "optimizer", 1);
    // fp32: 4 bytes per parameter, gradient; 8 per trainable element for exp_avg + exp_avg_sq.
    let stage0 = 32000 * 2048 + TL_STAGE_LAYERS * TL_LAYER;
    let stage1 = TL_STAGE_LAYERS * TL_LAYER + TL_HEAD;
    assert_eq!(get(&l0, Category::Parameter), 4 * stage0);
    assert_eq!(get(&l0, Category::Gradient), 0);
    assert_eq!(get(&l0, Category::OptimizerState), 0);
    assert_eq!(common::max_live(&t0, Category::Gradient), 0);
    assert_eq!(get(&l1, Category::Parameter), 4 * stage1);
    assert_eq!(get(&l1, Category::Gradient), 4 * stage1);
    assert_eq!(get(&l1, Category::OptimizerState), 8 * stage1);
    // The hidden state still crosses (one buffer of 64 × 2048 fp32 per micro-batch); no
    // gradient crosses back.
    assert_eq!(tagged(&t1, "pp_recv_activation"), 2 * 2, "two steps × m 2");
    assert_eq!(tagged(&t0, "pp_recv_grad"), 0);
    assert_eq!(tagged(&t1, "pp_send_grad"), 0);
    // Without freezing, both cross (the control).
    let t0 = lower_rank("tinyllama-1.1b", &recipe(2, 2, 0));
    assert_eq!(tagged(&t0, "pp_recv_grad"), 2 * 2);
}

/// A stage frozen only in part (layers 0–5 of stage 0's 0–10) still receives the next stage's
/// gradient, and its optimizer state covers layers 6–10 alone.
#[test]
fn a_partly_frozen_stage_keeps_state_for_its_trainable_layers() {
    let mut r0 = recipe(2, 2, 0);
    r0.freeze = vec!["model.embed_tokens".into(), "model.layers.0-5".into()];
    let t0 = lower_rank("tinyllama-1.1b", &r0);
    let l0 = live_at_phase(&t0, "optimizer", 1);
    assert_eq!(get(&l0, Category::Gradient), 4 * 5 * TL_LAYER);
    assert_eq!(get(&l0, Category::OptimizerState), 8 * 5 * TL_LAYER);
    assert_eq!(tagged(&t0, "pp_recv_grad"), 2 * 2);
}

/// LoRA (r 16, all linear layers) over pp 2 × dp 2 with FSDP2: each stage holds its own 11
/// layers' adapters (lm_head is not adapted by PEFT's all-linear), and FSDP2 shards them over the
/// two data-parallel ranks (r = 16 and every width even: exact halves); bf16 base and adapters
/// (`dtype=model`: PEFT's `autocast_adapter_dtype=False`), bf16 gradients and AdamW moments.
#[test]
fn lora_stages_under_fsdp2_keep_their_own_adapters_sharded() {
    assert_eq!(TL_LORA_LAYER, 573_440);
    for rank in 0..2 {
        let mut r = recipe(2, 2, rank);
        r.precision = Precision::Bf16;
        r.parallel.dp = 2;
        r.parallel.shard = Shard::Fsdp2;
        r.batch = 4;
        r.lora = Some(
            "r=16,alpha=32,targets=all-linear,dtype=model"
                .parse()
                .unwrap(),
        );
        let t = lower_rank("tinyllama-1.1b", &r);
        let l = live_at_phase(&t, "optimizer", 1);
        let adapters = TL_STAGE_LAYERS * TL_LORA_LAYER;
        assert_eq!(get(&l, Category::Gradient), 2 * adapters / 2, "rank {rank}");
        assert_eq!(
            get(&l, Category::OptimizerState),
            4 * adapters / 2,
            "rank {rank}"
        );
        let base = if rank == 0 {
            32000 * 2048 + TL_STAGE_LAYERS * TL_LAYER
        } else {
            TL_STAGE_LAYERS * TL_LAYER + TL_HEAD
        };
        assert_eq!(
            get(&l, Category::Parameter),
            2 * base / 2 + 2 * adapters / 2,
            "rank {rank}"
        );
    }
}

/// DDP over a stage that trains nothing raises in PyTorch; a partly frozen DDP stage buckets its
/// trainable gradients only (bucket bytes = the trainable parameters' gradient bytes).
#[test]
fn ddp_stages_bucket_only_trainable_gradients_and_a_frozen_one_is_refused() {
    let mut r = recipe(2, 2, 0);
    r.parallel.dp = 2;
    r.parallel.shard = Shard::Ddp;
    r.batch = 4;
    r.freeze = vec!["model.embed_tokens".into(), "model.layers.0-10".into()];
    let mut gr = r.clone();
    gr.batch = r.parallel.replica_batch(r.batch);
    let g = zoo::build("tinyllama-1.1b", &gr).unwrap();
    let e = rank_graph(&g, &r.parallel).unwrap_err().to_string();
    assert!(
        e.contains("DistributedDataParallel is not needed") && e.contains("--shard fsdp2"),
        "{e}"
    );
    r.freeze = vec!["model.embed_tokens".into(), "model.layers.0-5".into()];
    let t = lower_rank("tinyllama-1.1b", &r);
    let l = live_at_phase(&t, "optimizer", 1);
    assert_eq!(get(&l, Category::Communication), 4 * 5 * TL_LAYER);
    assert_eq!(get(&l, Category::OptimizerState), 8 * 5 * TL_LAYER);
}

/// GPT-2 (by hand: wte 50257 × 768, wpe 1024 × 768, 12 layers of 7 087 872, ln_f 2 × 768) with
/// LoRA r 8 on c_attn (768 → 2304: 8 × 3072 per layer) under --cp 2 (FSDP2 over dp × cp = 2):
/// every parameter sharded ⌈dim0/2⌉ × rest, the adapters' gradients and AdamW moments halved;
/// bf16 throughout (`dtype=model`). The ring attention is the same as without adapters.
#[test]
fn lora_under_context_parallelism_follows_fsdp2_over_dp_times_cp() {
    let layer: u64 = 4 * 768 + 768 * 2304 + 2304 + 768 * 768 + 768 + 2 * 768 * 3072 + 3072 + 768;
    assert_eq!(layer, 7_087_872);
    // Shards: wte's 50257 rows give 25129 per rank; everything else is even.
    let base_shard = 25129 * 768 + 512 * 768 + 12 * layer / 2 + 768;
    let adapters = 12 * 8 * (768 + 2304);
    for cp_rank in 0..2 {
        let r = Recipe {
            precision: Precision::Bf16,
            parallel: Parallel {
                shard: Shard::Fsdp2,
                cp: 2,
                cp_rank,
                ..Parallel::default()
            },
            lora: Some("r=8,targets=c_attn,dtype=model".parse().unwrap()),
            ..Recipe::new(1, 256)
        };
        let g = zoo::build("gpt2", &r).unwrap();
        let t = lower(&g, &r).unwrap();
        let l = live_at_phase(&t, "optimizer", 1);
        assert_eq!(
            get(&l, Category::Gradient),
            2 * adapters / 2,
            "cp rank {cp_rank}"
        );
        assert_eq!(get(&l, Category::OptimizerState), 4 * adapters / 2);
        assert_eq!(
            get(&l, Category::Parameter),
            2 * base_shard + 2 * adapters / 2
        );
    }
}
