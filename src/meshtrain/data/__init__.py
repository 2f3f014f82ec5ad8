"""Data: `prepare` (inputs -> token shards + manifest, streamed, parallel) and the loader (a
deterministic, resumable order over one prepared directory or a weighted blend)."""

from meshtrain.data.format import read_manifest
from meshtrain.data.loader import Blend, Dataset, DistributedLoader, validation_batches
from meshtrain.data.prepare import prepare
from meshtrain.data.sources import stdlib_sources
from meshtrain.data.windows import IGNORE_INDEX, PreferencePairs, TokenWindows

__all__ = [
    "IGNORE_INDEX",
    "Blend",
    "Dataset",
    "DistributedLoader",
    "PreferencePairs",
    "TokenWindows",
    "prepare",
    "read_manifest",
    "stdlib_sources",
    "validation_batches",
]
