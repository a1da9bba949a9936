"""The values inside a block, on every registered variant: what its token mixers receive, attention's scores, its
queries and keys before their norms and its output gate, and its MLP's neurons.

The checks that prove them are the verifier's (``read``, ``invokes``, ``neurons``, the gradient checks: they run in
``test_invariants.py::test_check_holds``). Here: every block serves them or declines them for a reason that is a
property of the block; a write to each equals the same edit made by a plain PyTorch hook at its site on the
unwrapped model (the logits, bit for bit); the TransformerLens names resolve to them.
"""

from __future__ import annotations

import re

import pytest
import torch

from nncanon.errors import ValueNotAvailable
from nncanon.proof.checks.references import encode, finish, hf_block, plain_copy
from nncanon.reading import host
from nncanon.sae import resolve
from nncanon.served import _pick, _put, operation_name
from nncanon.support import INNER_VALUES
from nncanon.testing import PROMPTS

MIXER_INPUT = {"self_attn": "attention_input", "linear_attn": "linear_attention_input"}


def test_every_block_serves_its_inner_values_or_says_why(model, variant):
    """Each mixer serves its input; each dense MLP serves its neurons and pre-activations (and its linear path where
    it is gated); a mixture of experts declines them, saying so."""
    report = model.support()
    for index in range(model.num_layers):
        for component, value in MIXER_INPUT.items():
            if report.available(component, layer=index):
                assert report.available(value, layer=index), f"layers[{index}]: {report.reason(value, index)}"
        if not report.available("mlp", layer=index):
            continue
        mlp = model.layers[index].mlp
        anatomy = mlp._nncanon.anatomy
        if anatomy is None:
            reason = report.reason("neurons", layer=index)
            assert reason is not None and "mixture of experts" in reason, f"layers[{index}]: {reason}"
            spec = model.family.for_layer(model._text_config, index)[0]
            assert spec.router_logits is not None or spec.expert_indices is not None, "a dense MLP said to be MoE"
            continue
        assert report.available("neurons", layer=index) and report.available("pre_activations", layer=index)
        gated = anatomy.linear is not None
        assert report.available("linear_activations", layer=index) == gated, report.reason("linear_activations", index)
        if not gated:
            assert "not gated" in report.reason("linear_activations", layer=index)


def _edit(tensor: torch.Tensor) -> None:
    """The edit both sides make, in place, at the last position: ``x * 2 + 1``."""
    tensor[:, -1] = tensor[:, -1] * 2 + 1


def _plain_edit_logits(model, index: int, value: str, inputs: dict) -> torch.Tensor:
    """The logits of the unwrapped model with `_edit` made by a plain hook at ``value``'s site on block ``index``."""
    binding = host(model, index, value)._nncanon.bindings[value]
    site = binding.site
    if site.op is not None:  # an operation inside a forward, which no module hook reaches: nnsight's source hooks
        plain = plain_copy(model)
        path = ".".join(part for part in (model.family.layers, str(index), site.module) if part)
        with torch.no_grad(), plain.trace(**inputs):
            source = plain.get(path).source
            operation = getattr(source, operation_name(source.names, site.op))
            _edit(finish(_pick(operation.output, site), binding, inputs))
            logits = plain.output.logits.save()
        return logits
    block = hf_block(model, index)
    module = block.get_submodule(site.module)
    inside = []  # the edit is made inside this block's forward only (a module several blocks share: Zamba)

    def edited(raw):
        if not inside:
            return None
        # In place, as nncanon writes (a copy may run the next kernel on another path, 1e-7 off), but on a copy
        # where nncanon hands the module one (`Site.private`: a mixer's input)
        tensor = _pick(raw, site).clone() if site.private else _pick(raw, site)
        _edit(finish(tensor, binding, inputs))  # (a view, laid out as the value is served)
        return _put(raw, site, tensor)

    if site.key == "input":
        handle = module.register_forward_pre_hook(lambda mod, args, kwargs: edited((args, kwargs)), with_kwargs=True)
    else:
        handle = module.register_forward_hook(lambda mod, args, output: edited(output))
    handles = [handle, block.register_forward_pre_hook(lambda mod, args: inside.append(True)),
               block.register_forward_hook(lambda mod, args, output: inside.clear())]
    try:
        with torch.no_grad():
            return model._module(**inputs).logits
    finally:
        for each in handles:
            each.remove()


def test_a_write_is_the_same_edit_by_a_plain_hook_at_its_site(model, variant):
    """On the first and last block, each inner value written at the last position gives the logits a plain hook
    gives that makes the same edit at the value's site, bit for bit (a mixer's input is the mixer's alone: on a
    parallel block the MLP still reads the unedited norm)."""
    report = model.support()
    inputs = encode(model)
    for index in sorted({0, model.num_layers - 1}):
        for value in INNER_VALUES:
            if not report.available(value, layer=index):
                continue
            with torch.no_grad(), model.trace(PROMPTS[0]):
                _edit(getattr(host(model, index, value), value))
                ours = model.logits.save()
            reference = _plain_edit_logits(model, index, value, inputs)
            assert torch.equal(ours, reference), f"layers[{index}].{value}"


def test_transformer_lens_names_resolve_to_the_inner_values(model):
    report = model.support()
    for index in range(model.num_layers):
        for name, value in (("mlp.hook_pre", "pre_activations"), ("mlp.hook_pre_linear", "linear_activations"),
                            ("mlp.hook_post", "neurons")):
            if report.available(value, layer=index):
                assert resolve(model, f"blocks.{index}.{name}").value == value
        mixer = next((v for c, v in MIXER_INPUT.items() if report.available(c, layer=index)), None)
        if mixer is not None:  # TransformerLens's ln1.hook_normalized: the norm's input before its weight
            normalized = mixer.replace("_input", "_normalized")
            if report.available(normalized, layer=index):
                assert resolve(model, f"blocks.{index}.ln1.hook_normalized").value == normalized
            else:
                with pytest.raises(ValueNotAvailable, match=re.escape(report.reason(normalized, layer=index))):
                    resolve(model, f"blocks.{index}.ln1.hook_normalized")


def test_a_square_mlps_down_projection_is_told_by_its_name():
    """Where ``d_mlp`` equals the stream's width (RecurrentGemma's twin: ``intermediate_size // 2``), every
    projection maps the stream to its own width; the name tells the down projection, the gate and the up."""
    from nncanon.components.anatomy import discover

    class Square(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.down_proj, self.act_fn = torch.nn.Linear(8, 8), torch.nn.GELU()

    anatomy = discover(Square(), "mlp", 8)
    assert (anatomy.down, anatomy.pre, anatomy.linear, anatomy.activation) == (
        "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.act_fn")
    unnamed = Square()
    unnamed.down_proj = None
    unnamed.w_out = torch.nn.Linear(8, 8)
    assert "no one down projection" in discover(unnamed, "mlp", 8)


def test_attention_serves_its_scores_and_inner_values_or_says_why(model, variant):
    """Every attention serving its probabilities serves its scores, and ``softmax(scores)`` is the probabilities
    (with the sink column where the attention has sinks); queries and keys before their norms are served where the
    attention has a q/k norm module, the output gate where its forward gates its output (a sigmoid or softplus
    after the kernel call), and each says why elsewhere."""
    from nncanon.components.inside import NORM_NAMES
    from nncanon.proof.checks.inside import probabilities_of

    report = model.support()
    for index in report.layers_with("self_attn"):
        attention = model.layers[index].self_attn
        module = attention._module
        older = "load with transformers" in (report.reason("attention_scores", layer=index) or "")  # (older minors)
        if report.available("attention_probabilities", layer=index) and not older:
            assert report.available("attention_scores", layer=index), report.reason("attention_scores", index)
            with torch.no_grad(), model.trace(PROMPTS):
                scores = attention.attention_scores.save()
                probabilities = attention.attention_probabilities.save()
            assert scores.shape == probabilities.shape
            made = probabilities_of(scores, module, probabilities)
            torch.testing.assert_close(made, probabilities, rtol=1e-5, atol=1e-6)
        else:
            assert report.reason("attention_scores", layer=index) is not None
        for name, index_in_pair in (("query_states_before_norm", 0), ("key_states_before_norm", 1)):
            has = any(isinstance(getattr(module, pair[index_in_pair], None), torch.nn.Module) for pair in NORM_NAMES)
            assert report.available(name, layer=index) == has, f"layers[{index}].{name}: {report.reason(name, index)}"
            if not has:
                assert "norm" in report.reason(name, layer=index)
        source = __import__("inspect").getsource(type(module).forward)
        after = source.split("attention_interface(")[-1] if "attention_interface(" in source else ""
        gated = any(f"{word}(" in after for word in ("sigmoid", "softplus"))  # (before the kernel: Doge's mask)
        assert report.available("attention_gate", layer=index) == gated, report.reason("attention_gate", index)
        if not gated:
            assert "does not gate its output" in report.reason("attention_gate", layer=index)


def test_a_write_to_the_scores_is_the_probabilities_it_makes(model, variant):
    """On the first and last block serving scores (eager), one score raised by 1 (the last query, a key it attends
    with others) gives the logits that writing the probabilities those scores make gives: the write reaches the
    softmax."""
    from nncanon.proof.checks.inside import probabilities_of, write_position

    layers = model.support().layers_with("attention_scores")
    for index in sorted({layers[0], layers[-1]} if layers else set()):
        attention = model.layers[index].self_attn
        with torch.no_grad(), model.trace(PROMPTS[0]):
            probabilities = attention.attention_probabilities.save()
            clean = model.logits.save()
        head, key = write_position(probabilities)
        with torch.no_grad(), model.trace(PROMPTS[0]):
            attention.attention_scores[:, head, -1, key] += 1.0
            ours = model.logits.save()
        with torch.no_grad(), model.trace(PROMPTS[0]):
            scores = attention.attention_scores.clone()
            scores[:, head, -1, key] += 1.0
            attention.attention_probabilities = probabilities_of(scores, attention._module, probabilities)
            reference = model.logits.save()
        assert not torch.equal(ours, clean), f"layers[{index}]: the write did not move the logits"
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5, msg=f"layers[{index}]")


def test_transformer_lens_scores_name(model):
    for index in model.support().layers_with("attention_scores"):
        assert resolve(model, f"blocks.{index}.attn.hook_attn_scores").value == "attention_scores"
