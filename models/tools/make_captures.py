"""Capture the zoo models that ``traces/python/vramsim_capture.py`` has no zoo entry for (ResNet-34/50/152,
VGG-16, BERT-large) on the ``meta`` device, as reference fixtures in ``models/tests/captures/``.

The fixtures have the format of ``traces/python/make_fixtures.py`` (whose ``fixture()`` writes them) and
``models/tests/fixtures.rs`` checks them like the main set. The models are built exactly as the zoo's
references do: ``torchvision.models.NAME(weights=None, num_classes=1000)`` on ``(B, 3, 224, 224)`` images
with ``F.cross_entropy``; ``transformers.BertForMaskedLM`` with bert-large-uncased's shape, eager
attention, ``input_ids`` and ``labels``. Checkpointing wraps every ResNet block, every VGG stage (the
convolutions, ReLUs and pool up to a max pool; VGG has no blocks of its own) and, for BERT, uses HF's
per-layer ``activation_checkpointing_enable``, all non-reentrant.

ViT-B/16 is not captured here: ``nn.MultiheadAttention`` calls ``F.scaled_dot_product_attention``, and on the
meta device that dispatches to the math backend (explicit matmuls and softmax) where CUDA runs a fused
kernel, so a meta capture says nothing about CUDA there. ``build`` can make it (``vit-b-16``, each
``EncoderBlock`` checkpointable) for the fake-CPU captures of ``make_amp_captures.py``, which pin the SDPA
backend as CUDA's ``sdp_utils.cpp`` would choose it.

Run from the repository root (torch, torchvision, transformers; no GPU, no network)::

    python models/tools/make_captures.py
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "traces", "python"))

import make_fixtures as mf  # noqa: E402
import vramsim_capture as vc  # noqa: E402

OUT_DIR = os.path.join(ROOT, "models", "tests", "captures")

# (model, batch, seq, dtype, optimizer, checkpoint)
CASES = [
    ("resnet34", 2, None, "fp32", "sgd", "none"),
    ("resnet50", 2, None, "fp32", "adamw", "none"),
    ("resnet50", 2, None, "bf16", "adamw", "none"),
    ("resnet50", 8, None, "fp32", "sgd", "full"),
    ("resnet50", 32, None, "fp32", "sgd-momentum", "none"),
    ("resnet152", 2, None, "fp32", "sgd", "none"),
    ("vgg16", 2, None, "fp32", "adamw", "none"),
    ("vgg16", 8, None, "fp32", "sgd", "none"),
    ("vgg16", 8, None, "bf16", "adamw", "full"),
    ("bert-large", 2, 128, "fp32", "adamw", "none"),
    ("bert-large", 2, 128, "bf16", "adamw", "none"),
    ("bert-large", 4, 512, "fp32", "sgd", "full"),
]


def build(model: str, batch: int, seq: int | None, dtype_name: str, opt: str, ckpt: bool):
    import torch

    dtype = getattr(torch, vc.DTYPES[dtype_name])
    if model == "vit-b-16":
        import torchvision

        def model_fn():
            m = torchvision.models.vit_b_16(weights=None, num_classes=1000)
            if ckpt:  # one block = one EncoderBlock
                m.encoder.layers = torch.nn.Sequential(*[vc._Checkpointed(b) for b in m.encoder.layers])
            return m.to(dtype)

        def inputs_fn():
            return (torch.randn(batch, 3, 224, 224, dtype=dtype), torch.randint(0, 1000, (batch,)))

        def loss_fn(m, inp):
            return torch.nn.functional.cross_entropy(m(inp[0]), inp[1])

    elif model.startswith("resnet") or model == "vgg16":
        import torchvision

        def model_fn():
            m = getattr(torchvision.models, model)(weights=None, num_classes=1000)
            if ckpt and model.startswith("resnet"):
                for lname in ("layer1", "layer2", "layer3", "layer4"):
                    layer = getattr(m, lname)
                    setattr(m, lname, torch.nn.Sequential(*[vc._Checkpointed(b) for b in layer]))
            elif ckpt:
                mods, stages, cur = list(m.features), [], []
                for mod in mods:
                    cur.append(mod)
                    if isinstance(mod, torch.nn.MaxPool2d):
                        stages.append(vc._Checkpointed(torch.nn.Sequential(*cur)))
                        cur = []
                m.features = torch.nn.Sequential(*stages)
            return m.to(dtype)

        def inputs_fn():
            return (torch.randn(batch, 3, 224, 224, dtype=dtype), torch.randint(0, 1000, (batch,)))

        def loss_fn(m, inp):
            return torch.nn.functional.cross_entropy(m(inp[0]), inp[1])

    else:
        import transformers as tf

        cfg = tf.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096, attn_implementation="eager", use_cache=False)

        def model_fn():
            m = tf.BertForMaskedLM(cfg)
            if ckpt:
                m.activation_checkpointing_enable({"use_reentrant": False})
            return m.to(dtype)

        def inputs_fn():
            return {"input_ids": torch.randint(0, cfg.vocab_size, (batch, seq)),
                    "labels": torch.randint(0, cfg.vocab_size, (batch, seq))}

        def loss_fn(m, inp):
            return m(**inp).loss

    def optimizer_fn(params):
        if opt == "sgd":
            return torch.optim.SGD(params, lr=1e-2, foreach=True)
        if opt == "sgd-momentum":
            return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=True)
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)

    return model_fn, inputs_fn, loss_fn, optimizer_fn


def main() -> int:
    if vc.torch is None:
        print("error: make_captures needs torch: pip install torch torchvision transformers", file=sys.stderr)
        return 2
    os.makedirs(OUT_DIR, exist_ok=True)
    rows = []
    for model, batch, seq, dtype, opt, ckpt in CASES:
        recipe = vc.Recipe(model, batch, seq or 1, dtype, opt, ckpt, 1, 2)
        fns = build(model, batch, seq, dtype, opt, ckpt == "full")
        meta = {"model": model, "recipe": recipe.name(), "batch": batch, "seq": seq, "dtype": dtype,
                "optimizer": opt, "foreach": True, "checkpoint": ckpt,
                "attn_implementation": "eager" if seq else None}
        t0 = time.perf_counter()
        cap = vc.capture(*fns, iterations=2, meta=meta)
        dt = time.perf_counter() - t0
        shape = f"b{batch}" if seq is None else f"b{batch}s{seq}"
        base = f"{model}__{shape}__{recipe.name()}"
        cap.write(os.path.join(OUT_DIR, base + ".jsonl.gz"))
        fx = mf.fixture(cap, recipe, base + ".jsonl.gz")
        with open(os.path.join(OUT_DIR, base + ".json"), "w") as f:
            json.dump(fx, f, indent=1)
            f.write("\n")
        rows.append((model, shape, recipe.name(), fx["params"], fx["peak_requested_bytes"], fx["peak_phase"]))
        print(f"{base}: peak {fx['peak_requested_bytes']} in {fx['peak_phase']} ({dt:.2f} s)")
    v = vc.versions()
    with open(os.path.join(OUT_DIR, "README.md"), "w") as f:
        f.write("# More reference captures: ResNet-34/50/152, VGG-16, BERT-large\n\n")
        f.write("Made by `models/tools/make_captures.py` (run it from the repository root to regenerate) with "
                "`traces/python/vramsim_capture.py`, in the format of `models/tests/fixtures/capture/` "
                "(see its README). `models/tests/fixtures.rs` checks both sets.\n\n")
        f.write(f"Versions: torch {v['torch']}, transformers {v['transformers']}, "
                f"torchvision {v['torchvision']}, python {v['python']}.\n\n")
        f.write("| model | shape | recipe | params | peak_requested_bytes | peak phase |\n")
        f.write("| --- | --- | --- | ---: | ---: | --- |\n")
        for model, shape, rname, params, peak, phase in rows:
            f.write(f"| {model} | {shape} | {rname} | {params:,} | {peak:,} | {phase} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
