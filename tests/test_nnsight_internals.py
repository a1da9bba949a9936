"""What nncanon relies on of nnsight's insides (`nncanon.nnsight_internals`): the table is complete, and each
entry's behaviour still holds in the installed nnsight (a new release that changes one fails its test here)."""

from __future__ import annotations

import ast
import inspect
import pathlib

import nnsight
import pytest
import torch
from nnsight.intervention import backward
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.eproperty import WriteBack, eproperty
from nnsight.intervention.interleaver import Mediator, OutOfOrderError
from nnsight.intervention.tracer import InterleavingTracer
from nnsight.intervention.util import first_input, replace_first_input
from nnsight.modeling.quantization import resolve_load_kwargs
from nnsight.modeling.transformers import TransformersModel
from nnsight.tracing.tracer import WithBlockNotFoundError

import nncanon
from nncanon.nnsight_internals import ATTRIBUTES, IMPORTS, INTERNALS, OVERRIDES
from nncanon.testing import PROMPTS, tiny_hf_model, tiny_model, tiny_tokenizer

PACKAGE = pathlib.Path(nncanon.__file__).parent
NNSIGHT = pathlib.Path(nnsight.__file__).parent

#: nncanon's own attributes whose names nnsight also uses for its own (not a use of nnsight's).
OWN_NAMES = {"_text_config", "_values"}


def _names_defined(root: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def _private_attributes_used(root: pathlib.Path) -> set[str]:
    used: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                used.add(node.attr)
    return used


def test_every_private_name_of_nnsight_used_is_listed():
    nnsights = _names_defined(NNSIGHT)
    used = {name for name in _private_attributes_used(PACKAGE) if name in nnsights} - OWN_NAMES
    assert used <= {entry.name for entry in INTERNALS}, "a private name of nnsight used but not listed"
    assert {entry.name for entry in ATTRIBUTES} <= used, "a listed attribute no longer used: drop it from the table"


def test_every_override_of_a_private_nnsight_method_is_listed():
    bases = (TransformersModel, Envoy, InterleavingTracer, eproperty)
    overridden = set()
    for module in [nncanon.mounted, nncanon.model, nncanon.threads, nncanon.served, nncanon.components.base,
                   nncanon.components.layer, nncanon.components.attention, nncanon.components.mlp,
                   nncanon.components.linear_attention]:
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or not issubclass(cls, bases):
                continue
            for name in vars(cls):
                private = name.startswith("_") and not name.startswith("__")
                nnsights = [base for base in cls.__mro__[1:] if base.__module__.startswith("nnsight")]
                if private and any(name in vars(base) for base in nnsights):
                    overridden.add(name)
    listed = {entry.name for entry in OVERRIDES if entry.kind == "override" and entry.name.startswith("_")}
    assert overridden == listed


def test_every_import_from_nnsight_is_listed():
    imported = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nnsight."):
                imported |= {f"{node.module}.{alias.name}" for alias in node.names}
            if isinstance(node, ast.ImportFrom) and node.module == "nnsight":
                assert {alias.name for alias in node.names} <= {"NNsight"}, "nnsight's API: NNsight, register"
    assert imported == {entry.name for entry in IMPORTS}


def test_every_entry_says_why():
    for entry in INTERNALS:
        assert entry.kind in ("attribute", "override", "patch", "import") and entry.why and entry.relies_on


# -- each entry's behaviour ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_an_envoy_wraps_its_module_as_module(model):
    block = model._module.model.layers[0]
    assert model.layers[0]._module is block and model.layers[0].mlp._module is block.mlp


def test_envoy_aliases_and_child_map():
    """nncanon binds a standard name to a native child (GPT-2's ``attn`` as ``self_attn``) and records it in
    ``_aliases``, as nnsight's ``rename`` does: the repr labels the child ``self_attn/attn``."""
    plain = nnsight.NNsight(tiny_hf_model("gpt2"))
    block = plain.transformer.h[0]
    assert block._child_map["attn"] is block.attn
    object.__setattr__(block, "self_attn", block.attn)
    block._aliases["self_attn"] = "attn"
    assert "(self_attn/attn): GPT2Attention" in repr(block)


def test_an_eproperty_keeps_its_parts_and_its_location():
    def stub(host, value):
        return value

    prop = eproperty(key="output")(stub)
    assert prop._preprocess is stub and prop._postprocess is None and prop._transform is None

    class Host:
        path = "model.layers.0"

    assert prop._location(Host()) == "model.layers.0.output"


def test_batch_size_and_batch_see_every_invoke():
    seen = {"sizes": [], "batches": []}

    class Watching(TransformersModel):
        def _batch_size(self, *inputs, **kwargs):
            seen["sizes"].append(inputs)
            return super()._batch_size(*inputs, **kwargs)

        def _batch(self, invokes, fn):
            args, kwargs = super()._batch(invokes, fn)
            seen["batches"].append(kwargs["input_ids"].shape)
            return args, kwargs

    watched = Watching(tiny_hf_model("llama"), tokenizer=tiny_tokenizer())
    with torch.no_grad(), watched.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            pass
        with tracer.invoke(PROMPTS[1]):
            pass
    assert {inputs[0] for inputs in seen["sizes"] if inputs} == set(PROMPTS)
    assert seen["batches"] and seen["batches"][-1][0] == 2


def test_remoteable_class_is_what_a_request_is_keyed_as(model):
    assert any("_remoteable_class" in vars(base) for base in TransformersModel.__mro__)
    assert model._remoteable_class() is TransformersModel


def test_generate_wraps_the_bare_method_and_capture_needs_a_with_block(model):
    bare = TransformersModel.generate.__wrapped__
    assert callable(bare) and bare is not TransformersModel.generate
    tracer = model.trace(PROMPTS[0])
    with pytest.raises(WithBlockNotFoundError):
        tracer.capture()
    ids = model.generate(PROMPTS[0], max_new_tokens=2, do_sample=False)  # no with block: runs at once
    assert isinstance(ids, torch.Tensor) and ids.shape[-1] >= 2


def test_the_backward_grad_property_is_made_by_grad_property(model):
    """nncanon wraps ``backward._grad_property``: the property nnsight installs inside a backward block."""
    assert backward._grad_property.__module__ == "nncanon.gradients"
    parameters = list(inspect.signature(backward._grad_property).parameters)
    assert parameters == ["interleaver", "seen", "hooks"]
    wrapped = nncanon.gradients._nnsight_grad_property
    assert wrapped.__module__ == "nnsight.intervention.backward"
    assert list(inspect.signature(wrapped).parameters) == ["interleaver", "seen", "hooks"]
    with model.trace(PROMPTS[0]):
        value = model.layers[0].mlp.mlp_output
        saved = value.save()
        logit = model.logits[0, -1, 5]
        with logit.backward():
            grad = value.grad.save()
    assert grad.shape == saved.shape


def test_mediator_current_value_swap_and_out_of_order(model):
    with pytest.raises(OutOfOrderError):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            model.layers[1].layer_output.save()
            model.layers[0].layer_output.save()
    assert hasattr(Mediator, "current") and hasattr(Mediator, "value") and hasattr(Mediator, "swap")
    assert "wanted" in vars(Mediator)


def test_an_edit_is_one_mediator_on_the_envoy_run_first_and_removed_there(model):
    before = list(model._edits)
    with model.edit(inplace=True):
        model.layers[0].mlp.mlp_output[:] = 0
    added = [edit for edit in model._edits if all(edit is not old for old in before)]
    assert len(added) == 1 and isinstance(added[0], Mediator)
    try:
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPTS[0]):
                first = model.layers[0].mlp.mlp_output.save()
            with tracer.invoke(PROMPTS[1]):
                second = model.layers[0].mlp.mlp_output.save()
        assert not first.any() and not second.any()  # it ran first, over every invoke's rows
    finally:
        model._edits.remove(added[0])
    with torch.no_grad(), model.trace(PROMPTS[0]):
        clean = model.layers[0].mlp.mlp_output.save()
    assert clean.any()


def test_write_back_and_util_signatures():
    assert list(inspect.signature(WriteBack).parameters)[:5] == ["fn", "view", "eproperty", "location", "occurrence"]
    args, kwargs = (torch.ones(1),), {}
    assert first_input(args, kwargs) is args[0]
    replaced, _ = replace_first_input(args, kwargs, torch.zeros(1))
    assert torch.equal(replaced[0], torch.zeros(1))
    assert "tracer_cls" in inspect.signature(Envoy.trace).parameters or "tracer_cls" in inspect.getsource(Envoy.trace)


def test_resolve_load_kwargs_reads_the_dtype_shorthand():
    resolved = resolve_load_kwargs({"dtype": "nf4"}, quantize=True)
    config = resolved["quantization_config"]
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert isinstance(resolved["dtype"], (str, torch.dtype))
    assert resolve_load_kwargs({"dtype": torch.float32}) == {"dtype": torch.float32}
