"""Regenerate the reference fixtures in ``models/tests/fixtures/capture/`` from real PyTorch.

Each case (zoo model x recipe) is captured on the ``meta`` device with ``vramsim_capture`` and written as

* ``MODEL__SHAPE__RECIPE.json``: the compact reference numbers (versions, recipe, parameter count,
  ``peak_requested_bytes``, the peak of each phase, bytes by category at the peak, alloc/free counts, live
  bytes at the end) that the Rust lowering is compared with;
* ``MODEL__SHAPE__RECIPE.jsonl.gz``: the full trace, only when it compresses to at most ``--max-trace-kib``
  (300 KiB by default), so the repository does not carry multi-megabyte traces;
* ``README.md``: the table of all cases, with the versions they were made with.

Run from the repository root (needs torch, torchvision and transformers; no GPU, no network)::

    python traces/python/make_fixtures.py            # all cases
    python traces/python/make_fixtures.py --only gpt2 --only mlp

The output is deterministic for a given torch/transformers/torchvision: no timings go in the files
(the script prints them), and the gzip streams carry no time stamp.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vramsim_capture as vc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT_DIR = os.path.join(ROOT, "models", "tests", "fixtures", "capture")

# Two shapes per model. "small" (every recipe): captures in seconds, and the optimizer step is often
# the peak. "large" (fewer recipes): activations dominate, so the forward/backward rules decide the peak.
SHAPES = {
    "small": {
        "mlp": dict(batch=64, seq=1),
        "resnet18": dict(batch=2, seq=1),
        "gpt2": dict(batch=2, seq=128),
        "bert-base": dict(batch=2, seq=128),
        "tinyllama-1.1b": dict(batch=2, seq=128),
    },
    "large": {
        "mlp": dict(batch=4096, seq=1),
        "resnet18": dict(batch=64, seq=1),
        "gpt2": dict(batch=8, seq=1024),
        "bert-base": dict(batch=16, seq=512),
        "tinyllama-1.1b": dict(batch=2, seq=1024),
    },
}

# (dtype, optimizer, checkpoint, accum) for each shape
RECIPES = {
    "small": [
        ("fp32", "adamw", "none", 1),
        ("fp32", "adam", "none", 1),
        ("fp32", "sgd", "none", 1),
        ("fp32", "sgd-momentum", "none", 1),
        ("bf16", "adamw", "none", 1),
        ("fp32", "adamw", "full", 1),
        ("fp32", "adamw", "none", 2),
    ],
    "large": [
        ("fp32", "adamw", "none", 1),
        ("fp32", "sgd", "none", 1),
        ("bf16", "adamw", "none", 1),
        ("fp32", "adamw", "full", 1),
        ("fp32", "adamw", "none", 2),
    ],
}

FIXTURE_FORMAT = "vramsim-capture-fixture"


def case_recipe(shape: str, model: str, dtype: str, opt: str, ckpt: str, accum: int) -> vc.Recipe:
    dims = SHAPES[shape][model]
    return vc.Recipe(model, dims["batch"], dims["seq"], dtype, opt, ckpt, accum, iterations=2)


def shape_name(recipe: vc.Recipe) -> str:
    if recipe.model in ("mlp", "resnet18"):
        return f"b{recipe.batch}"
    return f"b{recipe.batch}s{recipe.seq}"


def fixture(cap: vc.Capture, recipe: vc.Recipe, trace_file: str | None) -> dict:
    s = cap.summary()
    m = cap.meta
    return {
        "format": FIXTURE_FORMAT,
        "version": 1,
        "versions": {k: m.get(k) for k in ("torch", "transformers", "torchvision", "python")},
        "tool": {"name": m["tool"], "version": m["tool_version"], "device": m["device"],
                 "mimic_cuda": m["mimic_cuda"]},
        "model": recipe.model,
        "recipe": {
            "name": recipe.name(),
            "batch": recipe.batch,
            "seq": m.get("seq"),
            "dtype": recipe.dtype,
            "optimizer": recipe.optimizer,
            "optimizer_class": m["optimizer_class"],
            "optimizer_defaults": m["optimizer_defaults"],
            "checkpoint": recipe.checkpoint,
            "accum": recipe.accum,
            "iterations": recipe.iterations,
            "attn_implementation": m.get("attn_implementation"),
        },
        "params": m["params"],
        "peak_requested_bytes": s["peak_requested_bytes"],
        "peak_phase": s["peak_phase"],
        "peak_event_index": s["peak_event_index"],
        "by_category_at_peak": s["by_category_at_peak"],
        "peak_by_phase": s["peak_by_phase"],
        "peak_by_phase_segment": [[seg["phase"], seg["peak"]] for seg in s["peak_by_phase_segment"]],
        "allocs": s["allocs"],
        "frees": s["frees"],
        "events": len(cap.events),
        "final_live_bytes": s["final_live_bytes"],
        "final_live_by_category": s["final_live_by_category"],
        "trace": trace_file,
    }



def write_fixture(cap: vc.Capture, recipe: vc.Recipe, out_dir: str, base: str,
                  recipe_fields: dict) -> dict:
    """Writes `base.jsonl.gz` (the trace) and `base.json` (its fixture, with `recipe_fields` added to its
    recipe) into `out_dir`, and returns the fixture."""
    cap.write(os.path.join(out_dir, base + ".jsonl.gz"))
    fx = fixture(cap, recipe, base + ".jsonl.gz")
    fx["recipe"].update(recipe_fields)
    with open(os.path.join(out_dir, base + ".json"), "w") as f:
        json.dump(fx, f, indent=1)
        f.write("\n")
    return fx

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=OUT_DIR)
    ap.add_argument("--only", action="append", help="capture only this model (repeatable)")
    ap.add_argument("--max-trace-kib", type=int, default=300)
    a = ap.parse_args(argv)
    if vc.torch is None:
        print("error: make_fixtures needs torch: pip install torch torchvision transformers",
              file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for shape, model in ((sh, m) for sh in SHAPES for m in vc.ZOO):
        if a.only and model not in a.only:
            continue
        for dtype, opt, ckpt, accum in RECIPES[shape]:
            recipe = case_recipe(shape, model, dtype, opt, ckpt, accum)
            t0 = time.perf_counter()
            cap = vc.capture_zoo(recipe)
            seconds = time.perf_counter() - t0
            took = {"capture_seconds": cap.meta.pop("capture_seconds"),
                    "build_seconds": cap.meta.pop("build_seconds")}
            stem = f"{model}__{shape_name(recipe)}__{recipe.name()}"
            tmp = os.path.join(a.out, stem + ".jsonl.gz")
            cap.write(tmp)
            size = os.path.getsize(tmp)
            trace_file = stem + ".jsonl.gz"
            if size > a.max_trace_kib * 1024:
                os.remove(tmp)
                trace_file = None
            fx = fixture(cap, recipe, trace_file)
            with open(os.path.join(a.out, stem + ".json"), "w", encoding="utf-8") as f:
                json.dump(fx, f, indent=1)
                f.write("\n")
            rows.append((fx, size, seconds, took))
            print(f"{stem:50s} peak {fx['peak_requested_bytes']:>14,d} B  ({fx['peak_phase']})  "
                  f"params {fx['params']:>13,d}  events {fx['events']:>6d}  trace.gz {size / 1024:7.1f} KiB"
                  f"{'' if trace_file else ' (not kept)'}  "
                  f"total {seconds:5.2f} s, step capture {took['capture_seconds']:.2f} s", flush=True)
    if not a.only:
        write_readme(a.out, rows)
    return 0


def write_readme(out: str, rows: list) -> None:
    v = rows[0][0]["versions"] if rows else {}
    lines = [
        "# Reference captures of real PyTorch training steps",
        "",
        "Made by `traces/python/make_fixtures.py` (regenerate with `python traces/python/make_fixtures.py`",
        "from the repository root) with `traces/python/vramsim_capture.py`: each zoo model is built on the",
        "`meta` device and two training iterations run under a `TorchDispatchMode` that records every storage",
        "allocation and free (see the module's docstring for how, and for what differs from CUDA).",
        "",
        f"Versions: torch {v.get('torch')}, transformers {v.get('transformers')}, "
        f"torchvision {v.get('torchvision')}, python {v.get('python')}.",
        "",
        "`MODEL__SHAPE__RECIPE.json` holds the numbers; `.jsonl.gz` beside it the full vramsim trace where it is",
        "under 300 KiB compressed. Recipes: `DTYPE-OPTIMIZER[-ckptfull][-accumK]`; `bf16` is `model.to(bfloat16)`,",
        "`ckptfull` is non-reentrant `torch.utils.checkpoint` around every block (HF's own per-layer",
        "`activation_checkpointing_enable` for the HF models), optimizers use `foreach=True` (CUDA's default).",
        "Shapes (`bB` batch, `sS` sequence): a small one per model with every recipe, where the optimizer",
        "step is often the peak, and a large one with five recipes, where activations decide it; the",
        "`peak_by_phase` numbers check the forward and backward rules whatever the overall peak.",
        "",
        "`peak_requested_bytes` is the maximum over the trace of live requested (unrounded) bytes, PyTorch's",
        "`requested_bytes.all.peak`.",
        "",
        "| model | shape | recipe | params | peak_requested_bytes | peak phase | forward peak | backward peak | allocs | trace kept |",
        "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for fx, _size, _sec, _took in rows:
        shape = f"b{fx['recipe']['batch']}" + (f"s{fx['recipe']['seq']}" if fx['recipe']['seq'] else "")
        lines.append(f"| {fx['model']} | {shape} | {fx['recipe']['name']} | {fx['params']:,} | "
                     f"{fx['peak_requested_bytes']:,} | {fx['peak_phase']} | "
                     f"{fx['peak_by_phase']['forward']:,} | {fx['peak_by_phase']['backward']:,} | {fx['allocs']} | "
                     f"{'yes' if fx['trace'] else 'no'} |")
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
