"""Several dictionaries of one block read in one invoke, in either order (issue 31), and a norm's value read after
a dictionary at that norm (issue 34).

Every ordered pair of the dictionary sites of a block is read in one invoke: each dictionary's features equal its
features read alone, and the logits are the clean run's, bit for bit. An edit the model can no longer take (the
model ran past the point) is `InvalidWrite`, never lost.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from nncanon import InvalidWrite
from nncanon.sae import Dictionary, attach, value_at
from nncanon.testing import tiny_model

PROMPT = "The Eiffel Tower is in the city of"
SITES = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_in", "ln2.hook_normalized", "hook_mlp_out",
         "hook_resid_post")


def _dictionary(model, site: str, seed: int) -> Dictionary:
    """A random dictionary at ``blocks.1.{site}``; at ``hook_mlp_in`` a transcoder writing ``hook_mlp_out``."""
    d, features = model.hidden_size, 12
    g = torch.Generator().manual_seed(seed)
    kwargs = {"hook_name": f"blocks.1.{site}"}
    if site == "hook_mlp_in":
        kwargs.update(architecture="transcoder", hook_name_out="blocks.1.hook_mlp_out")
    return Dictionary.from_tensors(torch.randn(d, features, generator=g) / d ** 0.5, torch.full((features,), 0.05),
                                   torch.randn(features, d, generator=g) / d ** 0.5, torch.zeros(d), **kwargs)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2", "falcon_h1"])
def test_every_pair_of_a_blocks_dictionaries_is_served_in_either_order(family):
    """OutOfOrderRead before for a transcoder at hook_mlp_in read before a hook_resid_mid dictionary (and for any
    dictionary read after one at a later site of its block)."""
    model = tiny_model(family)
    dictionaries = {site: _dictionary(model, site, seed) for seed, site in enumerate(SITES)}
    with torch.no_grad(), model.trace(PROMPT):
        clean = model.logits.save()
    alone = {}
    for site, dictionary in dictionaries.items():
        with attach(model, dictionary) as item, torch.no_grad(), model.trace(PROMPT):
            alone[site] = item.features.save()
    for first, second in itertools.permutations(SITES, 2):
        with attach(model, dictionaries[first]) as a, attach(model, dictionaries[second]) as b:
            with torch.no_grad(), model.trace(PROMPT):
                features_a = a.features.save()
                features_b = b.features.save()
                again_a = a.features.save()  # (served from its visit where the model ran past it)
                logits = model.logits.save()
        for features, site in ((features_a, first), (again_a, first), (features_b, second)):
            torch.testing.assert_close(features, alone[site], rtol=0, atol=0, msg=f"{first} then {second}: {site}")
        assert torch.equal(logits, clean), (first, second)


def test_an_edit_after_the_model_ran_past_the_point_is_refused(llama):
    """A resid_mid dictionary read after a transcoder at hook_mlp_in is served from the visit made before the
    transcoder's read; an edit of its features then could not reach the model: InvalidWrite, by assignment or in
    place."""
    coder, mid = _dictionary(llama, "hook_mlp_in", 1), _dictionary(llama, "hook_resid_mid", 2)
    with attach(llama, coder) as t, attach(llama, mid) as b:
        with pytest.raises(InvalidWrite, match=r"resid_mid.*ran past its point"), torch.no_grad(), llama.trace(PROMPT):
            t.features.save()
            b.features[..., 3] += 1.0
            llama.logits.save()
        with pytest.raises(InvalidWrite, match="ran past its point"), torch.no_grad(), llama.trace(PROMPT):
            t.features.save()
            b.features = torch.zeros(1, 9, 12)


def test_edits_in_the_models_order_reach_it_whichever_dictionary_is_read_first(llama):
    """A transcoder at hook_mlp_in read first: a resid_mid dictionary's edit made before that read (in the model's
    order) and the transcoder's edit both reach the model, as plain hooks adding their decoder rows would."""
    from nncanon.proof.checks.references import encode, hf_block

    coder, mid = _dictionary(llama, "hook_mlp_in", 1), _dictionary(llama, "hook_resid_mid", 2)
    block = hf_block(llama, 1)
    handles = [block.self_attn.register_forward_hook(lambda m, a, out: (out[0] - 1.5 * mid.W_dec[5], *out[1:])),
               block.mlp.register_forward_hook(lambda m, a, out: out + 2.0 * coder.W_dec[3])]
    try:
        with torch.no_grad():
            expected = llama._module(**encode(llama, PROMPT)).logits
    finally:
        for handle in handles:
            handle.remove()
    with attach(llama, coder) as t, attach(llama, mid) as b, torch.no_grad(), llama.trace(PROMPT):
        b.features[..., 5] -= 1.5
        t.features[..., 3] += 2.0
        logits = llama.logits.save()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["ln2.hook_normalized", "ln2.hook_scale"])
def test_a_norms_value_read_after_a_dictionary_at_that_norm(llama, name):
    """OutOfOrderRead before (the value is computed from the norm's input, which the dictionary's read passed). The
    value equals the one read alone, and a write to it after the dictionary's read reaches the model as a write
    alone does."""
    sae = _dictionary(llama, "ln2.hook_normalized", 3)
    with torch.no_grad(), llama.trace(PROMPT):
        expected = value_at(llama, f"blocks.1.{name}").save()
    with torch.no_grad(), llama.trace(PROMPT):
        value_at(llama, f"blocks.1.{name}")[..., 2, :] *= 2
        written = llama.logits.save()
    with attach(llama, sae) as item:
        for order in ("dictionary first", "value first"):
            with torch.no_grad(), llama.trace(PROMPT):
                if order == "dictionary first":
                    features = item.features.save()
                value = value_at(llama, f"blocks.1.{name}").save()
                if order == "value first":
                    features = item.features.save()
            torch.testing.assert_close(value, expected, rtol=0, atol=0)
            torch.testing.assert_close(features, sae.encode(_normalized(llama)), rtol=0, atol=1e-6)
        with torch.no_grad(), llama.trace(PROMPT):
            item.features.save()
            value_at(llama, f"blocks.1.{name}")[..., 2, :] *= 2
            logits = llama.logits.save()
    torch.testing.assert_close(logits, written, rtol=0, atol=1e-6)
    assert not torch.equal(written, _clean(llama))


def _normalized(model):
    with torch.no_grad(), model.trace(PROMPT):
        value = model.layers[1].mlp.mlp_normalized.save()
    return value


def _clean(model):
    with torch.no_grad(), model.trace(PROMPT):
        logits = model.logits.save()
    return logits
