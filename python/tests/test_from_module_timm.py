"""``vramsim.from_module`` on timm's models: every ``timm/...`` zoo model, built by timm 0.6's
``timm.create_model(name)`` on the meta device, gives the zoo's ``peak_requested_bytes`` for the
same recipe (fp32 and amp-bf16; timm's input size, 384x384 for ``_384``, and 1000 classes; and a
non-default ``img_size`` / ``num_classes``). The zoo's timm graphs follow timm 0.6.6 (commit
c865028c, models/src/zoo/timm.rs); 0.6.7 is the nearest release on PyPI (.ci/run pins it).

Skipped, with the reason, where torch or timm is not installed.
"""

import contextlib
import re

import pytest

import vramsim

torch = pytest.importorskip("torch", reason="from_module needs torch (pip install torch)")
timm = pytest.importorskip("timm", reason="timm is not installed (pip install timm==0.6.7)")

# The zoo's timm models (models/src/zoo/mod.rs NAMES, `timm/...`).
NAMES = [
    "resnet18", "resnet26", "resnet34", "resnet50", "resnet101", "resnet152",
    "vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch32_224",
    "vit_base_patch16_224", "vit_base_patch16_384", "vit_large_patch16_224",
    "deit_tiny_patch16_224", "deit_small_patch16_224", "deit_base_patch16_224",
    "efficientnet_b0",
    "convnext_nano", "convnext_tiny", "convnext_small", "convnext_base", "convnext_large",
]


@contextlib.contextmanager
def _linspace_on_cpu():
    # timm 0.6's VisionTransformer / ConvNeXt constructors read their stochastic-depth rates as
    # Python floats (`[x.item() for x in torch.linspace(0, drop_path_rate, depth)]`,
    # vision_transformer.py / convnext.py `__init__`), which a meta tensor cannot answer: those
    # few floats are computed on the CPU, every parameter and buffer stays on the meta device.
    linspace = torch.linspace
    torch.linspace = lambda *a, **k: linspace(*a, **{**k, "device": "cpu"})
    try:
        yield
    finally:
        torch.linspace = linspace


def _create(name, **kwargs):
    with _linspace_on_cpu(), torch.device("meta"):
        return timm.create_model(name, **kwargs)


def _image(hw, b=2):
    return torch.empty(b, 3, hw, hw, device="meta")


def test_the_list_is_the_zoos():
    # The zoo's own list, as its error for an unknown model names it: a timm model added to the
    # zoo must be added here.
    with pytest.raises(vramsim.ConfigError) as e:
        vramsim.predict(model="timm/no-such-model", batch=2)
    zoo = re.findall(r"timm/([a-z0-9_]+)", str(e.value).split("the zoo has", 1)[1])
    assert sorted(zoo) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_timm_from_module_matches_the_zoo(name):
    net = _create(name)
    hw = 384 if name.endswith("_384") else 224
    m = vramsim.from_module(net, _image(hw))
    # Every call has a rule but ViT's `q, k, v = qkv.unbind(0)`, lowered from its recording.
    assert {r["op"] for r in m.recorded} <= {"unbind"}
    for options in (dict(batch=8, precision="fp32"), dict(batch=8, precision="amp-bf16")):
        ours = vramsim.predict(model=m, **options).peak_requested_bytes
        theirs = vramsim.predict(model="timm/" + name, **options).peak_requested_bytes
        # Within 0.1% is the acceptance; the lowering is the same ops, so it is the byte.
        assert ours == theirs, options


@pytest.mark.parametrize(
    "name,kwargs,hw",
    [
        ("vit_small_patch16_224", dict(img_size=160, num_classes=10), 160),
        ("resnet50", dict(num_classes=10), 160),
        ("convnext_nano", dict(num_classes=100), 192),
        ("efficientnet_b0", dict(num_classes=10), 160),
    ],
)
def test_timm_other_sizes_match_the_zoo(name, kwargs, hw):
    m = vramsim.from_module(_create(name, **kwargs), _image(hw))
    options = dict(batch=4, precision="amp-bf16", optimizer="sgd-momentum")
    ours = vramsim.predict(model=m, **options).peak_requested_bytes
    theirs = vramsim.predict(
        model="timm/" + name, image_size=hw, num_classes=kwargs["num_classes"], **options
    ).peak_requested_bytes
    assert ours == theirs
