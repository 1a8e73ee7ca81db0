"""Capture nanoGPT training steps on the ``meta`` device (and on fake CPU tensors with CUDA's autocast for
fp16 AMP), as reference fixtures in ``models/tests/captures/nanogpt/`` (checked by
``models/tests/nanogpt_captures.rs``).

The model below restates karpathy/nanoGPT's ``model.py`` (commit ``f08abb45``) module for module, with the
same parameters, buffer, ops and op order: ``LayerNorm(ndim, bias)`` calling ``F.layer_norm(x, w.shape, w,
b_or_None, 1e-5)``; ``CausalSelfAttention`` with ``nn.Linear`` projections and, on the manual path
(``flash = False``), the float32 ``bias`` buffer ``tril(ones(T, T)).view(1, 1, T, T)`` registered after
the projections, ``(q @ k.transpose(-2, -1)) * (1 / sqrt(hs))``, ``masked_fill(bias[:, :, :T, :T] == 0,
-inf)``, ``F.softmax``, dropout, ``@ v``; ``MLP`` with ``nn.GELU()``; the ``GPT`` module with ``wte``,
``wpe``, ``drop``, ``h``, ``ln_f`` in a ``ModuleDict``, ``lm_head`` (no bias) whose weight *is*
``wte.weight``, and ``forward(idx, targets)`` computing the logits on every position and
``F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1)``. The loop keeps what the model
returns, as ``train.py``'s ``logits, loss = model(X, Y)`` does (``keep``), until the next step rebinds it.
The zoo's SDPA path (``flash``) is not captured: on the meta device SDPA runs the math backend, not CUDA's
fused kernels.

Run from the repository root (torch only; no GPU, no network)::

    python models/tools/make_nanogpt_captures.py
"""

from __future__ import annotations

import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "traces", "python"))

import make_fixtures as mf  # noqa: E402
import vramsim_capture as vc  # noqa: E402

OUT_DIR = os.path.join(ROOT, "models", "tests", "captures", "nanogpt")

# zoo name -> (n_layer, n_head, n_embd, bias)
CONFIGS = {
    "nanogpt": (12, 12, 768, True),
    "nanogpt-nobias": (12, 12, 768, False),
}

# (zoo model, batch, seq, dtype, keep outputs)
CASES = [
    ("nanogpt-nobias", 2, 64, "fp32", True),
    ("nanogpt", 2, 64, "fp32", False),
    ("nanogpt", 2, 64, "bf16", True),
    ("nanogpt-nobias", 2, 64, "amp-fp16", True),
]


def modules():
    import torch
    from torch import nn
    from torch.nn import functional as F

    class LayerNorm(nn.Module):
        def __init__(self, ndim, bias):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(ndim))
            self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

        def forward(self, x):
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)

    class CausalSelfAttention(nn.Module):
        def __init__(self, n_embd, n_head, block, bias):
            super().__init__()
            self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
            self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
            self.attn_dropout = nn.Dropout(0.0)
            self.resid_dropout = nn.Dropout(0.0)
            self.n_head, self.n_embd = n_head, n_embd
            mask = torch.tril(torch.ones(block, block)).view(1, 1, block, block)
            self.register_buffer("bias", mask)

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_dropout(self.c_proj(y))

    class MLP(nn.Module):
        def __init__(self, n_embd, bias):
            super().__init__()
            self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
            self.dropout = nn.Dropout(0.0)

        def forward(self, x):
            return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

    class Block(nn.Module):
        def __init__(self, n_embd, n_head, block, bias):
            super().__init__()
            self.ln_1 = LayerNorm(n_embd, bias)
            self.attn = CausalSelfAttention(n_embd, n_head, block, bias)
            self.ln_2 = LayerNorm(n_embd, bias)
            self.mlp = MLP(n_embd, bias)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            x = x + self.mlp(self.ln_2(x))
            return x

    class GPT(nn.Module):
        def __init__(self, n_layer, n_head, n_embd, bias, vocab=50304, block=1024):
            super().__init__()
            self.block = block
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(vocab, n_embd),
                wpe=nn.Embedding(block, n_embd),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList([Block(n_embd, n_head, block, bias) for _ in range(n_layer)]),
                ln_f=LayerNorm(n_embd, bias),
            ))
            self.lm_head = nn.Linear(n_embd, vocab, bias=False)
            self.transformer.wte.weight = self.lm_head.weight

        def forward(self, idx, targets):
            b, t = idx.size()
            pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
            tok_emb = self.transformer.wte(idx)
            pos_emb = self.transformer.wpe(pos)
            x = self.transformer.drop(tok_emb + pos_emb)
            for block in self.transformer.h:
                x = block(x)
            x = self.transformer.ln_f(x)
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
            return logits, loss

    return GPT


def build(model, B, S, dtype_name, keep):
    import torch

    GPT = modules()
    n_layer, n_head, n_embd, bias = CONFIGS[model]
    dtype = getattr(torch, vc.DTYPES[dtype_name])
    state = {}

    def model_fn():
        return GPT(n_layer, n_head, n_embd, bias).to(dtype)

    def inputs_fn():
        return (torch.randint(0, 50304, (B, S)), torch.randint(0, 50304, (B, S)))

    def loss_fn(m, inp):
        logits, loss = m(inp[0], inp[1])
        if keep:
            state["out"] = (logits, loss)  # logits, loss = model(X, Y)
        return loss

    def optimizer_fn(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=True)

    return model_fn, inputs_fn, loss_fn, optimizer_fn


def main() -> int:
    if vc.torch is None:
        print("error: make_nanogpt_captures needs torch: pip install torch", file=sys.stderr)
        return 2
    os.makedirs(OUT_DIR, exist_ok=True)
    rows = []
    for model, B, S, dtype, keep in CASES:
        recipe = vc.Recipe(model, B, S, dtype, "adamw", "none", 1, 2)
        meta = {"model": model, "recipe": recipe.name(), "batch": B, "seq": S, "dtype": dtype,
                "optimizer": "adamw", "foreach": True, "checkpoint": "none",
                "attn_implementation": "eager"}
        amp = recipe.amp()
        cap = vc.capture(*build(model, B, S, dtype, keep), iterations=2, meta=meta,
                         device="cpu" if amp else "meta", amp=amp)
        base = f"{model}__b{B}s{S}__{dtype}" + ("-keep" if keep else "")
        fx = mf.write_fixture(cap, recipe, OUT_DIR, base, {"keep_outputs": keep})
        rows.append((base, fx["params"], fx["peak_requested_bytes"], fx["peak_phase"]))
        print(f"{base}: params {fx['params']} peak {fx['peak_requested_bytes']} in {fx['peak_phase']}")
    v = vc.versions()
    with open(os.path.join(OUT_DIR, "README.md"), "w") as f:
        f.write("# Reference captures: nanoGPT\n\n")
        f.write("Made by `models/tools/make_nanogpt_captures.py` (its docstring says how the model and "
                "loop are built) with `traces/python/vramsim_capture.py`: fp32/bf16 on the meta device, "
                "amp-fp16 on fake CPU tensors with CUDA's autocast policy and a GradScaler; nanoGPT's "
                "manual attention with its float32 `bias` buffers; AdamW foreach; two iterations. "
                "`models/tests/nanogpt_captures.rs` checks the parameter count, the peak and the peak "
                "of every phase segment exactly.\n\n")
        f.write(f"Versions: torch {v['torch']}, python {v['python']}.\n\n")
        f.write("| capture | params | peak_requested_bytes | peak phase |\n| --- | ---: | ---: | --- |\n")
        for base, params, peak, phase in rows:
            f.write(f"| {base} | {params:,} | {peak:,} | {phase} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
