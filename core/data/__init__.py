"""From a user's dataset to the model's batches: ``ppmedia.data``, one module per concern.

==============  ==========================================================================
``records``     one record in one form (LLaVA or messages style): turns, media by kind
``sources``     :func:`open_dataset`: JSON / JSON Lines / ``datasets``, checked when opened
``media``       reading images (PIL) and audio (soundfile); counted opens
``video``       videos as the processor samples them: its metadata, only the kept frames (PyAV)
``labels``      assistant-only labels from the chat template (markers or sentinel rendering)
``processor``   :class:`SampleProcessor`: the model's processor on one record, lengths
``batching``    :func:`collate_samples`: padded token rows, media in sample order
``loader``      :class:`ReplicaLoader`: a replica's share of each global batch, resumable
``packed``      :class:`Packing`: a replica's samples of a batch (or window) packed into rows
``grouped``     :func:`grouped_order`: the shuffled order grouped by length (windows of batches)
``counts``      :func:`global_label_tokens`: the loss's token count over the replicas
``errors``      :class:`DataError`: one error naming the file and line (or index)
==============  ==========================================================================

See docs/data.md ("Training on your data").
"""

from __future__ import annotations

from .batching import collate_samples
from .counts import global_label_tokens
from .errors import DataError
from .grouped import grouped_order, record_length_key, step_order
from .loader import ReplicaLoader, epoch_order
from .media import media_reads
from .packed import Packing, pack_steps
from .processor import SampleProcessor, TooLong
from .records import Record, parse_record
from .sources import RecordDataset, open_dataset

__all__ = [
    "DataError",
    "Packing",
    "Record",
    "RecordDataset",
    "ReplicaLoader",
    "SampleProcessor",
    "TooLong",
    "collate_samples",
    "epoch_order",
    "global_label_tokens",
    "grouped_order",
    "media_reads",
    "open_dataset",
    "pack_steps",
    "parse_record",
    "record_length_key",
    "step_order",
]
