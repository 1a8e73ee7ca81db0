"""Time PyTorch's own meta-device capture of the steps `vramsim predict` is benchmarked on (issue 4):
GPT-2 small at batch 8 × seq 1024 and Llama-2-70B at batch 1 × seq 4096 with full (non-reentrant, HF
per-layer) checkpointing, fp32, AdamW (foreach), two iterations — the same recipes as
``vramsim predict --model gpt2 --batch 8 --seq 1024`` and
``vramsim predict --model llama2-70b --batch 1 --seq 4096 --checkpoint full``.

Prints, per case: the time to import torch and transformers (once), to build the model on ``meta``,
to capture the two steps (``capture_seconds``), the process total, and the captured peak of requested
bytes. Run from the repository root::

    python models/tools/bench_capture.py [--only gpt2|llama2-70b]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

T_START = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "traces", "python"))

import torch  # noqa: E402
import transformers as tf  # noqa: E402

import vramsim_capture as vc  # noqa: E402

T_IMPORT = time.perf_counter() - T_START

LLAMA2_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
"""meta-llama/Llama-2-70b-hf's config.json."""


def case(name: str) -> tuple:
    if name == "gpt2":
        cfg = tf.GPT2Config(attn_implementation="eager", use_cache=False)
        cls, batch, seq, ckpt = tf.GPT2LMHeadModel, 8, 1024, False
    else:
        cfg = tf.LlamaConfig(attn_implementation="eager", use_cache=False, **LLAMA2_70B)
        cls, batch, seq, ckpt = tf.LlamaForCausalLM, 1, 4096, True

    def model_fn():
        m = cls(cfg)
        if getattr(m, "loss_type", "") is None:
            m.loss_type = "ForCausalLM"
        if ckpt:
            m.activation_checkpointing_enable({"use_reentrant": False})
        return m

    def inputs_fn():
        return {"input_ids": torch.randint(0, cfg.vocab_size, (batch, seq)),
                "attention_mask": torch.ones(batch, seq, dtype=torch.long),
                "labels": torch.randint(0, cfg.vocab_size, (batch, seq))}

    def loss_fn(m, inp):
        return m(**inp).loss

    def optimizer_fn(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)

    return model_fn, inputs_fn, loss_fn, optimizer_fn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("gpt2", "llama2-70b"))
    a = ap.parse_args()
    print(f"import torch + transformers: {T_IMPORT:.2f} s")
    for name in ("gpt2", "llama2-70b"):
        if a.only and name != a.only:
            continue
        t0 = time.perf_counter()
        cap = vc.capture(*case(name), iterations=2)
        total = time.perf_counter() - t0
        s = cap.summary()
        print(f"{name}: build {cap.meta['build_seconds']:.2f} s, capture {cap.meta['capture_seconds']:.2f} s, "
              f"total {total:.2f} s (+ imports {T_IMPORT:.2f} s), {len(cap.events)} events, "
              f"peak requested {s['peak_requested_bytes']} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
