"""Feature tools, the evaluation and activation collection, against plain computations on the unwrapped model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from nncanon import InvalidCollection, InvalidInput
from nncanon.proof.checks.references import encode, hf_block
from nncanon.sae import Dictionary, attach
from nncanon.sae import collection as collection_module
from nncanon.sae.collection import collect_activations, load_activations
from nncanon.sae.evaluation import evaluate
from nncanon.sae.tools import ablate_features, feature_attribution, steer_features, top_activating_contexts
from nncanon.testing import PROMPTS, tiny_model

from . import block_output_and_gradient

LAYER = 1
TEXTS = ["The Eiffel Tower is in the city of", "Berlin is the capital of", "Madrid", "Rome lies on the river",
         "a b c d e f", "The capital of Japan is Tokyo and the capital of Kenya is"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def sae(model):
    d = model.hidden_size
    g = torch.Generator().manual_seed(0)
    return Dictionary.from_tensors(torch.randn(d, 24, generator=g) / d ** 0.5, torch.full((24,), -0.05),
                                   torch.randn(24, d, generator=g) / d ** 0.5, torch.randn(d, generator=g) * 0.01,
                                   hook_name="blocks.1.hook_resid_post")


def _block_values(model, texts):
    """Block ``LAYER``'s output for each text alone (no padding), by a plain hook on the bare model."""
    values = []
    for text in texts:
        seen: dict = {}
        handle = hf_block(model, LAYER).register_forward_hook(
            lambda m, a, out, seen=seen: seen.setdefault("x", (out[0] if isinstance(out, tuple) else out).clone()))
        try:
            with torch.no_grad():
                model._module(**encode(model, text))
        finally:
            handle.remove()
        values.append(seen["x"][0])
    return values


def test_ablate_and_steer_move_the_value_by_the_decoder_rows(model, sae):
    x = _block_values(model, PROMPTS[:1])[0][None]
    f = sae.encode(x)
    with attach(model, sae) as item, torch.no_grad(), model.trace(PROMPTS[0]):
        ablate_features(item, [1, 2], positions=-1)
        steer_features(item, 5, 0.5, positions=[0, 1])
        value = model.layers[LAYER].layer_output.save()
    expected = x.clone()
    expected[:, -1] -= f[:, -1, 1:3] @ sae.W_dec[1:3]
    expected[:, :2] += 0.5 * sae.W_dec[5]
    torch.testing.assert_close(value, expected, rtol=0, atol=1e-6)
    with attach(model, sae) as item, pytest.raises(InvalidInput, match="has 24 features"):
        with model.trace(PROMPTS[0]):
            ablate_features(item, 24)


def test_feature_attribution_is_minus_features_times_the_decoder_projected_gradient(model, sae):
    token = 7
    x, value_grad = block_output_and_gradient(model, LAYER, token)
    expected = -(sae.encode(x) * (value_grad @ sae.W_dec.T)).sum(dim=1)[0]
    with attach(model, sae) as item:
        found = feature_attribution(model, item, PROMPTS[0], lambda logits: logits[:, -1, token])
        batched = feature_attribution(model, [item], PROMPTS[:2], lambda logits: logits[:, -1, token])
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-6)
    assert batched[item.name].shape == (2, 24)
    assert all(p.grad is None for p in model._module.parameters())


def test_top_activating_contexts_are_the_largest_activations_over_the_texts(model, sae):
    encoded = [sae.encode(x) for x in _block_values(model, TEXTS)]
    counts = sum((f > 0).sum(0) for f in encoded)
    features = counts.argsort(descending=True)[:3].tolist()  # the features that fire most
    with attach(model, sae) as item:
        found = top_activating_contexts(model, item, TEXTS, features=features, k=3, batch_size=4)
    for row, feature in enumerate(features):
        every = [(float(v), t, p) for t, f in enumerate(encoded) for p, v in enumerate(f[:, feature]) if v > 0]
        best = sorted(every, reverse=True)[:3]
        got = list(zip(found.values[row].tolist(), found.text[row].tolist(), found.position[row].tolist(),
                       strict=True))[:len(best)]
        for (value, text, position), (v, t, p) in zip(best, got, strict=True):
            assert (text, position) == (t, p) and abs(value - v) < 1e-5
    assert "[[" in found.contexts(features[0])[0][1]


def test_the_evaluation_against_plain_hooked_runs(model, sae):
    texts = TEXTS[:3]
    values = _block_values(model, texts)
    flat = torch.cat(values).double()
    recon = sae(torch.cat(values)).double()
    mse = (flat - recon).pow(2).sum(-1).mean()
    variance = flat.pow(2).sum(-1).mean() - flat.mean(0).pow(2).sum()
    features = sae.encode(torch.cat(values))
    result = evaluate(model, sae, texts, batch_size=3)
    assert result.tokens == flat.shape[0]
    assert abs(result.mse - float(mse)) < 1e-4 * float(mse)
    assert abs(result.explained_variance - float(1 - mse / variance)) < 1e-5
    assert result.l0 == pytest.approx(float((features != 0).sum(-1).float().mean()))
    # the losses: each text alone through the bare model, the block's output replaced
    losses = {"clean": [], "recon": [], "zero": []}
    for text in texts:
        for key, replace in (("clean", None), ("recon", sae), ("zero", torch.zeros_like)):
            hook = None if replace is None else hf_block(model, LAYER).register_forward_hook(
                lambda m, a, out, replace=replace: (replace(out[0]), *out[1:]) if isinstance(out, tuple)
                else replace(out))
            try:
                with torch.no_grad():
                    inputs = encode(model, text)
                    logits = model._module(**inputs).logits[0, :-1]
            finally:
                if hook is not None:
                    hook.remove()
            losses[key].append(torch.nn.functional.cross_entropy(logits, inputs["input_ids"][0, 1:], reduction="none"))
    clean, with_recon, zero = (float(torch.cat(losses[k]).mean()) for k in ("clean", "recon", "zero"))
    assert result.ce_loss_clean == pytest.approx(clean, rel=1e-4)
    assert result.ce_loss_with_reconstruction == pytest.approx(with_recon, rel=1e-4)
    assert result.ce_loss_zero_ablation == pytest.approx(zero, rel=1e-4)
    assert result.ce_loss_score == pytest.approx((zero - with_recon) / (zero - clean), rel=1e-3)


def test_collection_writes_every_token_once_and_resumes_after_an_interruption(model, tmp_path, monkeypatch):
    texts = TEXTS * 3
    whole = collect_activations(model, "blocks.1.hook_resid_post", texts, tmp_path / "whole", batch_size=4,
                                shard_rows=20, progress=False)
    expected = torch.cat(_block_values(model, texts))
    assert whole.rows == expected.shape[0] == whole.manifest["rows"]
    torch.testing.assert_close(load_activations(tmp_path / "whole"), expected, rtol=1e-5, atol=1e-5)
    manifest = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    assert manifest["point"] == "layers[1].layer_output" and manifest["shape"] == [model.hidden_size]
    assert manifest["texts_done"] == len(texts) and len(manifest["shards"]) > 1
    shard = load_file(str(tmp_path / "whole" / manifest["shards"][0]["file"]))
    assert shard["text"][0] == 0 and shard["position"][0] == 0
    # interrupted after two batches (the second shard's write never happens), then resumed
    real, calls = collection_module._batch, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(collection_module, "_batch", failing)
    with pytest.raises(KeyboardInterrupt):
        collect_activations(model, "blocks.1.hook_resid_post", texts, tmp_path / "resumed", batch_size=4,
                            shard_rows=20, progress=False)
    monkeypatch.setattr(collection_module, "_batch", real)
    partial = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    assert 0 < partial["texts_done"] < len(texts)
    resumed = collect_activations(model, "blocks.1.hook_resid_post", texts, tmp_path / "resumed", batch_size=4,
                                  shard_rows=20, progress=False)
    assert resumed.rows == whole.rows
    assert torch.equal(load_activations(tmp_path / "resumed"), load_activations(tmp_path / "whole"))
    with pytest.raises(InvalidCollection, match="corpus_sha256"):
        collect_activations(model, "blocks.1.hook_resid_post", list(reversed(texts)), tmp_path / "resumed",
                            batch_size=4, shard_rows=20, progress=False)
    with pytest.raises(InvalidCollection, match="made otherwise"):
        collect_activations(model, "blocks.0.hook_resid_post", texts, tmp_path / "resumed", batch_size=4,
                            shard_rows=20, progress=False)
