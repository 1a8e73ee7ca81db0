"""Tests of CUDA's autocast on fake CPU tensors (``cuda_autocast.py``) and of the capture tool's fake-CPU and AMP
recordings (``vramsim_capture.capture(device="cpu", amp=...)``).

The expectations are PyTorch's own (``torch/testing/_internal/autocast_test_lists.py``, the lists
``test/test_cuda.py`` checks CUDA autocast with), the policies of ``aten/src/ATen/autocast_mode.cpp`` derived by
hand for a few ops, and the meta-device fixtures in ``models/tests/fixtures/capture/`` (recorded independently
of this module). Run: ``python -m pytest traces/python`` (skips where torch is not installed).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import types
import warnings

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

try:
    import torch
except ImportError as e:  # absent (ModuleNotFoundError) or broken install
    pytest.skip(f"CUDA autocast emulation needs torch, which does not import ({e}): pip install torch",
                allow_module_level=True)

import cuda_autocast as ca  # noqa: E402
import vramsim_capture as vc  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
META_FIXTURES = os.path.join(ROOT, "models", "tests", "fixtures", "capture")
AMP_FIXTURES = os.path.join(ROOT, "models", "tests", "fixtures", "amp")

warnings.filterwarnings("ignore", message=".*chain_matmul is deprecated.*")
warnings.filterwarnings("ignore", message=".*torch.cross without specifying the dim.*")


def has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


class Spy(TorchDispatchMode):
    """Records (op name, input dtypes, positional args) of every op below autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.calls.append((str(func), [a.dtype for a in args if isinstance(a, torch.Tensor)], args))
        return func(*args, **(kwargs or {}))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


# --------------------------------------------------------------------------------------------------
# The policies, read off the wheel
# --------------------------------------------------------------------------------------------------

def test_every_cuda_autocast_op_has_a_policy() -> None:
    policies = ca.probe()
    assert set(policies) == set(ca.autocast_ops("AutocastCUDA"))
    assert len(policies) > 100
    unknown = {n for n, p in policies.items() if p.policy not in ca.POLICIES}
    # _cudnn_rnn's kernel (cudnn/AutocastRNN.cpp) flattens cuDNN weights; no CPU path reaches it
    assert unknown <= {"_cudnn_rnn"}, unknown


def test_policies_derived_by_hand_from_autocast_mode_cpp() -> None:
    """A few ops of each KERNEL_CUDA(..., policy) block of autocast_mode.cpp."""
    p = {n: x.policy for n, x in ca.probe().items()}
    for op in ("mm", "addmm", "bmm", "linear", "matmul", "conv2d", "scaled_dot_product_attention", "baddbmm"):
        assert p[op] == "lower_precision_fp", op
    for op in ("layer_norm", "native_layer_norm", "nll_loss", "rsqrt", "pow.Tensor_Scalar", "exp", "mse_loss",
               "group_norm"):
        assert p[op] == "fp32", op
    for op in ("softmax.int", "log_softmax.int", "sum", "cumsum", "prod"):
        assert p[op] == "fp32_set_opt_dtype", op
    for op in ("addcmul", "atan2", "dot", "index_put", "scatter_add"):
        assert p[op] == "promote", op
    assert ca.probe()["norm.Scalar"].target == "norm.ScalarOpt_dtype"
    assert p["binary_cross_entropy"] == "banned"
    # Composite losses with only a CPU autocast kernel are not CUDA autocast ops: they decompose.
    assert "cross_entropy_loss" not in p


def _autocast_test_lists() -> types.ModuleType:
    """torch/testing/_internal/autocast_test_lists.py without its test-harness import (common_utils, which
    needs packages a plain torch install lacks): only TEST_WITH_ROCM and TestCase are used from it."""
    name = "torch.testing._internal.common_utils"
    saved = sys.modules.get(name)
    stub = types.ModuleType(name)
    stub.TEST_WITH_ROCM = False
    stub.TestCase = object
    sys.modules[name] = stub
    try:
        sys.modules.pop("torch.testing._internal.autocast_test_lists", None)
        import torch.testing._internal.autocast_test_lists as atl
        return atl
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved


def test_pytorch_cuda_autocast_expectations_hold_on_fake_cpu() -> None:
    """Every entry of PyTorch's CUDA lists that runs on fake CPU tensors gives CUDA's output dtype."""
    atl = _autocast_test_lists()
    groups = [("torch_fp16", torch, torch.float16), ("torch_fp32", torch, torch.float32),
              ("torch_need_autocast_promote", torch, torch.float32), ("nn_fp16", torch._C._nn, torch.float16),
              ("nn_fp32", torch._C._nn, torch.float32), ("linalg_fp16", torch._C._linalg, torch.float16),
              ("methods_fp16", None, torch.float16), ("methods_fp32", None, torch.float32)]
    ran, skipped, wrong = 0, [], []
    with ca.installed(), FakeTensorMode(allow_non_fake_inputs=True):
        lists = atl.AutocastTestLists(torch.device("cpu"))
        for group, module, want in groups:
            for entry in getattr(lists, group):
                op, args = entry[0], entry[1]
                kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
                if not isinstance(args, tuple):  # einsum's entry is (name, equation, operands)
                    skipped.append((op, "entry shape"))
                    continue
                try:
                    with torch.autocast("cpu", dtype=torch.float16):
                        if module is not None and hasattr(module, op):
                            out = getattr(module, op)(*args, **kwargs)
                        else:
                            out = getattr(args[0], op)(*args[1:], **kwargs)
                except NotImplementedError as e:  # cudnn_convolution*: no CPU kernel at all
                    skipped.append((op, str(e).split("\n")[0]))
                    continue
                out = out if isinstance(out, torch.Tensor) else out[0]
                ran += 1
                if out.dtype != want:
                    wrong.append((group, op, out.dtype, want))
        for op, args, module in lists.banned:
            with pytest.raises(RuntimeError, match="unsafe to autocast"):
                with torch.autocast("cpu", dtype=torch.float16):
                    getattr(module, op)(*args)
    assert not wrong, wrong
    assert ran >= 90, (ran, skipped)
    assert {op for op, _ in skipped} <= {"einsum", "cudnn_convolution", "cudnn_convolution_transpose"}, skipped


def test_installed_is_undone() -> None:
    """On exit the wheel's own AutocastCPU kernels are back (CPU keeps layer_norm in 16 bit)."""
    def layer_norm_dtype() -> torch.dtype:
        x = torch.zeros(2, 4, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.layer_norm(x, (4,)).dtype
    before = layer_norm_dtype()
    clear = torch.clear_autocast_cache
    with ca.installed():
        assert layer_norm_dtype() == torch.float32  # CUDA's fp32 policy
    assert layer_norm_dtype() == before == torch.bfloat16
    assert torch.clear_autocast_cache is clear


# --------------------------------------------------------------------------------------------------
# Rules derived by hand (autocast_mode.cpp, SoftMax.cpp, LossNLL.cpp)
# --------------------------------------------------------------------------------------------------

def test_cross_entropy_keeps_explicit_dtype_then_nll_loss_casts() -> None:
    """cross_entropy_loss (no CUDA autocast kernel) runs log_softmax(x, 1, x.scalar_type()): the explicit dtype
    is kept by fp32_set_opt_dtype, so log_softmax stays fp16; nll_loss (fp32 policy) casts its input to fp32."""
    with ca.installed(), FakeTensorMode():
        x = torch.empty(4, 10, dtype=torch.float16)
        y = torch.zeros(4, dtype=torch.long)
        spy = Spy()
        with spy, torch.autocast("cpu", dtype=torch.float16):
            torch.nn.functional.cross_entropy(x, y)
    names = spy.names()
    i = names.index("aten._log_softmax.default")
    assert spy.calls[i][1] == [torch.float16] and spy.calls[i][2][2] is False  # no half_to_float
    j = names.index("aten.nll_loss_forward.default")
    assert "aten._to_copy.default" in names[i:j]
    assert spy.calls[j][1][0] == torch.float32


def test_half_softmax_to_float_takes_cudas_fused_path() -> None:
    """SoftMax.cpp: a CUDA Half input with dtype=float runs _softmax(x, dim, half_to_float=True), no copy;
    bf16 converts first (toType), as on CUDA."""
    for dtype, fused in ((torch.float16, True), (torch.bfloat16, False)):
        with ca.installed(), FakeTensorMode():
            x = torch.empty(4, 10, dtype=dtype)
            spy = Spy()
            with spy, torch.autocast("cpu", dtype=dtype):
                out = torch.softmax(x, -1)  # fp32_set_opt_dtype: dtype unset → float
        assert out.dtype == torch.float32
        names = spy.names()
        assert ("aten._to_copy.default" in names) != fused, names
        assert spy.calls[names.index("aten._softmax.default")][2][2] is fused


def test_weight_casts_are_cached_until_autocast_exits() -> None:
    """cached_cast: the fp16 copy of an fp32 leaf weight is made once per autocast region, held by the cache,
    and dropped by the outermost exit (torch.clear_autocast_cache)."""
    with ca.installed() as cache, FakeTensorMode():
        lin = torch.nn.Linear(8, 8)
        x = torch.empty(2, 8)
        spy = Spy()
        with spy, torch.autocast("cpu", dtype=torch.float16):
            lin(x)
            lin(x)
            assert len(cache) == 2  # weight and bias
        assert len(cache) == 0
    copies = [c for c in spy.calls if c[0] == "aten._to_copy.default"]
    assert len(copies) == 2 + 2  # weight and bias once (cached), the input x twice (no grad: never cached)
    with ca.installed() as cache, FakeTensorMode():
        lin = torch.nn.Linear(8, 8)
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            lin(torch.empty(2, 8))
            assert len(cache) == 0


def test_promote_takes_the_widest_type() -> None:
    with ca.installed(), FakeTensorMode():
        a = torch.empty(4, dtype=torch.float16)
        b = torch.empty(4, dtype=torch.float32)
        with torch.autocast("cpu", dtype=torch.float16):
            assert torch.addcmul(a, a, a).dtype == torch.float16
            assert torch.addcmul(a, a, b).dtype == torch.float32


# --------------------------------------------------------------------------------------------------
# The capture on fake CPU tensors
# --------------------------------------------------------------------------------------------------

def _sizes(events: list[dict]) -> list[tuple]:
    size: dict = {}
    out = []
    for ev in events:
        if ev["op"] == "alloc":
            size[ev["id"]] = ev["size"]
            out.append(("alloc", ev["size"], ev["category"]))
        elif ev["op"] == "free":
            out.append(("free", size[ev["id"]]))
        else:
            out.append(("phase", ev["name"]))
    return out


FAKE_VS_META = [
    ("mlp", 64, 1, "fp32", "adam", "none", 1),
    ("mlp", 64, 1, "bf16", "adamw", "none", 1),
    ("resnet18", 2, 1, "fp32", "sgd-momentum", "none", 1),
    ("resnet18", 2, 1, "bf16", "adamw", "none", 1),
    ("gpt2", 2, 128, "fp32", "adamw", "full", 1),
    ("gpt2", 2, 128, "bf16", "adamw", "none", 1),
    ("bert-base", 2, 128, "fp32", "adamw", "none", 2),
    ("bert-base", 2, 128, "bf16", "adamw", "none", 1),
    ("tinyllama-1.1b", 2, 128, "bf16", "adamw", "none", 1),
]


@pytest.mark.parametrize("case", FAKE_VS_META, ids=lambda c: f"{c[0]}-{c[3]}-{c[4]}-{c[5]}-{c[6]}")
def test_fake_cpu_capture_equals_meta_fixture(case: tuple) -> None:
    """A fake-CPU recording of an fp32/bf16 step is the meta recording, event for event (sizes, categories,
    order): the CPU `step` scalars are left out as host memory, and normalization statistics are CUDA's fp32."""
    model, batch, seq, dtype, opt, ckpt, accum = case
    if model in ("gpt2", "bert-base", "tinyllama-1.1b") and not has("transformers"):
        pytest.skip("transformers is not installed")
    if model == "resnet18" and not has("torchvision"):
        pytest.skip("torchvision is not installed")
    recipe = vc.Recipe(model, batch, seq, dtype, opt, ckpt, accum, 2, "eager", "cpu")
    shape = f"b{batch}" if model in ("mlp", "resnet18") else f"b{batch}s{seq}"
    with open(os.path.join(META_FIXTURES, f"{model}__{shape}__{recipe.name()}.json"), encoding="utf-8") as f:
        fx = json.load(f)
    cap = vc.capture_zoo(recipe)
    assert cap.meta["device"] == "cpu"
    assert cap.summary()["peak_requested_bytes"] == fx["peak_requested_bytes"]
    with gzip.open(os.path.join(META_FIXTURES, fx["trace"]), "rt", encoding="utf-8") as f:
        meta_events = [json.loads(line) for line in f][1:]
    assert _sizes(cap.events) == _sizes(meta_events)


def test_amp_capture_arguments_are_checked() -> None:
    fns = vc.zoo(vc.Recipe("mlp", 2, 1))
    with pytest.raises(ValueError, match="amp needs device='cpu'"):
        vc.capture(*fns, amp="fp16")
    with pytest.raises(ValueError, match="unknown amp dtype"):
        vc.capture(*fns, device="cpu", amp="fp8")
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        vc.capture(*fns, device="cpu", sdpa="cudnn")
    with pytest.raises(ValueError, match="unknown device"):
        vc.capture(*fns, device="cuda")
    with pytest.raises(ValueError, match="unknown attention"):
        vc.zoo(vc.Recipe("gpt2", 2, 8, attention="flash"))
    with pytest.raises(ValueError, match="recompute_sdpa checkpoints the pinned SDPA call"):
        vc.capture(*fns, device="cpu", recompute_sdpa=True)
    with pytest.raises(ValueError, match="selective recomputes the SDPA call only"):
        vc.zoo(vc.Recipe("bert-base", 2, 8, checkpoint="selective"))


def test_amp_fp16_mlp_step_by_hand() -> None:
    """MLP b4 under fp16 autocast with a GradScaler, SGD: the first forward casts each weight and bias once
    (cached, freed when autocast exits), runs the linears in fp16; the loss path is log_softmax in fp16 and an
    fp32 copy for nll_loss; the scaler adds its scale and growth tracker (4 B each) and loss*scale."""
    cap = vc.capture_zoo(vc.Recipe("mlp", 4, 1, "amp-fp16", "sgd", iterations=1))
    ev = cap.events
    params = sum(d_in * d_out + d_out for d_in, d_out in zip(vc.MLP_DIMS, vc.MLP_DIMS[1:]))
    allocs = [e for e in ev if e["op"] == "alloc"]
    setup = [e for e in allocs if e["category"] == "parameter"]
    assert sum(e["size"] for e in setup) == 4 * params
    # forward: fp16 copies of all four weights and biases (cast cache), the fp16 input copy of each linear
    fwd_end = next(i for i, e in enumerate(ev) if e == {"op": "phase", "name": "backward"})
    fwd = [e for e in ev[:fwd_end] if e["op"] == "alloc" and e["category"] != "input"]
    casts = sorted(e["size"] for e in fwd if e.get("tag", "").endswith("_to_copy"))
    want = sorted([2 * d_in * d_out for d_in, d_out in zip(vc.MLP_DIMS, vc.MLP_DIMS[1:])]
                  + [2 * d for d in vc.MLP_DIMS[1:]] + [2 * 4 * vc.MLP_DIMS[0]] + [4 * 4 * vc.MLP_DIMS[-1]])
    assert casts == want, (casts, want)
    # GradScaler: _scale (fp32) and _growth_tracker (int32) live to the end; found_inf, inv_scale made per step
    scaler = [e for e in allocs if e.get("tag") in ("aten.full", ":aten.full")]
    assert [e["size"] for e in scaler][:2] == [4, 4]


@pytest.mark.skipif(not os.path.isdir(AMP_FIXTURES), reason="no AMP fixtures")
@pytest.mark.parametrize("name", ["mlp__b64__amp-fp16-adamw-accum4", "resnet18__b2__amp-bf16-sgd-ckptfull",
                                  "gpt2__b2s128__amp-fp16-adamw"])
def test_amp_fixtures_are_reproducible(name: str) -> None:
    """The generator's recordings are deterministic: recapturing gives the stored fixture's numbers."""
    if name.startswith("gpt2") and not has("transformers"):
        pytest.skip("transformers is not installed")
    if name.startswith("resnet") and not has("torchvision"):
        pytest.skip("torchvision is not installed")
    with open(os.path.join(AMP_FIXTURES, name + ".json"), encoding="utf-8") as f:
        fx = json.load(f)
    r = fx["recipe"]
    recipe = vc.Recipe(fx["model"], r["batch"], r["seq"] or 1, r["dtype"], r["optimizer"], r["checkpoint"],
                       r["accum"], r["iterations"], r["attention"], "cpu")
    s = vc.capture_zoo(recipe).summary()
    assert s["peak_requested_bytes"] == fx["peak_requested_bytes"]
    assert s["peak_by_phase"] == fx["peak_by_phase"]
    assert (s["allocs"], s["frees"]) == (fx["allocs"], fx["frees"])
