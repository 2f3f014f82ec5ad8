"""`meshtrain jobscript KIND`: ready-to-submit scripts for Slurm, SGE (ABCI), PBS, plain mpirun,
torchrun, and an AWS ParallelCluster config (GPU or Trainium nodes). Each line says what it does."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Literal

from meshtrain.config import option
from meshtrain.config.options import check_declared
from meshtrain.errors import MeshtrainError


@dataclass(frozen=True)
class TrainiumNode:
    """A Trainium2 instance as the job uses it: `cores` logical NeuronCores (LNC=2, the Neuron default),
    one rank each; `cpus` vCPUs, shared by its ranks."""

    cores: int
    cpus: int


TRAINIUM = {"trn2.48xlarge": TrainiumNode(64, 192), "trn2.3xlarge": TrainiumNode(4, 12)}


def _check_time(text: str) -> None:
    from meshtrain.config import parse_duration

    parse_duration(text, "--time")


@dataclass
class JobSpec:
    """A job, as `meshtrain jobscript` takes it: every field is a flag, declared once (type, bounds,
    doc), and checked by the same declarations as the config keys."""

    config: str = option()
    """The training config the job runs."""
    nodes: int = option(1, ge=1)
    """Nodes."""
    gpus_per_node: int = option(0, ge=0)
    """GPUs per node (0: CPU nodes, see --procs-per-node)."""
    procs_per_node: int = option(1, ge=1)
    """Ranks per node on CPU nodes."""
    time: str = option("", check=_check_time)
    """Wall-clock limit, HH:MM:SS (also seconds, or D-HH[:MM[:SS]] as Slurm writes days), written into
    the scripts as HH:MM:SS; default 01:00:00 for the schedulers
    (slurm, sge, pbs, pcluster), none for mpirun and torchrun, where training stops itself at it."""
    partition: str = ""
    """Slurm partition / PBS queue."""
    account: str = ""
    """Slurm account / PBS project / ABCI group."""
    job_name: str = "meshtrain"
    """The scheduler's name for the job."""
    container_image: str = ""
    """pyxis/enroot image for srun."""
    container_mounts: str = ""
    """pyxis: SRC:DST mounts for the container."""
    container_workdir: str = ""
    """pyxis: the working directory inside the container."""
    sge_pe: str = option("", flags=("--pe",))
    """sge: parallel environment to request, -pe NAME slots (default: ABCI's -l rt_F nodes)."""
    mode: Literal["task-per-rank", "agent-per-node"] = "task-per-rank"
    """slurm: one srun task per rank, or one torch elastic agent per node."""
    modules: list[str] = option(default_factory=list, flags=("--module",))
    """Environment module to load (repeatable)."""
    accelerator: Literal["gpu", "trainium"] = "gpu"
    """pcluster: the compute nodes' accelerator: NVIDIA GPUs, or AWS Trainium (trn2, one rank per logical
    NeuronCore, --launch.device neuron; untested on hardware)."""
    instance_type: str = ""
    """pcluster: compute instance type (default: p5.48xlarge, or trn2.48xlarge with --accelerator trainium)."""
    venv: str = ".venv"
    """Where meshtrain is installed on the cluster (pcluster --accelerator trainium: the head node's setup
    script makes it, a relative path under /fsx/meshtrain)."""
    train_args: list[str] = field(default_factory=list)
    """Arguments for `meshtrain train` (after -- on the command line)."""

    def __post_init__(self):
        check_declared(self)

    @property
    def instance(self) -> str:
        return self.instance_type or ("trn2.48xlarge" if self.accelerator == "trainium" else "p5.48xlarge")

    @property
    def per_node(self) -> int:
        if self.accelerator == "trainium":
            return TRAINIUM[self.instance].cores
        return self.gpus_per_node or self.procs_per_node

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def signal_lead_s(self) -> int:
        """Seconds before the time limit at which the job is told to checkpoint: 90, or a quarter
        of a short job's limit (a 1-minute test job still trains for 45 s)."""
        from meshtrain.config import parse_duration

        return int(min(90, max(5, parse_duration(self.time, "--time") // 4)))

    @property
    def wall_clock(self) -> str:
        """--time as HH:MM:SS (hours past 24 allowed), the one spelling Slurm, SGE and PBS read alike:
        Slurm reads bare "3600" as minutes and "1-12" as days-hours, which meshtrain reads as seconds."""
        from meshtrain.config import parse_duration

        seconds = round(parse_duration(self.time, "--time"))
        return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"

    def time_limit(self) -> str:
        """training.time_limit of the job's config with the overrides after -- ("": none): the user's
        own limit, which the scripts keep (prepare refuses one that cannot fit --time)."""
        from meshtrain.config import load_config

        return load_config(self.config, self.train_args).training.time_limit

    def train_budget_s(self) -> int:
        """Seconds the job can train: --time less the checkpoint lead (0: no --time)."""
        from meshtrain.config import parse_duration

        return int(parse_duration(self.time, "--time")) - self.signal_lead_s if self.time else 0

    def train_command(self, nproc: int | None = None, time_limited: bool = False) -> str:
        """`meshtrain train` for the job; time_limited (launchers that send no signal before the
        limit): training.time_limit = the job's limit less the lead, unless the config sets one."""
        args = [f"{self.venv}/bin/meshtrain", "train", "--config", self.config]
        if self.accelerator == "trainium":
            args += ["--launch.device", "neuron"]
        if nproc:
            args += ["--nproc", str(nproc)]
        if time_limited and self.time and not self.time_limit():
            args += ["--training.time_limit", str(self.train_budget_s())]
        return shlex.join(args + self.train_args)


NCCL_KNOBS = """\
# Network knobs, uncomment what your cluster needs:
# export NCCL_SOCKET_IFNAME=ib0          # the interface for bootstrap traffic
# export NCCL_IB_HCA=mlx5                # InfiniBand adapters to use
# export NCCL_DEBUG=INFO                 # print the topology NCCL found (first run on a new cluster)
# export FI_PROVIDER=efa                 # AWS EFA (with the aws-ofi-nccl plugin)
# export GLOO_SOCKET_IFNAME=ib0          # CPU-only jobs: the interface gloo uses
"""


# Open MPI passes a variable to the ranks on other hosts only when named with -x: the network knobs
# above, MASTER_PORT, meshtrain's own settings, what this shell exported. Not CUDA_VISIBLE_DEVICES:
# each host's is its own (the scheduler's GPUs there). MPICH's Hydra passes the whole environment on.
FORWARD_ENV = (
    "# Open MPI gives the other hosts' ranks only the variables named with -x: every one of these exported here",
    "FORWARD=()",
    'for name in $(compgen -e); do case "$name" in',
    "    CUDA_VISIBLE_DEVICES) ;;",
    "    NCCL_*|GLOO_*|FI_*|UCX_*|MESHTRAIN_*|TORCH_*|CUDA_*|MASTER_ADDR|MASTER_PORT|OMP_NUM_THREADS|PYTHONPATH|HF_*)",
    '        FORWARD+=(-x "$name") ;;',
    "esac; done",
)


def _mpirun(spec: JobSpec, hostfile: str, per_node: bool = True) -> tuple[list[str], str]:
    """(the lines before it, the mpirun command) for the MPI the config's launch.env names: Open MPI's
    flags (auto, openmpi) or MPICH/Intel MPI Hydra's (-ppn; the environment is passed on already)."""
    from meshtrain.config import load_config

    mpich = load_config(spec.config, spec.train_args).launch.env == "mpich"
    placement = (f" -ppn {spec.per_node}" if mpich else f" -npernode {spec.per_node}") if per_node else ""
    forward = "" if mpich else ' ${FORWARD[@]+"${FORWARD[@]}"}'
    command = f'mpirun -np {spec.world}{placement} --hostfile "{hostfile}"{forward}'
    return ([] if mpich else list(FORWARD_ENV)), command


def slurm(spec: JobSpec, knobs: str = NCCL_KNOBS, before_training: tuple[str, ...] = ()) -> str:
    """`knobs`: the network settings block; `before_training`: lines run before the training step
    (pcluster on Trainium: the ahead-of-time compilation)."""
    lines = [
        "#!/bin/bash",
        "# Submit with: mkdir -p logs && sbatch THIS_FILE   (Slurm opens the log before the script runs)",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.nodes}                 # nodes in the allocation",
    ]
    if spec.mode == "task-per-rank":
        lines.append(f"#SBATCH --ntasks-per-node={spec.per_node}       # one task per rank: srun starts every rank")
    else:
        lines.append("#SBATCH --ntasks-per-node=1       # one task per node: it runs the elastic agent for its ranks")
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if spec.accelerator == "trainium":
        cpus = TRAINIUM[spec.instance].cpus // spec.per_node
    else:
        cpus = 8 if spec.gpus_per_node else 1
    if spec.mode == "agent-per-node":
        cpus *= spec.per_node
    lines += [
        f"#SBATCH --cpus-per-task={cpus}        # data loading and host work per task",
        f"#SBATCH --time={spec.wall_clock}            # wall-clock limit",
        "#SBATCH --output=logs/%x.%j.log      # %x = job name, %j = job id",
        "#SBATCH --open-mode=append           # a requeued job's runs all go into its one log",
        f"#SBATCH --signal=USR1@{spec.signal_lead_s}             # {spec.signal_lead_s} s before the limit: "
        "meshtrain checkpoints and exits 75",
        "#SBATCH --requeue                    # a preempted job goes back into the queue and resumes",
    ]
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.account:
        lines.append(f"#SBATCH --account={spec.account}")
    lines += ["", "set -euo pipefail", ""]
    lines += [*(f"module load {m}" for m in spec.modules), ""] if spec.modules else []
    lines.append(knobs)
    lines += before_training
    srun = " ".join(_srun(spec))
    if spec.mode == "task-per-rank":
        lines += [
            "# Every task is one rank; meshtrain reads SLURM_PROCID / SLURM_LOCALID / SLURM_STEP_NUM_TASKS",
            "# and takes the first host of SLURM_JOB_NODELIST as the rendezvous address.",
            "status=0",
            srun + " " + spec.train_command() + " || status=$?",
        ]
    else:
        lines += [
            "# One task per node runs torch elastic's agent with --nproc ranks; the agents meet in a c10d",
            "# rendezvous on the first host (port derived from the job id).",
            "status=0",
            srun + " " + spec.train_command(spec.per_node) + " || status=$?",
        ]
    lines += [
        "",
        "# Exit 75: a checkpoint was saved at the USR1 before the time limit (or at preemption). Slurm",
        "# requeues preempted jobs (--requeue) but not one that reaches its time limit: the job puts",
        "# itself back in the queue, at most MESHTRAIN_MAX_REQUEUES times, and its next run resumes.",
        "# Exit 124: a rank hung (training.hang_timeout; report in <run.dir>/hangs/): requeued the same way.",
        'MAX_REQUEUES="${MESHTRAIN_MAX_REQUEUES:-50}"',
        'if [[ "$status" =~ ^(75|124)$ ]] && [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_REQUEUES" ]; then',
        '    echo "meshtrain: exit $status (75: checkpointed before the limit, 124: hung); requeueing job '
        '$SLURM_JOB_ID (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )) of at most $MAX_REQUEUES)"',
        '    scontrol requeue "$SLURM_JOB_ID" || true   # already requeued when Slurm preempted it',
        "    exit 0",
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def _srun(spec: JobSpec) -> list[str]:
    """srun and its options for every step of the job (pyxis: the container it runs in)."""
    srun = ["srun", "--kill-on-bad-exit=1"]
    if spec.container_image:
        srun += [f"--container-image={spec.container_image}"]
        if spec.container_mounts:
            srun += [f"--container-mounts={spec.container_mounts}"]
        srun += [f"--container-workdir={spec.container_workdir or '$PWD'}"]
    return srun


def sge(spec: JobSpec) -> str:
    before_mpirun, mpirun_command = _mpirun(spec, "$HOSTFILE")
    lines = [
        "#!/bin/bash",
        "# Submit with: mkdir -p logs && qsub THIS_FILE",
        f"#$ -N {spec.job_name}",
        f"#$ -pe {spec.sge_pe} {spec.world}                # parallel environment and slots (ranks)"
        if spec.sge_pe
        else f"#$ -l rt_F={spec.nodes}               # ABCI: full nodes (other SGE sites: --pe mpi)",
        f"#$ -l h_rt={spec.wall_clock}          # wall-clock limit",
        "#$ -cwd                         # run in the submission directory",
        "#$ -j y                         # stdout and stderr into one log",
        f"#$ -o logs/{spec.job_name}.log",
        "#$ -r y                         # may run again (after exit 99: checkpointed before h_rt)",
    ]
    if spec.sge_pe and spec.gpus_per_node:  # rt_F nodes come with their GPUs; slots of a PE do not
        lines.append("#$ -l gpu=1                     # a GPU per slot (rank): your site's resource name, qconf -sc")
    if spec.account:
        lines.append(f"#$ -g {spec.account}                  # ABCI group to charge")
    lines += [
        "",
        "set -euo pipefail",
        "# shellcheck disable=SC1091  # the site's module system",
        "source /etc/profile.d/modules.sh 2>/dev/null || true",
    ]
    lines += [f"module load {m}" for m in spec.modules]
    lines += [
        "",
        NCCL_KNOBS,
        "# The hosts of the job: ABCI writes SGE_JOB_HOSTLIST, other SGE sites PE_HOSTFILE.",
        'HOSTFILE="${SGE_JOB_HOSTLIST:-${PE_HOSTFILE:-}}"',
        'if [ -n "${PE_HOSTFILE:-}" ] && [ -z "${SGE_JOB_HOSTLIST:-}" ]; then',
        '    HOSTFILE="$(mktemp)"',
        '    awk \'{print $1}\' "$PE_HOSTFILE" > "$HOSTFILE"',
        "    # mpirun -npernode below needs the PE's allocation rule to have placed the slots in whole nodes",
        "    # (a host may come on several lines, one per queue: its slots are their sum)",
        f"    if ! awk -v n={spec.nodes} -v p={spec.per_node} '!($1 in s) {{hosts++}} {{s[$1] += $2}} "
        'END {for (h in s) if (s[h] != p) bad = 1; exit bad || hosts != n}\' "$PE_HOSTFILE"; then',
        f'        echo "meshtrain: the PE placed its slots as $(awk \'{{printf "%s:%s ", $1, $2}}\' "$PE_HOSTFILE")'
        f"but the job needs {spec.nodes} hosts with {spec.per_node} each: use a PE whose allocation_rule is "
        f'{spec.per_node} (qconf -sp {spec.sge_pe or "PE"})" >&2',
        "        exit 1",
        "    fi",
        "fi",
        "",
        "# Ranks come from MPI (OMPI_COMM_WORLD_* or PMI_*); the first host is the rendezvous address. SGE gives",
        f"# no warning before h_rt: training checkpoints and exits 75 {spec.signal_lead_s} s before it.",
        *before_mpirun,
        "status=0",
        f"{mpirun_command} {spec.train_command(time_limited=True)} || status=$?",
        "",
        "# Exit 75 (checkpointed before h_rt, or preempted) or 124 (a rank hung: <run.dir>/hangs/): exit 99",
        "# makes SGE run the job again, and the next run resumes; at most MESHTRAIN_MAX_REQUEUES times",
        "# (SGE passes no variable of the submitting shell on: qsub -v MESHTRAIN_MAX_REQUEUES=N).",
        'COUNT="logs/.${JOB_NAME:-meshtrain}.${JOB_ID:-0}.requeues"',
        'RUNS=$(( $(cat "$COUNT" 2>/dev/null || echo 0) + 1 ))',
        'if [[ "$status" =~ ^(75|124)$ ]] && [ "$RUNS" -le "${MESHTRAIN_MAX_REQUEUES:-50}" ]; then',
        '    echo "$RUNS" > "$COUNT"',
        '    echo "meshtrain: exit $status (75: checkpointed, 124: hung); rescheduling job ${JOB_ID:-} '
        '(run $(( RUNS + 1 )))"',
        "    exit 99",
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def pbs(spec: JobSpec) -> str:
    before_mpirun, mpirun_command = _mpirun(spec, "$PBS_NODEFILE", per_node=False)
    resources = f"select={spec.nodes}:ncpus={max(8, spec.per_node * 8) if spec.gpus_per_node else spec.per_node}"
    resources += f":mpiprocs={spec.per_node}" + (f":ngpus={spec.gpus_per_node}" if spec.gpus_per_node else "")
    lines = [
        "#!/bin/bash",
        f"#PBS -N {spec.job_name}",
        f"#PBS -l {resources}",
        f"#PBS -l walltime={spec.wall_clock}",
        "#PBS -j oe                      # stdout and stderr into one log",
    ]
    if spec.partition:
        lines.append(f"#PBS -q {spec.partition}")
    if spec.account:
        lines.append(f"#PBS -A {spec.account}")
    lines += [
        "",
        "set -euo pipefail",
        'cd "$PBS_O_WORKDIR"',
        *(f"module load {m}" for m in spec.modules),
        "",
        NCCL_KNOBS,
        "# PBS_NODEFILE lists each host once per MPI process; the first is the rendezvous address.",
        f"# PBS gives no warning before walltime: training checkpoints and exits 75 {spec.signal_lead_s} s before",
        "# it; submit the same script again to continue (PBS has no self-requeue for unprivileged users).",
        *before_mpirun,
        f"{mpirun_command} {spec.train_command(time_limited=True)}",
    ]
    return "\n".join(lines) + "\n"


def mpirun(spec: JobSpec) -> str:
    before_mpirun, mpirun_command = _mpirun(spec, "$HOSTFILE")
    return (
        "\n".join(
            [
                "#!/bin/bash",
                "# Plain MPI over a hostfile: one line per host, e.g. `node1 slots=8`.",
                "set -euo pipefail",
                'HOSTFILE="${1:-hostfile}"',
                "",
                NCCL_KNOBS,
                "# Ranks come from MPI (OMPI_COMM_WORLD_* or PMI_*); with several hosts MASTER_ADDR is the first.",
                'MASTER_ADDR="$(awk \'NR==1{print $1}\' "$HOSTFILE")"',
                "export MASTER_ADDR",
                *before_mpirun,
                f"{mpirun_command} {spec.train_command(time_limited=True)}",
            ]
        )
        + "\n"
    )


def torchrun(spec: JobSpec) -> str:
    lines = [
        "#!/bin/bash",
        f"# Run on every node, with NODE_RANK = 0 .. {spec.nodes - 1} and HEAD = the address of node 0.",
        "set -euo pipefail",
        'NODE_RANK="${NODE_RANK:?set NODE_RANK}"',
        'HEAD="${HEAD:?set HEAD to the first node}"',
        "",
        NCCL_KNOBS,
    ]
    if spec.nodes == 1:
        lines.append(spec.train_command(spec.per_node, time_limited=True))
    else:
        lines.append(
            f'{spec.train_command(spec.per_node, time_limited=True)} --nnodes {spec.nodes} --node-rank "$NODE_RANK" '
            '--master-addr "$HEAD" --master-port 29500'
        )
    return "\n".join(lines) + "\n"


GENERATORS = {"slurm": slurm, "sge": sge, "pbs": pbs, "mpirun": mpirun, "torchrun": torchrun}
KINDS = (*GENERATORS, "pcluster")  # pcluster: launch/pcluster.py, a cluster config and its job

_RANKS = {"config", "nodes", "gpus_per_node", "procs_per_node", "venv", "train_args"}
_SCHEDULED = _RANKS | {"time", "account", "job_name", "modules"}
_SLURM = _SCHEDULED | {"partition", "container_image", "container_mounts", "container_workdir", "mode"}
USES = {
    "slurm": _SLURM,
    "sge": _SCHEDULED | {"sge_pe"},
    "pbs": _SCHEDULED | {"partition"},
    "mpirun": _RANKS | {"time"},  # --time: training.time_limit (nothing else stops the job)
    "torchrun": _RANKS | {"time"},
    # the instance sets the ranks per node (--gpus-per-node at most its GPUs)
    "pcluster": (_SLURM - {"procs_per_node"}) | {"accelerator", "instance_type"},
}
"""The JobSpec fields each kind's files use. A flag given to a kind that does not use it would be
silently dropped, so it is refused instead, naming the kinds that take it."""
HINTS = {
    "accelerator": " (on Trainium nodes pass -- --launch.device neuron)",
    "procs_per_node": " (a pcluster node runs one rank per GPU, or per NeuronCore)",
}


def check_flags(kind: str, spec: JobSpec) -> None:
    """Every flag takes effect or is refused in one line: one a kind does not use (USES), CPU ranks
    beside GPUs, and pyxis's container options without the image they apply to."""
    from meshtrain.config import declared

    if kind not in KINDS:
        raise MeshtrainError(f"jobscript kind {kind!r} is unknown: use one of {', '.join(KINDS)}")
    for name, d in declared(JobSpec).items():
        value = getattr(spec, name)
        if name not in USES[kind] and value != d.default:
            flag = (d.meta.get("flags") or ("--" + name.replace("_", "-"),))[0]
            shown = value[0] if isinstance(value, list) else value
            takers = ", ".join(k for k in KINDS if name in USES[k])
            raise MeshtrainError(
                f"{flag} {shown}: {kind} jobs do not use it (it is for {takers}): leave {flag} out{HINTS.get(name, '')}"
            )
    if spec.gpus_per_node and spec.procs_per_node != 1:
        raise MeshtrainError(
            f"--procs-per-node {spec.procs_per_node} with --gpus-per-node {spec.gpus_per_node}: GPU nodes run one "
            "rank per GPU; leave --procs-per-node out (it is for CPU nodes)"
        )
    for flag, value in (("--container-mounts", spec.container_mounts), ("--container-workdir", spec.container_workdir)):
        if value and not spec.container_image:
            raise MeshtrainError(f"{flag} {value} applies to a container: add --container-image IMAGE or leave it out")
