"""A dictionary's recorded TransformerLens processing: read from its config, applied at attach, named when refused."""

from __future__ import annotations

import json

import pytest
import torch

from nncanon import DictionaryMismatch, InvalidDictionary, UnknownHookName
from nncanon.sae import Dictionary, attach, resolve, value_at
from nncanon.sae.processing import recorded
from nncanon.testing import PROMPTS


def _sae(width: int, hook: str | None, record: dict | None, seed: int = 0, **kw) -> Dictionary:
    g = torch.Generator().manual_seed(seed)
    return Dictionary.from_tensors(torch.randn(width, 8, generator=g) / width ** 0.5, torch.full((8,), 0.01),
                                   torch.randn(8, width, generator=g) / width ** 0.5, torch.randn(width, generator=g),
                                   hook_name=hook, model_from_pretrained_kwargs=record, **kw)


def test_the_record_is_read_from_either_layout_and_bad_records_are_named():
    new = recorded({"metadata": {"model_from_pretrained_kwargs": {"center_writing_weights": True, "fold_ln": False,
                                                                  "n_devices": 1}}})
    assert new.settings == ("center_writing_weights",) and new.no_ops == (("n_devices", 1),)
    assert new.describe() == "from_pretrained_no_processing(center_writing_weights=True)"
    old = recorded({"model_from_pretrained_kwargs": {"fold_value_biases": True}})
    assert old.settings == ("fold_value_biases",) and old.source == "model_from_pretrained_kwargs"
    assert recorded({}).describe() == "no processing"
    hf = recorded({"metadata": {"model_class_name": "AutoModelForCausalLM",
                                "model_from_pretrained_kwargs": {"torch_dtype": "float32"}}})
    assert not hf and hf.describe() == "AutoModelForCausalLM (no processing)"
    with pytest.raises(InvalidDictionary, match="'fold_everything', which is not a TransformerLens loader kwarg"):
        recorded({"metadata": {"model_from_pretrained_kwargs": {"fold_everything": True}}})
    with pytest.raises(InvalidDictionary, match=r"\['fold_ln'\] is 'yes'; .* true or false"):
        recorded({"metadata": {"model_from_pretrained_kwargs": {"fold_ln": "yes"}}})
    with pytest.raises(InvalidDictionary, match="not a mapping"):
        recorded({"model_from_pretrained_kwargs": ["fold_ln"]})
    with pytest.raises(InvalidDictionary, match="model_class_name 'HookedMamba'"):
        recorded({"metadata": {"model_class_name": "HookedMamba"}})
    with pytest.raises(InvalidDictionary, match="fold_everything"):
        _sae(8, None, {"fold_everything": True})


def test_a_folder_keeps_its_record_and_the_repr_says_it(tmp_path):
    sae = _sae(32, "blocks.1.hook_resid_pre", {"center_writing_weights": True, "default_prepend_bos": True})
    assert "reads under from_pretrained_no_processing(center_writing_weights=True)" in repr(sae)
    folder = sae.save(tmp_path / "res")
    saved = json.loads((folder / "cfg.json").read_text())
    assert saved["metadata"]["model_from_pretrained_kwargs"] == {"center_writing_weights": True,
                                                                 "default_prepend_bos": True}
    loaded = Dictionary.load(folder)
    assert loaded.processing == sae.processing
    config = json.loads((folder / "cfg.json").read_text())
    config["metadata"]["model_from_pretrained_kwargs"]["center_everything"] = True
    (folder / "cfg.json").write_text(json.dumps(config))
    with pytest.raises(InvalidDictionary, match="center_everything"):
        Dictionary.load(folder)
    assert "reads under no processing" in repr(_sae(32, "blocks.1.hook_resid_pre", None))


def test_center_writing_weights_centres_what_it_reads_and_hands_the_mean_back(gpt2):
    width = gpt2._text_config.hidden_size
    sae = _sae(width, "blocks.1.hook_resid_pre", {"center_writing_weights": True})
    with attach(gpt2, sae) as item:
        line = gpt2.support().attached[0]
        assert "center_writing_weights: blocks.1.hook_resid_pre centred over its width" in line
        assert "reads under from_pretrained_no_processing(center_writing_weights=True)" in line
        with torch.no_grad(), gpt2.trace(PROMPTS[0]):
            x = gpt2.layers[1].layer_input.save()
            features = item.features.save()
            seen = item.input.save()
            error = item.error.save()
            reconstruction = item.reconstruction.save()
        centred = x - x.mean(-1, keepdim=True)
        assert torch.equal(seen, centred) and torch.equal(features, sae.encode(centred))
        assert torch.allclose(reconstruction + error, x, atol=1e-6)  # in the model's space: the mean handed back
        assert torch.allclose(reconstruction, sae.decode(features) + x.mean(-1, keepdim=True), atol=1e-6)
    with attach(gpt2, sae, error_term=False), torch.no_grad(), gpt2.trace(PROMPTS[0]):
        x = gpt2.layers[1].layer_input.save()  # the reconstruction, with the clean value's mean
    with torch.no_grad(), gpt2.trace(PROMPTS[0]):
        clean = gpt2.layers[1].layer_input.save()
    expected = sae.decode(sae.encode(clean - clean.mean(-1, keepdim=True))) + clean.mean(-1, keepdim=True)
    assert torch.allclose(x, expected, atol=1e-5)


def test_center_writing_weights_is_a_noop_on_an_rmsnorm_model(llama):
    width = llama._text_config.hidden_size
    sae = _sae(width, "blocks.1.hook_resid_post", {"center_writing_weights": True, "fold_ln": True})
    with attach(llama, sae) as item:
        assert "a no-op on this RMSNorm model" in item.describe()
        with torch.no_grad(), llama.trace(PROMPTS[0]):
            x = llama.layers[1].layer_output.save()
            features = item.features.save()
        assert torch.equal(features, sae.encode(x))


def test_fold_value_biases_subtracts_the_value_bias_gpt2_keeps(gpt2):
    d = gpt2._text_config.hidden_size
    block = gpt2._module.transformer.h[1]
    b_v = block.attn.c_attn.bias[2 * d:].detach()
    w_v = block.attn.c_attn.weight[:, 2 * d:].detach()
    for record, bias in (({"fold_value_biases": True}, b_v),
                         ({"fold_value_biases": True, "fold_ln": True}, b_v + block.ln_1.bias.detach() @ w_v)):
        sae = _sae(d, "blocks.1.attn.hook_z", record)
        with attach(gpt2, sae) as item, torch.no_grad(), gpt2.trace(PROMPTS[0]):
            z = gpt2.layers[1].self_attn.attention_head_outputs.save()
            features = item.features.save()
        heads = z.shape[-2]
        expected = sae.encode(z - bias.view(heads, -1))
        assert torch.allclose(features, expected, atol=1e-5), record
        one = _sae(d // heads, "blocks.1.attn.hook_v", record, hook_head_index=2)
        with attach(gpt2, one) as item, torch.no_grad(), gpt2.trace(PROMPTS[0]):
            v = gpt2.layers[1].self_attn.value_states.save()
            features = item.features.save()
        assert torch.allclose(features, one.encode(v[..., 2, :] - bias.view(heads, -1)[2]), atol=1e-5)


def test_what_cannot_be_reproduced_is_refused_at_attach(gpt2, llama):
    d = gpt2._text_config.hidden_size
    with pytest.raises(DictionaryMismatch, match="refactor_factored_attn_matrices: TransformerLens rewrites"):
        attach(gpt2, _sae(d, "blocks.1.attn.hook_z", {"refactor_factored_attn_matrices": True}))
    with attach(gpt2, _sae(d, "blocks.1.hook_resid_post", {"refactor_factored_attn_matrices": True})) as item:
        assert "refactor_factored_attn_matrices: no change" in item.describe()
    with pytest.raises(DictionaryMismatch, match="refuses on a rotary model"):
        attach(llama, _sae(llama._text_config.hidden_size, "blocks.1.hook_resid_post",
                           {"refactor_factored_attn_matrices": True}))
    with pytest.raises(DictionaryMismatch, match=r"under fold_ln: TransformerLens folds the norm's weight.*attach it "
                                                  r"at blocks\.1\.ln2\.hook_normalized"):
        attach(gpt2, _sae(d, "blocks.1.mlp.hook_in", {"fold_ln": True}))
    # ln2.hook_normalized is before the weight under fold_ln or not: such a dictionary attaches there, and reads the
    # LayerNorm's input centred over its root mean square (TransformerLens's value), not the MLP's input.
    folded = _sae(d, "blocks.1.ln2.hook_normalized", {"fold_ln": True})
    norm = gpt2._module.transformer.h[1].ln_2
    seen = []
    handle = norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    try:
        with attach(gpt2, folded) as item, torch.no_grad(), gpt2.trace(PROMPTS[0]):
            features = item.features.save()
    finally:
        handle.remove()
    h = seen[-1] - seen[-1].mean(-1, keepdim=True)
    normalized = h / (h.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    torch.testing.assert_close(features, folded.encode(normalized), rtol=1e-5, atol=1e-5)


def test_circuit_tracer_names_resolve(gpt2, llama):
    for model in (gpt2, llama):
        assert resolve(model, "blocks.1.mlp.hook_in").value == "mlp_input"
        assert resolve(model, "blocks.1.mlp.hook_out").value == "mlp_module_output"
        assert resolve(model, "blocks.1.hook_mlp_out").value == "mlp_output"
        with pytest.raises(UnknownHookName, match=r"blocks\.L\.mlp\.hook_everything"):
            resolve(model, "blocks.1.mlp.hook_everything")
    d = llama._text_config.hidden_size
    transcoder = _sae(d, "blocks.1.mlp.hook_in", None, hook_name_out="blocks.1.mlp.hook_out")
    with torch.no_grad(), llama.trace(PROMPTS[0]):
        x = value_at(llama, "blocks.1.mlp.hook_in").save()
    with attach(llama, transcoder) as item, torch.no_grad(), llama.trace(PROMPTS[0]):
        features = item.features.save()
    assert torch.equal(features, transcoder.encode(x))


def test_evaluate_measures_in_the_dictionarys_space(gpt2):
    from nncanon.sae.evaluation import evaluate

    width = gpt2._text_config.hidden_size
    sae = _sae(width, "blocks.1.hook_resid_post", {"center_writing_weights": True})
    texts = [PROMPTS[0]]
    result = evaluate(gpt2, sae, texts)
    with torch.no_grad(), gpt2.trace(texts):
        x = gpt2.layers[1].layer_output.save()
    centred = (x - x.mean(-1, keepdim=True))[0]
    mse = (sae.decode(sae.encode(centred)).double() - centred.double()).pow(2).sum(-1).mean().item()
    assert result.mse == pytest.approx(mse, rel=1e-5)
