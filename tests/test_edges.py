"""The corners of the surface (issue 14): checked writes to the logits, named errors, skips, threads, aliasing."""

from __future__ import annotations

import pytest
import torch

from nncanon import InvalidWrite
from nncanon.testing import PROMPTS, tiny_model


@pytest.fixture(scope="module")
def gpt2():
    return tiny_model("gpt2")


def _pointing_at(shape: torch.Size, token: int) -> torch.Tensor:
    """Logits of ``shape`` whose every row puts its mass on ``token``."""
    logits = torch.zeros(shape)
    logits[..., token] = 5.0
    return logits


@pytest.mark.parametrize(
    "bad, match",
    [
        (None, r"model\.logits was assigned a NoneType.*shape \(1, \d+, 300\)"),
        ([1.0, 2.0], r"model\.logits was assigned a list.*shape \(1, \d+, 300\)"),
        (torch.zeros(3), r"model\.logits .*shape \(3,\) does not broadcast to \(1, \d+, 300\)"),
        (torch.zeros(1, 1, 300, dtype=torch.float64), r"model\.logits .*dtype torch\.float64 is not torch\.float32"),
    ],
)
def test_a_wrong_logits_write_is_an_invalid_write(gpt2, bad, match):
    with pytest.raises(InvalidWrite, match=match), gpt2.trace(PROMPTS[0]):
        gpt2.logits = bad


def test_a_logits_write_replaces_the_logits_inside_the_output(gpt2):
    with torch.no_grad(), gpt2.trace(PROMPTS):
        clean = gpt2.output.save()
    with torch.no_grad(), gpt2.trace(PROMPTS):
        gpt2.logits = _pointing_at(gpt2.logits.shape, 7)
        output = gpt2.output.save()
        logits = gpt2.logits.save()
        probs = gpt2.next_token_probs.save()
    assert type(output) is type(clean) and output.keys() == clean.keys()
    assert torch.equal(output.logits, _pointing_at(logits.shape, 7)) and torch.equal(logits, output.logits)
    assert probs.shape == (2, gpt2.vocab_size)
    assert torch.equal(probs, torch.softmax(_pointing_at(logits.shape, 7)[:, -1], dim=-1))


def test_a_logits_write_in_one_invoke_leaves_the_other_rows(gpt2):
    with torch.no_grad(), gpt2.trace(PROMPTS):
        clean = gpt2.logits.save()
    with torch.no_grad(), gpt2.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            gpt2.logits = _pointing_at(gpt2.logits.shape, 7)
            written = gpt2.logits.save()
        with tracer.invoke(PROMPTS[1]):
            other = gpt2.logits.save()
    assert torch.equal(written, _pointing_at(written.shape, 7))
    assert torch.equal(other, clean[1:])


def test_a_logits_write_steers_generation(gpt2):
    prompt_length = len(gpt2.tokenizer(PROMPTS[0]).input_ids)
    with torch.no_grad(), gpt2.generate(PROMPTS[0], max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        for _ in tracer.iter[0:3]:
            gpt2.logits = _pointing_at(gpt2.logits.shape, 7)
        tokens = tracer.result.save()
    assert tokens[0, prompt_length:].tolist() == [7, 7, 7]


def test_next_token_probs_is_read_only(gpt2):
    with pytest.raises(InvalidWrite, match=r"next_token_probs is read-only.*model\.logits\[:, -1\]"):
        with gpt2.trace(PROMPTS[0]):
            gpt2.next_token_probs = torch.zeros(1, gpt2.vocab_size)
