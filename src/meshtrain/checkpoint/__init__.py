"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, commit, resume, reshard, prune.

A checkpoint is a directory `<checkpoint.dir>/step_00000006/`:
  .metadata, __<rank>_0.distcp   DCP: model and optimizer, keyed by parameter name (so any layout
                                 can load what any other layout saved)
  train_state.json               step, data-loader position, LR schedule, RNG, layout, model shape
                                 (LoRA: the adapters' settings and the base they belong to; only
                                 the adapters are in the shards)
  COMMITTED.json                 written last, once every rank has finished: step, layout, the size
                                 and CRC-32 of every file (each rank checksums the shards it wrote)
A directory without COMMITTED.json is an interrupted save, and one whose files no longer match their
checksums is damaged: `resume = "auto"` skips either with a warning and takes the previous one.
Older checkpoints are deleted only after a newer one has committed.

The parts: `commit` (the marker, checksums, retiring), `resume` (where a start continues from) and
`checkpointer` (DCP save and load). The package exports the first two; `Checkpointer` is imported from
`meshtrain.checkpoint.checkpointer`, so that what only reads checkpoints (the launcher's resume checks,
export) does not load torch.distributed.checkpoint and DTensor.
"""

from meshtrain.checkpoint.commit import (
    MARKER,
    TRAIN_STATE,
    committed_checkpoints,
    crc32,
    read_train_state,
    step_dirs,
    verify,
)
from meshtrain.checkpoint.resume import (
    checkpoint_root,
    continue_job,
    find_resume,
    job_came_back,
    job_locks,
    newest_checkpoint,
    refuse_another_lineage,
    refuse_overwriting_results,
    run_checkpoint_root,
    saved_by_this_job,
)

__all__ = [
    "MARKER",
    "TRAIN_STATE",
    "checkpoint_root",
    "committed_checkpoints",
    "continue_job",
    "crc32",
    "find_resume",
    "job_came_back",
    "job_locks",
    "newest_checkpoint",
    "refuse_another_lineage",
    "read_train_state",
    "refuse_overwriting_results",
    "run_checkpoint_root",
    "saved_by_this_job",
    "step_dirs",
    "verify",
]
