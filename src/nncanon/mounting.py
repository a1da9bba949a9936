"""Mount a family's sites on a model's envoy tree: the only place family data meets a model.

`envoy_classes` tells nnsight which envoy class to build for blocks, attention and MLP modules
(by native path); `mount` then binds, on every block, each standard value to the site its
family names, and records the values a configuration declines with the reason.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from nnsight.intervention.envoy import Envoy

from .components import AttentionEnvoy, ComponentState, LayerEnvoy, MLPEnvoy, VirtualMLP
from .families import Family
from .served import Binding, Site


def envoy_classes(family: Family) -> dict[str, type]:
    """The ``envoys=`` map nnsight builds the tree with: our classes on blocks, attention, MLP."""
    classes: dict[str, type] = {
        f"{family.layers}.*": LayerEnvoy,
        f"{family.layers}.*.{family.attention}": AttentionEnvoy,
    }
    if family.mlp is not None:
        classes[f"{family.layers}.*.{family.mlp}"] = MLPEnvoy
    return classes


def _binder(layer: Envoy, where: str, config: Any) -> Callable[..., Binding]:
    def bind(name: str, site: Site, heads: int | None = None, component: str = "") -> Binding:
        if site.module:
            layer.get(site.module)  # fail at load, not mid-trace, if the family's path is wrong
            path = f"{layer.path}.{site.module}"
        else:
            path = layer.path
        label = f"{where}.{component}" if component else where
        return Binding(name, f"{path}.{site.key}", site, config, label, heads)

    return bind


def _alias(parent: Envoy, alias: str, target: Any, native: str) -> None:
    """Bind ``target`` on ``parent`` as ``alias`` (the standard name) unless that is its native name."""
    if alias == native:
        return
    object.__setattr__(parent, alias, target)
    parent._aliases[alias] = native


def mount(model: Any, family: Family, config: Any) -> None:
    """Bind every block of ``model`` (a `StandardizedTransformer`) to ``family``'s sites.

    ``config`` is the text config (heads and scale factors are read from it).
    """
    owner = weakref.ref(model)

    def probabilities_reason() -> str | None:
        implementation = owner().attn_implementation
        if implementation == "eager":
            return None
        return (
            f"attention probabilities are only computed under attn_implementation='eager'; "
            f"this model runs {implementation!r}. Load it with "
            f"StandardizedTransformer(..., attn_implementation='eager')."
        )

    heads = config.num_attention_heads
    for index, layer in enumerate(model.layers):
        if not isinstance(layer, LayerEnvoy):
            raise TypeError(
                f"family {family.name!r} names {family.layers!r} as the blocks, but block {index} "
                f"({type(layer._module).__name__}) was not built as a LayerEnvoy: check the family's paths."
            )
        where = f"layers[{index}]"
        bind = _binder(layer, where, config)
        declined = family.declined(config, index)

        layer._nncanon = ComponentState(
            where,
            {
                "layer_input": bind("layer_input", Site(key="input")),
                "layer_output": bind("layer_output", Site(index=0 if family.block_extras else None)),
            },
        )

        attention = layer.get(family.attention)
        _alias(layer, "self_attn", attention, family.attention)
        attention._nncanon = ComponentState(
            f"{where}.self_attn",
            {
                "attention_head_outputs": bind("attention_head_outputs", family.head_outputs, heads, "self_attn"),
                "attention_output": bind("attention_output", family.attention_output, component="self_attn"),
            },
            {"attention_probabilities": probabilities_reason},
            probabilities=family.probabilities,
        )

        mlp_binding = bind("mlp_output", family.mlp_output, component="mlp")
        mlp_state = ComponentState(f"{where}.mlp", {"mlp_output": mlp_binding})
        if family.mlp is None:
            object.__setattr__(layer, "mlp", VirtualMLP(mlp_state))
        else:
            mlp = layer.get(family.mlp)
            _alias(layer, "mlp", mlp, family.mlp)
            mlp._nncanon = mlp_state

        for name, reason in declined.items():
            for state in (layer._nncanon, attention._nncanon, mlp_state):
                if name in state.bindings or name in state.reasons:
                    state.reasons[name] = reason
