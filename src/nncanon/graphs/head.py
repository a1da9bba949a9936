"""The modules a family runs between the final norm and the unembedding (`nncanon.families.Family.before_head`), on
the frozen replacement model: a linear layer is left as it is, a norm's scale is frozen at the clean run's (its output
written as the stream centred over the clean scale, times its weight: `nncanon.components.norms.formula`) and an
activation as its slope (``act(u)`` written as ``u · act(u_clean) / u_clean``, the clean run's value with the
gradient flowing through ``u`` only: the convention the causal convolution's SiLU has in `nncanon.graphs.mixers`).
ModernBERT-decoder's prediction head (``dense``, a GELU, a LayerNorm, then ``decoder``) is linear in the stream so.
Where the final norm's scale is not served because the module also runs elsewhere (nanochat norms the embeddings
with it: `nncanon.support.SupportReport.final_norm_at_head`), its last call is frozen at the head: the head's input
written as the last block's output centred over the clean run's scale (`FINAL`). Where a stacked-stream model
collapses its streams before the final norm rescaled by their magnitudes (Gemma-3n's AltUp unembedding:
`nncanon.families.Family.rescale`), the head's input is written as the last block's output collapsed with the clean
run's magnitudes, normed over the clean run's scale (`COLLAPSE`).

`stages` says what is frozen (or why a head cannot be), `read` saves the clean values inside the clean run's trace,
`freeze` writes them inside the frozen run's trace; both run after the final norm, before the head's output is read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..components.norms import NormAnatomy, formula, is_norm, norm_anatomy, statistics
from ..errors import ValueNotAvailable
from .mixers import read_module, write_module

#: Where an activation module's class is defined (every one has ``act(0) = 0``: a slope through the origin).
ACTIVATION_MODULES = ("transformers.activations", "torch.nn.modules.activation")
#: How each kind of stage is frozen (`nncanon.graphs.mixers.read_module`'s parts).
PARTS = {"norm": "scale", "activation": "ratio"}
#: The stage of a final norm frozen at the head's input (its path in `stages`).
FINAL = "<final norm at the head>"
#: The stage of a stacked-stream model's collapse and final norm, frozen at the head's input (its path in `stages`).
COLLAPSE = "<collapse of the stacked streams>"


def stages(model: Any) -> list[tuple[str, str, str]]:
    """``(path, child, kind)`` of each module run before the head that is frozen, in the order it runs: the
    `Family.before_head` path, the child's name in it (``""``: the module itself) and ``"norm"`` or ``"activation"``
    (a linear layer is left out); last, ``(FINAL, "", "final")`` where the final norm is frozen at the head, or
    ``(COLLAPSE, "", "collapse")`` where a stacked-stream model's collapse and final norm are. Raise
    `ValueNotAvailable` naming a module that is none of these (the head is not linear in the stream with it)."""
    family, report = model._family, model.support()
    served = report.available("final_norm_scale")
    found: list[tuple[str, str, str]] = []
    for path, envoy in _modules(model).items():
        if path == family.norm or (path == family.final_norm and served):
            continue  # (the final norm: its scale is model.final_norm_scale; a norm after a hyper-connected model's
            # collapse of its streams, which serves no such scale, is frozen here)
        children = list(envoy._module.named_children()) or [("", envoy._module)]
        for name, child in children:
            kind = _kind(child)
            if kind is None:
                where = f"{path}.{name}" if name else path
                raise ValueNotAvailable(
                    f"its head runs {where} ({type(child).__name__}) between the final norm and the unembedding: "
                    "neither a linear layer, a norm nor an activation, so the graph cannot freeze it")
            if kind != "linear":
                found.append((path, name, kind))
    if report.final_norm_at_head and not served:
        found.append((FINAL, "", "final"))
    elif family.rescale is not None and not served:
        found.append((COLLAPSE, "", "collapse"))
    return found


def _modules(model: Any) -> dict[str, Any]:
    """The envoys of `Family.before_head` this model has, by path (bound at load: a standard name may shadow one,
    ModernBERT-decoder's ``lm_head``)."""
    paths = [path for path in model._family.before_head if model._optional(path) is not None]
    return dict(zip(paths, model._before_head, strict=True))


def _envoy(model: Any, path: str, child: str) -> Any:
    envoy = _modules(model)[path]
    return getattr(envoy, child) if child else envoy


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, (nn.Linear, nn.Identity, nn.Dropout)):
        return "linear"
    if is_norm(module) and isinstance(norm_anatomy(module), NormAnatomy):
        return "norm"
    if type(module).__module__ in ACTIVATION_MODULES:
        return "activation"
    return None


def read(model: Any, frozen: list[tuple[str, str, str]]) -> list[Any]:
    """The clean run's frozen values (inside its trace), saved: a norm's scale ``[1, n, 1]`` (the final norm's: of
    the last block's output), an activation's slope ``[1, n, d]``, a stacked-stream collapse's magnitudes and
    final norm's scale ``[1, n, k + 1]``."""
    values = []
    for path, child, kind in frozen:
        if kind == "final":
            values.append(statistics(norm_anatomy(model.norm._module), model.layers[-1].layer_output)[1].save())
            continue
        if kind == "collapse":  # (the k magnitudes, then the final norm's scale: [1, n, k + 1])
            collapsed, magnitudes = model._family.rescale(model._module, "collapse", model.layers[-1].layer_output)
            scale = statistics(norm_anatomy(model.norm._module), collapsed)[1]
            values.append(torch.cat([*(m.to(scale.dtype) for m in magnitudes), scale], dim=-1).save())
            continue
        values.append(read_module(_envoy(model, path, child), PARTS[kind]).save())
    return values


def freeze(model: Any, frozen: list[tuple[str, str, str]], clean: list[torch.Tensor]) -> None:
    """Write each module's output with its frozen form on its live input (inside the frozen run's trace)."""
    for (path, child, kind), value in zip(frozen, clean, strict=True):
        if kind == "final":
            h = model.layers[-1].layer_output
            model.lm_head.input = formula(norm_anatomy(model.norm._module), model.norm._module, h, scale=value)
            continue
        if kind == "collapse":
            *magnitudes, scale = value.split(1, dim=-1)
            h, _ = model._family.rescale(model._module, "collapse", model.layers[-1].layer_output, magnitudes)
            model.lm_head.input = formula(norm_anatomy(model.norm._module), model.norm._module, h, scale=scale)
            continue
        write_module(_envoy(model, path, child), PARTS[kind], value)
