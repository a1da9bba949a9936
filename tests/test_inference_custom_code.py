"""Architectures that are not in transformers, as custom-code folders loaded with trust_remote_code=True:
each loads through the inference, and every served value equals an independent plain-hook computation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from nncanon import StandardizedTransformer
from nncanon.proof.twin import perturb
from nncanon.testing import PROMPTS, tiny_tokenizer

CODE = Path(__file__).parent / "custom_code"
#: Where each style's contributions are, read with plain hooks: (module, factor) per contribution.
SITES = {
    "inside": (("attention.out", 1.0), ("feed_forward.down", 1.0)),
    "scaled": (("attention", 0.5), ("feed_forward", 0.5)),
    "sandwich": (("post_attention_norm", 1.0), ("post_feed_forward_norm", 1.0)),
    "parallel": (("attention", 1.0), ("feed_forward", 1.0)),
}


def _folder(tmp_path: Path, style: str) -> Path:
    folder = tmp_path / style
    folder.mkdir()
    for name in ("configuration_toy.py", "modeling_toy.py"):
        shutil.copy(CODE / name, folder / name)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "nncanon_toy", "block_style": style, "architectures": ["ToyForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_toy.ToyConfig",
                     "AutoModelForCausalLM": "modeling_toy.ToyForCausalLM"},
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }))
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    perturb(built)
    built.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _plain(hf: torch.nn.Module, style: str, inputs: dict) -> dict:
    """Every value, read with plain forward hooks on the unwrapped model."""
    seen, handles = {}, []
    for index, block in enumerate(hf.blocks):
        def keep_block(module, args, output, index=index):
            seen[f"{index}.layer_input"], seen[f"{index}.layer_output"] = args[0].clone(), output.clone()

        def keep_heads(module, args, output, index=index):
            seen[f"{index}.attention_head_outputs"] = args[0].clone().unflatten(-1, (4, -1))

        handles += [block.register_forward_hook(keep_block),
                    block.attention.out.register_forward_hook(keep_heads)]
        for name, (path, factor) in zip(("attention_output", "mlp_output"), SITES[style], strict=True):
            def keep(module, args, output, key=f"{index}.{name}", factor=factor):
                seen[key] = output.clone() * factor
            handles.append(block.get_submodule(path).register_forward_hook(keep))
    try:
        with torch.no_grad():
            seen["logits"] = hf(**inputs).logits
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("style", list(SITES))
def test_custom_code_architecture_loads_through_the_inference(tmp_path, style):
    model = StandardizedTransformer(str(_folder(tmp_path, style)), trust_remote_code=True)
    report = model.support()
    assert model.inferred is not None
    assert report.provenance.startswith("inferred and proved on a twin of this config")
    names = ("layer_input", "attention_head_outputs", "attention_output", "mlp_output", "layer_output")
    for index in range(model.num_layers):
        for name in (*names, "attention_probabilities"):
            assert report.available(name, layer=index), report.reason(name, layer=index)
        assert report.available("attention_norm_scale", layer=index), report.reason("attention_norm_scale", index)
        if style == "parallel":  # (it builds ln_2 and never calls it: its values alone are declined, with why)
            for name in ("mlp_norm_scale", "mlp_normalized"):
                assert "ln_2 does not run" in report.reason(name, layer=index)
        else:
            assert report.available("mlp_norm_scale", layer=index), report.reason("mlp_norm_scale", layer=index)
    saved = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for index in range(model.num_layers):
            block = model.layers[index]
            saved[f"{index}.layer_input"] = block.layer_input.save()
            saved[f"{index}.attention_head_outputs"] = block.self_attn.attention_head_outputs.save()
            saved[f"{index}.attention_output"] = block.self_attn.attention_output.save()
            saved[f"{index}.mlp_output"] = block.mlp.mlp_output.save()
            saved[f"{index}.layer_output"] = block.layer_output.save()
        saved["logits"] = model.logits.save()
    expected = _plain(model._module, style, dict(model.tokenizer(PROMPTS[0], return_tensors="pt")))
    assert expected.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(value, expected[key]), key
