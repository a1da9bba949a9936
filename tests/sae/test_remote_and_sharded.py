"""Dictionaries in a remote request (nncanon and the dictionary travel by value; the server has neither) and on a
model placed with ``device_map`` (blocks on the CPU and on disk)."""

from __future__ import annotations

import torch

from nncanon import StandardizedTransformer
from nncanon.sae import Dictionary, attach
from nncanon.testing import PROMPTS, tiny_hf_model, tiny_tokenizer

from ..test_remote import _hosted, server_without_nncanon  # noqa: F401 - the fixture


def _sae(model, hook="blocks.1.hook_resid_post") -> Dictionary:
    d = model.hidden_size
    g = torch.Generator().manual_seed(0)
    return Dictionary.from_tensors(torch.randn(d, 16, generator=g) / d ** 0.5, torch.full((16,), 0.05),
                                   torch.randn(16, d, generator=g) / d ** 0.5, None, hook_name=hook)


def _run(model, item, remote):
    with torch.no_grad(), model.trace(PROMPTS[0], remote=remote):
        features = item.features.clone().save()
        item.features[..., 3] += 1.0
        logits = model.logits.save()
    return features, logits


def test_remote_equals_local_with_and_without_the_error_term(tmp_path, monkeypatch, server_without_nncanon):  # noqa: F811
    model = _hosted("llama", tmp_path, monkeypatch)
    sae = _sae(model)
    with attach(model, sae) as item:
        local, remote = _run(model, item, False), _run(model, item, "local")
    assert all(torch.equal(a, b) for a, b in zip(local, remote, strict=True))
    with attach(model, sae, error_term=False) as item:
        local, remote = _run(model, item, False), _run(model, item, "local")
        with torch.no_grad(), model.trace(PROMPTS[0], remote="local"):
            replaced = model.logits.save()
        with torch.no_grad(), model.trace(PROMPTS[0]):
            replaced_here = model.logits.save()
    assert all(torch.equal(a, b) for a, b in zip(local, remote, strict=True))
    assert torch.equal(replaced, replaced_here)


def test_device_map_offload_equals_the_whole_model(tmp_path):
    folder = tmp_path / "llama"
    tiny_hf_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    offload = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
               "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "disk"}
    whole = StandardizedTransformer(str(folder), attn_implementation="eager")
    placed = StandardizedTransformer(str(folder), attn_implementation="eager", device_map=offload,
                                     offload_folder=str(tmp_path / "offload"))
    runs = []
    for model in (whole, placed):
        with attach(model, _sae(model)) as item, attach(model, _sae(model, "blocks.0.hook_mlp_out")) as other:
            with torch.no_grad(), model.trace(PROMPTS[0]):
                first = other.features.clone().save()
                item.features[..., 2] = 0
                logits = model.logits.save()
            runs.append((first, logits))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
