"""Fault injection for the recovery tests, loaded into every process of a run by putting this
directory on PYTHONPATH (Python imports `sitecustomize` at start-up), so that production code
carries no test hooks. Set in the run's environment:

  MESHTRAIN_FAIL_AT_STEP=N          rank MESHTRAIN_FAIL_RANK (default 0) dies as step N starts
  MESHTRAIN_FAIL_IN_SAVE_AT_STEP=N  that rank dies while committing the checkpoint of step N
  MESHTRAIN_STEP_SLEEP=S            every step takes S seconds longer (time to signal a run mid-way)
  MESHTRAIN_ENOSPC_AT_STEP=N        every rank's checkpoint write of step N fails: "No space left on device"

Faults fire on the first attempt only (TORCHELASTIC_RESTART_COUNT 0), so an elastic restart recovers.
"""

import os


def _dies_here(var: str, step: int) -> bool:
    return (os.environ.get(var) == str(step) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and os.environ.get("MESHTRAIN_FAIL_RANK", "0") == os.environ.get("RANK", "0"))


def _die(what: str) -> None:
    print(f"[fault injection] rank {os.environ.get('RANK', '0')} dies {what}", flush=True)
    os._exit(1)


def _install() -> None:
    names = ("MESHTRAIN_FAIL_AT_STEP", "MESHTRAIN_FAIL_IN_SAVE_AT_STEP", "MESHTRAIN_STEP_SLEEP", "MESHTRAIN_ENOSPC_AT_STEP")
    if not any(os.environ.get(n) for n in names):
        return
    import errno
    import time

    import torch.distributed.checkpoint as dcp

    from meshtrain.checkpoint import Checkpointer
    from meshtrain.data.loader import DistributedLoader

    next_batch, commit = DistributedLoader.next_batch, Checkpointer._commit

    def faulty_next_batch(self):
        step = self.consumed // self.global_batch + 1
        if _dies_here("MESHTRAIN_FAIL_AT_STEP", step):
            _die(f"at step {step}")
        time.sleep(float(os.environ.get("MESHTRAIN_STEP_SLEEP") or 0))
        return next_batch(self)

    def faulty_commit(self, step, path, train_state):
        if _dies_here("MESHTRAIN_FAIL_IN_SAVE_AT_STEP", step):
            _die(f"during the save of step {step}")
        return commit(self, step, path, train_state)

    save = dcp.save

    def full_disk_save(state, checkpoint_id, **kwargs):
        if checkpoint_id.endswith(f"step_{int(os.environ.get('MESHTRAIN_ENOSPC_AT_STEP') or -1):08d}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), checkpoint_id)
        return save(state, checkpoint_id=checkpoint_id, **kwargs)

    DistributedLoader.next_batch, Checkpointer._commit, dcp.save = faulty_next_batch, faulty_commit, full_disk_save


_install()
