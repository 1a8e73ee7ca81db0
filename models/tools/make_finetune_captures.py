"""Capture fine-tuning steps on the ``meta`` device, as reference fixtures in
``models/tests/captures/finetune/`` (checked by ``models/tests/finetune_captures.rs``).

Two kinds of cases, each on a model of the capture tool's zoo (``vramsim_capture.zoo``, same configs,
same loop):

* **frozen**: the parameters whose names fall under one of the ``--freeze`` patterns get
  ``requires_grad_(False)`` after the model is built (the matching rule is vramsim's ``--freeze``
  syntax, written out again below: a pattern is a dotted module path whose components must equal the
  name's first components, and a component ``A-B`` matches any integer from A to B);
* **lora**: the model wrapped by PEFT's ``get_peft_model(model, LoraConfig(...))`` (PEFT from PyPI),
  which freezes every base parameter and adds ``lora_A``/``lora_B`` to the target linear layers.

The optimizer gets ``model.parameters()`` as in every capture: torch's AdamW skips parameters whose
``.grad`` is None, so frozen ones get no state (what the Trainer's requires_grad filter gives too).
Run from the repository root (torch, transformers, peft; no GPU, no network)::

    python models/tools/make_finetune_captures.py
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "traces", "python"))

import make_fixtures as mf  # noqa: E402
import vramsim_capture as vc  # noqa: E402

OUT_DIR = os.path.join(ROOT, "models", "tests", "captures", "finetune")

# (model, batch, seq, dtype, kind, spec[, checkpoint])
CASES = [
    ("mlp", 64, 0, "fp32", "freeze", "0"),
    ("mlp", 64, 0, "fp32", "freeze", "2,6"),
    ("resnet18", 2, 0, "fp32", "freeze", "conv1,bn1,layer1,layer2"),
    ("gpt2", 2, 128, "fp32", "freeze", "transformer.wte,transformer.wpe,transformer.h.0-5"),
    ("gpt2", 2, 128, "fp32", "freeze", "transformer.h.3.mlp"),
    ("tinyllama-1.1b", 2, 128, "fp32", "freeze", "model.embed_tokens,model.layers.0-10"),
    ("tinyllama-1.1b", 2, 128, "bf16", "freeze", "model"),
    ("bert-base", 2, 128, "fp32", "freeze", "bert.embeddings,bert.encoder.layer.0-5"),
    ("tinyllama-1.1b", 2, 128, "fp32", "lora", "r=8,alpha=16,dropout=0.05,targets=q_proj,v_proj"),
    ("tinyllama-1.1b", 2, 128, "bf16", "lora", "r=16,alpha=32,dropout=0,targets=all-linear"),
    ("gpt2", 2, 128, "fp32", "lora", "r=8,alpha=16,dropout=0.1,targets=c_attn"),
    ("gpt2", 2, 128, "bf16", "lora", "r=4,alpha=8,dropout=0.05,targets=all-linear"),
    # HF's activation_checkpointing_enable calls enable_input_require_grads (transformers 5.23):
    # the frozen embedding's output requires grad.
    ("tinyllama-1.1b", 2, 128, "fp32", "freeze", "model.embed_tokens,model.layers.0-10", "full"),
    ("tinyllama-1.1b", 2, 128, "bf16", "lora", "r=8,alpha=16,dropout=0.05,targets=q_proj,v_proj", "full"),
    ("gpt2", 2, 128, "fp32", "lora", "r=8,alpha=16,dropout=0,targets=c_attn", "full"),
]


def _component_matches(pat: str, comp: str) -> bool:
    if "-" in pat:
        lo, hi = pat.split("-", 1)
        if lo.isdigit() and hi.isdigit() and comp.isdigit():
            return int(lo) <= int(comp) <= int(hi)
    return pat == comp


def matches(pattern: str, name: str) -> bool:
    """Whether parameter ``name`` lies under the module path ``pattern`` (vramsim's ``--freeze``)."""
    p, n = pattern.split("."), name.split(".")
    return len(p) <= len(n) and all(_component_matches(a, b) for a, b in zip(p, n))


def parse_lora(spec: str) -> dict:
    out: dict = {"targets": []}
    key = None
    for part in spec.split(","):
        if "=" in part:
            key, val = part.split("=", 1)
        else:
            val = part  # a further target
        if key == "targets":
            out["targets"].append(val)
        else:
            out[key] = float(val) if key in ("alpha", "dropout") else int(val)
    return out


def wrap(model_fn, kind: str, spec: str):
    def build():
        m = model_fn()
        if kind == "freeze":
            pats = spec.split(",")
            for name, p in m.named_parameters():
                if any(matches(pat, name) for pat in pats):
                    p.requires_grad_(False)
            return m
        import peft
        cfg = parse_lora(spec)
        targets = "all-linear" if cfg["targets"] == ["all-linear"] else cfg["targets"]
        lc = peft.LoraConfig(r=cfg["r"], lora_alpha=cfg["alpha"], lora_dropout=cfg["dropout"],
                             target_modules=targets)
        return peft.get_peft_model(m, lc)
    return build


def main() -> int:
    if vc.torch is None:
        print("error: make_finetune_captures needs torch: pip install torch transformers peft",
              file=sys.stderr)
        return 2
    import peft
    os.makedirs(OUT_DIR, exist_ok=True)
    rows = []
    only = sys.argv[1:]
    for case in CASES:
        model, B, S, dtype, kind, spec = case[:6]
        ckpt = case[6] if len(case) > 6 else "none"
        recipe = vc.Recipe(model, B, S or 128, dtype, "adamw", ckpt, 1, 2)
        tag = spec.replace(",", "+").replace("=", "").replace(".", "_")
        base = f"{model}__{mf.shape_name(recipe) if S else f'b{B}'}__{recipe.name()}__{kind}-{tag}"
        if only and base not in only:
            continue
        model_fn, inputs_fn, loss_fn, optimizer_fn = vc.zoo(recipe)
        built = {}

        def mfn(model_fn=model_fn, kind=kind, spec=spec):
            built["m"] = wrap(model_fn, kind, spec)()
            return built["m"]

        meta = {"model": model, "recipe": recipe.name(), "batch": B, "seq": S or None, "dtype": dtype,
                "optimizer": "adamw", "foreach": True, "checkpoint": ckpt,
                "attn_implementation": "eager" if S else None, kind: spec}
        cap = vc.capture(mfn, inputs_fn, loss_fn, optimizer_fn, 2, meta=meta)
        m = built["m"]
        trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
        total = sum(p.numel() for p in m.parameters())
        fx = mf.write_fixture(cap, recipe, OUT_DIR, base, {kind: spec, "trainable_params": trainable})
        rows.append((base, total, trainable, fx["peak_requested_bytes"], fx["peak_phase"]))
        print(f"{base}: params {total} trainable {trainable} peak {fx['peak_requested_bytes']} in {fx['peak_phase']}",
              flush=True)
    v = vc.versions()
    with open(os.path.join(OUT_DIR, "README.md"), "w") as f:
        f.write("# Reference captures: frozen parameters and PEFT LoRA\n\n")
        f.write("Made by `models/tools/make_finetune_captures.py` (run it from the repository root to "
                "regenerate) with `traces/python/vramsim_capture.py`, in the format of "
                "`models/tests/fixtures/capture/` plus the recipe fields `freeze` (vramsim's `--freeze` "
                "patterns, applied with `requires_grad_(False)`) or `lora` (vramsim's `--lora` spec, "
                "applied with PEFT's `get_peft_model(model, LoraConfig(...))`) and `trainable_params` "
                "(`sum(p.numel() for p in model.parameters() if p.requires_grad)`, what PEFT's "
                "`print_trainable_parameters` prints as trainable).\n\n")
        f.write(f"Versions: torch {v['torch']}, transformers {v['transformers']}, peft {peft.__version__}, "
                f"python {v['python']}.\n\n")
        f.write("| capture | params | trainable | peak_requested_bytes | peak phase |\n"
                "| --- | ---: | ---: | ---: | --- |\n")
        for base, total, trainable, peak, phase in rows:
            f.write(f"| {base} | {total:,} | {trainable:,} | {peak:,} | {phase} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
