"""The invariant suite: run on every registered family's tiny model, in fp32.

The checks that prove a served value are the package's own (`nncanon.proof.checks`): the same
checks prove every value at load time on a twin of the user's config, and on inferred families.
Here they run on each registry variant itself; every check must hold and every value a variant
serves must be proved by some check. The other tests check the wrapper's behaviour: bad writes and
skips raise, a failed trace changes nothing, ``support()`` is honest, the tiny configs cover every
block kind.

Tolerance: sums of fp32 contributions are compared at ``atol=rtol=1e-5`` (the model adds them in
another order in parallel blocks, 7.5e-9 measured); everything read or recomputed in the model's
own order is compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from nncanon import InvalidSkip, InvalidWrite, SizeNotAvailable
from nncanon.model_sites import MODEL_SITES
from nncanon.proof.checks import CHECKS
from nncanon.proof.checks.base import GRADIENT_VALUES, HEAD_VALUES, KERNEL_INPUTS
from nncanon.proof.checks.references import served
from nncanon.proof.verdict import Verdict
from nncanon.reading import CONTRIBUTIONS, host
from nncanon.support import COMPONENTS, LAYER_VALUES
from nncanon.testing import PROMPTS

from ..conftest import (
    declined_as_recorded,
    identity_layers,
    inline_kernel_inputs,
    recorded_declines,
    upstream_failures,
    upstream_issue,
)

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def verdict(model, variant) -> Verdict:
    """Every check on the variant (after its declines are checked against the registry record)."""
    from nncanon.proof.verdict import verify

    identity_layers(model, variant)
    return verify(model)


@pytest.mark.parametrize("check", [check.name for check in CHECKS])
def test_check_holds(verdict, variant, check):
    failed = [r for r in verdict.results if r.check == check and not r.passed]
    if check not in upstream_failures(variant):
        assert not failed, "\n".join(r.describe() for r in failed)
        return
    # The installed transformers' own code is broken here (the record says why): the check fails, and a
    # load declines every value it puts in doubt with the failed check's numbers.
    assert failed, f"{check} holds on transformers {transformers.__version__}: the record's upstream failure is stale"
    _declined_at_load(variant, verdict, failed)


def test_every_held_result_is_within_its_bar(verdict):
    """The proof cache holds every result that held to its own numbers again, ``error <= tolerance``
    (`nncanon.proof.cache.validated`): a result that held beyond its bar would make its proof file read as corrupt,
    and the config be proved at every load."""
    beyond = [r.describe() for r in verdict.results
              if r.passed and r.error is not None and r.tolerance is not None and not r.error <= r.tolerance]
    assert beyond == []


def _declined_at_load(variant, verdict: Verdict, failed: list) -> None:
    """A load with its proof (`nncanon.proof.load`) declines each value that the ``failed`` results put in doubt
    in ``verdict``, naming the check and its measured error. The recomputed probabilities are served under sdpa
    only: there ``attention_probabilities`` is declined naming this check or the kernel inputs' (it is recomputed
    from them), whichever the load meets first."""
    from nncanon.components.kernel import RECOMPUTED
    from nncanon.testing import tiny_model

    loaded, asserted = {}, 0
    for result in failed:
        for value in result.values:
            checks = ("recomputed", "kernel") if value == RECOMPUTED else (result.check,)
            names = [f"{check} on {'the model' if result.layer is None else f'layers[{result.layer}]'}"
                     for check in checks]
            if result not in verdict.failures(result.layer, value):
                continue  # proved by a check of its own that held
            implementation = "sdpa" if value == RECOMPUTED else "eager"
            if implementation not in loaded:
                loaded[implementation] = tiny_model(variant, attn_implementation=implementation, verify="auto")
            report = loaded[implementation].support()
            if result.layer is None:
                reason = report.model_declines.get(value)
            else:
                reason = report.reason("attention_probabilities" if value == RECOMPUTED else value, result.layer)
            where = value if result.layer is None else f"layers[{result.layer}].{value}"
            figures = result.note if result.error is None else f"error {result.error:.2e}"  # raised: its error
            assert reason is not None and figures in reason and any(
                name in reason for name in names), (
                f"{where} is served after {result.describe()}: {reason}")
            asserted += 1
    assert asserted, "the failed checks put no value in doubt"


def _upstream_doubt(verdict: Verdict, variant, layer: int | None, value: str, gradient: bool = False) -> bool:
    """Whether only checks that the installed transformers makes fail (`upstream_failures`, asserted declined
    at load by `test_check_holds`) keep ``value`` on ``layer`` from being proved."""
    failures = verdict.failures(layer, value, gradient)
    return bool(failures) and all(result.check in upstream_failures(variant) for result in failures)


def test_every_served_value_is_proved(model, variant, verdict):
    """Each value a layer serves is covered by a check that held (no value is served unchecked), and so is
    its gradient by a gradient check; except where the installed transformers' own code fails the check
    (the record's upstream failures: the load declines the value, `test_check_holds`)."""
    report = model.support()
    for index in range(model.num_layers):
        for value in LAYER_VALUES:
            if value not in COMPONENTS and report.available(value, layer=index):
                if _upstream_doubt(verdict, variant, index, value):
                    continue
                assert verdict.proved(index, value), f"layers[{index}].{value}: {verdict.why_not(index, value)}"
                if value in GRADIENT_VALUES:
                    assert verdict.proved(index, value, gradient=True), (
                        f"layers[{index}].{value}.grad: {verdict.why_not(index, value, gradient=True)}")
    for value in ("logits", "project_on_vocab", "skip_layers", "resume"):
        if value in model._model_declines:  # declined by the family, with its reason (ZAYA's resume)
            with pytest.raises(AttributeError, match="not available"):
                model._model_value_check(value)
            continue
        assert verdict.proved(None, value) or _upstream_doubt(verdict, variant, None, value), (
            f"{value}: {verdict.why_not(None, value)}")
    for value in MODEL_SITES:  # the model-level values read at a module, and their gradients
        if not report.available(value):
            continue
        for gradient in (False, True):
            assert verdict.proved(None, value, gradient) or _upstream_doubt(verdict, variant, None, value, gradient), (
                f"model.{value}{'.grad' if gradient else ''}: {verdict.why_not(None, value, gradient)}")


def test_probabilities_recomputed_where_eager_serves_them(model, variant, verdict):
    """Every layer serving probabilities under eager through a kernel call they are recomputed from has them
    proved when recomputed under sdpa (where the model class runs sdpa at all); the kernel's inputs are
    served wherever the kernel is called (unless the record declines them: DiffLlama calls it twice), and
    proved on a copy running the kernel's implementation where the forward calls it under that one only."""
    from nncanon.components.kernel import RECOMPUTED, Kernel

    upstream = upstream_issue(variant) is not None
    report = model.support()
    for index in report.layers_with("self_attn"):
        attention = model.layers[index].self_attn
        kernel = attention._nncanon.kernel
        inline = inline_kernel_inputs(model, index)
        served_inputs = [report.available(name, layer=index) for name in KERNEL_INPUTS]
        recorded = set(KERNEL_INPUTS) & recorded_declines(variant, index)
        assert all(served_inputs) == (not inline and not recorded), f"layers[{index}]"
        if isinstance(kernel, Kernel) and inline and not recorded:  # called under another implementation only
            for name in KERNEL_INPUTS:
                assert verdict.proved(index, name), f"layers[{index}].{name}: {verdict.why_not(index, name)}"
        recomputable = isinstance(kernel, Kernel) and kernel.recompute is not None
        if report.available("attention_probabilities", layer=index) and recomputable and (
                type(model._module)._supports_sdpa):
            if upstream:  # transformers' own eager and sdpa attend differently: declined by the family, unproved
                assert "eager" in attention._nncanon.reason(RECOMPUTED) and not verdict.covered(index, RECOMPUTED)
                continue
            assert verdict.proved(index, RECOMPUTED) or _upstream_doubt(verdict, variant, index, RECOMPUTED), (
                f"layers[{index}]: {verdict.why_not(index, RECOMPUTED)}")


def test_head_shapes(model):
    """Each block's heads have the block's (heads, head_dim) from the family and the config."""
    for index in model.support().layers_with("attention_head_outputs"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            x = model.layers[index].layer_input.save()
            heads = model.layers[index].self_attn.attention_head_outputs.save()
        assert heads.shape[-2:] == _head_shape(model, index)
        assert heads.shape[:2] == x.shape[:2]


def _head_shape(model, index: int) -> tuple[int, int]:
    """``(heads, head_dim)`` of block ``index`` from the family and the config, apart from the served tensor."""
    config = model._text_config
    spec = model.family.for_layer(config, index)[0]
    if spec.head_shape is not None:
        return tuple(spec.head_shape(config, index))
    try:
        return model.num_heads, model.head_dim
    except SizeNotAvailable:  # a heterogeneous config (Gemma-4): the block's own width
        layer = config.per_layer_config[index]
        return model.num_heads, getattr(layer, "v_head_dim", None) or layer.head_dim


def test_tiny_config_has_every_block_kind(model, variant):
    """The family's tiny configs exercise every kind of block it declares, and attention where it has it.

    Each variant's kinds are ones the family declares; together the family's variants cover them all
    (a kind that only some configurations have, GraniteMoeHybrid's MLP without experts, has its own).
    """
    from nncanon.registry import variants

    family = model.family

    def kinds_of(config) -> set:
        kinds = set()
        for index in range(config.num_hidden_layers):
            kind = family.for_layer(config, index)[1]
            kinds |= set(kind.split()) if kind else {None}
        return kinds

    declared = set(family.layouts) or {None}
    assert kinds_of(model._text_config) <= declared
    covered, missing = set(), []
    for other in variants():
        if other.model_type in family.model_types:
            if other.unavailable:
                missing.append(other.name)  # an older transformers minor: the kinds it covers are not built
                continue
            covered |= kinds_of(other.build_config().get_text_config())
    assert covered <= declared if missing else covered == declared, f"not built here: {missing}"
    report = model.support()
    if any(layout.attention for layout in family.all_layouts()):
        attention = report.layers_with("self_attn")
        assert attention, "a family with attention has it in its tiny config"
        if not all("attention_probabilities" in recorded_declines(variant, i) for i in attention):
            assert report.layers_with("attention_probabilities"), "eager attention layers serve probabilities"


def test_skip_layers_rejects_bad_replacements(model):
    with torch.no_grad(), model.trace(PROMPTS[0]):
        x = model.layers[0].layer_input
        for bad in (x[:, :1], x.double(), (x,)):
            with pytest.raises(InvalidSkip, match=r"layers\[0\]|layers 0"):
                model.skip_layers(0, 0, skip_with=bad)
    with pytest.raises(InvalidSkip, match="outside"):
        with model.trace(PROMPTS[0]):
            model.skip_layers(0, model.num_layers)


def test_partial_batched_skip_raises(model):
    # A model whose blocks take stacked streams refuses any skip in a trace with several invokes.
    with pytest.raises(ValueError, match="several invokes" if model.family.stacked_streams else "cover every row"):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                model.skip_layers(0, 0)
            with tracer.invoke(PROMPTS[0]):
                model.logits.save()


def test_assignment_and_bad_writes(model, variant):
    layers = identity_layers(model, variant)
    if not layers:
        return
    layer = layers[0]
    names = served(model, layer)
    zeroed, kept = names[0], names[1:]
    component = host(model, layer, zeroed)
    others = []
    with torch.no_grad(), model.trace(PROMPTS[0]):
        x = model.layers[layer].layer_input.save()
        for name in names:
            value = getattr(host(model, layer, name), name)
            if name == zeroed:
                setattr(component, zeroed, torch.zeros_like(value))
            else:
                others.append(value.save())
        y = model.layers[layer].layer_output.save()
    torch.testing.assert_close(y - x, sum(others) if kept else torch.zeros_like(x), **TOL)
    where = component._nncanon.where.replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(InvalidWrite, match=rf"{where}.{zeroed}.*shape"):
        with model.trace(PROMPTS[0]):
            setattr(component, zeroed, torch.zeros(3, 3))
    with pytest.raises(InvalidWrite, match="dtype"):
        with model.trace(PROMPTS[0]):
            setattr(component, zeroed, getattr(component, zeroed).double())


def test_failed_trace_leaves_model_unchanged(model, variant):
    contributions = not declined_as_recorded(model, variant)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        before = model.logits.save()
    # after a first forward: RWKV rescales its own weights once, on its first eval forward
    weights = {k: v.clone() for k, v in model._module.state_dict().items()}
    names = served(model, 0, HEAD_VALUES + (CONTRIBUTIONS if contributions else ()))
    with pytest.raises(RuntimeError, match="deliberate"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            for name in names:
                getattr(host(model, 0, name), name)[:] = 0
            raise RuntimeError("deliberate")
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.layers[0].layer_output[:] = 0
    with torch.no_grad(), model.trace(PROMPTS[0]):
        after = model.logits.save()
    assert torch.equal(before, after)
    for key, value in model._module.state_dict().items():
        assert torch.equal(value, weights[key]), key


def test_what_a_layout_has_not_is_not_served(variant):
    """The values `mount` says a block's layout has not at all (which the proof then passes over) are values
    the block does not serve, on every block."""
    from nncanon.mounting import mount
    from nncanon.support import layer_states, value_reason
    from nncanon.testing import tiny_model

    model = tiny_model(variant)
    unserved = mount(model, model.family, model._text_config)  # mounted again: the same states, and the sets
    assert len(unserved) == model.num_layers
    for index, absent in enumerate(unserved):
        states = layer_states(model.layers[index])
        assert absent is None or all(value_reason(states, value) is not None for value in absent), index


def test_support_is_honest(model):
    from nncanon.support import COMPONENT_OF, COMPONENTS, LAYER_VALUES

    report = model.support()
    for index in range(model.num_layers):
        layer = model.layers[index]
        for value in LAYER_VALUES:
            reason = report.reason(value, layer=index)
            if value in COMPONENTS:
                if reason is None:
                    assert getattr(layer, value) is not None
                else:
                    with pytest.raises(AttributeError, match="not available") as caught:
                        getattr(layer, value)
                    assert reason in str(caught.value)
                continue
            owner = layer if value in ("layer_input", "layer_output") else None
            if owner is None:
                component_reason = report.reason(COMPONENT_OF[value], layer=index)
                if component_reason is not None:
                    assert reason == component_reason
                    continue
                owner = getattr(layer, COMPONENT_OF[value])
            if reason is None:
                with torch.no_grad(), model.trace(PROMPTS[0]):
                    read = getattr(owner, value).save()
                assert isinstance(read, torch.Tensor)
            else:
                with pytest.raises(AttributeError, match="not available") as caught:
                    with model.trace(PROMPTS[0]):
                        getattr(owner, value)
                assert reason in str(caught.value)
