"""nnsight writes torch's own ``.grad`` descriptor back onto ``torch.Tensor`` after a backward block (an
nnterp-style backward through ``project_on_vocab`` does): that state is not a backward, the forward
guard still names a ``.grad`` read too early, and proofs made afterwards hold."""

from __future__ import annotations

import pytest
import torch

from nncanon import GradientNotAvailable
from nncanon.gradients import in_backward
from nncanon.proof.verdict import verify
from nncanon.testing import PROMPTS, tiny_model


@pytest.fixture
def descriptor_on_tensor():
    had = "grad" in torch.Tensor.__dict__
    torch.Tensor.grad = torch._C.TensorBase.grad  # what nnsight leaves after a backward block
    yield
    if not had:
        del torch.Tensor.grad


def test_torchs_descriptor_on_tensor_is_not_a_backward(descriptor_on_tensor):
    assert not in_backward()
    model = tiny_model("llama")
    assert verify(model).passed
    with pytest.raises(GradientNotAvailable, match="forward part of the trace"):
        with model.trace(PROMPTS[0]):
            model.layers[0].self_attn.attention_output.grad
    assert torch.Tensor.__dict__.get("grad") is torch._C.TensorBase.grad, "the guard put back what it found"
    x = torch.ones(2, requires_grad=True)
    (x * 3).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 3.0))
