"""Capture HF decoders with transformers' default ``use_cache`` on the ``meta`` device, as reference
fixtures in ``models/tests/captures/use_cache/`` (checked by ``models/tests/use_cache_captures.rs``).

The capture tool builds its HF configs with ``use_cache=False``; a user's config keeps the default
``use_cache=True`` (``PretrainedConfig``), and transformers 5.23 then builds a ``DynamicCache`` in
``model.train()`` too: ``merge_with_config_defaults`` (utils/generic.py) turns ``use_cache`` off only
when gradient checkpointing is on and the model trains. Every other setting is the capture tool's
(``vramsim_capture.zoo``): the configs are the same but for ``use_cache``, which is left at its
default; the ``-keep`` cases keep ``outputs = model(**batch)`` until the next step rebinds it.
Run from the repository root (torch, transformers; no GPU, no network)::

    python models/tools/make_use_cache_captures.py
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "traces", "python"))

import make_fixtures as mf  # noqa: E402
import vramsim_capture as vc  # noqa: E402

OUT_DIR = os.path.join(ROOT, "models", "tests", "captures", "use_cache")

# (model, batch, seq, dtype, attention, checkpoint, keep_outputs)
CASES = [
    ("tinyllama-1.1b", 2, 128, "fp32", "eager", "none", False),
    ("tinyllama-1.1b", 2, 128, "bf16", "eager", "none", False),
    ("tinyllama-1.1b", 2, 128, "fp32", "eager", "full", False),
    ("tinyllama-1.1b", 2, 128, "bf16", "eager", "none", True),
    ("gpt2", 2, 128, "fp32", "eager", "none", False),
    ("gpt2", 2, 128, "bf16", "eager", "none", False),
    # No SDPA case: the tool pins only SDPA calls without a mask or enable_gqa, and HF's decoders
    # pass the all-ones mask on fake CPU tensors (GPT-2) or enable_gqa (TinyLlama), with or
    # without the cache.
    ("gpt2", 2, 128, "fp32", "eager", "none", True),
]


def _default_cache_config(model: str, attn: str = "eager"):
    """The capture tool's config with ``use_cache`` left at transformers' default."""
    import transformers as tf
    if model == "gpt2":
        cfg = tf.GPT2Config(attn_implementation=attn)
    elif model == "tinyllama-1.1b":
        cfg = tf.LlamaConfig(attn_implementation=attn, **vc.TINYLLAMA)
    else:
        raise ValueError(model)
    assert cfg.use_cache is True, "transformers' default use_cache changed"
    return cfg


def main() -> int:
    if vc.torch is None:
        print("error: make_use_cache_captures needs torch: pip install torch transformers", file=sys.stderr)
        return 2
    vc._hf_config = _default_cache_config
    os.makedirs(OUT_DIR, exist_ok=True)
    rows = []
    for model, B, S, dtype, attn, ckpt, keep in CASES:
        recipe = vc.Recipe(model, B, S, dtype, "adamw", ckpt, 1, 2, attention=attn)
        if keep:
            # `outputs = model(**batch)` kept by the loop until the next step rebinds it: the
            # output carries past_key_values.
            model_fn, inputs_fn, loss_fn, optimizer_fn = vc.zoo(recipe)
            state = {}

            def keep_loss(m, inp):
                state["out"] = m(**inp)
                return state["out"].loss

            meta = {"model": model, "recipe": recipe.name(), "batch": B, "seq": S, "dtype": dtype,
                    "optimizer": "adamw", "foreach": True, "checkpoint": ckpt,
                    "attn_implementation": attn, "keep_outputs": True}
            cap = vc.capture(model_fn, inputs_fn, keep_loss, optimizer_fn, 2, meta=meta,
                             sdpa=recipe.sdpa_backend())
        else:
            cap = vc.capture_zoo(recipe)
        base = f"{model}__b{B}s{S}__{recipe.name()}__use-cache" + ("-keep" if keep else "")
        fx = mf.write_fixture(cap, recipe, OUT_DIR, base, {"use_cache": True, "attention": attn, "keep_outputs": keep})
        rows.append((base, fx["params"], fx["peak_requested_bytes"], fx["peak_phase"]))
        print(f"{base}: peak {fx['peak_requested_bytes']} in {fx['peak_phase']}")
    v = vc.versions()
    with open(os.path.join(OUT_DIR, "README.md"), "w") as f:
        f.write("# Reference captures: HF decoders with the default `use_cache=True`\n\n")
        f.write("Made by `models/tools/make_use_cache_captures.py` (run it from the repository root to "
                "regenerate) with `traces/python/vramsim_capture.py`, in the format of "
                "`models/tests/fixtures/capture/` plus the recipe field `use_cache`. The configs are the "
                "capture tool's with `use_cache` left at transformers' default (True): the model output "
                "carries a `DynamicCache` whose per-layer keys/values are `torch.cat` copies.\n\n")
        f.write(f"Versions: torch {v['torch']}, transformers {v['transformers']}, "
                f"python {v['python']}.\n\n")
        f.write("| capture | params | peak_requested_bytes | peak phase |\n| --- | ---: | ---: | --- |\n")
        for base, params, peak, phase in rows:
            f.write(f"| {base} | {params:,} | {peak:,} | {phase} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
