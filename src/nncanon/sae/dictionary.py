"""A dictionary's math: encode a site's value into features, decode features back, as SAELens computes them.

`Dictionary` holds the weights (plain tensors, no ``nn.Module``: nothing here takes a gradient unless a trace asks
for the features' own) and computes, for every architecture of `nncanon.sae.config.ARCHITECTURES`, what SAELens's
``encode`` and ``decode`` compute, operation for operation (the same products, in the same order, in the
dictionary's dtype), so that on the same input the features are SAELens's bit for bit
(``scripts/compare_saelens.py`` checks it):

- input: cast to the dictionary's dtype; ``hook_z``: heads flattened; normalised (`NORMALIZATIONS`); ``b_dec``
  subtracted where ``apply_b_dec_to_input``;
- pre-activation ``x @ W_enc + b_enc`` (gated: the gate ``x @ W_enc + b_gate`` and the magnitude
  ``x @ (W_enc · exp(r_mag)) + b_mag``);
- activation: ReLU; top-k of the pre-activation (scaled by the decoder norms where
  ``rescale_acts_by_decoder_norm``), ReLU on the kept values, zeros elsewhere; JumpReLU ``relu(pre) · (pre >
  threshold)``; gated ``(gate > 0) · relu(magnitude)``;
- decode ``f @ W_dec + b_dec`` (top-k with rescaling: ``(f / ‖W_dec‖) @ W_dec``), the input normalisation undone
  (not on a transcoder, as SAELens), plus ``x @ W_skip.T`` on a skip transcoder.

Decoding is affine in the features, so an edit of the features moves the reconstruction by `Dictionary.delta`
of the edit alone: ``decode(f + Δ) - decode(f) = delta(Δ)``, with the normalisation's scale of that token.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import InvalidDictionary
from .config import ARCHITECTURES, DictionaryConfig, dtype_of, read_config
from .config_types import parse_config_bytes
from .processing import Processing, of

#: The files of a SAELens dictionary folder.
CONFIG_FILE, WEIGHTS_FILE = "cfg.json", "sae_weights.safetensors"

#: The weights each activation has besides ``W_enc``, ``W_dec`` and ``b_dec``.
_EXTRA = {"relu": ("b_enc",), "topk": ("b_enc",), "jumprelu": ("b_enc", "threshold"),
          "gated": ("b_gate", "b_mag", "r_mag")}


@dataclass
class Normalization:
    """What an input normalisation did to one batch of tokens, so that decoding can undo it.

    Attributes:
        scale: Multiplies the decoder's output (``layer_norm``: the tokens' standard deviations;
            ``constant_norm_rescale``: the inverse of their scale); ``None``: 1.
        shift: Added after the scale (``layer_norm``: the tokens' means); ``None``: 0.
    """

    scale: torch.Tensor | None = None
    shift: torch.Tensor | None = None


class Dictionary:
    """A sparse autoencoder or transcoder: ``features = encode(x)`` ``[..., d_sae]``, ``decode(features)``
    ``[..., d_out]``.

    Build one with `Dictionary.load` (a SAELens folder: ``cfg.json`` + ``sae_weights.safetensors``) or
    `Dictionary.from_tensors`; attach it to a model with `nncanon.sae.attach`.

    Attributes:
        cfg: The `DictionaryConfig`.
        W_enc: ``[d_in, d_sae]``.
        b_enc: ``[d_sae]`` (``None`` for gated).
        W_dec: ``[d_sae, d_out]``.
        b_dec: ``[d_out]``.
        threshold: ``[d_sae]``, JumpReLU's threshold (``None`` otherwise).
        b_gate, b_mag, r_mag: ``[d_sae]``, a gated dictionary's gate bias, magnitude bias and log-scale.
        W_skip: ``[d_out, d_in]``, a skip transcoder's skip connection.
        name: A label for messages and ``support()`` (the folder's name where loaded).
    """

    def __init__(self, cfg: DictionaryConfig, W_enc: torch.Tensor, W_dec: torch.Tensor,
                 b_dec: torch.Tensor | None = None, b_enc: torch.Tensor | None = None,
                 threshold: torch.Tensor | None = None, b_gate: torch.Tensor | None = None,
                 b_mag: torch.Tensor | None = None, r_mag: torch.Tensor | None = None,
                 W_skip: torch.Tensor | None = None, name: str | None = None) -> None:
        self.cfg = cfg
        self.name = name or _default_name(cfg)
        dtype = cfg.dtype
        given = {"W_enc": W_enc, "b_enc": None if cfg.activation == "gated" else b_enc, "W_dec": W_dec,
                 "b_dec": b_dec, "threshold": threshold, "b_gate": b_gate, "b_mag": b_mag, "r_mag": r_mag,
                 "W_skip": W_skip}
        for key, tensor in given.items():
            if tensor is not None and not isinstance(tensor, torch.Tensor):
                raise InvalidDictionary(f"{self.name}: {key} must be a tensor, not a {type(tensor).__name__}")
        # The shapes first: a default bias is allocated only for a config the given weights agree with.
        self._check_shapes({key: tuple(t.shape) for key, t in given.items() if t is not None})
        weights = {key: _weight(t, dtype) for key, t in given.items() if t is not None}
        _check_finite(self.name, weights)
        zeros = partial_zeros(weights["W_enc"], dtype)
        if "b_dec" not in weights:
            weights["b_dec"] = zeros(cfg.d_out)
        if "b_enc" not in weights and cfg.activation != "gated":
            weights["b_enc"] = zeros(cfg.d_sae)
        for key in given:
            setattr(self, key, weights.get(key))
        self._check()
        #: The model processing it was trained under (`nncanon.sae.processing`), applied at attach.
        self.processing: Processing = of(cfg)
        self._derived: dict[str, torch.Tensor] = {}

    # -- building -------------------------------------------------------------------------------------

    @classmethod
    def from_tensors(cls, W_enc: torch.Tensor, b_enc: torch.Tensor | None, W_dec: torch.Tensor,
                     b_dec: torch.Tensor | None, *, architecture: str = "standard", k: int | None = None,
                     threshold: torch.Tensor | None = None, hook_name: str | None = None,
                     hook_name_out: str | None = None, hook_head_index: int | None = None,
                     apply_b_dec_to_input: bool | None = None, normalize_activations: str = "none",
                     reshape_activations: str | None = None, rescale_acts_by_decoder_norm: bool = False,
                     name: str | None = None, model_from_pretrained_kwargs: dict | None = None,
                     **extra: torch.Tensor) -> Dictionary:
        """A dictionary from plain tensors: ``W_enc [d_in, d_sae]``, ``b_enc [d_sae]``, ``W_dec [d_sae, d_out]``,
        ``b_dec [d_out]`` (biases ``None``: zeros), in ``W_enc``'s dtype.

        Args:
            architecture: One of `ARCHITECTURES` (``"topk"`` needs ``k``; ``"jumprelu"`` needs ``threshold``;
                ``"gated"`` takes ``b_gate``, ``b_mag``, ``r_mag`` in ``extra`` and no ``b_enc``).
            hook_name: Where it reads (a TransformerLens hook name, ``"layers.3.layer_output"``, a module path);
                can also be given to `nncanon.sae.attach`.
            hook_name_out: A transcoder's output site; giving it makes the dictionary a transcoder.
            hook_head_index: Read (and write) one head of a per-head value.
            apply_b_dec_to_input: Subtract ``b_dec`` from the input before encoding (default: False, as SAELens
                writes it for new dictionaries; never on a transcoder).
            reshape_activations: ``"hook_z"`` for a dictionary over all heads flattened (default: when
                ``hook_name`` ends in ``hook_z``).
            model_from_pretrained_kwargs: The TransformerLens processing it was trained under, as SAELens records
                it (``{"center_writing_weights": True}``): applied to what it reads (`nncanon.sae.processing`).
            **extra: ``b_gate``, ``b_mag``, ``r_mag`` (gated), ``W_skip`` (skip transcoders).
        """
        if not isinstance(W_enc, torch.Tensor) or W_enc.dim() != 2:
            raise InvalidDictionary("W_enc must be a 2-D tensor [d_in, d_sae]")
        if not isinstance(W_dec, torch.Tensor) or W_dec.dim() != 2:
            raise InvalidDictionary("W_dec must be a 2-D tensor [d_sae, d_out]")
        if architecture not in ARCHITECTURES:
            raise InvalidDictionary(f"architecture {architecture!r} is not one nncanon runs; it runs "
                                    f"{', '.join(ARCHITECTURES)}")
        transcoder = "transcoder" in architecture or hook_name_out is not None
        raw = {"architecture": architecture, "d_in": W_enc.shape[0], "d_sae": W_enc.shape[1],
               "d_out": W_dec.shape[1], "dtype": str(W_enc.dtype).removeprefix("torch."),
               "apply_b_dec_to_input": bool(apply_b_dec_to_input) and not transcoder,
               "normalize_activations": normalize_activations,
               "rescale_acts_by_decoder_norm": rescale_acts_by_decoder_norm,
               "metadata": {"hook_name": hook_name, "hook_name_out": hook_name_out,
                            "hook_head_index": hook_head_index}}
        if model_from_pretrained_kwargs is not None:
            raw["metadata"]["model_from_pretrained_kwargs"] = model_from_pretrained_kwargs
        if reshape_activations is not None:
            raw["reshape_activations"] = reshape_activations
        if k is not None:
            raw["k"] = k
        cfg = read_config(raw, "Dictionary.from_tensors")
        unknown = set(extra) - {"b_gate", "b_mag", "r_mag", "W_skip"}
        if unknown:
            raise InvalidDictionary(f"Dictionary.from_tensors got {sorted(unknown)}; the extra weights it takes are "
                                    "b_gate, b_mag, r_mag (gated) and W_skip (skip transcoders)")
        return cls(cfg, W_enc, W_dec, b_dec=b_dec, b_enc=b_enc, threshold=threshold, name=name, **extra)

    @classmethod
    def load(cls, folder: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
             device: torch.device | str = "cpu", norm_scaling_factor: float | None = None,
             hook_name: str | None = None) -> Dictionary:
        """A dictionary from a local SAELens folder (``cfg.json`` and ``sae_weights.safetensors``); no ``sae_lens``.

        Args:
            folder: The folder.
            dtype: Run in this dtype instead of the config's.
            device: Where the weights go.
            norm_scaling_factor: For ``normalize_activations="expected_average_only_in"``: the factor SAELens keeps
                in its pretrained directory (``norm_scaling_factor``), folded into the weights as SAELens's
                ``from_pretrained`` folds it. Without it the dictionary runs unscaled, as SAELens's
                ``load_from_disk`` does.
            hook_name: Read here instead of the config's ``hook_name``.

        Raises:
            InvalidDictionary: the folder is missing, has no config or no weights, the weight file is truncated or
                not safetensors, a weight's shape disagrees with the config, or the architecture or a setting is
                not one nncanon runs (the message lists those it does).
        """
        path = Path(os.path.expanduser(os.fspath(folder)))
        if not path.is_dir():
            raise InvalidDictionary(f"the dictionary folder {os.fspath(folder)!r} does not exist")
        config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
        present = sorted(p.name for p in path.iterdir())
        if not config_path.is_file():
            raise InvalidDictionary(f"the dictionary folder {str(path)!r} has no {CONFIG_FILE} (it holds {present}): "
                                    f"a SAELens folder has {CONFIG_FILE} and {WEIGHTS_FILE}")
        if not weights_path.is_file():
            raise InvalidDictionary(f"the dictionary folder {str(path)!r} has no weights: {WEIGHTS_FILE} is missing "
                                    f"(it holds {present})")
        raw = parse_config_bytes(config_path.read_bytes(), str(config_path))
        cfg = read_config(raw, str(config_path))
        if dtype is not None:
            cfg = cfg.replaced(dtype=dtype_of(dtype))
        if hook_name is not None:
            cfg = cfg.replaced(hook_name=hook_name)
        check_shapes(cfg, header_shapes(weights_path), str(weights_path))  # before any tensor is read or made
        device = _checked_device(device)
        factor = _checked_factor(norm_scaling_factor)
        weights = _read_weights(weights_path, device)
        weights = _weights_for(cfg, weights, weights_path)
        dictionary = cls(cfg, name=path.name, **weights)
        if factor is not None:
            dictionary = dictionary.folded_scaling(factor)
        return dictionary.to(device)

    def save(self, folder: str | os.PathLike) -> Path:
        """Write the dictionary as a SAELens folder (``cfg.json``, ``sae_weights.safetensors``, 6.x layout)."""
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        cfg = self.cfg
        config = {"architecture": cfg.architecture, "d_in": cfg.d_in, "d_sae": cfg.d_sae,
                  "dtype": str(cfg.dtype).removeprefix("torch."), "device": "cpu",
                  "apply_b_dec_to_input": cfg.apply_b_dec_to_input,
                  "normalize_activations": cfg.normalize_activations,
                  "reshape_activations": cfg.reshape_activations,
                  "metadata": {"hook_name": cfg.hook_name, "hook_head_index": cfg.hook_head_index,
                               "model_name": cfg.model_name, "sae_lens_version": "6.0.0"}}
        processing = self.processing
        if processing.source:
            config["metadata"]["model_from_pretrained_kwargs"] = dict(processing.kwargs)
        if processing.model_class != "HookedTransformer":
            config["metadata"]["model_class_name"] = processing.model_class
        if cfg.transcoder:
            config["d_out"] = cfg.d_out
            config["metadata"].update(hook_name_out=cfg.hook_name_out, hook_head_index_out=cfg.hook_head_index_out)
        if cfg.architecture == "topk":
            config.update(k=cfg.k, rescale_acts_by_decoder_norm=cfg.rescale_acts_by_decoder_norm)
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        save_file({name: tensor.contiguous().cpu() for name, tensor in self.state_dict().items()}, path / WEIGHTS_FILE)
        return path

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights by SAELens's names."""
        names = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "b_gate", "b_mag", "r_mag", "W_skip")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | str | None = None) -> Dictionary:
        """A copy on ``device`` and in ``dtype`` (``self`` where nothing changes)."""
        dtype = self.cfg.dtype if dtype is None else dtype_of(dtype)
        device = None if device is None else _checked_device(device)
        first = self.W_enc
        if (device is None or torch.device(device) == first.device) and dtype == self.cfg.dtype:
            return self
        moved = {name: tensor.to(device=device, dtype=dtype) for name, tensor in self.state_dict().items()}
        return type(self)(self.cfg.replaced(dtype=dtype), name=self.name, **moved)

    def folded_scaling(self, factor: float) -> Dictionary:
        """``expected_average_only_in`` with its factor folded in, as SAELens's
        ``fold_activation_norm_scaling_factor``: ``W_enc · factor``, ``W_dec / factor``, ``b_dec / factor``."""
        factor = _checked_factor(factor)
        weights = self.state_dict()
        weights["W_enc"] = weights["W_enc"] * factor
        weights["W_dec"] = weights["W_dec"] / factor
        weights["b_dec"] = weights["b_dec"] / factor
        return type(self)(self.cfg.replaced(normalize_activations="none"), name=self.name, **weights)

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return self.W_enc.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the dictionary runs in."""
        return self.cfg.dtype

    @property
    def d_sae(self) -> int:
        """The number of features."""
        return self.cfg.d_sae

    def __repr__(self) -> str:
        cfg = self.cfg
        where = f" at {cfg.hook_name}" + (f" -> {cfg.hook_name_out}" if cfg.transcoder else "") if cfg.hook_name else ""
        return (f"Dictionary({self.name!r}: {cfg.architecture}, {cfg.d_in} -> {cfg.d_sae} features -> {cfg.d_out}, "
                f"{str(cfg.dtype).removeprefix('torch.')}{where}, reads under {self.processing.describe()})")

    # -- the math -------------------------------------------------------------------------------------

    def normalize(self, x: torch.Tensor) -> tuple[torch.Tensor, Normalization]:
        """``x [..., d_in]`` as the encoder reads it (dtype, normalisation, ``b_dec`` where applied), and what the
        normalisation did (for decoding)."""
        x = x.to(self.cfg.dtype)
        if self.cfg.reshape_activations == "hook_z" and x.shape[-1] != self.cfg.d_in:
            x = x.flatten(-2)
        state = Normalization()
        mode = self.cfg.normalize_activations
        if mode == "constant_norm_rescale":
            coefficient = (self.cfg.d_in ** 0.5) / x.norm(dim=-1, keepdim=True)
            x = x * coefficient
            state = Normalization(scale=coefficient)
        elif mode == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            x = x - mu
            std = x.std(dim=-1, keepdim=True)
            x = x / (std + 1e-5)
            state = Normalization(scale=std, shift=mu)
        if self.cfg.apply_b_dec_to_input:
            x = x - self.b_dec * True  # SAELens's ``b_dec * apply_b_dec_to_input``, the same product
        return x, state

    def encode_with_state(self, x: torch.Tensor) -> tuple[torch.Tensor, Normalization]:
        """``(features [..., d_sae], normalisation)`` of ``x [..., d_in]`` (``[..., heads, head_dim]`` for hook_z)."""
        sae_in, state = self.normalize(x)
        activation = self.cfg.activation
        if activation == "gated":
            gate = sae_in @ self.W_enc + self.b_gate
            active = (gate > 0).to(self.cfg.dtype)
            magnitude = sae_in @ self._magnitude_weight() + self.b_mag
            return active * torch.relu(magnitude), state
        pre = sae_in @ self.W_enc + self.b_enc
        if activation == "relu":
            return torch.relu(pre), state
        if activation == "jumprelu":
            return torch.relu(pre) * (pre > self.threshold).to(pre.dtype), state
        if self.cfg.rescale_acts_by_decoder_norm:
            pre = pre * self._decoder_norms()
        values, indices = torch.topk(pre, k=self.cfg.k, dim=-1, sorted=False)
        features = torch.zeros_like(pre)
        features.scatter_(-1, indices, values.relu())
        return features, state

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The features ``[..., d_sae]`` of ``x [..., d_in]`` (``[..., heads, head_dim]`` for a hook_z dictionary)."""
        return self.encode_with_state(x)[0]

    def decode(self, features: torch.Tensor, state: Normalization | None = None,
               x: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction ``[..., d_out]`` of ``features [..., d_sae]``.

        ``state``: the input's normalisation (from `encode_with_state`; needed for ``layer_norm`` and
        ``constant_norm_rescale``); ``x``: the input, for a skip transcoder's skip connection.
        """
        if self.cfg.normalize_activations in ("layer_norm", "constant_norm_rescale") and state is None:
            raise InvalidDictionary(f"{self.name}: decoding under normalize_activations="
                                    f"{self.cfg.normalize_activations!r} needs the input's normalisation: "
                                    "use encode_with_state(x) and pass its state")
        out = self._times_decoder(features) + self.b_dec
        if not self.cfg.transcoder:
            out = _undo(out, state)
        if self.cfg.skip:
            if x is None:
                raise InvalidDictionary(f"{self.name} is a skip transcoder: decode needs the input x")
            out = out + x.to(self.cfg.dtype) @ self.W_skip.T
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``: the reconstruction ``[..., d_out]`` of ``x``."""
        features, state = self.encode_with_state(x)
        return self.decode(features, state, x)

    __call__ = forward

    def delta(self, change: torch.Tensor, state: Normalization | None = None) -> torch.Tensor:
        """``decode(f + change) - decode(f)`` ``[..., d_out]``: the decoder's linear part on ``change``
        ``[..., d_sae]``,
        times the normalisation's scale (no bias, no shift, no skip: they cancel).

        Where ``change`` touches few features, only their decoder rows are multiplied.
        """
        columns = change.detach().flatten(0, -2).ne(0).any(0).nonzero()[:, 0]
        if 8 * columns.numel() <= change.shape[-1] and not change.requires_grad:
            part = change.index_select(-1, columns)
            if self.cfg.rescale_acts_by_decoder_norm:
                part = part * (1 / self._decoder_norms().index_select(0, columns))
            out = part @ self.W_dec.index_select(0, columns)
        else:
            out = self._times_decoder(change)
        if not self.cfg.transcoder and state is not None and state.scale is not None:
            out = out * state.scale if self.cfg.normalize_activations == "layer_norm" else out / state.scale
        return out

    def _times_decoder(self, features: torch.Tensor) -> torch.Tensor:
        if self.cfg.rescale_acts_by_decoder_norm:
            features = features * (1 / self._decoder_norms())
        return features @ self.W_dec

    def _decoder_norms(self) -> torch.Tensor:
        if "norms" not in self._derived:
            self._derived["norms"] = self.W_dec.norm(dim=-1)
        return self._derived["norms"]

    def _magnitude_weight(self) -> torch.Tensor:
        if "magnitude" not in self._derived:
            self._derived["magnitude"] = self.W_enc * self.r_mag.exp()
        return self._derived["magnitude"]

    # -- checks ---------------------------------------------------------------------------------------

    def _check_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        check_shapes(self.cfg, shapes, self.name)

    def _check(self) -> None:
        cfg = self.cfg
        self._check_shapes({name: tuple(tensor.shape) for name, tensor in self.state_dict().items()})
        needed = {"jumprelu": ("threshold",), "gated": ("b_gate", "b_mag", "r_mag")}.get(cfg.activation, ())
        missing = [name for name in needed if getattr(self, name) is None]
        if cfg.skip and self.W_skip is None:
            missing.append("W_skip")
        if missing:
            raise InvalidDictionary(f"{self.name}: a {cfg.architecture} dictionary needs {', '.join(missing)}")
        if cfg.activation == "topk" and not 0 < cfg.k <= cfg.d_sae:
            raise InvalidDictionary(f"{self.name}: k={cfg.k} is not in 1..d_sae={cfg.d_sae}")
        devices = {tensor.device for tensor in self.state_dict().values()}
        if len(devices) > 1:
            raise InvalidDictionary(f"{self.name}: the weights are on several devices ({sorted(map(str, devices))})")


def expected_shapes(cfg: DictionaryConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each weight a dictionary of ``cfg`` may hold, by SAELens's names (legacy ones included)."""
    features = (cfg.d_sae,)
    return {"W_enc": (cfg.d_in, cfg.d_sae), "W_dec": (cfg.d_sae, cfg.d_out), "b_dec": (cfg.d_out,),
            "b_enc": features, "threshold": features, "log_threshold": features, "b_gate": features,
            "b_mag": features, "r_mag": features, "scaling_factor": features, "W_skip": (cfg.d_out, cfg.d_in)}


def check_shapes(cfg: DictionaryConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse weights whose shapes (``name -> shape``) disagree with ``cfg``, before anything is allocated
    (`Dictionary.load` checks the weight file's header with it, before reading a tensor)."""
    expected = expected_shapes(cfg)
    wrong = [f"{name} is {tuple(shape)}, expected {expected[name]}" for name, shape in shapes.items()
             if name in expected and tuple(shape) != expected[name]]
    if wrong:
        raise InvalidDictionary(f"{where}: the weights do not fit the config (d_in={cfg.d_in}, d_sae={cfg.d_sae}, "
                                f"d_out={cfg.d_out}): " + "; ".join(wrong))


def header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of a safetensors file, from its header alone (8 bytes of length, then JSON): nothing
    of the tensors is read. A file whose header does not parse is `InvalidDictionary` naming it."""
    size = path.stat().st_size

    def unreadable(why: str) -> InvalidDictionary:
        return InvalidDictionary(f"{path} cannot be read as safetensors ({size} bytes: {why}); the file is truncated "
                                 "or not a safetensors file: download or save it again")

    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little") if size >= 8 else -1
        if not 0 < length <= min(size - 8, 100_000_000):
            raise unreadable(f"a header of {length} bytes")
        try:
            header = json.loads(handle.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
            raise unreadable(f"its header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise unreadable("its header is not an object")
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            raise unreadable(f"tensor {name!r} has no shape")
        shapes[name] = tuple(shape)
    return shapes


def _check_finite(name: str, weights: dict[str, torch.Tensor]) -> None:
    """Refuse a weight that holds NaN or ±inf (every feature and reconstruction would be NaN)."""
    for key, tensor in weights.items():
        if tensor.device.type != "meta" and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            raise InvalidDictionary(f"{name}: {key} holds {count} non-finite value(s) (NaN or ±inf) of "
                                    f"{tensor.numel()}: every feature and reconstruction would be NaN. The file is "
                                    "damaged or the training diverged")


def _undo(out: torch.Tensor, state: Normalization | None) -> torch.Tensor:
    """The input normalisation undone on the decoder's output (SAELens's ``run_time_activation_norm_fn_out``)."""
    if state is None or state.scale is None:
        return out
    if state.shift is not None:  # layer_norm
        return out * state.scale + state.shift
    return out / state.scale  # constant_norm_rescale


def _weight(tensor: Any, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidDictionary(f"a dictionary weight must be a tensor, not a {type(tensor).__name__}")
    return tensor.detach().to(dtype)


def partial_zeros(like: torch.Tensor, dtype: torch.dtype) -> Any:
    """``zeros(n)`` on ``like``'s device in ``dtype``: the default of a bias that was not given."""
    return lambda n: torch.zeros(n, dtype=dtype, device=like.device)


def _checked_device(device: Any) -> torch.device:
    """``device`` as a `torch.device`, refused (`InvalidDictionary`) where it names none, or one this machine lacks."""
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InvalidDictionary(f"device={device!r} is not a device ({str(error).splitlines()[0]}): give 'cpu', "
                                "'cuda', 'cuda:0', 'mps' or a torch.device") from None
    if found.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (found.index is not None and found.index >= count) or count == 0:
            raise InvalidDictionary(f"device={device!r}: this machine has {count} CUDA device(s)")
    if found.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise InvalidDictionary(f"device={device!r}: MPS is not available on this machine")
    return found


def _checked_factor(factor: Any) -> float | None:
    """``norm_scaling_factor``: ``None`` or a finite number above 0."""
    if factor is None:
        return None
    if isinstance(factor, torch.Tensor) and factor.numel() == 1:
        factor = factor.item()
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise InvalidDictionary(f"norm_scaling_factor={factor!r}: it is a finite number above 0 (SAELens's "
                                "norm_scaling_factor multiplies the input), or None")
    return float(factor)


def _default_name(cfg: DictionaryConfig) -> str:
    return f"{cfg.architecture}:{cfg.hook_name}" if cfg.hook_name else cfg.architecture


def _read_weights(path: Path, device: Any) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a truncated or foreign file is `InvalidDictionary` naming it."""
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        size = path.stat().st_size
        raise InvalidDictionary(f"{path} cannot be read as safetensors ({size} bytes: {error}); the file is "
                                "truncated or not a safetensors file: download or save it again") from None


def _weights_for(cfg: DictionaryConfig, weights: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """The weights of ``weights`` this architecture uses, SAELens's legacy forms converted (``log_threshold``,
    a trained BatchTopK's ``topk_threshold``); what cannot run is refused by name."""
    weights = dict(weights)
    if "log_threshold" in weights and "threshold" not in weights:  # older JumpReLU checkpoints, as SAELens converts
        weights["threshold"] = torch.exp(weights.pop("log_threshold"))
    scaling = weights.pop("scaling_factor", None)
    if scaling is not None and not torch.allclose(scaling, torch.ones_like(scaling)):
        raise InvalidDictionary(f"{path} holds a finetuning scaling_factor that is not all ones: SAELens before 6.0 "
                                "scaled the features by it before decoding; nncanon (like SAELens 6) does not run "
                                "it. Fold it into W_dec (W_dec * scaling_factor[:, None]) and save the folder again")
    if cfg.activation == "jumprelu" and "threshold" not in weights:
        topk = weights.pop("topk_threshold", None)
        if topk is not None and cfg.architecture == "batchtopk":  # a training checkpoint: one global threshold
            weights["threshold"] = torch.ones(cfg.d_sae, dtype=topk.dtype, device=topk.device) * topk.item()
        else:
            raise InvalidDictionary(
                f"{path} has no threshold for its {cfg.architecture} architecture"
                + (": a BatchTopK dictionary runs per token as JumpReLU with its learned threshold (SAELens saves it "
                   "so); this file has neither threshold nor topk_threshold. Top-k over a whole batch is not a "
                   "function of one token, so it cannot be spliced into a model" if cfg.architecture == "batchtopk"
                   else ""))
    weights.pop("topk_threshold", None)
    known = {"W_enc", "b_enc", "W_dec", "b_dec", "threshold", "b_gate", "b_mag", "r_mag", "W_skip"}
    missing = [name for name in ("W_enc", "W_dec") if name not in weights]
    if missing:
        raise InvalidDictionary(f"{path} has no {' or '.join(missing)} (it holds {sorted(weights)})")
    unknown = sorted(set(weights) - known)
    if unknown:
        raise InvalidDictionary(f"{path} holds weights nncanon does not know ({unknown}); the {cfg.architecture} "
                                f"architecture has {sorted(n for n in known if n in weights)}")
    if cfg.activation == "gated":
        weights.pop("b_enc", None)
    return weights
