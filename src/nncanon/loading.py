"""Loading what the user passed: its config without weights, its causal-LM config, its tokenizer, and the refusals
of what cannot be served (hub kernels, a folder with a config but no weights), with transformers' own errors
marked as coming from the config."""

from __future__ import annotations

import os
from typing import Any

import torch

from .errors import InvalidModel, ModelUnavailable, TokenizerNotFound
from .hub import alternatives, check_reachable

_HUB_KERNELS = (
    "transformers' hub kernels (`use_kernels=True`, `kernel_config=`, `kernelize`) replace modules' forwards "
    "with kernels downloaded from the hub, which the load-time proof's twin does not run, so nncanon could not "
    "vouch for a value read inside them"
)


def without_hub_kernels(model: Any, kwargs: dict) -> None:
    """Load with transformers' hub kernels off (``use_kernels=False``; transformers 5.25 turns them on by
    default in ``from_pretrained``); refuse them where the user asked for them or passed a kernelized model."""
    if kwargs.get("use_kernels") or kwargs.get("kernel_config") is not None:
        raise InvalidModel(f"{_HUB_KERNELS}. Leave out use_kernels= and kernel_config= (nncanon loads without them).")
    if isinstance(model, torch.nn.Module):
        if getattr(model, "use_kernels", False):
            raise InvalidModel(
                f"{type(model).__name__} was loaded with hub kernels: {_HUB_KERNELS}. Load it with "
                "from_pretrained(..., use_kernels=False), or pass its hub id or folder to StandardizedTransformer."
            )
    else:
        kwargs["use_kernels"] = False


def config_of(model: Any, kwargs: dict) -> Any:
    """The config of what the user passed, read without loading weights."""
    if kwargs.get("config") is not None:
        return kwargs["config"]
    if isinstance(model, torch.nn.Module):
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "get_text_config"):
            raise InvalidModel(
                f"StandardizedTransformer was given a {type(model).__name__} with no transformers config "
                "(.config): it serves transformers causal LMs. Pass a hub id, a saved folder, or a "
                "PreTrainedModel (AutoModelForCausalLM...) with tokenizer=."
            )
        return config
    if not isinstance(model, (str, os.PathLike)):
        raise InvalidModel(
            f"StandardizedTransformer was given a {type(model).__name__}; pass a hub id, a local folder or "
            "a transformers PreTrainedModel."
        )
    model = os.fspath(model)
    from transformers import AutoConfig

    options = {k: kwargs[k] for k in ("revision", "trust_remote_code", "token") if k in kwargs}
    check_reachable(model, options)
    try:
        return AutoConfig.from_pretrained(model, **options)
    except OSError as error:
        if _offline_miss(error):
            raise ModelUnavailable(alternatives(model)) from error
        raise


def _offline_miss(error: OSError) -> bool:
    """Whether transformers' error says the files are neither reachable nor cached (``HF_HUB_OFFLINE=1``...)."""
    text = str(error)
    return "couldn't connect" in text or "offline mode" in text or "local_files_only" in text


def causal_lm_config(config: Any, text: Any = None) -> Any:
    """The config the causal-LM class is built from.

    A multimodal checkpoint whose causal-LM class is its text model (Qwen3.5, Qwen3.5-MoE, Llama-4)
    is built from its text config (``model_type`` ``qwen3_5_text``...); transformers maps the
    checkpoint's language-model weights onto it. Others are built from the config itself. ``text``:
    ``config.get_text_config()``, where the caller has it.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text = config.get_text_config() if text is None else text
    if text is config or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return config
    built = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return text if getattr(built, "config_class", None) is type(text) else config


def tokenizer_of(model: str, kwargs: dict) -> Any:
    """The checkpoint's tokenizer (transformers 5.24's pipeline no longer infers it for nnsight's meta load)."""
    from transformers import AutoTokenizer

    folder = os.path.expanduser(os.fspath(model))
    if os.path.isdir(folder) and not any(os.path.exists(os.path.join(folder, name)) for name in _TOKENIZER_FILES):
        raise TokenizerNotFound(
            f"the folder {model!r} has no tokenizer files (none of {', '.join(_TOKENIZER_FILES)}): save the "
            "tokenizer beside the model (tokenizer.save_pretrained(folder)), or pass tokenizer=."
        )
    options = {k: kwargs[k] for k in ("revision", "trust_remote_code", "token") if k in kwargs}
    return AutoTokenizer.from_pretrained(model, **options)


#: Suffixes of the weight files transformers loads from a folder (safetensors, torch pickles, their shard indices).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


def refuse_folder_without_weights(model: Any, kwargs: dict) -> None:
    """Raise `ModelUnavailable` where ``model`` is a local folder with no weight file (a config alone).

    Such a folder loads on meta (``support()`` and the proof need no weights); running it needs them, and
    transformers' own error arrives wrapped in nnsight's, tracebacks and all, from the first trace.
    """
    if not isinstance(model, (str, os.PathLike)) or kwargs.get("gguf_file") or kwargs.get("subfolder"):
        return
    folder = os.path.expanduser(os.fspath(model))
    if not os.path.isdir(folder) or any(name.endswith(_WEIGHT_SUFFIXES) for name in os.listdir(folder)):
        return
    raise ModelUnavailable(
        f"the folder {os.fspath(model)!r} has a config but no weights (no model.safetensors, pytorch_model.bin or "
        "shard index): nncanon builds it on meta without them, which serves support() and the load-time proof, "
        "but running the model needs its weights. Save them beside the config (model.save_pretrained(folder)), "
        "or load the folder that holds them."
    )


#: Files of which a saved tokenizer has at least one.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model", "tekken.json")


def note_transformers_error(error: Exception, config: Any) -> None:
    """Add one line to an error transformers raised building the model: it came from the config, not nncanon."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    if frames and f"{os.sep}transformers{os.sep}" in frames[-1].filename:
        error.add_note(
            f"(transformers raised this building a model of this {type(config).__name__} "
            f"(model_type {getattr(config, 'model_type', None)!r}) from its config, before nncanon ran on it: "
            "transformers itself cannot build this config; fix the config, or report it to transformers)"
        )
