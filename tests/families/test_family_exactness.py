"""Attention implementations, on every registered family: ``attention_head_outputs`` under sdpa equals
plain hooks and eager; probabilities under sdpa, recomputed, equal eager's (and refuse writes) where the
attention's kernel call is one they are recomputed from (transformers' interface, Falcon's sdpa call), and
are declined naming eager elsewhere.

(bf16 write locality and the per-head decomposition are checks of the verifier, `nncanon.proof.checks`,
run on every family by test_invariants.)
"""

from __future__ import annotations

import pytest
import torch

from nncanon import InvalidWrite, ValueNotAvailable
from nncanon.proof.checks.references import encode, site_reference
from nncanon.registry import records
from nncanon.testing import PROMPTS, tiny_model

from ..conftest import recorded_declines, upstream_failures, upstream_issue


def test_sdpa_heads_and_probabilities_equal_eager(variant, model):
    # eager only by the record (unless the installed minor still runs sdpa: Gemma-2 on 5.20, the record's upstream
    # failure), or in the installed transformers' own class (GPT-J before 5.24)
    eager_only = records()[variant.model_type].get("eager_only") and "sdpa" not in upstream_failures(variant)
    if eager_only or not type(model._module)._supports_sdpa:
        with pytest.raises(ValueError):
            tiny_model(variant, attn_implementation="sdpa")
        return
    sdpa = tiny_model(variant, attn_implementation="sdpa")
    assert sdpa.attn_implementation == "sdpa"
    attention_layers = model.support().layers_with("attention_head_outputs")
    eager_heads, sdpa_heads = [], []
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for index in attention_layers:
            eager_heads.append(model.layers[index].self_attn.attention_head_outputs.save())
    with torch.no_grad(), sdpa.trace(PROMPTS[0]):
        for index in attention_layers:
            sdpa_heads.append(sdpa.layers[index].self_attn.attention_head_outputs.save())
    # Under sdpa the heads are the projection's input, as plain hooks on the bare sdpa model read it.
    inputs = encode(sdpa)
    for index, sdpa_value in zip(attention_layers, sdpa_heads, strict=True):
        assert torch.equal(sdpa_value, site_reference(sdpa, index, "attention_head_outputs", inputs))
    # And they equal eager's wherever transformers' own eager and sdpa forwards agree (they do not for
    # Falcon with ALiBi before 5.25, whose eager path adds ALiBi twice: see model_registry/falcon.json).
    with torch.no_grad():
        agree = torch.allclose(model._module(**inputs).logits, sdpa._module(**inputs).logits, rtol=1e-4, atol=1e-5)
    if agree:
        assert upstream_issue(variant) is None, "eager and sdpa agree here: the record's upstream_issues entry is stale"
        # a record may widen atol where transformers' own eager and sdpa kernels differ more (its sdpa_atol_why)
        atol = records()[variant.model_type].get("sdpa_atol", 1e-5)
        for eager_value, sdpa_value in zip(eager_heads, sdpa_heads, strict=True):
            torch.testing.assert_close(sdpa_value, eager_value, rtol=1e-4, atol=atol)
    else:
        assert upstream_issue(variant) is not None, "eager and sdpa differ in transformers itself, unrecorded"
    _sdpa_probabilities(variant, model, sdpa, attention_layers)


def _sdpa_probabilities(variant, model, sdpa, attention_layers) -> None:
    """Under sdpa, probabilities are recomputed (equal to eager's, writes refused naming eager) on every layer
    that serves them under eager through a kernel call they are recomputed from, and declined naming eager
    elsewhere, and where transformers' own eager and sdpa attend differently (`upstream_issues`: they would be
    sdpa's, not eager's)."""
    from nncanon.components.kernel import Kernel

    upstream = upstream_issue(variant) is not None
    for index in attention_layers:
        eager_serves = model.support().available("attention_probabilities", layer=index)
        kernel = sdpa.layers[index].self_attn._nncanon.kernel
        recomputable = isinstance(kernel, Kernel) and kernel.recompute is not None
        if not (eager_serves and recomputable) or upstream:
            assert not sdpa.support().available("attention_probabilities", layer=index)
            # Declined for want of eager, unless the family declines them outright (DiffLlama).
            reason = "eager" if "attention_probabilities" not in recorded_declines(variant, index) else "not available"
            with pytest.raises(ValueNotAvailable, match=reason):
                with sdpa.trace(PROMPTS[0]):
                    sdpa.layers[index].self_attn.attention_probabilities
            continue
        assert sdpa.support().available("attention_probabilities", layer=index)
        raises = upstream_failures(variant).get("recomputed", {}).get("raises")
        if raises is not None:  # the installed minor's sdpa computes something else (the record says why)
            with pytest.raises(ValueNotAvailable, match=raises):
                with torch.no_grad(), sdpa.trace(PROMPTS):
                    sdpa.layers[index].self_attn.attention_probabilities.save()
            continue
        with torch.no_grad(), model.trace(PROMPTS):
            eager = model.layers[index].self_attn.attention_probabilities.save()
        with torch.no_grad(), sdpa.trace(PROMPTS):
            recomputed = sdpa.layers[index].self_attn.attention_probabilities.save()
        if "recomputed" in upstream_failures(variant):
            # The installed transformers' eager attention gives NaN probabilities on fully masked queries (the
            # record's upstream failure): the recomputation equals eager's wherever eager's are numbers.
            finite = ~torch.isnan(eager)
            assert not finite.all(), "eager's probabilities have no NaN: the record's upstream failure is stale"
            recomputed, eager = recomputed[finite], eager[finite]
        torch.testing.assert_close(recomputed, eager, rtol=1e-5, atol=1e-5, msg=f"layers[{index}]")
        with pytest.raises(InvalidWrite, match='attn_implementation="eager"'):
            with torch.no_grad(), sdpa.trace(PROMPTS[0]):
                sdpa.layers[index].self_attn.attention_probabilities[:, 0] = 0
