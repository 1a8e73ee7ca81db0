"""Tests of the meta-device capture tool: hand-derived peaks, CUDA mimicry, trace validity, fixtures.

Run: ``python -m pytest traces/python`` (skips, with the reason, where torch is not installed).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

try:
    import torch
except ImportError as e:  # absent (ModuleNotFoundError) or broken install
    pytest.skip(f"the capture tool records real PyTorch, and torch does not import ({e}): "
                "pip install torch", allow_module_level=True)

import vramsim_capture as vc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(ROOT, "models", "tests", "fixtures", "capture")

MiB = 1 << 20


def has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


# --------------------------------------------------------------------------------------------------
# Trace validity, applied to every capture below
# --------------------------------------------------------------------------------------------------

def check_trace(lines: list[str]) -> list[dict]:
    """The trace is one the Rust reader accepts and the simulator can replay without a story error."""
    assert lines, "empty trace"
    header = json.loads(lines[0])
    assert set(header) == {"format", "version", "meta"}, header.keys()
    assert header["format"] == "vramsim-trace" and header["version"] == 1
    meta = header["meta"]
    assert meta["tool"] == "vramsim_capture" and meta["torch"] == torch.__version__
    events = [json.loads(line) for line in lines[1:]]
    keys = {"alloc": {"op", "id", "size", "stream", "category", "tag"}, "free": {"op", "id"},
            "phase": {"op", "name"}}
    live: dict[int, int] = {}
    ever: set[int] = set()
    assert events[0] == {"op": "phase", "name": "setup"}
    for i, ev in enumerate(events):
        assert ev["op"] in keys, (i, ev)
        assert set(ev) <= keys[ev["op"]], (i, ev)
        if ev["op"] == "alloc":
            assert isinstance(ev["id"], int) and ev["id"] >= 0
            assert ev["id"] not in live, f"event {i}: id {ev['id']} allocated while live"
            assert ev["id"] not in ever, f"event {i}: id {ev['id']} reused"
            assert isinstance(ev["size"], int) and ev["size"] > 0, (i, ev)
            assert ev["stream"] == 0
            assert ev["category"] in vc.CATEGORIES, (i, ev)
            live[ev["id"]] = ev["size"]
            ever.add(ev["id"])
        elif ev["op"] == "free":
            assert ev["id"] in live, f"event {i}: free of id {ev['id']}, which is not live"
            del live[ev["id"]]
        else:
            assert ev["name"] in vc.PHASES, (i, ev)
    return events


def lines_of(cap: vc.Capture) -> list[str]:
    return list(cap.lines())


# --------------------------------------------------------------------------------------------------
# (b) A step whose peak is derived by hand from PyTorch's autograd rules
# --------------------------------------------------------------------------------------------------

B = 32
ACT = B * 1024 * 4           # one (32, 1024) fp32 tensor: 131072 bytes
W = 1024 * 1024 * 4          # a 1024x1024 fp32 weight: 4 MiB
BIAS = 1024 * 4
P = 2 * (W + BIAS)           # parameters of Linear-ReLU-Linear: 8,396,800 bytes


def linear_relu_linear() -> "torch.nn.Module":
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))


def capture_linear(optimizer: str = "sgd", **kw) -> vc.Capture:
    def opt(params):
        if optimizer == "adam":
            return torch.optim.Adam(params, lr=1e-3, foreach=True)
        return torch.optim.SGD(params, lr=0.1, foreach=True)
    return vc.capture(linear_relu_linear, lambda: torch.randn(B, 1024),
                      lambda m, x: m(x).sum(), opt, 2, **kw)


def test_linear_relu_linear_sgd_peak_by_hand():
    """x -> addmm -> h1 -> relu -> r1 -> addmm -> y -> sum -> loss, SGD, two iterations.

    Autograd rules (derivatives.yaml): addmm saves its input (mat1) and weight, not its output; relu
    saves its output; sum saves only sizes. So:

    forward  h1 = addmm(x)          live: P + x + h1
             r1 = relu(h1)          + r1, then h1 dies (nothing saved it)
             y  = addmm(r1)         + y
             loss = y.sum()         + 4, then y dies             -> forward peak P + 3 ACT + 4
    backward seed = ones_like(loss) + 4 (held by torch.autograd.backward until it returns)
             AddmmBackward (layer 2): grad r1 = mm (ACT), grad W2 = mm (4 MiB, stolen by
             AccumulateGrad), grad b2 = sum_to (4 KiB)
             ReluBackward: grad h1 = threshold_backward (ACT); then grad r1 and r1 die
             AddmmBackward (layer 1): grad W1 (4 MiB), grad b1 (4 KiB), while grad h1 is live
                                            -> backward peak: P (params) + P (grads) + x + grad h1
                                               + loss + seed = 2P + 2 ACT + 8
    optimizer foreach SGD without momentum: _foreach_add_ in place, nothing allocated
    zero_grad set_to_none: the grads die                       -> final live P
    """
    cap = capture_linear("sgd")
    events = check_trace(lines_of(cap))
    s = vc.summarize(events)
    assert cap.meta["params"] == 2 * (1024 * 1024 + 1024)
    assert s["peak_by_phase"]["setup"] == P
    assert s["peak_by_phase"]["forward"] == P + 3 * ACT + 4
    assert s["peak_requested_bytes"] == 2 * P + 2 * ACT + 8 == 17_055_752
    assert s["peak_phase"] == "backward"
    assert s["by_category_at_peak"] == {
        "parameter": P, "gradient": P, "input": ACT, "activation": 4, "temporary": ACT + 4}
    assert s["peak_by_phase"]["optimizer"] == 2 * P
    assert s["final_live_bytes"] == P
    # per iteration: x, h1, r1, y, loss, seed, grad r1, grad h1 and 4 grads = 12 allocs, all freed
    # (the grads at zero_grad, the rest within the step); the 4 parameters stay
    assert s["allocs"] == 4 + 2 * 12 and s["frees"] == 2 * 12


def test_adam_foreach_optimizer_peak_is_five_times_params():
    """foreach Adam: params + grads + exp_avg + exp_avg_sq, plus the list of exp_avg_sq.sqrt() that
    _multi_tensor_adam allocates before addcdiv_: 5 P at the optimizer step (the inputs are dead)."""
    cap = capture_linear("adam")
    s = vc.summarize(check_trace(lines_of(cap)))
    assert s["peak_by_phase"]["optimizer"] == 5 * P
    assert s["peak_requested_bytes"] == 5 * P
    assert s["final_live_by_category"] == {"parameter": P, "optimizer_state": 2 * P}


# --------------------------------------------------------------------------------------------------
# CUDA mimicry and recipe mechanics
# --------------------------------------------------------------------------------------------------

def _dropout_capture(mimic_cuda: bool) -> dict:
    def model_fn():
        return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Dropout(0.1), torch.nn.Linear(1024, 1))
    cap = vc.capture(model_fn, lambda: torch.randn(B, 1024), lambda m, x: m(x).sum(),
                     lambda p: torch.optim.SGD(p, lr=0.1, foreach=True), 1, mimic_cuda=mimic_cuda)
    events = check_trace(lines_of(cap))
    return [e for e in events if e["op"] == "alloc" and e["tag"].startswith("1:")]


def test_dropout_saves_a_bool_mask_as_on_cuda():
    # CUDA: at::dropout -> native_dropout -> (output fp32, mask bool); NativeDropoutBackward saves the mask.
    allocs = _dropout_capture(mimic_cuda=True)
    assert [e["tag"] for e in allocs] == ["1:aten.native_dropout"] * 2, allocs
    assert sorted(e["size"] for e in allocs) == [B * 1024, ACT], allocs
    assert all(e["category"] == "activation" for e in allocs)
    # Unmimicked meta takes CPU's unfused path: an fp32 noise tensor (empty_like + bernoulli_) is saved.
    raw = _dropout_capture(mimic_cuda=False)
    assert [e["tag"] for e in raw] == ["1:aten.empty_like", "1:aten.mul.Tensor"], raw
    assert sorted(e["size"] for e in raw) == [ACT, ACT], raw


def test_accumulation_adds_gradients_in_place():
    cap = capture_linear("sgd", accum=2)
    events = check_trace(lines_of(cap))
    grads = [e for e in events if e["op"] == "alloc" and e["category"] == "gradient"]
    assert len(grads) == 2 * 4  # one buffer per parameter per iteration, not per micro-batch
    s = vc.summarize(events)
    assert s["final_live_bytes"] == P


def test_checkpoint_recomputes_in_backward():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU())

        def forward(self, x):
            from torch.utils.checkpoint import checkpoint
            return checkpoint(self.inner, x, use_reentrant=False)

    cap = vc.capture(lambda: torch.nn.Sequential(Block(), Block()), lambda: torch.randn(B, 1024),
                     lambda m, x: m(x).sum(), lambda p: torch.optim.SGD(p, lr=0.1, foreach=True), 1)
    events = check_trace(lines_of(cap))
    phase = None
    recomputed = []
    forward_acts = []
    for e in events:
        if e["op"] == "phase":
            phase = e["name"]
        elif e["op"] == "alloc" and e["category"] == "activation":
            (recomputed if phase == "backward" else forward_acts).append(e)
    # forward keeps only the loss (the block inputs are the input x and block 1's output)
    assert sorted(e["size"] for e in forward_acts) == [4, ACT]
    # backward recomputes each block: relu's output is saved for ReluBackward (checkpoint stops early
    # once every tensor the block's backward needs is recomputed, so addmm's output dies as a temporary)
    assert [e["size"] for e in recomputed] == [ACT, ACT], recomputed


# --------------------------------------------------------------------------------------------------
# (c) Validity of zoo captures, the CLI, and the fixtures
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model,needs", [("mlp", None), ("resnet18", "torchvision"),
                                         ("gpt2", "transformers"), ("bert-base", "transformers")])
def test_zoo_traces_are_valid(model, needs):
    if needs and not has(needs):
        pytest.skip(f"{model} needs {needs}")
    recipe = vc.Recipe(model, batch=2, seq=32, dtype="fp32", optimizer="adamw", checkpoint="full", accum=2)
    cap = vc.capture_zoo(recipe)
    events = check_trace(lines_of(cap))
    s = vc.summarize(events)
    assert cap.meta["untracked_input_storages"] == 0
    assert cap.meta["model"] == model and cap.meta["recipe"] == "fp32-adamw-ckptfull-accum2"
    assert s["final_live_by_category"].keys() == {"parameter", "optimizer_state"} | (
        {"other"} if model in ("resnet18", "bert-base") else set())
    assert [seg["phase"] for seg in s["peak_by_phase_segment"]] == (
        ["setup"] + (["forward", "backward"] * 2 + ["optimizer", "zero_grad"]) * 2)
    cats = {e["category"] for e in events if e["op"] == "alloc"}
    assert {"parameter", "input", "activation", "temporary", "gradient", "optimizer_state"} <= cats


def test_zoo_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown model 'vgg99': the zoo has mlp"):
        vc.zoo(vc.Recipe("vgg99"))
    with pytest.raises(ValueError, match="batch and seq must be 1 or more"):
        vc.zoo(vc.Recipe("mlp", batch=0))
    if has("transformers"):
        with pytest.raises(ValueError, match="seq 2048 is longer than gpt2's 1024 positions"):
            vc.zoo(vc.Recipe("gpt2", seq=2048))


def test_cli_writes_a_gzip_jsonl_trace(tmp_path):
    out = tmp_path / "mlp.jsonl.gz"
    r = subprocess.run([sys.executable, os.path.join(HERE, "vramsim_capture.py"), "--model", "mlp",
                        "--batch", "4", "--optimizer", "sgd-momentum", "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    with gzip.open(out, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    events = check_trace(lines)
    meta = json.loads(lines[0])["meta"]
    assert meta["optimizer"] == "sgd-momentum" and meta["batch"] == 4 and meta["iterations"] == 2
    assert sum(1 for e in events if e["op"] == "alloc" and e["category"] == "optimizer_state") == 8
    r = subprocess.run([sys.executable, os.path.join(HERE, "vramsim_capture.py"), "--model", "nope",
                        "-o", str(tmp_path / "x.jsonl")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "unknown model 'nope'" in r.stderr


def _fixture_files() -> list[str]:
    if not os.path.isdir(FIXTURES):
        return []
    return sorted(f for f in os.listdir(FIXTURES) if f.endswith(".json"))


@pytest.mark.parametrize("name", _fixture_files())
def test_fixture_is_consistent(name):
    """Each committed fixture agrees with its own trace (where kept), and is reproduced exactly by this
    tool when the installed torch/transformers/torchvision are the ones that made it (cheap cases)."""
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        fx = json.load(f)
    assert fx["format"] == "vramsim-capture-fixture"
    assert fx["peak_requested_bytes"] == max(fx["peak_by_phase"].values())
    assert sum(fx["by_category_at_peak"].values()) == fx["peak_requested_bytes"]
    if fx["trace"]:
        with gzip.open(os.path.join(FIXTURES, fx["trace"]), "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
        if json.loads(lines[0])["meta"]["torch"] == torch.__version__:
            events = check_trace(lines)
        else:
            events = [json.loads(line) for line in lines[1:]]
        s = vc.summarize(events)
        assert s["peak_requested_bytes"] == fx["peak_requested_bytes"]
        assert s["by_category_at_peak"] == fx["by_category_at_peak"]
        assert s["allocs"] == fx["allocs"] and s["frees"] == fx["frees"]
    same = all(fx["versions"][k] == vc.versions()[k] for k in ("torch", "transformers", "torchvision"))
    if fx["model"] in ("mlp", "resnet18") and same:
        import make_fixtures
        r = fx["recipe"]
        recipe = vc.Recipe(fx["model"], r["batch"], r["seq"] or 1, r["dtype"], r["optimizer"],
                           r["checkpoint"], r["accum"], r["iterations"])
        cap = vc.capture_zoo(recipe)
        cap.meta.pop("capture_seconds")
        cap.meta.pop("build_seconds")
        again = make_fixtures.fixture(cap, recipe, fx["trace"])
        assert again == fx
