"""nnterp 1.3's ``nnterp.nnsight_utils``: module getters and activation collectors.

On an nncanon `StandardizedTransformer` the getters return nncanon's exact values: ``get_layer_output``
is ``layers[i].layer_output``, ``get_attention_output`` is ``self_attn.attention_output`` (what
attention adds to the residual stream), ``get_mlp_output`` is ``mlp.mlp_output``, ``project_on_vocab``
is the model's own (final norm, head and logit post-processing). On any other nnsight model (a
``LanguageModel`` with nnterp's ``model.model.layers`` layout, as in nnterp 1.3) they read the raw
module values, first element of a tuple.

Shapes: layer values are ``[batch, seq, hidden]``; logits ``[batch, seq, vocab]``; the collectors
return ``[num_layers, num_prompts, hidden]`` on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..model import StandardizedTransformer as _Standardized
from .rename_utils import RenameConfig, get_rename_dict

GetModuleOutput = Callable[[Any, int], Any]


def _standard(model: Any) -> bool:
    return isinstance(model, _Standardized)


def unpack_tuple(value: Any) -> Any:
    """The first element of a module's tuple output; the value itself otherwise."""
    return value[0] if isinstance(value, tuple) else value


def get_embed_tokens(model: Any) -> Any:
    """The token embedding module."""
    return model.embed_tokens if _standard(model) else model.model.embed_tokens


def get_layers(model: Any) -> Any:
    """The blocks (``model.layers``; ``model.model.layers`` on a plain nnsight model)."""
    return model.layers if _standard(model) else model.model.layers


def get_num_layers(nn_model: Any) -> int:
    """The number of blocks."""
    return len(get_layers(nn_model))


def get_layer(nn_model: Any, layer: int) -> Any:
    """Block ``layer``'s envoy."""
    return get_layers(nn_model)[layer]


def get_layer_input(nn_model: Any, layer: int) -> Any:
    """The residual stream entering block ``layer``, ``[batch, seq, hidden]``."""
    block = get_layer(nn_model, layer)
    return block.layer_input if _standard(nn_model) else block.input


def get_layer_output(nn_model: Any, layer: int) -> Any:
    """The residual stream after block ``layer``, ``[batch, seq, hidden]``."""
    block = get_layer(nn_model, layer)
    return block.layer_output if _standard(nn_model) else unpack_tuple(block.output)


def get_attention(nn_model: Any, layer: int) -> Any:
    """Block ``layer``'s attention envoy."""
    return get_layer(nn_model, layer).self_attn


def get_attention_output(nn_model: Any, layer: int) -> Any:
    """What block ``layer``'s attention adds to the stream (nncanon); the module's output otherwise."""
    attention = get_attention(nn_model, layer)
    return attention.attention_output if _standard(nn_model) else unpack_tuple(attention.output)


def get_mlp(nn_model: Any, layer: int) -> Any:
    """Block ``layer``'s MLP envoy."""
    return get_layer(nn_model, layer).mlp


def get_mlp_output(nn_model: Any, layer: int) -> Any:
    """What block ``layer``'s MLP adds to the stream (nncanon); the module's output otherwise."""
    mlp = get_mlp(nn_model, layer)
    return mlp.mlp_output if _standard(nn_model) else unpack_tuple(mlp.output)


def get_logits(nn_model: Any) -> Any:
    """The logits, ``[batch, seq, vocab]``."""
    return nn_model.logits if _standard(nn_model) else nn_model.output.logits


def get_unembed_norm(nn_model: Any) -> Any:
    """The final norm's envoy."""
    return nn_model.norm if _standard(nn_model) else nn_model.model.norm


def get_unembed(nn_model: Any) -> Any:
    """The unembedding (``lm_head``)."""
    return nn_model.lm_head


def project_on_vocab(nn_model: Any, h: Any) -> Any:
    """``h`` through the final norm and the head (nncanon: also the family's logit post-processing)."""
    if _standard(nn_model):
        return nn_model.project_on_vocab(h)
    return nn_model.lm_head(get_unembed_norm(nn_model)(h))


def get_next_token_probs(nn_model: Any) -> Any:
    """The next-token probabilities at the last position, ``[batch, vocab]``."""
    return get_logits(nn_model)[:, -1, :].softmax(-1)


def set_layer_output(nn_model: Any, layer: int, tensor: Any) -> None:
    """Replace block ``layer``'s output stream by ``tensor``."""
    block = get_layer(nn_model, layer)
    if _standard(nn_model):
        block.layer_output = tensor
    elif isinstance(block.output, tuple):
        block.output = (tensor, *block.output[1:])
    else:
        block.output = tensor


class ModuleAccessor:
    """The ``torch.nn.Module`` objects of a transformers model under nnterp's standard names.

    ``embed_tokens``, ``layers`` (each with ``self_attn`` and ``mlp``), ``ln_final`` and ``lm_head``,
    found with nnsight's ``rename`` and `get_rename_dict`.

    Args:
        model: A transformers ``PreTrainedModel``.
        rename_config: Extra native names for an architecture nnterp's map does not know.
        rename: Extra ``{native: standard}`` entries.
    """

    def __init__(self, model: nn.Module, rename_config: RenameConfig | None = None,
                 rename: dict[str, str] | None = None) -> None:
        from nnsight import NNsight

        full = get_rename_dict(rename_config=rename_config)
        full.update(rename or {})
        self.nn_model = NNsight(model, rename=full)

    def __getattr__(self, name: str) -> nn.Module:
        attribute = getattr(self.nn_model, name)
        if not hasattr(attribute, "_module"):
            raise AttributeError(f"Attribute {name} is not a module")
        return attribute._module

    def get_embed_tokens(self) -> nn.Module:
        return self.nn_model.embed_tokens._module

    def get_layers(self) -> nn.ModuleList:
        return self.nn_model.layers._module

    def get_mlp(self, layer: int) -> nn.Module:
        return self.nn_model.layers[layer].mlp._module

    def get_attention(self, layer: int) -> nn.Module:
        return self.nn_model.layers[layer].self_attn._module

    def get_unembed_norm(self) -> nn.Module:
        return self.nn_model.ln_final._module

    def get_unembed(self) -> nn.Module:
        return self.nn_model.lm_head._module


def _check_index(nn_model: Any, idx: int) -> None:
    side = nn_model.tokenizer.padding_side
    if idx < 0 and side != "left":
        raise ValueError(f"negative index is currently only supported with left padding, not {side}")
    if idx > 0 and side != "right":
        raise ValueError(f"positive index is currently only supported with right padding, not {side}")


@torch.no_grad()
def get_token_activations(
    nn_model: Any,
    prompts: Any = None,
    layers: list[int] | None = None,
    get_activations: GetModuleOutput | None = None,
    remote: bool = False,
    idx: int | None = None,
    tracer: Any = None,
) -> torch.Tensor:
    """The activation at token ``idx`` (default the last) of each prompt at each layer.

    Returns:
        ``[num_layers, num_prompts, hidden]`` on the CPU (inside a given ``tracer``: on the model's device).
    """
    if remote:
        raise NotImplementedError("nncanon.nnterp does not run on NDIF (remote=True)")
    if tracer is None and prompts is None:
        raise ValueError("prompts must be provided if tracer is None")
    get_activations = get_activations or get_layer_output
    idx = -1 if idx is None else idx
    _check_index(nn_model, idx)
    layers = list(range(get_num_layers(nn_model))) if layers is None else layers
    order = sorted(range(len(layers)), key=lambda i: layers[i] % get_num_layers(nn_model))
    acts: list[Any] = [None] * len(layers)
    if tracer is not None:
        for i in order:  # nnsight reads values in forward order
            acts[i] = get_activations(nn_model, layers[i])[:, idx]
        return torch.stack(acts)
    with nn_model.trace(prompts) as tracer:
        for i in order:
            acts[i] = get_activations(nn_model, layers[i])[:, idx].cpu().save()
        tracer.stop()
    return torch.stack(acts)


@torch.no_grad()
def collect_last_token_activations_session(
    nn_model: Any,
    prompts: list[str],
    batch_size: int,
    layers: list[int] | None = None,
    get_activations: GetModuleOutput | None = None,
    remote: bool = False,
    idx: int | None = None,
) -> torch.Tensor:
    """`get_token_activations` over batches of ``batch_size`` prompts, ``[num_layers, num_prompts, hidden]``."""
    return collect_token_activations_batched(
        nn_model, prompts, batch_size, layers, get_activations, remote, idx, use_session=False
    )


def collect_token_activations_batched(
    nn_model: Any,
    prompts: list[str],
    batch_size: int,
    layers: list[int] | None = None,
    get_activations: GetModuleOutput | None = None,
    remote: bool = False,
    idx: int | None = None,
    tqdm: Any = None,
    use_session: bool = True,
) -> torch.Tensor:
    """`get_token_activations` over batches of ``batch_size`` prompts, ``[num_layers, num_prompts, hidden]``.

    ``use_session`` is accepted and unused (a session only mattered for NDIF).
    """
    starts = range(0, len(prompts), batch_size)
    if tqdm is not None:
        starts = tqdm(starts)
    acts = [get_token_activations(nn_model, prompts[i:i + batch_size], layers, get_activations, remote, idx)
            for i in starts]
    return torch.cat(acts, dim=1)


def compute_next_token_probs(nn_model: Any, prompt: str | list[str], remote: bool = False) -> torch.Tensor:
    """The next-token probabilities of each prompt, ``[num_prompts, vocab]`` on the CPU."""
    if remote:
        raise NotImplementedError("nncanon.nnterp does not run on NDIF (remote=True)")
    with torch.no_grad(), nn_model.trace(prompt):
        probs = get_next_token_probs(nn_model).cpu().save()
    return probs


__all__ = [
    "ModuleAccessor",
    "collect_last_token_activations_session",
    "collect_token_activations_batched",
    "compute_next_token_probs",
    "get_attention",
    "get_attention_output",
    "get_embed_tokens",
    "get_layer",
    "get_layer_input",
    "get_layer_output",
    "get_layers",
    "get_logits",
    "get_mlp",
    "get_mlp_output",
    "get_next_token_probs",
    "get_num_layers",
    "get_token_activations",
    "get_unembed",
    "get_unembed_norm",
    "project_on_vocab",
    "set_layer_output",
]
