"""Capture timm 0.6 models (the code of timm's 2022 RTX 3090 benchmark CSVs) on the ``meta`` device, as
reference fixtures in ``models/tests/captures_timm/`` for the zoo's ``timm/<name>`` models.

timm 0.6.6 is not on the path by default: point ``TIMM_SRC`` at a checkout of
huggingface/pytorch-image-models at commit c865028c34fc05cc7deea8e753b30d8cd1952591 (the commit that
wrote ``results/benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv``), e.g.::

    git -C pytorch-image-models archive c865028c timm | tar -x -C /tmp/timm06
    TIMM_SRC=/tmp/timm06 python models/tools/make_timm_captures.py

The models are ``timm.create_model(name)`` (built on the CPU, because timm 0.6 calls ``.tolist()`` on a
``linspace`` while building, then moved to ``meta`` in the recipe's dtype), trained on
``(B, 3, 224, 224)`` images with ``F.cross_entropy`` and a foreach optimizer, as the other captures.
Format: ``traces/python/make_fixtures.py``'s ``fixture()``; ``models/tests/fixtures.rs`` checks them.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "traces", "python"))
if os.environ.get("TIMM_SRC"):
    sys.path.insert(0, os.environ["TIMM_SRC"])

import make_fixtures as mf  # noqa: E402
import vramsim_capture as vc  # noqa: E402

OUT_DIR = os.path.join(ROOT, "models", "tests", "captures_timm")

# (timm model, batch, dtype, optimizer)
CASES = [
    ("resnet26", 2, "fp32", "sgd-momentum"),
    ("vit_small_patch16_224", 2, "fp32", "adamw"),
    ("vit_base_patch16_224", 2, "fp32", "sgd-momentum"),
    ("vit_tiny_patch16_224", 4, "bf16", "sgd"),
    ("convnext_tiny", 2, "fp32", "sgd"),
    ("convnext_tiny", 2, "bf16", "adamw"),
    ("convnext_tiny", 8, "fp32", "sgd-momentum"),
    ("convnext_nano", 2, "fp32", "sgd-momentum"),
    ("convnext_nano", 2, "bf16", "adamw"),
    ("efficientnet_b0", 2, "fp32", "sgd-momentum"),
    ("efficientnet_b0", 4, "bf16", "adamw"),
]


def build(model: str, batch: int, dtype_name: str, opt: str):
    import timm
    import torch

    dtype = getattr(torch, vc.DTYPES[dtype_name])

    def model_fn():
        with torch.device("cpu"):
            m = timm.create_model(model)
        return m.to(device="meta", dtype=dtype)

    def inputs_fn():
        return (torch.randn(batch, 3, 224, 224, dtype=dtype), torch.randint(0, 1000, (batch,)))

    def loss_fn(m, inp):
        return torch.nn.functional.cross_entropy(m(inp[0]), inp[1])

    def optimizer_fn(params):
        if opt == "sgd":
            return torch.optim.SGD(params, lr=1e-2, foreach=True)
        if opt == "sgd-momentum":
            return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=True)
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)

    return model_fn, inputs_fn, loss_fn, optimizer_fn


def main() -> int:
    if vc.torch is None:
        print("error: make_timm_captures needs torch: pip install torch", file=sys.stderr)
        return 2
    try:
        import timm
    except ImportError:
        print("error: set TIMM_SRC to a timm 0.6.6 source tree (see the docstring)", file=sys.stderr)
        return 2
    if not timm.__version__.startswith("0.6."):
        print(f"error: timm {timm.__version__} is not 0.6.x (set TIMM_SRC)", file=sys.stderr)
        return 2
    os.makedirs(OUT_DIR, exist_ok=True)
    rows = []
    for model, batch, dtype, opt in CASES:
        name = "timm/" + model
        recipe = vc.Recipe(name, batch, 1, dtype, opt, "none", 1, 2)
        meta = {"model": name, "recipe": recipe.name(), "batch": batch, "seq": None, "dtype": dtype,
                "optimizer": opt, "foreach": True, "checkpoint": "none", "attn_implementation": None,
                "timm": timm.__version__}
        t0 = time.perf_counter()
        cap = vc.capture(*build(model, batch, dtype, opt), iterations=2, meta=meta)
        dt = time.perf_counter() - t0
        base = f"timm_{model}__b{batch}__{recipe.name()}"
        cap.write(os.path.join(OUT_DIR, base + ".jsonl.gz"))
        fx = mf.fixture(cap, recipe, base + ".jsonl.gz")
        with open(os.path.join(OUT_DIR, base + ".json"), "w") as f:
            json.dump(fx, f, indent=1)
            f.write("\n")
        rows.append((name, f"b{batch}", recipe.name(), fx["params"], fx["peak_requested_bytes"], fx["peak_phase"]))
        print(f"{base}: peak {fx['peak_requested_bytes']} in {fx['peak_phase']} ({dt:.2f} s)")
    v = vc.versions()
    with open(os.path.join(OUT_DIR, "README.md"), "w") as f:
        f.write("# Reference captures of timm 0.6 models\n\n")
        f.write("Made by `models/tools/make_timm_captures.py` (its docstring says how to get timm 0.6.6) with "
                "`traces/python/vramsim_capture.py`, in the format of `models/tests/fixtures/capture/`; "
                "`models/tests/fixtures.rs` checks them with the others.\n\n")
        f.write(f"Versions: timm {timm.__version__} (huggingface/pytorch-image-models c865028c), "
                f"torch {v['torch']}, python {v['python']}.\n\n")
        f.write("| model | shape | recipe | params | peak_requested_bytes | peak phase |\n")
        f.write("| --- | --- | --- | ---: | ---: | --- |\n")
        for model, shape, rname, params, peak, phase in rows:
            f.write(f"| {model} | {shape} | {rname} | {params:,} | {peak:,} | {phase} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
