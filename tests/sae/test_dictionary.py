"""A dictionary's math against plain formulas, SAELens folders (both layouts) and what a folder can get wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from nncanon import InvalidDictionary
from nncanon.sae import ARCHITECTURES, Dictionary, read_config

D_IN, D_SAE = 12, 20


def _weights(seed: int = 0, d_out: int = D_IN) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"W_enc": torch.randn(D_IN, D_SAE, generator=g), "b_enc": torch.randn(D_SAE, generator=g) * 0.3,
            "W_dec": torch.randn(D_SAE, d_out, generator=g), "b_dec": torch.randn(d_out, generator=g) * 0.3}


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 5, D_IN, generator=torch.Generator().manual_seed(seed)) * 2


def _folder(tmp_path, cfg: dict, weights: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "sae_weights.safetensors")
    return tmp_path


def test_relu_with_b_dec_on_input_is_the_plain_formula():
    w = _weights()
    d = Dictionary.from_tensors(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], apply_b_dec_to_input=True)
    x = _x()
    expected = torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    assert torch.equal(d.encode(x), expected)
    torch.testing.assert_close(d.decode(expected), expected @ w["W_dec"] + w["b_dec"])


def test_topk_keeps_the_k_largest_pre_activations_after_relu():
    w = _weights()
    d = Dictionary.from_tensors(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], architecture="topk", k=3)
    x = _x()
    pre = x @ w["W_enc"] + w["b_enc"]
    f = d.encode(x)
    assert ((f != 0).sum(-1) <= 3).all()
    kept = pre.sort(dim=-1, descending=True).values[..., :3].clamp(min=0)
    torch.testing.assert_close(f.sort(dim=-1, descending=True).values[..., :3], kept, rtol=0, atol=0)


def test_topk_rescaled_by_decoder_norms():
    w = _weights()
    d = Dictionary.from_tensors(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], architecture="topk", k=4,
                                rescale_acts_by_decoder_norm=True)
    x = _x()
    norms = w["W_dec"].norm(dim=-1)
    pre = (x @ w["W_enc"] + w["b_enc"]) * norms
    values, index = pre.topk(4, dim=-1)
    expected = torch.zeros_like(pre).scatter(-1, index, values.relu())
    assert torch.equal(d.encode(x), expected)
    torch.testing.assert_close(d.decode(expected), (expected / norms) @ w["W_dec"] + w["b_dec"])


def test_jumprelu_zeroes_what_is_not_above_its_threshold():
    w = _weights()
    threshold = torch.rand(D_SAE) * 2
    d = Dictionary.from_tensors(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], architecture="jumprelu",
                                threshold=threshold)
    pre = _x() @ w["W_enc"] + w["b_enc"]
    assert torch.equal(d.encode(_x()), torch.where(pre > threshold, pre.clamp(min=0), torch.zeros_like(pre)))


def test_gated_is_the_gate_times_the_magnitude():
    w = _weights()
    g = torch.Generator().manual_seed(3)
    b_gate, b_mag, r_mag = (torch.randn(D_SAE, generator=g) * 0.5 for _ in range(3))
    d = Dictionary.from_tensors(w["W_enc"], None, w["W_dec"], w["b_dec"], architecture="gated", b_gate=b_gate,
                                b_mag=b_mag, r_mag=r_mag, apply_b_dec_to_input=True)
    x = _x() - w["b_dec"]
    gate = (x @ w["W_enc"] + b_gate) > 0
    magnitude = torch.relu(x @ (w["W_enc"] * r_mag.exp()) + b_mag)
    assert torch.equal(d.encode(_x()), gate.float() * magnitude)


@pytest.mark.parametrize("mode", ["layer_norm", "constant_norm_rescale"])
def test_normalisations_are_undone_on_the_output_and_an_edit_scales_with_them(mode):
    w = _weights()
    d = Dictionary.from_tensors(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], normalize_activations=mode)
    x = _x()
    if mode == "layer_norm":
        mu = x.mean(-1, keepdim=True)
        std = (x - mu).std(-1, keepdim=True)
        normed, undo = (x - mu) / (std + 1e-5), (lambda y: y * std + mu)
    else:
        coefficient = D_IN ** 0.5 / x.norm(dim=-1, keepdim=True)
        normed, undo = x * coefficient, (lambda y: y / coefficient)
    features, state = d.encode_with_state(x)
    torch.testing.assert_close(features, torch.relu(normed @ w["W_enc"] + w["b_enc"]))
    torch.testing.assert_close(d.decode(features, state), undo(features @ w["W_dec"] + w["b_dec"]))
    change = torch.zeros_like(features)
    change[..., 4] = 1.5
    torch.testing.assert_close(d.delta(change, state), d.decode(features + change, state) - d.decode(features, state))


def test_a_skip_transcoder_adds_its_skip_connection():
    w = _weights(d_out=D_IN + 3)
    skip = torch.randn(D_IN + 3, D_IN)
    d = Dictionary.from_tensors(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], architecture="skip_transcoder",
                                W_skip=skip, hook_name="blocks.0.ln2.hook_normalized",
                                hook_name_out="blocks.0.hook_mlp_out")
    x = _x()
    f = torch.relu(x @ w["W_enc"] + w["b_enc"])
    torch.testing.assert_close(d(x), f @ w["W_dec"] + w["b_dec"] + x @ skip.T)
    assert d.cfg.transcoder and d.cfg.d_out == D_IN + 3


def test_save_and_load_round_trip(tmp_path):
    w = _weights()
    d = Dictionary.from_tensors(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], architecture="topk", k=5,
                                hook_name="blocks.1.hook_resid_post")
    loaded = Dictionary.load(d.save(tmp_path / "sae"))
    assert (loaded.cfg.architecture, loaded.cfg.k, loaded.cfg.hook_name) == ("topk", 5, "blocks.1.hook_resid_post")
    assert torch.equal(loaded.encode(_x()), d.encode(_x()))


def test_a_folder_written_before_saelens_6_loads(tmp_path):
    w = _weights()
    cfg = {"d_in": D_IN, "d_sae": D_SAE, "hook_point": "blocks.2.hook_resid_pre", "hook_point_layer": 2,
           "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 4}, "normalize_activations": False,
           "dtype": "torch.float32", "model_name": "gpt2-small", "apply_b_dec_to_input": True}
    d = Dictionary.load(_folder(tmp_path, cfg, w))
    assert (d.cfg.architecture, d.cfg.k, d.cfg.hook_name, d.cfg.normalize_activations) == (
        "topk", 4, "blocks.2.hook_resid_pre", "none")
    assert d.cfg.apply_b_dec_to_input


def test_older_jumprelu_log_threshold_and_a_batchtopk_training_checkpoint(tmp_path):
    w = _weights()
    threshold = torch.rand(D_SAE)
    cfg = {"architecture": "jumprelu", "d_in": D_IN, "d_sae": D_SAE, "metadata": {"hook_name": "blocks.0.hook_mlp_out"}}
    d = Dictionary.load(_folder(tmp_path / "a", cfg, {**w, "log_threshold": threshold.log()}))
    torch.testing.assert_close(d.threshold, threshold)
    cfg = {"architecture": "batchtopk", "d_in": D_IN, "d_sae": D_SAE, "k": 4}
    d = Dictionary.load(_folder(tmp_path / "b", cfg, {**w, "topk_threshold": torch.tensor(0.25, dtype=torch.float64)}))
    assert d.cfg.activation == "jumprelu" and torch.equal(d.threshold, torch.full((D_SAE,), 0.25))
    with pytest.raises(InvalidDictionary, match="Top-k over a whole batch is not a function of one token"):
        Dictionary.load(_folder(tmp_path / "c", cfg, w))


def test_bad_folders_are_named(tmp_path):
    w = _weights()
    cfg = {"architecture": "standard", "d_in": D_IN, "d_sae": D_SAE}
    with pytest.raises(InvalidDictionary, match="does not exist"):
        Dictionary.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidDictionary, match=r"has no cfg\.json"):
        Dictionary.load(tmp_path / "empty")
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidDictionary, match=r"has no weights: sae_weights\.safetensors is missing"):
        Dictionary.load(tmp_path / "config-only")
    folder = _folder(tmp_path / "truncated", cfg, w)
    data = (folder / "sae_weights.safetensors").read_bytes()
    (folder / "sae_weights.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidDictionary, match="truncated or not a safetensors file"):
        Dictionary.load(folder)
    with pytest.raises(InvalidDictionary, match=r"W_enc is \(12, 20\), expected \(12, 21\)"):
        Dictionary.load(_folder(tmp_path / "shapes", {**cfg, "d_sae": 21}, w))
    with pytest.raises(InvalidDictionary, match="runs standard, topk, batchtopk, jumprelu, gated"):
        Dictionary.load(_folder(tmp_path / "arch", {**cfg, "architecture": "matching_pursuit"}, w))
    with pytest.raises(InvalidDictionary, match="normalize_activations 'covariance_whitening'"):
        Dictionary.load(_folder(tmp_path / "norm", {**cfg, "normalize_activations": "covariance_whitening"}, w))
    with pytest.raises(InvalidDictionary, match="finetuning scaling_factor"):
        Dictionary.load(_folder(tmp_path / "scale", cfg, {**w, "scaling_factor": torch.full((D_SAE,), 2.0)}))
    with pytest.raises(InvalidDictionary, match="needs threshold"):
        Dictionary.from_tensors(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], architecture="jumprelu")
    assert set(ARCHITECTURES) >= {"standard", "topk", "batchtopk", "jumprelu", "gated", "transcoder"}
    assert read_config({"d_in": 4, "d_sae": 8}).architecture == "standard"


def test_expected_average_only_in_folds_a_given_factor_as_saelens_does(tmp_path):
    w = _weights()
    cfg = {"architecture": "standard", "d_in": D_IN, "d_sae": D_SAE,
           "normalize_activations": "expected_average_only_in"}
    plain = Dictionary.load(_folder(tmp_path, cfg, w))
    folded = Dictionary.load(tmp_path, norm_scaling_factor=2.0)
    x = _x()
    torch.testing.assert_close(folded.encode(x), plain.encode(x * 2.0))
    torch.testing.assert_close(folded(x), plain(x * 2.0) / 2.0)
