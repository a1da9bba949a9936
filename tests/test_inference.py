"""Families nobody wrote: a record inferred from a twin serves exactly the record's values, or declines."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import PretrainedConfig, PreTrainedModel

from nncanon import StandardizedTransformer, UnknownFamilyError
from nncanon.cli import main
from nncanon.families import REGISTRY, Family
from nncanon.inference import infer_family
from nncanon.leave_one_out import compare
from nncanon.proof.checks.base import GRADIENT_VALUES
from nncanon.testing import PROMPTS, tiny_hf_model, tiny_tokenizer
from nncanon.versions import transformers_minor


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma2", "granite", "opt", "gptj"])
def test_inferred_record_serves_every_value_of_the_record(model_type):
    """Leave-one-out on a dense family: each value the record serves is served, bit-equal, by the inferred one."""
    row = compare(model_type)
    assert row.error == ""
    assert row.different == []
    if model_type == "gptj" and transformers_minor() < (5, 24):
        # GPT-J's code before 5.24 computes its probabilities inline in `self._attn` (no attention interface; the
        # record names the operation, families/gptj.py): the inferred record finds none there, and declines
        # them and the heads on every layer; the rest it serves.
        assert row.declined == [f"layers[{i}].{value}" for i in (0, 1)
                                for value in ("attention_probabilities", "attention_head_outputs")]
        assert len(row.recovered) == 2 * 4 + 2
        return
    assert row.declined == []
    assert len(row.recovered) >= 2 * 5 + 2  # per layer: the stream in and out, heads, both contributions


@pytest.mark.parametrize("model_type", ["deepseek_v3", "mamba2", "qwen3_5_text", "phimoe"])
def test_inferred_moe_and_hybrid_records_serve_every_value_of_the_record(model_type):
    """Leave-one-out on a sample of MoE and hybrid types: routers, shared experts, mixers and their heads."""
    row = compare(model_type)
    assert (row.error, row.different, row.declined) == ("", [], [])
    served = {name.split(".", 1)[-1] for name in row.recovered}
    mixers = ("mamba2", "qwen3_5_text")
    expected = {"linear_attention_head_outputs"} if model_type in mixers else {"router_logits", "expert_indices"}
    assert expected <= served


def test_leave_one_out_declines_rather_than_differs():
    """Where the inference cannot stand behind a value, it is declined, never served different: Qwen2-MoE's
    gated shared expert, DiffLlama's differential heads."""
    for model_type, declined in (("qwen2_moe", "shared_expert_output"), ("diffllama", "attention_head_outputs")):
        row = compare(model_type)
        assert row.different == [] and row.error == ""
        assert {name.split(".", 1)[-1] for name in row.declined} == {declined}


def test_residual_inside_the_module_is_read_at_the_projection():
    """BLOOM adds the residual inside its attention and MLP: the inferred sites are their projections."""
    inferred = infer_family(tiny_hf_model("bloom").config)
    assert inferred.family.attention_output.module == "self_attention.dense"
    assert inferred.family.mlp_output.module == "mlp.dense_4h_to_h"
    row = compare("bloom")
    assert row.different == []
    for index in (0, 1):
        for name in ("attention_output", "mlp_output", "layer_output"):
            assert f"layers[{index}].{name}" in row.recovered


def test_scale_and_logit_steps_are_named_by_config_attributes():
    inferred = infer_family(tiny_hf_model("granite").config)
    assert inferred.family.attention_output.scale == "residual_multiplier"
    assert inferred.family.mlp_output.scale == "residual_multiplier"
    assert [(s.op, s.attribute) for s in inferred.family.logit_steps] == [("divide", "logits_scaling")]
    gemma = infer_family(tiny_hf_model("gemma2").config).family
    assert (gemma.attention_output.module, gemma.mlp_output.module) == (
        "post_attention_layernorm", "post_feedforward_layernorm")
    assert [(s.op, s.attribute) for s in gemma.logit_steps] == [("softcap", "final_logit_softcapping")]


def test_unregistered_model_type_loads_through_the_inference(monkeypatch):
    hf = tiny_hf_model("llama")
    monkeypatch.delitem(REGISTRY, "llama")
    model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
    assert model.inferred is not None and model.family is model.inferred.family
    report = model.support()
    assert report.provenance.startswith("inferred and proved on a twin of this config")
    verdict = model._provenance.proof.verdict  # the gradients too, by the same verifier
    for index in range(model.num_layers):
        for value in (v for v in GRADIENT_VALUES if report.available(v, index)):
            assert verdict.proved(index, value, gradient=True), verdict.why_not(index, value, gradient=True)
            assert report.gradient_reason(value, index) is None
    seen = {}
    handle = hf.model.layers[1].self_attn.register_forward_hook(lambda m, a, out: seen.update(out=out[0].clone()))
    try:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            attention = model.layers[1].self_attn.attention_output.save()
    finally:
        handle.remove()
    assert torch.equal(attention, seen["out"])


class _NoBlocksConfig(PretrainedConfig):
    model_type = "nncanon_test_no_blocks"

    def __init__(self, vocab_size=300, hidden_size=32, num_hidden_layers=2, **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        super().__init__(**kwargs)


class _NoBlocks(PreTrainedModel):
    """Two blocks as plain attributes, not a ModuleList."""

    config_class = _NoBlocksConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.first = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.second = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden = self.embed(input_ids)
        return (self.head(hidden + self.second(hidden + self.first(hidden))),)


def test_model_without_a_block_list_is_unknown_and_says_what_was_tried():
    model = _NoBlocks(_NoBlocksConfig())
    with pytest.raises(UnknownFamilyError) as raised:
        StandardizedTransformer(model, tokenizer=tiny_tokenizer())
    message = str(raised.value)
    assert "nncanon_test_no_blocks" in message  # the registry lookup that failed
    assert "tried to infer it" in message and "2 blocks" in message  # and the inference's search


def test_cli_prints_a_family_that_evaluates_to_the_inferred_record(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    tiny_hf_model("gpt2").save_pretrained(folder)
    assert main(["infer", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "identity on layers[0] (attention_output, mlp_output): held" in out
    source = out.split("(FAMILIES = [...] there):\n", 1)[1].split("\n# model_registry/", 1)[0]
    namespace: dict = {}
    exec(source, namespace)
    family = namespace["GPT2"]
    assert isinstance(family, Family)
    inferred = infer_family(tiny_hf_model("gpt2").config).family
    for name in ("layers", "embed_tokens", "norm", "attention", "attention_output", "mlp_output", "head_outputs"):
        assert getattr(family, name) == getattr(inferred, name)
    record = json.loads(re.search(r"model_registry/gpt2.json:\n(\{.*\})", out, re.S).group(1))
    assert record["model_type"] == "gpt2" and record["variants"]["gpt2"]["n_embd"] == 32
