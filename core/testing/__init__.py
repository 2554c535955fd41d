"""Testing kit for ppmedia and for authors of adapter plugins.

* :mod:`ppmedia.testing.tiny_models`: tiny seeded transformers models and processor-style batches,
  one module per built-in family;
* :mod:`ppmedia.testing.parity`: the multi-process pipeline parity harness (real
  ``torch.distributed.pipelining`` schedules over gloo, compared with the model's own forward).

Nothing here is needed to train: it imports transformers and spawns processes, and is only loaded
when asked for.
"""
