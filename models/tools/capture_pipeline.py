"""Record each rank of a real ``torch.distributed.pipelining`` run as a vramsim trace.

Two (or more) processes on the CPU with the gloo backend run PyTorch's own schedule
(``Schedule1F1B``, ``ScheduleGPipe`` or ``ScheduleInterleaved1F1B``) on an HF GPT-2 or Llama (a
small config, eager attention, fp32, ``use_cache=False``, CUDA's fused dropout, optionally HF's
non-reentrant activation checkpointing) split as torchtitan splits it (``_generate_llm_fqn_per_model_part``: the
embeddings count as a layer on the first stage, the final norm and head as one on the last); each
rank records the storages it allocates with the capture tool's ``Recorder`` (real CPU tensors: a
storage's life is its allocation's). The stage modules do what ``GPT2Model.forward`` does around
its blocks (``LlamaStage``: ``LlamaModel.forward``): the first stage embeds, every stage makes its
own position ids, causal mask (and rotary tables), the last applies the final norm, the head and
(through the schedule's ``loss_fn``) transformers' ``ForCausalLMLoss``.
Stages are built in static mode (``input_args``/``output_args``): no metadata inference step; the
static metadata is what inference gives a training run (``_create_act_recv_info``: a non-first
stage's received activation requires grad, so ``_retrieve_recv_activations`` makes it a leaf whose
``.grad`` is sent back).

    python3 models/tools/capture_pipeline.py OUT_DIR [--model gpt2|llama]
        [--schedule 1f1b|gpipe|interleaved:V] [--pp 2] [--m 4] [--checkpoint]
        [--dp N --shard ddp|zero1-torch [--bucket-view]]
        [--dp N --shard fsdp2 [--fsdp-param-dtype bf16] [--fsdp-reduce-dtype fp32]] [--layers N]
        [--freeze-blocks K] [--loop plain|torchtitan]

With ``--dp N`` (N ≥ 2, with ``--shard``) the world is ``pp × N`` processes on torchtitan's mesh
order (``pp`` outer, ``dp`` inner: global rank ``pp_rank · N + dp_rank``).

``--shard ddp`` wraps each stage module in ``DistributedDataParallel(process_group=dp group)`` (its
defaults, or ``gradient_as_bucket_view=True`` with ``--bucket-view``), which ``stage.py``'s
``forward_maybe_with_nosync`` / ``backward_maybe_with_nosync`` drive; ``--shard zero1-torch`` steps it
with a ``ZeroRedundancyOptimizer(AdamW, process_group=dp group)``. Every global rank is written as
``rank{pp_rank}.dp{dp_rank}.jsonl.gz`` (the DDP wrapper is built under the recorder, so its
Reducer's bucket tensors are recorded).

``--shard fsdp2`` forms torchtitan's ``("pp", "dp")`` device mesh and wraps each stage module as the
FSDP2 lowering models it (``lower/fsdp.rs``): ``fully_shard`` on every block, then on the stage
module (its root), all with ``reshard_after_forward=False`` (torchtitan's default policy under PP)
and the ``MixedPrecisionPolicy`` given; the stage's activations then travel in the param dtype. Only
the first data-parallel rank of each stage writes its trace, as ``rank{pp_rank}.jsonl.gz``
(``torch.chunk`` gives it the largest shards). The trace holds one step: the optimizer steps
DTensors, whose local allocations a dispatch mode does not see. FSDP2's ``resize_`` of the
unsharded parameters' storages (``_fsdp_param.py`` ``alloc_storage``/``free_storage``) is not an op:
it is recorded by wrapping those two functions.

``--freeze-blocks K`` fine-tunes: the embeddings and blocks 0..K-1 are frozen
(``requires_grad_(False)`` on the whole model before the split, as vramsim's ``--freeze
transformer.wte,transformer.wpe,transformer.h.0-(K-1)``; GPT-2's tied head follows ``wte``); AdamW
keeps no state for a parameter without a gradient. The static stage metadata is what ``PipelineStage``'s
metadata inference gives such a split (``_forward_metadata_inference`` /
``_backward_metadata_inference``): a stage whose output does not require grad (every layer up to
its last frozen) gets ``output_grads=None`` (derived as ``None``: no gradient receive buffer), and
a stage whose input comes from such a stage ``input_grads=None`` (no gradient sent back), and a
stage whose input does require grad gets it ``requires_grad`` (a leaf whose ``.grad`` is sent back).

``--loop torchtitan`` runs torchtitan's loop around ``schedule.step`` (``Trainer.train_step``,
``pp_forward_backward_step``): the last stage keeps ``torch.sum(torch.stack(losses))``, and through
its graph every micro-batch's received activation, the other stages a one-element tensor, until
after the optimizer step. The default ``plain`` loop drops the losses when the schedule returns.
The metadata records the loop as ``pp_loop``.

Without ``--dp`` every rank writes ``OUT_DIR/rank{R}.jsonl.gz``; the run also writes
``OUT_DIR/config.json`` (the model's config, for ``vramsim predict --hf-config``).
``models/tests/pipeline_capture.rs`` compares them with the lowering of each rank.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "traces", "python"))
import vramsim_capture  # noqa: E402

CONFIG = dict(
    model_type="gpt2",
    vocab_size=1024,
    n_positions=128,
    n_embd=128,
    n_layer=6,
    n_head=4,
    use_cache=False,
    attn_implementation="eager",
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)
LLAMA_CONFIG = dict(
    model_type="llama",
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    use_cache=False,
    attn_implementation="eager",
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
)
SEQ = 64


def split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """torchtitan's _generate_llm_fqn_per_model_part(num_stages, num_layers, 1, 1) as layer ranges."""
    eff = num_layers + 2
    per, extra = divmod(eff, num_stages)
    out, cur = [], 0
    for s in range(num_stages):
        n = per + (1 if s < extra else 0)
        if s == 0 or s == num_stages - 1:
            n -= 1
        out.append((cur, min(cur + n, num_layers)))
        cur = min(cur + n, num_layers)
    return out


class Stage(torch.nn.Module):
    """The part of GPT2LMHeadModel one stage runs (``GPT2Model.forward`` around its blocks)."""

    def __init__(self, full, first: bool, last: bool, layers: tuple[int, int]):
        super().__init__()
        t = full.transformer
        self.config = full.config
        self.wte = t.wte if first else None
        self.wpe = t.wpe if first else None
        self.drop = t.drop if first else None
        self.h = torch.nn.ModuleList(t.h[layers[0]:layers[1]])
        self.ln_f = t.ln_f if last else None
        self.lm_head = full.lm_head if last else None

    def forward(self, x, attention_mask=None):
        from transformers.masking_utils import create_causal_mask

        if self.wte is not None:
            inputs_embeds = self.wte(x)
        else:
            inputs_embeds = x
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        if self.wpe is not None:
            # GPT2Model.forward's locals: `position_embeds` lives to the end of the forward.
            position_embeds = self.wpe(position_ids)
            hidden = inputs_embeds + position_embeds
            hidden = self.drop(hidden)
        else:
            hidden = x
        causal_mask = create_causal_mask(
            config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            past_key_values=None, position_ids=position_ids)
        for block in self.h:
            hidden = block(hidden, None, causal_mask, None, use_cache=False, position_ids=position_ids)
        if self.ln_f is not None:
            hidden = self.ln_f(hidden)
            hidden = self.lm_head(hidden)
        return hidden


class LlamaStage(torch.nn.Module):
    """The part of LlamaForCausalLM one stage runs (``LlamaModel.forward`` around its layers): every
    stage makes its position ids, causal mask and rotary tables (``rotary_emb(hidden, position_ids)``)."""

    def __init__(self, full, first: bool, last: bool, layers: tuple[int, int]):
        super().__init__()
        t = full.model
        self.config = full.config
        self.embed_tokens = t.embed_tokens if first else None
        self.rotary_emb = t.rotary_emb
        self.layers = torch.nn.ModuleList(t.layers[layers[0]:layers[1]])
        self.norm = t.norm if last else None
        self.lm_head = full.lm_head if last else None

    def forward(self, x, attention_mask=None):
        from transformers.masking_utils import create_causal_mask

        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        causal_mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
            past_key_values=None, position_ids=position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=causal_mask, position_embeddings=position_embeddings,
                           position_ids=position_ids, past_key_values=None, use_cache=False)
        if self.norm is not None:
            hidden = self.lm_head(self.norm(hidden))
        return hidden


def _with_layers(cfg: dict, layers: int | None) -> dict:
    """The config with ``layers`` blocks (``--layers``), else as it is."""
    cfg = dict(cfg)
    if layers is not None:
        cfg["n_layer" if cfg["model_type"] == "gpt2" else "num_hidden_layers"] = layers
    return cfg


def _record_fsdp_resizes(rec) -> None:
    """Report FSDP2's storage ``resize_`` calls to the recorder as the allocation or free they are."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    def wrap(fn):
        def resized(tensor):
            st = tensor.untyped_storage()
            before = st.nbytes()
            fn(tensor)
            old = rec._by_storage.get(st)
            if st.nbytes() == before:
                return
            if old is None:
                rec._new_alloc(st, "parameter", "fsdp_unsharded")
            else:
                rec._realloc(st, old)
        return resized

    for mod in (_fsdp_param, _fsdp_param_group):
        if hasattr(mod, "alloc_storage"):
            mod.alloc_storage = wrap(_fsdp_param.alloc_storage)
    _fsdp_param.free_storage = wrap(_fsdp_param.free_storage)


def run(grank: int, world: int, out: str, schedule: str, m: int, port: int, ckpt: bool,
        model: str = "gpt2", dp: int = 1, shard: str = "none", bucket_view: bool = False,
        param_dtype: str | None = None, reduce_dtype: str | None = None,
        layers: int | None = None, freeze_blocks: int | None = None,
        loop: str = "plain") -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=grank, world_size=world * dp)
    # torchtitan's mesh ("pp", "dp"): pp outer.
    rank, dp_rank = divmod(grank, dp)
    pp_group = dp_group = dp_mesh = None
    if shard == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world, dp), mesh_dim_names=("pp", "dp"))
        pp_group, dp_mesh = mesh.get_group("pp"), mesh["dp"]
    elif dp > 1:
        # Every rank creates every group, in the same order.
        for d in range(dp):
            g = dist.new_group([p * dp + d for p in range(world)])
            if d == dp_rank:
                pp_group = g
        for p in range(world):
            g = dist.new_group([p * dp + d for d in range(dp)])
            if p == rank:
                dp_group = g
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}
    act_dtype = dtypes[param_dtype] or torch.float32
    from transformers import GPT2Config, GPT2LMHeadModel
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    torch.manual_seed(0)
    if model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(**_with_layers(LLAMA_CONFIG, layers))
        full = LlamaForCausalLM(cfg)
        stage_cls, n_layers, width = LlamaStage, cfg.num_hidden_layers, cfg.hidden_size
    else:
        cfg = GPT2Config(**_with_layers(CONFIG, layers))
        full = GPT2LMHeadModel(cfg)
        stage_cls, n_layers, width = Stage, cfg.n_layer, cfg.n_embd
    full.train()
    if freeze_blocks is not None:
        t = full.transformer if model == "gpt2" else full.model
        embeddings = [t.wte, t.wpe] if model == "gpt2" else [t.embed_tokens]
        blocks = t.h if model == "gpt2" else t.layers
        for mod in embeddings + list(blocks[:freeze_blocks]):
            mod.requires_grad_(False)
    if ckpt:
        # HF's gradient checkpointing (what vramsim's --checkpoint full is), non-reentrant.
        full.activation_checkpointing_enable({"use_reentrant": False})
    v = int(schedule.split(":")[1]) if schedule.startswith("interleaved:") else 1
    n_stages = world * v
    splits = split(n_layers, n_stages)
    import copy
    vocab = cfg.vocab_size
    batch = m  # micro-batch size 1
    stages, mods = [], []

    # With a frozen prefix: a stage's output requires grad once one of its layers up to the
    # end (or the embeddings) trains; its input when the previous stage's output does.
    def output_needs_grad(s_idx: int) -> bool:
        return freeze_blocks is None or splits[s_idx][1] > freeze_blocks or s_idx == n_stages - 1

    # Stage s runs on rank s mod pp (torchtitan's "loop" style); each is its own copy of the model
    # (`_split_module` deep-copies it).
    for s_idx in range(rank, n_stages, world):
        first, last = s_idx == 0, s_idx == n_stages - 1
        mod = stage_cls(copy.deepcopy(full), first, last, splits[s_idx])
        if shard == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            policy = MixedPrecisionPolicy(param_dtype=dtypes[param_dtype],
                                          reduce_dtype=dtypes[reduce_dtype])
            blocks = mod.h if hasattr(mod, "h") else mod.layers
            for block in blocks:
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
            fully_shard(mod, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
        # A non-first stage's received activation requires grad when the previous stage's output
        # does, as metadata inference records it (`_create_act_recv_info`: `requires_grad=
        # has_backward and is_floating_point()`); `_retrieve_recv_activations` then makes the
        # buffer a leaf that requires grad. In full training every received activation does.
        recv_grad = not first and output_needs_grad(s_idx - 1)
        mb_in = (torch.empty(1, SEQ, dtype=torch.long, device="meta") if first
                 else torch.empty(1, SEQ, width, device="meta", dtype=act_dtype,
                                  requires_grad=recv_grad))
        mb_out = torch.empty(1, SEQ, vocab if last else width, device="meta", dtype=act_dtype)
        mods.append(mod)
        stages.append((mod, s_idx, first, last, mb_in, mb_out))
    del full
    first = rank == 0
    last = (n_stages - 1) % world == rank
    if shard == "fsdp2":
        # The dp ranks of a stage read the same batch shape (their own samples).
        torch.manual_seed(1 + dp_rank)
    stage_mod = torch.nn.ModuleList(mods)

    def loss_fn(logits, labels):
        return _causal_lm_loss(logits, labels, vocab)

    dev = torch.device("cpu")
    names = {id(mod): n for n, mod in stage_mod.named_modules(remove_duplicate=False)}
    rec = vramsim_capture.Recorder(dev, names)
    for name, p in stage_mod.named_parameters():
        rec.track(p.to_local() if hasattr(p, "to_local") else p, "parameter", name)
    if shard == "fsdp2":
        _record_fsdp_resizes(rec)
    # The stages, each wrapped in DDP under the recorder (the Reducer's buckets are made there).
    subs = [mod for mod, *_ in stages]
    if shard in ("ddp", "zero1-torch"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        with rec:
            subs = [DDP(mod, process_group=dp_group, gradient_as_bucket_view=bucket_view)
                    for mod in subs]
    stages = [PipelineStage(sub, s_idx, n_stages, torch.device("cpu"),
                            input_args=(mb_in,), output_args=(mb_out,),
                            output_grads=None if s_last or not output_needs_grad(s_idx) else (mb_out,),
                            input_grads=None if s_first or not output_needs_grad(s_idx - 1) else (mb_in,),
                            group=pp_group)
              for sub, (_, s_idx, s_first, s_last, mb_in, mb_out) in zip(subs, stages)]

    if v > 1:
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    else:
        cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        sched = cls(stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    if shard == "zero1-torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(stage_mod.parameters(), optimizer_class=torch.optim.AdamW,
                                      process_group=dp_group, lr=1e-4, foreach=True)
    else:
        # Every parameter (AdamW skips those without a gradient: no state for the frozen ones);
        # given only the trainable ones, a fully frozen rank's optimizer would raise "optimizer
        # got an empty parameter list".
        opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-4, foreach=True)
    # CUDA's fused dropout (a bool mask), as the capture tool's own runs take it.
    with rec, vramsim_capture.cuda_like_dropout():
        for it in range(1 if shard == "fsdp2" else 2):
            rec.mark_phase("forward")
            rec.context = "input"
            # The zoo's loop: input_ids, attention_mask (all ones) and labels, each on the ranks
            # whose stages read it (every stage builds its causal mask from the attention mask).
            ids = torch.randint(0, vocab, (batch, SEQ)) if first else None
            mask = torch.ones(batch, SEQ, dtype=torch.long)
            labels = torch.randint(0, vocab, (batch, SEQ)) if last else None
            rec.context = None
            losses = [] if last else None
            if first:
                sched.step(ids, attention_mask=mask, target=labels, losses=losses, return_outputs=False)
            else:
                sched.step(attention_mask=mask, target=labels, losses=losses, return_outputs=False)
            if loop == "torchtitan":
                # torchtitan's `Trainer.pp_forward_backward_step` (`trainer.py`): the last stage
                # returns `torch.sum(torch.stack(losses)).to(self.device)`, whose graph reaches
                # every loss; the others `torch.tensor([-1.0], device=self.device)`, which on
                # CUDA is a device copy the caching allocator makes (a dispatch mode does not see
                # `torch.tensor`'s own allocation: `torch.full` makes the same one-element tensor).
                loss = torch.sum(torch.stack(losses)) if last else torch.full((1,), -1.0)
            del ids, mask, labels, losses
            rec.mark_phase("optimizer")
            opt.step()
            if loop == "torchtitan":
                # `train_step` returns after `optimizers.step()`: its `loss` dies there.
                del loss
            rec.mark_phase("zero_grad")
            opt.zero_grad(set_to_none=True)
        events = rec.close()
    rec.closed = True
    cap = vramsim_capture.Capture(meta={"tool": "capture_pipeline.py", "rank": rank, "pp": world,
                                        "schedule": schedule, "microbatches": m, "seq": SEQ,
                                        "checkpoint": "full" if ckpt else "none", "model": model,
                                        "dp": dp, "dp_rank": dp_rank, "shard": shard,
                                        "gradient_as_bucket_view": bucket_view,
                                        "fsdp_param_dtype": param_dtype,
                                        "fsdp_reduce_dtype": reduce_dtype,
                                        "freeze_blocks": freeze_blocks,
                                        "pp_loop": loop,
                                        "torch": torch.__version__}, events=events)
    if shard == "fsdp2":
        # the first data-parallel rank holds the largest shards (torch.chunk)
        if dp_rank == 0:
            cap.write(os.path.join(out, f"rank{rank}.jsonl.gz"))
    else:
        name = f"rank{rank}.jsonl.gz" if dp == 1 else f"rank{rank}.dp{dp_rank}.jsonl.gz"
        cap.write(os.path.join(out, name))
    dist.barrier()
    dist.destroy_process_group()


def _causal_lm_loss(logits, labels, vocab):
    """transformers' ForCausalLMLoss (``loss_utils.py``) as GPT2LMHeadModel calls it."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=vocab)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--schedule", default="1f1b", help="1f1b, gpipe or interleaved:V")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--m", type=int, default=4)
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--checkpoint", action="store_true", help="HF gradient checkpointing (non-reentrant)")
    ap.add_argument("--model", default="gpt2", choices=["gpt2", "llama"])
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks per stage")
    ap.add_argument("--shard", default="none", choices=["none", "ddp", "zero1-torch", "fsdp2"])
    ap.add_argument("--bucket-view", action="store_true", help="DDP gradient_as_bucket_view=True")
    ap.add_argument("--fsdp-param-dtype", choices=["bf16", "fp32"])
    ap.add_argument("--fsdp-reduce-dtype", choices=["bf16", "fp32"])
    ap.add_argument("--layers", type=int, help="the model's number of blocks (6 by default)")
    ap.add_argument("--freeze-blocks", type=int,
                    help="freeze the embeddings and blocks 0..K-1 (fine-tuning)")
    ap.add_argument("--loop", default="plain", choices=["plain", "torchtitan"],
                    help="the loop around schedule.step: plain (drops the losses when it returns) "
                         "or torchtitan (Trainer.train_step keeps their sum until after the "
                         "optimizer step)")
    a = ap.parse_args()
    if a.freeze_blocks is not None and a.shard != "none":
        ap.error("--freeze-blocks is recorded without data parallelism (--shard none)")
    if (a.dp > 1) != (a.shard != "none"):
        ap.error("--dp N (N > 1) goes with --shard ddp, zero1-torch or fsdp2")
    if a.bucket_view and a.shard not in ("ddp", "zero1-torch"):
        ap.error("--bucket-view is DDP's gradient_as_bucket_view: give it with --shard ddp or zero1-torch")
    if (a.fsdp_param_dtype or a.fsdp_reduce_dtype) and a.shard != "fsdp2":
        ap.error("--fsdp-param-dtype / --fsdp-reduce-dtype are FSDP2's MixedPrecisionPolicy: give them with --shard fsdp2")
    os.makedirs(a.out, exist_ok=True)
    cfg = _with_layers(LLAMA_CONFIG if a.model == "llama" else CONFIG, a.layers)
    cfg.pop("attn_implementation")
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    mp.spawn(run, args=(a.pp, a.out, a.schedule, a.m, a.port, a.checkpoint, a.model, a.dp, a.shard,
                         a.bucket_view, a.fsdp_param_dtype, a.fsdp_reduce_dtype, a.layers,
                         a.freeze_blocks, a.loop),
             nprocs=a.pp * a.dp, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
