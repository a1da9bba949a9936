"""The proof cache: a proof kept under a key made of everything that could change its verdict.

The key is nncanon's version and code, the transformers and torch versions, the checks run, the family record,
the model class and the config's structural fingerprint (the config with the twin's sizes: two checkpoints that
differ only in width share a proof). `Proof` is what a file holds; `read_cached` never returns a stale one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pickle
import secrets
import types
import warnings
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from stat import S_ISREG
from typing import Any

import torch

from ..versions import __version__
from . import verdict
from .shrink import shrink_sizes
from .verdict import Verdict

#: The layout of a cache file; another layout is ignored and rewritten.
SCHEMA = 3
#: Config entries that do not change what a model computes.
_VOLATILE = {
    "transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "use_cache",
    "output_hidden_states", "output_attentions", "return_dict", "id2label", "label2id", "tokenizer_class",
    "_commit_hash", "problem_type", "_attn_implementation_autoset", "auto_map", "chunk_size_feed_forward",
    "quantization_config",  # (keyed on its own: `cache_key`'s ``quantization``, as the model is quantized)
}


def cache_dir() -> Path:
    """Where proofs are kept: ``$NNCANON_CACHE/proofs``, default ``~/.cache/nncanon/proofs``."""
    return Path(_cache_folder())


def _cache_folder() -> str:
    """`cache_dir` as a string, kept by the environment it is made from (a cached load builds no path)."""
    environment = (os.environ.get("NNCANON_CACHE"), os.environ.get("HOME"))
    folder = _FOLDERS.get(environment)
    if folder is None:
        root = environment[0] or Path.home() / ".cache" / "nncanon"
        folder = _FOLDERS[environment] = str(Path(root) / "proofs")
    return folder


#: `_cache_folder` by ``($NNCANON_CACHE, $HOME)``.
_FOLDERS: dict[tuple[str | None, str | None], str] = {}


@cache
def code_digest() -> str:
    """A digest of nncanon's own source: a proof made by other code is not reused."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def current_versions() -> dict[str, str]:
    import transformers

    parts = (__version__, transformers.__version__, torch.__version__)
    versions = _VERSIONS.get(parts)
    if versions is None:
        versions = _VERSIONS[parts] = {"nncanon": __version__, "code": code_digest(),
                                       "transformers": transformers.__version__, "torch": torch.__version__}
    return dict(versions)


#: `current_versions` by the version strings (the code digest is the same for the whole process).
_VERSIONS: dict[tuple[str, str, str], dict[str, str]] = {}


def _plain(values: Any) -> Any:
    if isinstance(values, dict):
        return {k: _plain(v) for k, v in sorted(values.items()) if k not in _VOLATILE}
    if isinstance(values, (list, tuple)):
        return [_plain(v) for v in values]
    return values


def _stable(value: Any) -> Any:
    """``value`` as plain data that is the same in every process: functions by name and code."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [type(value).__qualname__] + [[f.name, _stable(getattr(value, f.name))]
                                             for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        return sorted([str(k), _stable(v)] for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_stable(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, types.CodeType):
        return [value.co_code.hex(), [_stable(c) for c in value.co_consts], list(value.co_names)]
    if isinstance(value, types.FunctionType):
        return [value.__module__, value.__qualname__, _stable(value.__code__)]
    if callable(value):
        return [getattr(value, "__module__", ""), getattr(value, "__qualname__", repr(type(value)))]
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


#: Digests of immutable objects (frozen records, the checks' tuple), by identity; the object is kept
#: with its digest so that its id is never reused by another.
_DIGESTS: dict[int, tuple[Any, str]] = {}


def digest_of(value: Any) -> str:
    """A digest of an immutable object (a family record, the checks' table): a record changed at run time (or
    a family passed as ``family=``) is proved again rather than read from a proof of another record."""
    known = _DIGESTS.get(id(value))
    if known is None or known[0] is not value:
        known = _DIGESTS[id(value)] = (value, hashlib.sha256(json.dumps(_stable(value), default=str).encode())
                                       .hexdigest()[:16])
    return known[1]


def fingerprint(config: Any, family: Any, model_class: type) -> str:
    """The structural fingerprint of ``config``: its entries with the twin's sizes, the family record
    and the class.

    Kept in memory by the config's whole state (`config_state`): a config changed in any way since,
    a nested one included, is fingerprinted again.
    """
    state = config_state(config)
    memo = None if state is None else (state, digest_of(family), model_class)
    known = _FINGERPRINTS.get(memo) if memo is not None else None
    if known is None:
        known = _fingerprint(config, family, model_class)
        if memo is not None:
            _FINGERPRINTS[memo] = known
            while len(_FINGERPRINTS) > _KEEP:
                del _FINGERPRINTS[next(iter(_FINGERPRINTS))]
    return known


#: Fingerprints computed in this process, by `config_state`, record digest and class (the latest `_KEEP`).
_FINGERPRINTS: dict[tuple[bytes, str, type], str] = {}
_KEEP = 256


def config_state(config: Any) -> bytes | None:
    """All of ``config``'s state as bytes: its class and its attributes, nested configs and every list,
    dict and value in them (a pickle, ~10x cheaper than ``to_dict``), or ``None`` where it cannot be
    taken exactly (a config class from outside transformers, which may serialize itself its own way;
    an attribute that does not pickle).

    Equal bytes mean equal ``to_dict()``: transformers' ``to_dict`` is a function of the class and the
    attributes only. The pickle tells apart what compares equal but serializes differently (``1``,
    ``1.0`` and ``True``; ``0.0`` and ``-0.0``).
    """
    if not type(config).__module__.startswith("transformers."):
        return None
    try:
        return pickle.dumps((type(config), config.__dict__), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an attribute pickle cannot take: no memo, the fingerprint is computed each time
        return None


def _fingerprint(config: Any, family: Any, model_class: type) -> str:
    values = config.to_dict()
    shrink_sizes(values, "", [])
    text = json.dumps(_plain(values), sort_keys=True, default=str)
    head = f"{family.name}|{digest_of(family)}|{model_class.__qualname__}"
    return hashlib.sha256(f"{head}|{text}".encode()).hexdigest()[:24]


@dataclass
class Proof:
    """The proof of one config.

    Attributes:
        key: Its cache key.
        versions: nncanon, its code digest, transformers and torch it was made with.
        family: The family's name.
        created: When it was made (UTC, ISO format).
        seconds: How long the twin and the checks took.
        layer_map: For each block of the original, the twin block whose checks prove it (``None``:
            the twin has no block of its kind).
        twin_layers: The original block each twin block stands for.
        verdict: The checks' results on the twin.
        changes: Every attribute the twin changed, ``[path, old, new, rule]``.
        twin: Which twin it ran on (`nncanon.proof.ladder.TwinRun.to_dict`: the step of the ladder, its
            sizes, the steps before it and why each was not taken), and ``config``: a digest of the config,
            for a twin of a later step (such a proof stands for that config alone).
        no_twin: Where no twin runs, the one reason every value is declined (the verdict is then empty).
        from_cache: Whether it was read from the cache rather than made now.
    """

    key: str
    versions: dict[str, str]
    family: str
    created: str
    seconds: float
    layer_map: list[int | None]
    twin_layers: list[int]
    verdict: Verdict
    changes: list[list[Any]] = field(default_factory=list)
    twin: dict = field(default_factory=dict)
    no_twin: str | None = None
    from_cache: bool = False
    _unproved: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def describe(self) -> str:
        """``proved on a twin of this config (transformers 5.24.0, 2026-12-01 08:12 UTC; step 1 of the ladder
        (the table's sizes): 64 wide, 4 heads of 16, 2 of 32 blocks, vocabulary 320, 0.1M parameters)``, or why
        nothing was proved."""
        when = self.created.replace("T", " ")[:16] + " UTC"
        if self.no_twin is not None:
            return f"declined: the proof could not run on any twin: {self.no_twin} (transformers " \
                   f"{self.versions['transformers']}, {when})"
        twin = f"; {self.twin['described']}" if self.twin.get("described") else ""
        return f"proved on a twin of this config (transformers {self.versions['transformers']}, {when}{twin})"

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA, "key": self.key, "versions": self.versions, "family": self.family,
            "created": self.created, "seconds": self.seconds, "layer_map": self.layer_map,
            "twin_layers": self.twin_layers, "changes": self.changes, "twin": self.twin, "no_twin": self.no_twin,
            "results": self.verdict.to_list(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Proof:
        no_twin = data.get("no_twin")
        if no_twin is not None and not isinstance(no_twin, str):
            raise TypeError("no_twin is not a reason")
        return cls(
            data["key"], dict(data["versions"]), data["family"], data["created"], float(data["seconds"]),
            list(data["layer_map"]), list(data["twin_layers"]), Verdict.from_list(data["results"]),
            list(data.get("changes", [])), dict(data.get("twin") or {}), no_twin, from_cache=True,
        )

    def stands_for(self, config: Any) -> bool:
        """Whether this proof proves ``config``: a proof on the table's twin proves every config of that
        twin (the cache key says which); one on a later step's twin, or one that found no twin, was made
        for one config (``twin["config"]``)."""
        if self.no_twin is None and self.twin.get("step", 1) == 1:
            return True
        return self.twin.get("config") == config_digest(config)


def config_digest(config: Any) -> str:
    """A digest of all of ``config`` that changes what it computes (its sizes included)."""
    text = json.dumps(_plain(config.to_dict()), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cache_key(config: Any, family: Any, model_class: type, quantization: dict | None = None) -> str:
    """The cache key of a proof of ``config``: the versions, the checks run, the family record, the class,
    the fingerprint, and how the model is quantized or cast (``quantization``: `nncanon.quantization.Quantization.key`;
    ``None``: a float32 model)."""
    versions = current_versions()
    quantized = "" if quantization is None else json.dumps(quantization, sort_keys=True, default=str)
    parts = (tuple(versions.values()), digest_of(verdict.CHECKS), fingerprint(config, family, model_class), quantized)
    key = _KEYS.get(parts)
    if key is None:
        text = f"{json.dumps(versions, sort_keys=True)}|{parts[1]}|{parts[2]}" + (f"|{quantized}" if quantized else "")
        key = _KEYS[parts] = hashlib.sha256(text.encode()).hexdigest()[:32]
    return key


#: Cache keys by what they are made of (a few short strings each).
_KEYS: dict[tuple, str] = {}


def read_cached(key: str, config: Any = None) -> Proof | None:
    """The cached proof under ``key``, or ``None``: none there, unreadable, not a regular file (a symlink, a
    pipe), corrupt in any way, edited since it was written (its digest), made by other versions, or, given
    ``config``, made for another config. Never a stale proof, never an error: a file is data, checked by
    `validated` before any of it is believed."""
    path = os.path.join(_cache_folder(), f"{key}.json")
    try:
        descriptor = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        stat = os.fstat(descriptor)
        if not S_ISREG(stat.st_mode) or stat.st_size > MAX_BYTES:
            return None
        stamp = (path, stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size)
        proof = _READ.get(stamp)
        if proof is None:
            with os.fdopen(descriptor, "rb", closefd=False) as file:
                data = json.loads(file.read(MAX_BYTES + 1))
            proof = _READ[stamp] = Proof.from_dict(validated(data, key))
        return proof if config is None or proof.stands_for(config) else None
    except Exception:  # a file is data from outside this process: whatever is wrong with it, it proves nothing
        return None
    finally:
        os.close(descriptor)


#: Proofs read in this process, by file and its identity and modification stamp (a file written since is read again).
_READ: dict[tuple[str, int, int, int, int], Proof] = {}
#: The largest proof file read (a proof of a 100-block model is ~100 kB).
MAX_BYTES = 32 * 2**20
#: ``os.open`` flag that refuses a symlink at the path (0 where the platform has none).
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class CorruptProof(ValueError):
    """A proof file that is not what `write_cached` writes (the reason): it is ignored, and proved again."""


def validated(data: Any, key: str) -> dict:
    """``data`` (a proof file's JSON) if it is a proof of ``key`` as `write_cached` writes one, else raise
    `CorruptProof` naming what is wrong.

    The file is data, not authority: its layout and every field's type are checked (a ``"passed"`` is a JSON
    ``true`` or ``false``, not a string), each result that says it held is held to its own numbers again
    (``error <= tolerance``), the layer map names only blocks the twin has, and the digest binds the content to
    the key: a file edited by hand, or cut short, no longer matches its digest.
    """
    _require(isinstance(data, dict), "not a JSON object")
    _require(data.get("schema") == SCHEMA and data.get("key") == key, f"not a schema-{SCHEMA} proof of {key}")
    _require(data.get("versions") == current_versions(), "made by other versions")
    _require(data.get("digest") == content_digest(data), "its content does not match its digest")
    for name, kind in (("family", str), ("created", str), ("layer_map", list), ("twin_layers", list),
                       ("changes", list), ("twin", dict), ("results", list)):
        _require(isinstance(data.get(name), kind), f"{name} is not a {kind.__name__}")
    _require(_number(data.get("seconds")) and data["seconds"] >= 0, "seconds is not a duration")
    _require(data.get("no_twin") is None or isinstance(data["no_twin"], str), "no_twin is not a reason")
    blocks = data["twin_layers"]
    _require(all(_index(b) for b in blocks), "twin_layers are not block indices")
    _require(all(b is None or (_index(b) and b < len(blocks)) for b in data["layer_map"]),
             f"layer_map names a block the twin (of {len(blocks)} blocks) does not have")
    _require(all(isinstance(change, list) and len(change) == 4 for change in data["changes"]),
             "changes are not [path, old, new, rule]")
    twin = data["twin"]
    _require(all(isinstance(twin.get(name, ""), str) for name in ("described", "config")), "twin is malformed")
    _require(_index(twin.get("step", 1)) and twin.get("step", 1) >= 1, "twin's step is not a step of the ladder")
    for result in data["results"]:
        _require(isinstance(result, dict) and _result_fits(result, len(blocks)),
                 f"a result is malformed: {result!r}"[:200])
    return data


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise CorruptProof(reason)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _result_fits(result: dict, blocks: int) -> bool:
    """Whether one check result (`nncanon.proof.checks.base.CheckResult.to_dict`) has its fields' types, a layer
    of the twin, and, where it says it held with a measured error and a bar, an error within the bar."""
    error, tolerance = result.get("error"), result.get("tolerance")
    shaped = (
        isinstance(result.get("check"), str) and isinstance(result.get("note", ""), str)
        and (result.get("layer") is None or (_index(result["layer"]) and result["layer"] < blocks))
        and isinstance(result.get("values"), list) and all(isinstance(v, str) for v in result["values"])
        and isinstance(result.get("passed"), bool) and isinstance(result.get("gradient", False), bool)
        and (error is None or (isinstance(error, (int, float)) and not isinstance(error, bool)))
        and (tolerance is None or (_number(tolerance) and tolerance >= 0))
    )
    if not shaped:
        return False
    return not result["passed"] or error is None or tolerance is None or error <= tolerance  # (NaN: not <=)


def content_digest(data: dict) -> str:
    """The digest of a proof file's content (everything but the digest itself, its key included), as JSON."""
    body = {name: value for name, value in data.items() if name != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_cached(proof: Proof) -> None:
    """Store ``proof``: a file of its own, created exclusively (``O_EXCL``, never through a symlink: a link or
    file planted at the temporary name fails the write, not another file), renamed over the proof's name (a
    rename replaces a link there, never what it points to); the cache's folders, where this creates them, are
    the user's alone (``0o700``). An unwritable cache only costs a warning and a proof at the next load."""
    directory = cache_dir()
    temporary = None
    try:
        _make_private_folders(directory)
        body = json.loads(json.dumps(proof.to_dict(), default=str))  # as a reader will see it
        body["digest"] = content_digest(body)
        temporary = directory / f".{proof.key}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
        with os.fdopen(os.open(temporary, flags, 0o644), "w") as file:
            file.write(json.dumps(body, indent=1, sort_keys=True))
        os.replace(temporary, directory / f"{proof.key}.json")
        temporary = None
    except OSError as error:
        warnings.warn(f"nncanon could not write its proof cache at {directory}: {error}", stacklevel=3)
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def _make_private_folders(directory: Path) -> None:
    """Create ``directory`` and any missing folder above it readable, writable and listable by this user only."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # (another process made it meanwhile)
            os.mkdir(folder, 0o700)
