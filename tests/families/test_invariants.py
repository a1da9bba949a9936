"""The invariant suite: run on every registered family's tiny model, in fp32.

Every test compares independent computations: our values against plain PyTorch hooks on the
unwrapped model, the contribution identity, head ablation against probability ablation, a skip
against the layer input, the lens at the last layer against the logits.

Tolerance: sums of fp32 contributions are compared at ``atol=rtol=1e-5`` (the model adds them in
another order in parallel blocks, 7.5e-9 measured); everything read or recomputed in the model's
own order is compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from nnsight.intervention.util import first_input

from nncanon import InvalidSkip, InvalidWrite, SizeNotAvailable
from nncanon.served import _pick
from nncanon.testing import PROMPTS
from nncanon.tools import head_count

from ..conftest import (
    CONTRIBUTIONS,
    HEAD_VALUES,
    declined_as_recorded,
    encode,
    hf_block,
    host,
    identity_layers,
    recorded_declines,
    served,
)

TOL = dict(rtol=1e-5, atol=1e-5)


def _site_reference(model, layer: int, name: str, inputs: dict) -> torch.Tensor:
    """A value read with plain forward hooks on the unwrapped model, at the site its family names."""
    binding = host(model, layer, name)._nncanon.bindings[name]
    site = binding.site
    if site.op is not None:
        return _finish(_operation_reference(model, layer, site, inputs), binding, inputs)
    block = hf_block(model, layer)
    module = block.get_submodule(site.module) if site.module else block
    seen = {}

    def pre(mod, args, kwargs):
        seen["raw"] = (args, kwargs)

    def post(mod, args, output):
        tensor = _pick(output, site)
        seen["raw"] = tensor.clone()

    handle = (
        module.register_forward_pre_hook(pre, with_kwargs=True)
        if site.key == "input"
        else module.register_forward_hook(post)
    )
    try:
        with torch.no_grad():
            model._module(**inputs)
    finally:
        handle.remove()
    raw = seen["raw"]
    return _finish(_pick(raw, site).clone() if site.key == "input" else raw, binding, inputs)


def _operation_reference(model, layer: int, site, inputs: dict) -> torch.Tensor:
    """An operation site's tensor (``site.op`` inside a forward, where no module hook reaches), read
    by nnsight's own source hooks on a plain ``NNsight`` over a fresh copy of the model."""
    from nnsight import NNsight

    hf = model._module
    fresh = type(hf)(hf.config).to(next(hf.parameters()).dtype).eval()
    fresh.load_state_dict(hf.state_dict())
    path = ".".join(part for part in (model.family.layers, str(layer), site.module) if part)
    plain = NNsight(fresh)
    with torch.no_grad(), plain.trace(**inputs):
        operation = getattr(plain.get(path).source, site.op)
        raw = (operation.output if site.key == "output" else operation.inputs).save()
    return _pick(raw, site).clone()


def _finish(tensor: torch.Tensor, binding, inputs: dict) -> torch.Tensor:
    """A raw site tensor as the binding serves it: token axis restored, heads split, scaled."""
    site = binding.site
    batch, seq = inputs["input_ids"].shape
    if site.flat:
        tensor = tensor.view(batch, seq, -1)
    if site.merge:
        tensor = tensor.flatten(-2)
    if binding.heads is not None:
        tensor = tensor.view(batch, seq, binding.heads, -1)
    if site.scale is not None:
        tensor = tensor * site.factor(binding.config)
    return tensor


def _trace_all(model, prompt=PROMPTS[0], contributions=True):
    """Every served value of every layer, and the logits, from one trace (in execution order)."""
    plan = []
    for index in range(model.num_layers):
        names = served(model, index, ("attention_head_outputs", "attention_output", "linear_attention_head_outputs",
                                      "linear_attention_output", "mlp_output"))
        plan.append([n for n in names if contributions or n in HEAD_VALUES])
    values = []
    with torch.no_grad(), model.trace(prompt):
        for index, names in enumerate(plan):
            layer = model.layers[index]
            row = {"layer_input": layer.layer_input.save()}
            for name in names:
                row[name] = getattr(host(model, index, name), name).save()
            row["layer_output"] = layer.layer_output.save()
            values.append(row)
        logits = model.logits.save()
    return values, logits


def _block_streams(model, inputs: dict) -> tuple[list, list, object]:
    """Every block's input and output read with plain hooks on the unwrapped model, and its output.

    (Hooks, not ``output_hidden_states``: what a model reports there differs, e.g. Mamba's leaves the
    embeddings out.)
    """
    entering, leaving, handles = {}, {}, []
    for index, block in enumerate(model._module.get_submodule(model.family.layers)):

        def pre(module, args, kwargs, index=index):
            entering[index] = first_input(args, kwargs).clone()

        def post(module, args, output, index=index):
            leaving[index] = (output[0] if isinstance(output, (tuple, list)) else output).clone()

        handles += [block.register_forward_pre_hook(pre, with_kwargs=True), block.register_forward_hook(post)]
    try:
        with torch.no_grad():
            output = model._module(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    count = model.num_layers
    return [entering[i] for i in range(count)], [leaving[i] for i in range(count)], output


def test_values_equal_plain_hooks(model, variant):
    inputs = encode(model)
    contributions = not declined_as_recorded(model, variant)
    values, logits = _trace_all(model, contributions=contributions)
    entering, leaving, reference = _block_streams(model, inputs)
    torch.testing.assert_close(logits, reference.logits, rtol=0, atol=0)
    for index, row in enumerate(values):
        torch.testing.assert_close(row["layer_input"], entering[index], rtol=0, atol=0)
        torch.testing.assert_close(row["layer_output"], leaving[index], rtol=0, atol=0)
        for name in set(row) - {"layer_input", "layer_output"}:
            torch.testing.assert_close(row[name], _site_reference(model, index, name, inputs), rtol=0, atol=0)
            if name in CONTRIBUTIONS:
                assert row[name].shape == row["layer_input"].shape
        if "attention_head_outputs" in row:  # the model's sizes, or the block's own (Inkling's sliding layers)
            assert row["attention_head_outputs"].shape[-2:] == _head_shape(model, index)


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


def test_contribution_identity(model, variant):
    layers = identity_layers(model, variant)
    values, _ = _trace_all(model)
    for row in (values[index] for index in layers):
        total = row["layer_input"] + sum(row[name] for name in CONTRIBUTIONS if name in row)
        torch.testing.assert_close(total, row["layer_output"], **TOL)


def test_zeroed_contribution_leaves_the_others(model, variant):
    for index in identity_layers(model, variant):
        names = served(model, index)
        for zeroed in names:
            kept = []
            with torch.no_grad(), model.trace(PROMPTS[0]):
                x = model.layers[index].layer_input.save()
                for name in names:
                    value = getattr(host(model, index, name), name)
                    if name == zeroed:
                        value[:] = 0
                    else:
                        kept.append(value.save())
                y = model.layers[index].layer_output.save()
            torch.testing.assert_close(y - x, sum(kept) if kept else torch.zeros_like(x), **TOL)


def test_head_ablation_equals_probability_ablation(model):
    for index in model.support().layers_with("attention_probabilities"):
        head = head_count(model, index) - 1
        with torch.no_grad(), model.trace(PROMPTS[0]):
            model.layers[index].self_attn.attention_head_outputs[..., head, :] = 0
            by_head = model.logits.save()
        with torch.no_grad(), model.trace(PROMPTS[0]):
            model.layers[index].self_attn.attention_probabilities[:, head] = 0
            by_probabilities = model.logits.save()
        with torch.no_grad(), model.trace(PROMPTS[0]):
            clean = model.logits.save()
        torch.testing.assert_close(by_head, by_probabilities, **TOL)
        assert not torch.equal(by_head, clean), "zeroing a head must reach the logits"


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
    covered = set()
    for other in variants():
        if other.model_type in family.model_types:
            covered |= kinds_of(other.build_config().get_text_config())
    assert covered == declared
    report = model.support()
    if any(layout.attention for layout in family.all_layouts()):
        attention = report.layers_with("self_attn")
        assert attention, "a family with attention has it in its tiny config"
        if not all("attention_probabilities" in recorded_declines(variant, i) for i in attention):
            assert report.layers_with("attention_probabilities"), "eager attention layers serve probabilities"


def test_write_in_one_invoke_touches_its_rows_only(model, variant):
    """Invokes 1 and 3 of a trace whose invoke 2 writes are bit-identical to the same trace without the write.

    (Compared with the same batch, not with invoke 1: some models are not batch-row invariant at
    the last bit, e.g. chunked DeltaNet kernels, so two identical rows of one batch can differ.)
    """
    declined_as_recorded(model, variant)  # (served() leaves declined values out)
    writable = HEAD_VALUES + CONTRIBUTIONS
    # The first block that serves a writable value (RWKV's block 0 declines its contributions).
    start = next((i for i in range(model.num_layers) if served(model, i, writable)), None)
    assert start is not None, "some block serves a writable value"
    first = served(model, start, writable)
    last = served(model, model.num_layers - 1) or served(model, model.num_layers - 1, HEAD_VALUES)
    runs = {}
    for write in (False, True):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                clean = model.logits.save()
            with tracer.invoke(PROMPTS[0]):
                if write:
                    for name in first:
                        getattr(host(model, start, name), name)[:, 1:] = 0
                    if last and model.num_layers - 1 > start:
                        getattr(host(model, model.num_layers - 1, last[-1]), last[-1])[:, -1] = 1.0
                middle = model.logits.save()
            with tracer.invoke(PROMPTS[1]):
                other = model.logits.save()
        runs[write] = (clean, middle, other)
    # A mixture of experts runs each expert on the batch's tokens routed to it: a write that reroutes
    # invoke 2's tokens changes how many rows each expert's matmul has, which moves the other rows'
    # results at the last bit (7.5e-9 measured). A write that leaked would move them by far more.
    tolerance = dict(rtol=0, atol=1e-6) if model.support().layers_with("expert_indices") else dict(rtol=0, atol=0)
    torch.testing.assert_close(runs[True][0], runs[False][0], **tolerance)
    torch.testing.assert_close(runs[True][2], runs[False][2], **tolerance)
    assert not torch.equal(runs[True][1], runs[False][1]), "the write must reach its own invoke"


def test_skip_layers_passes_the_stream(model):
    last = model.num_layers - 1
    with torch.no_grad(), model.trace(PROMPTS[0]):
        entering = model.layers[0].layer_input.save()
        model.skip_layers(0, last)
        leaving = model.layers[last].layer_output.save()
        lens = model.project_on_vocab(entering).save()
        logits = model.logits.save()
    assert torch.equal(leaving, entering)
    assert torch.equal(logits, lens)


def test_resumed_forward_is_the_forward(model):
    """Skipping blocks 0..L-1 with the stream a forward of the same prompt had entering block L gives
    that forward's logits, bit for bit (what sweeps that share a prompt's forward rely on), and the
    last-position logits alone are the full logits' last row."""
    from nncanon.tools.resume import next_token_only, resume_at, streams_entering

    middle = model.num_layers // 2 or 1 if model.num_layers > 1 else 0
    streams = streams_entering(model, PROMPTS[0], [0, middle])
    with torch.no_grad(), model.trace(PROMPTS[0]):
        whole = model.logits.save()
    for layer, stream in streams.items():
        with torch.no_grad(), model.trace(PROMPTS[0]):
            resume_at(model, layer, stream)
            resumed = model.logits.save()
        assert torch.equal(resumed, whole), f"resumed at layers[{layer}]"
    with torch.no_grad(), model.trace(PROMPTS[0], **next_token_only(model)):
        last = model.logits.save()
    torch.testing.assert_close(last[:, -1], whole[:, -1], rtol=1e-5, atol=1e-6)


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
    with pytest.raises(ValueError, match="cover every row"):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                model.skip_layers(0, 0)
            with tracer.invoke(PROMPTS[0]):
                model.logits.save()


def test_lens_at_last_layer_equals_logits(model):
    with torch.no_grad(), model.trace(PROMPTS):
        lens = model.project_on_vocab(model.layers[-1].layer_output).save()
        logits = model.logits.save()
    torch.testing.assert_close(lens, logits, rtol=0, atol=0)


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
    weights = {k: v.clone() for k, v in model._module.state_dict().items()}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        before = model.logits.save()
    with pytest.raises(RuntimeError, match="deliberate"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            for name in served(model, 0, HEAD_VALUES + (CONTRIBUTIONS if contributions else ())):
                getattr(host(model, 0, name), name)[:] = 0
            raise RuntimeError("deliberate")
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.layers[0].layer_output[:] = 0
    with torch.no_grad(), model.trace(PROMPTS[0]):
        after = model.logits.save()
    assert torch.equal(before, after)
    for key, value in model._module.state_dict().items():
        assert torch.equal(value, weights[key]), key


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
