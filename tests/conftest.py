"""Shared fixtures: every registry variant as a tiny model, and plain-PyTorch references."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from nncanon.registry import variants
from nncanon.testing import PROMPTS, tiny_model

# Tiny models gain nothing from intra-op threads, and several test processes on a few cores would
# oversubscribe them: one thread per process.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"  # and in the processes the tests start (the CLI's)

# The references the tests load with transformers' own from_pretrained are plain models, as nncanon loads them:
# transformers 5.25 turns hub kernels on by default (and needs the `kernels` package and the hub for them).
os.environ["USE_HUB_KERNELS"] = "NO"

# Load-time proofs go to a cache of this test process, never the user's ~/.cache/nncanon.
os.environ["NNCANON_CACHE"] = tempfile.mkdtemp(prefix="nncanon-cache-")

VARIANTS = variants()
VARIANT_IDS = [v.name for v in VARIANTS]


def variant_params(names=None) -> list:
    """Registry variants (those called ``names``, else all) as parameters; the installed transformers'
    missing model types are skipped with the reason (`nncanon.registry.Variant.unavailable`), never failed."""
    chosen = VARIANTS if names is None else [v for v in VARIANTS if v.name in set(names)]
    return [pytest.param(v, id=v.name, marks=[pytest.mark.skip(reason=v.unavailable)] if v.unavailable else [])
            for v in chosen]


def model_type_params() -> list:
    """Every registered model type as a parameter, skipped with the reason where the installed transformers
    lacks it (`nncanon.versions.missing_from_transformers`) or its class needs a library not installed."""
    from nncanon.registry import records
    from nncanon.versions import missing_from_transformers, missing_libraries

    params = []
    for model_type, record in sorted(records().items()):
        reason = (missing_from_transformers(model_type, record["config_class"], record.get("model_class"))
                  or missing_libraries(record.get("requires", ())))
        params.append(pytest.param(model_type, marks=[pytest.mark.skip(reason=reason)] if reason else []))
    return params


def skip_unavailable(name: str) -> None:
    """Skip the running test when the installed transformers cannot build variant ``name``."""
    from nncanon.registry import variant as find

    reason = find(name).unavailable
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module", params=variant_params())
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def model(variant):
    """The variant's tiny model (eager attention, fp32), shared by one test module."""
    return tiny_model(variant)


# The helpers the verifier reads the surface with, shared by the tests (one copy, in the package).
from nncanon.proof.checks.base import HEAD_VALUES  # noqa: E402, F401
from nncanon.proof.checks.references import encode, hf_block, served  # noqa: E402, F401
from nncanon.reading import CONTRIBUTIONS, host  # noqa: E402


def recorded_declines(variant, layer: int) -> set[str]:
    """What the registry record says block ``layer`` of ``variant`` declines (on every layer that has it).

    A record lists what a configuration cannot serve exactly under ``"declined_variants"``: a list
    (``{"bloom_residual_post_ln": ["attention_output", "mlp_output"]}``: declined on every layer that
    has the value) or, where only some layers decline, a map from layer to list
    (``{"rwkv": {"0": ["linear_attention_output", "mlp_output"]}}``).
    """
    from nncanon.registry import records

    recorded = records()[variant.model_type].get("declined_variants", {}).get(variant.name, [])
    return set(recorded.get(str(layer), []) if isinstance(recorded, dict) else recorded)


def upstream_failures(variant) -> dict[str, dict]:
    """The checks that the installed transformers' own code makes fail on ``variant``, each with its record
    entry: the record's ``"upstream_failures"`` entries whose ``"transformers"`` minors include the installed
    one (and whose ``"variants"``, where given, include ``variant``). An entry says ``"why"``; ``"raises"``: the
    message a read of the value raises there (instead of measuring a difference).

    There the check must fail and the load-time proof must decline what it covers (the suite asserts both);
    on every other minor it must hold. ``"sdpa"`` is no check of the verifier: the installed minor still runs
    sdpa where the record says ``"eager_only"`` (Gemma-2 on 5.20). Qwen4-Exp's eager attention gives NaN on
    5.20-5.22 (``model_registry/qwen4_exp.json``).
    """
    found: dict[str, dict] = {}
    for entry in _on_installed_minor(variant, "upstream_failures"):
        found.update(dict.fromkeys(entry["checks"], entry))
    return found


def upstream_issue(variant) -> str | None:
    """Why transformers' own eager and sdpa forwards attend differently on ``variant`` on the installed minor
    (the record's ``"upstream_issues"`` entry for it: Falcon's ALiBi path before 5.25), else ``None``. There the
    heads under sdpa are not eager's, and the family declines probabilities recomputed under sdpa."""
    return next((entry["why"] for entry in _on_installed_minor(variant, "upstream_issues")), None)


def _on_installed_minor(variant, key: str) -> list[dict]:
    """The entries of ``variant``'s record under ``key`` whose ``"transformers"`` minors include the installed
    one and whose ``"variants"`` (where given) include ``variant``."""
    from nncanon.registry import records
    from nncanon.versions import transformers_minor

    minor = "{}.{}".format(*transformers_minor())
    return [entry for entry in records()[variant.model_type].get(key, [])
            if minor in entry["transformers"] and variant.name in entry.get("variants", [variant.name])]


def inline_kernel_inputs(model, layer: int) -> set[str]:
    """The attention kernel's per-head inputs where block ``layer``'s attention makes no kernel call under the
    implementation it runs (as nnsight's parse of its forward sees it): no call of transformers' attention
    interface, nor of the call its family names (`Family.kernel`) or not under this implementation; declined
    there, by rule, not by the record."""
    from nncanon.components.kernel import STATES, Kernel, implementation
    from nncanon.served import operation_name

    if not model.support().available("self_attn", layer=layer):
        return set()
    attention = model.layers[layer].self_attn
    names = attention.source.names
    declared = model.family.for_layer(model._text_config, layer)[0].kernel
    declared = declared(model._text_config) if callable(declared) else declared
    if isinstance(declared, Kernel):
        now = implementation(attention._module) or implementation(model._module)
        calls = operation_name(names, declared.op) in names and declared.runs_under(now)
    else:
        calls = declared is None and any(name.startswith("attention_interface_") for name in names)
    return set() if calls else set(STATES)


def identity_layers(model, variant) -> list[int]:
    """The layers whose contribution identity can be asked, after checking declines against the record.

    A value is declined when the block has it (its component is there, and it is not a value the
    component lacks, like a dense MLP's routing) but does not serve it; a component a block does not
    have (a Mamba block's ``self_attn``) is not a decline. Asserts that on every layer ``support()``
    declines exactly the recorded values the layer has (`recorded_declines`), that each recorded value
    is declined somewhere, and that reading a declined value raises with the reason.

    A layer that declines a contribution is left out: its identity cannot be asked. Except for a
    variant listed under ``"identity_without_declined"``, whose declined values are not terms of the
    block's update (Zamba's shared transformer reaches the stream only through its Mamba mixer's
    input): the identity holds over the served contributions there too.
    """
    from nncanon.registry import records
    from nncanon.support import COMPONENT_OF, INNER_VALUES, NORM_VALUES

    additive = variant.name in records()[variant.model_type].get("identity_without_declined", [])
    report = model.support()
    layers, seen, everywhere = [], set(), set()
    for index in range(model.num_layers):
        expected = recorded_declines(variant, index)
        everywhere |= expected
        inline = inline_kernel_inputs(model, index)
        expected = expected | inline
        row = report.layers[index]
        # (a block's inner values, its neurons, its mixers' inputs and its norms' values, are declined by the block's
        # structure, not by the record: tests/families/test_inner_values.py and test_norms.py hold every one of those
        # declines to its reason)
        # (the scores likewise where the installed minor's older attention code is not proved: the family says so)
        old_scores = {"attention_scores"} - set(expected) if "load with transformers" in (
            report.reason("attention_scores", layer=index) or "") else set()
        has = {value for value, component in COMPONENT_OF.items()
               if report.available(component, layer=index) and value not in row.absent
               and value not in INNER_VALUES + NORM_VALUES}
        declined = set(report.declined(index)) - set(INNER_VALUES) - set(NORM_VALUES) - old_scores
        assert declined == expected & has, (
            f"layer {index}: support() declines {declined}, the record says {expected & has}"
        )
        seen |= declined - inline
        for value in declined:
            with pytest.raises(AttributeError, match="not available"):
                with model.trace(PROMPTS[0]):
                    getattr(host(model, index, value), value)
        if additive or not declined & set(CONTRIBUTIONS):
            layers.append(index)
    assert seen == everywhere, f"the record declines {everywhere - seen} that no layer declines"
    return layers


def declined_as_recorded(model, variant) -> bool:
    """Whether some layer's identity cannot be asked (`identity_layers`, with its checks)."""
    return len(identity_layers(model, variant)) < model.num_layers
