"""What a researcher gets wrong first, refused with a named error before the model runs (or as it starts)."""

from __future__ import annotations

import pytest
import torch

from nncanon import GradientNotAvailable, InvalidInput, NestedTrace
from nncanon.tools import (
    activation_patching,
    attribution_patching,
    head_ablation_sweep,
    logit_difference,
    logit_lens,
    mean_values,
    patchscope,
    run_metric,
    steer,
    zero_ablate,
)

from .conftest import build

METRIC = logit_difference(5, 7)


@pytest.mark.parametrize("tool", ["trace", "attribution_patching", "head_ablation_sweep", "activation_patching",
                                  "logit_lens"])
def test_a_tool_called_inside_an_open_trace_is_refused_and_the_model_still_runs(tool):
    """A tool runs its own forward; started inside a trace of the same model it is `NestedTrace` (nnsight's own
    failure is an AttributeError on a None), and the next trace is the plain one."""
    model = build("llama")
    with torch.no_grad(), model.trace("a b"):
        before = model.logits.save()
    calls = {
        "trace": lambda: model.trace("c d").__enter__(),
        "attribution_patching": lambda: attribution_patching(model, "c d", None, METRIC),
        "head_ablation_sweep": lambda: head_ablation_sweep(model, "c d", layers=[0]),
        "activation_patching": lambda: activation_patching(model, "c d", "e f", layers=[0]),
        "logit_lens": lambda: logit_lens(model, "c d"),
    }
    with pytest.raises(NestedTrace, match="inside an open trace"), torch.no_grad(), model.trace("a b"):
        calls[tool]()
    with torch.no_grad(), model.trace("a b"):
        after = model.logits.save()
    assert torch.equal(before, after)


def test_attribution_patching_refuses_a_metric_that_is_not_one_number_per_prompt():
    """A metric of five logits per prompt was summed into one number silently; one of no logit at all failed
    with torch's "does not require grad". A scalar (a sum over the batch) keeps each prompt's estimate."""
    model = build("llama")
    prompts = ["a b", "c d"]
    with pytest.raises(InvalidInput, match=r"metric returned \(2, 5\).*\[batch\] = \[2\]"):
        attribution_patching(model, prompts, None, lambda logits: logits[:, -1, :5])
    with pytest.raises(GradientNotAvailable, match="does not depend on the logits"):
        attribution_patching(model, prompts, None, lambda logits: torch.tensor(1.0))
    per_prompt = attribution_patching(model, prompts, None, METRIC)
    summed = attribution_patching(model, prompts, None, lambda logits: METRIC(logits).sum())
    for item in ("heads", "attention", "mlp"):
        torch.testing.assert_close(summed[item], per_prompt[item], rtol=1e-6, atol=1e-7)


def test_positions_and_heads_out_of_range_are_named_by_every_tool():
    """Each was torch's IndexError "index 5 is out of bounds for dimension 0 with size 3" from inside the trace."""
    model = build("llama")
    prompt = "a b"  # 3 tokens
    message = r"positions=\[5\] is out of range: the sequence is 3 tokens long \(padded\), so an index is in 0\.\.2"
    with pytest.raises(InvalidInput, match=message):
        logit_lens(model, prompt, positions=[5])
    with pytest.raises(InvalidInput, match=message):
        mean_values(model, prompt, "mlp_output", positions=[5])
    with pytest.raises(InvalidInput, match=message), torch.no_grad(), model.trace(prompt):
        steer(model, 0, torch.ones(model.hidden_size), positions=5)
    with pytest.raises(InvalidInput, match=message), torch.no_grad(), model.trace(prompt):
        zero_ablate(model, 0, "block", positions=torch.tensor([5]))
    with pytest.raises(InvalidInput, match=r"heads=\[9\] is out of range: layers\[0\] has 4 heads"), \
            torch.no_grad(), model.trace(prompt):
        zero_ablate(model, 0, "attention_head_outputs", heads=[0, 9])


def test_attribution_patching_takes_one_item_of_over_as_a_string():
    """over="heads" was read letter by letter: "over=('h', 'e', 'a', 'd', 's'): choose among ..."."""
    model = build("llama")
    alone = attribution_patching(model, "a b", None, METRIC, over="heads")
    listed = attribution_patching(model, "a b", None, METRIC, over=("heads",))
    assert alone.attention is None and alone.mlp is None
    assert torch.equal(alone.heads, listed.heads)
    with pytest.raises(ValueError, match=r"over=\('neurons',\): choose among"):
        attribution_patching(model, "a b", None, METRIC, over="neurons")


def test_patchscope_positions_out_of_range_are_named():
    model = build("llama")
    with pytest.raises(InvalidInput, match=r"positions=\[5\] is out of range: the sequence is 3 tokens long"):
        patchscope(model, "a b", "c d", 0, source_position=5)
    with pytest.raises(InvalidInput, match=r"positions=\[-9\] is out of range: the sequence is 3 tokens long"):
        patchscope(model, "a b", "c d", 0, target_position=-9)


def test_an_empty_list_of_layers_is_named():
    """layers=[] was "no layer of this model serves layer_output" (it serves it on every layer), or torch's
    "stack expects a non-empty TensorList" from the lens."""
    model = build("llama")
    with pytest.raises(InvalidInput, match=r"layers=\[\] names no layer"):
        logit_lens(model, "a b", layers=[])
    with pytest.raises(InvalidInput, match=r"layers=\[\] names no layer.*serves attention_head_outputs"):
        head_ablation_sweep(model, "a b", layers=[])
    with pytest.raises(InvalidInput, match=r"layers=\[\] names no layer.*serves layer_output"):
        activation_patching(model, "a b", "c d", layers=[])


def test_a_metric_of_another_position_under_next_token_only_is_named():
    """With the last position's logits only, logits[:, -2] was torch's IndexError from inside the trace."""
    model = build("llama")
    with pytest.raises(InvalidInput, match=r"next_token_only=True .* the metric sees \[batch, 1, vocab\]"):
        attribution_patching(model, "a b", None, lambda logits: logits[:, -2, 5], next_token_only=True)


def test_attribution_patching_under_inference_mode_is_named_and_under_no_grad_is_the_same():
    """Under torch.inference_mode() the backward has nothing to run on (it was torch's "does not require grad");
    under torch.no_grad() the tool takes its own gradients: the same estimates."""
    model = build("llama")
    with pytest.raises(GradientNotAvailable, match="inference_mode"), torch.inference_mode():
        attribution_patching(model, "a b", None, METRIC)
    with torch.no_grad():
        inside = attribution_patching(model, "a b", None, METRIC)
    assert torch.equal(inside.heads, attribution_patching(model, "a b", None, METRIC).heads)


def test_a_metric_for_one_prompt_keeps_a_scalar_and_refuses_a_dropped_batch_axis():
    """For one prompt (a string) the sweeps drop the metric's batch axis by taking [0]: a scalar metric was torch's
    "invalid index of a 0-dim tensor" after the whole sweep, and a metric that dropped the batch axis itself
    (logits[0, -1], [vocab]) was silently cut to the logit of token 0."""
    model = build("llama")
    scalar = lambda logits: (logits[:, -1, 5] - logits[:, -1, 7]).sum()  # noqa: E731
    alone = activation_patching(model, "a b", "c d", layers=[0], metric=scalar)
    listed = activation_patching(model, ["a b"], ["c d"], layers=[0], metric=scalar)
    assert torch.equal(alone, listed)
    swept = head_ablation_sweep(model, "a b", layers=[0], metric=lambda logits: logits[:, 5].sum())
    torch.testing.assert_close(swept, head_ablation_sweep(model, "a b", layers=[0], metric=lambda logits: logits[:, 5]))
    assert run_metric(model, "a b", scalar).shape == ()
    with pytest.raises(InvalidInput, match=r"the metric returned \(300,\) for one prompt: keep the batch axis"):
        activation_patching(model, "a b", "c d", layers=[0], metric=lambda logits: logits[0, -1])
    with pytest.raises(InvalidInput, match=r"the metric returned \(300,\) for one prompt"):
        head_ablation_sweep(model, "a b", layers=[0], metric=lambda logits: logits[0])


def test_attribution_patching_takes_a_metric_of_batch_by_one():
    """logits[:, -1, [5]] is [batch, 1]: one number per prompt, the same estimate as logits[:, -1, 5]."""
    model = build("llama")
    kept = attribution_patching(model, ["a b", "c d"], None, lambda logits: logits[:, -1, [5]])
    flat = attribution_patching(model, ["a b", "c d"], None, lambda logits: logits[:, -1, 5])
    assert torch.equal(kept.heads, flat.heads)
