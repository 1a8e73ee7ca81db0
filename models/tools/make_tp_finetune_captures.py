"""Capture fine-tuning on one tensor-parallel rank on the ``meta`` device, as reference fixtures in
``models/tests/captures/tp_finetune/`` (checked by ``models/tests/tensor_parallel.rs``).

The rank's model is ``make_tp_captures.py``'s (HF's GPT-2, TinyLlama and BERT split as Megatron-LM
splits them, rank 0 of PyTorch's fake process group), then:

* **freeze**: ``requires_grad_(False)`` on the parameters under vramsim's ``--freeze`` patterns
  (``make_finetune_captures.matches``); a frozen column-parallel layer takes Megatron's
  ``linear_with_frozen_weight`` path (``make_tp_captures.column_input(x, frozen=True)``);
* **lora**: NVIDIA Megatron-Bridge's LoRA (``megatron/bridge/peft/lora.py``, ``lora_layers.py``
  ``LoRALinear``, ``peft/utils.py`` ``ParallelLinearAdapter``) written here operation by
  operation after its code: each target layer wrapped so that ``linear_output = to_wrap(x)``,
  ``adapter_output = adapter(x.contiguous())`` on the base's input before its collective (the
  LayerNorm output), ``linear_output + adapter_output.reshape(linear_output.shape)``. The adapter
  of a column-parallel base: dropout, with sequence parallelism
  ``gather_from_sequence_parallel_region`` (``_gather_along_first_dim``; backward
  reduce-scatters), ``linear_in = ColumnParallelLinear(in, r, gather_output=True,
  disable_grad_reduce=sp)`` (``[r/t, in]``, the input gradient all-reduced unless
  ``disable_grad_reduce``, the output gathered along the last dimension: ``torch.empty`` of t × the
  input, ``torch.cat(chunks, dim=-1)``; backward keeps the rank's slice, ``.contiguous()``),
  ``linear_out = ColumnParallelLinear(r, out)`` (``[out/t, r]``). Of a row-parallel base: dropout,
  ``linear_in = RowParallelLinear(in, r, input_is_parallel=True)`` (``[r, in/t]``, output
  all-reduced), ``linear_out = ColumnParallelLinear(r, out, gather_output=True)``, with sequence
  parallelism ``scatter_to_sequence_parallel_region`` (``_split_along_first_dim``: on Megatron's
  sequence-first tensors a view; written here as the batch-first slice, also a view). Then
  ``x * (alpha / dim)``. Adapter weights in the model's dtype (``self.bfloat16()`` under a bf16
  config), every base parameter frozen (``PEFT.freeze_model``), the adapters' linears without
  sequence parallelism. LLaMA's and BERT's column-parallel linears take their input through their
  parent's forward pre-hook; a second pre-hook keeps a weak reference to the parent's input before
  the collective for the adapters (so it keeps nothing alive, also when a checkpoint's
  recomputation stops early).
* **head**: HF's ``*ForSequenceClassification`` / ``*ForTokenClassification`` / base model (as
  ``make_head_captures.py`` builds them) on the rank's split base model, the head replicated whole
  on every rank; with sequence parallelism the final hidden state gathered first
  (``gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)``, as Megatron's
  ``Pooler``; backward a view of the gradient's first ``numel / t`` elements, the bytes of Megatron's
  sequence-first slice).
* a ninth field ``"full"``: HF's ``activation_checkpointing_enable`` (non-reentrant) on top.

Run from the repository root (torch, transformers; no GPU, no network)::

    python models/tools/make_tp_finetune_captures.py
"""

from __future__ import annotations

import os
import sys
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "traces", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import make_fixtures as mf  # noqa: E402
import vramsim_capture as vc  # noqa: E402
import make_tp_captures as tpc  # noqa: E402
from make_finetune_captures import matches, parse_lora  # noqa: E402

OUT_DIR = os.path.join(ROOT, "models", "tests", "captures", "tp_finetune")

# (model, batch, seq, dtype, tp, sp, kind, spec[, checkpoint])
CASES = [
    ("gpt2", 2, 128, "bf16", 2, False, "freeze", "transformer.wte,transformer.wpe,transformer.h.0-5"),
    ("gpt2", 2, 128, "bf16", 2, True, "freeze", "transformer.wte,transformer.wpe,transformer.h.0-5"),
    ("tinyllama-1.1b", 2, 128, "bf16", 2, False, "freeze", "model.embed_tokens,model.layers.0-10"),
    ("bert-base", 2, 128, "bf16", 2, True, "freeze", "bert.embeddings,bert.encoder.layer.0-5"),
    ("gpt2", 2, 128, "bf16", 2, False, "lora", "r=8,alpha=16,dropout=0.05,targets=all-linear"),
    ("gpt2", 2, 128, "bf16", 2, True, "lora", "r=8,alpha=16,dropout=0.05,targets=all-linear"),
    ("gpt2", 4, 128, "fp32", 4, True, "lora", "r=8,alpha=16,dropout=0,targets=c_attn,c_proj"),
    ("tinyllama-1.1b", 2, 128, "bf16", 2, False, "lora", "r=16,alpha=32,dropout=0,targets=all-linear"),
    ("tinyllama-1.1b", 2, 128, "fp32", 4, False, "lora", "r=8,alpha=16,dropout=0.1,targets=q_proj,v_proj"),
    ("bert-base", 2, 128, "bf16", 2, True, "lora", "r=8,alpha=16,dropout=0.1,targets=all-linear"),
    ("gpt2", 2, 128, "bf16", 2, False, "head", "seq-cls:2"),
    ("gpt2", 2, 128, "fp32", 2, False, "head", "token-cls:5"),
    ("gpt2", 2, 128, "bf16", 2, False, "head", "none"),
    ("tinyllama-1.1b", 2, 128, "bf16", 2, False, "head", "seq-cls:2"),
    ("tinyllama-1.1b", 2, 128, "bf16", 2, False, "head", "token-cls:5"),
    ("bert-base", 2, 128, "bf16", 2, False, "head", "seq-cls:3"),
    ("bert-base", 2, 128, "fp32", 2, False, "head", "token-cls:9"),
    ("bert-base", 2, 128, "fp32", 2, False, "head", "none"),
    ("gpt2", 2, 128, "bf16", 2, True, "head", "seq-cls:2"),
    ("gpt2", 2, 128, "fp32", 2, True, "head", "token-cls:5"),
    ("gpt2", 2, 128, "bf16", 2, True, "head", "none"),
    ("bert-base", 2, 128, "bf16", 2, True, "head", "seq-cls:3"),
    ("bert-base", 2, 128, "fp32", 2, True, "head", "token-cls:9"),
    ("bert-base", 2, 128, "fp32", 2, True, "head", "none"),
    # HF's activation checkpointing (non-reentrant) of every block, whose
    # `activation_checkpointing_enable` also marks the (vocabulary-parallel) input embedding's output
    # as requiring grad (`enable_input_require_grads`).
    ("gpt2", 2, 128, "bf16", 2, False, "freeze", "transformer.wte,transformer.wpe,transformer.h.0-5", "full"),
    ("gpt2", 2, 128, "bf16", 2, True, "lora", "r=8,alpha=16,dropout=0.05,targets=all-linear", "full"),
    ("tinyllama-1.1b", 2, 128, "bf16", 2, False, "lora", "r=8,alpha=16,dropout=0,targets=q_proj,v_proj", "full"),
]

torch = vc.torch


def _adapters(t: int, sp: bool, dtype):
    """Megatron-Bridge's ``LoRALinear`` and ``ParallelLinearAdapter`` on a rank of ``t``."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    class Copy(torch.autograd.Function):
        # copy_to_tensor_model_parallel_region, and ColumnParallelLinear's allreduce_dgrad.
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous()
            dist.all_reduce(g)
            return g

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.contiguous()
            dist.all_reduce(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    class SeqGather(torch.autograd.Function):
        # _GatherFromSequenceParallelRegion, tensor_parallel_output_grad=True.
        @staticmethod
        def forward(ctx, x):
            shape = list(x.shape)
            shape[1] *= t
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x.contiguous())
            return out

        @staticmethod
        def backward(ctx, g):
            shape = list(g.shape)
            shape[1] //= t
            out = torch.empty(shape, dtype=g.dtype, device=g.device)
            dist.reduce_scatter_tensor(out, g.contiguous())
            return out

    class GatherLast(torch.autograd.Function):
        # _GatherFromModelParallelRegion: _gather_along_last_dim / _split_along_last_dim.
        @staticmethod
        def forward(ctx, x):
            shape = list(x.shape)
            shape[0] *= t
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x.contiguous())
            chunks = out.chunk(t, dim=0)
            return torch.cat(chunks, dim=-1).contiguous()

        @staticmethod
        def backward(ctx, g):
            n = g.shape[-1] // t
            return torch.split(g, n, dim=-1)[0].contiguous()

    class SplitView(torch.autograd.Function):
        # _ScatterToSequenceParallelRegion: the first-dimension slice of a sequence-first tensor
        # is contiguous, so `.contiguous()` is the view; batch-first here, the same bytes.
        @staticmethod
        def forward(ctx, x):
            n = x.shape[1] // t
            return x[:, 0:n]

        @staticmethod
        def backward(ctx, g):
            shape = list(g.shape)
            shape[1] *= t
            out = torch.empty(shape, dtype=g.dtype, device=g.device)
            dist.all_gather_into_tensor(out, g.contiguous())
            return out

    class ColumnPL(nn.Module):
        def __init__(self, in_f, out_local, gather_output, disable_grad_reduce=False):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(out_local, in_f, dtype=dtype))
            self.gather_output = gather_output
            self.disable_grad_reduce = disable_grad_reduce

        def forward(self, x):
            if not self.disable_grad_reduce:
                x = Copy.apply(x)
            out = F.linear(x, self.weight)
            return GatherLast.apply(out) if self.gather_output else out

    class RowPL(nn.Module):
        def __init__(self, in_local, out_f):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(out_f, in_local, dtype=dtype))

        def forward(self, x):
            return Reduce.apply(F.linear(x, self.weight))

    class ParallelLinearAdapter(nn.Module):
        def __init__(self, row, in_f, out_f, dim, alpha, dropout):
            super().__init__()
            self.row, self.dim, self.alpha = row, dim, alpha
            if row:
                self.linear_in = RowPL(in_f // t, dim)
                self.linear_out = ColumnPL(dim, out_f // t, gather_output=True)
            else:
                self.linear_in = ColumnPL(in_f, dim // t, gather_output=True, disable_grad_reduce=sp)
                self.linear_out = ColumnPL(dim, out_f // t, gather_output=False)
            self.dropout = nn.Dropout(dropout) if dropout > 0.0 else nn.Identity()

        def forward(self, x):
            x = self.dropout(x)
            if not self.row and sp:
                x = SeqGather.apply(x)
            x = self.linear_in(x)
            x = self.linear_out(x)
            if self.row and sp:
                x = SplitView.apply(x)
            return x * (self.alpha / self.dim)

    class LoRALinear(nn.Module):
        def __init__(self, to_wrap, adapter, owner=None):
            super().__init__()
            self.to_wrap = to_wrap
            self.adapter = adapter
            self._owner = [owner]  # not a submodule

        def forward(self, x, *args, **kwargs):
            linear_output = self.to_wrap(x, *args, **kwargs)
            layernorm_output = x if self._owner[0] is None else self._owner[0]._tp_pre()
            adapter_output = self.adapter(layernorm_output.contiguous())
            adapter_output = adapter_output.reshape(linear_output.shape)
            return linear_output + adapter_output

    return ParallelLinearAdapter, LoRALinear


def _stash_pre(module, args, kwargs):
    # A weak reference: the caller holds the input for the whole forward (and a checkpoint's
    # recomputation, which may stop early, before `_stash_clear` runs), so the stash keeps nothing
    # alive.
    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    module._tp_pre = weakref.ref(x)
    return None


def _stash_clear(module, args, kwargs, output):
    module._tp_pre = None
    return None


def apply_lora(m, model: str, spec: str, t: int, sp: bool, dtype):
    """Megatron-Bridge's LoRA on the rank's tensor-parallel linear layers of ``m``."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    cfg = parse_lora(spec)
    ParallelLinearAdapter, LoRALinear = _adapters(t, sp, dtype)
    owners = {"tinyllama-1.1b": ("self_attn", "mlp"), "bert-base": ("attention.self", "intermediate")}
    hooked = set()
    for name, mod in list(m.named_modules()):
        for o in owners.get(model, ()):
            if name.endswith("." + o):
                mod.register_forward_pre_hook(_stash_pre, with_kwargs=True, prepend=True)
                mod.register_forward_hook(_stash_clear, with_kwargs=True)
                hooked.add(name)
    targets = cfg["targets"]
    for name, mod in list(m.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if targets != ["all-linear"] and leaf not in targets:
            continue
        parent_name = name.rsplit(".", 1)[0] if "." in name else ""
        cls = type(mod).__name__
        if cls in ("RowConv1D", "RowLinear"):
            row, owner = True, None
            if cls == "RowConv1D":
                in_local, out_f = mod.weight.shape
            else:
                out_f, in_local = mod.weight.shape
            in_f = in_local * t
        elif cls == "ColumnConv1D":
            row, owner = False, None
            in_f, out_local = mod.weight.shape
            out_f = out_local * t
        elif isinstance(mod, nn.Linear) and parent_name in hooked:
            row, owner = False, m.get_submodule(parent_name)
            out_local, in_f = mod.weight.shape
            out_f = out_local * t
        else:
            continue  # replicated (or the vocabulary-parallel output layer): no adapter
        assert not isinstance(mod, Conv1D) or cls == "ColumnConv1D"
        ad = ParallelLinearAdapter(row, in_f, out_f, cfg["r"], cfg["alpha"], cfg["dropout"])
        setattr(m.get_submodule(parent_name), leaf, LoRALinear(mod, ad, owner))
    for n, p in m.named_parameters():
        p.requires_grad_(".adapter." in n)
    return m


def head_model(model: str, head: str, B: int, S: int, t: int, sp: bool, recipe):
    """``(model_fn, inputs_fn, loss_fn, optimizer_fn)``: HF's head class (as
    ``make_head_captures.py`` builds it) on the rank's split base model of ``make_tp_captures.py``;
    the head itself replicated, whole on every rank (Megatron's ``get_linear_layer``)."""
    import transformers as tf
    import transformers.models.bert.modeling_bert as mb

    make = {"gpt2": tpc.tp_gpt2, "tinyllama-1.1b": tpc.tp_llama, "bert-base": tpc.tp_bert}[model]
    lm_fn, _, _, optimizer_fn = make(recipe, t, sp)
    # make_tp_captures swaps BERT's CrossEntropyLoss for the vocabulary-parallel one (its MLM
    # head); a classifier's loss is the plain one.
    mb.CrossEntropyLoss = torch.nn.CrossEntropyLoss
    dtype = getattr(torch, vc.DTYPES[recipe.dtype])
    kind, _, n = head.partition(":")
    n = int(n) if n else 2
    kw = dict(attn_implementation="eager", use_cache=False, num_labels=n)
    if model == "gpt2":
        cfg = tf.GPT2Config(pad_token_id=50256, **kw)
    elif model == "bert-base":
        cfg = tf.BertConfig(**kw)
    else:
        cfg = tf.LlamaConfig(pad_token_id=0, **vc.TINYLLAMA, **kw)
    vocab = cfg.vocab_size

    import torch.distributed as dist

    class GatherReplicated(torch.autograd.Function):
        # gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False), as
        # Megatron's Pooler: forward _gather_along_first_dim (a new tensor); backward
        # _split_along_first_dim, the rank's first-dimension slice of a sequence-first tensor
        # (a view): written batch-first as the first numel/t elements of the gradient.
        @staticmethod
        def forward(ctx, x):
            shape = list(x.shape)
            ctx.shard = list(x.shape)
            shape[1] *= t
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x.contiguous())
            return out

        @staticmethod
        def backward(ctx, g):
            n = 1
            for d in ctx.shard:
                n *= d
            return g.reshape(-1)[0:n].view(ctx.shard)

    def gather_output(module, args, output):
        # After the final norm (GPT-2's ln_f, LLaMA's norm): the shard dies when replaced.
        return GatherReplicated.apply(output)

    def gather_encoder(module, args, output):
        # BERT: the encoder's last hidden state, before the pooler and the classifiers.
        output.last_hidden_state = GatherReplicated.apply(output.last_hidden_state)
        return output

    def model_fn():
        lm = lm_fn()
        base = {"gpt2": "transformer", "tinyllama-1.1b": "model", "bert-base": "bert"}[model]
        split = getattr(lm, base)
        if sp:
            if model == "gpt2":
                split.ln_f.register_forward_hook(gather_output)
            elif model == "bert-base":
                split.encoder.register_forward_hook(gather_encoder)
            else:
                split.norm.register_forward_hook(gather_output)
        if kind == "none":
            m = tf.AutoModel.from_config(cfg)
            if model == "bert-base":
                split.pooler = m.pooler
            return split.to(dtype)
        if kind == "seq-cls":
            m = tf.AutoModelForSequenceClassification.from_config(cfg)
        else:
            m = tf.AutoModelForTokenClassification.from_config(cfg)
        if model == "bert-base" and kind == "seq-cls":
            split.pooler = m.bert.pooler
        setattr(m, base, split)
        return m.to(dtype)

    def inputs_fn():
        inp = {"input_ids": torch.randint(0, vocab, (B, S))}
        if model != "bert-base":
            inp["attention_mask"] = torch.ones(B, S, dtype=torch.long)
        if kind == "seq-cls":
            inp["labels"] = torch.randint(0, n, (B,))
        elif kind == "token-cls":
            inp["labels"] = torch.randint(0, n, (B, S))
        return inp

    def loss_fn(m, inp):
        if kind == "none":
            return m(**inp).last_hidden_state.mean()
        return m(**inp).loss

    return model_fn, inputs_fn, loss_fn, optimizer_fn


def main() -> int:
    if torch is None:
        print("error: make_tp_finetune_captures needs torch: pip install torch transformers",
              file=sys.stderr)
        return 2
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.makedirs(OUT_DIR, exist_ok=True)
    rows = []
    only = sys.argv[1:]
    for case in CASES:
        model, B, S, dtype_name, t, sp, kind, spec = case[:8]
        ckpt = case[8] if len(case) > 8 else "none"
        recipe = vc.Recipe(model, B, S, dtype_name, "adamw", ckpt, 1, 2, attention="eager")
        tag = spec.replace(",", "+").replace("=", "").replace(".", "_").replace(":", "")
        base = f"{model}__b{B}s{S}__{recipe.name()}__tp{t}" + ("-sp" if sp else "") + f"__{kind}-{tag}"
        if only and base not in only:
            continue
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=t)
        make = {"gpt2": tpc.tp_gpt2, "tinyllama-1.1b": tpc.tp_llama, "bert-base": tpc.tp_bert}[model]
        if kind == "head":
            model_fn, inputs_fn, loss_fn, optimizer_fn = head_model(model, spec, B, S, t, sp, recipe)
        else:
            model_fn, inputs_fn, loss_fn, optimizer_fn = make(recipe, t, sp)
        dtype = getattr(torch, vc.DTYPES[dtype_name])
        built = {}

        def mfn(model_fn=model_fn, kind=kind, spec=spec, model=model, t=t, sp=sp, dtype=dtype,
                ckpt=ckpt):
            m = model_fn()
            if kind == "head":
                pass
            elif kind == "freeze":
                pats = spec.split(",")
                for name, p in m.named_parameters():
                    if any(matches(pat, name) for pat in pats):
                        p.requires_grad_(False)
            else:
                m = apply_lora(m, model, spec, t, sp, dtype)
            if ckpt == "full":
                m.activation_checkpointing_enable({"use_reentrant": False})
            built["m"] = m
            return m

        meta = {"model": model, "recipe": recipe.name(), "batch": B, "seq": S, "dtype": dtype_name,
                "optimizer": "adamw", "foreach": True, "checkpoint": ckpt,
                "attn_implementation": "eager", "tp": t, "sp": sp, kind: spec}
        cap = vc.capture(mfn, inputs_fn, loss_fn, optimizer_fn, 2, meta=meta)
        m = built["m"]
        trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
        total = sum(p.numel() for p in m.parameters())
        fx = mf.write_fixture(cap, recipe, OUT_DIR, base,
                              {"tp": t, "sp": sp, "attention": "eager", kind: spec,
                               "trainable_params": trainable})
        rows.append((base, total, trainable, fx["peak_requested_bytes"], fx["peak_phase"]))
        print(f"{base}: params {total} trainable {trainable} peak {fx['peak_requested_bytes']} "
              f"in {fx['peak_phase']}", flush=True)
    if only:
        return 0
    v = vc.versions()
    with open(os.path.join(OUT_DIR, "README.md"), "w") as f:
        f.write("# Reference captures: fine-tuning on one tensor-parallel rank (frozen parameters, "
                "Megatron-Bridge's LoRA)\n\n")
        f.write("Made by `models/tools/make_tp_finetune_captures.py` (run it from the repository root "
                "to regenerate; its docstring says how the adapters are written) on the rank of "
                "`models/tools/make_tp_captures.py`, in the format of `models/tests/fixtures/capture/` "
                "plus the recipe fields `tp`, `sp`, `freeze` or `lora` (vramsim's option syntax) and "
                "`trainable_params`.\n\n")
        f.write(f"Versions: torch {v['torch']}, transformers {v['transformers']}, "
                f"python {v['python']}.\n\n")
        f.write("| capture | params | trainable | peak_requested_bytes | peak phase |\n"
                "| --- | ---: | ---: | ---: | --- |\n")
        for base, total, trainable, peak, phase in rows:
            f.write(f"| {base} | {total:,} | {trainable:,} | {peak:,} | {phase} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
