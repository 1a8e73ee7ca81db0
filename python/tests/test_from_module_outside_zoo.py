"""``vramsim.from_module`` on torchvision classifiers the zoo does not have, against PyTorch itself: the
same training step recorded by the package's recorder (``vramsim.record``: meta tensors, or fake CPU
tensors under CUDA's autocast policy for amp-bf16; fused dropout where CUDA fuses it) and replayed.

The recorder sees what a dispatch mode sees: no kernel-internal allocations, so the cuBLAS and cuBLASLt
workspaces vramsim models on CUDA are switched off for the comparison (``cublas_workspace_config=":0:0"``,
``cublaslt_workspace_size=0``; the default prediction is higher by those workspaces). Calls
without a rule fall back on what the capture recorded of them (``Model.recorded``).

Skipped, with the reason, where torch or torchvision is not installed.
"""

import pytest

import vramsim

torch = pytest.importorskip("torch", reason="from_module needs torch (pip install torch)")
tv = pytest.importorskip("torchvision", reason="torchvision is not installed")
nn = torch.nn
F = nn.functional

# The recorder does not see kernel workspaces (see the module's doc).
NO_WORKSPACES = dict(cublas_workspace_config=":0:0", cublaslt_workspace_size=0)


def _adamw(params):
    # predict's default optimizer, with CUDA's foreach default.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)


def _recorded_peak(make, batch, precision):
    """The step recorded by PyTorch and replayed: peak live requested bytes."""

    def inputs_fn():
        return (torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,)))

    def loss_fn(model, inp):
        return F.cross_entropy(model(inp[0]), inp[1])

    kw = dict(device="cpu", amp="bf16") if precision == "amp-bf16" else {}
    rec = vramsim.record(make, inputs_fn, loss_fn, _adamw, **kw)
    return rec.replay().peak_requested_bytes


def _ours(name, batch, precision, **options):
    with torch.device("meta"):
        net = getattr(tv.models, name)()
    m = vramsim.from_module(net, torch.empty(batch, 3, 224, 224, device="meta"))
    assert m.recorded == [], m.recorded  # every call of these models has a rule
    return vramsim.predict(model=m, batch=batch, precision=precision, **options)


ACCEPTANCE = [
    (name, precision)
    for name in ("efficientnet_b0", "mobilenet_v3_large", "convnext_tiny")
    for precision in ("fp32", "amp-bf16")
]


@pytest.mark.parametrize("name,precision", ACCEPTANCE, ids=[f"{n}-{p}" for n, p in ACCEPTANCE])
def test_outside_the_zoo_matches_a_recording(name, precision):
    batch = 8
    theirs = _recorded_peak(getattr(tv.models, name), batch, precision)
    ours = _ours(name, batch, precision, **NO_WORKSPACES).peak_requested_bytes
    with_workspaces = _ours(name, batch, precision).peak_requested_bytes
    err = (ours - theirs) / theirs * 100
    print(f"{name} {precision} batch {batch}: recorded {theirs}, from_module {ours} ({err:+.4f}%), "
          f"with CUDA's workspaces {with_workspaces}")
    assert abs(err) <= 1.0
    assert with_workspaces > ours


@pytest.mark.parametrize("name", ["shufflenet_v2_x1_0", "squeezenet1_0", "densenet121", "mnasnet0_5"])
def test_other_torchvision_classifiers_match_a_recording(name):
    # channel_shuffle (view, transpose, contiguous) and chunk; max_pool2d(ceil_mode=True);
    # avg_pool2d and the dense concatenations; MNASNet's plain inverted residuals.
    batch = 4
    theirs = _recorded_peak(getattr(tv.models, name), batch, "fp32")
    ours = _ours(name, batch, "fp32", **NO_WORKSPACES).peak_requested_bytes
    print(f"{name} fp32 batch {batch}: recorded {theirs}, from_module {ours}")
    assert abs(ours - theirs) / theirs <= 0.01


FALLBACK_HEAVY = [("swin_t", "fp32"), ("maxvit_t", "fp32"), ("maxvit_t", "amp-bf16")]


@pytest.mark.parametrize("name,precision", FALLBACK_HEAVY, ids=[f"{n}-{p}" for n, p in FALLBACK_HEAVY])
def test_transformers_with_calls_without_a_rule_match_a_recording(name, precision):
    # Swin-T's shifted windows (`F.pad`, `torch.roll`, the attention mask's `new_zeros`, `masked_fill`,
    # comparisons, tensor and `...` indexing) and MaxViT-T's `einsum`/`swapaxes` have no rule: they
    # are lowered from their recording, and the step still agrees with PyTorch's. Under autocast the
    # recorded `einsum` casts its arguments to bf16 first, as its AutocastCUDA kernel does.
    batch = 2
    with torch.device("meta"):
        net = getattr(tv.models, name)()
    m = vramsim.from_module(net, torch.empty(batch, 3, 224, 224, device="meta"))
    assert m.recorded, "these models have calls without a rule"
    ours = vramsim.predict(model=m, batch=batch, precision=precision, **NO_WORKSPACES).peak_requested_bytes
    theirs = _recorded_peak(getattr(tv.models, name), batch, precision)
    print(f"{name} {precision} batch {batch}: recorded {theirs}, from_module {ours}; from the recording: "
          + ", ".join(f"{r['op']} × {r['count']}" for r in m.recorded))
    assert abs(ours - theirs) / theirs <= 0.01


def test_regnet_blocks_do_not_nest():
    # RegNet's stages are Sequentials of blocks holding Sequentials of repeated layers: only the
    # outermost repeated children are checkpointing blocks (regions do not nest).
    net = tv.models.regnet_y_400mf().to("meta")  # its constructor reads tensors: not under meta
    m = vramsim.from_module(net, torch.empty(2, 3, 224, 224, device="meta"))
    blocks = [b["module"] for b in m.document["blocks"]]
    assert blocks == [f"trunk_output.block{i}" for i in range(1, 5)]
    full = vramsim.predict(model=m, batch=8, checkpoint="full")
    assert full.peak_requested_bytes < vramsim.predict(model=m, batch=8).peak_requested_bytes


class _Odd(nn.Module):
    """Calls the op library has no rule for: celu (a new output, saves its input), squeeze (a view)
    and logsigmoid (saves its input and a buffer of its own, ``log_sigmoid_forward``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 10)

    def forward(self, x):
        h = F.celu(self.a(x))
        h = h.unsqueeze(1).squeeze(1)
        return self.b(F.logsigmoid(h))


def test_calls_without_a_rule_use_their_recording():
    batch = 1024  # activations (1 MiB per [B, 256] tensor) outweigh the 19k parameters' optimizer step
    with torch.device("meta"):
        net = _Odd()
    m = vramsim.from_module(net, torch.empty(batch, 64, device="meta"))
    assert [r["op"] for r in m.recorded] == ["celu", "squeeze", "log_sigmoid"]
    assert "log_sigmoid" in repr(m)
    p = vramsim.predict(model=m, batch=batch, **NO_WORKSPACES)
    assert [r["op"] for r in p.recorded_calls] == ["celu", "squeeze", "log_sigmoid"]
    assert any("recorded at capture" in w and "celu" in w for w in p.warnings)

    def inputs_fn():
        return (torch.randn(batch, 64), torch.randint(0, 10, (batch,)))

    rec = vramsim.record(_Odd, inputs_fn, lambda model, inp: F.cross_entropy(model(inp[0]), inp[1]), _adamw)
    theirs = rec.replay().peak_requested_bytes
    print(f"_Odd batch {batch}: recorded {theirs}, from_module {p.peak_requested_bytes}")
    assert abs(p.peak_requested_bytes - theirs) / theirs <= 0.01
    # The batch stays a variable through the recording (the buffer's size is 256·batch floats).
    assert vramsim.predict(model=m, batch=2 * batch).peak_requested_bytes > p.peak_requested_bytes


class _Erf(nn.Module):
    """``torch.erf`` has no rule, and its backward is a composite (derivatives.yaml
    ``2.0 / sqrt(M_PI) * exp(-(self.pow(2))) * grad``: five ops, their temporaries alive together):
    the capture records that backward's allocations and frees too."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 10)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.erf(h) * h)


def test_a_recorded_backward_keeps_its_temporaries():
    batch = 1024
    with torch.device("meta"):
        net = _Erf()
    m = vramsim.from_module(net, torch.empty(batch, 64, device="meta"))
    erf = next(op for op in m.document["ops"] if op["op"] == "erf")
    assert len([s for s in erf["recorded"]["backward"]["steps"] if "alloc" in s]) >= 5
    ours = vramsim.predict(model=m, batch=batch, **NO_WORKSPACES).peak_requested_bytes

    def inputs_fn():
        return (torch.randn(batch, 64), torch.randint(0, 10, (batch,)))

    rec = vramsim.record(_Erf, inputs_fn, lambda model, inp: F.cross_entropy(model(inp[0]), inp[1]), _adamw)
    theirs = rec.replay().peak_requested_bytes
    print(f"_Erf batch {batch}: recorded {theirs}, from_module {ours}")
    assert abs(ours - theirs) / theirs <= 0.01


class _InPlace(nn.Module):
    """Calls without a rule that write in place (``clamp_``, which autograd makes save a clone of
    its input; ``leaky_relu_``, saving its result), a view (``narrow``) and a copy (``flip``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 10)

    def forward(self, x):
        h = F.elu(self.a(x)).clamp_(max=3.0)
        h = torch.narrow(F.leaky_relu(h, inplace=True), 1, 0, 128)
        return self.b(torch.cat([h, h.flip(1)], 1))


def test_in_place_calls_without_a_rule_use_their_recording():
    batch = 1024
    with torch.device("meta"):
        net = _InPlace()
    m = vramsim.from_module(net, torch.empty(batch, 64, device="meta"))
    assert [r["op"] for r in m.recorded] == ["elu", "clamp_", "leaky_relu", "narrow", "flip"]
    ours = vramsim.predict(model=m, batch=batch, **NO_WORKSPACES).peak_requested_bytes

    def inputs_fn():
        return (torch.randn(batch, 64), torch.randint(0, 10, (batch,)))

    rec = vramsim.record(_InPlace, inputs_fn, lambda model, inp: F.cross_entropy(model(inp[0]), inp[1]), _adamw)
    theirs = rec.replay().peak_requested_bytes
    print(f"_InPlace batch {batch}: recorded {theirs}, from_module {ours}")
    assert abs(ours - theirs) / theirs <= 0.01


def test_a_fallback_call_follows_the_precision():
    # bf16 parameters: the recorded outputs and saved tensors follow their input's dtype.
    with torch.device("meta"):
        net = _Odd()
    m = vramsim.from_module(net, torch.empty(8, 64, device="meta"))
    fp32 = vramsim.predict(model=m, batch=64, **NO_WORKSPACES).peak_requested_bytes
    bf16 = vramsim.predict(model=m, batch=64, precision="bf16", **NO_WORKSPACES).peak_requested_bytes
    assert bf16 < fp32


class _Same(nn.Module):
    """``Conv2d(padding="same")``: the conv2d rule does not model a string padding, so the call falls
    back on its recording, and says why."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 16, 3, padding="same")
        self.bn = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.c(x))).mean((2, 3)))


def test_arguments_a_rule_refuses_fall_back_on_the_recording():
    batch = 64
    with torch.device("meta"):
        net = _Same()
    m = vramsim.from_module(net, torch.empty(batch, 3, 64, 64, device="meta"))
    assert m.recorded == [
        {"op": "conv2d (padding given as a string is not modelled)", "module": "c", "count": 1}
    ]
    ours = vramsim.predict(model=m, batch=batch, **NO_WORKSPACES).peak_requested_bytes

    def inputs_fn():
        return (torch.randn(batch, 3, 64, 64), torch.randint(0, 10, (batch,)))

    rec = vramsim.record(_Same, inputs_fn, lambda model, inp: F.cross_entropy(model(inp[0]), inp[1]), _adamw)
    theirs = rec.replay().peak_requested_bytes
    print(f"_Same batch {batch}: recorded {theirs}, from_module {ours}")
    assert abs(ours - theirs) / theirs <= 0.01


def test_a_small_hf_gpt2_through_the_fallback_matches_a_recording():
    # HF GPT-2's calls without a rule (`arange`, `to`, the mask's `new_ones`/`le`/`where`, `Conv1D`'s
    # `addmm`, `split`, `pow`, `None` and tensor indexing, ...) all fall back on their recording; a
    # 2-layer model with eager attention still gives PyTorch's recorded step.
    tf = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = tf.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = tf.GPT2LMHeadModel(cfg)

        def forward(self, ids):
            # an all-ones mask, as a tokenizer gives (HF's packed-sequence check cannot run on meta)
            return self.m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits

    def loss(out, y):
        return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())

    batch, seq = 4, 64
    with torch.device("meta"):
        net = Logits()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    m = vramsim.from_module(net, ids, loss_fn=loss, targets=ids)
    assert m.recorded
    ours = vramsim.predict(model=m, batch=batch, **NO_WORKSPACES).peak_requested_bytes

    def inputs_fn():
        return (torch.randint(0, 1000, (batch, seq)), torch.randint(0, 1000, (batch, seq)))

    rec = vramsim.record(Logits, inputs_fn, lambda model, inp: loss(model(inp[0]), inp[1]), _adamw)
    theirs = rec.replay().peak_requested_bytes
    print(f"GPT-2 (2 layers) batch {batch} × {seq}: recorded {theirs}, from_module {ours}")
    assert abs(ours - theirs) / theirs <= 0.01


def test_a_recorded_view_keeps_its_strides(tmp_path):
    # `swapaxes` has no rule: its output is recorded as a view with PyTorch's strides ([256, 1, 16]
    # for a [B, 16, 16] view of a contiguous [B, 256]), so the reshape after it copies (`aten.clone`,
    # the tensor the second Linear saves), as in PyTorch, and the addmm output before it is freed.
    class Swap(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 256)
            self.b = nn.Linear(256, 10)

        def forward(self, x):
            return self.b(self.a(x).view(-1, 16, 16).swapaxes(1, 2).reshape(-1, 256))

    with torch.device("meta"):
        net = Swap()
    m = vramsim.from_module(net, torch.empty(8, 64, device="meta"))
    swap = next(op for op in m.document["ops"] if op["op"] == "swapaxes")
    assert swap["recorded"]["outputs"] == [{"view": 0, "strides": [256, 1, 16]}]
    trace = tmp_path / "swap.jsonl"
    vramsim.predict(model=m, batch=1024, iterations=1, trace_out=str(trace))
    import json

    activations = [
        (e["size"], e.get("tag")) for e in map(json.loads, trace.read_text().splitlines())
        if e.get("op") == "alloc" and e.get("category") == "activation" and e["size"] == 1024 * 256 * 4
    ]
    assert activations == [(1024 * 256 * 4, "aten.clone")]
