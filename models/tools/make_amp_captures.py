"""Record mixed-precision (AMP) training steps of every zoo family as reference fixtures in
``models/tests/fixtures/amp/``.

Each step runs on fake CPU tensors (``FakeTensorMode``: no memory, no compute, no GPU) under
``torch.autocast("cpu", dtype)`` with CUDA's autocast policy installed on the CPU autocast key
(``traces/python/cuda_autocast.py``: the ops and the policy of each are read off the installed wheel's
``AutocastCUDA`` kernels), CUDA's kernel choices (fused dropout with a bool mask, the SDPA backend pinned, CUDA's
float32 normalization statistics) and, for fp16, a ``GradScaler``; see ``traces/python/vramsim_capture.py``.

Recipes: ``amp-fp16`` (float32 parameters, fp16 autocast, ``GradScaler``) and ``amp-bf16`` (bf16 autocast, no
scaler); AdamW and SGD (``foreach=True``, CUDA's default); no checkpointing, non-reentrant
``torch.utils.checkpoint`` around every block (``ckptfull``) or around each SDPA call (``ckptselective``, the
attention core, with the SDPA models), torchtitan's op-level selective checkpointing of every block
(``ckptselective-op``, ``vramsim_capture.torchtitan_op_sac_context_fn``); 1 or 4 micro-batches per step (``accum4``); HF
models with eager attention, BERT also with SDPA and ViT-B/16 always with SDPA, the backend pinned
(``sdpa-flash``: FlashAttention-2, ``sdpa-mem-efficient``). Small shapes so that the files stay small, and a few
larger SGD steps (``LARGE``) whose peak is in the forward/backward rather than in the optimizer step.

The fixtures have the format of ``traces/python/make_fixtures.py`` plus ``recipe.attention`` and ``tool.amp``;
``models/tests/amp_fixtures.rs`` lowers each recipe and compares. Run from the repository root (torch,
torchvision, transformers; no GPU, no network)::

    python models/tools/make_amp_captures.py [--only MODEL ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "traces", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import make_captures as mc  # noqa: E402
import make_fixtures as mf  # noqa: E402
import vramsim_capture as vc  # noqa: E402

OUT_DIR = os.path.join(ROOT, "models", "tests", "fixtures", "amp")
MAX_TRACE_KIB = 300

SHAPES = {"mlp": (64, None), "resnet18": (2, None), "resnet50": (2, None), "vgg16": (2, None),
          "vit-b-16": (2, None), "gpt2": (2, 128), "bert-base": (2, 128), "tinyllama-1.1b": (2, 128)}

# (model, dtype, optimizer, checkpoint, accum, attention)
CASES = [
    (m, d, o, c, a, "eager")
    for m in ("mlp", "resnet18", "gpt2", "bert-base", "tinyllama-1.1b")
    for d, o, c, a in (("amp-fp16", "adamw", "none", 1), ("amp-bf16", "adamw", "none", 1),
                       ("amp-fp16", "sgd", "none", 1), ("amp-fp16", "adamw", "full", 1),
                       ("amp-bf16", "sgd", "full", 1), ("amp-fp16", "adamw", "none", 4))
] + [
    ("resnet50", "amp-fp16", "adamw", "none", 1, "eager"),
    ("resnet50", "amp-bf16", "sgd", "full", 1, "eager"),
    ("vgg16", "amp-fp16", "sgd", "none", 1, "eager"),
    ("vgg16", "amp-bf16", "adamw", "full", 1, "eager"),
    ("bert-base", "amp-fp16", "adamw", "none", 1, "sdpa-flash"),
    ("bert-base", "amp-bf16", "adamw", "none", 1, "sdpa-mem-efficient"),
    ("vit-b-16", "amp-fp16", "adamw", "none", 1, "sdpa-flash"),
    ("vit-b-16", "amp-bf16", "sgd", "none", 1, "sdpa-flash"),
    ("vit-b-16", "amp-fp16", "adamw", "none", 1, "sdpa-mem-efficient"),
    ("vit-b-16", "amp-fp16", "sgd", "full", 1, "sdpa-flash"),
    ("vit-b-16", "amp-bf16", "adamw", "none", 4, "sdpa-flash"),
    # selective: the SDPA call (the attention core) recomputed
    ("vit-b-16", "amp-fp16", "sgd", "selective", 1, "sdpa-flash"),
    ("vit-b-16", "amp-bf16", "sgd", "selective", 1, "sdpa-mem-efficient"),
    ("bert-base", "amp-fp16", "sgd", "selective", 1, "sdpa-flash"),
    # selective-op: torchtitan's op-level SAC around every block (the mm outputs of LLaMA's linears,
    # every other one; BERT's linears are addmm, so only its flash attention's outputs are kept)
    ("tinyllama-1.1b", "amp-bf16", "sgd", "selective-op", 1, "eager"),
    ("bert-base", "amp-fp16", "sgd", "selective-op", 1, "sdpa-flash"),
]

# Larger activations, SGD: the peak sits in the forward/backward, where the autocast rules decide it
# (in the small AdamW cases the optimizer step, parameters + gradients + state, is the peak).
LARGE = [
    ("gpt2", "amp-bf16", "sgd", "none", 1, "eager", (4, 512)),
    ("bert-base", "amp-fp16", "sgd", "none", 1, "eager", (8, 512)),
    ("tinyllama-1.1b", "amp-bf16", "sgd", "none", 1, "eager", (2, 1024)),
    ("resnet50", "amp-bf16", "sgd", "none", 1, "eager", (16, None)),
    ("vgg16", "amp-fp16", "sgd", "none", 1, "eager", (16, None)),
    ("mlp", "amp-fp16", "sgd", "none", 1, "eager", (4096, None)),
    ("vit-b-16", "amp-fp16", "sgd", "none", 1, "sdpa-flash", (16, None)),
    ("vit-b-16", "amp-bf16", "sgd", "none", 1, "sdpa-mem-efficient", (16, None)),
    ("vit-b-16", "amp-fp16", "sgd", "selective", 1, "sdpa-flash", (16, None)),
]


def capture(model: str, dtype: str, opt: str, ckpt: str, accum: int, attention: str,
            shape: tuple | None = None) -> tuple:
    batch, seq = shape or SHAPES[model]
    recipe = vc.Recipe(model, batch, seq or 1, dtype, opt, ckpt, accum, 2, attention, "cpu")
    if model in vc.ZOO:
        return recipe, vc.capture_zoo(recipe)
    fns = mc.build(model, batch, seq, dtype, opt, ckpt == "full")
    meta = {"model": model, "recipe": recipe.name(), "batch": batch, "seq": seq, "dtype": dtype,
            "optimizer": opt, "foreach": True, "checkpoint": ckpt,
            "attn_implementation": attention if model == "vit-b-16" else None}
    return recipe, vc.capture(*fns, iterations=2, accum=accum, meta=meta, device="cpu",
                              amp=recipe.amp(), sdpa=recipe.sdpa_backend(),
                              recompute_sdpa=ckpt == "selective")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=OUT_DIR)
    ap.add_argument("--only", action="append", help="capture only this model (repeatable)")
    a = ap.parse_args(argv)
    if vc.torch is None:
        print("error: make_amp_captures needs torch: pip install torch torchvision transformers", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for case in CASES + LARGE:
        if a.only and case[0] not in a.only:
            continue
        t0 = time.perf_counter()
        recipe, cap = capture(*case)
        seconds = time.perf_counter() - t0
        for k in ("capture_seconds", "build_seconds"):
            cap.meta.pop(k)
        seq = SHAPES[recipe.model][1] and recipe.seq
        shape = f"b{recipe.batch}" + (f"s{seq}" if seq else "")
        stem = f"{recipe.model}__{shape}__{recipe.name()}"
        path = os.path.join(a.out, stem + ".jsonl.gz")
        cap.write(path)
        size = os.path.getsize(path)
        trace_file = stem + ".jsonl.gz"
        if size > MAX_TRACE_KIB * 1024:
            os.remove(path)
            trace_file = None
        fx = mf.fixture(cap, recipe, trace_file)
        fx["recipe"]["seq"] = seq or None
        fx["recipe"]["attention"] = recipe.attention
        fx["tool"]["amp"] = cap.meta["amp"]
        fx["tool"]["sdpa_backend"] = cap.meta["sdpa_backend"]
        with open(os.path.join(a.out, stem + ".json"), "w", encoding="utf-8") as f:
            json.dump(fx, f, indent=1)
            f.write("\n")
        rows.append((fx, shape))
        print(f"{stem:60s} peak {fx['peak_requested_bytes']:>14,d} B ({fx['peak_phase']})  events {fx['events']:>6d}  "
              f"trace.gz {size / 1024:7.1f} KiB{'' if trace_file else ' (not kept)'}  {seconds:5.1f} s", flush=True)
    if not a.only:
        write_table(a.out, rows)
    return 0


def write_table(out: str, rows: list) -> None:
    """The generated part of the README: versions and the recordings (the measured part is written by hand)."""
    v = rows[0][0]["versions"] if rows else {}
    lines = [f"Versions: torch {v.get('torch')}, transformers {v.get('transformers')}, "
             f"torchvision {v.get('torchvision')}, python {v.get('python')}.", "",
             "| model | shape | recipe | params | peak_requested_bytes | peak phase | events | trace kept |",
             "| --- | --- | --- | ---: | ---: | --- | ---: | --- |"]
    for fx, shape in rows:
        lines.append(f"| {fx['model']} | {shape} | {fx['recipe']['name']} | {fx['params']:,} | "
                     f"{fx['peak_requested_bytes']:,} | {fx['peak_phase']} | {fx['events']} | "
                     f"{'yes' if fx['trace'] else 'no'} |")
    with open(os.path.join(out, "RECORDINGS.md"), "w", encoding="utf-8") as f:
        f.write("# AMP recordings (generated by models/tools/make_amp_captures.py)\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
