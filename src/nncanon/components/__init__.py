"""One envoy class per standard role: the block, its attention, its linear mixer and its MLP."""

from .attention import AttentionEnvoy
from .base import Component, ComponentState
from .layer import COMPONENT_NAMES, LayerEnvoy, LayersEnvoy, layer_index
from .linear_attention import LinearAttentionEnvoy
from .mlp import MLPEnvoy, VirtualMLP

__all__ = [
    "COMPONENT_NAMES",
    "AttentionEnvoy",
    "Component",
    "ComponentState",
    "LayerEnvoy",
    "LayersEnvoy",
    "LinearAttentionEnvoy",
    "MLPEnvoy",
    "VirtualMLP",
    "layer_index",
]
