"""Capture the training-loop knobs that the meta device can show, as references for
``models/tests/loop_knobs.rs`` (written to ``models/tests/knob_captures/``).

Each case is a zoo model of ``vramsim_capture`` with its own optimizer (and ``zero_grad``) in place of
the zoo's, two iterations on the ``meta`` device:

* ``sgd-nesterov``: ``torch.optim.SGD(momentum=0.9, nesterov=True)``, foreach and for-loop;
* ``adamw-zero``: ``AdamW(foreach=True)`` with ``optimizer.zero_grad(set_to_none=False)``;
* ``adafactor-hf``: ``transformers.optimization.Adafactor(scale_parameter=False,
  relative_step=False)``, what HF Trainer builds for ``optim="adafactor"``.

Gradient clipping and the GradScaler cannot be captured here: on the meta device ``clip_grad_norm_``
takes its per-tensor fallback (``_has_foreach_support`` is false off CUDA/CPU) and GradScaler needs
CUDA; their rules are read from the sources (``models/src/lower/optim.rs``).

Run from the repository root (needs torch, torchvision, transformers)::

    python traces/python/make_knob_captures.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vramsim_capture as vc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT_DIR = os.path.join(ROOT, "models", "tests", "knob_captures")

# (model, batch, seq, dtype, optimizer, zero_grad set_to_none)
CASES = [
    ("mlp", 64, 1, "fp32", "sgd-nesterov", True),
    ("mlp", 64, 1, "fp32", "sgd-nesterov-for-loop", True),
    ("mlp", 64, 1, "fp32", "adamw-zero", False),
    ("mlp", 64, 1, "fp32", "adafactor-hf", True),
    ("mlp", 64, 1, "bf16", "adafactor-hf", True),
    ("resnet18", 2, 1, "fp32", "adafactor-hf", True),
    ("gpt2", 2, 128, "bf16", "adafactor-hf", True),
]


def optimizer_fn(name: str, set_to_none: bool):
    import torch
    from transformers.optimization import Adafactor

    def make(params):
        if name == "sgd-nesterov":
            opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, nesterov=True, foreach=True)
        elif name == "sgd-nesterov-for-loop":
            opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, nesterov=True, foreach=False)
        elif name == "adamw-zero":
            opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
        elif name == "adafactor-hf":
            opt = Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)
        else:
            raise ValueError(name)
        if not set_to_none:
            zero_grad = opt.zero_grad
            opt.zero_grad = lambda set_to_none=True: zero_grad(set_to_none=False)
        return opt

    return make


def main() -> int:
    if vc.torch is None:
        print("error: needs torch, torchvision and transformers", file=sys.stderr)
        return 2
    os.makedirs(OUT_DIR, exist_ok=True)
    for model, batch, seq, dtype, opt, set_to_none in CASES:
        recipe = vc.Recipe(model, batch, seq, dtype, "sgd", "none", 1, 2)
        model_fn, inputs_fn, loss_fn, _ = vc.zoo(recipe)
        cap = vc.capture(model_fn, inputs_fn, loss_fn, optimizer_fn(opt, set_to_none), 2,
                         meta={"model": model, "batch": batch, "seq": seq, "dtype": dtype,
                               "optimizer": opt, "zero_grad_set_to_none": set_to_none})
        shape = f"b{batch}" if model in ("mlp", "resnet18") else f"b{batch}s{seq}"
        path = os.path.join(OUT_DIR, f"{model}__{shape}__{dtype}-{opt}.jsonl.gz")
        cap.write(path)
        s = cap.summary()
        print(f"{os.path.basename(path):50s} peak {s['peak_requested_bytes']:>14,d} B ({s['peak_phase']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
