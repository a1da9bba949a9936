"""Writes during generation: applied at every step, through the cache, on hybrid and SSM models.

A write to a linear mixer's contribution inside ``for _ in tracer.iter[0:3]`` of
``model.generate(..., max_new_tokens=3)`` reaches every step (the prompt's forward, then one token
per step read through the cache), each step's block output is what the written values make it,
and the per-step logits equal plain transformers generating with the same write made by a forward
hook on the unwrapped model.
"""

from __future__ import annotations

import pytest
import torch

from nncanon.testing import PROMPTS, tiny_hf_model, tiny_model

from ..conftest import skip_unavailable

STEPS = 3

#: (variant, a block with a linear mixer; the mixer's module path in that block)
CASES = [("qwen3_next", 0, "linear_attn"), ("mamba", 1, "mixer")]


def _reference_logits(name: str, layer: int, mixer: str, inputs: dict, zero: bool) -> list[torch.Tensor]:
    """Per-step logits of plain ``generate`` (cache on), the mixer's output zeroed by a hook if ``zero``."""
    hf = tiny_hf_model(name)
    block = hf.get_submodule("backbone.layers" if hasattr(hf, "backbone") else "model.layers")[layer]
    module = block.get_submodule(mixer)
    handle = module.register_forward_hook(lambda module, args, output: torch.zeros_like(output)) if zero else None
    try:
        with torch.no_grad():
            out = hf.generate(
                **inputs,
                max_new_tokens=STEPS,
                do_sample=False,
                use_cache=True,
                return_dict_in_generate=True,
                output_logits=True,
            )
    finally:
        if handle is not None:
            handle.remove()
    return list(out.logits)


@pytest.mark.parametrize("name, layer, mixer", CASES, ids=[case[0] for case in CASES])
def test_write_at_every_generation_step(name, layer, mixer):
    skip_unavailable(name)
    model = tiny_model(name)
    inputs = dict(model.tokenizer(PROMPTS[0], return_tensors="pt"))
    prompt_length = inputs["input_ids"].shape[1]
    has_mlp = model.support().available("mlp_output", layer=layer)
    entering, written, mlp_outputs, leaving, logits = [], [], [], [], []
    with torch.no_grad(), model.generate(PROMPTS[0], max_new_tokens=STEPS, do_sample=False) as tracer:
        for _ in tracer.iter[0:STEPS]:
            block = model.layers[layer]
            entering.append(block.layer_input.save())
            contribution = block.linear_attn.linear_attention_output
            contribution[:] = 0
            written.append(block.linear_attn.linear_attention_output.save())
            if has_mlp:
                mlp_outputs.append(block.mlp.mlp_output.save())
            leaving.append(block.layer_output.save())
            logits.append(model.logits[:, -1].save())
        ids = tracer.result.save()
    assert len(leaving) == STEPS
    # The prompt's forward, then one token per step: the cache carries the rest.
    assert [x.shape[1] for x in entering] == [prompt_length] + [1] * (STEPS - 1)
    for step in range(STEPS):
        assert torch.equal(written[step], torch.zeros_like(written[step])), f"step {step}: the write is seen"
        expected = entering[step] + written[step] + (mlp_outputs[step] if has_mlp else 0)
        assert torch.equal(leaving[step], expected), f"step {step}: the block adds the written contribution"
    reference = _reference_logits(name, layer, mixer, inputs, zero=True)
    clean = _reference_logits(name, layer, mixer, inputs, zero=False)
    assert ids.shape[1] == prompt_length + STEPS
    for step in range(STEPS):
        torch.testing.assert_close(logits[step], reference[step], rtol=0, atol=0)
        assert not torch.equal(logits[step], clean[step]), f"step {step}: the write must change the logits"
