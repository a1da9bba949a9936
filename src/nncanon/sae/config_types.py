"""A dictionary's ``cfg.json`` checked for types before it is read: JSON's ``"false"`` is a string, and Python's
``bool("false")`` is ``True``; a number where a bool is due, a string where a width is due, a list where an object
is, are refused by key (`InvalidDictionary`), never read as something else.

`parse_config_bytes` reads the file's bytes (UTF-8, a JSON object, nesting bounded); `check_config_types` checks
the fields nncanon reads, at the top level and under ``metadata``, and leaves the others (SAELens writes many
that nncanon does not use) as they are.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import InvalidDictionary

#: Fields that are true or false (JSON ``true``/``false``; ``null`` where SAELens allows it).
BOOLS = ("apply_b_dec_to_input", "rescale_acts_by_decoder_norm", "prepend_bos", "normalize_activations_bool")
#: Fields that are positive ints (widths, ``k``).
SIZES = ("d_in", "d_sae", "d_out", "k")
#: Fields that are non-negative ints or ``null`` (head and layer indices).
INDICES = ("hook_head_index", "hook_head_index_out", "hook_point_head_index", "hook_layer", "hook_layer_out")
#: Fields that are strings or ``null``.
STRINGS = ("architecture", "activation_fn", "activation_fn_str", "hook_name", "hook_point", "hook_name_out",
           "dtype", "model_name", "reshape_activations", "device")
#: Fields that are objects or ``null``.
OBJECTS = ("metadata", "activation_fn_kwargs")

#: How deep a cfg.json may nest (SAELens writes two levels; a deeper file is not one, and Python's parser would
#: otherwise recurse until it fails).
MAX_DEPTH = 32


def parse_config_bytes(data: bytes, where: str) -> dict:
    """The JSON object of a ``cfg.json``'s bytes; not UTF-8, not JSON, nested deeper than `MAX_DEPTH` or not an
    object: `InvalidDictionary` naming ``where``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidDictionary(f"{where} is not UTF-8 text (byte {error.start}: {data[error.start:error.start + 4]!r}"
                                "); a SAELens cfg.json is JSON in UTF-8") from None
    depth = _depth(text)
    if depth > MAX_DEPTH:
        raise InvalidDictionary(f"{where} nests {depth} levels deep; a SAELens cfg.json nests two (its metadata)")
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise InvalidDictionary(f"{where} is not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise InvalidDictionary(f"{where} holds a JSON {type(raw).__name__}, not an object of fields")
    return raw


def _depth(text: str) -> int:
    """The deepest nesting of brackets in ``text`` outside strings (a bound checked before parsing)."""
    depth = deepest = 0
    in_string = escaped = False
    for character in text:
        if in_string:
            if escaped:
                escaped = False
            elif character == "\\":
                escaped = True
            elif character == '"':
                in_string = False
        elif character == '"':
            in_string = True
        elif character in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif character in "]}":
            depth -= 1
    return deepest


def check_config_types(raw: Any, where: str) -> None:
    """Refuse (`InvalidDictionary`, naming ``where`` and the key) a field of ``raw`` whose JSON type is not the one
    nncanon reads it as, at the top level and under ``metadata``."""
    if not isinstance(raw, dict):
        raise InvalidDictionary(f"{where} holds a {type(raw).__name__}, not an object of fields")
    levels = [("", raw)] + [(f"{name}.", raw[name]) for name in OBJECTS if isinstance(raw.get(name), dict)]
    for prefix, fields in levels:
        for key, value in fields.items():
            problem = _problem(key, value)
            if problem is not None:
                raise InvalidDictionary(f"{where}: {prefix}{key} is {_shown(value)}; {problem}")


def _problem(key: str, value: Any) -> str | None:
    """What is wrong with ``value`` as field ``key`` (``None``: nothing, or a field nncanon does not read)."""
    if key in BOOLS:
        if value is None or isinstance(value, bool):
            return None
        hint = f' (JSON {str(value).lower()}, not the string "{value}")' if value in ("true", "false", "True",
                                                                                    "False") else ""
        return f"it is true or false{hint}"
    if key == "normalize_activations":
        if value is None or isinstance(value, (bool, str)):
            return None
        return "it is a string (none, expected_average_only_in, constant_norm_rescale, layer_norm) or, before " \
               "SAELens 6, true or false"
    if key in SIZES:
        if value is None and key in ("d_out", "k"):
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return "it is a positive integer"
        return None
    if key in INDICES:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return "it is a non-negative integer or null"
        return None
    if key in STRINGS:
        return None if value is None or isinstance(value, str) else "it is a string or null"
    if key in OBJECTS:
        return None if value is None or isinstance(value, dict) else "it is an object or null"
    return None


def _shown(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    text = json.dumps(value) if isinstance(value, (dict, list, str, bool, int, float, type(None))) else repr(value)
    return f"{text[:40]}... (a JSON {type(value).__name__})" if len(text) > 40 else f"{text} (a JSON " \
        f"{_json_type(value)})"


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)
