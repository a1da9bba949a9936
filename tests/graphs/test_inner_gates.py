"""Attribution graphs through the nonlinearities a block or head keeps besides its norms' scales, patterns and
mixers' gates, each frozen at the clean run's values: a clamp of the attention's projections as its bounds (OLMo's
``clip_qkv``: `nncanon.components.attention_gates`), a mixture of attention experts' routing (JetMoE's router logits),
a gated norm's scale and gate (AXK2: `nncanon.components.norm_gates`) and a prediction head's norm and activation
(ModernBERT-decoder: `nncanon.graphs.head`), a final norm whose scale is not served, frozen at the head's input
(nanochat's, run on the embeddings too), and a pattern the surface does not serve (DiffLlama's two kernel calls,
frozen through their query and key inputs, with its per-head group norm's scale), an attention sink's scale after the
kernel (GraniteMoE-SWA), a rounding with a straight-through gradient (Kolibri-1.1's NVFP4 values) and a post-LN
block's norm on its own sum (OpenAI GPT's ``ln_2``: `nncanon.components.norm_gates.BLOCK_GATES`) and Gemma-4's
per-layer-input branch (its per-layer input frozen at the block's entry; its GELU's slope and its norm's scale last),
and Zamba2's hybrid block's norms, none on the stream alone (its shared transformer's on ``cat[x, embeddings]`` at
its entry and on the attention's output before the transcoder's input, its Mamba block's before the mixer), and
post-LN OPT's two norms on its sums (the attention's before its inline MLP, the MLP's last), and LongCat-Flash's block
after its shortcut MoE (its second attention's query and key at the kernel and latent norm, its second norms' scales;
its dense MLPs' outputs are leaves folded into the block's error node: `tests/graphs/test_frozen_sublayers.py`).
On each tiny registry variant the graph is one `nncanon.graphs.verify`
proves (forward, completeness, sampled removals) and `graphs.support` is ``None``; with the value left live the
frozen model is not affine along a direction of the token nodes and the linearity proof declines the model.
"""

from __future__ import annotations

import pytest
import torch

from nncanon.components import attention_gates, norm_gates
from nncanon.graphs import replacement
from nncanon.graphs.proof import prove
from nncanon.testing import tiny_model

from ..conftest import variant_params
from .conftest import assert_exact_graph
from .test_mixers import PROMPT, _second_difference

#: Per registry variant: the table its frozen value is named in, and the class that names it.
KINDS = {"olmo_clipqkv": (attention_gates.ATTENTION_GATES, "OlmoAttention"),
         "jetmoe": (attention_gates.ATTENTION_GATES, "JetMoeAttention"),
         "axk2": (norm_gates.NORM_GATES, "AXK2GatedRMSNorm"),
         "modernbert_decoder": (None, "ModernBertDecoderPredictionHead"),
         "diffllama": (attention_gates.ATTENTION_GATES, "DiffLlamaAttention"),
         "nanochat": (None, "NanoChatRMSNorm"),
         "granitemoe_swa": (attention_gates.ATTENTION_GATES, "GraniteMoeSWAAttention"),
         "kolibri1_1": (attention_gates.ATTENTION_GATES, "Kolibri1_1Attention"),
         "openai_gpt": (norm_gates.BLOCK_GATES, "Block"),
         "gemma4_text_ple": (norm_gates.BLOCK_GATES, "Gemma4TextDecoderLayer"),
         "zamba2": (norm_gates.BLOCK_GATES, "Zamba2HybridLayer"),
         "opt_postln_proj": (norm_gates.BLOCK_GATES, "OPTDecoderLayer"),
         "longcat_flash": (norm_gates.BLOCK_GATES, "LongcatFlashDecoderLayer")}
#: What is left live where not the whole entry (DiffLlama's pattern, or its group norm; without the entry its
#: structure is declined: its pattern is not served).
LIVE = {"diffllama": {"pattern": lambda entry: (entry[0][2:], entry[1]),
                      "group norm": lambda entry: (entry[0][:2], entry[1])},
        "gemma4_text_ple": {place: (lambda entry, place=place: lambda block: {
            at: gates for at, gates in entry(block).items() if at != place}) for place in ("first", "last")},
        # (Zamba2's hybrid block: its shared transformer's two norms, its Mamba block's; Zamba's are the same table's)
        "zamba2": {place: (lambda entry, place=place: {at: gates for at, gates in entry.items() if at != place})
                   for place in ("first", "mlp", "mixer")},
        "opt_postln_proj": {place: (lambda entry, place=place: lambda block: {
            at: gates for at, gates in entry(block).items() if at != place}) for place in ("mlp", "last")},
        # (LongCat-Flash's second half: each kind of its frozen values left live alone)
        "longcat_flash": {part: (lambda entry, live=live: {"last": tuple(
            gate for gate in entry["last"] if not live(gate))}) for part, live in (
            ("second attention", lambda gate: (gate.module or "").startswith("self_attn.1")),
            ("second norms", lambda gate: gate.part == "scale"))}}


@pytest.mark.parametrize("variant", variant_params(KINDS))
def test_graph_through_frozen_values_is_exact(variant):
    model = tiny_model(variant)
    plan = replacement.plan_of(model)
    if variant.name == "axk2":  # the input norm's step first, the MLP's gated norm's before the transcoder's input
        steps = plan.steps[1]
        assert steps[0] == replacement.NORM_GATES + "input_layernorm"
        assert steps[steps.index(replacement.INPUT) - 1] == replacement.NORM_GATES + "post_attention_layernorm"
    if variant.name == "zamba2":  # (each hybrid block's norms: at its entry, before the MLP, before the mixer)
        owners = [step for step in plan.steps[1] if step.startswith(replacement.NORM_GATES)]
        assert owners == [replacement.NORM_GATES + owner for owner in ("<block entry>", "<block mlp>", "<block mixer>")]
    if variant.name == "openai_gpt":  # (the norm on the block's sum: its last step)
        assert all(steps[-1] == replacement.NORM_GATES + "<block>" for steps in plan.steps)
    if variant.name in ("modernbert_decoder", "nanochat"):
        kinds = {"modernbert_decoder": ["activation", "norm"], "nanochat": ["final"]}[variant.name]
        assert [kind for _, _, kind in plan.head_stages] == kinds
    assert_exact_graph(model, variant.name)


def test_the_clamp_bites_on_the_prompt():
    """The tiny OLMo's clamp clips some projections on the test prompt (so its frozen bounds are what is tested), and
    the bounds read are its clipped values there and infinite elsewhere."""
    model = tiny_model("olmo_clipqkv")
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    clean = replacement.clean_run(model, ids, replacement.plan_of(model))
    (low, high), *_ = (values for key, values in clean.frozen[0][replacement.ATTENTION].items())
    clipped = torch.isfinite(low)
    assert 0 < clipped.sum() < clipped.numel()
    assert torch.equal(low[clipped], high[clipped]) and low[clipped].abs().eq(model.config.clip_qkv).all()
    assert torch.isinf(high[~clipped]).all() and (high[~clipped] > 0).all()


CASES = [(variant, part) for variant in KINDS for part in LIVE.get(variant, {"all": None})]


@pytest.mark.parametrize(("variant", "part"), [pytest.param(param.values[0], part, id=f"{name}-{part}",
                                                            marks=param.marks)
                                               for name, part in CASES for param in variant_params([name])])
def test_a_live_value_is_caught(variant, part, monkeypatch):
    """Frozen, the model is affine along a direction of the token nodes (second difference ~1e-7); with the value
    left live it is not, and the linearity proof declines the model ("not affine")."""
    table, name = KINDS[variant.name]
    model = tiny_model(variant)
    assert _second_difference(model) < 1e-5
    if table is None:
        monkeypatch.setattr(replacement.before_head, "stages", lambda model: [])
    elif part in LIVE.get(variant.name, {}):
        monkeypatch.setitem(table, name, LIVE[variant.name][part](table[name]))
    else:
        monkeypatch.delitem(table, name)
    live = _second_difference(model)
    assert live > 1e-4, f"{name} ({part}): left live it moves the second difference only to {live:.1e}"
    reason = prove(model)
    assert reason is not None and "not affine" in reason
