"""`StandardizedTransformer`: any decoder-only transformers model, one surface, proved on a twin of its config.

The model is the load (`nncanon.loading`), the mounted surface (`nncanon.mounted.MountedModel`), the load-time
proof (`nncanon.proof.load`, or `nncanon.inference` for a family nobody registered) and its provenance.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
import zipfile
from typing import Any

import torch
from safetensors import safe_open

from .errors import (
    BatchCoupledWarning,
    ConfigChanged,
    InvalidArgument,
    InvalidCheckpoint,
    InvalidModel,
    ModelChanged,
    NncanonError,
    TokenizerNotFound,
    UntestedTransformersWarning,
)
from .families import Family
from .inference.loading import family_for_load, inferred_provenance
from .loading import (
    causal_lm_config,
    config_of,
    note_transformers_error,
    refuse_folder_without_weights,
    tokenizer_of,
    without_hub_kernels,
)
from .mounted import MountedModel
from .proof.cache import cache_key, config_state
from .proof.load import VERIFY_MODES, load_provenance
from .quantization import (
    Quantization,
    batch_coupling,
    declared,
    declared_coupling,
    detected,
    holds_quantized,
    refuse_unavailable,
    signature,
)
from .quiet import kernel_notices_filtered
from .versions import untested_transformers


def _kind(quantization: Quantization | None) -> tuple:
    """What must agree between the proof's and the model's quantization: method, scheme and dtype."""
    return (None, "", torch.float32) if quantization is None else (
        quantization.method, quantization.scheme, quantization.dtype)


def _unreplaced(quantization: Quantization | None) -> bool:
    """Whether a float32 model without quantized layers is what ``quantization`` loads: its quantizer replaced none
    of the model's layers (transformers' bitsandbytes replaces ``nn.Linear`` itself only, not Falcon's subclass),
    as it replaced none of the twin's."""
    return quantization is not None and quantization.method is not None and quantization.dtype == torch.float32


def _named(quantization: Quantization | None) -> str:
    return "in float32, unquantized" if quantization is None else f"quantized or cast as {quantization.describe()}"


def _layers(found: tuple) -> str:
    classes, dtype, dtypes = found
    mixed = f" (parameters in {' and '.join(dtypes)})" if len(dtypes) > 1 else ""
    return ", ".join(f"{count} {name}" for name, count in classes) + f"; {str(dtype).removeprefix('torch.')}{mixed}"


class StandardizedTransformer(MountedModel):
    """A decoder-only transformers model with one surface for every family.

    Args:
        model: A hub id, a local folder, or a built ``PreTrainedModel`` (then pass ``tokenizer=``).
        verify: ``"auto"`` (default): prove every value on a twin of this config (a shrunk copy with
            random weights, on the CPU) unless the proof cache has that proof; ``"always"``: prove it
            again; ``"never"``: serve the values unproved (``support()`` says so). A value whose proof
            fails is declined, naming the failed check and its numbers. See "How nncanon knows a
            value is right" in the docs.
        family: The `Family` to serve the model with, instead of the registered one for its model type.
        **kwargs: Go to transformers and nnsight as they do for ``TransformersModel``:
            ``device="cpu"``, ``device_map``, ``dtype``, ``attn_implementation``, ``dispatch``...

    The tokenizer pads on the left, so ``[:, -1]`` is every prompt's last token in a batch.
    Loading runs no forward pass on the model (the proof runs on the twin).

    Example:
        >>> model = StandardizedTransformer("openai-community/gpt2", attn_implementation="eager")
        >>> with model.trace("The Eiffel Tower is in the city of"):
        ...     attention = model.layers[9].self_attn.attention_output.save()
        ...     probs = model.next_token_probs.save()
    """

    def __init__(
        self, model: Any, *args: Any, tokenizer: Any = None, verify: str = "auto", family: Family | None = None,
        **kwargs: Any,
    ) -> None:
        if verify not in VERIFY_MODES:
            raise InvalidArgument(f"verify={verify!r} is not one of {', '.join(map(repr, VERIFY_MODES))}: "
                                  "'auto' (prove on a twin unless the cache has the proof), 'always', or 'never'")
        config = causal_lm_config(_readable_config(model, kwargs))
        quantization = declared(config, kwargs, model if isinstance(model, torch.nn.Module) else None)
        refuse_unavailable(quantization, kwargs)  # (before any weight is loaded)
        inferred = None
        if family is None:
            family, inferred = family_for_load(config, model, kwargs)
        without_hub_kernels(model, kwargs)
        if isinstance(model, torch.nn.Module):
            _refuse_without_head_or_tokenizer(model, family, tokenizer)
        untested = untested_transformers()
        if untested is not None:
            warnings.warn(untested, UntestedTransformersWarning, stacklevel=2)
        if not isinstance(model, torch.nn.Module):
            if kwargs.get("dispatch"):
                refuse_folder_without_weights(model, kwargs)
            kwargs.setdefault("task", "text-generation")
            if tokenizer is None:
                tokenizer = tokenizer_of(model, kwargs)
        try:
            super().__init__(model, *args, family=family, tokenizer=tokenizer, **kwargs)
        except Exception as error:
            unreadable = _unreadable_weights(model, error)
            if unreadable is not None:
                raise unreadable from error
            note_transformers_error(error, config)
            raise
        self._inferred = inferred
        self._quantization = quantization
        self._signature: tuple | None = None  # the proof's model as its layers hold it (`quantization.signature`)
        self._provenance = self._prove(verify, self._unserved)
        self._proved_config = _config_seen(self)
        _warn_if_the_tokenizer_exceeds_the_embedding(self)
        if quantization is not None:  # its quantized weights guarded from the load (a float32 one's first trace checks)
            self._check_unchanged()

    def _prove(self, verify: str, unserved: list | None = None) -> Any:
        """Prove this model's values on a twin of its config (see ``verify``); decline what fails.
        ``unserved``: what `mount` returned."""
        with kernel_notices_filtered():
            if self._inferred is None:
                return load_provenance(self, self._module.config, verify, unserved, self._quantization)
            return inferred_provenance(self, verify, unserved)

    @property
    def quantization(self) -> Quantization | None:
        """How the model is quantized or cast, as the proof's twin was (`nncanon.quantization.Quantization`:
        ``bitsandbytes nf4, compute float32``...); ``None`` for a float32 model."""
        return self._quantization

    def interleave(self, *args: Any, **kwargs: Any) -> Any:
        """Run a trace, first checking that the model is still the one its proof was made for (`ModelChanged`), and
        warning once where the model couples the tokens of a batch (`BatchCoupledWarning`)."""
        self._check_unchanged()
        self._warn_if_coupled()  # (a model on meta warns once its weights are loaded: `dispatch`)
        return super().interleave(*args, **kwargs)

    def _warn_if_coupled(self) -> None:
        """Warn `BatchCoupledWarning` once, at the first trace of a loaded model that couples a batch's tokens."""
        if (self._quantization is None or "_coupling_warned" in self.__dict__
                or getattr(self._module, "device", None) == torch.device("meta")):
            return
        coupling = self._batch_coupling()
        if coupling is not None:
            self.__dict__["_coupling_warned"] = True
            warnings.warn(f"this model computes the tokens of a batch together: {coupling}.", BatchCoupledWarning,
                          stacklevel=3)

    def _batch_coupling(self) -> str | None:
        """Why this model does not compute the tokens of a batch independently (`nncanon.quantization.batch_coupling`),
        ``None`` where it does."""
        if self._quantization is None:
            return None
        if getattr(self._module, "device", None) == torch.device("meta"):  # before the load: as its config declares
            return declared_coupling(self._quantization)
        return batch_coupling(self._module)  # (the layers' thresholds as they are now: a change after the load shows)

    def _check_unchanged(self) -> None:
        """Raise `ModelChanged` where the model's linear layers or dtype changed since the proof (a layer swapped
        for a quantized one, a cast): taken at the first trace of the loaded weights, compared at every later one."""
        if self.__dict__.get("_provenance") is None or getattr(self._module, "device", None) == torch.device("meta"):
            return
        now = signature(self._module)
        if self._signature is None:
            self._signature = now
            if holds_quantized(now):
                self.guard_quantized_weights()
            found = detected(self._module, now)
            if self._quantization is None and now[2] not in ((), ("float32",)):
                self._signature = None
                raise ModelChanged(
                    f"the model's parameters are in {' and '.join(now[2])}, but its proof was made for a float32 "
                    "model: part of it was cast after the load (the embedding left in float32 while the rest was "
                    "cast, or the reverse), and torch would refuse the mixed products. Cast all of it "
                    "(model._module.to(dtype)) and load it again as it is now (StandardizedTransformer(model, ...), "
                    "or dtype= at the load), so that the proof's twin is made like it."
                )
            if _kind(found) == _kind(self._quantization) or (found is None and _unreplaced(self._quantization)):
                return
            self._signature = None
            raise ModelChanged(
                f"the model is {_named(found)} but its proof was made for a model {_named(self._quantization)}: "
                "it was quantized or cast after the load. Load it as it is now (StandardizedTransformer(model, ...), "
                "or quantization_config=/dtype= at the load), so that the proof's twin is made like it."
            )
        if now != self._signature:
            raise ModelChanged(
                "the model changed since its proof: its linear layers or dtype are not those it was proved with "
                f"(now {_layers(now)}; proved with {_layers(self._signature)}): a layer was swapped (quantized) or "
                "the model cast after the load. Load it again as it is now, so that the proof's twin is made like it."
            )

    @property
    def inferred(self) -> Any:
        """The `nncanon.inference.InferredFamily` where no family is registered for this model type
        (its record was inferred from a twin and proved on it); ``None`` for a registered family."""
        return self._inferred

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # A remote request ships the model by value (nncanon is not on the server): it travels as the
        # MountedModel it is, the surface with its state, without the load and the proof, which the server never
        # runs (their code would travel with it otherwise, down to the proof's process-local state).
        return (MountedModel.__new__, (MountedModel,), self.__getstate__())

    def dispatch(self) -> None:
        """Load the real weights (a model built on meta); a folder with a config and no weights, or with a weight
        file that cannot be read, is refused by name."""
        if not self.dispatched and self.args:
            refuse_folder_without_weights(self.args[0], self.kwargs)
        try:
            super().dispatch()
        except Exception as error:
            unreadable = _unreadable_weights(self.args[0] if self.args else None, error)
            if unreadable is None:
                raise
            raise unreadable from error
        self._check_unchanged()  # the loaded layers are those the proof was made for (and their weights guarded)
        self._warn_if_coupled()

    def trace(self, *inputs: Any, **kwargs: Any) -> Any:
        """nnsight's trace (see `MountedModel.trace`), refused where the config changed since the load-time proof in
        a way that changes what the proof keyed on (`ConfigChanged`, naming what changed)."""
        _check_config(self)
        return super().trace(*inputs, **kwargs)


def _warn_if_the_tokenizer_exceeds_the_embedding(model: StandardizedTransformer) -> None:
    """Warn, at load, where the tokenizer has more tokens than the model's embedding has rows: its ids from the
    embedding's size on have no row (a trace of a prompt that holds one raises `InvalidInput`)."""
    tokenizer = getattr(model, "tokenizer", None)
    rows = getattr(model._text_config, "vocab_size", None)
    try:
        tokens = len(tokenizer) if tokenizer is not None else None
    except TypeError:
        return
    if isinstance(rows, int) and isinstance(tokens, int) and tokens > rows:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        warnings.warn(f"the tokenizer ({name}) has {tokens} tokens, but the model's embedding has {rows} rows "
                      f"(vocab_size={rows}): ids {rows}..{tokens - 1} have no row, and a trace of a prompt that holds "
                      "one raises InvalidInput. Is the tokenizer the model's?", UserWarning, stacklevel=3)


def _readable_config(model: Any, kwargs: dict) -> Any:
    """`config_of`, with a local folder's ``config.json`` named where transformers cannot read it: one that is not
    a JSON object (cut short, empty, ``null``) is an `InvalidCheckpoint`; any other error reading it (a field of
    the wrong type, no ``model_type``, custom code) is transformers' own, with one line naming the file."""
    try:
        return config_of(model, kwargs)
    except NncanonError:
        raise
    except Exception as error:
        folder = os.path.expanduser(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else None
        path = os.path.join(folder, kwargs.get("subfolder") or "", "config.json") if folder else None
        if path is None or not os.path.isfile(path):
            raise
        try:
            with open(path, "rb") as file:
                parsed = json.load(file)
        except (OSError, ValueError) as failure:
            parsed = failure
        if not isinstance(parsed, dict):
            found = (f"{type(parsed).__name__}: {parsed}" if isinstance(parsed, Exception)
                     else f"it holds {json.dumps(parsed)[:40]}")
            raise InvalidCheckpoint(
                f"the config file {path} is not a JSON object ({found}): it is cut short, empty or not a config. "
                "Save the model again (model.save_pretrained(folder)) or download it again."
            ) from error
        error.add_note(f"(raised reading the config file {path}: check that file, or save the model again)")
        raise

def _unreadable_weights(model: Any, error: Exception) -> InvalidCheckpoint | None:
    """`InvalidCheckpoint` naming the weight file of the local folder ``model`` that cannot be read, where one
    cannot (safetensors files are opened, their headers only), else ``None`` (``error`` is about something else)."""
    if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(os.path.expanduser(os.fspath(model))):
        return None
    folder = os.path.expanduser(os.fspath(model))
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            try:
                with safe_open(path, framework="pt"):
                    pass
            except Exception as failure:
                problem = f"({type(failure).__name__}: {failure}): it is cut short or is not a safetensors file"
                break
        elif name.endswith((".bin", ".pt", ".pth")) and not _torch_checkpoint(path):
            problem = ("(neither a zip archive, as torch.save writes, nor a pickle): it is cut short or is not a "
                       "PyTorch checkpoint")
            break
    else:
        return None
    return InvalidCheckpoint(
        f"the weight file {path} cannot be read {problem}. Save the model again (model.save_pretrained(folder)) "
        f"or download it again. (transformers raised {type(error).__name__}: {str(error)[:200]})"
    )


def _torch_checkpoint(path: str) -> bool:
    """Whether ``path`` can be a file of ``torch.save``: a whole zip archive (its directory at the end: a cut file
    has none), or a legacy pickle (not checked further)."""
    with open(path, "rb") as file:
        legacy = file.read(1) == b"\x80"
    return legacy or zipfile.is_zipfile(path)


def _refuse_without_head_or_tokenizer(module: torch.nn.Module, family: Family, tokenizer: Any) -> None:
    """Refuse a built model without the language-model head its family reads the logits from (a ``LlamaModel``
    rather than a ``LlamaForCausalLM``), or without a tokenizer to run it with (`TokenizerNotFound`)."""
    try:
        module.get_submodule(family.lm_head)
    except AttributeError:
        raise InvalidModel(
            f"StandardizedTransformer was given a {type(module).__name__}, which has no language-model head "
            f"({family.lm_head!r}): it is a base model, whose output is the last hidden state, not logits. nncanon "
            "serves causal language models: pass the causal-LM class (AutoModelForCausalLM.from_pretrained(...)), "
            "or its hub id or folder."
        ) from None
    named = getattr(getattr(module, "config", None), "_name_or_path", "")
    if tokenizer is None and not named:
        raise TokenizerNotFound(
            f"StandardizedTransformer was given a built {type(module).__name__} without tokenizer=, and its config "
            "names no checkpoint to load one from: pass tokenizer=AutoTokenizer.from_pretrained(<its hub id or "
            "folder>) (nncanon.testing.tiny_tokenizer() for the tiny test models)."
        )


def _config_seen(model: StandardizedTransformer) -> tuple[bytes | None, dict | None] | None:
    """What `_check_config` compares the config with: its state and entries when the proof was applied (``None``:
    no proof was made, ``verify="never"``)."""
    proof = getattr(model._provenance, "proof", None)
    if proof is None:
        return None
    config = model._module.config
    return _seen(config)


def _seen(config: Any) -> tuple[bytes | None, dict | None]:
    """``(state, entries)``: the entries taken now only where the state cannot be (they are read back from it)."""
    state = config_state(config)
    return state, _entries(config) if state is None else None


def _entries_seen(seen: tuple[bytes | None, dict | None]) -> dict | None:
    """The entries of the config as `_seen` took it: its own, or read back from its state (nncanon's own pickle)."""
    state, entries = seen
    if entries is not None or state is None:
        return entries
    cls, attributes = pickle.loads(state)
    config = cls.__new__(cls)
    config.__dict__.update(attributes)
    return _entries(config)


def _check_config(model: StandardizedTransformer) -> None:
    """Raise `ConfigChanged` where the model's config no longer has the proof's key (or, for a proof of one
    config, its digest): the proof, and the values served from it, were made for the config as loaded.

    The config's state is compared first (a pickle of it, tens of microseconds); only where it changed is the key
    computed again. A change the key does not see (``use_cache``, ``output_attentions``) is taken as the new state.
    """
    seen = model.__dict__.get("_proved_config")
    proof = getattr(model.__dict__.get("_provenance"), "proof", None)
    if seen is None or proof is None:
        return
    config = model._module.config
    state = config_state(config)
    if state is not None and state == seen[0]:
        return
    quantization = model.__dict__.get("_quantization")
    key = cache_key(config, model.family, type(model._module), None if quantization is None else quantization.key())
    if key == proof.key and proof.stands_for(config):
        model.__dict__["_proved_config"] = _seen(config)
        return
    changed = _changes(_entries_seen(seen), _entries(config))
    raise ConfigChanged(
        f"this model's config changed after its load-time proof ({changed}): the values nncanon serves were proved "
        "for the config as loaded, and the model now computes with another. Load the model again after changing "
        "the config (StandardizedTransformer(model, ...) proves the new config), or set it back."
    )


def _entries(config: Any) -> dict | None:
    """The config's entries, flattened to ``{"path": value}`` (nested configs by dotted path), for `_changes`."""
    try:
        flat: dict = {}

        def walk(values: dict, prefix: str) -> None:
            for name, value in values.items():
                if isinstance(value, dict):
                    walk(value, f"{prefix}{name}.")
                else:
                    flat[f"{prefix}{name}"] = value

        walk(config.to_dict(), "")
        return flat
    except Exception:  # (a custom config whose to_dict fails: the change is not named, still refused)
        return None


def _changes(before: dict | None, now: dict | None) -> str:
    """``residual_multiplier 0.22 -> 0.66, ...``: the entries that differ (at most five named)."""
    if before is None or now is None:
        return "its entries could not be listed"
    differ = [name for name in sorted(set(before) | set(now))
              if before.get(name, "<unset>") != now.get(name, "<unset>")]
    shown = [f"{name} {before.get(name, '<unset>')!r} -> {now.get(name, '<unset>')!r}" for name in differ[:5]]
    more = f", and {len(differ) - 5} more" if len(differ) > 5 else ""
    return ", ".join(shown) + more if shown else "an entry changed and was set back differently"
