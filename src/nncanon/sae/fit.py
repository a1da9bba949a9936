"""Whether a dictionary fits the points it is attached at: widths, dtype, heads, and values a dictionary can read."""

from __future__ import annotations

from typing import Any

from ..components.norms import SCALES
from ..errors import DictionaryMismatch
from .dictionary import Dictionary
from .names import Point
from .sites import point_shape


def check_fit(model: Any, dictionary: Dictionary, point: Point, point_out: Point) -> None:
    """Refuse, before any forward of the user's, a dictionary that does not fit its points."""
    cfg = dictionary.cfg
    for which, where in (("input", point), ("output", point_out)):
        if where.value in ("attention_probabilities", "attention_scores"):
            raise DictionaryMismatch(f"{dictionary.name}: {where.label} is [b, H, q, k], not a value per token: a "
                                     f"dictionary reads a value [b, s, ...] (the {which} point)")
        if where.value == "attention_head_contributions":
            raise DictionaryMismatch(f"{dictionary.name}: {where.label} (attn.hook_result) is computed from "
                                     "attn.hook_z and read-only: a dictionary splices the value it reads. Attach it at "
                                     f"attn.hook_z (the {which} point), or read hook_result with nncanon.sae.value_at")
        if where.value in SCALES:
            raise DictionaryMismatch(f"{dictionary.name}: {where.label} is a norm's scale [b, s, 1], not a vector per "
                                     f"token: a dictionary reads a value [b, s, d] (the {which} point)")
    if point.head is not None or point_out.head is not None:
        for where in (point, point_out):
            if where.head is None:
                continue
            heads = point_shape(model, Point(where.layer, where.value, None, where.name))[0][0]
            if not 0 <= where.head < heads:
                raise DictionaryMismatch(f"{dictionary.name}: hook_head_index {where.head} is outside "
                                         f"{where.label.split('[...')[0]}'s {heads} heads (0..{heads - 1})")
    shape_in, dtype, _ = point_shape(model, point)
    shape_out, _, _ = point_shape(model, point_out)
    width_in = _width(shape_in, cfg.reshape_activations == "hook_z")
    width_out = _width(shape_out, cfg.reshape_activations == "hook_z")
    per_head = cfg.reshape_activations != "hook_z" and len(shape_in) > 1
    if per_head:
        raise DictionaryMismatch(
            f"{dictionary.name} reads {point.label}, which is per head {list(shape_in)}; a dictionary reads one vector "
            f"per token: one head (hook_head_index) or all heads flattened (reshape_activations='hook_z')")
    if width_in != cfg.d_in:
        raise DictionaryMismatch(
            f"{dictionary.name} has d_in={cfg.d_in}, but {point.label} ({point.name or point.label}) is {width_in} "
            "wide "
            f"on this model ({list(shape_in)} per token): it was trained on another model or another point")
    if width_out != cfg.d_out:
        raise DictionaryMismatch(
            f"{dictionary.name} writes d_out={cfg.d_out}, but {point_out.label} is {width_out} wide on this model")
    if dtype != cfg.dtype:
        raise DictionaryMismatch(
            f"{dictionary.name} runs in {cfg.dtype}, but the model runs {point.label} in {dtype}: convert one "
            f"(dictionary.to(dtype={dtype}), or load the model with dtype={cfg.dtype})")


def _width(shape: tuple[int, ...], flatten: bool) -> int:
    width = 1
    for size in shape if flatten else shape[-1:]:
        width *= size
    return width
