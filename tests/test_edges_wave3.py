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
    with pytest.raises(InvalidCollection, match="made otherwise .*model_sha256"):
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
        kwargs["texts"] = TEXTS[:-1] + ["another last text"]
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
    with pytest.raises(InvalidCollection, match="manifest.json is a symbolic link"):
        os.symlink(outside / "manifest.json", folder / "manifest.json")
        _collect(llama, folder)
    (folder / "manifest.json").unlink()
    with pytest.raises(InvalidCollection, match="activations-00000.safetensors"):  # a link: a shard not named
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
    with pytest.raises(InvalidCollection, match="nowhere.*does not exist"):
        load_activations(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidCollection, match="manifest.json is missing"):
        load_activations(tmp_path / "empty")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(InvalidCollection, match="a-file is not a folder"):
        _collect(llama, tmp_path / "a-file")
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as patch:  # a disk that refuses the shard (root writes into a read-only folder)
        patch.setattr(collection_module.files.tempfile, "mkstemp", refused)
        with pytest.raises(InvalidCollection, match="denied.*not writable.*Permission denied"):
            _collect(llama, tmp_path / "denied")
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder: the chmod case needs another user (the refusal above ran)")
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(InvalidCollection, match="read-only.*Permission denied"):
            _collect(llama, locked)
        with pytest.raises(InvalidCollection, match="read-only.*Permission denied"):
            _collect(llama, locked / "below")
    finally:
        locked.chmod(0o700)
