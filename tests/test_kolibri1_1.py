"""Kolibri-1.1 (transformers 5.25): indexed attention with shared keys/values; what is refused and declined.

The invariant suite (tests/families) runs every check of the verifier on the ``kolibri1_1`` variant. Here: that
the variant's indexers do select keys on the proof's prompt (so the suite exercises the sparse path), the skips
that would strand a later block without the keys/values or the pool it reads, the declined resume, and the twin
of the full-size config (its ``kv_source_layers`` renumbered to the blocks it keeps).
"""

from __future__ import annotations

import pytest
import torch

from nncanon import InvalidSkip, ValueNotAvailable
from nncanon.proof.checks.references import encode
from nncanon.testing import PROMPTS, tiny_model
from nncanon.versions import missing_from_transformers

_MISSING = missing_from_transformers("kolibri1_1", "Kolibri1_1Config")
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")


@pytest.fixture(scope="module")
def model():
    return tiny_model("kolibri1_1")


def test_the_indexers_select_keys_on_the_proof_prompt(model):
    """Each indexed block attends to fewer keys than its causal mask shows (and an indexer's pool leaves some
    out), so the suite's checks run through the selection, not around it."""
    seen: dict[int, tuple[int, int, int]] = {}
    hooks = []
    for index, block in enumerate(model._module.model.layers):
        if block.self_attn.indexer is None:
            continue

        def record(module, args, output, index=index):
            mask = args[2]
            visible = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
            seen[index] = (int(visible.sum()), int(output[0].sum()), int(output[1].sum()))

        hooks.append(block.self_attn.indexer.register_forward_hook(record))
    try:
        with torch.no_grad():
            model._module(**encode(model))
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(seen) == [1, 2, 4, 6]
    for visible, selected, pool in seen.values():
        assert selected < pool < visible


def test_a_skip_that_strands_shared_keys_values_or_pool_is_refused(model):
    """layers[1] produces the keys/values layers[2] and [6] read; layers[4] selects the pool layers[6] rescores."""
    with pytest.raises(InvalidSkip, match=r"layers\[1\] produces the keys/values that layers \[2, 6\] read"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            model.skip_layers(1, 1)
    with pytest.raises(InvalidSkip, match=r"layers\[4\] selects the pool of candidate keys that layers \[6\]"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            model.skip_layers(3, 5)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        entering = model.layers[1].layer_input.save()
        model.skip_layers(1, 6)
        leaving = model.layers[6].layer_output.save()
    assert torch.equal(leaving, entering)


def test_a_skipped_block_hands_on_the_pool_it_was_given(model):
    """layers[5] (sliding) sits between the indexer layers[4] and the block that rescores its pool, layers[6]:
    skipped, it hands the pool on, as a plain hook that returns the block's input and pool does."""
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.skip_layers(5, 5)
        logits = model.logits.save()

    def passed(module, args, kwargs, output):
        return args[0], kwargs["index_pool"]

    hook = model._module.model.layers[5].register_forward_hook(passed, with_kwargs=True)
    try:
        with torch.no_grad():
            expected = model._module(**encode(model)).logits
    finally:
        hook.remove()
    with torch.no_grad():
        plain = model._module(**encode(model)).logits
    assert torch.equal(logits, expected)
    assert not torch.equal(logits, plain)


def test_resume_is_declined(model):
    from nncanon.resuming import resume_at

    assert "kv_source_layers" in model.support().model_declines["resume"]
    with pytest.raises(ValueNotAvailable, match=r"model\.resume is not available"):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            resume_at(model, 2, torch.zeros(1))


def test_the_twin_renumbers_the_key_value_sources():
    """The full-size default (50 blocks, four indexers, keys/values read across blocks): the twin keeps one
    block of each kind, with the sources and indexers renumbered to its blocks."""
    import transformers

    from nncanon.proof.twin import build_twin

    built = build_twin(transformers.Kolibri1_1Config(), model_class=transformers.Kolibri1_1ForCausalLM,
                       blocks="model.layers")
    config = built.config
    assert built.stands_for == [0, 2, 4, 9, 14, 19, 24, 49]
    # originally 9, 14 and 49 read layer 4's keys/values; 19 and 24 have their own
    assert config.kv_source_layers == [0, 1, 2, 2, 2, 5, 6, 2]
    assert config.index_layers == [2, 4, 5] and config.mlp_only_layers == [0]
    assert config.index_num_heads <= config.num_attention_heads // config.num_key_value_heads
    assert config.index_pool_size % config.index_compression == 0
    budget = config.index_topk + config.index_num_local_tokens + config.index_num_sink_tokens
    assert budget < encode(tiny_model("kolibri1_1"))["input_ids"].shape[1]  # the proof's prompt selects keys
