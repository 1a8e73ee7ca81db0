"""Capture one tensor-parallel rank of HF's GPT-2, TinyLlama and BERT on the ``meta`` device, as
reference fixtures in ``models/tests/captures/tp/`` (checked by ``models/tests/tensor_parallel.rs``).

The models are transformers' ``GPT2LMHeadModel``, ``LlamaForCausalLM`` and ``BertForMaskedLM`` with
their modules split as Megatron-LM splits a transformer (``megatron/core/tensor_parallel/``: ``layers.py``, ``mappings.py``,
``cross_entropy.py``), written here operation by operation after Megatron's code:

* ``VocabParallelEmbedding``: the mask of ids outside the rank's range, ``ids.clone() - start``
  masked, ``F.embedding`` of the rank's rows, masked rows zeroed, the in-place all-reduce;
* column-parallel ``c_attn``/``c_fc`` (HF ``Conv1D`` with ``nf/t`` columns; LLaMA's
  ``q/k/v_proj``, ``gate_proj``, ``up_proj`` with their heads/t, KV heads/t and width/t, one input
  for the attention and one for the MLP, as Megatron's fused ``linear_qkv`` and ``linear_fc1``;
  BERT's ``query/key/value`` and ``intermediate.dense``) behind
  ``copy_to_tensor_model_parallel_region`` (identity; all-reduce of the input gradient) or, with
  sequence parallelism, the all-gather into Megatron's persistent ``GlobalMemoryBuffer`` that
  saves the local shard and reduce-scatters the input gradient into a new shard (a frozen weight
  takes ``linear_with_frozen_weight``: ``gather_from_sequence_parallel_region`` into a new tensor,
  the shard not saved);
* row-parallel ``c_proj`` (``nx/t`` rows; LLaMA's ``o_proj``, ``down_proj``; BERT's
  ``attention.output.dense``, ``output.dense``): the product, the in-place all-reduce (or the reduce-scatter
  into a new sequence shard), then the whole bias added;
* the ``lm_head`` (GPT-2's tied; BERT's tied ``decoder`` with its bias share) column-parallel, and
  BERT's ``CrossEntropyLoss`` likewise replaced, HF's ``ForCausalLMLoss`` steps with Megatron's
  ``vocab_parallel_cross_entropy`` in place of ``cross_entropy``;
* with sequence parallelism the embeddings' sequence shard taken as the first step of the module
  after the sum (GPT-2's embedding dropout, BERT's embedding LayerNorm).

LLaMA is captured without sequence parallelism: HF's ``LlamaModel.forward`` derives the position
ids and the causal mask from the embeddings' sequence length, which the sequence shard would cut.

The process group is PyTorch's fake backend (``torch.testing._internal.distributed.fake_pg``):
rank 0 of ``world_size = t``, collectives that touch no data, so the meta device records the
rank's allocations. The vocabulary is padded as Megatron pads it (``calculate_padded_vocab_size``,
a multiple of 128·t). Run from the repository root (torch, transformers; no GPU, no network)::

    python models/tools/make_tp_captures.py
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "traces", "python"))

import make_fixtures as mf  # noqa: E402
import vramsim_capture as vc  # noqa: E402

OUT_DIR = os.path.join(ROOT, "models", "tests", "captures", "tp")

# (model, batch, seq, dtype, tp, sp)
CASES = [
    ("gpt2", 2, 128, "bf16", 2, False),
    ("gpt2", 2, 128, "bf16", 2, True),
    # GPT2Model.forward ends with `hidden_states.view(-1, seq, h)`: on the sequence shard of --sp
    # that view holds only when batch × seq/t is a multiple of seq (it allocates nothing).
    ("gpt2", 4, 128, "fp32", 4, True),
    ("tinyllama-1.1b", 2, 128, "bf16", 2, False),
    ("tinyllama-1.1b", 2, 128, "fp32", 4, False),
    ("bert-base", 2, 128, "bf16", 2, False),
    ("bert-base", 2, 128, "bf16", 2, True),
]

torch = vc.torch


def _functions(t: int, sp: bool):
    """The rank's collectives and split modules for a group of ``t`` ranks."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    buffers: dict = {}

    def global_buffer(shape, dtype):
        # GlobalMemoryBuffer.get_tensor(shape, dtype, "mpu"): one flat buffer per dtype, made
        # again only when a larger request comes.
        n = 1
        for d in shape:
            n *= d
        if dtype not in buffers or buffers[dtype].numel() < n:
            buffers[dtype] = torch.empty(n, dtype=dtype, requires_grad=False)
        return buffers[dtype][0:n].view(*shape)

    def seq_scaled(shape, num, den):
        shape = list(shape)
        shape[1] = shape[1] * num // den
        return shape

    class CopyToTp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous()
            dist.all_reduce(g)
            return g

    class ReduceFromTp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.contiguous()
            dist.all_reduce(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    class GatherToBuffer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            buf = global_buffer(seq_scaled(x.shape, t, 1), x.dtype)
            dist.all_gather_into_tensor(buf, x)
            return buf

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            buf = global_buffer(seq_scaled(x.shape, t, 1), x.dtype)
            dist.all_gather_into_tensor(buf, x)
            sub = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(sub, g.contiguous())
            return sub

    class ReduceScatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = torch.empty(seq_scaled(x.shape, 1, t), dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(out, x.contiguous())
            return out

        @staticmethod
        def backward(ctx, g):
            full = torch.empty(seq_scaled(g.shape, t, 1), dtype=g.dtype, device=g.device)
            dist.all_gather_into_tensor(full, g.contiguous())
            return full

    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            n = x.shape[1] // t
            return x[:, 0:n].contiguous()

        @staticmethod
        def backward(ctx, g):
            full = torch.empty(seq_scaled(g.shape, t, 1), dtype=g.dtype, device=g.device)
            dist.all_gather_into_tensor(full, g.contiguous())
            return full

    class SeqGather(torch.autograd.Function):
        # gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True): a new
        # tensor; backward reduce-scatters into a new shard.
        @staticmethod
        def forward(ctx, x):
            out = torch.empty(seq_scaled(x.shape, t, 1), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x.contiguous())
            return out

        @staticmethod
        def backward(ctx, g):
            out = torch.empty(seq_scaled(g.shape, 1, t), dtype=g.dtype, device=g.device)
            dist.reduce_scatter_tensor(out, g.contiguous())
            return out

    def column_input(x, frozen=False):
        # A frozen weight takes Megatron's `linear_with_frozen_weight` (ColumnParallelLinear.forward:
        # `if not weight.requires_grad`), which under sequence parallelism gathers with
        # `gather_from_sequence_parallel_region` (a new tensor) and saves only the weight.
        if sp and frozen:
            return SeqGather.apply(x)
        return GatherToBuffer.apply(x) if sp else CopyToTp.apply(x)

    def frozen(*linears):
        # The base weights (a LoRA wrapper's `to_wrap`) of the column-parallel linears reading one
        # input are all frozen.
        ws = [getattr(m, "to_wrap", m).weight for m in linears]
        return bool(ws) and not any(w.requires_grad for w in ws)

    def row_output(x):
        return ReduceScatter.apply(x) if sp else ReduceFromTp.apply(x)

    class ColumnConv1D(Conv1D):
        def forward(self, x):
            return super().forward(column_input(x, frozen(self)))

    class RowConv1D(nn.Module):
        def __init__(self, nf, nx):
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.empty(nx, nf))
            self.bias = nn.Parameter(torch.empty(nf))

        def forward(self, x):
            size_out = x.size()[:-1] + (self.nf,)
            out = torch.mm(x.view(-1, x.size(-1)), self.weight).view(size_out)
            return row_output(out) + self.bias

    class VocabParallelEmbedding(nn.Module):
        def __init__(self, n, h):
            super().__init__()
            self.start, self.end = 0, n
            self.weight = nn.Parameter(torch.empty(n, h))

        def forward(self, ids):
            input_mask = (ids < self.start) | (ids >= self.end)
            masked_input = ids.clone() - self.start
            masked_input[input_mask] = 0
            out = F.embedding(masked_input, self.weight)
            out[input_mask, :] = 0.0
            return ReduceFromTp.apply(out)

    class RowLinear(nn.Module):
        def __init__(self, out_features, in_features, bias=False):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(out_features, in_features))
            self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

        def forward(self, x):
            # Megatron's `output_` is a local too; as a temporary it dies right after the bias
            # add instead of right after `output_parallel` at the return: two frees with no
            # allocation between them, the same allocator state either way.
            output_parallel = F.linear(x, self.weight)
            if self.bias is None:
                return row_output(output_parallel)
            return row_output(output_parallel) + self.bias

    column_names = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value",
                    "dense")

    def column_input_hook(module, args, kwargs):
        # The one input of a module's column-parallel linears (LLaMA's attention and MLP).
        fz = frozen(*[c for n, c in module.named_children() if n in column_names])
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = column_input(kwargs["hidden_states"], fz)
        else:
            args = (column_input(args[0], fz),) + tuple(args[1:])
        return args, kwargs

    class ColumnLmHead(nn.Linear):
        def forward(self, x):
            return F.linear(column_input(x, frozen(self)), self.weight, self.bias)

    class ScatterDropout(nn.Dropout):
        def forward(self, x):
            return super().forward(Scatter.apply(x) if sp else x)

    class VocabParallelCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target):
            logits = logits.float()
            logits_max = torch.max(logits, dim=-1)[0]
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX)
            logits -= logits_max.unsqueeze(dim=-1)
            start, end = 0, logits.size(-1)
            target_mask = (target < start) | (target >= end)
            masked_target = target.clone() - start
            masked_target[target_mask] = 0
            logits_2d = logits.view(-1, logits.size(-1))
            masked_target_1d = masked_target.view(-1)
            arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
            predicted_1d = logits_2d[arange_1d, masked_target_1d]
            predicted_1d = predicted_1d.clone().contiguous()
            predicted = predicted_1d.view_as(target)
            predicted[target_mask] = 0.0
            exp_logits = logits
            torch.exp(logits, out=exp_logits)
            sum_exp = exp_logits.sum(dim=-1)
            dist.all_reduce(predicted)
            dist.all_reduce(sum_exp)
            loss = torch.log(sum_exp) - predicted
            exp_logits.div_(sum_exp.unsqueeze(dim=-1))
            ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            softmax, target_mask, masked_target_1d = ctx.saved_tensors
            grad_input = softmax
            grad_2d = grad_input.view(-1, softmax.size(-1))
            arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
            softmax_update = 1.0 - target_mask.view(-1).float()
            grad_2d[arange_1d, masked_target_1d] -= softmax_update
            grad_input.mul_(grad_output.unsqueeze(dim=-1))
            return grad_input, None

    def loss_function(logits, labels, vocab_size=None, **kwargs):
        # HF's ForCausalLMLoss with vocab_parallel_cross_entropy and a mean over the tokens.
        logits = logits.float()
        labels = nn.functional.pad(labels, (0, 1), value=-100)
        shift_labels = labels[..., 1:].contiguous()
        logits = logits.view(-1, logits.size(-1))
        shift_labels = shift_labels.view(-1)
        return VocabParallelCrossEntropy.apply(logits, shift_labels).mean()

    class ScatterLayerNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(Scatter.apply(x) if sp else x)

    class TpCrossEntropyLoss(nn.Module):
        # BertForMaskedLM's `CrossEntropyLoss()(scores.view(-1, V), labels.view(-1))`.
        def forward(self, logits, target):
            return VocabParallelCrossEntropy.apply(logits, target).mean()

    return (ColumnConv1D, RowConv1D, VocabParallelEmbedding, ColumnLmHead, ScatterDropout,
            loss_function, RowLinear, column_input_hook, TpCrossEntropyLoss, ScatterLayerNorm)


def tp_gpt2(recipe: "vc.Recipe", t: int, sp: bool):
    """``(model_fn, inputs_fn, loss_fn, optimizer_fn)`` of GPT-2's rank 0 of ``t``."""
    import transformers as tf

    (ColumnConv1D, RowConv1D, VocabParallelEmbedding, ColumnLmHead, ScatterDropout,
     loss_function, _, _, _, _) = _functions(t, sp)
    _, inputs_fn, _, optimizer_fn = vc.zoo(recipe)
    dtype = getattr(torch, vc.DTYPES[recipe.dtype])
    cfg = vc._hf_config("gpt2", "eager")
    h, inner = cfg.n_embd, cfg.n_inner or 4 * cfg.n_embd
    multiple = 128 * t
    local_vocab = (cfg.vocab_size + multiple - 1) // multiple * multiple // t

    def model_fn():
        m = tf.GPT2LMHeadModel(cfg)
        m.loss_type = "ForCausalLM"
        tr = m.transformer
        tr.wte = VocabParallelEmbedding(local_vocab, h)
        tr.drop = ScatterDropout(cfg.embd_pdrop)
        for blk in tr.h:
            blk.attn.c_attn = ColumnConv1D(3 * h // t, h)
            blk.attn.c_proj = RowConv1D(h, h // t)
            blk.attn.split_size = h // t
            blk.mlp.c_fc = ColumnConv1D(inner // t, h)
            blk.mlp.c_proj = RowConv1D(h, inner // t)
        m.lm_head = ColumnLmHead(h, local_vocab, bias=False)
        m.lm_head.weight = tr.wte.weight
        return m.to(dtype)

    # `PreTrainedModel.loss_function` is a property: this script's GPT-2 class gets the rank's loss.
    tf.GPT2LMHeadModel.loss_function = property(lambda self: loss_function)

    def loss_fn(model, inp):
        return model(**inp).loss

    return model_fn, inputs_fn, loss_fn, optimizer_fn


def tp_llama(recipe: "vc.Recipe", t: int, sp: bool):
    """``(model_fn, inputs_fn, loss_fn, optimizer_fn)`` of TinyLlama's rank 0 of ``t``."""
    import transformers as tf
    from torch import nn

    assert not sp, "LLaMA is captured without sequence parallelism (see the module docstring)"
    (_, _, VocabParallelEmbedding, ColumnLmHead, _, loss_function, RowLinear,
     column_input_hook, _, _) = _functions(t, sp)
    _, inputs_fn, _, optimizer_fn = vc.zoo(recipe)
    dtype = getattr(torch, vc.DTYPES[recipe.dtype])
    cfg = vc._hf_config("tinyllama-1.1b", "eager")
    h, inter = cfg.hidden_size, cfg.intermediate_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = h // nh
    multiple = 128 * t
    local_vocab = (cfg.vocab_size + multiple - 1) // multiple * multiple // t

    def model_fn():
        m = tf.LlamaForCausalLM(cfg)
        m.loss_type = "ForCausalLM"
        m.model.embed_tokens = VocabParallelEmbedding(local_vocab, h)
        for layer in m.model.layers:
            a, f = layer.self_attn, layer.mlp
            a.q_proj = nn.Linear(h, nh * hd // t, bias=False)
            a.k_proj = nn.Linear(h, nkv * hd // t, bias=False)
            a.v_proj = nn.Linear(h, nkv * hd // t, bias=False)
            a.o_proj = RowLinear(h, nh * hd // t)
            a.register_forward_pre_hook(column_input_hook, with_kwargs=True)
            f.gate_proj = nn.Linear(h, inter // t, bias=False)
            f.up_proj = nn.Linear(h, inter // t, bias=False)
            f.down_proj = RowLinear(h, inter // t)
            f.register_forward_pre_hook(column_input_hook, with_kwargs=True)
        m.lm_head = ColumnLmHead(h, local_vocab, bias=False)
        return m.to(dtype)

    tf.LlamaForCausalLM.loss_function = property(lambda self: loss_function)

    def loss_fn(model, inp):
        return model(**inp).loss

    return model_fn, inputs_fn, loss_fn, optimizer_fn


def tp_bert(recipe: "vc.Recipe", t: int, sp: bool):
    """``(model_fn, inputs_fn, loss_fn, optimizer_fn)`` of BERT's rank 0 of ``t`` (masked LM)."""
    import transformers as tf
    import transformers.models.bert.modeling_bert as mb
    from torch import nn

    (_, _, VocabParallelEmbedding, ColumnLmHead, _, _, RowLinear, column_input_hook,
     TpCrossEntropyLoss, ScatterLayerNorm) = _functions(t, sp)
    _, inputs_fn, loss_fn, optimizer_fn = vc.zoo(recipe)
    dtype = getattr(torch, vc.DTYPES[recipe.dtype])
    cfg = vc._hf_config("bert-base", "eager")
    h, inter = cfg.hidden_size, cfg.intermediate_size
    multiple = 128 * t
    local_vocab = (cfg.vocab_size + multiple - 1) // multiple * multiple // t

    def model_fn():
        m = tf.BertForMaskedLM(cfg)
        emb = m.bert.embeddings
        emb.word_embeddings = VocabParallelEmbedding(local_vocab, h)
        emb.LayerNorm = ScatterLayerNorm(h, eps=cfg.layer_norm_eps)
        for layer in m.bert.encoder.layer:
            a = layer.attention
            a.self.query = nn.Linear(h, h // t)
            a.self.key = nn.Linear(h, h // t)
            a.self.value = nn.Linear(h, h // t)
            a.self.register_forward_pre_hook(column_input_hook, with_kwargs=True)
            a.output.dense = RowLinear(h, h // t, bias=True)
            layer.intermediate.dense = nn.Linear(h, inter // t)
            layer.intermediate.register_forward_pre_hook(column_input_hook, with_kwargs=True)
            layer.output.dense = RowLinear(h, inter // t, bias=True)
        p = m.cls.predictions
        p.bias = nn.Parameter(torch.zeros(local_vocab))
        p.decoder = ColumnLmHead(h, local_vocab, bias=True)
        p.decoder.weight = emb.word_embeddings.weight
        p.decoder.bias = p.bias
        # `scores.view(-1, self.config.vocab_size)`: the rank's share.
        m.config.vocab_size = local_vocab
        return m.to(dtype)

    mb.CrossEntropyLoss = TpCrossEntropyLoss
    return model_fn, inputs_fn, loss_fn, optimizer_fn


def main() -> int:
    if torch is None:
        print("error: make_tp_captures needs torch: pip install torch transformers", file=sys.stderr)
        return 2
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.makedirs(OUT_DIR, exist_ok=True)
    rows = []
    for model, B, S, dtype, t, sp in CASES:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=t)
        recipe = vc.Recipe(model, B, S, dtype, "adamw", "none", 1, 2, attention="eager")
        make = {"gpt2": tp_gpt2, "tinyllama-1.1b": tp_llama, "bert-base": tp_bert}[model]
        model_fn, inputs_fn, loss_fn, optimizer_fn = make(recipe, t, sp)
        meta = {"model": model, "recipe": recipe.name(), "batch": B, "seq": S, "dtype": dtype,
                "optimizer": "adamw", "foreach": True, "checkpoint": "none",
                "attn_implementation": "eager", "tp": t, "sp": sp}
        cap = vc.capture(model_fn, inputs_fn, loss_fn, optimizer_fn, 2, meta=meta)
        base = f"{model}__b{B}s{S}__{recipe.name()}__tp{t}" + ("-sp" if sp else "")
        fx = mf.write_fixture(cap, recipe, OUT_DIR, base, {"tp": t, "sp": sp, "attention": "eager"})
        rows.append((base, fx["params"], fx["peak_requested_bytes"], fx["peak_phase"]))
        print(f"{base}: params {fx['params']}, peak {fx['peak_requested_bytes']} in {fx['peak_phase']}")
    v = vc.versions()
    with open(os.path.join(OUT_DIR, "README.md"), "w") as f:
        f.write("# Reference captures: one tensor-parallel rank of GPT-2, TinyLlama and BERT (Megatron-LM's split)\n\n")
        f.write("Made by `models/tools/make_tp_captures.py` (run it from the repository root to "
                "regenerate) with `traces/python/vramsim_capture.py` on the meta device, rank 0 of "
                "PyTorch's fake process group, in the format of `models/tests/fixtures/capture/` plus "
                "the recipe fields `tp` and `sp`. The tool's docstring says how the HF modules are "
                "split.\n\n")
        f.write(f"Versions: torch {v['torch']}, transformers {v['transformers']}, "
                f"python {v['python']}.\n\n")
        f.write("| capture | params | peak_requested_bytes | peak phase |\n| --- | ---: | ---: | --- |\n")
        for base, params, peak, phase in rows:
            f.write(f"| {base} | {params:,} | {peak:,} | {phase} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
