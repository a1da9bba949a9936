"""The model-level values read at a module, on every registered variant: the token and position embeddings and the
final norm's output.

The checks that prove them are the verifier's (``embeddings``, ``embedding_gradients``, and ``invokes`` and
``locality`` for their writes: they run in ``test_invariants.py::test_check_holds``). Here: every model serves them
or declines them for a reason that is a property of the family; an assignment of each equals the same replacement
made by a plain PyTorch hook at its module (the logits, bit for bit); the TransformerLens names resolve to them; bad
writes are named.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

import nncanon
from nncanon.families import REGISTRY, Embeddings
from nncanon.families.base import POSITION_KINDS
from nncanon.gradients import no_weight_gradients
from nncanon.model_sites import MODEL_SITES, final_norm_path
from nncanon.proof.checks.embeddings import site_module
from nncanon.proof.checks.references import encode
from nncanon.sae import resolve, value_at
from nncanon.served import _pick, _put
from nncanon.support import MODEL_VALUES, WIDTH
from nncanon.testing import PROMPTS, tiny_hf_model, tiny_model, tiny_tokenizer

_ROTARY = re.compile("rotary|rope", re.IGNORECASE)


def _has_module(model, path: str | None) -> bool:
    if path is None:
        return False
    parent, _, name = path.rpartition(".")
    return getattr(model._module.get_submodule(parent) if parent else model._module, name, None) is not None


def test_every_model_serves_its_embeddings_or_says_why(model, variant):
    """The token embeddings always; the position embeddings exactly where the family names a module that this
    configuration has, else the family's reason, which its structure bears out (a rotary family has a rotary
    embedding, a recurrent one no attention); the final norm's output exactly where the final norm exists."""
    report = model.support()
    family = model.family
    assert report.available("token_embeddings"), report.reason("token_embeddings")
    positions = family.embeddings.positions
    if _has_module(model, positions):
        assert report.available("position_embeddings"), report.reason("position_embeddings")
    else:
        reason = report.reason("position_embeddings")
        assert reason is not None and "has no absolute position embeddings" in reason
        kind = family.embeddings.positions_kind
        kind = kind(model._text_config) if callable(kind) else kind
        classes = {type(module).__name__ for module in model._module.modules()}
        if kind == "rotary":
            inline = any("rotary" in inspect.getsource(type(m).forward).lower() for m in model._module.modules()
                         if "Attention" in type(m).__name__)  # (GPT-J's and CodeGen's before 5.24: no module)
            assert inline or any(_ROTARY.search(name) for name in classes), f"a rotary family without rotary: {kind}"
        elif kind == "recurrent":
            assert not report.layers_with("self_attn"), "a recurrent family with softmax attention"
        assert POSITION_KINDS.get(kind, kind) in reason
    if final_norm_path(family) == "lm_head" or _has_module(model, final_norm_path(family)):
        assert report.available("final_norm_output"), report.reason("final_norm_output")
    else:
        assert "has no final norm" in report.reason("final_norm_output")


def test_an_assignment_is_the_same_replacement_by_a_plain_hook(model, variant):
    """Each served value assigned whole (``model.token_embeddings = t``, the clean value scaled by 0.5) gives the
    logits a plain hook at its module that returns the same tensor gives, bit for bit (the in-place edit is the
    proof's ``embeddings`` check)."""
    report = model.support()
    inputs = encode(model)
    for name in MODEL_SITES:
        if not report.available(name):
            continue
        with torch.no_grad(), model.trace(PROMPTS[0]):
            clean = getattr(model, name).save()
        with torch.no_grad(), model.trace(PROMPTS[0]):
            setattr(model, name, clean * 0.5)
            ours = model.logits.save()
        site = model._model_bindings[name].site
        calls = []

        def replaced(raw, site=site, name=name, calls=calls):
            calls.append(True)
            if name != "final_norm_output" and len(calls) > 1:
                return raw
            return _put(raw, site, _pick(raw, site).clone() * 0.5)

        module = site_module(model, name)
        handle = (module.register_forward_pre_hook(lambda mod, args, kwargs: replaced((args, kwargs)), with_kwargs=True)
                  if site.key == "input" else module.register_forward_hook(lambda mod, args, out: replaced(out)))
        try:
            with torch.no_grad():
                reference = model._module(**inputs).logits
        finally:
            handle.remove()
        assert torch.equal(ours, reference), f"model.{name}"


def test_transformer_lens_names_resolve_to_the_model_values(model):
    """``hook_embed`` is ``model.token_embeddings``; ``hook_pos_embed`` is ``model.position_embeddings`` where the
    model has them, else refused with the family's reason; `value_at` reads the same tensor."""
    report = model.support()
    point = resolve(model, "hook_embed")
    assert (point.layer, point.value, point.label) == (None, "token_embeddings", "model.token_embeddings")
    if report.available("position_embeddings"):
        assert resolve(model, "hook_pos_embed").value == "position_embeddings"
    else:
        with pytest.raises(nncanon.ValueNotAvailable) as refused:
            resolve(model, "hook_pos_embed")
        assert report.reason("position_embeddings") in str(refused.value)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        by_name = value_at(model, "hook_embed").save()
        served = model.token_embeddings.save()
    assert torch.equal(by_name, served)


def test_support_lists_the_model_values_within_its_width(model):
    report = model.support()
    data = report.to_dict()
    assert list(data["model_values"]) == list(MODEL_VALUES)
    assert all(data["model_values"][name] == report.reason(name) for name in MODEL_VALUES)
    assert max(len(line) for line in str(report).splitlines()) <= WIDTH
    served = [name for name in MODEL_VALUES if report.available(name)]
    assert f"model values served: {', '.join(served)}"[:60] in str(report)


@pytest.fixture(scope="module")
def gpt2():
    return tiny_model("gpt2")


def test_position_embeddings_are_served_per_prompt_and_a_write_stays_in_its_invoke(gpt2):
    """GPT-2 computes one row of position embeddings for the whole batch: each invoke reads its own rows,
    ``[b, s, d]``, and a write to them moves its invoke's logits only."""
    with torch.no_grad(), gpt2.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            one = gpt2.position_embeddings.save()
            first = gpt2.logits.save()
        with tracer.invoke(PROMPTS):
            two = gpt2.position_embeddings.save()
            gpt2.position_embeddings[:, -1] = 0
            written = gpt2.logits.save()
    table = gpt2._module.transformer.wpe.weight
    assert one.shape == (1, one.shape[1], gpt2.hidden_size) and two.shape[0] == 2
    assert torch.equal(one[0], table[: one.shape[1]])
    with torch.no_grad(), gpt2.trace(PROMPTS[0]):
        clean = gpt2.logits.save()
    assert torch.equal(first, clean)
    with torch.no_grad(), gpt2.trace(PROMPTS):
        unwritten = gpt2.logits.save()
    assert not torch.equal(written[:, -1], unwritten[:, -1])


def test_bad_writes_are_named(gpt2):
    with pytest.raises(nncanon.InvalidWrite, match=r"model\.token_embeddings .*expects shape \(1, \d+, 32\)"):
        with gpt2.trace(PROMPTS[0]):
            gpt2.token_embeddings = torch.zeros(3, 5)
    with pytest.raises(nncanon.InvalidWrite, match=r"model\.final_norm_output .*dtype torch.float64"):
        with gpt2.trace(PROMPTS[0]):
            gpt2.final_norm_output = torch.zeros(1, 1, gpt2.hidden_size, dtype=torch.float64)
    with pytest.raises(nncanon.InvalidWrite, match=r"model\.position_embeddings .*shape \(7,\)"):
        with gpt2.trace(PROMPTS[0]):
            gpt2.position_embeddings = torch.zeros(7)


def test_a_rotary_model_refuses_position_embeddings_by_name():
    model = tiny_model("llama")
    with pytest.raises(nncanon.ValueNotAvailable, match="rotary embedding of the queries and keys"):
        with model.trace(PROMPTS[0]):
            model.position_embeddings.save()
    with pytest.raises(nncanon.ValueNotAvailable, match="rotary"):
        with model.trace(PROMPTS[0]):
            model.position_embeddings = torch.zeros(1)


@pytest.mark.parametrize("name", ["gpt2", "xglm", "llama"])
def test_the_gradient_at_the_embeddings_is_served_with_frozen_weights(name):
    """With no weight taking a gradient (attribution), ``token_embeddings.grad`` (and the positions') is the gradient
    of the logit at them, as plain PyTorch computes it with the module's output made a leaf."""
    model = tiny_model(name)
    names = [n for n in ("token_embeddings", "position_embeddings") if model.support().available(n)]
    values, grads = {}, {}
    with torch.enable_grad(), no_weight_gradients(model), model.trace(PROMPTS[0]):
        for each in names:
            values[each] = getattr(model, each)
        logit = model.logits[0, -1, 5]
        with logit.backward():
            for each in reversed(names):
                grads[each] = values[each].grad.save()
    leaves = {}

    def leaf(out, each):
        leaves[each] = out.detach().requires_grad_(True)
        return leaves[each]

    handles = [site_module(model, each).register_forward_hook(lambda mod, args, out, each=each: leaf(out, each))
               for each in names]
    try:
        with torch.enable_grad(), no_weight_gradients(model):
            logit = model._module(**encode(model)).logits[0, -1, 5]
            expected = torch.autograd.grad(logit, [leaves[each] for each in names])
    finally:
        for handle in handles:
            handle.remove()
    for each, reference in zip(names, expected, strict=True):
        assert torch.allclose(grads[each], reference.expand_as(grads[each]), rtol=1e-5, atol=1e-7), each
        assert bool(grads[each].abs().any()), each


def _load_with(name: str, family):
    hf = tiny_hf_model(name)
    return nncanon.StandardizedTransformer(hf, tokenizer=tiny_tokenizer(hf.config.vocab_size), family=family,
                                           verify="always")


def test_a_wrong_embedding_formula_declines_the_token_embeddings_with_the_checks_numbers():
    """Granite's record without its ``embedding_multiplier``: the formula into block 0 fails on the twin, and the load
    declines ``token_embeddings`` naming the check and its error; the final norm's output stays served."""
    broken = dataclasses.replace(REGISTRY["granite"], embeddings=Embeddings())
    model = _load_with("granite", broken)
    reason = model.support().reason("token_embeddings")
    assert reason is not None and "embeddings on the model" in reason and "formula" in reason and "error" in reason
    assert model.support().available("final_norm_output")
    with pytest.raises(nncanon.ValueNotAvailable, match="formula"):
        with model.trace(PROMPTS[0]):
            model.token_embeddings.save()


def test_a_final_norm_read_at_the_wrong_call_is_declined():
    """nanochat norms its embeddings with its final norm: read at that module's output, the value is its first call,
    before block 0, and the load declines ``final_norm_output`` naming the check (which could not read it after the
    last block, so the values its one trace covers are in doubt with it)."""
    broken = dataclasses.replace(REGISTRY["nanochat"], final_norm=None)
    model = _load_with("nanochat", broken)
    reason = model.support().reason("final_norm_output")
    assert reason is not None and "embeddings on the model" in reason
    with pytest.raises(nncanon.ValueNotAvailable, match="embeddings on the model"):
        with model.trace(PROMPTS[0]):
            model.final_norm_output.save()
