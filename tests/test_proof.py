"""Every load proves itself: the twin, the load-time proof, its cache and provenance.

- the twin keeps every setting and every kind of block, shrinks the sizes, and says which attribute
  stops a config that cannot be shrunk (on transformers' own full-size config of every registered type);
- configurations outside the registry variants load with every served value proved on their twin;
- a family record broken on purpose (a wrong site) loses exactly the broken value, with the numbers;
- a write-back broken on purpose (it detaches a value's gradient) loses exactly that value's ``.grad``, with
  the numbers; the value itself is still served;
- the cache: reused, re-proved on ``verify="always"``, ignored when corrupt or made by other versions.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
import transformers

import nncanon
from nncanon import StandardizedTransformer
from nncanon.families import REGISTRY
from nncanon.proof import cache as proof_cache
from nncanon.proof import load as proof_load
from nncanon.proof.checks.base import GRADIENT_VALUES
from nncanon.proof.ladder import NoTwinRuns, running_twin, twin
from nncanon.proof.shrink import TwinError
from nncanon.proof.twin import block_kind, blocks_of, build_twin, model_class_for
from nncanon.registry import records
from nncanon.served import Site
from nncanon.support import COMPONENTS, LAYER_VALUES, NORM_VALUES
from nncanon.testing import PROMPTS, tiny_hf_model, tiny_tokenizer

from .conftest import model_type_params


def test_twin_shrinks_sizes_and_keeps_settings():
    config = transformers.LlamaConfig(attention_bias=True, mlp_bias=True, rms_norm_eps=3e-6)
    small = nncanon.twin(config)
    assert small.config.hidden_size == 64 and small.config.num_hidden_layers == 2
    assert small.config.num_attention_heads == 4 and small.config.num_key_value_heads == 4
    assert small.config.attention_bias and small.config.mlp_bias and small.config.rms_norm_eps == 3e-6
    assert sum(p.numel() for p in small.parameters()) < 1_000_000
    assert type(small) is transformers.LlamaForCausalLM


def test_twin_keeps_grouped_and_multi_query_heads():
    grouped = build_twin(transformers.LlamaConfig(num_attention_heads=32, num_key_value_heads=8)).config
    single = build_twin(transformers.LlamaConfig(num_attention_heads=32, num_key_value_heads=1)).config
    assert (grouped.num_attention_heads, grouped.num_key_value_heads) == (4, 2)
    assert (single.num_attention_heads, single.num_key_value_heads) == (4, 1)


def test_twin_keeps_every_kind_of_block():
    """Gemma-3's five sliding layers and one global, repeated: the twin has both kinds, in the order of
    the blocks it stands for, and the last block."""
    config = transformers.Gemma3TextConfig(num_hidden_layers=26)
    built = build_twin(config)
    kinds = [block_kind(b) for b in blocks_of(built.model, len(built.stands_for))]
    assert len(set(kinds)) == 2
    assert built.stands_for[-1] == 25
    assert [built.config.layer_types[j] for j in range(len(built.stands_for))] == [
        config.layer_types[i] for i in built.stands_for
    ]
    for index in range(26):  # every block is proved by a twin block of its kind
        assert built.kinds[built.stands_for[built.block_for(index)]] == built.kinds[index]


def test_twin_does_not_change_the_callers_random_state():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    twin(transformers.GPT2Config())
    assert torch.equal(torch.rand(3), expected)


class _WideOnlyConfig(transformers.LlamaConfig):
    """A custom config (as custom-code checkpoints have) that refuses widths off a multiple of 128."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.hidden_size % 128:
            raise ValueError(f"hidden_size must be a multiple of 128, got {self.hidden_size}")


def test_a_config_that_cannot_be_shrunk_names_the_attribute():
    with pytest.raises(TwinError, match=r"setting hidden_size \(stream width\) from 4096 to 64 fails.*multiple of 128"):
        build_twin(_WideOnlyConfig(), model_class=transformers.LlamaForCausalLM)


#: transformers' default config of these types does not build at full size (upstream), so it has no twin.
UNBUILDABLE_DEFAULTS = {
    "cohere_compass_text", "dbrx", "dots1", "hunyuan_v1_dense", "hunyuan_v1_moe", "lfm2_moe", "ministral",
    "nemotron", "qwen4_exp", "qwen4_exp_text",
}
#: transformers' default config of these types builds but does not run at full size either (upstream): every
#: twin's forward raises transformers' own error. Bamba's and Granite-4.0-H's defaults have no attention layer
#: (a cache of state-space layers alone has no sequence length in 5.24, no mask sizes in 5.25); DeepSeek-V2's
#: has no experts per token.
_NO_ATTENTION_LAYER = "get_seq_length|`get_mask_sizes` can only be called on Attention layers"
UNRUNNABLE_DEFAULTS = {
    "bamba": _NO_ATTENTION_LAYER, "granitemoehybrid": _NO_ATTENTION_LAYER, "deepseek_v2": "argument 'k' must be int",
}


@pytest.mark.parametrize("model_type", model_type_params())
def test_twin_of_the_full_size_default_config(model_type):
    """Every registered type's full-size default config (a real checkpoint's shape) has a twin that runs in
    plain transformers (`running_twin`: the first step of the ladder whose forward, padded batch and cached
    generation step run), whose blocks have the kinds of the blocks they stand for (checked inside
    `build_twin`) and are the family's. A default config transformers itself cannot build or run has none,
    and says so with transformers' error."""
    from nncanon.loading import causal_lm_config

    record = records()[model_type]
    # the config the causal LM is built from (a multimodal checkpoint whose causal LM is its text model: that)
    full = getattr(transformers, record["config_class"])()
    config = causal_lm_config(full)
    cls = getattr(transformers, record["model_class"]) if record.get("model_class") else model_class_for(full)
    family = REGISTRY[model_type]
    if model_type in UNBUILDABLE_DEFAULTS:
        with pytest.raises(TwinError, match=r"cannot build .* at full size either"):
            build_twin(config, model_class=cls, blocks=family.layers)
        with pytest.raises(NoTwinRuns, match=r"does not build"):
            running_twin(config, model_class=cls, blocks=family.layers)
        return
    if model_type in UNRUNNABLE_DEFAULTS:
        with pytest.raises(NoTwinRuns, match=UNRUNNABLE_DEFAULTS[model_type]):
            running_twin(config, model_class=cls, blocks=family.layers)
        return
    run = running_twin(config, model_class=cls, blocks=family.layers)
    built = run.twin
    assert len(built.model.get_submodule(family.layers)) == len(built.stands_for)
    assert sum(p.numel() for p in built.model.parameters()) < 10_000_000
    assert all(built.block_for(i) is not None for i in range(len(built.kinds)))


def _folder(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    return str(tmp_path)


#: Configurations outside the registry variants, at full size (loaded on meta: no weights exist).
OUTSIDE = {
    "gpt2_inverse_layer_idx_upcast": lambda: transformers.GPT2Config(
        scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True),
    "llama_biases": lambda: transformers.LlamaConfig(attention_bias=True, mlp_bias=True),
    "qwen2_sliding_window": lambda: transformers.Qwen2Config(
        use_sliding_window=True, sliding_window=4096, max_window_layers=14),
    "gemma3_rope_scaling": lambda: transformers.Gemma3TextConfig(
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    "deepseek_v3_dense_first": lambda: transformers.DeepseekV3Config(first_k_dense_replace=3),
    "qwen2_moe_dense_layers": lambda: transformers.Qwen2MoeConfig(mlp_only_layers=[0, 1], decoder_sparse_step=2),
    # Llama-3.2-11B-Vision's layout: 40 blocks, cross-attention (idle on text alone) at 3, 8, ..., 38
    "mllama_vision_default": lambda: transformers.MllamaConfig(),
}


@pytest.mark.parametrize("name", sorted(OUTSIDE))
def test_configs_outside_the_registry_are_proved(name, tmp_path):
    model = StandardizedTransformer(_folder(tmp_path, OUTSIDE[name]()), attn_implementation="eager")
    assert model._module.device.type == "meta", "loading proves on the twin: the model's weights stay unloaded"
    report = model.support()
    assert report.provenance.startswith("proved on a twin of this config (transformers ")
    # The family's own declines only (GPT-2's reordered eager attention calls no attention interface), and the scales
    # of q/k norms its attention calls heads-first (Gemma-3: declined by structure, the same on every config).
    expected = [v for v in LAYER_VALUES if v in model.family.declined(model._text_config, 0)
                or "heads-first" in (report.reason(v, 0) or "")]
    assert report.declined() == expected, [report.reason(v, 0) for v in report.declined()]
    assert not report.model_declines
    for index in range(model.num_layers):
        for value in LAYER_VALUES:
            if value not in COMPONENTS and report.available(value, layer=index):
                assert report.provenance_of(value, index) == report.provenance


def _load(hf, family=None, verify="always"):
    return StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), family=family, verify=verify)


def test_a_broken_site_is_declined_with_the_failed_checks_numbers():
    """mlp_output read at the MLP's input norm (a wrong site of the right shape): the load declines exactly it."""
    broken = dataclasses.replace(REGISTRY["llama"], mlp_output=Site("post_attention_layernorm"))
    hf = tiny_hf_model("llama")
    model = _load(hf, broken)
    report = model.support()
    for index in range(model.num_layers):
        # (and the norm values the wrong site puts in doubt: it names the pre-MLP norm as the MLP's post-norm)
        assert report.declined(index)[-1] == "mlp_output"
        assert set(report.declined(index)[:-1]) <= set(NORM_VALUES)
        reason = report.reason("mlp_output", index)
        assert "not proved on a twin of this config" in reason and "ablation" in reason
        assert "error" in reason and "> 1e-05" in reason
        assert report.available("attention_output", index) and report.available("attention_head_outputs", index)
    with pytest.raises(nncanon.ValueNotAvailable, match="ablation"):
        with model.trace(PROMPTS[0]):
            model.layers[0].mlp.mlp_output.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):  # the values that held are served
        attention = model.layers[0].self_attn.attention_output.save()
    assert attention.shape[-1] == hf.config.hidden_size


def test_a_detached_gradient_declines_exactly_its_grad(monkeypatch, tmp_path):
    """The heads' write-back broken so that the model no longer runs through the served view (its gradient
    never arrives): the load refuses exactly ``attention_head_outputs.grad``, naming the gradient check and
    its numbers; the heads are still served, and every other value's gradient too."""
    from nncanon.served import Binding

    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    original = Binding.write_back

    def detaching(self, view, raw, mediator=None, graph=False):
        if graph and self.name == "attention_head_outputs":
            return raw  # the model keeps its own tensor: the served view is out of the graph
        return original(self, view, raw, mediator, graph)

    monkeypatch.setattr(Binding, "write_back", detaching)
    model = _load(tiny_hf_model("llama"))
    monkeypatch.setattr(Binding, "write_back", original)  # what follows measures the load's verdict only
    report = model.support()
    verdict = model._provenance.proof.verdict
    for index in range(model.num_layers):
        assert report.declined(index) == [] and report.available("attention_head_outputs", index)
        reason = report.gradient_reason("attention_head_outputs", index)
        assert "gradients on layers" in reason and "error" in reason and "> 1e-05" in reason
        failed = verdict.failures(index, "attention_head_outputs", gradient=True)[0]
        assert failed.check == "gradients" and failed.error > 1e-2, failed.describe()
        assert report.gradient_provenance_of("attention_head_outputs", index) == f"declined: {reason}"
        others = [v for v in GRADIENT_VALUES if v != "attention_head_outputs" and report.available(v, index)]
        assert others and all(report.gradient_reason(v, index) is None for v in others)
        assert report.gradient_provenance_of("attention_output", index) == report.provenance
    assert "yes, no .grad [1]" in str(report) and "[1] .grad not served: not proved" in str(report)
    assert report.to_dict()["layers"][0]["gradients_declined"] == {
        "attention_head_outputs": report.gradient_reason("attention_head_outputs", 0)}
    with torch.no_grad(), model.trace(PROMPTS[0]):  # the value is served
        heads = model.layers[0].self_attn.attention_head_outputs.save()
    assert heads.shape[-2:] == (model.num_heads, model.head_dim)
    with pytest.raises(nncanon.GradientNotAvailable, match=r"attention_head_outputs\.grad is not served: .*gradients "
                                                           r"on layers\[0\].*error"):
        with model.trace(PROMPTS[0]):
            heads = model.layers[0].self_attn.attention_head_outputs
            attention = model.layers[0].self_attn.attention_output
            logit = model.logits[0, -1, 5]
            with logit.backward():
                attention.grad.save()
                heads.grad.save()
    with pytest.raises(nncanon.GradientNotAvailable, match="is not served"):  # a write too
        with model.trace(PROMPTS[0]):
            heads = model.layers[1].self_attn.attention_head_outputs
            logit = model.logits[0, -1, 5]
            with logit.backward():
                heads.grad = torch.zeros_like(heads)
    # attribution patching takes its gradients with torch.autograd.grad, not .grad: it refuses them too
    from nncanon.tools import attribution_patching, logit_difference

    with pytest.raises(nncanon.GradientNotAvailable, match=r"attention_head_outputs's gradient is not served"):
        attribution_patching(model, PROMPTS[0], None, logit_difference(5, 6))
    others = attribution_patching(model, PROMPTS[0], None, logit_difference(5, 6), over=("attention", "mlp"))
    assert others.heads is None and not bool(others.attention.isnan().any())
    with model.trace(PROMPTS[0]):  # the other gradients are served
        attention = model.layers[0].self_attn.attention_output
        logit = model.logits[0, -1, 5]
        with logit.backward():
            grad = attention.grad.save()
    assert grad.shape[-1] == model.hidden_size and bool(grad.abs().any())


def test_a_missing_scale_is_declined():
    """Granite's attention read without its residual multiplier: attention_output is declined, the MLP's
    (with its multiplier) is served."""
    broken = dataclasses.replace(REGISTRY["granite"], attention_output=Site("self_attn", index=0))
    model = _load(tiny_hf_model("granite"), broken)
    report = model.support()
    for index in range(model.num_layers):
        assert report.declined(index) == ["attention_output"]
        assert "ablation" in report.reason("attention_output", index)
        assert report.available("mlp_output", index)
    registered = _load(tiny_hf_model("granite"), verify="auto").support()  # the broken proof is not reused
    assert all(registered.available("attention_output", index) for index in range(model.num_layers))


def test_the_cache_is_reused_and_verify_always_proves_again(monkeypatch, tmp_path):
    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    hf = tiny_hf_model("llama")
    first = _load(hf, verify="auto")._provenance.proof
    assert not first.from_cache and len(list((tmp_path / "proofs").glob("*.json"))) == 1
    calls = []
    monkeypatch.setattr(proof_load, "running_twin", lambda *a, **k: calls.append(1) or pytest.fail("re-proved"))
    second = _load(hf, verify="auto")._provenance.proof
    assert second.from_cache and second.key == first.key and second.verdict.to_list() == first.verdict.to_list()
    monkeypatch.undo()
    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    again = _load(hf, verify="always")._provenance.proof
    assert not again.from_cache


def test_a_corrupt_cache_is_ignored_and_rewritten(monkeypatch, tmp_path):
    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    hf = tiny_hf_model("llama")
    proof = _load(hf, verify="auto")._provenance.proof
    path = tmp_path / "proofs" / f"{proof.key}.json"
    for corrupt in ("{not json", json.dumps({"schema": 1, "key": proof.key}), "[]", ""):
        path.write_text(corrupt)
        reloaded = _load(hf, verify="auto")._provenance.proof
        assert not reloaded.from_cache
        assert json.loads(path.read_text())["key"] == proof.key  # rewritten


def test_a_proof_from_another_transformers_version_is_not_used(monkeypatch, tmp_path):
    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    hf = tiny_hf_model("llama")
    proof = _load(hf, verify="auto")._provenance.proof
    path = tmp_path / "proofs" / f"{proof.key}.json"
    data = json.loads(path.read_text())
    data["versions"]["transformers"] = "5.0.0"
    path.write_text(json.dumps(data))
    assert proof_cache.read_cached(proof.key) is None
    assert not _load(hf, verify="auto")._provenance.proof.from_cache


def test_the_key_follows_structure_not_size():
    """Two widths of one layout share a proof; another layout or flag does not."""
    key = proof_cache.fingerprint
    family, cls = REGISTRY["llama"], transformers.LlamaForCausalLM
    base = key(transformers.LlamaConfig(), family, cls)
    assert key(transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672), family, cls) == base
    assert key(transformers.LlamaConfig(attention_bias=True), family, cls) != base
    assert key(transformers.LlamaConfig(num_hidden_layers=40), family, cls) != base
    edited = dataclasses.replace(family, mlp_output=Site("post_attention_layernorm"))
    assert key(transformers.LlamaConfig(), edited, cls) != base, "a proof of another record was reused"


def test_verify_never_serves_unproved_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    model = _load(tiny_hf_model("llama"), verify="never")
    report = model.support()
    assert report.provenance.startswith("unproved: loaded with verify='never'")
    assert report.provenance_of("attention_output", 0) == report.provenance
    assert "values served: unproved" in str(report)
    assert not (tmp_path / "proofs").exists()


def test_verify_takes_three_modes():
    with pytest.raises(ValueError, match="verify='sometimes' is not one of 'auto', 'always', 'never'"):
        _load(tiny_hf_model("llama"), verify="sometimes")


def test_a_config_no_twin_runs_declines_every_value_for_one_reason(monkeypatch, tmp_path):
    """Where no twin runs, the load warns once and declines every value (model-level ones too) for the one
    reason, transformers' error on the twin; ``support()`` states it once, at the top."""
    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))

    def fails(*args, **kwargs):
        raise NoTwinRuns("no twin of this LlamaConfig runs: ... its forward fails in transformers: RuntimeError: X", [])

    monkeypatch.setattr(proof_load, "running_twin", fails)
    with pytest.warns(UserWarning, match="declines every value") as caught:
        model = _load(tiny_hf_model("llama"))
    assert len([w for w in caught if "declines every value" in str(w.message)]) == 1
    report = model.support()
    assert report.provenance.startswith("declined: the proof could not run on any twin")
    assert report.cause is not None and "RuntimeError: X" in report.cause
    assert set(report.declined()) >= {"attention_output", "mlp_output"}
    assert report.reason("layer_output", 0) == report.cause and report.model_declines["logits"] == report.cause
    text = str(report)
    assert text.count("RuntimeError: X") == 1 and len(text) < 2500
    assert report.to_dict()["layers"][0]["values"]["attention_output"] == report.cause
    # every model-level value raises ValueNotAvailable with the cause, inside and outside a trace (never
    # nnsight's generic "has no attribute": ValueNotAvailable is an AttributeError, so a property raising it
    # falls over to nnsight's __getattr__)
    for name in ("logits", "next_token_probs"):
        with pytest.raises(nncanon.ValueNotAvailable, match=rf"model\.{name} is not available: .*RuntimeError: X"):
            getattr(model, name)
        with pytest.raises(nncanon.ValueNotAvailable, match=rf"model\.{name} is not available: .*RuntimeError: X"):
            with model.trace(PROMPTS[0]):
                getattr(model, name).save()
    assert not hasattr(model, "logits")
    with pytest.raises(nncanon.ValueNotAvailable, match=r"model\.skip_layers is not available: .*RuntimeError: X"):
        with model.trace(PROMPTS[0]):
            model.skip_layers(0, 0)
    with pytest.raises(nncanon.ValueNotAvailable, match=r"model\.project_on_vocab is not available"):
        model.project_on_vocab(torch.zeros(1, 1, model.hidden_size))
    with pytest.raises(nncanon.ValueNotAvailable, match=r"model\.logits is not available: .*RuntimeError: X"):
        with model.trace(PROMPTS[0]):
            model.logits[:, -1] = 0
    # and the tools say the cause too
    from nncanon import tools

    ids, other = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[5, 6, 9, 8]])
    for call in (lambda: tools.head_ablation_sweep(model, PROMPTS[0]),
                 lambda: tools.activation_patching(model, ids, other),
                 lambda: tools.attribution_patching(model, ids, other, lambda logits: logits[:, -1, 5])):
        with pytest.raises(nncanon.ValueNotAvailable, match=r"no layer of this model serves .*RuntimeError: X"):
            call()


def test_an_unwritable_cache_warns_and_still_proves(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("NNCANON_CACHE", str(blocked))
    with pytest.warns(UserWarning, match="could not write its proof cache"):
        model = _load(tiny_hf_model("llama"), verify="auto")
    assert model.support().provenance.startswith("proved")


def test_support_shows_provenance():
    model = _load(tiny_hf_model("llama"))
    report = model.support()
    assert str(report).splitlines()[1].startswith("values served: proved on a twin of this config")
    data = report.to_dict()
    assert data["provenance"] == report.provenance and data["model_declines"] == {}


def test_a_failed_model_level_check_declines_it(monkeypatch):
    """The lens is refused where its check failed (a family whose final norm is named wrong)."""
    broken = dataclasses.replace(REGISTRY["llama"], norm=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _load(tiny_hf_model("llama"), broken)
    assert "project_on_vocab" in model.support().model_declines
    with pytest.raises(nncanon.ValueNotAvailable, match="lens"):
        with model.trace(PROMPTS[0]):
            model.project_on_vocab(model.layers[-1].layer_output).save()


def test_a_check_that_raises_declines_what_it_covers_and_the_load_goes_on(monkeypatch, tmp_path):
    """A twin whose forward fails (transformers' own pure-Mamba GraniteMoeHybrid with a cache, in 5.24)
    proves nothing: the load does not crash, every value is declined naming the error."""
    from nncanon.proof import verdict as proof_verdict
    from nncanon.proof.checks import CHECKS
    from nncanon.proof.checks.base import Check

    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))  # its failed proof must not reach later loads

    def boom(model):
        raise RuntimeError("the twin's forward failed")

    monkeypatch.setattr(proof_verdict, "CHECKS", (Check("boom", boom), *CHECKS[1:]))
    model = _load(tiny_hf_model("llama"))
    report = model.support()
    for index in range(model.num_layers):
        assert "attention_output" in report.declined(index)
        assert "boom on layers" in report.reason("attention_output", index)
        assert "RuntimeError: the twin's forward failed" in report.reason("mlp_output", index)
    assert "RuntimeError" in report.model_declines["logits"]


def test_the_key_follows_the_checks_run(monkeypatch):
    """A proof made by other checks (fewer, or replaced) is never read as this one."""
    from nncanon.proof import verdict as proof_verdict

    config = transformers.LlamaConfig()
    key = proof_cache.cache_key(config, REGISTRY["llama"], transformers.LlamaForCausalLM)
    monkeypatch.setattr(proof_verdict, "CHECKS", proof_verdict.CHECKS[1:])
    assert proof_cache.cache_key(config, REGISTRY["llama"], transformers.LlamaForCausalLM) != key


def test_a_proof_made_without_the_gradient_checks_is_proved_again(monkeypatch, tmp_path):
    """A cached proof from checks without the gradient ones (an older nncanon) is not read: the key differs,
    and the load proves again, gradients included."""
    from nncanon.proof import verdict as proof_verdict

    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    hf = tiny_hf_model("llama")
    everything = proof_verdict.CHECKS
    monkeypatch.setattr(proof_verdict, "CHECKS", tuple(c for c in everything if not c.gradient))
    old = _load(hf, verify="auto")._provenance.proof
    assert not any(r.gradient for r in old.verdict.results)
    monkeypatch.setattr(proof_verdict, "CHECKS", everything)
    new = _load(hf, verify="auto")._provenance.proof
    assert not new.from_cache and new.key != old.key
    assert {r.check for r in new.verdict.results if r.gradient} == {"gradients", "gradient_writes", "norm_gradients",
                                                                    "embedding_gradients"}
    assert new.verdict.proved(0, "attention_head_outputs", gradient=True)
    assert len(list((tmp_path / "proofs").glob("*.json"))) == 2


def _fingerprints_agree(config, family, cls):
    """The fingerprint a load uses (kept in memory by the config's state) against one computed afresh."""
    return proof_cache.fingerprint(config, family, cls) == proof_cache._fingerprint(config, family, cls)


def test_a_changed_config_is_never_given_a_stale_fingerprint():
    """The in-memory fingerprint follows every change of the config: a top-level flag, an entry of a nested
    dict, a list element, an attribute of a nested config, a value equal in Python but not in the config
    file (1 / 1.0 / True), an attribute added; each is fingerprinted again."""
    family, cls = REGISTRY["gemma3"], transformers.Gemma3ForConditionalGeneration
    config = transformers.Gemma3Config()
    seen = {proof_cache.fingerprint(config, family, cls)}
    text = config.text_config
    edits = [
        lambda: setattr(text, "attn_logit_softcapping", 30.0),
        lambda: text.rope_parameters["full_attention"].update(rope_theta=5e5),
        lambda: text.layer_types.__setitem__(0, "full_attention"),
        lambda: setattr(config.vision_config, "hidden_act", "gelu"),
        lambda: setattr(text, "an_attribute_added_later", True),
        lambda: setattr(text, "an_attribute_added_later", 1),
        lambda: setattr(text, "an_attribute_added_later", 1.0),
        lambda: setattr(text, "an_attribute_added_later", 0.0),
        lambda: setattr(text, "an_attribute_added_later", -0.0),
        lambda: setattr(config, "mm_tokens_per_image", 64),
    ]
    for edit in edits:
        edit()
        assert _fingerprints_agree(config, family, cls)
        fingerprint = proof_cache.fingerprint(config, family, cls)
        assert fingerprint not in seen, "a changed config kept the fingerprint of what it was"
        seen.add(fingerprint)


def test_a_nested_change_after_a_load_proves_the_new_config(monkeypatch, tmp_path):
    """A config edited in place after a proved load is proved again on the next load (its proof key moves);
    an unchanged config reuses its proof."""
    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    hf = tiny_hf_model("llama")
    first = _load(hf, verify="auto")._provenance.proof
    assert _load(hf, verify="auto")._provenance.proof.key == first.key
    hf.config.rope_parameters["rope_theta"] = hf.config.rope_parameters["rope_theta"] * 2
    second = _load(hf, verify="auto")._provenance.proof
    assert second.key != first.key and not second.from_cache
    assert second.key == proof_cache.cache_key(hf.config, REGISTRY["llama"], type(hf))


def test_a_config_outside_transformers_is_fingerprinted_each_time():
    """A config class from outside transformers (custom code) may serialize itself its own way: no memo."""

    class CustomConfig(transformers.LlamaConfig):
        pass

    CustomConfig.__module__ = "transformers_modules.custom"
    config = CustomConfig()
    assert proof_cache.config_state(config) is None
    assert _fingerprints_agree(config, REGISTRY["llama"], transformers.LlamaForCausalLM)


def test_a_cached_proof_declines_what_a_new_proof_declines():
    """A proof read from the cache (its declines worked out once, kept with it) leaves the same support table
    as the proof made now, on every load that reads it."""
    broken = dataclasses.replace(REGISTRY["llama"], mlp_output=Site("post_attention_layernorm"))
    hf = tiny_hf_model("llama")
    made = _load(hf, broken, verify="always")
    cached = [_load(hf, broken, verify="auto") for _ in range(2)]
    assert all(model._provenance.proof.from_cache for model in cached)
    expected = made.support().to_dict()
    assert expected["layers"][0]["values"]["mlp_output"] is not None
    for model in cached:
        assert model.support().to_dict() == expected
