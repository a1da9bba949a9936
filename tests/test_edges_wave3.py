"""The edges of wave 3 (issue 31): collections that never mix, dictionaries that never read "false" as true, and
the quantized, proof and first-hour points.

Each test asserts an exact named error and its message, or an equality between independent computations (a
collection against the rows it was collected from, a resumed collection against an uninterrupted one).
"""

from __future__ import annotations

import json
import os
import re
import socket

import pytest
import torch
from safetensors.torch import load_file

from nncanon import InvalidArgument, InvalidCollection
from nncanon import files as nncanon_files
from nncanon.sae import collection as collection_module
from nncanon.sae.collection import collect_activations, iterate_activations, load_activations
from nncanon.testing import tiny_model

HOOK = "blocks.1.hook_resid_post"
TEXTS = ["The Eiffel Tower is in the city of", "Berlin is the capital of", "Madrid", "Rome lies on the river",
         "a b c d e f", "The capital of Japan is Tokyo and the capital of Kenya is"] * 2


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _collect(model, folder, texts=TEXTS, **kwargs):
    kwargs = {"batch_size": 4, "shard_rows": 20, "progress": False, **kwargs}
    return collect_activations(model, kwargs.pop("hook", HOOK), texts, folder, **kwargs)


def _interrupted(model, folder, monkeypatch, after: int = 2, **kwargs):
    """A collection stopped (as by kill -9) when its ``after + 1``-th batch starts."""
    real, calls = collection_module._batch, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) > after:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(collection_module, "_batch", failing)
    with pytest.raises(KeyboardInterrupt):
        _collect(model, folder, **kwargs)
    monkeypatch.setattr(collection_module, "_batch", real)
    return json.loads((folder / "manifest.json").read_text())


# -- Activation collection: resume refuses anything that is not the same collection --------------------------------


def test_a_resume_with_another_checkpoint_of_the_same_type_and_width_is_refused(llama, tmp_path, monkeypatch):
    """Mixed silently before: the manifest compared ``model_type`` only."""
    partial = _interrupted(llama, tmp_path, monkeypatch)
    assert 0 < partial["texts_done"] < len(TEXTS)
    other = tiny_model("llama", seed=1)
    with pytest.raises(InvalidCollection, match=r"made otherwise .*model_sha256"):
        _collect(other, tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text()) == partial  # nothing written


@pytest.mark.parametrize("change", ["width", "dtype", "point", "max_length", "batch_size", "corpus", "model dtype"])
def test_a_resume_with_other_settings_is_refused(llama, tmp_path, monkeypatch, change):
    partial = _interrupted(llama, tmp_path, monkeypatch)
    model, kwargs = llama, {}
    if change == "width":
        model = tiny_model("llama", hidden_size=48)
    elif change == "model dtype":
        model = tiny_model("llama", dtype=torch.float64)
    elif change == "dtype":
        kwargs["dtype"] = torch.float16
    elif change == "point":
        kwargs["hook"] = "blocks.0.hook_resid_post"
    elif change == "max_length":
        kwargs["max_length"] = 5
    elif change == "batch_size":
        kwargs["batch_size"] = 3
    else:
        kwargs["texts"] = [*TEXTS[:-1], "another last text"]
    key = {"width": "model_sha256", "dtype": "dtype_requested", "point": "point", "corpus": "corpus_sha256",
           "model dtype": "model_dtype"}.get(change, change)
    with pytest.raises(InvalidCollection, match=f"made otherwise .*{key}"):
        _collect(model, tmp_path, **kwargs)
    assert json.loads((tmp_path / "manifest.json").read_text()) == partial


def test_an_interrupted_collection_resumes_to_the_rows_of_an_uninterrupted_one(llama, tmp_path, monkeypatch):
    whole = _collect(llama, tmp_path / "whole")
    _interrupted(llama, tmp_path / "resumed", monkeypatch)
    assert (tmp_path / "resumed" / ".lock").exists()  # left by the "dead" collector: it holds nothing
    resumed = _collect(llama, tmp_path / "resumed")
    assert resumed.rows == whole.rows
    assert torch.equal(load_activations(tmp_path / "resumed"), load_activations(tmp_path / "whole"))


def test_an_interruption_between_the_shard_and_the_manifest_adopts_the_whole_shard(llama, tmp_path, monkeypatch):
    """The shard is renamed into place, the process dies before the manifest names it: the resume verifies it
    against the digest the manifest recorded as pending and takes it in (no row lost, none written twice)."""
    whole = _collect(llama, tmp_path / "whole")
    real = collection_module.files.write_new
    state = {"shards": 0}

    def dying(folder, name, data):
        real(folder, name, data)
        if name.startswith("activations-"):
            state["shards"] += 1
            if state["shards"] == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(collection_module.files, "write_new", dying)
    with pytest.raises(KeyboardInterrupt):
        _collect(llama, tmp_path / "cut")
    monkeypatch.setattr(collection_module.files, "write_new", real)
    manifest = json.loads((tmp_path / "cut" / "manifest.json").read_text())
    assert len(manifest["shards"]) == 1 and manifest["pending"]["file"] == "activations-00001.safetensors"
    committed = load_activations(tmp_path / "cut")  # loading reads what the manifest names, not the pending shard
    assert committed.shape[0] == manifest["rows"] == manifest["shards"][0]["rows"]
    _collect(llama, tmp_path / "cut")
    assert torch.equal(load_activations(tmp_path / "cut"), load_activations(tmp_path / "whole"))
    assert whole.rows == json.loads((tmp_path / "cut" / "manifest.json").read_text())["rows"]


# -- two collectors on one folder ------------------------------------------------------------------------------------


def test_a_second_collector_on_the_same_folder_is_refused_with_the_holder_named(llama, tmp_path, monkeypatch):
    """Both finished before, the folder a mix of the two while the manifest described one."""
    real, seen = collection_module._batch, []

    def second_collector(*args, **kwargs):
        if not seen:
            with pytest.raises(InvalidCollection) as refused:
                _collect(llama, tmp_path)
            seen.append(str(refused.value))
        return real(*args, **kwargs)

    monkeypatch.setattr(collection_module, "_batch", second_collector)
    first = _collect(llama, tmp_path)
    monkeypatch.setattr(collection_module, "_batch", real)
    assert f"pid {os.getpid()} on {socket.gethostname()}" in seen[0] and "another collector" in seen[0]
    assert first.rows == load_activations(tmp_path).shape[0]
    _collect(llama, tmp_path)  # released at the end: the finished collection resumes (nothing left to do)


# -- manifest and shards verified on load and on resume ------------------------------------------------------------


@pytest.mark.parametrize("damage", ["missing", "cut", "edited", "reordered", "unnamed", "manifest cut",
                                    "manifest edited rows", "manifest wrong types"])
def test_a_damaged_collection_is_named_on_load_and_on_resume(llama, tmp_path, damage):
    _collect(llama, tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 3
    first, second = tmp_path / manifest["shards"][0]["file"], tmp_path / manifest["shards"][1]["file"]
    named = first.name
    if damage == "missing":
        first.unlink()
    elif damage == "cut":
        first.write_bytes(first.read_bytes()[:-7])
    elif damage == "edited":
        data = bytearray(first.read_bytes())
        data[-3] ^= 0x55  # one activation's byte
        first.write_bytes(bytes(data))
    elif damage == "reordered":
        a, b = first.read_bytes(), second.read_bytes()
        first.write_bytes(b)
        second.write_bytes(a)
    elif damage == "unnamed":
        named = "activations-00099.safetensors"
        (tmp_path / named).write_bytes(first.read_bytes())
    else:
        named = "manifest.json"
        if damage == "manifest cut":
            (tmp_path / named).write_text(json.dumps(manifest)[:-10])
        elif damage == "manifest edited rows":
            manifest["rows"] += 1
            (tmp_path / named).write_text(json.dumps(manifest))
        else:
            manifest["shards"][0]["texts"] = "0-4"
            (tmp_path / named).write_text(json.dumps(manifest))
    for attempt in (lambda: load_activations(tmp_path), lambda: list(iterate_activations(tmp_path)),
                    lambda: _collect(llama, tmp_path)):
        with pytest.raises(InvalidCollection, match=named):
            attempt()


def test_a_manifest_naming_reordered_shards_is_refused(llama, tmp_path):
    _collect(llama, tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["shards"][0], manifest["shards"][1] = manifest["shards"][1], manifest["shards"][0]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidCollection, match="reordered"):
        load_activations(tmp_path)


# -- temporary files, links, FIFOs ----------------------------------------------------------------------------------


def test_a_planted_link_at_a_shard_or_manifest_name_is_replaced_never_written_through(llama, tmp_path):
    folder, outside = tmp_path / "folder", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    for name in ("activations-00000.safetensors", "manifest.json.tmp", "manifest.json"):
        (outside / name).write_text("precious")
    os.symlink(outside / "manifest.json.tmp", folder / "manifest.json.tmp")  # the old fixed temporary name
    with pytest.raises(InvalidCollection, match=r"manifest.json is a symbolic link"):
        os.symlink(outside / "manifest.json", folder / "manifest.json")
        _collect(llama, folder)
    (folder / "manifest.json").unlink()
    with pytest.raises(InvalidCollection, match=r"activations-00000.safetensors"):  # a link: a shard not named
        os.symlink(outside / "activations-00000.safetensors", folder / "activations-00000.safetensors")
        _collect(llama, folder)
    (folder / "activations-00000.safetensors").unlink()
    _collect(llama, folder)
    assert all((outside / name).read_text() == "precious" for name in os.listdir(outside))
    assert load_file(str(folder / "activations-00000.safetensors"))["activations"].shape[0] > 0
    assert not any(name.startswith(".nncanon-tmp-") for name in os.listdir(folder))


@pytest.mark.parametrize("name", ["manifest.json", "activations-00000.safetensors", ".lock"])
def test_a_fifo_at_a_collection_name_is_refused_without_blocking(llama, tmp_path, name):
    """Hung before: reading the manifest opened the FIFO and waited for a writer."""
    os.mkfifo(tmp_path / name)
    with pytest.raises(InvalidCollection, match=re.escape(name)):
        _collect(llama, tmp_path)
    if name == "manifest.json":
        with pytest.raises(InvalidCollection, match="FIFO"):
            load_activations(tmp_path)


# -- arguments, before any work --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"texts": "a bare string corpus"}, "not one string"),
    ({"texts": []}, "non-empty list"),
    ({"texts": ["fine", ""]}, "text 1 is ''"),
    ({"texts": ["fine", 3]}, "text 1 is 3"),
    ({"max_length": 0}, "max_length=0"),
    ({"batch_size": 0}, "batch_size=0"),
    ({"batch_size": -2}, "batch_size=-2"),
    ({"shard_rows": 0}, "shard_rows=0"),
    ({"batch_size": True}, "batch_size=True"),
    ({"max_length": 2.5}, "max_length=2.5"),
    ({"dtype": torch.int8}, "floating torch dtype"),
    ({"hook": "blocks.1.attn.hook_pattern"}, "not a value per token"),
])
def test_bad_arguments_are_invalid_argument_before_any_work(llama, tmp_path, monkeypatch, kwargs, message):
    def never(*args, **kw):
        raise AssertionError("a batch ran")

    monkeypatch.setattr(collection_module, "_batch", never)
    folder = tmp_path / "never"
    with pytest.raises(InvalidArgument, match=message):
        _collect(llama, folder, **kwargs)
    assert not folder.exists()


# -- damaged, missing or unwritable folders ------------------------------------------------------------------------


def test_missing_unreadable_and_unwritable_folders_are_invalid_collection(llama, tmp_path, monkeypatch):
    with pytest.raises(InvalidCollection, match=r"nowhere.*does not exist"):
        load_activations(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidCollection, match=r"manifest.json is missing"):
        load_activations(tmp_path / "empty")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(InvalidCollection, match="a-file is not a folder"):
        _collect(llama, tmp_path / "a-file")
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as patch:  # a disk that refuses the shard (root writes into a read-only folder)
        patch.setattr(nncanon_files.tempfile, "mkstemp", refused)
        with pytest.raises(InvalidCollection, match=r"denied.*not writable.*Permission denied"):
            _collect(llama, tmp_path / "denied")
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder: the chmod case needs another user (the refusal above ran)")
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(InvalidCollection, match=r"read-only.*Permission denied"):
            _collect(llama, locked)
        with pytest.raises(InvalidCollection, match=r"read-only.*Permission denied"):
            _collect(llama, locked / "below")
    finally:
        locked.chmod(0o700)


# -- Dictionaries: cfg.json with types -------------------------------------------------------------------------------

D_IN, D_SAE = 12, 20


def _dictionary_folder(path, cfg_text: str | bytes | None = None, weights: dict | None = None, **cfg):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    if weights is None:
        weights = {"W_enc": torch.randn(D_IN, D_SAE, generator=g), "b_enc": torch.zeros(D_SAE),
                   "W_dec": torch.randn(D_SAE, D_IN, generator=g), "b_dec": torch.randn(D_IN, generator=g)}
    if cfg_text is None:
        cfg_text = json.dumps({"architecture": "standard", "d_in": D_IN, "d_sae": D_SAE, "dtype": "float32",
                               "metadata": {"hook_name": "blocks.1.hook_resid_post"}, **cfg})
    (path / "cfg.json").write_bytes(cfg_text if isinstance(cfg_text, bytes) else cfg_text.encode())
    save_file(weights, str(path / "sae_weights.safetensors"))
    return path


@pytest.mark.parametrize(("cfg", "key"), [
    ({"apply_b_dec_to_input": "false"}, r"apply_b_dec_to_input is \"false\" .*true or false \(JSON false"),
    ({"architecture": "topk", "k": 3, "rescale_acts_by_decoder_norm": "false"}, "rescale_acts_by_decoder_norm"),
    ({"apply_b_dec_to_input": 0}, "apply_b_dec_to_input is 0"),
    ({"d_sae": "20"}, r"d_sae is \"20\" .*positive integer"),
    ({"d_in": 12.0}, "d_in is 12.0"),
    ({"d_in": True}, "d_in is true"),
    ({"d_sae": -20}, "d_sae is -20"),
    ({"architecture": ["standard"]}, "architecture is"),
    ({"metadata": {"hook_name": 3}}, "metadata.hook_name is 3"),
    ({"metadata": {"hook_head_index": "1"}}, "metadata.hook_head_index"),
    ({"metadata": "blocks.1"}, "metadata is"),
    ({"architecture": "topk", "k": "3"}, "k is"),
    ({"activation_fn_kwargs": {"k": 0}}, "activation_fn_kwargs.k is 0"),
])
def test_a_cfg_field_of_the_wrong_json_type_is_named(tmp_path, cfg, key):
    """``"false"`` read as True before (``bool("false")``): a dictionary that subtracted b_dec it should not."""
    from nncanon import InvalidDictionary
    from nncanon.sae import Dictionary

    with pytest.raises(InvalidDictionary, match=key):
        Dictionary.load(_dictionary_folder(tmp_path, **cfg))


@pytest.mark.parametrize(("text", "message"), [
    (b'{"d_in": 12, "architecture": "standard\xff"}', "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nests 100000 levels"),
    (b'["a list"]', "not an object"),
    (b'{"d_in": 12,', "not valid JSON"),
])
def test_a_cfg_that_is_not_utf8_json_or_is_nested_deep_is_named(tmp_path, text, message):
    from nncanon import InvalidDictionary
    from nncanon.sae import Dictionary

    with pytest.raises(InvalidDictionary, match=message):
        Dictionary.load(_dictionary_folder(tmp_path, cfg_text=text))


def test_the_weights_shapes_are_checked_against_the_header_before_any_allocation(tmp_path, monkeypatch):
    """A config of d_sae 2**40 over small weights allocated zeros for a missing bias first (8 GB to 4 TB)."""
    from nncanon import InvalidDictionary
    from nncanon.sae import Dictionary
    from nncanon.sae import dictionary as dictionary_module

    g = torch.Generator().manual_seed(0)
    folder = _dictionary_folder(tmp_path, weights={"W_enc": torch.randn(D_IN, D_SAE, generator=g),
                                                  "W_dec": torch.randn(D_SAE, D_IN, generator=g)}, d_sae=2 ** 40)

    def never(*args, **kwargs):
        raise AssertionError("a tensor was read or made before the shapes were checked")

    monkeypatch.setattr(dictionary_module, "load_file", never)
    monkeypatch.setattr(dictionary_module, "partial_zeros", never)
    with pytest.raises(InvalidDictionary, match=r"W_enc is \(12, 20\), expected \(12, 1099511627776\)"):
        Dictionary.load(folder)
    with pytest.raises(InvalidDictionary, match=r"W_enc is \(12, 20\), expected \(12, 1099511627776\)"):
        from nncanon.sae.config import read_config
        Dictionary(read_config({"d_in": D_IN, "d_sae": 2 ** 40}), torch.randn(D_IN, D_SAE), torch.randn(D_SAE, D_IN))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("weight", ["W_enc", "b_dec"])
def test_non_finite_weights_are_refused_at_load(tmp_path, bad, weight):
    from nncanon import InvalidDictionary
    from nncanon.sae import Dictionary

    folder = _dictionary_folder(tmp_path)
    weights = load_file(str(folder / "sae_weights.safetensors"))
    weights[weight].view(-1)[3] = bad
    _dictionary_folder(tmp_path, weights=weights)
    with pytest.raises(InvalidDictionary, match=f"{weight} holds 1 non-finite value"):
        Dictionary.load(folder)


@pytest.mark.parametrize("factor", [0, -1.5, float("nan"), float("inf"), "2", True])
def test_a_norm_scaling_factor_that_is_not_above_zero_is_refused(tmp_path, factor):
    from nncanon import InvalidDictionary
    from nncanon.sae import Dictionary

    folder = _dictionary_folder(tmp_path, normalize_activations="expected_average_only_in")
    with pytest.raises(InvalidDictionary, match=r"norm_scaling_factor=.*finite number above 0"):
        Dictionary.load(folder, norm_scaling_factor=factor)
    assert Dictionary.load(folder, norm_scaling_factor=2.0).cfg.normalize_activations == "none"


@pytest.mark.parametrize(("device", "message"), [("bogus", "is not a device"), ("cuda:99", "CUDA device")])
def test_a_bad_device_is_named(tmp_path, device, message):
    from nncanon import InvalidDictionary
    from nncanon.sae import Dictionary

    folder = _dictionary_folder(tmp_path)
    with pytest.raises(InvalidDictionary, match=message):
        Dictionary.load(folder, device=device)
    with pytest.raises(InvalidDictionary, match=message):
        Dictionary.load(folder).to(device)


# -- Dictionaries in a trace -----------------------------------------------------------------------------------------


def _sae(model, hook: str = HOOK, seed: int = 0, features: int = 16, **kw):
    from nncanon.sae import Dictionary

    d = model.hidden_size
    g = torch.Generator().manual_seed(seed)
    return Dictionary.from_tensors(torch.randn(d, features, generator=g) / d ** 0.5, torch.full((features,), 0.05),
                                   torch.randn(features, d, generator=g) / d ** 0.5, torch.zeros(d), hook_name=hook,
                                   **kw)


def _logits(model, prompt=TEXTS[0]):
    with torch.no_grad(), model.trace(prompt):
        logits = model.logits.save()
    return logits


@pytest.mark.parametrize("use", ["features", "reconstruction", "error", "input", "write", "steer", "attribution",
                                 "contexts", "evaluate"])
def test_a_detached_dictionarys_items_raise_on_use(llama, use):
    """Served the features of a dictionary no longer on the model before, silently."""
    from nncanon import DictionaryDetached
    from nncanon.sae import attach
    from nncanon.sae.evaluation import evaluate
    from nncanon.sae.tools import feature_attribution, steer_features, top_activating_contexts

    item = attach(llama, _sae(llama))
    item.detach()
    clean = _logits(llama)
    with pytest.raises(DictionaryDetached, match=r"used after detach\(\)"):
        if use == "attribution":
            feature_attribution(llama, item, TEXTS[0], lambda logits: logits[:, -1, 0])
        elif use == "contexts":
            top_activating_contexts(llama, item, TEXTS[:2], k=2)
        elif use == "evaluate":
            evaluate(llama, item, TEXTS[:2])
        else:
            with torch.no_grad(), llama.trace(TEXTS[0]):
                if use == "write":
                    item.features = torch.zeros(1)
                elif use == "steer":
                    steer_features(item, 1, 2.0)
                else:
                    getattr(item, use).save()
    assert torch.equal(_logits(llama), clean)


def test_a_features_slice_write_of_the_wrong_shape_is_invalid_write(llama):
    from nncanon import InvalidWrite
    from nncanon.sae import attach

    clean = _logits(llama)
    with attach(llama, _sae(llama)) as item:
        with pytest.raises(InvalidWrite, match=r"item.features\[:\] = torch.zeros\(3\)"), torch.no_grad(), \
                llama.trace(TEXTS[0]):
            item.features[:] = torch.zeros(3)
        with pytest.raises(InvalidWrite, match="features"), torch.no_grad(), llama.trace(TEXTS[0]):
            item.features = torch.zeros(3)
    assert torch.equal(_logits(llama), clean)


def test_gradients_of_an_error_term_false_dictionary_are_gradient_not_available(llama):
    """A bare RuntimeError before ("cannot register a hook on a tensor that doesn't require gradient")."""
    from nncanon import GradientNotAvailable
    from nncanon.sae import attach
    from nncanon.sae.tools import feature_attribution

    with attach(llama, _sae(llama), error_term=False) as item:
        with pytest.raises(GradientNotAvailable, match=r"error_term=False .*not in the graph"):
            with llama.trace(TEXTS[0]):
                features = item.features
                with llama.logits.sum().backward():
                    features.grad.save()
        with pytest.raises(GradientNotAvailable, match=r"feature_attribution of .*error_term=False"):
            feature_attribution(llama, item, TEXTS[0], lambda logits: logits[:, -1, 0])


@pytest.mark.parametrize("tool", ["steer", "ablate"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), torch.tensor(float("nan")), "2"])
def test_non_finite_steering_of_features_is_refused_as_tools_steer_refuses_it(llama, tool, bad):
    """Accepted silently before: every value after the point, and the logits, NaN."""
    from nncanon import InvalidInput
    from nncanon.sae import attach
    from nncanon.sae.tools import ablate_features, steer_features

    clean = _logits(llama)
    with attach(llama, _sae(llama)) as item:
        with pytest.raises(InvalidInput, match=r"(non-finite|NaN or infinite|give a number)"), torch.no_grad(), \
                llama.trace(TEXTS[0]):
            if tool == "steer":
                steer_features(item, 1, bad)
            else:
                ablate_features(item, 1, value=bad)
    assert torch.equal(_logits(llama), clean)


@pytest.mark.parametrize(("head", "message"), [(-1, "hook_head_index -1 is outside"), (4, "hook_head_index 4 is "
                                                                                            "outside .*4 heads"),
                                               ("1", "head='1': a head index is an int"),
                                               (True, "head=True: a head index is an int")])
def test_bad_head_indices_are_named(llama, head, message):
    from nncanon import DictionaryMismatch
    from nncanon.sae import Dictionary, attach

    width = llama.hidden_size // 4
    g = torch.Generator().manual_seed(0)
    one_head = Dictionary.from_tensors(torch.randn(width, 8, generator=g), None, torch.randn(8, width, generator=g),
                                       None, hook_name="blocks.1.attn.hook_z")
    with pytest.raises(DictionaryMismatch, match=message):
        attach(llama, one_head, head=head)


@pytest.mark.parametrize(("kwargs", "message"), [({"batch_size": 0}, "batch_size=0; it is a positive int"),
                                                 ({"k": 0}, "k=0; it is a positive int"),
                                                 ({"k": 10_000}, r"k=10000, but the texts hold \d+ tokens"),
                                                 ({"texts": "one string"}, "not one string")])
def test_top_activating_contexts_sizes_are_named(llama, kwargs, message):
    from nncanon import InvalidArgument, InvalidInput
    from nncanon.sae import attach
    from nncanon.sae.tools import top_activating_contexts

    with attach(llama, _sae(llama)) as item, pytest.raises((InvalidArgument, InvalidInput), match=message):
        top_activating_contexts(llama, item, kwargs.pop("texts", TEXTS[:3]), **kwargs)


def test_evaluate_batch_size_zero_is_named(llama):
    from nncanon.sae.evaluation import evaluate

    with pytest.raises(InvalidArgument, match="evaluate: batch_size=0"):
        evaluate(llama, _sae(llama), TEXTS[:2], batch_size=0)


def test_value_at_hook_pattern_is_the_attention_probabilities(llama):
    """The documented table names it; this reads what the surface serves (a bare AttributeError was reported)."""
    from nncanon.sae import value_at

    with torch.no_grad(), llama.trace(TEXTS[0]):
        pattern = value_at(llama, "blocks.1.attn.hook_pattern").save()
        served = llama.layers[1].self_attn.attention_probabilities.save()
    assert pattern.shape[1] == llama.num_heads and torch.equal(pattern, served)
    assert torch.allclose(pattern.sum(-1), torch.ones_like(pattern.sum(-1)))


@pytest.mark.parametrize("order", ["attn_out first", "resid_mid first"])
def test_dictionaries_at_hook_attn_out_and_hook_resid_mid_are_served_together_in_either_order(llama, order):
    """OutOfOrderRead before when hook_attn_out's features were read first (and feature_attribution with both always
    failed). Both edits reach the attention's output: the logits are those of a plain hook adding both decoder rows
    there."""
    from nncanon.proof.checks.references import encode, hf_block
    from nncanon.sae import attach

    first, second = _sae(llama, "blocks.1.hook_attn_out", seed=1), _sae(llama, "blocks.1.hook_resid_mid", seed=2)
    handle = hf_block(llama, 1).self_attn.register_forward_hook(
        lambda m, a, out: (out[0] + 2.0 * first.W_dec[3] - 1.5 * second.W_dec[5], *out[1:]))
    try:
        with torch.no_grad():
            expected = llama._module(**encode(llama, TEXTS[0])).logits
    finally:
        handle.remove()
    with attach(llama, first) as a, attach(llama, second) as b:
        reads = (a, b) if order == "attn_out first" else (b, a)
        with torch.no_grad(), llama.trace(TEXTS[0]):
            for item in reads:
                item.features.save()
            a.features[..., 3] += 2.0
            b.features[..., 5] -= 1.5
            logits = llama.logits.save()
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_feature_attribution_with_dictionaries_at_attn_out_and_resid_mid_equals_each_alone(llama):
    from nncanon.sae import attach
    from nncanon.sae.tools import feature_attribution

    first, second = _sae(llama, "blocks.1.hook_attn_out", seed=1), _sae(llama, "blocks.1.hook_resid_mid", seed=2)
    metric = lambda logits: logits[:, -1, 3] - logits[:, -1, 7]  # noqa: E731
    with attach(llama, first) as a:
        alone_a = feature_attribution(llama, a, TEXTS[0], metric)
    with attach(llama, second) as b:
        alone_b = feature_attribution(llama, b, TEXTS[0], metric)
    with attach(llama, first) as a, attach(llama, second) as b:
        for items in ([a, b], [b, a]):
            both = feature_attribution(llama, items, TEXTS[0], metric)
            torch.testing.assert_close(both[a.name], alone_a, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(both[b.name], alone_b, rtol=1e-5, atol=1e-6)


def test_a_transcoder_at_hook_mlp_in_and_a_dictionary_at_hook_resid_mid(llama):
    """Served together in either order (OutOfOrderRead before when the transcoder was read first: its read passes
    the attention's output, through which the resid_mid dictionary's edit goes; that dictionary is now read first,
    in the model's order), and feature_attribution orders them itself."""
    from nncanon.sae import Dictionary, attach
    from nncanon.sae.tools import feature_attribution

    d = llama.hidden_size
    g = torch.Generator().manual_seed(4)
    coder = Dictionary.from_tensors(torch.randn(d, 16, generator=g) / d ** 0.5, None, torch.randn(16, d, generator=g),
                                    None, architecture="transcoder", hook_name="blocks.1.hook_mlp_in",
                                    hook_name_out="blocks.1.hook_mlp_out")
    with attach(llama, coder) as t, attach(llama, _sae(llama, "blocks.1.hook_resid_mid", seed=2)) as b:
        for order in ("resid_mid first", "transcoder first"):
            with torch.no_grad(), llama.trace(TEXTS[0]):
                if order == "resid_mid first":
                    mid = b.features.save()
                coded = t.features.save()
                if order == "transcoder first":
                    mid = b.features.save()
            torch.testing.assert_close(mid, b.dictionary.encode(_resid_mid(llama)), rtol=0, atol=1e-6)
            torch.testing.assert_close(coded, coder.encode(_resid_mid(llama)), rtol=0, atol=1e-6)
        result = feature_attribution(llama, [t, b], TEXTS[0], lambda logits: logits[:, -1, 0])
        assert set(result) == {t.name, b.name}


def _resid_mid(model):
    """Block 1's stream between attention and MLP, by plain hooks: its input plus the attention's output."""
    from nncanon.proof.checks.references import encode, hf_block

    seen = {}

    def block_input(module, args, kwargs):
        seen["in"] = (args[0] if args else kwargs["hidden_states"]).clone()

    def attention_output(module, args, out):
        seen["attn"] = out[0].clone()

    block = hf_block(model, 1)
    handles = [block.register_forward_pre_hook(block_input, with_kwargs=True),
               block.self_attn.register_forward_hook(attention_output)]
    try:
        with torch.no_grad():
            model._module(**encode(model, TEXTS[0]))
    finally:
        for handle in handles:
            handle.remove()
    return seen["in"] + seen["attn"]


# -- Quantized models ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama64(tmp_path_factory):
    from nncanon.testing import tiny_hf_model, tiny_tokenizer

    path = tmp_path_factory.mktemp("llama64")
    tiny_hf_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("threshold", [6.0, 0.0])
def test_support_batch_is_right_before_the_first_trace_of_a_lazily_loaded_model(llama64, threshold):
    """None until the first trace before (docs/quantization.md's ``assert independent.support().batch is None``
    passed on any model)."""
    from transformers import BitsAndBytesConfig

    import nncanon

    model = nncanon.StandardizedTransformer(llama64, device_map="cpu", quantization_config=BitsAndBytesConfig(
        load_in_8bit=True, llm_int8_threshold=threshold))
    assert model._module.device == torch.device("meta")
    before = model.support().batch
    assert (before is not None) == (threshold > 0)
    with torch.no_grad(), model.trace(TEXTS[0]):
        model.logits.save()
    assert model.support().batch == before


def test_support_batch_follows_int8_thresholds_changed_after_the_load(llama64):
    """None while the invokes were coupled before: the answer was kept from the first trace."""
    from transformers import BitsAndBytesConfig

    import nncanon

    model = nncanon.StandardizedTransformer(llama64, device_map="cpu", dispatch=True, quantization_config=(
        BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)))
    with torch.no_grad(), model.trace(TEXTS[0]):
        model.logits.save()
    assert model.support().batch is None
    layers = [m for m in model._module.modules() if type(m).__name__ == "Linear8bitLt"]
    for layer in layers:
        layer.state.threshold = 4.0
    assert "llm_int8_threshold=4" in model.support().batch
    for layer in layers:
        layer.state.threshold = 0.0
    assert model.support().batch is None


@pytest.mark.parametrize("when", ["before the first trace", "after a trace"])
def test_a_cast_that_leaves_the_embedding_in_float32_is_model_changed(when):
    """torch's "expected m1 and m2 to have the same dtype" before: the signature looked at the first parameter only
    (the embedding's)."""
    from nncanon import ModelChanged

    model = tiny_model("llama")
    if when == "after a trace":
        _logits(model)
    model._module.to(torch.bfloat16)
    model._module.model.embed_tokens.to(torch.float32)
    with pytest.raises(ModelChanged, match="bfloat16 and float32"):
        _logits(model)


def test_a_model_with_a_vocabulary_under_the_proofs_tokenizer_is_proved_and_its_tokenizer_named():
    """The proof said "the same error on all steps tried: transformers cannot run this config" (false: the config
    runs; the proof's 300-token prompts had ids past its 100 rows). The twin's vocabulary now holds the proof's
    tokenizer, and a user's tokenizer larger than the embedding is named at load with both sizes."""
    import nncanon
    from nncanon.testing import tiny_hf_model, tiny_tokenizer

    hf = tiny_hf_model("llama", vocab_size=100)
    with pytest.warns(UserWarning, match=r"has 300 tokens, but the model's embedding has 100 rows"):
        model = nncanon.StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), verify="always")
    report = model.support()
    assert "could not run" not in str(report) and report.available("layer_output", layer=0)
    with torch.no_grad(), model.trace(torch.tensor([[1, 5, 99]])):
        out = model.layers[0].layer_output.save()
    assert out.shape == (1, 3, hf.config.hidden_size)


# -- The first hour --------------------------------------------------------------------------------------------------


def test_the_readme_says_where_the_recipe_does_not_run_unchanged_and_its_branch_runs(tmp_path):
    """The README recipe fails on the hybrid demo's layer 0 (no softmax attention); the README now says so and
    shows the branch, which runs."""
    import re
    import runpy
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "has no softmax attention" in readme
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if 'demo_model("hybrid")' in b)
    script = tmp_path / "readme_branch.py"
    script.write_text(block)
    runpy.run_path(str(script), run_name="__main__")


def test_the_fast_heatmap_is_titled_estimated(tmp_path, monkeypatch):
    """``nncanon ablate --fast`` drew estimates on the exact heatmap's scale with no mark."""
    import matplotlib.figure

    from nncanon.study import plot_head_effects

    titles: list[str] = []
    real = matplotlib.figure.Figure.savefig

    def keep_titles(figure, *args, **kwargs):
        titles.extend([figure._suptitle.get_text(), *(axis.get_title() for axis in figure.axes)])
        return real(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep_titles)
    effects = {"m": torch.randn(2, 3)}
    plot_head_effects(effects, " Paris", str(tmp_path / "exact.png"), prompt="p")
    assert not any("estimated" in t.lower() for t in titles)
    titles.clear()
    plot_head_effects(effects, " Paris", str(tmp_path / "fast.png"), prompt="p", estimated="log_odds")
    assert "ESTIMATED" in titles[0] and "m: estimated drop in log-odds of P(Paris)" in titles


def test_top_contexts_are_long_enough_to_tell_sentences_apart_and_long_runs_show_progress(llama, capsys):
    """Contexts of 8 tokens before and 2 after could not tell two sentences apart; runs of several batches showed no
    progress."""
    from nncanon.sae import attach
    from nncanon.sae.tools import top_activating_contexts

    texts = ["one two three four five six seven eight nine ten eleven twelve thirteen fourteen", "a b"] * 3
    with attach(llama, _sae(llama)) as item:
        found = top_activating_contexts(llama, item, texts, features=[0], k=2, batch_size=2)
    err = capsys.readouterr().err
    assert "top activating contexts" in err and "6/6" in err
    for (value, context), text, position in zip(found.contexts(0), found.text[0].tolist(),
                                                found.position[0].tolist(), strict=True):
        tokens = found.tokens[text]
        before = "".join(tokens[max(0, position - 24):position])
        assert context == f"{before}[[{tokens[position]}]]{''.join(tokens[position + 1:position + 7])}"
        assert value == pytest.approx(float(found.values[0].max())) or value <= float(found.values[0].max())


# -- RWKV's stream rescaling -----------------------------------------------------------------------------------------


def test_the_twin_of_rwkv_4_169m_crosses_its_stream_rescaling():
    """A full-size RWKV-4-169M config halves the stream after blocks 5 and 11 (``rescale_every=6``); a twin of 2
    blocks kept ``rescale_every=6`` and never exercised it. The twin now halves after every block, so the proof's
    checks run across such boundaries: there ``layers[i + 1].layer_input`` is ``layers[i].layer_output / 2``
    (the model's own doing, between blocks), which the proved twin's surface shows against plain hooks."""
    from transformers import RwkvConfig

    import nncanon
    from nncanon.proof.checks.references import encode

    config = RwkvConfig(vocab_size=50277, hidden_size=768, num_hidden_layers=12, intermediate_size=3072,
                        attention_hidden_size=768, rescale_every=6, context_length=1024)
    small = nncanon.twin(config)
    blocks = small.config.num_hidden_layers
    assert small.config.rescale_every == 1 and blocks >= 2
    small.eval()
    from nncanon.testing import tiny_tokenizer

    model = nncanon.StandardizedTransformer(small, tokenizer=tiny_tokenizer(small.config.vocab_size),
                                            verify="always")
    seen = []
    handles = [block.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (args[0] if args else kwargs["hidden"]).clone()) and None, with_kwargs=True) for block in small.rwkv.blocks]
    try:
        with torch.no_grad():
            small(**encode(model, TEXTS[0]))
    finally:
        for handle in handles:
            handle.remove()
    inputs, outputs = [], []
    with torch.no_grad(), model.trace(TEXTS[0]):
        for i in range(blocks):
            inputs.append(model.layers[i].layer_input.save())
            outputs.append(model.layers[i].layer_output.save())
    for i in range(1, blocks):
        torch.testing.assert_close(inputs[i], seen[i], rtol=0, atol=0)
        torch.testing.assert_close(inputs[i], outputs[i - 1] / 2, rtol=0, atol=0)
    assert "could not run" not in str(model.support())


@pytest.mark.parametrize("argv", [["--help"], ["ablate", "--help"], ["ablate", "--layer", "x"],
                                  ["ablate", "--prompt", ""], ["ablate", "--out", "FILE"],
                                  ["ablate", "--quiet", "--out", "FILE"], ["ablate", "--quiet", "--layer", "x"]])
def test_the_command_lines_help_and_usage_errors_are_fast_and_import_nothing_heavy(tmp_path, argv):
    """``nncanon --help`` took 3-4 s: the package imported torch, transformers and nnsight first; a usage error under
    ``--quiet`` still imported transformers (to hide its progress bars). Each command runs in a fresh interpreter
    (``python -m nncanon``, timed whole: < 1.5 s), and a second one reports what the same call imported."""
    import subprocess
    import sys
    import time

    (tmp_path / "file").write_text("a file where the folder should be")
    argv = [str(tmp_path / "file") if arg == "FILE" else arg for arg in argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "nncanon", *argv], capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    assert result.returncode in (0, 2), (argv, result.returncode, result.stderr[-2000:])
    assert argv[-1] == "--help" or result.returncode == 2, result.stdout
    assert elapsed < 1.5, f"nncanon {' '.join(argv)} took {elapsed:.2f} s"
    code = ("import sys, contextlib, io\n"
            "from nncanon.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    try:\n"
            f"        main({argv!r})\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print([name for name in ('torch', 'transformers', 'nnsight') if name in sys.modules])\n")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "[]", (argv, imported.stdout)


def test_the_package_names_its_public_api_without_importing_it():
    import nncanon

    assert nncanon.InvalidInput.__module__ == "nncanon.errors" and "StandardizedTransformer" in dir(nncanon)
