"""``vramsim.from_module`` on transformers models: the zoo's HF families (GPT-2, BERT, LLaMA),
built from the zoo's own config.json files (``models/tests/hf/``) with 2 layers on the meta device,
give the zoo's ``peak_requested_bytes`` for the same config (``hf_config=``) under every precision.

The model computes its loss from ``labels`` (``outputs.loss``: ``ForCausalLMLoss``, BERT's MLM
``CrossEntropyLoss``), as the zoo's ``--loss hf``; GPT-2 and LLaMA also get the all-ones
``attention_mask`` the zoo's loop passes (transformers' ``fast_all(mask)`` is answered True on the
meta device, and drops the mask for SDPA), BERT none (the zoo's BERT takes none).

Skipped, with the reason, where torch or transformers is not installed.
"""

import json
import os

import pytest

import vramsim

torch = pytest.importorskip("torch", reason="from_module needs torch (pip install torch)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

HF = os.path.join(os.path.dirname(__file__), "..", "..", "models", "tests", "hf")
LAYERS = 2

# (zoo config, transformers class, layer-count field, whether the zoo passes an attention_mask)
FAMILIES = {
    "gpt2": ("gpt2.json", "GPT2LMHeadModel", "n_layer", True),
    "bert": ("bert-base-uncased.json", "BertForMaskedLM", "num_hidden_layers", False),
    "llama": ("TinyLlama-1.1B-intermediate-step-1431k-3T.json", "LlamaForCausalLM", "num_hidden_layers", True),
}


def _config(tmp_path, family):
    fname, cls, field, _ = FAMILIES[family]
    with open(os.path.join(HF, fname)) as f:
        c = json.load(f)
    c[field] = LAYERS
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(c))
    transformers.logging.set_verbosity_error()
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in c.items() if k != "transformers_version"})
    with torch.device("meta"):
        model = getattr(transformers, cls)(cfg)
    return model, str(path)


def _ids(b, s):
    return torch.empty(b, s, dtype=torch.int64, device="meta")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_from_module_matches_the_zoo(tmp_path, family):
    model, cfg = _config(tmp_path, family)
    seq = 256
    inputs = {"input_ids": _ids(2, seq), "labels": _ids(2, seq)}
    if FAMILIES[family][3]:
        inputs["attention_mask"] = _ids(2, seq)
    m = vramsim.from_module(model, inputs)
    assert "scaled_dot_product_attention" in m.ops
    # HF's gradient_checkpointing_enable() (the zoo's --checkpoint full) turns the KV cache off
    # in training (`use_cache=False`): captured so, the blocks are checkpointed like the zoo's.
    m_ck = vramsim.from_module(model, dict(inputs, use_cache=False))
    for graph, options in (
        (m, dict(batch=8, precision="fp32", optimizer="sgd")),
        (m, dict(batch=6, precision="amp-bf16", optimizer="sgd")),
        (m, dict(batch=4, precision="bf16", accum=2)),
        (m, dict(batch=3, precision="amp-fp16")),
        (m_ck, dict(batch=8, precision="amp-bf16", checkpoint="full", optimizer="sgd")),
        (m_ck, dict(batch=5, precision="fp32", checkpoint="full")),
    ):
        ours = vramsim.predict(model=graph, **options).peak_requested_bytes
        theirs = vramsim.predict(hf_config=cfg, seq=seq, **options).peak_requested_bytes
        assert abs(ours - theirs) <= theirs / 1000, options
        if options.get("checkpoint") and family == "llama":
            # LLaMA's GradientCheckpointingLayer also hands position_ids (a keyword argument the
            # capture's module hooks do not see) to the checkpoint: [1, S] int64 kept.
            assert theirs - ours in (0, seq * 8), options
        else:
            assert ours == theirs, options


def test_hf_attention_kernel_follows_the_recipe(tmp_path):
    model, cfg = _config(tmp_path, "gpt2")
    ids = _ids(2, 128)
    m = vramsim.from_module(model, {"input_ids": ids, "attention_mask": _ids(2, 128), "labels": _ids(2, 128)})
    for gpu, precision in (("h100", "amp-bf16"), ("a100-80gb", "amp-bf16"), ("a100-80gb", "fp32")):
        ours = vramsim.predict(model=m, batch=4, gpu=gpu, precision=precision).to_dict()
        theirs = vramsim.predict(hf_config=cfg, seq=128, batch=4, gpu=gpu, precision=precision).to_dict()
        assert ours["attention"]["kernel"] == theirs["attention"]["kernel"], (gpu, precision)


def test_hf_logits_with_a_loss_fn(tmp_path):
    # Without labels the output's `logits` are the output; loss_fn takes them.
    model, _ = _config(tmp_path, "gpt2")
    y = _ids(2, 64)
    m = vramsim.from_module(
        model,
        {"input_ids": _ids(2, 64)},
        loss_fn=lambda logits, t: torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten()),
        targets=y,
    )
    assert m.ops[-1] == "cross_entropy"
    assert vramsim.predict(model=m, batch=3).peak_requested_bytes > 0
