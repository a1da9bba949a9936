"""The transcoders of a graph, per layer or cross-layer, behind one interface (`Coders`).

- `CrossLayerTranscoder`: circuit-tracer's cross-layer transcoder (CLT): one encoder per layer, each feature of
  layer ``s`` decoding into the MLP output of every layer ``l >= s``; in nncanon's orientation (``W_enc[l]
  [d, F]``, ``W_dec[s] [F, n_layers - s, d]``, ``b_dec [n_layers, d]``: the bias of the reconstruction into
  layer ``l``), ReLU or JumpReLU (strict: ``pre > threshold``).
- `Coders`: what attribution asks of a set: each layer's features of its input, each feature's encoder column (its
  target: ``x · W_enc[:, f]``), each feature's decoder vectors ``[R, d]`` into layers ``s .. s + R - 1`` (``R`` 1
  for per-layer transcoders, ``n_layers`` for a CLT, zero past the last layer), and each layer's reconstruction.
- `check_transcoders`: a set checked against the model (widths, the points it reads and writes, finite weights).

A transcoder reads, per layer, one of `READS` (TransformerLens's ``mlp.hook_in``, ``ln2.hook_normalized``,
``hook_resid_mid``, ``hook_resid_pre``, resolved by the name table) and writes ``mlp_output`` (``hook_mlp_out``;
circuit-tracer's ``mlp.hook_out`` where the block adds its MLP module's output as it is, not before a post-norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidDictionary, ValueNotAvailable
from ..sae import Dictionary, resolve
from ..sae.sites import binding_of
from ..support import has_mlp
from .streams import WRITES_MODULE, hyper_connected

#: The values a transcoder may read, by the name table's value: the MLP module's input (``mlp.hook_in``), the MLP
#: norm's input normalised before its weight (``ln2.hook_normalized``), the stream after the mixer
#: (``hook_resid_mid``), the stream entering the block (``hook_resid_pre``; a parallel block's ``hook_mlp_in``).
READS = ("mlp_input", "mlp_normalized", "resid_mid", "layer_input")

#: The value a transcoder writes (on a hyper-connected model the MLP module's output: `writes_of`).
WRITES = "mlp_output"
#: The TransformerLens name of each value a transcoder writes.
WRITE_HOOKS = {WRITES: "hook_mlp_out", WRITES_MODULE: "mlp.hook_out"}


def writes_of(model: Any) -> str:
    """The value ``model``'s transcoders write: `WRITES`, or the MLP module's output, ``d`` wide
    (`nncanon.graphs.streams.WRITES_MODULE`) on a model whose blocks keep several streams per position (what the
    block injects into each stream is ``k·d`` wide) or where a block with an MLP serves no ``mlp_output`` (its
    update is not a sum of contributions: residual gains, post-norms; a graph's edges are gradients through the
    frozen model all the same)."""
    if hyper_connected(model):
        return WRITES_MODULE
    report = model.support()
    return WRITES_MODULE if any(has_mlp(row) and row.reasons["mlp_output"] is not None for row in report.layers) \
        else WRITES


def mlp_blocks(model: Any) -> list[bool]:
    """Per block, whether it has an MLP (a transcoder); a block without one (a hybrid's Mamba block) has none."""
    return [has_mlp(row) for row in model.support().layers]


@dataclass
class CrossLayerTranscoder:
    """A cross-layer transcoder (circuit-tracer's CLT), in nncanon's orientation.

    Attributes:
        W_enc: ``[n_layers, d, F]`` each layer's encoder.
        b_enc: ``[n_layers, F]``.
        W_dec: ``n_layers`` tensors, ``W_dec[s]`` ``[F, n_layers - s, d]``: feature ``f`` of layer ``s`` writes
            ``activation · W_dec[s][f, l - s]`` to layer ``l``'s MLP output.
        b_dec: ``[n_layers, d]`` the reconstruction's bias per output layer.
        threshold: ``[n_layers, F]`` (JumpReLU), or ``None`` (ReLU).
        W_skip: ``[n_layers, d, d]`` (circuit-tracer's ``x @ W_skip[l]``), or ``None``.
        feature_input_hook, feature_output_hook: TransformerLens names without the block (``hook_resid_mid``,
            ``hook_mlp_out``), resolved on each block by the name table.
        name: An identifier (circuit-tracer's ``scan``).
    """

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: list[torch.Tensor]
    b_dec: torch.Tensor
    threshold: torch.Tensor | None = None
    W_skip: torch.Tensor | None = None
    feature_input_hook: str = "hook_resid_mid"
    feature_output_hook: str = "hook_mlp_out"
    name: str = "clt"

    @property
    def n_layers(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_model(self) -> int:
        return self.W_enc.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every weight, by name (``W_dec.<s>`` per source layer)."""
        out = {"W_enc": self.W_enc, "b_enc": self.b_enc, "b_dec": self.b_dec}
        out.update({f"W_dec.{s}": w for s, w in enumerate(self.W_dec)})
        out.update({k: v for k, v in (("threshold", self.threshold), ("W_skip", self.W_skip)) if v is not None})
        return out

    def to(self, device: Any = None, dtype: torch.dtype | None = None) -> CrossLayerTranscoder:
        """The CLT with every weight moved (a new record)."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype)
        return CrossLayerTranscoder(move(self.W_enc), move(self.b_enc), [move(w) for w in self.W_dec],
                                    move(self.b_dec), move(self.threshold), move(self.W_skip),
                                    self.feature_input_hook, self.feature_output_hook, self.name)

    def pre(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The encoder pre-activation ``[n, F]`` of ``x [n, d]`` at ``layer`` (with ``b_enc``)."""
        return x.to(self.dtype) @ self.W_enc[layer] + self.b_enc[layer]

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The features ``[n, F]`` of ``x [n, d]`` at ``layer`` (ReLU, or JumpReLU strict)."""
        pre = self.pre(layer, x)
        if self.threshold is None:
            return torch.relu(pre)
        return pre * (pre > self.threshold[layer]).to(pre.dtype)


class Coders:
    """A transcoder set as attribution reads it (per-layer `Dictionary` transcoders or one `CrossLayerTranscoder`).

    Attributes:
        layers: Per block, its per-layer transcoder (``None``: none; that block's MLP output is all error), or
            ``None`` everywhere for a CLT.
        clt: The cross-layer transcoder, or ``None``.
        reads: Per block, the value of `READS` its features read.
        reach: Output layers a feature writes to (1 per-layer, ``n_layers`` for a CLT).
    """

    def __init__(self, layers: list[Dictionary | None], clt: CrossLayerTranscoder | None, reads: list[str]) -> None:
        self.layers, self.clt, self.reads = layers, clt, reads
        self.reach = 1 if clt is None else clt.n_layers

    def present(self, layer: int) -> bool:
        """Whether ``layer`` has an encoder."""
        return self.clt is not None or self.layers[layer] is not None

    def dtype(self, layer: int) -> torch.dtype:
        return self.clt.dtype if self.clt is not None else self.layers[layer].dtype

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Features ``[n, F]`` of the layer's input ``x [n, d]``."""
        if self.clt is not None:
            return self.clt.encode(layer, x)
        return self.layers[layer].encode(x.to(self.dtype(layer)))

    def encoder(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """The encoder columns ``[d, k]`` of ``features`` (indices) at ``layer``: a target is ``x · column``."""
        if self.clt is not None:
            return self.clt.W_enc[layer][:, features]
        return self.layers[layer].W_enc[:, features]

    def decoders(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """``[k, reach, d]``: row ``r`` the vector feature ``f`` of ``layer`` writes to layer ``layer + r`` per unit
        of activation (zero past the last layer)."""
        if self.clt is None:
            return self.layers[layer].W_dec[features][:, None]
        w = self.clt.W_dec[layer][features]
        return torch.cat([w, w.new_zeros(len(features), self.reach - w.shape[1], w.shape[2])], dim=1)

    def skip(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """The skip connection's output ``[..., d]`` of the layer's input ``x``, or ``None`` (no skip)."""
        if self.clt is not None:
            w = self.clt.W_skip
            return None if w is None else x.to(w.dtype) @ w[layer]
        t = self.layers[layer]
        return None if t is None or t.W_skip is None else x.to(t.dtype) @ t.W_skip.T

    def reconstructions(self, features: list[torch.Tensor | None], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each layer's reconstruction ``[n, d]`` (``None`` where it has no transcoder) from every layer's features
        (``[n, F]``) and inputs ``[n, d]``: the decoders of every layer at or before it, ``b_dec`` and the skip."""
        if self.clt is None:
            return [None if f is None else self.layers[layer].decode(f, x=inputs[layer].to(self.dtype(layer)))
                    for layer, f in enumerate(features)]
        clt, out = self.clt, []
        for layer in range(clt.n_layers):
            total = clt.b_dec[layer].expand(features[0].shape[0], -1).clone()
            for source in range(layer + 1):
                total = total + features[source] @ clt.W_dec[source][:, layer - source]
            skip = self.skip(layer, inputs[layer])
            out.append(total if skip is None else total + skip)
        return out


def check_transcoders(model: Any, transcoders: Any) -> Coders:
    """The `Coders` of ``transcoders``, checked against ``model``.

    ``transcoders``: a `CrossLayerTranscoder`; or per-layer transcoders, a sequence with one entry per block
    (``None``: that block's whole MLP output is its error node) or a mapping ``{layer: transcoder}``; or a `Coders`
    (returned as it is: checked when it was made). Each reads one of `READS` at its block and writes its
    ``mlp_output``, where its config names them (unnamed: ``mlp_input``); its widths must be the model's.

    Raises:
        InvalidDictionary: another width, a point not of its block or not one of `READS`, an architecture without a
            linear pre-activation, an input normalisation, NaN weights.
    """
    if isinstance(transcoders, Coders):
        return transcoders  # (checked already)
    n_layers = len(model.layers)
    hidden = model.config.get_text_config().hidden_size
    if isinstance(transcoders, CrossLayerTranscoder):
        return _check_clt(model, transcoders, n_layers, hidden)
    if isinstance(transcoders, Dictionary):
        transcoders = [transcoders]
    if isinstance(transcoders, dict):
        wrong = sorted(str(k) for k in transcoders if not (isinstance(k, int) and 0 <= k < n_layers))
        if wrong:
            raise InvalidDictionary(f"transcoders are keyed by layer 0..{n_layers - 1}; got keys {wrong}")
        transcoders = [transcoders.get(layer) for layer in range(n_layers)]
    transcoders = list(transcoders)
    if len(transcoders) != n_layers:
        raise InvalidDictionary(f"the model has {n_layers} blocks and {len(transcoders)} transcoders were given: pass "
                                "one per block (None where a block has none) or a mapping {layer: transcoder}")
    reads = []
    mlps = mlp_blocks(model)
    for layer, transcoder in enumerate(transcoders):
        reads.append("mlp_input")
        if transcoder is None:
            continue
        if not mlps[layer]:
            raise InvalidDictionary(f"transcoder {layer} is for layers[{layer}], which has no MLP: pass None there "
                                    f"({model.support().reason('mlp', layer=layer)})")
        if not isinstance(transcoder, Dictionary):
            raise InvalidDictionary(f"transcoder {layer} is a {type(transcoder).__name__}, not a "
                                    "nncanon.sae.Dictionary")
        cfg = transcoder.cfg
        where = f"transcoder {layer} ({transcoder.name})"
        if cfg.activation not in ("relu", "jumprelu", "topk") or cfg.rescale_acts_by_decoder_norm:
            raise InvalidDictionary(f"{where} is {cfg.architecture}: a graph's feature targets are the encoder's "
                                    "pre-activation, which relu, jumprelu and top-k transcoders have")
        if cfg.normalize_activations != "none" or cfg.apply_b_dec_to_input:
            raise InvalidDictionary(f"{where} normalises its input ({cfg.normalize_activations}, apply_b_dec_to_input="
                                    f"{cfg.apply_b_dec_to_input}): its features are not linear in the MLP's input")
        if cfg.d_in != hidden or cfg.d_out != hidden:
            raise InvalidDictionary(f"{where} maps {cfg.d_in} -> {cfg.d_out}, but this model's blocks are {hidden} "
                                    "wide: it was trained on another model")
        if cfg.hook_name is not None:
            reads[layer] = _point(model, cfg.hook_name, layer, where, READS)
        if cfg.hook_name_out is not None:
            _point(model, cfg.hook_name_out, layer, where, (writes_of(model),))
        _finite(transcoder.state_dict(), where)
    return Coders(transcoders, None, reads)


def _check_clt(model: Any, clt: CrossLayerTranscoder, n_layers: int, hidden: int) -> Coders:
    where = f"the cross-layer transcoder {clt.name}"
    if not all(mlp_blocks(model)):
        raise InvalidDictionary(f"{where} decodes into every block's MLP, but layers[{mlp_blocks(model).index(False)}] "
                                "has none: use per-layer transcoders (None at the blocks without an MLP)")
    if clt.n_layers != n_layers or clt.d_model != hidden:
        raise InvalidDictionary(f"{where} has {clt.n_layers} layers of width {clt.d_model}, but this model has "
                                f"{n_layers} blocks {hidden} wide: it was trained on another model")
    width = clt.W_enc.shape[2]
    for s, w in enumerate(clt.W_dec):
        if tuple(w.shape) != (width, n_layers - s, hidden):
            raise InvalidDictionary(f"{where}'s W_dec[{s}] is {tuple(w.shape)}, not {(width, n_layers - s, hidden)} "
                                    "(features, output layers from its own, width)")
    reads = [_point(model, f"blocks.{layer}.{clt.feature_input_hook}", layer, where, READS)
             for layer in range(n_layers)]
    for layer in range(n_layers):
        _point(model, f"blocks.{layer}.{clt.feature_output_hook}", layer, where, (writes_of(model),))
    _finite(clt.tensors(), where)
    return Coders([None] * n_layers, clt, reads)


def _point(model: Any, name: str, layer: int, where: str, allowed: tuple[str, ...]) -> str:
    """The value ``name`` resolves to on block ``layer``, one of ``allowed``; `InvalidDictionary` otherwise."""
    try:
        point = resolve(model, _mlp_hook(model, name, layer))
    except ValueNotAvailable as error:
        raise InvalidDictionary(f"{where} names {name!r}, which this model cannot read: {error}") from None
    if point.value == WRITES and WRITES_MODULE in allowed and name.endswith("mlp.hook_out") and point.layer == layer:
        return WRITES_MODULE  # (this block adds its MLP module's output as it is: `_mlp_hook` named it so)
    if point.layer != layer or point.value not in allowed or point.head is not None:
        wanted = " or ".join(f"layers.{layer}.{value}" for value in allowed)
        raise InvalidDictionary(f"{where} names {name!r} ({point.label}); a graph's transcoder for block {layer} "
                                f"{'reads' if set(allowed) <= set(READS) else 'writes'} {wanted}")
    return point.value


def _finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    for key, tensor in tensors.items():
        if tensor is not None and not torch.isfinite(tensor).all():
            raise InvalidDictionary(f"{where}'s {key} holds NaN or infinite values")


def _mlp_hook(model: Any, name: str, layer: int) -> str:
    """circuit-tracer's ``mlp.hook_out`` (its MLP wrapper's output) as the name table's ``hook_mlp_out`` where block
    ``layer`` adds its MLP module's output as it is (``mlp.hook_in``, the MLP module's input, is a name of the table
    as it is). Before a post-norm (Gemma-2/3, OLMo-2) or a residual multiplier (Granite) the module's output is not
    what the block adds: the name stays ``mlp.hook_out`` (``mlp_module_output``), which a graph's transcoder does not
    write, and `_point` refuses it by name rather than read it as the value after the norm."""
    if not name.endswith("mlp.hook_out"):
        return name
    try:
        binding = binding_of(model, layer, "mlp_output")
    except ValueNotAvailable:
        return name
    site, path = binding.site, getattr(model.layers[layer].mlp, "path", None)
    plain = (site.key == "output" and site.op is None and site.scale is None and site.bias is None
             and not (site.merge or site.stacked or site.weighted))
    return name.replace("mlp.hook_out", "hook_mlp_out") if plain and binding.location == f"{path}.output" else name
