"""Sharded and offloaded models, as far as a CPU allows: accelerate's disk offload, meta loading.

With ``device_map`` placing blocks on the CPU and on disk (accelerate streams the offloaded weights
in for each forward), every value equals the value of the same model loaded whole, bit for bit;
``project_on_vocab`` works from any layer (the offloaded head included); ``skip_layers`` works
across offloaded blocks. A model loaded by path is built on meta: ``support()`` answers before any
weight is loaded. Multi-GPU placement is checked by ``benchmarks/multi_device_check.py`` on a
machine with GPUs.
"""

from __future__ import annotations

import pytest
import torch

from nncanon import InvalidSkip, StandardizedTransformer
from nncanon.testing import PROMPTS, tiny_hf_model, tiny_tokenizer

OFFLOAD = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "lm_head": "disk",
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tiny_hf_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def _values(model):
    out = []
    with torch.no_grad(), model.trace(PROMPTS):
        for index in range(model.num_layers):
            layer = model.layers[index]
            out.append(layer.layer_input.save())
            out.append(model.project_on_vocab(layer.layer_input).save())
            out.append(layer.self_attn.attention_probabilities.save())
            out.append(layer.self_attn.attention_head_outputs.save())
            out.append(layer.self_attn.attention_output.save())
            out.append(layer.mlp.mlp_output.save())
            out.append(layer.layer_output.save())
        out.append(model.logits.save())
    return out


def test_disk_offload_serves_identical_values(folder, tmp_path):
    whole = StandardizedTransformer(folder, attn_implementation="eager")
    offloaded = StandardizedTransformer(
        folder, attn_implementation="eager", device_map=OFFLOAD, offload_folder=str(tmp_path)
    )
    for a, b in zip(_values(whole), _values(offloaded), strict=True):
        assert a.device == b.device == torch.device("cpu")
        assert torch.equal(a, b)
    # the load-time proof ran on the config, not on the offloaded weights: the same proof, nothing declined
    assert offloaded.support().provenance == whole.support().provenance
    assert offloaded.support().provenance.startswith("proved on a twin of this config")
    assert offloaded.support().declined() == []
    assert hasattr(offloaded._module.model.layers[1], "_hf_hook"), "block 1 really is offloaded"

    with torch.no_grad(), offloaded.trace(PROMPTS[0]):
        entering = offloaded.layers[0].layer_input.save()
        offloaded.skip_layers(0, 1)
        logits = offloaded.logits.save()
        lens = offloaded.project_on_vocab(entering).save()
    assert torch.equal(logits, lens)


def test_meta_loading_answers_support_before_weights(folder):
    model = StandardizedTransformer(folder, attn_implementation="eager")
    assert not model.dispatched
    assert next(model._module.parameters()).device == torch.device("meta")
    report = model.support()
    assert report.layers_with("attention_probabilities") == [0, 1]
    assert not model.dispatched, "support() loads nothing"
    model.dispatch()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        out = model.layers[1].mlp.mlp_output.save()
    assert out.device == torch.device("cpu") and model.dispatched


def test_skip_replacement_on_another_device_is_refused_with_the_reason(folder):
    model = StandardizedTransformer(folder, attn_implementation="eager")
    with pytest.raises(InvalidSkip, match=r"device meta \(expected cpu\)"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            x = model.layers[0].layer_input
            model.skip_layers(0, 0, skip_with=x.to("meta"))
