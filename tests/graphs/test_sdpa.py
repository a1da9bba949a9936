"""Attribution graphs under ``attn_implementation="sdpa"``: the pattern frozen through the kernel's query and key.

- On a sample of families (dense, GPT-2, a mixture of experts, ALiBi in the mask, a sliding window's mask, query and
  key norms), the graph of a model loaded under sdpa is the graph of the same weights
  loaded eager (same nodes, adjacency within 1e-5), and it passes `nncanon.graphs.verify` (affine in the sources,
  each edge its source's removal) under sdpa;
- the frozen forward under sdpa keeps no ``[n, n]`` tensor for the backward (eager keeps the patterns), and the
  memory estimate per batch row is linear in the positions but for the masks' ``2 · n²`` bytes;
- families whose pattern cannot be frozen through the kernel's inputs are declined with the reason (by structure,
  or by the proof's pattern check: Inkling's bias made from the stream).
"""

from __future__ import annotations

import pytest
import torch

from nncanon import ValueNotAvailable, graphs
from nncanon.graphs.attribution import build
from nncanon.graphs.memory import per_row_bytes
from nncanon.graphs.replacement import clean_run, frozen_run, plan_of
from nncanon.support import graph_reason
from nncanon.testing import tiny_model

from ..conftest import upstream_issue, variant_params

PROMPT = "The cat sat on the mat"
#: Each a kind of attention transformers runs under sdpa: dense with GQA, GPT-2, a MoE, ALiBi folded into the mask
#: (Falcon-RW), a sliding window (a boolean mask materialised), query/key norms (Qwen3: frozen after them). (The
#: families with attention sinks, gpt-oss, MiMo-V2, HY-V4, Granite's window, and Gemma-2's soft-cap, BLOOM's ALiBi:
#: transformers refuses sdpa for them.) DiffLlama: two kernel calls, both frozen through their query and key inputs
#: (`nncanon.components.attention_gates`), under either implementation.
SAMPLE = ("llama", "gpt2", "mixtral", "falcon_rw_style", "mistral", "qwen3", "diffllama")


@pytest.mark.parametrize("variant", variant_params(SAMPLE))
def test_sdpa_graph_is_the_eager_graph(variant):
    built = {}
    for implementation in ("eager", "sdpa"):
        model = tiny_model(variant, attn_implementation=implementation)
        assert model.config._attn_implementation == implementation
        transcoders = graphs.random_transcoders(model, n_features=12, seed=1)
        options = {"max_n_logits": 3, "max_feature_nodes": 20, "batch_size": 16}
        if implementation == "eager":  # (eager's proof: tests/graphs/test_families.py)
            built[implementation] = build(model, PROMPT, transcoders, **options)
            continue
        if upstream_issue(variant):  # (Falcon's ALiBi before transformers 5.25: eager and sdpa attend differently)
            assert "probabilities are not served under 'sdpa'" in (graphs.support(model) or "")
            return
        assert graphs.support(model) is None, f"{variant.name} under {implementation}: {graphs.support(model)}"
        built[implementation] = graph = graphs.attribute(model, PROMPT, transcoders, **options)
    check = graphs.verify(model, graph, transcoders, samples=3)  # (the sdpa model's graph)
    assert check.ok, f"{variant.name} under sdpa: {check}"
    eager, sdpa = built["eager"], built["sdpa"]
    assert torch.equal(eager.active_features, sdpa.active_features)
    assert torch.equal(eager.selected_features, sdpa.selected_features)
    assert torch.equal(eager.logit_targets, sdpa.logit_targets)
    torch.testing.assert_close(sdpa.adjacency_matrix, eager.adjacency_matrix, rtol=0, atol=1e-5)
    assert eager.adjacency_matrix.abs().max() > 1e-2  # (not an empty graph)


def _saved_square(model, n_tokens: int) -> list[tuple[int, ...]]:
    """The shapes of the tensors the frozen forward of ``n_tokens`` positions saves for its backward that end in
    ``[n, n]`` (a pattern)."""
    ids = torch.arange(3, 3 + n_tokens)[None]
    plan = plan_of(model)
    clean = clean_run(model, ids, plan)
    leaf = clean.embeddings[None].clone().requires_grad_()
    outputs = [x[None].clone().requires_grad_() for x in clean.outputs]
    square: list[tuple[int, ...]] = []

    def pack(tensor):
        if tensor.dim() >= 2 and tensor.shape[-1] == tensor.shape[-2] == n_tokens:
            square.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _, head = frozen_run(model, ids, plan, clean, leaf, outputs)
    head[0, -1, 0].backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0
    return square


def test_sdpa_forward_keeps_no_pattern():
    """Under eager the backward keeps every layer's pattern (``[1, H, n, n]``); under sdpa nothing ``[n, n]``."""
    n_tokens = 37
    assert _saved_square(tiny_model("llama", attn_implementation="eager"), n_tokens)
    assert _saved_square(tiny_model("llama", attn_implementation="sdpa"), n_tokens) == []


def test_estimate_linear_under_sdpa():
    sdpa, eager = tiny_model("llama", attn_implementation="sdpa"), tiny_model("llama")
    for n in (16, 64, 256):
        masks = 2 * n * n  # (booleans: a sliding window's or padding's mask, counted always)
        assert per_row_bytes(sdpa, 2 * n) - 4 * masks == 2 * (per_row_bytes(sdpa, n) - masks)
        assert per_row_bytes(sdpa, n) < per_row_bytes(eager, n)


def test_pattern_made_from_the_stream_declined():
    """Inkling adds relative-position logits projected from the block's input to the scores: with the kernel's
    query and key frozen the pattern still moves with the stream, so the proof declines it under sdpa, with the
    numbers (the verify check alone misses it by little: completeness 1.1e-4 against 1e-4 on the tiny model)."""
    model = tiny_model("inkling_text_swa_heads", attn_implementation="sdpa")
    reason = graphs.support(model)
    assert reason is not None and "attention pattern moved by" in reason and 'attn_implementation="eager"' in reason
    moved = float(reason.split("moved by ")[1].split()[0])
    assert moved > 1e-4


def test_declined_with_the_reason():
    """An implementation other than eager and sdpa: its pattern is not proved a function of the kernel's query and
    key; a block whose attention serves no probabilities under sdpa (and whose pattern no frozen value of
    `nncanon.components.attention_gates` freezes): declined naming it."""
    llama = tiny_model("llama", attn_implementation="sdpa")
    report = llama.support()
    report.layers[0].reasons["attention_probabilities"] = "(a reason)"
    reason = graph_reason(report, "sdpa")
    assert reason == ("layers[0]'s attention probabilities are not served under 'sdpa', so its kernel's pattern is "
                      "not proved a function of its query and key: (a reason)")
    with pytest.raises(ValueNotAvailable, match=r"no attribution graph on this mamba model: no block has an MLP"):
        graphs.attribute(tiny_model("mamba"), PROMPT, graphs.random_transcoders(llama))
    llama = tiny_model("llama", attn_implementation="sdpa")
    other = graph_reason(llama.support(), "flex_attention")
    assert other is not None and "'flex_attention'" in other and 'attn_implementation="eager" or "sdpa"' in other
