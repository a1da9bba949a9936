"""The core surface, beyond the per-family invariants: loading, errors, sizes, support, the recipe."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest
import torch
import transformers

from nncanon import InvalidWrite, SizeNotAvailable, StandardizedTransformer, UnknownFamilyError
from nncanon.testing import PROMPTS, tiny_hf_model, tiny_model, tiny_tokenizer
from nncanon.tools import head_count
from nncanon.versions import transformers_minor


def test_load_from_folder_matches_in_memory(tmp_path):
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded = StandardizedTransformer(str(tmp_path), device="cpu", attn_implementation="eager")
    assert not loaded.dispatched, "loading by path builds the envoys only; weights come at the first trace"
    in_memory = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    with torch.no_grad(), loaded.trace(PROMPTS):
        a = loaded.layers[1].mlp.mlp_output.save()
        logits = loaded.logits.save()
    with torch.no_grad(), in_memory.trace(PROMPTS):
        b = in_memory.layers[1].mlp.mlp_output.save()
        expected = in_memory.logits.save()
    assert torch.equal(a, b) and torch.equal(logits, expected)


#: Multimodal checkpoints whose causal-LM class is their text model: (config, full model, text record, vision).
_VISION_QWEN = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2)
MULTIMODAL = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "qwen3_5_text", _VISION_QWEN),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text", _VISION_QWEN),
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration", "llama4_text",
               dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                    patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)),
}


@pytest.mark.parametrize("model_type", list(MULTIMODAL))
def test_a_multimodal_checkpoint_loads_its_text_model(model_type, tmp_path):
    """Qwen3.5's, Qwen3.5-MoE's and Llama-4's checkpoints are multimodal (``model_type`` ``qwen3_5``...), and
    transformers builds their causal LM from the text config: nncanon serves that model, with the text family."""
    from nncanon.registry import variant as registry_variant

    config_class, model_class, text, vision = MULTIMODAL[model_type]
    text_variant = registry_variant(text)
    config = getattr(transformers, config_class)(text_config=text_variant.config, vision_config=vision)
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == model_type
    model = StandardizedTransformer(str(tmp_path), attn_implementation="eager")
    assert model._text_config.model_type == text
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = model.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    last = model.num_layers - 1
    with torch.no_grad(), model.trace(PROMPTS[0]):
        leaving = model.layers[last].layer_output.save()
        logits = model.logits.save()
    with torch.no_grad():
        assert torch.equal(logits, plain(input_ids=ids).logits)
    assert torch.equal(model.project_on_vocab(leaving), logits)
    assert model.support().layers_with("mlp_output") == list(range(model.num_layers))


def test_a_folder_loads_without_hub_kernels_and_asking_for_them_is_refused(tmp_path, monkeypatch):
    """transformers 5.25 turns hub kernels on by default in from_pretrained (they replace modules' forwards with
    kernels the proof's twin does not run): nncanon loads without them, whatever the environment says, and
    names them where the user asks for them or passes a kernelized model."""
    from nncanon.errors import InvalidModel

    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)  # transformers' default, not the suite's "NO"
    model = StandardizedTransformer(str(tmp_path), attn_implementation="eager")
    assert model._module.use_kernels is False
    ids = model.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad(), model.trace(PROMPTS[0]):
        logits = model.logits.save()
    with torch.no_grad():
        assert torch.equal(logits, hf.eval()(input_ids=ids).logits)
    for asked in ({"use_kernels": True}, {"kernel_config": object()}):
        with pytest.raises(InvalidModel, match=r"hub kernels .*Leave out use_kernels= and kernel_config="):
            StandardizedTransformer(str(tmp_path), **asked)
    hf._use_kernels = True
    assert hf.use_kernels
    with pytest.raises(InvalidModel, match=r"LlamaForCausalLM was loaded with hub kernels.*use_kernels=False"):
        StandardizedTransformer(hf, tokenizer=tiny_tokenizer())


def test_loading_runs_no_forward():
    hf = tiny_hf_model("gpt2")
    calls = []
    handle = hf.register_forward_hook(lambda *args: calls.append(1))
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    model.support()
    handle.remove()
    assert calls == []


def test_left_padding_makes_last_position_every_prompts_last_token():
    model = tiny_model("llama")
    assert model.tokenizer.padding_side == "left"
    with torch.no_grad(), model.trace(PROMPTS):
        batched = model.next_token_probs.save()
    for row, prompt in enumerate(PROMPTS):
        with torch.no_grad(), model.trace(prompt):
            alone = model.next_token_probs.save()
        torch.testing.assert_close(batched[row], alone[0], rtol=1e-5, atol=1e-6)


def test_unknown_family_names_what_is_missing():
    config = transformers.PretrainedConfig()
    config.model_type = "made_up_arch"
    module = torch.nn.Linear(2, 2)
    module.config = config
    expected = r"made_up_arch.*Registered: .*llama.*nncanon/families/.*model_registry"
    with pytest.raises(UnknownFamilyError, match=expected):
        StandardizedTransformer(module)


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("bert", r"'bert' \(BertConfig\): bert is an encoder .* encoders used as decoders are out of nncanon's scope"),
        ("roberta", r"roberta is an encoder .*masked-language modelling.*out of nncanon's scope"),
        ("bart", r"bart's causal-LM class is the decoder half of an encoder-decoder model: its blocks cross-attend"),
        ("dory", r"nGPT model: each block normalises the stream onto the unit sphere and interpolates"),
        ("hrm_text", r"two stacks of blocks \(H and L\) in nested loops.*no one layers\[i\] input or output"),
        ("inkling2_text", r"block attention residuals: each block's input is a learned attention over"),
        ("inkling2_loop_text", r"block attention residuals.*loop_num_passes"),
        ("cpmant", r"prepends `prompt_length` learned prompt tokens"),
        ("blt", r"three stacks on two sequence axes"),
        ("gemma4_unified_assistant", r"speculative-decoding drafter: it ignores input_ids"),
        ("git", r"BERT-style post-norm stack: each block computes LayerNorm\(x \+ attention\)"),
        ("musicgen", r"audio decoder of a text-to-music encoder-decoder.*not a language model over text tokens"),
        ("musicgen_melody", r"num_codebooks parallel streams of EnCodec audio codes.*not a language model over text"),
    ],
)
def test_out_of_scope_types_say_why(model_type, expected):
    """A type of transformers' causal-LM mapping that nncanon does not serve by design raises `OutOfScopeModel`
    (an `UnknownFamilyError`) naming what it is instead of the generic "no family" message; the config is
    read only (nothing is built)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from nncanon import OutOfScopeModel
    from nncanon.families import family_for
    from nncanon.versions import missing_from_transformers

    if (reason := missing_from_transformers(model_type)) is not None:  # an older transformers minor
        pytest.skip(reason)
    config = CONFIG_MAPPING[model_type].__new__(CONFIG_MAPPING[model_type])  # no validation: only its type is read
    with pytest.raises(OutOfScopeModel, match=expected) as caught:
        family_for(config)
    assert isinstance(caught.value, UnknownFamilyError) and "Registered:" not in str(caught.value)


def test_every_causal_lm_type_is_served_or_out_of_scope_with_a_reason():
    """Every model type of transformers' causal-LM mapping is registered, out of scope with a reason, or a
    decoder not served yet with what is missing (`nncanon.scope.NOT_YET`): none gets the generic error."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from nncanon.families import REGISTRY
    from nncanon.scope import NOT_YET, out_of_scope_reason

    missing = {t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in REGISTRY and out_of_scope_reason(t) is None}
    assert missing <= set(NOT_YET), sorted(missing - set(NOT_YET))
    assert not set(NOT_YET) & set(REGISTRY), "a served type is still listed as not served yet"


def test_every_decoder_only_text_type_is_served():
    """Issue 16's measure: no decoder-only text type of transformers is left unserved."""
    from nncanon.scope import NOT_YET

    assert NOT_YET == {}, sorted(NOT_YET)


def test_a_decoder_not_served_yet_says_what_is_missing(monkeypatch):
    """A type listed in `nncanon.scope.NOT_YET` (none is today) gets an `UnknownFamilyError` naming what is
    missing, not the generic error and not `OutOfScopeModel`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from nncanon import OutOfScopeModel
    from nncanon.families import REGISTRY, family_for
    from nncanon.scope import NOT_YET

    monkeypatch.delitem(REGISTRY, "hy_v4")
    monkeypatch.setitem(NOT_YET, "hy_v4", "its streams are not built yet")
    config = CONFIG_MAPPING["hy_v4"].__new__(CONFIG_MAPPING["hy_v4"])
    expected = r"does not serve model_type 'hy_v4' .* yet: its streams are not built yet"
    with pytest.raises(UnknownFamilyError, match=expected) as e:
        family_for(config)
    assert not isinstance(e.value, OutOfScopeModel)


def test_a_family_declines_resume_with_its_reason():
    """ZAYA's router state flows from block to block: a forward resumed at a later block is not the forward,
    so the family declines ``resume`` and `resume_at` raises with the reason ``support()`` gives."""
    from nncanon import ValueNotAvailable
    from nncanon.resuming import resume_at, streams_entering

    model = tiny_model("zaya")
    reason = model.support().model_declines["resume"]
    assert "router state" in reason
    stream = streams_entering(model, PROMPTS[0], [1])[1]
    with pytest.raises(ValueNotAvailable, match=r"model\.resume is not available: ZAYA's router"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            resume_at(model, 1, stream)


def test_sizes_follow_the_config():
    model = tiny_model("qwen3")
    config = model._module.config
    assert model.num_layers == config.num_hidden_layers == 2
    assert (model.num_heads, model.num_kv_heads, model.head_dim) == (4, 2, 16)
    assert model.hidden_size == 32 and model.vocab_size == 300


def test_support_report_api():
    model = tiny_model("llama", attn_implementation="sdpa")
    report = model.support()
    assert report.available("attention_head_outputs", layer=1)
    assert report.available("attention_probabilities", layer=0)     # recomputed under sdpa
    assert report.layers_with("self_attn") == [0, 1] == report.layers_with("query_states")
    assert report.to_dict()["layers"][0]["values"]["mlp_output"] is None
    with pytest.raises(KeyError, match="not a standard value"):
        report.available("attn_out", layer=0)
    with pytest.raises(IndexError, match="2 layers"):
        report.reason("mlp_output", layer=5)
    falcon = tiny_model("falcon_rw_style", attn_implementation="sdpa").support()
    if transformers_minor() < (5, 25):
        # Falcon's ALiBi path under sdpa: the kernel's inputs are its sdpa call's, its probabilities are declined
        # (transformers' eager attends differently there); under eager, the kernel's inputs are (no call takes them).
        assert falcon.available("query_states", layer=0)
        assert not falcon.available("attention_probabilities", layer=0)
        assert 'attn_implementation="eager"' in falcon.reason("attention_probabilities", layer=0)
        assert falcon.layers_with("attention_probabilities") == []
        table = str(falcon)
        assert "FalconDecoderLayer" in table and "attention_probabilities: transformers' Falcon" in table
        # Declined: what a block's components have but do not serve; a dense MLP's routing is not declined.
        assert falcon.declined() == ["attention_probabilities"] == falcon.declined(1)
        kernel = ["query_states", "key_states", "value_states"]
        assert tiny_model("falcon_rw_style").support().declined() == kernel
    else:  # from 5.25 Falcon attends through transformers' interface, ALiBi in the mask: served as Llama's are
        assert falcon.layers_with("attention_probabilities") == [0, 1] == falcon.layers_with("query_states")
        assert falcon.declined() == [] == tiny_model("falcon_rw_style").support().declined()
    assert report.declined() == []
    assert tiny_model("mixtral").support().declined() == []
    assert tiny_model("kolibri1").support().declined() == ["router_logits", "shared_expert_output"]


def test_head_output_write_by_assignment_and_wrong_shape():
    model = tiny_model("llama")
    with torch.no_grad(), model.trace(PROMPTS[0]):
        heads = model.layers[0].self_attn.attention_head_outputs
        model.layers[0].self_attn.attention_head_outputs = torch.zeros_like(heads)
        attention = model.layers[0].self_attn.attention_output.save()
    assert torch.equal(attention, torch.zeros_like(attention))
    with pytest.raises(InvalidWrite, match=r"attention_head_outputs.*\(1, \d+, 4, 8\)"):
        with model.trace(PROMPTS[0]):
            model.layers[0].self_attn.attention_head_outputs = torch.zeros(1, 2, 3)


def test_generation_with_a_write_at_every_step():
    model = tiny_model("llama")
    norms = []
    with torch.no_grad(), model.generate(PROMPTS[0], max_new_tokens=3) as tracer:
        for _ in tracer.iter[0:3]:
            model.layers[0].mlp.mlp_output[:] = 0
            norms.append(model.layers[0].mlp.mlp_output.abs().sum().save())
        ids = tracer.result.save()
    assert [float(n) for n in norms] == [0.0, 0.0, 0.0]
    assert ids.shape[1] == len(model.tokenizer(PROMPTS[0]).input_ids) + 3


def _readme_python() -> str:
    text = (Path(__file__).parents[1] / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)[0]


def test_readme_recipe_runs_unchanged_but_for_the_hub_id(tmp_path, capsys):
    """The README's example is the seed ablation recipe; run it on a GPT-2-shaped model in a folder."""
    config = transformers.GPT2Config(vocab_size=300, n_embd=48, n_layer=12, n_head=12, n_positions=64,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    code = _readme_python()
    assert '"openai-community/gpt2"' in code
    script = tmp_path / "readme_example.py"  # nnsight reads a trace's source from its file
    script.write_text(code.replace('"openai-community/gpt2"', repr(str(tmp_path))))
    runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out
    for name in ("clean", "attention", "mlp", "head 8", "blocks 9-10"):
        assert re.search(rf"^{name}\s+P\(Paris\) \d\.\d{{3}}$", printed, re.M), name
    assert "GPT2Block" in printed


def test_num_heads_of_a_model_without_attention_names_what_it_has():
    model = tiny_model("mamba")
    with pytest.raises(SizeNotAvailable, match=r"mamba has no softmax attention.*head_count"):
        model.num_heads
    assert tiny_model("qwen3_next").num_heads == tiny_model("qwen3_next")._text_config.num_attention_heads


def test_head_sizes_that_differ_by_layer_say_so():
    """Gemma-4's full-attention layers are wider (global_head_dim): transformers' config refuses one head_dim,
    and so does the model, naming each layer's; the per-head values follow each layer's own width. Laguna's
    blocks have their own head counts: no one num_heads, and each block serves its own."""
    model = tiny_model("gemma4_text")
    with pytest.raises(SizeNotAvailable, match=r"head_dim differs by layer \(\{0: 16, 1: 32\}\)"):
        model.head_dim
    with torch.no_grad(), model.trace(PROMPTS[0]):
        sliding = model.layers[0].self_attn.attention_head_outputs.save()
        full = model.layers[1].self_attn.attention_head_outputs.save()
    assert sliding.shape[-2:] == (model.num_heads, 16) and full.shape[-2:] == (model.num_heads, 32)

    laguna = tiny_model("laguna_uneven_heads")  # num_attention_heads_per_layer = [4, 2]
    with pytest.raises(SizeNotAvailable, match=r"num_heads differs by layer \(\{0: 4, 1: 2\}\)"):
        laguna.num_heads
    assert laguna.head_dim == 16
    assert [head_count(laguna, layer) for layer in range(2)] == [4, 2]


def test_bindings_made_at_first_use_are_the_bindings_made_at_once():
    """A load defers a block's bindings (`ComponentState.deferred`): made at the first use, or before a
    copy or pickle, they are field for field what making them at once gives; reading a value makes them."""
    import copy

    from nncanon.mounting import _made, component_states

    model = tiny_model("llama")
    first, last = component_states(model.layers[0]), component_states(model.layers[-1])
    assert all("_make" in state.__dict__ for state in first + last)
    made_at_once = [_made(*state.__dict__["_make"][1]) for state in first]
    copied = [copy.copy(state) for state in first]  # a copy (as a pickle) makes them first
    fields = ("name", "location", "site", "config", "where", "heads", "order", "block", "weighted")
    for state, copied_state, expected in zip(first, copied, made_at_once, strict=True):
        assert "_make" not in state.__dict__ and copied_state.bindings is state.bindings
        assert list(state.bindings) == list(expected)
        for name, binding in state.bindings.items():
            assert [getattr(binding, f) for f in fields] == [getattr(expected[name], f) for f in fields]
            assert (binding.prepare is None) == (expected[name].prepare is None)
    seen = {}
    block = model._module.model.layers[-1]
    hook = block.register_forward_hook(lambda m, i, o: seen.setdefault("output", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad(), model.trace(PROMPTS[0]):
        output = model.layers[-1].layer_output.save()
    hook.remove()
    assert "_make" not in last[0].__dict__ and torch.equal(output, seen["output"])
