"""Attribution graphs on registered families: built and proved exact, or declined with the reason.

For each family below (dense pre-norm, post-norms and soft-cap, query/key norms, parallel blocks, a mixture of
experts, multipliers; and families declined by structure or by the linearity proof), on its tiny model with random
transcoders:

- `nncanon.graphs.support` is ``None`` and the graph's checks hold (`nncanon.graphs.verify`: the frozen model's
  forward is the clean run's; each target is its row sum plus its bias term; removing a sampled source moves every
  target by minus its column; relative 1e-4), or it is a reason and `attribute` raises `ValueNotAvailable` with it;
- the graph has circuit-tracer's layout (node count, sorted active features, rows of errors and tokens zero, the
  logit targets the most probable tokens after the soft-cap).

It runs on every registered variant (under a second each: the proof's graph and the test's); those in `BUILT`
must build, those in `DECLINED` must be declined with that reason.
"""

from __future__ import annotations

import pytest
import torch

from nncanon import ValueNotAvailable, graphs
from nncanon.testing import tiny_model

from ..conftest import VARIANT_IDS, variant_params

#: Families that build (each kind of block once; granitemoe: an assignment to a scaled site takes the gradient).
BUILT = ("llama", "gpt2", "gemma2", "qwen3", "gpt_neox_parallel", "mixtral", "olmo2", "granite", "granitemoe", "cohere",
         "bloom", "afmoe", "biogpt", "olmo_clipqkv", "jetmoe", "axk2", "modernbert_decoder", "diffllama", "nanochat",
         "olmo_hybrid", "stablelm", "granitemoe_swa", "kolibri1_1", "hy_v4", "deepseek_v4", "qwen4_exp",
         "qwen4_exp_text", "doge", "beam", "ergo", "bloom_residual_post_ln", "gemma4_text", "gemma4_multimodal",
         "gemma4_unified", "gemma4_unified_text", "nemotron_h",
         "openai_gpt", "minimax", "gemma4_text_ple", "rwkv", "zaya", "zamba", "zamba2", "opt_postln_proj",
         "mllama", "gemma3n_text", "gemma3n_text_unshared", "longcat_flash")
#: Families declined: by structure (Mamba: no block has an MLP). (Gemma-3n's AltUp, LAuReL and per-layer-input
#: branch are frozen: tests/graphs/test_gemma3n.py; HY-V4, DeepSeek-V4 and Qwen4-Exp keep several
#: streams per position: their hyper-connections' weights are frozen and their transcoders write the MLP module's
#: output: tests/graphs/test_streams.py; Doge, Beam, Ergo, Gemma-4 and BLOOM with the residual after the norm are not
#: additive: their transcoders write the MLP module's output, and Nemotron-H's blocks without an MLP have no
#: transcoder, nor Mllama's cross-attention blocks (not run on text alone), and post-LN OPT's transcoders write its
#: inline MLP's down projection: tests/graphs/test_mlp_less.py; AFMoE's output gate is frozen;
#: BioGPT's inline MLP is read where its norm reads; the linear mixers whose gates are frozen:
#: tests/graphs/test_mixers.py; the norms inside attention whose scales are frozen, DeepSeek's compressed-KV norm,
#: BitNet's sub-norm and Gemma-4's value norm: tests/graphs/test_attention_norms.py; OLMo's clamp, JetMoE's attention
#: routing, AXK2's gated norms, ModernBERT-decoder's prediction head, OpenAI GPT's and post-LN OPT's norms on the
#: block's sums, Zamba's hybrid blocks' norms, LongCat-Flash's second attention and norms:
#: tests/graphs/test_inner_gates.py; LongCat-Flash's dense MLPs, folded into its error nodes:
#: tests/graphs/test_frozen_sublayers.py.)
DECLINED = {"mamba": "no block has an MLP for a transcoder"}


PROMPT = "The cat sat on the mat"


@pytest.mark.parametrize("variant", variant_params(VARIANT_IDS))
def test_graph_exact_or_declined(variant):
    model = tiny_model(variant)
    transcoders = graphs.random_transcoders(model, n_features=12, seed=1)
    reason = graphs.support(model)
    if variant.name in DECLINED:
        assert reason is not None and DECLINED[variant.name] in reason
    if variant.name in BUILT:
        assert reason is None, f"{variant.name}: {reason}"
    line = model.support().graphs  # support()'s line says the same
    assert line == ("yes (the frozen replacement model was proved affine in its sources on this model)"
                    if reason is None else f"no, {reason}")
    print(f"GRAPH {variant.name}: {'built' if reason is None else 'declined: ' + reason}")  # (the sweep's record)
    if reason is not None:
        assert isinstance(reason, str) and len(reason) > 20
        with pytest.raises(ValueNotAvailable, match="no attribution graph"):
            graphs.attribute(model, PROMPT, transcoders)
        return
    graph = graphs.attribute(model, PROMPT, transcoders, max_n_logits=3, max_feature_nodes=20, batch_size=16)
    check = graphs.verify(model, graph, transcoders, samples=4)
    assert check.ok, f"{variant.name}: {check}"
    _layout(model, graph)


def _layout(model, graph):
    n_layers, n_pos = len(model.layers), len(graph.input_tokens)
    assert graph.n_nodes == graph.adjacency_matrix.shape[0] == graph.adjacency_matrix.shape[1]
    assert graph.n_nodes == graph.n_features + (n_layers + 1) * n_pos + graph.n_logits
    keys = graph.active_features[:, 0] * 10**8 + graph.active_features[:, 1] * 10**4 + graph.active_features[:, 2]
    assert torch.equal(keys, keys.sort().values)
    first_error = graph.n_features
    assert not graph.adjacency_matrix[first_error:graph.logit_node(0)].any()  # errors, tokens: no inputs
    assert not graph.adjacency_matrix[:, graph.logit_node(0):].any()           # logits: no outputs
    with torch.no_grad(), model.trace(graph.input_tokens[None]):
        probs = model.next_token_probs[0].save()
    top = probs.topk(graph.n_logits)
    assert torch.equal(top.indices, graph.logit_targets)
    torch.testing.assert_close(top.values, graph.logit_probabilities)


def test_support_line():
    """``print(model.support())`` says whether graphs can be built, within 120 columns; before the proof ran, that
    the structure allows them; under sdpa too (the pattern frozen through the kernel's query and key)."""
    model = tiny_model("qwen2", attn_implementation="eager")
    text = str(model.support())
    assert "attribution graphs: " in text and all(len(line) <= 120 for line in text.splitlines())
    if graphs.support(model) is None:
        assert "attribution graphs: yes" in str(model.support())
    sdpa = tiny_model("qwen2", attn_implementation="sdpa")
    assert sdpa.support().to_dict()["graphs"].startswith(("the structure allows them", "yes"))
    fresh = tiny_model("llama", attn_implementation="eager")
    assert fresh.support().graphs.startswith(("the structure allows them", "yes"))
