"""Capture the zoo's heads, losses, kept outputs and image sizes on the ``meta`` device, as reference
fixtures in ``models/tests/captures/heads/`` (checked by ``models/tests/head_captures.rs``).

Each case is built as a user would write it, with transformers 5.23 / torchvision 0.29:

* ``seq-cls:N``, ``token-cls:N``: ``AutoModelForSequenceClassification`` /
  ``AutoModelForTokenClassification`` ``.from_config(config)`` with ``num_labels=N`` (GPT-2 and LLaMA
  with ``pad_token_id`` set, which HF needs for batches over 1); labels ``[B]`` int64 (float32 for
  N = 1: regression), ``[B, S]`` int64 for tokens;
* ``none``: ``AutoModel.from_config(config)``, the loop's loss ``out.last_hidden_state.mean()``;
* ``--loss plain``: the model called without labels, ``F.cross_entropy(logits.view(-1, V),
  labels.view(-1))`` in the loop;
* ``--keep-outputs``: the loop stores what the model returns in a variable that the next step's
  assignment rebinds (``state["out"] = model(...)``; torchvision's ``output = model(x)``,
  ``loss = criterion(output, y)``);
* image models: ``torchvision.models.NAME(weights=None, num_classes=N)`` on ``(B, 3, H, W)`` images.

All other settings are the capture tool's (eager attention, ``use_cache=False``, AdamW foreach, two
iterations). Run from the repository root (torch, torchvision, transformers; no GPU, no network)::

    python models/tools/make_head_captures.py
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "traces", "python"))

import make_fixtures as mf  # noqa: E402
import vramsim_capture as vc  # noqa: E402

OUT_DIR = os.path.join(ROOT, "models", "tests", "captures", "heads")

# (model, head, batch, seq, dtype, loss, keep_outputs, image_size, num_classes)
CASES = [
    ("gpt2", "seq-cls:2", 2, 32, "fp32", "hf", False, None, None),
    ("gpt2", "seq-cls:1", 2, 32, "fp32", "hf", False, None, None),
    ("gpt2", "token-cls:5", 2, 32, "bf16", "hf", False, None, None),
    ("gpt2", "none", 2, 32, "fp32", "hf", False, None, None),
    ("gpt2", "lm", 2, 32, "bf16", "plain", False, None, None),
    ("gpt2", "lm", 2, 32, "fp32", "hf", True, None, None),
    ("gpt2", "lm", 2, 32, "bf16", "plain", True, None, None),
    ("bert-base", "seq-cls:3", 2, 32, "fp32", "hf", False, None, None),
    ("bert-base", "seq-cls:1", 2, 32, "bf16", "hf", False, None, None),
    ("bert-base", "token-cls:9", 2, 32, "fp32", "hf", False, None, None),
    ("bert-base", "none", 2, 32, "fp32", "hf", False, None, None),
    ("tinyllama-1.1b", "seq-cls:2", 2, 16, "bf16", "hf", False, None, None),
    ("tinyllama-1.1b", "token-cls:5", 2, 16, "bf16", "hf", False, None, None),
    ("tinyllama-1.1b", "none", 1, 16, "fp32", "hf", False, None, None),
    ("resnet50", None, 2, None, "fp32", "hf", False, (160, 160), 10),
    ("resnet18", None, 2, None, "bf16", "hf", True, (96, 128), 10),
    ("vgg16", None, 2, None, "fp32", "hf", False, (64, 64), 10),
]


def build(model, head, B, S, dtype_name, loss_kind, keep, image, classes):
    import torch
    import transformers as tf

    dtype = getattr(torch, vc.DTYPES[dtype_name])
    state = {}
    if head is None:
        import torchvision
        H, W = image

        def model_fn():
            return getattr(torchvision.models, model)(weights=None, num_classes=classes).to(dtype)

        def inputs_fn():
            return (torch.randn(B, 3, H, W, dtype=dtype), torch.randint(0, classes, (B,)))

        def loss_fn(m, inp):
            output = m(inp[0])
            if keep:
                state["output"] = output
            loss = torch.nn.functional.cross_entropy(output, inp[1])
            if keep:
                state["loss"] = loss
            return loss
    else:
        kind, _, n = head.partition(":")
        n = int(n) if n else 2
        kw = dict(attn_implementation="eager", use_cache=False, num_labels=n)
        if model == "gpt2":
            cfg = tf.GPT2Config(pad_token_id=50256, **kw)
        elif model == "bert-base":
            cfg = tf.BertConfig(**kw)
        else:
            cfg = tf.LlamaConfig(pad_token_id=0, **vc.TINYLLAMA, **kw)
        vocab = cfg.vocab_size

        def model_fn():
            if kind == "seq-cls":
                m = tf.AutoModelForSequenceClassification.from_config(cfg)
            elif kind == "token-cls":
                m = tf.AutoModelForTokenClassification.from_config(cfg)
            elif kind == "none":
                m = tf.AutoModel.from_config(cfg)
            else:
                m = {"gpt2": tf.GPT2LMHeadModel, "tinyllama-1.1b": tf.LlamaForCausalLM,
                     "bert-base": tf.BertForMaskedLM}[model](cfg)
                if model != "bert-base" and getattr(m, "loss_type", "") is None:
                    m.loss_type = "ForCausalLM"
            return m.to(dtype)

        def inputs_fn():
            inp = {"input_ids": torch.randint(0, vocab, (B, S))}
            if model != "bert-base":
                inp["attention_mask"] = torch.ones(B, S, dtype=torch.long)
            if kind == "seq-cls":
                inp["labels"] = torch.randn(B) if n == 1 else torch.randint(0, n, (B,))
            elif kind == "token-cls":
                inp["labels"] = torch.randint(0, n, (B, S))
            elif kind != "none":
                inp["labels"] = torch.randint(0, vocab, (B, S))
            return inp

        def loss_fn(m, inp):
            if kind == "none":
                out = m(**{k: v for k, v in inp.items() if k != "labels"})
                if keep:
                    state["out"] = out
                return out.last_hidden_state.mean()
            if loss_kind == "plain":
                logits = m(**{k: v for k, v in inp.items() if k != "labels"}).logits
                loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)),
                                                         inp["labels"].view(-1))
                if keep:
                    state["out"] = (logits, loss)  # logits, loss = model(x, y)
                return loss
            out = m(**inp)
            if keep:
                state["out"] = out  # outputs = model(**batch)
            return out.loss

    def optimizer_fn(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)

    return model_fn, inputs_fn, loss_fn, optimizer_fn


def main() -> int:
    if vc.torch is None:
        print("error: make_head_captures needs torch: pip install torch torchvision transformers",
              file=sys.stderr)
        return 2
    os.makedirs(OUT_DIR, exist_ok=True)
    rows = []
    for model, head, B, S, dtype, loss, keep, image, classes in CASES:
        recipe = vc.Recipe(model, B, S or 1, dtype, "adamw", "none", 1, 2)
        meta = {"model": model, "recipe": recipe.name(), "batch": B, "seq": S, "dtype": dtype,
                "optimizer": "adamw", "foreach": True, "checkpoint": "none",
                "attn_implementation": "eager" if S else None}
        cap = vc.capture(*build(model, head, B, S, dtype, loss, keep, image, classes),
                         iterations=2, meta=meta)
        shape = f"b{B}s{S}" if S else f"b{B}i{image[0]}x{image[1]}c{classes}"
        variant = (head or "image").replace(":", "") + ("-plain" if loss == "plain" else "") \
            + ("-keep" if keep else "")
        base = f"{model}__{shape}__{dtype}__{variant}"
        fx = mf.write_fixture(cap, recipe, OUT_DIR, base, {
            "head": head, "loss": loss, "keep_outputs": keep,
            "image_size": list(image) if image else None, "num_classes": classes})
        rows.append((base, fx["params"], fx["peak_requested_bytes"], fx["peak_phase"]))
        print(f"{base}: peak {fx['peak_requested_bytes']} in {fx['peak_phase']}")
    v = vc.versions()
    with open(os.path.join(OUT_DIR, "README.md"), "w") as f:
        f.write("# Reference captures: heads, losses, kept outputs, image sizes\n\n")
        f.write("Made by `models/tools/make_head_captures.py` (run it from the repository root to "
                "regenerate; its docstring says how each case is built) with "
                "`traces/python/vramsim_capture.py`, in the format of `models/tests/fixtures/capture/` "
                "plus the recipe fields `head`, `loss`, `keep_outputs`, `image_size`, `num_classes`. "
                "`models/tests/head_captures.rs` checks the peak of every phase segment exactly.\n\n")
        f.write(f"Versions: torch {v['torch']}, transformers {v['transformers']}, "
                f"torchvision {v['torchvision']}, python {v['python']}.\n\n")
        f.write("| capture | params | peak_requested_bytes | peak phase |\n| --- | ---: | ---: | --- |\n")
        for base, params, peak, phase in rows:
            f.write(f"| {base} | {params:,} | {peak:,} | {phase} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
