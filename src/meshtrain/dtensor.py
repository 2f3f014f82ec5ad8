"""`is_dtensor`: isinstance(t, DTensor) without importing DTensor. torch.distributed.tensor takes a
second or more of every process's start to import, which a single-process run never needs: the
modules that shard (FSDP, TP, CP, distributed checkpoints) import it where they are used, and no
tensor can be a DTensor before it is loaded."""

from __future__ import annotations

import sys


def is_dtensor(t: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
