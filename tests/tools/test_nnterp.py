"""nnterp 1.3 scripts run on nncanon.nnterp with only the imports changed; the values are the exact ones."""

from __future__ import annotations

import runpy
import textwrap

import pytest
import torch

from nncanon.nnterp import StandardizedTransformer, logit_lens, patchscope_lens, repeat_prompt
from nncanon.testing import PROMPTS, tiny_hf_model, tiny_tokenizer
from nncanon.tools import logit_lens as tools_lens

from .conftest import FAMILIES

#: An nnterp 1.3 script, as a user wrote it (only MODEL is filled in by the test).
SCRIPT = textwrap.dedent(
    """
    import torch
    from nnterp import StandardizedTransformer
    from nnterp.interventions import logit_lens

    model = StandardizedTransformer(MODEL, enable_attention_probs=True)
    prompt = "The Eiffel Tower is in the city of"
    with torch.no_grad(), model.trace(prompt):
        embeddings = model.token_embeddings.save()
        first_in = model.layers_input[0].save()
        attention_in = model.attentions_input[0].save()
        probabilities = model.attention_probabilities[0].save()
        attention_out = model.attentions_output[0].save()
        mlp_in = model.mlps_input[0].save()
        mlp_out = model.mlps_output[0].save()
        first_out = model.layers_output[0].save()
        logits = model.logits.save()

    with torch.no_grad(), model.trace(prompt):
        model.mlps_output[0] = torch.zeros_like(model.mlps_output[0])
        no_mlp = model.layers_output[0].save()

    with torch.no_grad(), model.trace(prompt):
        model.skip_layer(1)
        skipped = model.logits.save()

    direction = torch.ones(model.hidden_size)
    with torch.no_grad(), model.trace(prompt):
        model.steer(layers=[0, 1], steering_vector=direction, factor=2.0, token_positions=-1)
        steered = model.next_token_probs.save()

    probs = logit_lens(model, [prompt])
    top = model.get_topk_closest_tokens(first_out[0, -1], k=3)
    print(model.num_layers, model.num_heads, model.hidden_size, model.vocab_size, len(top))
    """
)


@pytest.mark.parametrize("name", [name for name in ("llama", "gpt2") if name in FAMILIES])
def test_an_nnterp_script_runs_with_the_import_changed(name, tmp_path, capsys):
    hf = tiny_hf_model(name)
    hf.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    code = SCRIPT.replace("from nnterp", "from nncanon.nnterp").replace("MODEL", repr(str(tmp_path)))
    script = tmp_path / "nnterp_script.py"  # nnsight reads a trace's source from its file
    script.write_text(code)
    run = runpy.run_path(str(script), run_name="__main__")
    model = run["model"]
    assert run["attention_out"].shape == run["first_in"].shape
    total = run["first_in"] + run["attention_out"] + run["mlp_out"]
    torch.testing.assert_close(total, run["first_out"], rtol=1e-5, atol=1e-5)  # exact contributions
    torch.testing.assert_close(run["no_mlp"] - run["first_in"], run["attention_out"], rtol=1e-5, atol=1e-5)
    assert run["probabilities"].shape[1] == model.num_heads
    torch.testing.assert_close(run["probabilities"].sum(-1), torch.ones_like(run["probabilities"].sum(-1)))
    assert run["probs"].shape == (1, model.num_layers, model.vocab_size)
    torch.testing.assert_close(run["probs"][:, -1], run["logits"][:, -1].softmax(-1))
    assert not torch.equal(run["skipped"], run["logits"])
    assert len(run["top"]) == 3
    printed = capsys.readouterr().out.split()
    assert printed[-1] == "3" and int(printed[0]) == model.num_layers


@pytest.fixture
def compat(family):
    hf = tiny_hf_model(family)
    return StandardizedTransformer(hf, tokenizer=tiny_tokenizer(hf.config.get_text_config().vocab_size))


def test_accessors_are_the_standard_values(compat):
    model = compat
    values = {}
    with torch.no_grad(), model.trace(PROMPTS):
        block = model.layers[1]
        values["in"] = (model.layers_input[1].save(), block.layer_input.save())
        values["attention"] = (model.attentions_output[1].save(), block.self_attn.attention_output.save())
        values["mlp"] = (model.mlps_output[1].save(), block.mlp.mlp_output.save())
        values["out"] = (model.layers_output[1].save(), block.layer_output.save())
    for name, (ours, standard) in values.items():
        assert torch.equal(ours, standard), name
    assert model.layers_output.returns_tuple is False
    assert model.attentions[1] is model.layers[1].self_attn and model.mlps[0] is model.layers[0].mlp
    assert model.ln_final is model.norm


def test_writes_reach_the_model(compat):
    model = compat
    vector = torch.arange(model.hidden_size, dtype=torch.float32) / model.hidden_size
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.layers_output[0][:, -1] += vector
        model.attentions_output[1][:] = 0
        manual = model.logits.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.steer(0, vector, token_positions=-1)
        model.layers[1].self_attn.attention_output[:] = 0
        steered = model.logits.save()
    assert torch.equal(manual, steered)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.steer(0, vector, batch_index=0, token_positions=[-1])
        model.attentions_output[1] = torch.zeros_like(model.attentions_output[1])
        by_batch_index = model.logits.save()
    assert torch.equal(manual, by_batch_index)


def test_logit_lens_and_patchscope_lens(compat):
    model = compat
    probs = logit_lens(model, PROMPTS)
    lens = tools_lens(model, PROMPTS, positions=-1)
    torch.testing.assert_close(probs, lens.softmax(-1))
    with torch.no_grad(), model.trace(PROMPTS):
        expected = model.next_token_probs.save()
    torch.testing.assert_close(probs[:, -1], expected)
    probs, inverse = logit_lens(model, PROMPTS[0], return_inv_logits=True)
    assert inverse.shape == probs.shape
    scoped = patchscope_lens(model, PROMPTS, repeat_prompt(), layers=[model.num_layers - 1])
    assert scoped.shape == (2, 1, model.vocab_size)
    torch.testing.assert_close(scoped[:, 0], expected, rtol=1e-5, atol=1e-6)


def test_token_embeddings_and_topk(compat):
    model = compat
    with torch.no_grad(), model.trace(PROMPTS[0]):
        ids = model.input_ids.save()  # the model's input comes before the embedding's output
        embeddings = model.token_embeddings.save()
        hidden = model.layers_output[model.num_layers - 1][0, -1].save()
        probs = model.next_token_probs.save()
    with torch.no_grad():
        torch.testing.assert_close(embeddings, model.embed_tokens._module(ids))
    top = model.get_topk_closest_tokens(hidden, k=2)
    assert list(top.values()) == pytest.approx(probs[0].topk(2).values.tolist(), rel=1e-5)
    assert len(model.get_topk_closest_tokens(hidden[None].expand(3, -1), k=2)) == 3


def test_nnterp_module_tree_is_the_standard_one(compat):
    model = compat
    assert model.model.layers is model.layers and model.model.ln_final is model.norm
    assert model.model.embed_tokens is model.embed_tokens and model._model is model._module
    native = model.layers.path.rpartition(".")[2]
    assert getattr(model.model, native) is model.layers  # the native names stay


def test_nnsight_utils_read_the_standard_values(compat):
    from nncanon.nnterp import nnsight_utils as utils

    model = compat
    getters = [(utils.get_layer_input, "layer_input"), (utils.get_attention_output, "self_attn.attention_output"),
               (utils.get_mlp_output, "mlp.mlp_output"), (utils.get_layer_output, "layer_output")]
    ours, standard = [], []
    with torch.no_grad(), model.trace(PROMPTS):
        for getter, path in getters:  # nnsight reads values in forward order: each pair together
            ours.append(getter(model, 1).save())
            value = model.layers[1]
            for name in path.split("."):
                value = getattr(value, name)
            standard.append(value.save())
        probs = utils.get_next_token_probs(model).save()
        projected = utils.project_on_vocab(model, standard[3]).save()
    for mine, theirs in zip(ours, standard, strict=True):
        assert torch.equal(mine, theirs)
    torch.testing.assert_close(probs, model_probs(model))
    acts = utils.get_token_activations(model, PROMPTS, layers=[1, 0])
    torch.testing.assert_close(acts[0], standard[3][:, -1])
    batched = utils.collect_token_activations_batched(model, PROMPTS, batch_size=1, layers=[1, 0])
    torch.testing.assert_close(batched, acts, rtol=1e-5, atol=1e-5)  # one prompt at a time: no padding
    assert projected.shape[-1] == model.vocab_size


def model_probs(model):
    with torch.no_grad(), model.trace(PROMPTS):
        probs = model.logits[:, -1].softmax(-1).save()
    return probs


def test_run_prompts_sums_the_targets_probabilities(compat):
    from nncanon.nnterp.prompt_utils import Prompt, get_first_tokens, run_prompts

    model = compat
    prompts = [Prompt.from_strings(text, {"city": ["Paris", "Rome"]}, model) for text in PROMPTS]
    tokens = get_first_tokens(["Paris", "Rome"], model)
    assert prompts[0].target_tokens["city"] == tokens and len(set(tokens)) == len(tokens)
    result = run_prompts(model, prompts, batch_size=1)["city"]  # [prompts, 1]
    expected = torch.stack([model_probs_of(model, text)[tokens].sum() for text in PROMPTS])
    torch.testing.assert_close(result[:, 0], expected)


def model_probs_of(model, text):
    with torch.no_grad(), model.trace(text):
        probs = model.next_token_probs[0].save()
    return probs


def test_module_accessor_finds_the_models_modules(compat):
    from nncanon.nnterp import ModuleAccessor

    model = compat
    accessor = ModuleAccessor(model._module)
    assert accessor.get_layers() is model.layers._module
    assert accessor.get_embed_tokens() is model.embed_tokens._module
    assert accessor.get_unembed() is model.lm_head._module
    layer = next(i for i, block in enumerate(model.layers) if "self_attn" in block.__dict__)
    assert accessor.get_attention(layer) is model.layers[layer].self_attn._module
