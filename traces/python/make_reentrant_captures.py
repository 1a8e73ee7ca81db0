"""Capture reentrant activation checkpointing (``torch.utils.checkpoint(use_reentrant=True)``) on the
meta device, as references for ``models/tests/reentrant.rs`` (written to
``models/tests/reentrant_captures/``).

Each case is a zoo model of ``vramsim_capture`` with ``--checkpoint full --checkpoint-impl
reentrant``: the MLP's ``Linear+ReLU`` blocks under ``checkpoint(block, x, use_reentrant=True)``, and
HF's own per-layer wrapper for BERT and GPT-2 (``activation_checkpointing_enable({"use_reentrant":
True})``), fp32, AdamW (foreach), two iterations.

Run from the repository root (needs torch, transformers)::

    python traces/python/make_reentrant_captures.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vramsim_capture as vc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT_DIR = os.path.join(ROOT, "models", "tests", "reentrant_captures")

# (model, batch, seq)
CASES = [("mlp", 64, 1), ("bert-base", 2, 128), ("gpt2", 2, 128)]


def main() -> int:
    if vc.torch is None:
        print("error: needs torch and transformers", file=sys.stderr)
        return 2
    os.makedirs(OUT_DIR, exist_ok=True)
    for model, batch, seq in CASES:
        recipe = vc.Recipe(model, batch, seq, "fp32", "adamw", "full", 1, 2, "eager", "meta", "reentrant")
        cap = vc.capture_zoo(recipe)
        path = os.path.join(OUT_DIR, f"{model}.jsonl.gz")
        cap.write(path)
        print(f"{path}: {len(cap.events)} events, peak requested {cap.summary()['peak_requested_bytes']} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
