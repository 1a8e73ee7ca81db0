"""The committed graphs of published multi-GPU runs' models (``models/tests/imported/``, written by
``models/tools/make_published_parallel_captures.py``) are what ``vramsim.from_module`` captures of
those models, so the Rust tests that compare them with the published figures
(``api/tests/published_zero_recipe.rs``) lower the public capture's document.

Skipped, with the reason, where torch is not installed.
"""

import json
import os

import pytest

import vramsim

torch = pytest.importorskip("torch", reason="from_module needs torch (pip install torch)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_zero_recipe_graph_is_from_modules_capture():
    # pytorch/tutorials recipes_source/zero_redundancy_optimizer.rst: 20 × nn.Linear(2000, 2000), a
    # (20, 2000) input, nn.MSELoss() against (20, 2000) labels.
    nn = torch.nn
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(2000, 2000) for _ in range(20)])
    x = torch.empty(20, 2000, device="meta")
    labels = torch.empty(20, 2000, device="meta")
    m = vramsim.from_module(model, x, loss_fn=nn.MSELoss(), targets=labels, name="zero_recipe_linear20")
    with open(os.path.join(ROOT, "models", "tests", "imported", "zero_recipe_linear20.json")) as f:
        committed = json.load(f)
    assert m.document == committed
    assert m.recorded == []
