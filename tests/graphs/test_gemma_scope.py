"""Gemma Scope's transcoders and CLTs, written in the published layout, load as circuit-tracer 0.5 reads them (its
reading reproduced here from the layout: circuit_tracer is not imported), read and write the values they were
trained on (Gemma-3's MLP input after the pre-feedforward norm, its output after the post-feedforward norm), and
every malformed file is `InvalidDictionary` naming the file and the field."""

from __future__ import annotations

import json

import huggingface_hub.constants
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from nncanon import InvalidDictionary, graphs
from nncanon.graphs.cli import transcoders_for
from nncanon.sae import Dictionary, resolve
from nncanon.testing import tiny_model

PROMPT = "The cat sat on the mat"
WIDTH = 24


@pytest.fixture(scope="module")
def gemma3():
    """The tiny Gemma-3 (text) model: Gemma Scope 2's points are its block's modules."""
    return tiny_model("gemma3_text")


def _tensors(d: int, n_out: int | None, affine: bool, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in Gemma Scope 2's names (``n_out``: a CLT layer's ``w_dec [F, n_out, d]``)."""
    g = torch.Generator().manual_seed(seed)
    w = {"w_enc": torch.randn(d, WIDTH, generator=g) / d ** 0.5, "b_enc": 0.1 * torch.randn(WIDTH, generator=g),
         "threshold": 0.3 * torch.rand(WIDTH, generator=g),
         "w_dec": 0.05 * torch.randn(WIDTH, *(() if n_out is None else (n_out,)), d, generator=g),
         "b_dec": 0.01 * torch.randn(d, generator=g)}
    if affine:
        w["affine_skip_connection"] = 0.02 * torch.randn(d, d, generator=g)
    return w


def _write_set(root, model, affine=False,
               points=("pre_feedforward_layernorm.output", "post_feedforward_layernorm.output"), seed=0):
    """Gemma Scope 2's ``transcoder_all/layer_<L>_width_<W>_l0_small[_affine]/{params.safetensors, config.json}``
    for each block; returns the ``{layer}`` path."""
    d = model.config.get_text_config().hidden_size
    name = "layer_{layer}_width_24_l0_small" + ("_affine" if affine else "")
    for layer in range(len(model.layers)):
        folder = root / "transcoder_all" / name.format(layer=layer)
        folder.mkdir(parents=True)
        save_file(_tensors(d, None, affine, seed + layer), str(folder / "params.safetensors"))
        config = {"hf_hook_point_in": f"model.layers.{layer}.{points[0]}",
                  "hf_hook_point_out": f"model.layers.{layer}.{points[1]}", "width": WIDTH,
                  "model_name": "google/gemma-3-tiny-pt", "architecture": "jump_relu", "l0": 7,
                  "affine_connection": affine, "type": "transcoder"}
        (folder / "config.json").write_text(json.dumps(config))
    return str(root / "transcoder_all" / name)


def _write_clt(root, model, affine=True):
    """Gemma Scope 2's ``clt/width_<W>_l0_medium[_affine]/params_layer_<i>.safetensors``."""
    d, n = model.config.get_text_config().hidden_size, len(model.layers)
    folder = root / "clt" / ("width_24_l0_medium" + ("_affine" if affine else ""))
    folder.mkdir(parents=True)
    for layer in range(n):
        save_file(_tensors(d, n, affine, 10 + layer), str(folder / f"params_layer_{layer}.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "hf_hook_point_in": "model.layers.{layer}.pre_feedforward_layernorm.output", "width": WIDTH,
        "hf_hook_point_out": "model.layers.{layer}.post_feedforward_layernorm.output", "architecture": "jump_relu",
        "affine_connection": affine, "type": "clt"}))
    return folder


def _circuit_tracer_layer(file):
    """circuit-tracer 0.5's ``load_gemma_scope_2_transcoder``, reproduced: its parameters and its features."""
    s = load_file(str(file))
    p = {"W_enc": s["w_enc"].T.contiguous(), "W_dec": s["w_dec"], "b_enc": s["b_enc"], "b_dec": s["b_dec"],
         "threshold": s["threshold"]}
    if "affine_skip_connection" in s:
        p["W_skip"] = s["affine_skip_connection"].T.contiguous()
    return p


def _circuit_tracer_features(pre, threshold):
    return pre * (pre > threshold)  # its JumpReLU


@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
def test_gemma_scope_2_transcoders_are_circuit_tracers(gemma3, tmp_path, affine):
    pattern = _write_set(tmp_path, gemma3, affine=affine)
    loaded = graphs.load_transcoders(pattern)
    x = torch.randn(5, gemma3.config.get_text_config().hidden_size, generator=torch.Generator().manual_seed(1))
    for layer, t in enumerate(loaded):
        ct = _circuit_tracer_layer(tmp_path / "transcoder_all" / pattern.format(layer=layer).split("/")[-1]
                                   / "params.safetensors")
        assert torch.equal(t.W_enc, ct["W_enc"].T) and torch.equal(t.W_dec, ct["W_dec"])
        for name in ("b_enc", "b_dec", "threshold"):
            assert torch.equal(getattr(t, name), ct[name]), name
        assert (t.W_skip is None) == (not affine) and (not affine or torch.equal(t.W_skip, ct["W_skip"]))
        assert t.cfg.architecture == ("jumprelu_skip_transcoder" if affine else "jumprelu_transcoder")
        assert (t.cfg.hook_name, t.cfg.hook_name_out) == (f"blocks.{layer}.mlp.hook_in", f"blocks.{layer}.hook_mlp_out")
        ours = t.encode(x)
        theirs = _circuit_tracer_features(F.linear(x, ct["W_enc"], ct["b_enc"]), ct["threshold"])
        assert torch.equal(ours != 0, theirs != 0) and bool((ours != 0).any())
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        recon = theirs @ ct["W_dec"] + ct["b_dec"] + (x @ ct["W_skip"].T if affine else 0)
        torch.testing.assert_close(t.decode(ours, x=x), recon, rtol=0, atol=1e-6)
    # the same files through a circuit-tracer 0.5 config listing them (its hub configs' form)
    files = [f"transcoder_all/{pattern.format(layer=i).split('/')[-1]}/params.safetensors" for i in range(2)]
    (tmp_path / "config.yaml").write_text(json.dumps({"model_kind": "transcoder_set", "feature_input_hook":
                                                      "mlp.hook_in", "feature_output_hook": "hook_mlp_out",
                                                      "transcoders": files}))
    for a, b in zip(loaded, graphs.load_transcoders(tmp_path), strict=True):
        assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


def test_gemma_scope_2_reads_and_writes_what_it_was_trained_on(gemma3, tmp_path):
    """Each feature is the transcoder of ``pre_feedforward_layernorm``'s output read by a plain PyTorch hook on the
    unwrapped model; it writes ``post_feedforward_layernorm``'s output (``mlp_output``); the graph is proved."""
    transcoders = graphs.load_transcoders(_write_set(tmp_path, gemma3, affine=True))
    graph = graphs.attribute(gemma3, PROMPT, transcoders, max_n_logits=2, max_feature_nodes=24)
    assert graph.cfg["reads"] == ["mlp_input"] * len(gemma3.layers) and len(graph.active_features)
    assert graphs.verify(gemma3, graph, transcoders, samples=3).ok
    assert all(resolve(gemma3, t.cfg.hook_name_out).value == "mlp_output" for t in transcoders)
    seen, hooks = {}, []
    for layer, block in enumerate(gemma3._module.model.layers):
        def keep(module, args, output, layer=layer):
            seen[layer] = output.detach()
        hooks.append(block.pre_feedforward_layernorm.register_forward_hook(keep))
    try:
        with torch.no_grad():
            gemma3._module(graph.input_tokens[None])
    finally:
        for hook in hooks:
            hook.remove()
    for (layer, pos, feature), value in zip(graph.active_features.tolist(), graph.activation_values, strict=True):
        torch.testing.assert_close(value, transcoders[layer].encode(seen[layer][0, pos])[feature], rtol=1e-5,
                                   atol=1e-6)
    module_output = _write_set(tmp_path / "b", gemma3, points=("pre_feedforward_layernorm.output", "mlp.output"))
    with pytest.raises(InvalidDictionary, match=r"hf_hook_point_out is 'model\.layers\.0\.mlp\.output', the MLP "
                                                 r"module's output, before the post-feedforward norm"):
        graphs.load_transcoders(module_output)
    before_norm = [Dictionary.from_tensors(t.W_enc, t.b_enc, t.W_dec, t.b_dec, architecture="jumprelu_transcoder",
                                           threshold=t.threshold, hook_name=t.cfg.hook_name,
                                           hook_name_out=t.cfg.hook_name_out.replace("hook_mlp_out", "mlp.hook_out"))
                   for t in transcoders]  # circuit-tracer's mlp.hook_out: on Gemma-3, the module's output
    with pytest.raises(InvalidDictionary, match=r"names 'blocks\.0\.mlp\.hook_out' \(layers\[0\]\.mlp_module_output\)"):
        graphs.attribute(gemma3, PROMPT, before_norm)
    stream = graphs.load_transcoders(_write_set(tmp_path / "c", gemma3, points=("input", "output")))
    assert stream[1].cfg.hook_name == "blocks.1.hook_resid_pre"
    with pytest.raises(InvalidDictionary, match=r"writes layers\.0\.mlp_output"):  # the block's output: refused
        graphs.attribute(gemma3, PROMPT, stream)


def test_gemma_scope_2_clt_is_circuit_tracers(gemma3, tmp_path):
    folder = _write_clt(tmp_path, gemma3)
    clt = graphs.load_transcoders(folder)
    raw = [load_file(str(folder / f"params_layer_{i}.safetensors")) for i in range(2)]
    stacked = {k: torch.stack([r[k] for r in raw]) for k in raw[0]}
    # circuit-tracer 0.5's load_gemma_scope_2_clt, reproduced
    assert torch.equal(clt.W_enc.transpose(-1, -2), stacked["w_enc"].transpose(-1, -2).contiguous())
    assert torch.equal(clt.threshold[:, None], stacked["threshold"].unsqueeze(1))
    assert torch.equal(clt.b_enc, stacked["b_enc"]) and torch.equal(clt.b_dec, stacked["b_dec"])
    assert all(torch.equal(clt.W_dec[i], stacked["w_dec"][i, :, i:, :]) for i in range(2))
    assert torch.equal(clt.W_skip, stacked["affine_skip_connection"])
    assert (clt.feature_input_hook, clt.feature_output_hook) == ("mlp.hook_in", "hook_mlp_out")
    config = {"model_kind": "cross_layer_transcoder", "feature_input_hook": "mlp.hook_in",
              "feature_output_hook": "hook_mlp_out",  # circuit-tracer's configs list one file more than the layers
              "transcoders": [f"clt/{folder.name}/params_layer_{i}.safetensors" for i in (0, 1, 1)]}
    (tmp_path / "clt.yaml").write_text(json.dumps(config))
    listed = graphs.load_transcoders(tmp_path / "clt.yaml")
    assert all(torch.equal(a, b) for a, b in zip(clt.tensors().values(), listed.tensors().values(), strict=True))
    graph = graphs.attribute(gemma3, PROMPT, clt, max_n_logits=2, max_feature_nodes=16)
    assert graph.cfg["cross_layer"] and graphs.verify(gemma3, graph, clt, samples=3).ok


def test_the_cli_spec_and_nncanon_folders(gemma3, tmp_path):
    """``nncanon graph --transcoders`` takes the same spec; a set saved as nncanon (SAELens) folders loads back by a
    ``{layer}`` path, the same weights and points."""
    pattern = _write_set(tmp_path, gemma3, affine=True)
    loaded = graphs.load_transcoders(pattern)
    for t in loaded:
        t.save(tmp_path / "saved" / f"layer_{t.cfg.hook_name.split('.')[1]}")
    for other in (transcoders_for(gemma3, pattern), graphs.load_transcoders(str(tmp_path / "saved" / "layer_{layer}"))):
        for a, b in zip(loaded, other, strict=True):
            assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
            assert (a.cfg.hook_name, a.cfg.hook_name_out, a.cfg.architecture) == (
                b.cfg.hook_name, b.cfg.hook_name_out, b.cfg.architecture)


def test_gemma_scope_1_npz_and_hub_cache(tmp_path, monkeypatch):
    """Gemma Scope 1's ``params.npz`` (read at ``ln2.hook_normalized``, as circuit-tracer's config for them), by a
    ``{layer}`` path and by circuit-tracer's ``hf://`` config entries found in the local Hugging Face cache."""
    snapshot = tmp_path / "hub" / "models--google--gemma-scope-2b-pt-transcoders" / "snapshots" / ("0" * 40)
    (snapshot.parents[1] / "refs").mkdir(parents=True)
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    g = torch.Generator().manual_seed(4)
    for layer in range(2):
        (snapshot / f"layer_{layer}").mkdir(parents=True)
        np.savez(snapshot / f"layer_{layer}" / "params.npz", W_enc=torch.randn(8, WIDTH, generator=g).numpy(),
                 W_dec=torch.randn(WIDTH, 8, generator=g).numpy(), b_enc=torch.randn(WIDTH, generator=g).numpy(),
                 b_dec=torch.randn(8, generator=g).numpy(), threshold=torch.rand(WIDTH, generator=g).numpy())
    by_layer = graphs.load_transcoders(str(snapshot / "layer_{layer}"))
    raw = np.load(snapshot / "layer_1" / "params.npz")  # circuit-tracer's load_gemma_scope_transcoder, reproduced
    assert torch.equal(by_layer[1].W_enc, torch.tensor(raw["W_enc"]).T.contiguous().T)
    assert torch.equal(by_layer[1].threshold, torch.tensor(raw["threshold"]))
    assert by_layer[0].cfg.hook_name == "blocks.0.ln2.hook_normalized"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    uris = [f"hf://google/gemma-scope-2b-pt-transcoders/layer_{i}/params.npz" for i in range(2)]
    (tmp_path / "config.yaml").write_text(json.dumps({"model_kind": "transcoder_set", "transcoders": uris,
                                                      "feature_input_hook": "ln2.hook_normalized",
                                                      "feature_output_hook": "hook_mlp_out"}))
    listed = graphs.load_transcoders(tmp_path / "config.yaml")
    assert all(torch.equal(a.W_enc, b.W_enc) for a, b in zip(by_layer, listed, strict=True))
    (tmp_path / "config.yaml").write_text(json.dumps({"transcoders": ["hf://google/absent/params.npz"],
                                                      "feature_input_hook": "ln2.hook_normalized",
                                                      "feature_output_hook": "hook_mlp_out"}))
    with pytest.raises(InvalidDictionary, match="not in the local Hugging Face cache"):
        graphs.load_transcoders(tmp_path / "config.yaml")


def _edit_params(folder, **changes):
    w = load_file(str(folder / "params.safetensors"))
    w.update(changes)
    save_file({k: v for k, v in w.items() if v is not None}, str(folder / "params.safetensors"))


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def _truncate(folder):
    data = (folder / "params.safetensors").read_bytes()
    (folder / "params.safetensors").write_bytes(data[: len(data) - 100])


BAD = {
    "missing-layer": (lambda f: f.rename(f.parent / f.name.replace("layer_1_", "layer_2_")),
                      r"then not for layer 1, but for layer 2 again"),
    "width": (lambda f: _edit_params(f, b_enc=torch.zeros(WIDTH + 1)), r"params\.safetensors: b_enc is \(25,\)"),
    "config-width": (lambda f: _edit_config(f, width=WIDTH * 2), r"config\.json: width is 48"),
    "nan-threshold": (lambda f: _edit_params(f, threshold=torch.full((WIDTH,), float("nan"))),
                      r"params\.safetensors: threshold holds 24 NaN"),
    "negative-threshold": (lambda f: _edit_params(f, threshold=-torch.ones(WIDTH)), r"threshold holds 24 negative"),
    "json-width": (lambda f: _edit_config(f, width="24"), r"config\.json: width is the JSON str \"24\""),
    "json-affine": (lambda f: _edit_config(f, affine_connection="false"), r"affine_connection is the JSON str"),
    "json-point": (lambda f: _edit_config(f, hf_hook_point_in=3), r"hf_hook_point_in is the JSON int"),
    "truncated": (_truncate, r"params\.safetensors cannot be read as safetensors"),
    "missing-tensor": (lambda f: _edit_params(f, threshold=None), r"it has no threshold"),
    "unknown-tensor": (lambda f: _edit_params(f, norm=torch.ones(1)), r"tensors nncanon does not read \(norm\)"),
    "sae": (lambda f: _edit_config(f, hf_hook_point_out=None), r"sparse autoencoder of model\.layers\.1"),
    "other-block": (lambda f: _edit_config(f, hf_hook_point_in="model.layers.0.pre_feedforward_layernorm.output"),
                    r"a point of block 0, but the transcoder is the set's layer 1"),
    "unmapped-point": (lambda f: _edit_config(f, hf_hook_point_in="model.layers.1.self_attn.o_proj.input"),
                       r"maps Gemma Scope 2's points"),
    "affine-disagrees": (lambda f: _edit_config(f, affine_connection=True), r"affine_connection is true but"),
    "no-config": (lambda f: (f / "config.json").unlink(), r"but no config\.json"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_gemma_scope_2_sets(gemma3, tmp_path, case):
    pattern = _write_set(tmp_path, gemma3)
    change, message = BAD[case]
    change(tmp_path / "transcoder_all" / pattern.format(layer=1).split("/")[-1])
    with pytest.raises(InvalidDictionary, match=message):
        graphs.load_transcoders(pattern)


def test_bad_gemma_scope_2_clts_and_configs(gemma3, tmp_path):
    folder = _write_clt(tmp_path, gemma3, affine=False)
    (folder / "params_layer_1.safetensors").rename(folder / "params_layer_2.safetensors")
    with pytest.raises(InvalidDictionary, match=r"not for layers \[1\]"):
        graphs.load_transcoders(folder)
    (folder / "params_layer_2.safetensors").unlink()
    (folder / "config.json").unlink()
    with pytest.raises(InvalidDictionary, match=r"has no config\.json: Gemma Scope 2's CLT files do not say"):
        graphs.load_transcoders(folder)
    (folder / "clt.yaml").write_text(json.dumps({"model_kind": "cross_layer_transcoder", "transcoders": [
        "params_layer_0.safetensors"], "feature_input_hook": "mlp.hook_in", "feature_output_hook": "hook_mlp_out"}))
    with pytest.raises(InvalidDictionary, match=r"w_dec is \(24, 2, 32\), not \(24, 1, 32\)"):
        graphs.load_transcoders(folder / "clt.yaml")
    pattern = _write_set(tmp_path / "set", gemma3)
    files = [f"{pattern.format(layer=i)}/params.safetensors" for i in range(2)]
    (tmp_path / "other.yaml").write_text(json.dumps({"feature_input_hook": "hook_resid_mid", "transcoders": files,
                                                     "feature_output_hook": "hook_mlp_out"}))
    with pytest.raises(InvalidDictionary, match="one of the two is wrong"):
        graphs.load_transcoders(tmp_path / "other.yaml")
    (tmp_path / "empty.yaml").write_text(json.dumps({"model_kind": "cross_layer_transcoder", "transcoders": []}))
    with pytest.raises(InvalidDictionary, match="lists no files"):
        graphs.load_transcoders(tmp_path / "empty.yaml")
    (tmp_path / "nothing" / "0").mkdir(parents=True)
    with pytest.raises(InvalidDictionary, match=r"holds no params\.safetensors, params\.npz or cfg\.json"):
        graphs.load_transcoders(str(tmp_path / "nothing" / "{layer}"))
    (tmp_path / "npz").mkdir()
    (tmp_path / "npz" / "0.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(InvalidDictionary, match=r"0\.npz cannot be read as an \.npz"):
        graphs.load_transcoders(str(tmp_path / "npz" / "{layer}.npz"))
