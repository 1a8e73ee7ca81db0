"""``vramsim.from_module`` on the zoo's language models at their named sizes: the transformers
module built on the meta device from the published config.json of each size (the zoo's
``models/tests/hf/`` files with the size's fields changed), and karpathy/nanoGPT's ``GPT`` at every
size with and without bias, give the named zoo model's ``peak_requested_bytes`` to the byte
(test_from_module_hf.py checks the families at 2 layers through ``hf_config=``; this checks the
named presets, GQA, the large vocabularies and the layer counts).

The device is given a capacity every recipe fits in (``capacity="4TiB"``): a run that goes out of
memory stops at its first failing allocation, and where that falls is not what is compared here.

Skipped, with the reason, where torch or transformers is not installed.
"""

import importlib.util
import json
import os
import sys

import pytest

import vramsim

torch = pytest.importorskip("torch", reason="from_module needs torch (pip install torch)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
HF = os.path.join(ROOT, "models", "tests", "hf")
SEQ = 256

# zoo name: (base config.json, transformers class, the size's fields from its published
# config.json, whether the zoo's loop passes an attention_mask)
SIZES = {
    # openai-community/gpt2-medium, -large, -xl
    "gpt2-medium": ("gpt2.json", "GPT2LMHeadModel", dict(n_embd=1024, n_layer=24, n_head=16), True),
    "gpt2-large": ("gpt2.json", "GPT2LMHeadModel", dict(n_embd=1280, n_layer=36, n_head=20), True),
    "gpt2-xl": ("gpt2.json", "GPT2LMHeadModel", dict(n_embd=1600, n_layer=48, n_head=25), True),
    # google-bert/bert-large-uncased
    "bert-large": (
        "bert-base-uncased.json", "BertForMaskedLM",
        dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
        False,
    ),
    "tinyllama-1.1b": ("TinyLlama-1.1B-intermediate-step-1431k-3T.json", "LlamaForCausalLM", {}, True),
    "llama2-7b": ("Llama-2-7b-hf.json", "LlamaForCausalLM", {}, True),
    # meta-llama/Llama-2-13b-hf, Llama-2-70b-hf, Meta-Llama-3-8B
    "llama2-13b": (
        "Llama-2-7b-hf.json", "LlamaForCausalLM",
        dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
             num_attention_heads=40, num_key_value_heads=40),
        True,
    ),
    "llama2-70b": (
        "Llama-2-7b-hf.json", "LlamaForCausalLM",
        dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
             num_attention_heads=64, num_key_value_heads=8),
        True,
    ),
    "llama3-8b": (
        "Llama-2-7b-hf.json", "LlamaForCausalLM",
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
             rope_theta=500000.0),
        True,
    ),
}


def _ids(b, s):
    return torch.empty(b, s, dtype=torch.int64, device="meta")


@pytest.mark.parametrize("name", sorted(SIZES))
def test_named_sizes_match_the_zoo(name):
    fname, cls, fields, mask = SIZES[name]
    with open(os.path.join(HF, fname)) as f:
        c = json.load(f)
    c.update(fields)
    transformers.logging.set_verbosity_error()
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in c.items() if k != "transformers_version"})
    with torch.device("meta"):
        model = getattr(transformers, cls)(cfg)
    inputs = {"input_ids": _ids(2, SEQ), "labels": _ids(2, SEQ)}
    if mask:
        inputs["attention_mask"] = _ids(2, SEQ)
    m = vramsim.from_module(model, inputs)
    assert not m.recorded
    for options in (
        dict(batch=2, precision="fp32"),
        dict(batch=2, precision="amp-bf16"),
        dict(batch=2, precision="bf16", optimizer="sgd"),
    ):
        ours = vramsim.predict(model=m, seq=SEQ, capacity="4TiB", **options)
        theirs = vramsim.predict(model=name, seq=SEQ, capacity="4TiB", **options)
        assert theirs.fits, options
        assert ours.peak_requested_bytes == theirs.peak_requested_bytes, options


# The nanoGPT sizes (model.py `from_pretrained`'s config_args) and bias; `nanogpt` itself is in
# test_from_module_hf.py.
NANOGPT = {
    "nanogpt-nobias": (12, 12, 768, False),
    "nanogpt-medium": (24, 16, 1024, True),
    "nanogpt-medium-nobias": (24, 16, 1024, False),
    "nanogpt-large": (36, 20, 1280, True),
    "nanogpt-large-nobias": (36, 20, 1280, False),
    "nanogpt-xl": (48, 25, 1600, True),
    "nanogpt-xl-nobias": (48, 25, 1600, False),
}


@pytest.mark.parametrize("name", sorted(NANOGPT))
def test_nanogpt_sizes_match_the_zoo(name):
    # karpathy/nanoGPT's GPT as models/tools/make_nanogpt_captures.py restates it, the manual
    # attention path (the zoo's `--attention eager`), `logits, loss = model(X, Y)`.
    sys.path.insert(0, os.path.join(ROOT, "traces", "python"))
    spec = importlib.util.spec_from_file_location(
        "make_nanogpt_captures", os.path.join(ROOT, "models", "tools", "make_nanogpt_captures.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with torch.device("meta"):
        gpt = tool.modules()(*NANOGPT[name])
    m = vramsim.from_module(gpt, [_ids(2, 128), _ids(2, 128)])
    for options in (dict(batch=4, precision="fp32"), dict(batch=4, precision="amp-bf16")):
        ours = vramsim.predict(model=m, seq=128, capacity="4TiB", **options).peak_requested_bytes
        theirs = vramsim.predict(
            model=name, seq=128, attention="eager", capacity="4TiB", **options
        ).peak_requested_bytes
        assert ours == theirs, options
