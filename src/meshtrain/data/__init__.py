from meshtrain.data.loader import Dataset, DistributedLoader, TokenWindows, validation_batches
from meshtrain.data.prepare import prepare, read_manifest, stdlib_sources

__all__ = [
    "Dataset",
    "DistributedLoader",
    "TokenWindows",
    "prepare",
    "read_manifest",
    "stdlib_sources",
    "validation_batches",
]
