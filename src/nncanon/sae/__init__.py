"""Sparse autoencoders and transcoders on the standard surface: SAELens dictionaries on every family.

- `Dictionary` (``dictionary``): a dictionary's math, loaded from a SAELens folder (`Dictionary.load`, no
  ``sae_lens`` needed) or built from tensors (`Dictionary.from_tensors`); `config`: reading ``cfg.json``.
- `resolve`, `value_at` (``names``, ``sites``): one name table, TransformerLens hook names, nncanon values and
  module paths, as points of the model.
- `attach` (``splice``): a dictionary's features as a value of every trace, spliced with the error term (an
  unedited run is the clean run, bit for bit).
- ``processing``: the TransformerLens processing a dictionary's config records (``model_from_pretrained_kwargs``),
  applied to what it reads and undone on what it writes.
- ``tools``: ablate and steer features, feature attribution, top-activating contexts; ``evaluation``: the standard
  evaluation; ``collection``: activations over a corpus for training dictionaries.

The demo dictionary is ``nncanon.demo_dictionary()`` (``nncanon.demo``: the entry points load it).

See ``docs/dictionaries.md`` and ``docs/hook-names.md``.
"""

from .config import ARCHITECTURES, NORMALIZATIONS, DictionaryConfig, read_config
from .dictionary import Dictionary
from .names import DERIVED, TRANSFORMER_LENS, Point, resolve
from .sites import value_at
from .splice import AttachedDictionary, attach, attached

__all__ = [
    "ARCHITECTURES",
    "DERIVED",
    "NORMALIZATIONS",
    "TRANSFORMER_LENS",
    "AttachedDictionary",
    "Dictionary",
    "DictionaryConfig",
    "Point",
    "attach",
    "attached",
    "read_config",
    "resolve",
    "value_at",
]
