"""Tests of train_step_gpu.py's pure parts (no GPU): recipe names, the predict options a measurement maps to,
and the table, on the committed H100 measurements."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import train_step_gpu as ts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "testdata" / "h100-train-steps"


def test_every_recipe_has_a_measurement_named_after_it():
    names = {ts.recipe_name(r) for r in ts.all_recipes()}
    measured = {p.name[: -len(".json")] for p in DATA.glob("*.json")}
    default = {n for n in measured if "__expandable_segments-true" not in n}
    assert names == default
    assert len(names) == len(ts.RECIPES) + len(ts.LORA_RECIPES)  # no two recipes share a name
    # the expandable-segments runs: recipes of the list, named with their setting
    expandable = {n.replace("__expandable_segments-true", "") for n in measured - default}
    assert len(expandable) == 10 and expandable <= names
    res = json.loads((DATA / "mlp__b64s128__fp32-adamw__expandable_segments-true.json").read_text())
    assert res["alloc_conf"] == res["recipe"]["alloc_conf"] == "expandable_segments:True"
    assert ts.recipe_name(res["recipe"]) == res["name"]


def test_predict_options_follow_the_measured_run():
    res = json.loads((DATA / "gpt2__b4s1024__amp-bf16-adamw-sdpa.json").read_text())
    args = ts.predict_args(res)
    assert args[:3] == ["predict", "--model", "gpt2"]
    # torch 2.11 keeps its cuBLAS workspaces; the measured context; PyTorch's own SDPA choice
    assert "--cublas-workspace-cache" in args
    assert args[args.index("--context") + 1] == str(res["context_bytes"]) == "552402944"
    assert args[args.index("--attention") + 1] == "auto"
    assert args[args.index("--precision") + 1] == "amp-bf16"
    res = json.loads((DATA / "resnet18__b32s128__fp32-sgd-momentum.json").read_text())
    assert "--seq" not in ts.predict_args(res)


def test_the_table_shows_the_errors_against_the_measurement():
    res = json.loads((DATA / "mlp__b64s128__fp32-adamw.json").read_text())
    pred = {"peak_allocated_bytes": res["peak_allocated"] * 2, "peak_reserved_bytes": res["peak_reserved"],
            "attention": None}
    rows = ts.table([{"name": res["name"], "measured": res, "predicted": pred},
                     {"name": "broken", "error": "error: no such model\nUsage"}]).splitlines()
    assert "| +100.00% |" in rows[2] and "| +0.00% |" in rows[2]
    assert rows[3] == "| broken | vramsim failed: error: no such model | | | | |"


def test_a_lora_recipe_predicts_with_its_adapters():
    res = json.loads((DATA / "tinyllama-1.1b__b4s512__bf16-adamw-sdpa-lora16.json").read_text())
    args = ts.predict_args(res)
    assert args[args.index("--lora") + 1] == "r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj"
