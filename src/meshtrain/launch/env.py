"""Who am I: rank, world size and rendezvous address, read from the launcher's environment."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from meshtrain.errors import MeshtrainError


@dataclass
class LaunchEnv:
    launcher: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    job_id: str = ""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.launcher != "single"

    def as_dict(self) -> dict:
        return asdict(self)

    def export(self) -> None:
        """Set the variables torch.distributed's env:// rendezvous reads."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
                          MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))


def _int(env: dict, key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise MeshtrainError(f"environment variable {key}={env[key]!r} is not an integer") from None


def detect(env: dict | None = None) -> LaunchEnv:
    """torchrun / torch elastic (also what pyxis's PyTorch hook and Kubeflow set), else one process."""
    env = dict(os.environ) if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
        if missing:
            raise MeshtrainError(f"{' and '.join(missing)} missing from the environment while "
                                 f"{'WORLD_SIZE' if 'RANK' in missing else 'RANK'} is set; set both or neither")
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        if not 0 <= rank < world:
            raise MeshtrainError(f"RANK={rank} is outside WORLD_SIZE={world}")
        return LaunchEnv(
            launcher="torchrun",
            rank=rank,
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world,
            node_rank=_int(env, "GROUP_RANK") if "GROUP_RANK" in env else 0,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
            job_id=env.get("TORCHELASTIC_RUN_ID", ""),
        )
    return LaunchEnv(launcher="single")
