"""Attribution graphs on hyper-connected models (several residual streams per position: HY-V4, DeepSeek-V4,
Qwen4-Exp): each hyper-connection's stream-computed weights (the mix a sublayer reads, each stream's weight of its
output, DeepSeek-V4's Sinkhorn mix of the streams; `nncanon.components.stream_gates`) and the final collapse's are
frozen at the clean run's values, and each transcoder writes the MLP module's output (``d`` wide), not the ``k·d``
injection into the streams (`nncanon.graphs.streams`). On each tiny registry variant the graph is one
`nncanon.graphs.verify` proves (forward, completeness, sampled removals) and `graphs.support` is ``None``; with any one
frozen weight left live the frozen model is not affine along a direction of the token nodes, and the linearity proof
declines the model ("not affine").
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from nncanon import graphs
from nncanon.components import attention_gates, stream_gates
from nncanon.graphs import replacement, streams
from nncanon.graphs.proof import prove
from nncanon.testing import tiny_model

from ..conftest import variant_params
from .test_mixers import PROMPT, _second_difference

#: Per registry variant: its blocks' hyper-connection class and the final collapse's.
KINDS = {"hy_v4": ("HYV4HyperConnection", "HYV4HyperHead"),
         "deepseek_v4": ("DeepseekV4HyperConnection", "DeepseekV4HyperHead"),
         "qwen4_exp": ("Qwen4ExpTextGatedResidual", "Qwen4ExpTextGatedResidual"),
         "qwen4_exp_text": ("Qwen4ExpTextGatedResidual", "Qwen4ExpTextGatedResidual")}


#: HY-V4's tiny model initialises its hyper-connections' logit scales at 0.01 (transformers' init), which leaves its
#: weights nearly constant over the prompt (a live one moves the second difference by 3e-6 only, under the proof's
#: 1e-4): the test runs it with them 100 times larger (about 1, a trained model's order), and puts them back.
SHARPEN = {"hy_v4": 100.0}


@contextmanager
def _sharpened(model, variant: str):
    """``model`` with its hyper-connections' logit scales multiplied by ``SHARPEN[variant]`` (1: as they are)."""
    factor = SHARPEN.get(variant, 1.0)
    scales = [p for name, p in model._module.named_parameters() if name.endswith((".scale", ".hc_scale"))]
    with torch.no_grad():
        for p in scales:
            p.mul_(factor)
    try:
        yield model
    finally:
        with torch.no_grad():
            for p in scales:
                p.div_(factor)


def _hyper_connection(model, name: str):
    """Block 0's first child of class ``name``."""
    return next(child for child in model.layers[0]._module.children() if type(child).__name__ == name)


@pytest.mark.parametrize("variant", variant_params(KINDS))
def test_graph_on_streams_is_exact(variant):
    model = tiny_model(variant)
    plan = replacement.plan_of(model)
    assert plan.writes == "mlp_module_output" and plan.collapse is not None
    for steps in plan.steps:  # one hyper-connection first, one before the MLP's side (its norm or the input)
        mixes = [i for i, step in enumerate(steps) if step.startswith(streams.STREAMS)]
        assert len(mixes) == 2 and mixes[0] == 0
        assert steps[mixes[1] + 1] in ("mlp_norm_scale", replacement.INPUT)
    assert graphs.support(model) is None
    transcoders = graphs.random_transcoders(model, n_features=12, seed=1)
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=3, max_feature_nodes=20, batch_size=16)
    n_layers, n_pos = len(model.layers), graph.input_tokens.shape[-1]
    assert graph.adjacency_matrix.shape[0] == len(graph.selected_features) + n_layers * n_pos + n_pos + len(
        graph.logit_targets)
    check = graphs.verify(model, graph, transcoders, samples=4)
    assert check.ok, f"{variant.name}: {check}"
    assert check.forward < 1e-5


@pytest.mark.parametrize("variant", variant_params(KINDS))
def test_every_frozen_weight_is_needed(variant, monkeypatch):
    """Frozen, the model is affine along a direction of the token nodes (second difference ~1e-7); with any one of a
    block's hyper-connection weights, the final collapse's, or (DeepSeek-V4) its attention's value-path gates left
    live it is not; with the blocks' post weights left live the linearity proof declines the model."""
    with _sharpened(tiny_model(variant), variant.name) as model:
        _every_frozen_weight_is_needed(model, variant, monkeypatch)


def _every_frozen_weight_is_needed(model, variant, monkeypatch) -> None:
    assert _second_difference(model) < 1e-5
    block, _ = KINDS[variant.name]
    original = stream_gates.STREAM_GATES[block]
    for left in stream_gates.gates_of(_hyper_connection(model, block)):
        monkeypatch.setitem(stream_gates.STREAM_GATES, block, lambda module, left=left: tuple(
            gate for gate in (original(module) if callable(original) else original) if gate != left))
        assert _second_difference(model) > 1e-4, f"{block}: {left} left live"
    monkeypatch.setitem(stream_gates.STREAM_GATES, block, original)
    with monkeypatch.context() as patch:
        patch.setattr(replacement.streams, "collapse", lambda model: None)
        assert _second_difference(model) > 1e-4, "the final collapse left live"
    if variant.name == "deepseek_v4":
        attention = model.layers[1].self_attn._module
        entry = attention_gates.ATTENTION_GATES["DeepseekV4Attention"]
        for left in attention_gates.gates_of(attention):
            monkeypatch.setitem(attention_gates.ATTENTION_GATES, "DeepseekV4Attention", (
                lambda module, left=left: tuple(gate for gate in entry[0](module) if gate != left), "before"))
            assert _second_difference(model) > 1e-4, f"DeepseekV4Attention: {left} left live"
        monkeypatch.setitem(attention_gates.ATTENTION_GATES, "DeepseekV4Attention", entry)
    last = stream_gates.gates_of(_hyper_connection(model, block))[-1]  # (post, or Qwen4-Exp's injection weights)
    monkeypatch.setitem(stream_gates.STREAM_GATES, block, lambda module: tuple(
        gate for gate in (original(module) if callable(original) else original) if gate != last))
    reason = prove(model)
    assert reason is not None and "not affine" in reason


@pytest.mark.parametrize("variant", variant_params(["deepseek_v4"]))
def test_a_prompt_shorter_than_a_compressed_window(variant):
    """DeepSeek-V4's compressors form a window from ``compress_rate`` positions (2 and 4 on the tiny model): on a
    3-token prompt the heavily compressed block compresses nothing, its compressor's gates are not frozen (their
    calls do not run: `nncanon.components.mixer_gates.Gate.runs_from`), and the graph is exact."""
    model = tiny_model(variant)
    assert max(model.config.compress_rates.values()) > 3
    transcoders = graphs.random_transcoders(model, n_features=12, seed=1)
    graph = graphs.attribute(model, [5, 7, 9], transcoders, max_n_logits=3, batch_size=16)
    check = graphs.verify(model, graph, transcoders, samples=2)
    assert check.ok, str(check)
