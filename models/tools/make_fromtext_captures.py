"""Transformers models outside the zoo, both ways: captured by ``vramsim.from_module`` (a graph the models
crate lowers) and recorded by the capture tool (``traces/python/vramsim_capture.py``, CUDA-flavoured:
fused dropout, CUDA's autocast policy on fake CPU tensors for AMP), as fixtures checked by
``models/tests/imported_text_captures.rs`` (the lowering within 1% of the recording).

* ``t5-small``: ``T5ForConditionalGeneration`` with t5-small's shapes (``T5Config`` defaults: d_model 512,
  d_ff 2048, 8 heads, 6 + 6 layers, 32 relative-position buckets, ReLU FFN, dropout 0.1, tied
  ``shared``/``lm_head``), ``attn_implementation="eager"`` (``T5Attention``'s matmuls with the
  relative position bias; transformers' SDPA path passes that bias as an ``attn_mask``, which
  vramsim's SDPA rules do not model yet), ``input_ids`` [B, S] and ``labels`` [B, T] (the loss the
  model computes: ``_shift_right`` of the labels into ``decoder_input_ids``, ``CrossEntropyLoss``).
  No ``attention_mask``: the recorder cannot answer transformers' ``mask.all()`` on meta tensors.

Writes ``models/tests/imported/NAME.json`` (the graph, batch as a variable) and
``models/tests/captures/fromtext/NAME__RECIPE.json`` (the recording's summary). Run from the repository
root (torch, transformers; no GPU, no network)::

    python models/tools/make_fromtext_captures.py
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "traces", "python"))

import vramsim_capture as vc  # noqa: E402

GRAPHS = os.path.join(ROOT, "models", "tests", "imported")
OUT_DIR = os.path.join(ROOT, "models", "tests", "captures", "fromtext")

# (name, batch, (encoder) length, decoder length (T5), dtype)
CASES = [
    ("t5-small", 4, 128, 64, "fp32"),
    ("t5-small", 4, 128, 64, "amp-bf16"),
    ("t5-small", 4, 128, 64, "bf16"),
    ("mixtral-tiny", 4, 128, None, "fp32"),
    ("mixtral-tiny", 4, 128, None, "bf16"),
    ("mixtral-tiny", 4, 128, None, "amp-bf16"),
]


def t5_config():
    import transformers

    c = transformers.T5Config(decoder_start_token_id=0, pad_token_id=0)
    c._attn_implementation = "eager"
    return c


def mixtral_config():
    import transformers

    c = transformers.MixtralConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=1024,
    )
    c._attn_implementation = "eager"
    return c


def build(name):
    import transformers

    if name == "t5-small":
        return transformers.T5ForConditionalGeneration(t5_config())
    return transformers.MixtralForCausalLM(mixtral_config())


def inputs(name, b, s, t, device=None):
    import torch

    ids = torch.empty(b, s, dtype=torch.int64, device=device)
    if name == "t5-small":
        return {"input_ids": ids, "labels": torch.empty(b, t, dtype=torch.int64, device=device)}
    # The all-ones attention_mask a tokenizer gives (the recorder cannot run transformers'
    # packed-sequence check without one: it reads position ids with `.all()`).
    return {"input_ids": ids, "attention_mask": torch.empty(b, s, dtype=torch.int64, device=device),
            "labels": torch.empty(b, s, dtype=torch.int64, device=device)}


def _graph_capture():
    # The installed package's capture (pip install ./python), as from_module runs it: its autocast
    # policies come from the package's capture tool, and its rules from the native module.
    from vramsim import _graph_capture as gc

    return gc


def main() -> int:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    gc = _graph_capture()
    os.makedirs(OUT_DIR, exist_ok=True)
    # The graphs first, in a process where no AMP recording has run yet: the recorder's autocast
    # emulation re-registers the CPU autocast kernels, which the capture's reading of each call's
    # AutocastCUDA policy must not see.
    from vramsim import _vramsim as native  # the installed package (pip install ./python)

    for name in dict.fromkeys(c[0] for c in CASES):
        _, _, s, t, _ = next(c for c in CASES if c[0] == name)
        with torch.device("meta"):
            model = build(name)
        # The calls with a rule, as from_module passes them (the others' backward is recorded).
        doc = gc.capture(model, inputs(name, 2, s, t, "meta"), name=name, rules=native.graph_rules())
        with open(os.path.join(GRAPHS, name + ".json"), "w") as f:
            json.dump(doc, f)
    for name, b, s, t, dtype in CASES:
        def model_fn(dtype=dtype, name=name):
            m = build(name)
            # `--precision bf16`: model.to(bfloat16) (T5LayerNorm then casts back to the weight's dtype).
            return m.to(torch.bfloat16) if dtype == "bf16" else m

        def inputs_fn(name=name, b=b, s=s, t=t):
            return inputs(name, b, s, t)

        def loss_fn(m, x):
            return m(**x).loss

        def opt_fn(params):
            return torch.optim.AdamW(params, lr=1e-4, foreach=True)

        amp = dtype[4:] if dtype.startswith("amp-") else None
        cap = vc.capture(model_fn, inputs_fn, loss_fn, opt_fn, iterations=2,
                         device="cpu" if amp else "meta", amp=amp)
        summary = cap.summary()
        fx = {
            "model": name,
            "graph": f"imported/{name}.json",
            "versions": {k: cap.meta.get(k) for k in ("torch", "transformers", "python")},
            "recipe": {"batch": b, "seq": s, "decoder_seq": t, "dtype": dtype, "optimizer": "adamw",
                       "iterations": 2, "attn_implementation": "eager"},
            "params": cap.meta["params"],
            "peak_requested_bytes": summary["peak_requested_bytes"],
            "peak_phase": summary["peak_phase"],
            "peak_by_phase_segment": [[seg["phase"], seg["peak"]] for seg in summary["peak_by_phase_segment"]],
        }
        shape = f"b{b}s{s}" + (f"t{t}" if t else "")
        path = os.path.join(OUT_DIR, f"{name}__{shape}__{dtype}-adamw.json")
        with open(path, "w") as f:
            json.dump(fx, f, indent=1)
            f.write("\n")
        print(f"{path}: peak {fx['peak_requested_bytes']} ({fx['peak_phase']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
