"""QK attributions (`nncanon.graphs.qk_attribution`): one attention score split exactly into pairs of a graph's
source nodes.

- On the tiny Llama (eager and sdpa), Gemma-2 (the score before its soft-cap), Qwen3 (query/key norms, frozen) and
  Jamba's attention block after a Mamba block, all with grouped-query attention (4 heads over 2 key/value heads):
  `nncanon.graphs.verify_qk` holds (the query and key are the sums of their rows and biases, sampled removals move them
  by their rows, the pairs and bias terms sum to the score from the surface's query and key), and the score is the one
  plain PyTorch computes from the query, key and scaling transformers' attention interface receives on the
  unwrapped model;
- the features that are not nodes are in the biases: on a graph of every feature, the same rows, and the biases
  less the unselected features' rows;
- the check can fail: with the query and key norms left live, Qwen3's attribution is declined with the numbers;
- bad input is a named error.
"""

from __future__ import annotations

import sys

import pytest
import torch

from nncanon import InvalidArgument, InvalidInput, ValueNotAvailable, graphs
from nncanon.graphs import qk as qk_module
from nncanon.testing import tiny_model

from ..conftest import variant_params

PROMPT = "The cat sat on the mat"
#: More kinds of attention, each eager with no soft-cap and no position bias, so the score is the surface's
#: ``attention_scores`` (proved at load to be what the softmax receives): GPT-2's fused projection, GPT-Neo unscaled,
#: XGLM's query scaled before the kernel, GPT-1's kernel, DeepSeek-V2's latent attention (its compressed-query and
#: KV norms frozen), OLMo-2's whole-projection query/key norms, Mistral, Phi-3, Gemma-3's per-head norms.
MORE = ("gpt2", "gpt_neo", "xglm", "openai_gpt", "deepseek_v2", "olmo2", "mistral", "phi3", "gemma3_text")
#: (variant, attn_implementation, layer): dense, sdpa, a soft-cap, query/key norms, an attention after a Mamba block.
CASES = (("llama", "eager", 1), ("llama", "sdpa", 1), ("gemma2", "eager", 1), ("qwen3", "eager", 1),
         ("qwen3", "sdpa", 0), ("jamba", "eager", 1))


def _graph(model, max_feature_nodes=10):
    transcoders = graphs.random_transcoders(model, n_features=12, seed=3)
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=2, max_feature_nodes=max_feature_nodes,
                             batch_size=16)
    return graph, transcoders


class _Capture:
    """transformers' ``ALL_ATTENTION_FUNCTIONS`` for a modeling module, recording what the attention interface
    receives at one attention module (query, key ``[b, heads, s, head_dim]``, its keywords)."""

    def __init__(self, functions, module):
        self.functions, self.module, self.seen = functions, module, {}

    def get_interface(self, implementation, default):
        real = self.functions.get_interface(implementation, default)

        def interface(module, query, key, value, mask, **kwargs):
            if module is self.module:
                self.seen.update(query=query.detach(), key=key.detach(), **kwargs)
            return real(module, query, key, value, mask, **kwargs)
        return interface


def _plain_score(model, ids, layer, head, query_position, key_position, monkeypatch):
    """The score ``q·k·scaling`` from the query, key and ``scaling`` transformers' attention interface receives
    (plain PyTorch, no nncanon: the attention's inputs taken by a forward pre-hook on the unwrapped model, its class's
    own forward run again on them with the interface recorded), and the soft-cap it is given."""
    attention = model.layers[layer].self_attn._module
    inputs = {}

    def hook(module, args, kwargs):
        inputs.update(args=args, kwargs=kwargs)
    handle = attention.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model._module(ids[None], use_cache=False)
    finally:
        handle.remove()
    modeling = sys.modules[type(attention).__module__]
    capture = _Capture(modeling.ALL_ATTENTION_FUNCTIONS, attention)
    monkeypatch.setattr(modeling, "ALL_ATTENTION_FUNCTIONS", capture)
    with torch.no_grad():
        type(attention).forward(attention, *inputs["args"], **inputs["kwargs"])
    monkeypatch.undo()
    q, k = capture.seen["query"], capture.seen["key"]
    group = head // (q.shape[1] // k.shape[1])
    score = float(q[0, head, query_position].double() @ k[0, group, key_position].double()) * capture.seen["scaling"]
    return score, capture.seen["scaling"], capture.seen.get("softcap")


@pytest.mark.parametrize(("name", "implementation", "layer"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_qk_attribution_is_exact(name, implementation, layer, monkeypatch):
    model = tiny_model(name, attn_implementation=implementation)
    graph, transcoders = _graph(model)
    head, query_position, key_position = 3, 5, 2  # (head 3 reads key/value head 1)
    qk = graphs.qk_attribution(model, graph, transcoders, layer, head, query_position, key_position)
    assert qk.check.ok and qk.check.rtol == 1e-5, qk.check
    assert len(qk.sampled) == 4 and qk.key_head == 1
    n_sources = graph.n_features + (graph.n_layers + 1) * graph.n_pos
    assert qk.query.shape == qk.key.shape == (n_sources, qk.query_bias.shape[0]) and qk.pairs.shape == (n_sources,) * 2
    score, scaling, softcap = _plain_score(model, graph.input_tokens, layer, head, query_position, key_position,
                                           monkeypatch)
    assert qk.scaling == scaling and (softcap is not None) == (name == "gemma2")
    assert abs(qk.score - score) <= 1e-5 * (abs(score) + 1e-3)
    query_cross, key_cross, biases = qk.bias_terms
    total = float(qk.pairs.double().sum() + query_cross.double().sum() + key_cross.double().sum()) + biases
    scale = float(qk.pairs.abs().sum() + query_cross.abs().sum() + key_cross.abs().sum()) + abs(biases)
    assert abs(total - score) <= 1e-5 * scale
    assert qk.query[graph.token_node(query_position)].abs().sum() > 0  # (a token reaches its own query)
    assert not qk.query[graph.token_node(query_position) + 1:].any()  # (no later token reaches it)
    if softcap is not None:  # (Gemma-2: the score the softmax receives is the soft-capped one)
        with torch.no_grad(), model.trace(graph.input_tokens[None]):
            scores = model.layers[layer].self_attn.attention_scores.save()
        capped = softcap * torch.tanh(torch.tensor(qk.score) / softcap)
        torch.testing.assert_close(scores[0, head, query_position, key_position], capped, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", variant_params(MORE))
def test_score_is_the_surface_score(variant):
    model = tiny_model(variant)
    graph, transcoders = _graph(model)
    layer, head, query_position, key_position = len(model.layers) - 1, 1, graph.n_pos - 1, graph.n_pos - 2
    qk = graphs.qk_attribution(model, graph, transcoders, layer, head, query_position, key_position)
    assert qk.check.ok, f"{variant.name}: {qk.check}"
    with torch.no_grad(), model.trace(graph.input_tokens[None]):
        scores = model.layers[layer].self_attn.attention_scores.save()
    score = float(scores[0, head, query_position, key_position])
    assert abs(qk.score - score) <= 1e-5 * (abs(score) + 1e-2), f"{variant.name}: {qk.score} against {score}"


def test_unselected_features_are_in_the_biases(model):
    layer, head, i, j = 1, 1, 4, 3
    partial, transcoders = _graph(model, max_feature_nodes=6)
    full, _ = _graph(model, max_feature_nodes=None)
    assert partial.n_features < full.n_features == len(full.active_features)
    some = graphs.qk_attribution(model, partial, transcoders, layer, head, i, j)
    every = graphs.qk_attribution(model, full, transcoders, layer, head, i, j)
    left = torch.ones(full.n_features, dtype=torch.bool)
    left[partial.selected_features] = False
    for name in ("query", "key"):
        rows, all_rows = getattr(some, name), getattr(every, name)
        torch.testing.assert_close(rows[:partial.n_features], all_rows[partial.selected_features], rtol=0, atol=1e-6)
        torch.testing.assert_close(rows[partial.n_features:], all_rows[full.n_features:], rtol=0, atol=1e-6)
        bias = getattr(every, f"{name}_bias") + all_rows[:full.n_features][left].sum(0)
        torch.testing.assert_close(getattr(some, f"{name}_bias"), bias, rtol=0, atol=1e-5)
    assert all_rows[:full.n_features][left].abs().sum() > 0  # (the unselected features move the key)


def test_live_query_norms_are_declined(monkeypatch):
    model = tiny_model("qwen3")
    graph, transcoders = _graph(model)
    monkeypatch.setattr(qk_module, "QK_NORMS", {})
    with pytest.raises(ValueNotAvailable, match=r"not affine in the graph's sources \(forward .* completeness"):
        graphs.qk_attribution(model, graph, transcoders, 1, 0, 5, 2)


def test_bad_input(model, transcoders):
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=1, max_feature_nodes=4)
    n = graph.n_pos
    for args, match in (((2, 0, 1, 0), r"layer=2: an int in \[0, 2\)"), ((1, 4, 1, 0), r"head=4: an int in \[0, 4\)"),
                        ((1, 0, n, 0), rf"query_position={n}"), ((1, 0, 1, -1), r"key_position=-1"),
                        ((True, 0, 1, 0), "layer=True"), ((1, 0, 1, 2), "after query_position=1: the causal mask")):
        with pytest.raises(InvalidArgument, match=match):
            graphs.qk_attribution(model, graph, transcoders, *args)
    other = graphs.random_transcoders(model, n_features=12, seed=4)
    with pytest.raises(InvalidInput, match="not built on this llama model with these transcoders"):
        graphs.qk_attribution(model, graph, other, 1, 0, 1, 0)
    gemma2 = tiny_model("gemma2")
    with pytest.raises(InvalidInput, match="not built on this gemma2 model"):
        graphs.qk_attribution(gemma2, graph, graphs.random_transcoders(gemma2, n_features=12, seed=3), 1, 0, 1, 0)
    jamba = tiny_model("jamba")
    jamba_graph, jamba_transcoders = _graph(jamba)
    with pytest.raises(ValueNotAvailable, match=r"layers\[0\] \(JambaMambaDecoderLayer\).*no softmax attention"):
        graphs.qk_attribution(jamba, jamba_graph, jamba_transcoders, 0, 0, 1, 0)
    mistral = tiny_model("mistral")  # (a sliding window of 4 positions)
    mistral_graph, mistral_transcoders = _graph(mistral)
    with pytest.raises(InvalidArgument, match=r"key_position=2 is masked for query_position=10 .* a sliding window"):
        graphs.qk_attribution(mistral, mistral_graph, mistral_transcoders, 1, 0, 10, 2)
    diffllama = tiny_model("diffllama")
    diff_graph, diff_transcoders = _graph(diffllama)
    with pytest.raises(ValueNotAvailable, match="query_states is not available: DiffLlama calls the attention kernel"):
        graphs.qk_attribution(diffllama, diff_graph, diff_transcoders, 1, 0, 1, 0)


def test_cross_layer_transcoders(model):
    """A CLT's feature of block 0 writes into block 1's MLP output too (after block 1's attention: not in its query),
    and a skip connection is live: exact all the same."""
    clt = graphs.random_clt(model, n_features=64, skip=True)
    graph = graphs.attribute(model, PROMPT, clt, max_n_logits=1)
    qk = graphs.qk_attribution(model, graph, clt, 1, 2, graph.n_pos - 1, 3)
    assert qk.check.ok, qk.check
    assert graph.cfg["cross_layer"] and qk.query[:graph.n_features].abs().sum() > 0
