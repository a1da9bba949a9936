"""nnterp 1.3 compatibility: run an nnterp 1.3 script on nncanon by changing only its imports.

``from nnterp import StandardizedTransformer`` becomes ``from nncanon.nnterp import StandardizedTransformer``
and ``from nnterp.interventions import logit_lens`` becomes ``from nncanon.nnterp.interventions import
logit_lens`` (also importable from here). The accessors of nnterp 1.3 are there, readable and
writable inside a trace: ``layers_input[i]``, ``layers_output[i]``, ``attentions_input[i]``,
``attentions_output[i]``, ``mlps_input[i]``, ``mlps_output[i]``, ``attentions[i]``, ``mlps[i]``,
``attention_probabilities[i]``, ``token_embeddings``, ``ln_final``, ``skip_layer(i)``,
``skip_layers(a, b)``, ``steer(...)``, ``project_on_vocab(h)``, ``get_topk_closest_tokens(h, k)``,
``logits``, ``next_token_probs``, ``input_ids``, ``attention_mask``.

**What changes: some values are now exact, so numbers can differ from nnterp 1.3.**

- ``attentions_output[i]`` and ``mlps_output[i]`` are nncanon's ``attention_output`` and
  ``mlp_output``: *exactly what the sublayer adds to the residual stream*. nnterp 1.3 returned the
  module's raw output, which is not the contribution on several families: it includes the
  residual on BLOOM and MPT, it is before the post-norm on Gemma-2/3, OLMo-2/3, GLM-4 and
  EXAONE-4, before ``residual_multiplier`` on Granite. On Llama-style and GPT-2 blocks the two
  are the same tensor. Writes go to the contribution too (zeroing it removes the sublayer).
- ``layers_output[i]`` / ``layers_input[i]`` are always a tensor (the residual stream), on every
  family; ``layers_output.returns_tuple`` is ``False`` and ``detect_layer_output_type()`` does nothing.
- ``project_on_vocab(h)`` is the family's final norm, head *and* logit post-processing
  (soft-capping, scaling), so at the last layer it equals the logits; nnterp 1.3 applied only the
  norm and the head. `logit_lens` and ``get_topk_closest_tokens`` use it.
- ``attentions_input[i]`` and ``mlps_input[i]`` are the modules' first inputs, as in nnterp 1.3
  (the normed stream the sublayer reads). ``attention_probabilities[i]`` are nncanon's (load with
  ``enable_attention_probs=True`` or ``attn_implementation="eager"``).
- nnterp's other modules are here under the same names: ``nncanon.nnterp.nnsight_utils``,
  ``nncanon.nnterp.prompt_utils``, ``nncanon.nnterp.rename_utils`` (`RenameConfig`,
  `get_rename_dict`, `ModuleAccessor`), and ``it_repeat_prompt``, ``patchscope_generate``,
  ``patch_object_attn_lens`` in ``nncanon.nnterp.interventions``. nnterp's renamed module tree is
  there as aliases of the same envoys: ``model.model.layers`` (also GPT-2's ``transformer.h``),
  ``model.model.ln_final``, ``model.model.embed_tokens``; ``model._model`` is the transformers model.
- nnterp 1.3.0's own test suite runs against this module (``tests/nnterp_upstream/``); the items
  that differ on purpose are listed, with the figure, in the docs ("Migrating from nnterp 1.3").
- Loading: ``check_renaming``, ``allow_dispatch``, ``check_attn_probs_with_trace``,
  ``allow_multimodal`` and ``rename_config`` are accepted and unused (the family registry does
  that work); ``rename=`` is not supported (an unregistered model raises
  `nncanon.UnknownFamilyError`), nor is ``remote=True``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..model import StandardizedTransformer as _Standardized
from ..tools.steering import steer as _steer
from .interventions import (
    TargetPrompt,
    TargetPromptBatch,
    it_repeat_prompt,
    logit_lens,
    patch_object_attn_lens,
    patchscope_generate,
    patchscope_lens,
    repeat_prompt,
)
from .nnsight_utils import ModuleAccessor
from .rename_utils import RenameConfig, get_rename_dict

_LAYER_VALUES = {"layer_input", "layer_output"}


class LayerAccessor:
    """``model.layers_output[i]`` and friends: read or write one value of block ``i`` inside a trace."""

    def __init__(self, model: Any, component: str | None, value: str | None) -> None:
        self.model = model
        self.component = component
        self.value = value

    def get_module(self, layer: int) -> Any:
        """The envoy of block ``layer`` (or of its attention / MLP)."""
        block = self.model.layers[layer]
        return block if self.component is None else getattr(block, self.component)

    def __getitem__(self, layer: int) -> Any:
        module = self.get_module(layer)
        if self.value is None:
            return module
        if self.value == "input":
            return module.input
        return getattr(module, self.value)

    def __setitem__(self, layer: int, value: Any) -> None:
        if self.value is None:
            name = self.component or "layers"
            raise ValueError(f"Cannot set the value of a module accessor. Did you mean {name}_input/output?")
        module = self.get_module(layer)
        if self.value == "input":
            module.input = value
        else:
            setattr(module, self.value, value)

    def __call__(self, layer: int) -> Any:
        return self[layer]

    @property
    def returns_tuple(self) -> bool:
        """nnterp 1.3 API: always ``False``, the values are tensors on every family."""
        return False


class AttentionProbabilitiesAccessor:
    """``model.attention_probabilities[i]``: block ``i``'s attention probabilities ``[b, H, q, k]`` (eager only)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.model.layers[layer].self_attn.attention_probabilities

    def __setitem__(self, layer: int, value: torch.Tensor) -> None:
        self.model.layers[layer].self_attn.attention_probabilities = value

    @property
    def enabled(self) -> bool:
        return self.model.attn_implementation == "eager"

    def print_source(self, layer: int = 0, allow_dispatch: bool = True) -> None:
        """Print the operation of block ``layer``'s attention whose input is served, then the module's source.

        ``allow_dispatch`` is accepted and unused (reading the source loads no weights).
        """
        attention = self.model.layers[layer].self_attn
        with self.model.scan("Hello"):  # the operation inside a nested call is found while a forward runs
            print("Accessing attention probabilities from:")
            print(attention._probability_operation())
        print("\n\nFull module source:")
        print(attention.source)


def _alias(host: Any, name: str, target: Any) -> None:
    """Bind ``host.<name>`` to the envoy ``target`` unless ``host`` already answers to ``name``."""
    if target is None or name in host.__dict__ or hasattr(type(host), name) or hasattr(host._module, name):
        return
    object.__setattr__(host, name, target)
    host._aliases[name] = target.path[len(host.path) + 1:] if host.path else target.path


def _bind_nnterp_names(model: Any) -> None:
    """nnterp 1.3's renamed module tree, as aliases of the same envoys.

    ``model.model`` is the backbone (GPT-2's ``transformer``...), and it holds ``layers``,
    ``ln_final`` and ``embed_tokens``; each block already has ``self_attn`` and ``mlp`` (nncanon's
    standard names). Native names stay.
    """
    backbone = model.layers.path.rpartition(".")[0]
    host = model.get(backbone.partition(".")[2]) if "." in backbone else model
    if host is not model:
        _alias(model, "model", host)
    _alias(host, "layers", model.layers)
    _alias(host, "ln_final", model.norm)
    _alias(host, "embed_tokens", model.embed_tokens)


class StandardizedTransformer(_Standardized):
    """nncanon's `StandardizedTransformer` with nnterp 1.3's loading arguments and accessors.

    Differences from nnterp 1.3 (exact contributions, the full ``project_on_vocab``) are in this
    module's docstring.
    """

    def __init__(
        self,
        model: Any,
        trust_remote_code: bool = False,
        check_renaming: bool = True,
        remote: bool = False,
        allow_dispatch: bool = True,
        enable_attention_probs: bool = False,
        check_attn_probs_with_trace: bool = True,
        allow_multimodal: bool = False,
        rename_config: Any = None,
        **kwargs: Any,
    ) -> None:
        if remote:
            raise NotImplementedError("nncanon.nnterp does not run on NDIF (remote=True); run locally")
        if kwargs.pop("rename", None) is not None:
            raise NotImplementedError(
                "rename= is not supported: nncanon finds each family's modules from its registry "
                "(nncanon/families/); an unregistered model raises UnknownFamilyError"
            )
        if enable_attention_probs:
            implementation = kwargs.get("attn_implementation")
            if implementation not in (None, "eager"):
                raise ValueError(
                    f"Cannot use attn_implementation='{implementation}' with enable_attention_probs=True. "
                    "Either set enable_attention_probs=False or don't pass attn_implementation."
                )
            kwargs["attn_implementation"] = "eager"
        if trust_remote_code:
            kwargs["trust_remote_code"] = True
        tokenizer_kwargs = kwargs.pop("tokenizer_kwargs", None) or {}
        if isinstance(model, str):
            kwargs.setdefault("device_map", "auto")
        super().__init__(model, **kwargs)
        for key, value in tokenizer_kwargs.items():
            setattr(self.tokenizer, key, value)
        self.layers_input = LayerAccessor(self, None, "layer_input")
        self.layers_output = LayerAccessor(self, None, "layer_output")
        self.attentions = LayerAccessor(self, "self_attn", None)
        self.attentions_input = LayerAccessor(self, "self_attn", "input")
        self.attentions_output = LayerAccessor(self, "self_attn", "attention_output")
        self.mlps = LayerAccessor(self, "mlp", None)
        self.mlps_input = LayerAccessor(self, "mlp", "input")
        self.mlps_output = LayerAccessor(self, "mlp", "mlp_output")
        self.attention_probabilities = AttentionProbabilitiesAccessor(self)
        self._add_prefix_false_tokenizer = None
        _bind_nnterp_names(self)

    # -- nnterp 1.3 properties -----------------------------------------------

    @property
    def _model(self) -> Any:
        """The wrapped transformers model (nnterp 1.3 and nnsight 0.5 spell it ``_model``)."""
        return self._module

    @property
    def ln_final(self) -> Any:
        """The final norm (``model.norm``)."""
        return self.norm

    @property
    def attn_probs_available(self) -> bool:
        return self.attention_probabilities.enabled

    @property
    def token_embeddings(self) -> torch.Tensor:
        """The token embeddings (``embed_tokens``' output), inside a trace."""
        return self.embed_tokens.output

    @token_embeddings.setter
    def token_embeddings(self, value: torch.Tensor) -> None:
        self.embed_tokens.output = value

    @property
    def input_ids(self) -> torch.Tensor:
        """The batch's input ids, inside a trace."""
        return self.inputs[1]["input_ids"]

    @property
    def input_size(self) -> torch.Size:
        return self.input_ids.shape

    @property
    def attention_mask(self) -> torch.Tensor:
        """The batch's attention mask, inside a trace."""
        return self.inputs[1]["attention_mask"]

    @property
    def add_prefix_false_tokenizer(self) -> Any:
        """The tokenizer with ``add_prefix_space=False`` (the model's own where it cannot be reloaded)."""
        if self._add_prefix_false_tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._add_prefix_false_tokenizer = AutoTokenizer.from_pretrained(
                    self._module.config.name_or_path, add_prefix_space=False
                )
            except (OSError, ValueError, TypeError):
                self._add_prefix_false_tokenizer = self.tokenizer
        return self._add_prefix_false_tokenizer

    # -- nnterp 1.3 methods --------------------------------------------------

    def detect_layer_output_type(self) -> None:
        """nnterp 1.3 API: nothing to detect, the layer values are tensors on every family."""

    def skip_layer(self, layer: int, skip_with: torch.Tensor | None = None) -> None:
        """Skip block ``layer`` (it does not run; the stream passes)."""
        self.skip_layers(layer, layer, skip_with)

    def skip_layers(
        self,
        start_layer: int,
        end_layer: int | None = None,
        skip_with: torch.Tensor | None = None,
        layer_returns_tuple: bool | None = None,
    ) -> None:
        """Skip blocks ``start_layer..end_layer`` (inclusive); ``layer_returns_tuple`` is accepted and unused."""
        if isinstance(skip_with, tuple):
            skip_with = skip_with[0]
        super().skip_layers(start_layer, end_layer, skip_with)

    def steer(  # type: ignore[override]
        self,
        layers: int | list[int],
        steering_vector: torch.Tensor,
        factor: float = 1,
        positions: Any = None,
        token_positions: Any = None,
        batch_index: Any = None,
    ) -> None:
        """nnterp 1.3's ``steer``: ``layers_output[l][batch_index, token_positions] += factor * steering_vector``."""
        if positions is not None:
            if token_positions is not None:
                raise ValueError("Cannot specify both `positions` (deprecated) and `token_positions`.")
            warnings.warn("`positions` is deprecated, use `token_positions` instead.", DeprecationWarning, stacklevel=2)
            token_positions = positions
        if batch_index is None:
            _steer(self, layers, steering_vector, factor, token_positions)
            return
        for layer in sorted([layers] if isinstance(layers, int) else layers):
            output = self.layers[layer].layer_output
            added = (factor * steering_vector).to(device=output.device, dtype=output.dtype)
            if token_positions is None:
                output[batch_index] += added
            else:
                output[batch_index, token_positions] += added

    def probs_to_dict(self, tokens: torch.Tensor, probs: torch.Tensor) -> dict[str, float]:
        """Token strings to probabilities."""
        return {
            token: prob.item() for token, prob in zip(self.tokenizer.convert_ids_to_tokens(tokens), probs, strict=True)
        }

    def get_topk_closest_tokens(self, hidden_state: torch.Tensor, k: int = 5) -> dict | list[dict]:
        """The ``k`` most likely tokens of ``project_on_vocab(hidden_state)``; ``[hidden]`` or ``[batch, hidden]``."""
        if hidden_state.shape[-1] != self.hidden_size:
            raise ValueError(
                f"Hidden state shape {hidden_state.shape} does not match model hidden size {self.hidden_size}."
            )
        probs = self.project_on_vocab(hidden_state).softmax(-1)
        top = torch.topk(probs, k=k, dim=-1)
        if hidden_state.ndim == 1:
            return self.probs_to_dict(top.indices, top.values)
        if hidden_state.ndim == 2:
            return [self.probs_to_dict(top.indices[i], top.values[i]) for i in range(hidden_state.shape[0])]
        raise ValueError(f"Unsupported hidden state shape {hidden_state.shape}. Expected 1D or 2D tensor.")


__all__ = [
    "AttentionProbabilitiesAccessor",
    "LayerAccessor",
    "ModuleAccessor",
    "RenameConfig",
    "StandardizedTransformer",
    "TargetPrompt",
    "TargetPromptBatch",
    "get_rename_dict",
    "it_repeat_prompt",
    "logit_lens",
    "patch_object_attn_lens",
    "patchscope_generate",
    "patchscope_lens",
    "repeat_prompt",
]
