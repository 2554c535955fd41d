"""Testing kit for ppmedia and for authors of adapter plugins.

* :mod:`ppmedia.testing.tiny_models`: tiny seeded transformers models and processor-style batches, one
  module per built-in family; :func:`~ppmedia.testing.tiny_models.load` also takes a plugin's own
  tiny-family module (object or dotted name);
* :mod:`ppmedia.testing.checks`: :func:`check_adapter`, an adapter through split -> stage -> consume ->
  merge for several microbatch counts against the model's own full-batch merged embeddings;
* :mod:`ppmedia.testing.stages`: :func:`check_stage_splits`, stage modules of chosen layer splits run
  in one process against the model's own logits and gradients (state that crosses stage boundaries);
* :mod:`ppmedia.testing.goldens`: :func:`write_goldens` / :func:`check_goldens` (config, inputs and
  expected embeddings as safetensors; configs and inputs regenerate byte for byte, expected floats
  within :func:`~ppmedia.testing.goldens.regeneration_tolerance`, a bound that scales with the tensor);
* :mod:`ppmedia.testing.parity`: the multi-process pipeline parity harness (real
  ``torch.distributed.pipelining`` schedules over gloo, compared with the model's own forward);
  :func:`check_pipeline_parity` wraps it for any family;
* :mod:`ppmedia.testing.processors`: :func:`build_tiny_processor` / :func:`save_tiny_processor`, a tiny
  family's own real processor classes around a word-level tokenizer with the tiny model's ids
  (:mod:`ppmedia.testing.word_tokenizer`), and :func:`chat_batch` to make batches with it;
* :mod:`ppmedia.testing.datasets`: :func:`save_tiny_checkpoint` (a tiny model and its processor in one
  folder) and :func:`write_image_chat_dataset` (generated images and a LLaVA-style JSON Lines file);
* :mod:`ppmedia.testing.kit`: :class:`FamilyKit`, all of the above for one family, built once;
* :mod:`ppmedia.testing.pytest_plugin`: the pytest plugin (entry point ``pytest11``, fixture
  ``ppmedia_kit``).

Nothing here is needed to train. Importing this package imports nothing heavy (each name below is
imported on first use); the kit imports torch, the tiny models transformers when a family is loaded,
and the parity harness spawns processes.
"""

import typing as _typing

from .._lazy import lazy_attributes as _lazy_attributes

_EXPORTS = {
    "AdapterMismatch": "checks",
    "FamilyKit": "kit",
    "Kit": "kit",
    "MicrobatchCheck": "checks",
    "StageSplitCheck": "stages",
    "check_adapter": "checks",
    "check_goldens": "goldens",
    "check_pipeline_parity": "kit",
    "build_tiny_processor": "processors",
    "chat_batch": "processors",
    "check_stage_splits": "stages",
    "save_tiny_checkpoint": "datasets",
    "save_tiny_processor": "processors",
    "write_goldens": "goldens",
    "write_image_chat_dataset": "datasets",
}
__getattr__, __dir__ = _lazy_attributes(__name__, _EXPORTS)

if _typing.TYPE_CHECKING:
    from .checks import AdapterMismatch, MicrobatchCheck, check_adapter
    from .datasets import save_tiny_checkpoint, write_image_chat_dataset
    from .goldens import check_goldens, write_goldens
    from .kit import FamilyKit, Kit, check_pipeline_parity
    from .processors import build_tiny_processor, chat_batch, save_tiny_processor
    from .stages import StageSplitCheck, check_stage_splits

__all__ = [
    "AdapterMismatch",
    "FamilyKit",
    "Kit",
    "MicrobatchCheck",
    "StageSplitCheck",
    "build_tiny_processor",
    "chat_batch",
    "check_adapter",
    "check_goldens",
    "check_pipeline_parity",
    "check_stage_splits",
    "save_tiny_checkpoint",
    "save_tiny_processor",
    "write_goldens",
    "write_image_chat_dataset",
]
