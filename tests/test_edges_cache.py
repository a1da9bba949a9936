"""The proof cache is data, not authority (issue 25, points 3, 6 and 7).

A proof file is validated before any of it is believed (types, each held result against its own bar, the layer map
within the twin), bound to its key by a digest over its content (an edited file is a stale file: proved again),
written exclusively and never through a symlink, into folders of the user's alone; a corrupt file of any shape is
ignored and rewritten, never a crash.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import warnings

import pytest

from nncanon import StandardizedTransformer
from nncanon.families import REGISTRY
from nncanon.proof import cache as proof_cache
from nncanon.served import Site
from nncanon.testing import tiny_hf_model, tiny_tokenizer

#: Granite's attention read before its ``residual_multiplier``: the proof declines it (the ablation check fails).
BROKEN_GRANITE = dataclasses.replace(REGISTRY["granite"], attention_output=Site("self_attn", index=0))


def _load(hf, family=None, verify="auto"):
    return StandardizedTransformer(hf, tokenizer=tiny_tokenizer(), family=family, verify=verify)


def _proof_file(tmp_path, model):
    return tmp_path / "proofs" / f"{model._provenance.proof.key}.json"


def _rewrite(path, edit, digest: bool) -> None:
    """Edit the proof file at ``path`` with ``edit(data)``; with ``digest``, as a writer who recomputes it would."""
    data = json.loads(path.read_text())
    edit(data)
    if digest:
        data["digest"] = proof_cache.content_digest(data)
    path.write_text(json.dumps(data))


@pytest.fixture
def granite(monkeypatch, tmp_path):
    """A proof (in a cache of its own) that declines Granite's broken attention_output, and its file."""
    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    hf = tiny_hf_model("granite")
    model = _load(hf, BROKEN_GRANITE)
    assert model.support().declined(0) == ["attention_output"]
    return hf, _proof_file(tmp_path, model)


@pytest.mark.parametrize("digest", [False, True], ids=["edited", "edited-with-its-digest"])
def test_a_proof_edited_to_pass_is_not_believed(granite, digest):
    """Every ``"passed"`` set to the string ``"false"`` (which ``bool()`` reads as true): the value stays declined,
    the file is proved again and rewritten with JSON booleans."""
    hf, path = granite

    def strings(data):
        for result in data["results"]:
            result["passed"] = "false"

    _rewrite(path, strings, digest)
    reloaded = _load(hf, BROKEN_GRANITE)
    assert not reloaded._provenance.proof.from_cache
    assert reloaded.support().declined(0) == ["attention_output"]
    assert all(isinstance(r["passed"], bool) for r in json.loads(path.read_text())["results"])


def test_a_failed_result_flipped_to_held_is_held_to_its_own_numbers(granite):
    """``"passed": true`` on a result whose error exceeds its bar, digest recomputed: re-checked, not believed."""
    hf, path = granite

    def flipped(data):
        failed = [r for r in data["results"] if not r["passed"] and r["error"] is not None]
        assert failed and all(r["error"] > r["tolerance"] for r in failed)
        for result in failed:
            result["passed"] = True

    _rewrite(path, flipped, digest=True)
    with pytest.raises(proof_cache.CorruptProof, match="a result is malformed"):
        proof_cache.validated(json.loads(path.read_text()), path.stem)
    assert _load(hf, BROKEN_GRANITE).support().declined(0) == ["attention_output"]


def test_an_edit_that_keeps_every_type_is_stale_by_its_digest(granite):
    hf, path = granite
    _rewrite(path, lambda data: data.update(seconds=data["seconds"] + 1), digest=False)
    with pytest.raises(proof_cache.CorruptProof, match="does not match its digest"):
        proof_cache.validated(json.loads(path.read_text()), path.stem)
    assert not _load(hf, BROKEN_GRANITE)._provenance.proof.from_cache
    assert proof_cache.read_cached(path.stem) is not None  # rewritten, valid again


def test_a_layer_map_outside_the_twin_or_a_corrupt_file_of_any_shape_is_ignored_and_rewritten(monkeypatch, tmp_path):
    """A layer map naming a block the twin lacks was an ``IndexError: list index out of range`` that made the model
    unloadable, naming no file. Now it, and a file of any other shape, reads as no proof; the load proves again and
    rewrites it."""
    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    hf = tiny_hf_model("llama")
    path = _proof_file(tmp_path, _load(hf))
    valid = path.read_text()
    for layer_map in ([99, 0], [0, -1], [0, True], "0"):
        path.write_text(valid)
        _rewrite(path, lambda data: data.update(layer_map=layer_map), digest=True)  # noqa: B023 - called at once
        with pytest.raises(proof_cache.CorruptProof, match="layer_map"):
            proof_cache.validated(json.loads(path.read_text()), path.stem)
        assert proof_cache.read_cached(path.stem) is None
    for content in ("null", "[]", "{}", "7", '"proof"', "[" * 100_000 + "]" * 100_000, '{"schema": 3', "\x00\xff"):
        path.write_text(content)
        assert proof_cache.read_cached(path.stem) is None, content[:20]
    path.write_text(valid)
    _rewrite(path, lambda data: data.update(layer_map=[99, 0]), digest=True)
    model = _load(hf)
    assert not model._provenance.proof.from_cache and model.support().declined() == []
    assert json.loads(path.read_text())["layer_map"] == model._provenance.proof.layer_map
    assert proof_cache.read_cached(path.stem) is not None


def test_a_pipe_or_a_symlink_at_the_proofs_name_is_not_read(monkeypatch, tmp_path):
    """A FIFO would block a plain read for ever; a symlink is not followed (it may point anywhere): both are
    ignored, and the rename of the new proof replaces them, never what a link points to."""
    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    hf = tiny_hf_model("llama")
    path = _proof_file(tmp_path, _load(hf))
    valid = path.read_text()
    victim = tmp_path / "victim.json"
    victim.write_text(valid)  # a valid proof, elsewhere: a link to it is still not followed
    path.unlink()
    path.symlink_to(victim)
    assert proof_cache.read_cached(path.stem) is None
    assert not _load(hf)._provenance.proof.from_cache
    assert not path.is_symlink() and victim.read_text() == valid
    path.unlink()
    os.mkfifo(path)
    assert proof_cache.read_cached(path.stem) is None
    assert not _load(hf)._provenance.proof.from_cache and stat.S_ISREG(path.stat().st_mode)


def test_a_symlink_planted_at_the_temporary_name_is_never_followed(monkeypatch, tmp_path):
    """Was ``Path.write_text`` on a predictable ``.KEY.PID.tmp``: a link planted there let one user overwrite another's
    file. The name is now unguessable, and even a link at it fails the write (a warning), the target untouched."""
    monkeypatch.setenv("NNCANON_CACHE", str(tmp_path))
    hf = tiny_hf_model("llama")
    proof = _load(hf)._provenance.proof
    folder = tmp_path / "proofs"
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file")
    monkeypatch.setattr(proof_cache.secrets, "token_hex", lambda n: "guessed")
    (folder / f".{proof.key}.{os.getpid()}.guessed.tmp").symlink_to(victim)
    with pytest.warns(UserWarning, match="could not write its proof cache"):
        proof_cache.write_cached(proof)
    assert victim.read_text() == "someone else's file"


def test_the_cache_folders_it_creates_are_the_users_alone(monkeypatch, tmp_path):
    root = tmp_path / "shared" / "nncanon"
    monkeypatch.setenv("NNCANON_CACHE", str(root))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # written, without a warning
        _load(tiny_hf_model("llama"))
    for folder in (tmp_path / "shared", root, root / "proofs"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert [p.name for p in (root / "proofs").iterdir() if p.name.endswith(".tmp")] == []
