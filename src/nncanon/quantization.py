"""A model's quantization or half precision, in one record: what the proof's twin is made like, what its bars scale
with, what ``support()`` says, and what the proof cache keys on.

`Quantization` is the method and scheme (``bitsandbytes nf4``), the dtype the model's values are computed in, and
its config as plain data. `declared` reads it from what the user passed (``quantization_config=``, ``dtype=``), a
pre-quantized checkpoint's config, or a built model; `refuse_unavailable` refuses, in one line naming the method and
its package, a method that is not installed or does not run here, before any weight is loaded. `precision` is the
unit roundoff of the format a model computes in (the one rule of the checks' bars: `nncanon.proof.checks.base`),
`dense_weight` a linear layer's weight as a float ``[out, in]`` matrix whatever holds it (a packed 4-bit or an int8
tensor reads through its declared ``in_features``/``out_features`` and its own dequantization, never its storage
shape), and `signature` what a trace compares with the proof's model to see that the model changed since.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from nnsight.modeling.quantization import resolve_load_kwargs

from .errors import InvalidWrite, QuantizationUnavailable, ValueNotAvailable

#: transformers' ``quant_method`` -> (the module it imports, the package to install). Methods run here by the tests:
#: bitsandbytes, torchao, quanto; the others are refused where their package is missing (docs/quantization.md).
PACKAGES: dict[str, tuple[str, str]] = {
    "bitsandbytes": ("bitsandbytes", "bitsandbytes"),
    "torchao": ("torchao", "torchao"),
    "quanto": ("optimum.quanto", "optimum-quanto"),
    "hqq": ("hqq", "hqq"),
    "compressed-tensors": ("compressed_tensors", "compressed-tensors"),
    "gptq": ("gptqmodel", "gptqmodel"),
    "awq": ("awq", "autoawq"),
    "aqlm": ("aqlm", "aqlm"),
    "vptq": ("vptq", "vptq"),
    "eetq": ("eetq", "eetq"),
    "higgs": ("flute", "flute-kernel"),
    "fbgemm_fp8": ("fbgemm_gpu", "fbgemm-gpu"),
    "spqr": ("spqr_quant", "spqr_quant"),
    "quark": ("quark", "amd-quark"),
    "fp_quant": ("fp_quant", "fp_quant"),
    "auto-round": ("auto_round", "auto-round"),
}

#: The unit roundoff (machine epsilon) of the formats values are computed in: a float dtype's, and bitsandbytes'
#: 8-bit matmul's int8 activations (one part in 2^7 of a row's largest magnitude).
INT8_EPS = 2.0 ** -7


@dataclass(frozen=True)
class Quantization:
    """How a model is quantized or cast: what the twin is made like and what the proof says it ran on.

    Attributes:
        method: transformers' ``quant_method`` (``"bitsandbytes"``, ``"torchao"``, ``"quanto"``...), or ``None`` for
            a model that is only cast (``dtype=torch.bfloat16``).
        scheme: The method's scheme (``"int8"``, ``"nf4"``, ``"fp4"``, ``"int8 weight-only"``), ``""`` where none.
        dtype: The dtype of the model's floating parameters and stream (``torch.float32`` unless cast).
        compute: The dtype the quantized layers compute in where the method has one (``bnb_4bit_compute_dtype``).
        config: The quantization config (``None``: cast only), as transformers takes it.
        pre_quantized: Whether the checkpoint holds its weights quantized (its config has the quantization).
    """

    method: str | None
    scheme: str = ""
    dtype: torch.dtype = torch.float32
    compute: torch.dtype | None = None
    config: Any = field(default=None, compare=False, hash=False)
    pre_quantized: bool = field(default=False, compare=False)

    def describe(self) -> str:
        """``bitsandbytes nf4, compute float32``; ``bfloat16`` for a model only cast."""
        if self.method is None:
            return _name(self.dtype)
        what = " ".join(part for part in (self.method, self.scheme) if part)
        compute = self.compute or self.dtype
        return f"{what}, compute {_name(compute)}"

    def provenance(self) -> str:
        """How ``support()`` names the twin: ``a twin quantized as this model (bitsandbytes nf4, compute float32)``."""
        made = "cast" if self.method is None else "quantized"
        return f"a twin {made} as this model ({self.describe()})"

    def key(self) -> dict:
        """As plain data, for the proof cache key: the config's entries, the dtypes, and whether bitsandbytes' CPU
        kernel repacks 4-bit weights on this machine (it computes in bfloat16 then)."""
        entries = _config_dict(self.config)
        return {"method": self.method, "scheme": self.scheme, "dtype": _name(self.dtype),
                "compute": None if self.compute is None else _name(self.compute), "config": entries,
                "packs_for_cpu": self.method == "bitsandbytes" and self.scheme in ("nf4", "fp4") and _cpu_packs()}

    @property
    def precision(self) -> float:
        """The unit roundoff of the format this model's values are computed in (see `precision`)."""
        if self.method == "bitsandbytes" and self.scheme == "int8":
            return max(INT8_EPS, torch.finfo(self.dtype).eps)
        compute = self.compute or self.dtype
        if self.method == "bitsandbytes" and self.scheme in ("nf4", "fp4") and _cpu_packs():
            compute = torch.bfloat16  # its CPU kernel takes bfloat16 scales and accumulates in bfloat16
        return max(torch.finfo(compute).eps, torch.finfo(self.dtype).eps)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cpu_packs() -> bool:
    """Whether bitsandbytes' 4-bit layers repack their weights for this CPU (AVX512-BF16) at their first forward
    without gradients (``Linear4bit.forward``)."""
    try:
        from bitsandbytes.functional import has_avx512bf16
    except ImportError:
        return False
    return bool(has_avx512bf16())


def _config_dict(config: Any) -> dict | None:
    if config is None:
        return None
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {str(k): (str(v) if not isinstance(v, (int, float, bool, str, type(None), list, dict)) else v)
            for k, v in sorted(values.items())}


def _method_of(config: Any) -> str:
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return str(getattr(method, "value", method))


def _scheme_of(method: str, config: Any) -> tuple[str, torch.dtype | None]:
    """The scheme of ``config`` and the compute dtype it names (``None``: none)."""
    get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
    if method == "bitsandbytes":
        if get("load_in_4bit") or get("_load_in_4bit"):
            compute = get("bnb_4bit_compute_dtype")
            if isinstance(compute, str):
                compute = getattr(torch, compute)
            return str(get("bnb_4bit_quant_type", "fp4")), compute or torch.float32
        return "int8", None
    if method == "torchao":
        quant_type = get("quant_type")
        name = type(quant_type).__name__ if quant_type is not None and not isinstance(quant_type, (str, dict)) else (
            quant_type if isinstance(quant_type, str) else "")
        return _words(name.removesuffix("Config")), None
    if method == "quanto":
        weights, activations = get("weights"), get("activations")
        return f"weights {weights}" + (f", activations {activations}" if activations else ""), None
    if method == "hqq":
        return f"{get('nbits', '')}-bit", None
    return "", None


def _words(name: str) -> str:
    """``Int8WeightOnly`` -> ``int8 weight-only``."""
    out = ""
    for index, char in enumerate(name):
        if char.isupper() and index:
            out += "-" if name[:index].endswith("Weight") else " "
        out += char.lower()
    return out


def declared(config: Any, kwargs: dict, module: Any = None) -> Quantization | None:
    """The quantization (or cast) of what the user loads: ``quantization_config=`` in ``kwargs`` (or nnsight's
    shorthand ``dtype="nf4"``, ``"int8"``..., as nnsight resolves it at the load), else the checkpoint's own
    (``config.quantization_config``), with ``dtype=`` (or a built ``module``'s dtype); ``None``
    for a plain float32 model.

    Args:
        config: The model's config (read without weights).
        kwargs: What the user passed to ``StandardizedTransformer``.
        module: The built model, where the user passed one (its dtype and ``config.quantization_config``).
    """
    kwargs = resolve_load_kwargs(kwargs, quantize=True)  # nnsight's shorthand: dtype="nf4", "int8"...
    quantization = kwargs.get("quantization_config")
    if quantization is None and module is not None:
        quantization = getattr(getattr(module, "config", None), "quantization_config", None)
    pre_quantized = getattr(config, "quantization_config", None) is not None
    if quantization is None:
        quantization = getattr(config, "quantization_config", None)
    dtype = _dtype_of(kwargs, module, config)
    if quantization is None:
        return None if dtype == torch.float32 else Quantization(None, "", dtype)
    method = _method_of(quantization)
    scheme, compute = _scheme_of(method, quantization)
    return Quantization(method, scheme, dtype, compute, quantization, pre_quantized)


def _dtype_of(kwargs: dict, module: Any, config: Any) -> torch.dtype:
    """The dtype of the floating parameters: a built module's, else ``dtype=`` (``torch_dtype=``) as passed, else
    the checkpoint's own (transformers 5 loads ``dtype="auto"``: the config's ``dtype``), else float32."""
    if isinstance(module, torch.nn.Module):
        return float_dtype(module)
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def refuse_unavailable(quantization: Quantization | None, kwargs: dict | None = None) -> None:
    """Raise `QuantizationUnavailable`, in one line naming the method and its package, where ``quantization``'s
    package is not installed or transformers' own check of the method says it does not run here; before any
    weight is loaded."""
    if quantization is None or quantization.method is None:
        return
    method = quantization.method
    module, package = PACKAGES.get(method, (None, None))
    if module is not None and not _installed(module):
        raise QuantizationUnavailable(
            f"{method} quantization needs the {package!r} package, which is not installed: "
            f"pip install torch=={torch.__version__.split('+')[0]} {package} (or load the model without "
            "quantization_config=)"
        )
    problem = _environment_problem(quantization, kwargs or {})
    if problem is not None:
        package = f", package {package!r}" if package else ""
        raise QuantizationUnavailable(
            f"{method} quantization{package} does not run here (transformers says: {problem}); load the model without "
            "quantization_config=, or with a method that runs on this machine (docs/quantization.md)"
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _environment_problem(quantization: Quantization, kwargs: dict) -> str | None:
    """transformers' own check that the method runs here (its quantizer's ``validate_environment``), as one line."""
    from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

    config = quantization.config
    try:
        if isinstance(config, dict):
            config = AutoQuantizationConfig.from_dict(config)
        quantizer = AutoHfQuantizer.from_config(config, pre_quantized=quantization.pre_quantized)
        quantizer.validate_environment(device_map=kwargs.get("device_map"), dtype=quantization.dtype,
                                       weights_only=True)
        if not quantization.pre_quantized:
            quantizer.get_quantize_ops()  # (transformers 5 has no way to quantize some methods' weights yet: HQQ)
    except (OSError, ImportError, RuntimeError, ValueError, NotImplementedError) as error:
        return " ".join(str(error).split())[:300] or type(error).__name__
    return None


# -- the weights of linear layers ---------------------------------------------------------------


def is_quantized(module: torch.nn.Module) -> bool:
    """Whether ``module`` (a linear layer) holds its weight quantized: a bitsandbytes, quanto or HQQ layer, or a
    torchao tensor subclass."""
    if type(module).__module__.startswith(_QUANTIZED_PACKAGES):
        return True
    weight = module._parameters.get("weight")  # (not module.weight: nn.Module's __getattr__ is slow on a miss)
    if weight is None:
        weight = module._buffers.get("weight")
    if type(weight) in _PLAIN_TENSORS:
        return not weight.is_floating_point()
    return isinstance(weight, torch.Tensor) and (type(weight.data) is not torch.Tensor
                                                 or not weight.is_floating_point())


#: Packages whose layers hold their weights quantized (their modules' names start so).
_QUANTIZED_PACKAGES = ("bitsandbytes.", "optimum.", "hqq.")
#: Weight types that hold a plain tensor (a tensor subclass may hold a quantized one: torchao's).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def dense_weight(module: torch.nn.Module) -> torch.Tensor:
    """``module``'s weight as a float matrix ``[out_features, in_features]``, dequantized where it is held
    quantized (bitsandbytes 8-bit and 4-bit, packed for the CPU or not; torchao; quanto), in the dtype the layer
    computes in. GPT-2's ``Conv1D`` (weight ``[in, out]``) is transposed. The result is a new tensor where the
    weight is quantized (never a view into the packed storage); a plain layer's own weight otherwise."""
    weight = module.weight
    if type(module).__name__ == "Conv1D":
        return weight.T
    if not is_quantized(module):
        return weight
    out_features, in_features = _features(module)
    with torch.no_grad():
        dense = _dequantized(module, weight)
    dtype = getattr(module, "compute_dtype", None) or float_dtype(module)
    return dense.reshape(out_features, in_features).to(dtype)


def _features(module: torch.nn.Module) -> tuple[int, int]:
    """The layer's declared ``(out_features, in_features)``: its attributes, or its weight's quantization state's
    shape (never the storage shape of a packed weight)."""
    out_features, in_features = getattr(module, "out_features", None), getattr(module, "in_features", None)
    if out_features is None or in_features is None:
        shape = getattr(getattr(module.weight, "quant_state", None), "shape", None) or module.weight.shape
        out_features, in_features = shape[0], shape[1]
    return int(out_features), int(in_features)


def float_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of ``module``'s first floating parameter or buffer (float32 where it has none)."""
    for tensor in chain(module.parameters(), module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _dequantized(module: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    kind = type(weight).__name__
    if kind == "Params4bit":
        import copy

        import bitsandbytes.functional as bnb

        data, state = weight.data, weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):  # repacked for the CPU: back to the stored layout
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            nested = getattr(state, "original_nested", False)
            data, state = _convert_weight_packed_for_cpu_inverse(data, copy.deepcopy(state))
            if not nested:  # (bitsandbytes 0.50's inverse puts back the absmax layout of a nested state only)
                state.absmax = state.absmax.T.reshape(-1).float()
        return bnb.dequantize_4bit(data, state).float()
    if kind == "Int8Params":
        scale = weight.SCB if getattr(weight, "SCB", None) is not None else module.state.SCB
        return weight.data.float() * scale.float()[:, None] / 127.0
    if hasattr(weight, "dequantize"):  # torchao's tensor subclasses, quanto's QTensors
        return weight.dequantize().float()
    if hasattr(module, "dequantize"):  # HQQ
        return module.dequantize().float()
    raise TypeError(f"nncanon cannot read the weight of a {type(module).__name__} holding a {kind}")


def head_dtype(module: torch.nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype ``lm_head(h.to(lm_head.weight.dtype))`` casts to: a plain head's weight dtype; ``default`` for a
    quantized head (its layer takes its input as it comes)."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and not is_quantized(module) and weight.is_floating_point():
        return weight.dtype
    return default


def copied_tensor(tensor: torch.Tensor) -> torch.Tensor | None:
    """A copy of a tensor subclass that wraps others (a quantized weight) which ``copy.deepcopy`` cannot copy
    (quanto's ``QBytesTensor``), made from its inner tensors (torch's ``__tensor_flatten__`` protocol); ``None``
    for a tensor ``deepcopy`` copies itself."""
    if type(tensor) is torch.Tensor or not hasattr(tensor, "__tensor_flatten__") or type(tensor).__module__.split(
            ".")[0] != "optimum":
        return None
    names, context = tensor.__tensor_flatten__()
    inner = {name: getattr(tensor, name).clone() for name in names}
    return type(tensor).__tensor_unflatten__(inner, context, tensor.size(), tensor.stride())


def precision(module: torch.nn.Module, quantization: Quantization | None = None) -> float:
    """The unit roundoff of the format ``module`` computes its values in: ``quantization``'s (`Quantization`),
    else that of its floating parameters' dtype (``torch.finfo(dtype).eps``: 1.2e-7 in float32)."""
    if quantization is not None:
        return quantization.precision
    found = detected(module)
    if found is not None:
        return found.precision
    return torch.finfo(float_dtype(module)).eps


def detected(module: torch.nn.Module, layers: tuple | None = None) -> Quantization | None:
    """The quantization of a built model as its modules hold it (``config.quantization_config`` for the method
    and scheme where the layers are quantized), ``None`` for a float32 model. ``layers``: the model's `signature`,
    where the caller has it (a model without quantized layers is then not walked again)."""
    if layers is not None and not holds_quantized(layers):
        return None if layers[1] == torch.float32 else Quantization(None, "", layers[1])
    config = getattr(getattr(module, "config", None), "quantization_config", None)
    layers = [m for m in _linears(module) if is_quantized(m)]
    dtype = float_dtype(module)
    if not layers:
        return None if dtype == torch.float32 else Quantization(None, "", dtype)
    if config is None:  # quantized by hand (modules swapped, torchao's quantize_): the package that holds it
        holder = type(layers[0]) if type(layers[0]).__module__.split(".")[0] != "torch" else type(layers[0].weight)
        return Quantization(holder.__module__.split(".")[0], "", dtype)
    method = _method_of(config)
    scheme, compute = _scheme_of(method, config)
    return Quantization(method, scheme, dtype, compute, config)


def _linears(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if isinstance(m, torch.nn.Linear) or is_quantized(m)]


def signature(module: torch.nn.Module) -> tuple:
    """What a trace compares with the model the proof was made for: how many linear layers hold quantized
    weights, of which classes, the dtype of the first floating parameter, and the dtypes of all of them (a module
    swapped for a quantized one, or a cast, of the whole model or of part of it, changes it)."""
    classes: dict[str, int] = {}
    for sub in module.modules():
        quantized = is_quantized(sub)
        if quantized or isinstance(sub, torch.nn.Linear):
            name = type(sub).__name__ + ("/" + type(sub.weight).__name__ if quantized else "")
            classes[name] = classes.get(name, 0) + 1
    dtypes = sorted({_name(t.dtype) for t in module.parameters() if t.is_floating_point()})
    return tuple(sorted(classes.items())), float_dtype(module), tuple(dtypes)


def batch_coupling(module: torch.nn.Module) -> str | None:
    """Why the tokens of a batch are not computed independently by ``module`` (a model), ``None`` where they are.

    bitsandbytes' LLM.int8 (``llm_int8_threshold`` > 0, 6.0 by default) takes the input columns where any token of
    the batch exceeds the threshold out of the int8 product and computes them in 16-bit for every token: a token with
    an outlier (or an edit that makes one) changes how every other token's products are rounded, in its prompt and
    in the others."""
    for sub in module.modules():
        threshold = getattr(getattr(sub, "state", None), "threshold", 0.0) or 0.0
        if type(sub).__name__ == "Linear8bitLt" and threshold > 0:
            return _coupled_by(threshold)
    return None


def declared_coupling(quantization: Quantization | None) -> str | None:
    """`batch_coupling` as the quantization config declares it, for a model whose layers are not loaded yet (built
    on meta: the quantizer replaces its linear layers at the load)."""
    if quantization is None or quantization.method != "bitsandbytes" or quantization.scheme != "int8":
        return None
    entries = _config_dict(quantization.config) or {}
    threshold = entries.get("llm_int8_threshold", 6.0)
    return _coupled_by(threshold) if isinstance(threshold, (int, float)) and threshold > 0 else None


def _coupled_by(threshold: float) -> str:
    return (f"bitsandbytes LLM.int8 (llm_int8_threshold={threshold:g}) picks its outlier feature columns over "
            "every token of the batch and computes them in 16-bit for all of them, so an edit at one token "
            "(or in one invoke) moves the other tokens' values, earlier positions and other prompts included, "
            "by a few units of int8's precision. For tokens computed independently, load with "
            "BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)")


def holds_quantized(layers: tuple) -> bool:
    """Whether a model's `signature` counts linear layers that hold their weights quantized."""
    return any("/" in name for name, _ in layers[0])


def _weight_refusal(envoy: Any) -> str:
    module = envoy._module
    holder = type(module.weight).__name__
    return (f"{envoy.path}.weight is held quantized ({type(module).__name__} holding a {holder}): nncanon serves no "
            "read or write of it through the surface (its storage is packed, so its shape and values are not the "
            "layer's, and a write would corrupt it). Read it dequantized with "
            "nncanon.quantization.dense_weight(<envoy>._module), [out_features, in_features]; to change the layer, "
            "load the model unquantized.")


class QuantizedWeight:
    """Mixed into the envoy of a layer holding its weight quantized: ``.weight`` refuses a read and a write."""

    @property
    def weight(self) -> Any:
        raise ValueNotAvailable(_weight_refusal(self))

    @weight.setter
    def weight(self, value: Any) -> None:
        raise InvalidWrite(_weight_refusal(self))

    def __getattr__(self, name: str) -> Any:
        # The property's ValueNotAvailable is an AttributeError, which lands here: raise it, not the module's weight.
        if name == "weight":
            raise ValueNotAvailable(_weight_refusal(self))
        return super().__getattr__(name)


#: The guarded envoy class of each envoy class (`nncanon.mounted.MountedModel.guard_quantized_weights`).
_GUARDED: dict[type, type] = {}


def guarded(cls: type) -> type:
    """``cls`` (an envoy class) with `QuantizedWeight` mixed in, one class per class."""
    if cls not in _GUARDED:
        _GUARDED[cls] = type(cls.__name__, (QuantizedWeight, cls), {"__module__": cls.__module__})
    return _GUARDED[cls]
