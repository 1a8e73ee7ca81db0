"""``vramsim.from_module``: a user's nn.Module captured on the meta device and lowered by the models
crate gives the zoo's answers for the zoo's own torchvision / torch.nn modules, under every recipe;
bad arguments and calls without a rule raise ``ConfigError`` naming them.

Skipped, with the reason, where torch (or torchvision) is not installed.
"""

import pytest

import vramsim

torch = pytest.importorskip("torch", reason="from_module needs torch (pip install torch)")
nn = torch.nn


def _meta(*shape, dtype=None):
    return torch.empty(*shape, device="meta", dtype=dtype or torch.float32)


def _mlp():
    # The zoo's `mlp` (traces/python/vramsim_capture.py MLP_DIMS).
    with torch.device("meta"):
        return nn.Sequential(
            nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
            nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1000),
        )


def _torchvision(name):
    tv = pytest.importorskip("torchvision", reason="torchvision is not installed")
    with torch.device("meta"):
        return getattr(tv.models, name)()


CASES = [
    ("mlp", _mlp, (2, 1024)),
    ("resnet18", lambda: _torchvision("resnet18"), (2, 3, 224, 224)),
    ("vgg16", lambda: _torchvision("vgg16"), (2, 3, 224, 224)),
    ("vit-b-16", lambda: _torchvision("vit_b_16"), (2, 3, 224, 224)),
] + [
    (n, (lambda n=n: _torchvision(n)), (2, 3, 224, 224))
    for n in ("resnet34", "resnet50", "resnet101", "resnet152")
]


@pytest.mark.parametrize("zoo,make,shape", CASES, ids=[c[0] for c in CASES])
def test_from_module_matches_the_zoo(zoo, make, shape):
    m = vramsim.from_module(make(), _meta(*shape))
    assert isinstance(m, vramsim.Model)
    for options in (
        dict(batch=8, precision="fp32"),
        dict(batch=5, precision="amp-bf16", accum=2),
        dict(batch=16, precision="bf16", optimizer="sgd-momentum", zero_grad="zero"),
    ):
        ours = vramsim.predict(model=m, **options)
        theirs = vramsim.predict(model=zoo, **options)
        # Within 0.1% is the acceptance; the lowering is the same ops, so it is the byte.
        assert ours.peak_requested_bytes == theirs.peak_requested_bytes, options
        assert ours.peak_reserved_bytes == theirs.peak_reserved_bytes, options


def test_max_batch_and_whatif_take_a_captured_model():
    m = vramsim.from_module(_torchvision("resnet18"), _meta(4, 3, 224, 224))
    ours = vramsim.max_batch(model=m, gpu="rtx4090", precision="amp-bf16")
    theirs = vramsim.max_batch(model="resnet18", gpu="rtx4090", precision="amp-bf16")
    assert ours.max_batch == theirs.max_batch
    w = vramsim.whatif(model=m, batch=4, vary={"precision": ["fp32", "amp-bf16"]})
    assert len(w) == 2 and all(r.fits for r in w)


def test_a_custom_loss_is_captured():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 8))
    y = _meta(4, 8)
    m = vramsim.from_module(net, _meta(4, 64), loss_fn=nn.functional.mse_loss, targets=y)
    assert m.ops[-1] == "mse_loss"
    assert vramsim.predict(model=m, batch=32).peak_requested_bytes > 0


def test_wrong_types_name_the_argument():
    with pytest.raises(vramsim.ConfigError, match="model"):
        vramsim.from_module("resnet18", _meta(2, 3, 224, 224))
    with pytest.raises(vramsim.ConfigError, match="example_inputs"):
        vramsim.from_module(_mlp(), [1, 2, 3])
    with pytest.raises(vramsim.ConfigError, match="loss_fn"):
        vramsim.from_module(_mlp(), _meta(2, 1024), loss_fn=3)
    net = nn.Linear(4, 4)  # real weights: refused, nothing is materialised by from_module
    with pytest.raises(vramsim.ConfigError, match="meta"):
        vramsim.from_module(net, _meta(2, 4))


def test_calls_without_a_rule_are_listed():
    # A call without a rule falls back on its recording (Model.recorded); a document without the
    # recording (an older capture) is refused, listing the call.
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(16, 16), nn.CELU(), nn.Linear(16, 4))
    m = vramsim.from_module(net, _meta(2, 16))
    assert m.recorded == [{"op": "celu", "module": "1", "count": 1}]
    for op in m.document["ops"]:
        op.pop("recorded", None)
    with pytest.raises(vramsim.ConfigError, match="celu @ 1"):
        vramsim.predict(model=m, batch=4)


def test_checkpointing_wraps_the_repeated_blocks():
    # torchvision's BasicBlocks (children of the layerN Sequentials) are the blocks, as in the zoo.
    m = vramsim.from_module(_torchvision("resnet18"), _meta(2, 3, 224, 224))
    for ck in ("full", "every:2"):
        ours = vramsim.predict(model=m, batch=16, checkpoint=ck)
        theirs = vramsim.predict(model="resnet18", batch=16, checkpoint=ck)
        assert ours.peak_requested_bytes == theirs.peak_requested_bytes, ck
        assert not ours.warnings
    with pytest.raises(vramsim.ConfigError, match="blocks"):
        vramsim.from_module(_mlp(), _meta(2, 1024), blocks=["no.such.module"])
