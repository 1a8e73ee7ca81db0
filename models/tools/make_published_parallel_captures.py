"""Capture the models of published multi-GPU memory measurements that no zoo model matches, as
``vramsim-graph`` documents in ``models/tests/imported/`` (``predict --graph FILE``).

``zero_recipe_linear20.json``: the model of PyTorch's recipe "Shard Optimizer States with
ZeroRedundancyOptimizer" (``pytorch/tutorials``, ``recipes_source/zero_redundancy_optimizer.rst``):
``nn.Sequential(*[nn.Linear(2000, 2000) for _ in range(20)])`` on a ``(20, 2000)`` input with
``nn.MSELoss()`` against ``(20, 2000)`` labels. ``api/tests/published_zero_recipe.rs`` compares vramsim
with the recipe's printed ``max_memory_allocated``.

The capture is ``vramsim.from_module``'s own (``python/vramsim/_graph_capture.py``, loaded by path so the
compiled extension is not needed), on the meta device; ``rules`` are the calls of this model, both with
a rule in ``imported::SUPPORTED`` (so nothing is recorded for a fallback, as ``from_module`` would do).

Run from the repository root (torch only; no GPU, no network)::

    python models/tools/make_published_parallel_captures.py
"""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT_DIR = os.path.join(ROOT, "models", "tests", "imported")


def _capture_module():
    path = os.path.join(ROOT, "python", "vramsim", "_graph_capture.py")
    spec = importlib.util.spec_from_file_location("_graph_capture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import torch
    from torch import nn

    capture = _capture_module().capture
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(2000, 2000) for _ in range(20)])
    x = torch.empty(20, 2000, device="meta")
    labels = torch.empty(20, 2000, device="meta")
    doc = capture(
        model, x, loss_fn=nn.MSELoss(), targets=labels, name="zero_recipe_linear20", rules=("linear", "mse_loss")
    )
    out = os.path.join(OUT_DIR, "zero_recipe_linear20.json")
    with open(out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(out, len(doc["ops"]), "calls")


if __name__ == "__main__":
    main()
