"""nnterp 1.3's ``nnterp.rename_utils``: its rename map and config readers.

`nncanon.nnterp.StandardizedTransformer` finds each family's modules from nncanon's family registry,
not from this map; the map is here for `ModuleAccessor` and for scripts that build their own
``NNsight(model, rename=get_rename_dict())``. A `RenameConfig` passed to the nncanon model is
accepted and unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Containers nnterp renames to ``model`` (GPT-2's ``transformer``, GPT-NeoX's ``gpt_neox``...).
MODEL_NAMES = ["transformer", "gpt_neox", "decoder", "language_model"]


def _expand_path_with_model(paths: list[str]) -> list[str]:
    """``model.x`` also under each container name (``model.transformer.x``...)."""
    nested = [path.replace("model.", f"model.{name}.") for name in MODEL_NAMES for path in paths
              if path.startswith("model.")]
    return paths + nested


ATTENTION_NAMES = ["attn", "self_attention", "attention", "norm_attn_norm"]
LAYER_NAMES = _expand_path_with_model(["h", "blocks", "model.layers"])
LN_NAMES = _expand_path_with_model(["final_layer_norm", "ln_f", "norm_f", "norm", "embedding_norm", "model.ln_final"])
LM_HEAD_NAMES = ["embed_out"]
MLP_NAMES = ["block_sparse_moe", "ffn"]
EMBED_TOKENS_NAMES = _expand_path_with_model(["wte", "embed_in", "word_embeddings", "model.embed_tokens"])


class RenamingError(Exception):
    """nnterp 1.3's error for a module it cannot find."""


@dataclass
class RenameConfig:
    """nnterp 1.3's custom module names and config keys for an architecture it does not know.

    nncanon reads a family's modules and sizes from its registry (``nncanon/families/``), so a
    `StandardizedTransformer` ignores it; `get_rename_dict` and the ``get_*`` readers here use it.
    """

    attn_name: str | list[str] | None = None
    mlp_name: str | list[str] | None = None
    ln_final_name: str | list[str] | None = None
    lm_head_name: str | list[str] | None = None
    model_name: str | list[str] | None = None
    layers_name: str | list[str] | None = None
    attn_prob_source: Any = None
    ignore_mlp: bool | None = None
    ignore_attn: bool | None = None
    attn_head_config_key: str | list[str] | int | None = None
    hidden_size_config_key: str | list[str] | int | None = None
    vocab_size_config_key: str | list[str] | int | None = None


def get_rename_dict(rename_config: RenameConfig | None = None) -> dict[str, str]:
    """nnterp 1.3's nnsight ``rename`` map: native module names to nnterp's standard ones."""
    rename: dict[str, str] = {}
    if rename_config is not None:
        for standard, names in (
            ("model", rename_config.model_name),
            ("layers", rename_config.layers_name),
            ("self_attn", rename_config.attn_name),
            ("mlp", rename_config.mlp_name),
            ("ln_final", rename_config.ln_final_name),
            ("lm_head", rename_config.lm_head_name),
        ):
            for name in [names] if isinstance(names, str) else names or []:
                rename[name] = standard
    rename.update(
        {name: "model" for name in MODEL_NAMES}
        | {name: "layers" for name in LAYER_NAMES}
        | {name: "self_attn" for name in ATTENTION_NAMES}
        | {name: "mlp" for name in MLP_NAMES}
        | {name: "ln_final" for name in LN_NAMES}
        | {name: "lm_head" for name in LM_HEAD_NAMES}
        | {name: "embed_tokens" for name in EMBED_TOKENS_NAMES}
    )
    return rename


def text_config(model: Any) -> Any:
    """The model's text config (the config itself on a text-only model)."""
    return model.config.get_text_config()


def _config_value(model: Any, keys: list[str], override: Any) -> int | None:
    if isinstance(override, int):
        return override
    if isinstance(override, str):
        keys = [*keys, override]
    elif isinstance(override, list):
        keys = [*keys, *override]
    elif override is not None:
        raise ValueError(f"Invalid config key {override!r}: expected None, a str, a list of str or an int")
    config = text_config(model)
    for key in keys:
        if getattr(config, key, None) is not None:
            return getattr(config, key)
    return None


def get_num_attention_heads(model: Any, raise_error: bool = True, rename_config: RenameConfig | None = None
                            ) -> int | None:
    """The config's number of attention heads."""
    override = rename_config.attn_head_config_key if rename_config is not None else None
    value = _config_value(model, ["n_heads", "num_attention_heads", "n_head", "num_heads"], override)
    if value is None and raise_error:
        raise ValueError(f"No attention-head count in the config of {type(model).__name__}")
    return value


def get_hidden_size(model: Any, raise_error: bool = True, rename_config: RenameConfig | None = None) -> int | None:
    """The config's hidden size."""
    override = rename_config.hidden_size_config_key if rename_config is not None else None
    value = _config_value(model, ["hidden_size", "d_model", "n_embd"], override)
    if value is None and raise_error:
        raise ValueError(f"No hidden size in the config of {type(model).__name__}")
    return value


def get_vocab_size(model: Any, raise_error: bool = True, rename_config: RenameConfig | None = None) -> int | None:
    """The config's vocabulary size."""
    override = rename_config.vocab_size_config_key if rename_config is not None else None
    value = _config_value(model, ["vocab_size", "n_vocab"], override)
    if value is None and raise_error:
        raise ValueError(f"No vocabulary size in the config of {type(model).__name__}")
    return value


def get_ignores(model: Any, rename_config: RenameConfig | None = None) -> list[str]:
    """The standard modules this model has no module for: ``["mlp"]`` on OPT (its MLP is fc1/fc2 in the block).

    On a `StandardizedTransformer` every block has an ``mlp`` (nncanon serves OPT's MLP
    contribution), but the raw module tree has none, as in nnterp 1.3.
    """
    from transformers import OPTForCausalLM

    ignores = ["mlp"] if isinstance(model, OPTForCausalLM) else []
    if rename_config is not None:
        if rename_config.ignore_mlp:
            ignores.append("mlp")
        if rename_config.ignore_attn:
            ignores.append("attention")
    return ignores
