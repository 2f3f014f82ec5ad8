"""Who am I: rank, world size and rendezvous address, read from whichever launcher started us.

One small class per environment (in the spirit of Lightning's cluster environments). Precedence,
first match wins:
  1. torchrun / torch elastic: RANK + WORLD_SIZE (also Kubeflow; not an srun task whose pyxis/enroot
     hook copied its ids there without LOCAL_WORLD_SIZE: Slurm's variables place it, see 5.)
  2. AzureML: AZ_BATCH_MASTER_NODE with Open MPI ranks
  3. Open MPI: OMPI_COMM_WORLD_* (wins over Slurm: under `mpirun` inside `sbatch` every rank also
     carries the batch step's SLURM_PROCID=0)
  4. MPICH / Intel MPI (Hydra), `srun --mpi=pmi2`: PMI_RANK + PMI_SIZE
  5. Slurm `srun` task: SLURM_PROCID inside a job step (SLURM_STEP_ID set). The batch step has
     SLURM_PROCID=0 and SLURM_NTASKS=2 but no step id: it is one process, not rank 0 of 2.
  6. a single process.
Under MPI the hosts come from the scheduler (Slurm node list, SGE's PE_HOSTFILE or
SGE_JOB_HOSTLIST, PBS_NODEFILE); MASTER_ADDR/MASTER_PORT, when set, always win.
"""

from __future__ import annotations

import os
import re
import zlib
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path

from meshtrain.config import LAUNCHERS
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
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


class ClusterEnvironment(ABC):
    """rank, world_size, local_rank, local_world_size, node_rank, master_addr, master_port, job_id."""

    name = ""

    def __init__(self, env: dict[str, str]):
        self.env = env

    @staticmethod
    @abstractmethod
    def detect(env: dict[str, str]) -> bool:
        """Whether this launcher started the process."""

    def int(self, *keys: str, default: int | None = None) -> int:
        return env_int(self.env, *keys, default=default, launcher=self.name)

    def tasks_per_node(self) -> int | None:
        """Slurm's tasks on each node of the step (None: not under Slurm)."""
        for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            if self.env.get(key):
                return tasks_per_node(key, self.env[key])
        return None

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size  # block distribution of ranks over nodes

    def label(self) -> str:
        """The launcher, with the scheduler that allocated the hosts when it is not the launcher."""
        if self.name in ("openmpi", "mpich"):
            for scheduler, key in (
                ("slurm", "SLURM_JOB_ID"),
                ("sge", "PE_HOSTFILE"),
                ("sge", "SGE_JOB_HOSTLIST"),
                ("pbs", "PBS_JOBID"),
            ):
                if self.env.get(key):
                    return f"{self.name}+{scheduler}"
        return self.name

    @property
    def job_id(self) -> str:
        for key in ("SLURM_JOB_ID", "JOB_ID", "PBS_JOBID"):
            if self.env.get(key):
                return self.env[key]
        return ""

    @property
    def master_addr(self) -> str:
        if self.env.get("MASTER_ADDR"):
            return self.env["MASTER_ADDR"]
        host = first_scheduler_host(self.env)
        if host:
            return host
        if self.world_size == self.local_world_size:
            return "127.0.0.1"  # one node
        raise MeshtrainError(
            f"{self.name}: cannot tell which host is the first of {self.world_size} ranks on several nodes "
            "(no Slurm, SGE or PBS host list); export MASTER_ADDR=<first host> to every rank"
        )

    @property
    def master_port(self) -> int:
        if self.env.get("MASTER_PORT"):
            return checked_port(self.int("MASTER_PORT"), "MASTER_PORT")
        return port_from_job_id(self.job_id)

    def resolve(self) -> LaunchEnv:
        if self.world_size < 1 or self.local_world_size < 1:
            raise MeshtrainError(
                f"{self.name}: world size {self.world_size} with {self.local_world_size} per node: "
                "both must be at least 1; check the launcher's task counts"
            )
        launch = LaunchEnv(
            self.label(),
            self.rank,
            self.world_size,
            self.local_rank,
            self.local_world_size,
            self.node_rank,
            self.master_addr,
            self.master_port,
            self.job_id,
        )
        check_consistent(launch)
        return launch


class TorchElastic(ClusterEnvironment):
    name = "torchrun"

    @staticmethod
    def detect(env):
        return ("RANK" in env or "WORLD_SIZE" in env) and not container_hook_task(env)

    def resolve(self) -> LaunchEnv:
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in self.env]
        if missing:
            present = "WORLD_SIZE" if "RANK" in missing else "RANK"
            raise MeshtrainError(
                f"{missing[0]} is missing from the environment while {present} is set; "
                "set both (torchrun does) or neither"
            )
        return super().resolve()

    rank = property(lambda self: self.int("RANK"))
    world_size = property(lambda self: self.int("WORLD_SIZE"))
    # env:// without torchrun (RANK and WORLD_SIZE alone): one node, each rank on its own device
    local_world_size = property(lambda self: self.int("LOCAL_WORLD_SIZE", default=self.world_size))
    local_rank = property(lambda self: self.int("LOCAL_RANK", default=self.rank % self.local_world_size))
    node_rank = property(lambda self: self.int("GROUP_RANK", default=self.rank // self.local_world_size))
    job_id = property(lambda self: self.env.get("TORCHELASTIC_RUN_ID", "") or ClusterEnvironment.job_id.fget(self))


class OpenMPI(ClusterEnvironment):
    name = "openmpi"

    @staticmethod
    def detect(env):
        return "OMPI_COMM_WORLD_RANK" in env

    rank = property(lambda self: self.int("OMPI_COMM_WORLD_RANK"))
    world_size = property(lambda self: self.int("OMPI_COMM_WORLD_SIZE"))
    local_rank = property(lambda self: self.int("OMPI_COMM_WORLD_LOCAL_RANK"))
    local_world_size = property(lambda self: self.int("OMPI_COMM_WORLD_LOCAL_SIZE"))

    @property
    def job_id(self) -> str:
        return ClusterEnvironment.job_id.fget(self) or self.env.get("OMPI_MCA_ess_base_jobid", "")


class AzureML(OpenMPI):
    name = "azureml"

    @staticmethod
    def detect(env):
        return "AZ_BATCH_MASTER_NODE" in env and "OMPI_COMM_WORLD_RANK" in env

    @property
    def master_addr(self) -> str:
        return self.env.get("MASTER_ADDR") or self.env["AZ_BATCH_MASTER_NODE"].split(":")[0]

    @property
    def master_port(self) -> int:
        _, _, port = self.env["AZ_BATCH_MASTER_NODE"].partition(":")
        if self.env.get("MASTER_PORT") or not port:
            return super().master_port
        if not port.isdigit():
            raise MeshtrainError(
                f"environment variable AZ_BATCH_MASTER_NODE={self.env['AZ_BATCH_MASTER_NODE']!r}: its port "
                f"{port!r} is not a number; export MASTER_PORT=<port> to every rank"
            )
        return checked_port(int(port), "AZ_BATCH_MASTER_NODE")


class MPICH(ClusterEnvironment):
    """MPICH / Intel MPI (Hydra) and `srun --mpi=pmi2`."""

    name = "mpich"

    @staticmethod
    def detect(env):
        return "PMI_RANK" in env and "PMI_SIZE" in env

    rank = property(lambda self: self.int("PMI_RANK"))
    world_size = property(lambda self: self.int("PMI_SIZE"))

    @property
    def local_rank(self) -> int:
        """Hydra's, Cray PALS's or Slurm's; with no count per node (one node of every rank), the rank."""
        keys = ("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID")
        return self.int(*keys) if any(k in self.env for k in keys) else self.rank % self.local_world_size

    @property
    def local_world_size(self) -> int:
        """Hydra's or Cray PALS's count, else Slurm's (`srun --mpi=pmi2`), else one node of every rank."""
        for key in ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"):
            if key in self.env:
                return self.int(key)
        per_node = self.tasks_per_node()
        return self.world_size if per_node is None else per_node


class Slurm(ClusterEnvironment):
    """One task per rank, started by `srun` (only inside a job step)."""

    name = "slurm"

    @staticmethod
    def detect(env):
        return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)

    rank = property(lambda self: self.int("SLURM_PROCID"))
    world_size = property(lambda self: self.int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))
    local_rank = property(lambda self: self.int("SLURM_LOCALID"))
    node_rank = property(lambda self: self.int("SLURM_NODEID"))

    @property
    def local_world_size(self) -> int:
        per_node = self.tasks_per_node()
        if per_node is None:
            raise MeshtrainError("slurm: environment variable SLURM_STEP_TASKS_PER_NODE is missing (srun sets it)")
        return per_node


def container_hook_task(env: dict[str, str]) -> bool:
    """An srun task whose container hook (enroot's PyTorch hook under pyxis) copied Slurm's task ids into
    torchrun's RANK, WORLD_SIZE and LOCAL_RANK, but not LOCAL_WORLD_SIZE: read as torchrun's, a job of
    several nodes would be one node; Slurm's own variables place it."""
    return (
        Slurm.detect(env)
        and "TORCHELASTIC_RUN_ID" not in env
        and "LOCAL_WORLD_SIZE" not in env
        and env.get("RANK") == env.get("SLURM_PROCID")
    )


def one_task_per_node(env: dict[str, str]) -> bool:
    """An srun step of one task per node (the agent-per-node mode): the task is a node's launcher."""
    return Slurm.detect(env) and Slurm(env).tasks_per_node() == 1


class Single(ClusterEnvironment):
    name = "single"

    @staticmethod
    def detect(env):
        return True

    rank = local_rank = node_rank = 0
    world_size = local_world_size = 1
    master_addr = "127.0.0.1"
    master_port = 29500


ENVIRONMENTS: dict[str, type[ClusterEnvironment]] = {
    "torchrun": TorchElastic,
    "azureml": AzureML,
    "openmpi": OpenMPI,
    "mpich": MPICH,
    "slurm": Slurm,
    "single": Single,
}
assert ("auto", *ENVIRONMENTS) == LAUNCHERS


def first_scheduler_host(env: dict[str, str]) -> str:
    """The first host of the allocation, from Slurm, SGE or PBS."""
    key = next((k for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if env.get(k)), None)
    if key:
        import hostlist

        try:
            hosts = hostlist.expand_hostlist(env[key])
        except hostlist.BadHostlist as e:
            hosts, reason = [], str(e)
        else:
            reason = "it names no host"
        if not hosts:
            raise MeshtrainError(
                f"environment variable {key}={env[key]!r} is not a Slurm host list ({reason}): it should look "
                "like gpu[01-04],cpu7; unset it or export MASTER_ADDR=<first host>"
            )
        return hosts[0]
    for key in ("PE_HOSTFILE", "SGE_JOB_HOSTLIST", "PBS_NODEFILE"):
        path = env.get(key)
        if path and Path(path).is_file():
            lines = [line.split() for line in Path(path).read_text().splitlines() if line.strip()]
            if lines:
                return lines[0][0]
    return ""


def env_int(env: dict[str, str], *keys: str, default: int | None = None, launcher: str = "") -> int:
    """The first of `keys` set in `env`, as an integer; `default` where none is set (None: required)."""
    key = next((k for k in keys if k in env), None)
    if key is None:
        if default is None:
            raise MeshtrainError(f"{launcher or 'launcher'}: environment variable {' or '.join(keys)} is missing")
        return default
    try:
        return int(env[key])
    except ValueError:
        raise MeshtrainError(
            f"environment variable {key}={env[key]!r} is not an integer: set it to a whole number or unset it"
        ) from None


_PER_NODE = re.compile(r"(\d+)(?:\(x\d+\))?")  # a count, repeated on N nodes: "4(xN)"


def tasks_per_node(key: str, text: str) -> int:
    """The tasks on every node, from Slurm's per-node counts ("4", "4(x2)", "4,2", "2(x3),1", also
    MPICH under srun). Ranks sit in blocks of one count per node (node_rank = rank // count), so
    nodes with different counts are refused rather than read from the first one."""
    items = [_PER_NODE.fullmatch(item.strip()) for item in text.split(",")]
    if not all(items):
        raise MeshtrainError(
            f"environment variable {key}={text!r} is not Slurm's tasks per node, such as 4 or 4(x2),3: "
            "unset it or let srun set it"
        )
    counts = {int(m[1]) for m in items}
    if len(counts) > 1:
        raise MeshtrainError(
            f"{key}={text!r}: the nodes run different numbers of tasks, but ranks are placed the same number "
            "per node: start the same number on every node (srun --ntasks-per-node=N)"
        )
    return counts.pop()


def checked_port(port: int, source: str) -> int:
    """A rendezvous port, refused before any process group waits on one that cannot exist."""
    if not 1 <= port <= 65535:
        raise MeshtrainError(f"{source}: port {port} is outside 1..65535: set a free port in that range")
    return port


def port_from_job_id(job_id: str) -> int:
    """A port below the ephemeral range (15000-31999), the same on every rank of one job."""
    if not job_id:
        return 29500
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return 15000 + number % 17000


def check_consistent(launch: LaunchEnv) -> None:
    if not 0 <= launch.rank < launch.world_size:
        raise MeshtrainError(f"{launch.launcher}: rank {launch.rank} is outside world size {launch.world_size}")
    if not 0 <= launch.local_rank < launch.local_world_size or launch.world_size % launch.local_world_size:
        raise MeshtrainError(
            f"{launch.launcher}: local rank {launch.local_rank} of {launch.local_world_size} per node does not fit "
            f"world size {launch.world_size}; start the same number of tasks on every node"
        )
    if launch.local_rank != launch.rank % launch.local_world_size:
        fix = (
            "set LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun does (ranks in blocks of LOCAL_WORLD_SIZE per node)"
            if launch.launcher == "torchrun"
            else "use mpirun --map-by slot / srun --distribution=block"
        )
        raise MeshtrainError(
            f"{launch.launcher}: ranks are not placed in blocks per node (rank {launch.rank} has local rank "
            f"{launch.local_rank} of {launch.local_world_size}), so a node's tensor-parallel group would span "
            f"nodes: {fix}"
        )


def chosen_launcher(configured: str, env: dict[str, str] | None = None) -> str:
    """The launcher a job names: launch.env, or where that is "auto" MESHTRAIN_LAUNCHER ("auto": found
    from the environment)."""
    env = os.environ if env is None else env
    return env.get("MESHTRAIN_LAUNCHER", configured) if configured == "auto" else configured


def refuse_single_among_many(env: dict[str, str]) -> None:
    """launch.env = single makes a process train alone whatever its environment says: right inside a
    Slurm allocation of several tasks that runs one process (its variables describe the allocation),
    wrong for a process torchrun or mpirun started beside others, whose variables count the
    processes themselves: each would train the whole job alone and write the same run.dir. Stray
    RANK/WORLD_SIZE without torchrun's own TORCHELASTIC_RUN_ID (a container's) are what single is
    forced against, so only torchrun's are taken as several processes."""
    for cls in (TorchElastic, OpenMPI, MPICH):
        if cls is TorchElastic and "TORCHELASTIC_RUN_ID" not in env:
            continue
        if cls.detect(env) and (world := cls(env).resolve().world_size) > 1:
            raise MeshtrainError(
                f"launch.env = 'single', but {cls.name} started this process as one of {world}: each would train "
                f"alone; drop launch.env (or set it to {cls.name}), or start one process"
            )


def detect(env: dict[str, str] | None = None, launcher: str = "auto") -> LaunchEnv:
    env = dict(os.environ) if env is None else env
    launcher = chosen_launcher(launcher, env)
    if launcher not in LAUNCHERS:
        raise MeshtrainError(f"launch.env = {launcher!r} is unknown: use one of {', '.join(LAUNCHERS)}")
    if launcher != "auto":
        cls = ENVIRONMENTS[launcher]
        if not (cls.detect(env) or (cls is TorchElastic and container_hook_task(env))):  # forced: the hook's
            raise MeshtrainError(f"launch.env = {launcher!r} but this process was not started by it")
        if cls is Single:
            refuse_single_among_many(env)
        return cls(env).resolve()
    for cls in ENVIRONMENTS.values():
        if cls.detect(env):
            return cls(env).resolve()
    raise AssertionError("Single always matches")
