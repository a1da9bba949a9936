"""Remote execution without nncanon on the server: nnsight's ``remote="local"`` simulation.

The simulation serialises the trace as a remote run would and deserialises it with modules the
server lacks hidden. Here nncanon is hidden outright (an import of it raises), so a pass means
nncanon's code travelled with the request by value and the request is keyed as the plain
``TransformersModel`` the server hosts. Every value must be bit-identical to the local trace.
"""

from __future__ import annotations

import importlib.abc
import sys

import pytest
import torch
from nnsight.intervention.backends.local import LocalSimulationBackend
from nnsight.modeling import huggingface

from nncanon import StandardizedTransformer
from nncanon.testing import PROMPTS, tiny_hf_model, tiny_tokenizer


class _NoNncanon(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "nncanon" or name.startswith("nncanon."):
            raise ModuleNotFoundError(f"No module named {name!r} (a server without nncanon)")
        return None


@pytest.fixture
def server_without_nncanon(monkeypatch):
    """Hide nncanon (modules and imports) while the simulated server deserialises a request."""
    hide, restore = LocalSimulationBackend._hide_local_modules, LocalSimulationBackend._restore
    blocker = _NoNncanon()

    def hide_all(self):
        hidden = hide(self)
        for name in [n for n in sys.modules if n == "nncanon" or n.startswith("nncanon.")]:
            hidden["modules"][name] = sys.modules.pop(name)
        sys.meta_path.insert(0, blocker)
        return hidden

    def restore_all(self, hidden):
        sys.meta_path.remove(blocker)
        restore(self, hidden)

    monkeypatch.setattr(LocalSimulationBackend, "_hide_local_modules", hide_all)
    monkeypatch.setattr(LocalSimulationBackend, "_restore", restore_all)


def _hosted(name: str, tmp_path, monkeypatch) -> StandardizedTransformer:
    """A variant saved to a folder and loaded by path, keyed as if it were a hub checkpoint."""
    folder = tmp_path / name
    tiny_hf_model(name).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    monkeypatch.setitem(huggingface._ID_CACHE, str(folder), f"nncanon-test/{name}")  # no hub lookup offline
    return StandardizedTransformer(str(folder), attn_implementation="eager")


def _contributions(model, remote):
    values = []
    report = model.support()
    with torch.no_grad(), model.trace(PROMPTS[0], remote=remote):
        for index in range(model.num_layers):
            layer = model.layers[index]
            values.append(layer.layer_input.save())
            for component, value in (("self_attn", "attention_head_outputs"), ("self_attn", "attention_output"),
                                     ("linear_attn", "linear_attention_output"), ("mlp", "mlp_output")):
                if report.available(value, layer=index):
                    values.append(getattr(getattr(layer, component), value).save())
            values.append(layer.layer_output.save())
        values.append(model.logits.save())
    return values


def test_key_is_the_plain_transformers_model(tmp_path, monkeypatch):
    model = _hosted("llama", tmp_path, monkeypatch)
    assert model.to_model_key().startswith("nnsight.modeling.transformers.TransformersModel:")
    # the proof of a model used remotely runs here, on the local config, before any request
    assert model.support().provenance.startswith("proved on a twin of this config")


@pytest.mark.parametrize("name", ["gemma2", "bloom", "granite", "qwen3_next"])
def test_contribution_values_remote_equal_local(name, tmp_path, monkeypatch, server_without_nncanon):
    model = _hosted(name, tmp_path, monkeypatch)
    local = _contributions(model, remote=False)
    remote = _contributions(model, remote="local")
    assert len(local) == len(remote)
    for a, b in zip(local, remote, strict=True):
        assert torch.equal(a, b)


def test_seed_recipe_remote_equals_local(tmp_path, monkeypatch, server_without_nncanon):
    model = _hosted("gpt2", tmp_path, monkeypatch)
    target = model.tokenizer(" Paris", add_special_tokens=False).input_ids[0]

    def recipe(remote):
        runs = {}
        with torch.no_grad(), model.trace(remote=remote) as tracer:
            with tracer.invoke(PROMPTS[0]):
                runs["clean"] = model.next_token_probs[0, target].save()
            with tracer.invoke(PROMPTS[0]):
                model.layers[1].self_attn.attention_output[:] = 0
                runs["attention"] = model.next_token_probs[0, target].save()
            with tracer.invoke(PROMPTS[0]):
                model.layers[1].mlp.mlp_output[:] = 0
                runs["mlp"] = model.next_token_probs[0, target].save()
            with tracer.invoke(PROMPTS[0]):
                model.layers[1].self_attn.attention_head_outputs[..., 2, :] = 0
                runs["head"] = model.next_token_probs[0, target].save()
        with torch.no_grad(), model.trace(PROMPTS[0], remote=remote):
            model.skip_layers(0, 1)
            runs["skip"] = model.next_token_probs[0, target].save()
        with torch.no_grad(), model.trace(PROMPTS[0], remote=remote):
            model.layers[0].self_attn.attention_probabilities[:, 1] = 0
            runs["probabilities"] = model.logits.save()
        return runs

    local, remote = recipe(False), recipe("local")
    for key in local:
        assert torch.equal(local[key], remote[key]), key


def test_a_request_ships_the_surface_not_the_load_or_the_proof(tmp_path, monkeypatch):
    """The model travels by value as the `MountedModel` it is: the proof's and the loader's code stay here."""
    import io

    from nnsight.intervention.serialization import CustomCloudPickler

    from nncanon.mounted import MountedModel

    model = _hosted("llama", tmp_path, monkeypatch)
    buffer = io.BytesIO()
    CustomCloudPickler(buffer).dump(model)
    payload = buffer.getvalue()
    assert b"MountedModel" in payload
    for name in (b"running_twin", b"load_provenance", b"config_of", b"family_for_load"):
        assert name not in payload, name
    assert type(MountedModel.__new__(MountedModel)) is MountedModel


def test_mounting_caches_travel_empty():
    """The mounting's caches are keyed by module classes (a checkpoint's custom code among them, which a server
    cannot import): a request carries them as new, empty ones, whatever this process mounted before."""
    from nnsight.intervention import serialization

    from nncanon import mounting

    StandardizedTransformer(tiny_hf_model("llama"), tokenizer=tiny_tokenizer(), verify="never")  # a mount fills them
    for cache in (mounting._KERNEL_SITES, mounting._COMBINED, mounting._BLOCK_SITES):
        travelled = serialization.loads(serialization.dumps(cache))
        assert type(travelled) is type(cache) and travelled == {}
    assert mounting._BLOCK_SITES
