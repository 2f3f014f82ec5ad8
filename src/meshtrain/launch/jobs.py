"""A job of any kind from its spec: the flags checked for the kind, what the kind implies filled in,
and its files rendered. The one place that knows both the scripts (launch/jobscript.py) and the
ParallelCluster config (launch/pcluster.py, built on the Slurm script)."""

from __future__ import annotations

from dataclasses import replace

from meshtrain.config import parse_duration
from meshtrain.errors import MeshtrainError
from meshtrain.launch.jobscript import GENERATORS, JobSpec, check_flags
from meshtrain.launch.pcluster import pcluster_files, pcluster_spec


def prepare(kind: str, spec: JobSpec) -> JobSpec:
    """The spec the kind's files are written from (the CLI takes the world size from it): its flags
    checked, what the kind implies filled in (the schedulers' default --time; pcluster: the instance's
    ranks), and the config's own training.time_limit checked against --time."""
    check_flags(kind, spec)
    if kind == "pcluster":
        spec = pcluster_spec(spec)
    if not spec.time and kind not in ("mpirun", "torchrun"):
        spec = replace(spec, time="01:00:00")
    limit = spec.time_limit()
    if spec.time and parse_duration(limit, "training.time_limit") > spec.train_budget_s():
        raise MeshtrainError(
            f"training.time_limit = {limit!r} does not fit the job: --time {spec.time} leaves "
            f"{spec.train_budget_s()} s to train ({spec.signal_lead_s} s go to the checkpoint before it): "
            "shorten training.time_limit or raise --time"
        )
    return spec


# In every file a job is written as: what `jobscript --out` may replace (its own earlier output, not a
# file that only mentions meshtrain).
MARKER = "# written by `meshtrain jobscript`"
# How the files of earlier versions, without the marker, began: --out replaces them too.
EARLIER_HEADERS = (
    "# Submit with: mkdir -p logs && sbatch THIS_FILE",
    "# Submit with: mkdir -p logs && qsub THIS_FILE",
    "# Plain MPI over a hostfile: one line per host",
    "# Run on every node, with NODE_RANK",
    "# AWS ParallelCluster 3: pcluster create-cluster",
    "#PBS -j oe                      # stdout and stderr into one log",
    "# ParallelCluster runs this on every node once it is configured",
)


def render(kind: str, spec: JobSpec) -> dict[str, str]:
    """{file suffix: text} of a job ("": the script, or pcluster's cluster config, beside its other
    files), from the spec that prepare(kind, ...) made; each file marked (MARKER) after its #! line."""
    files = pcluster_files(spec) if kind == "pcluster" else {"": GENERATORS[kind](spec)}
    return {suffix: _marked(text, kind) for suffix, text in files.items()}


def _marked(text: str, kind: str) -> str:
    shebang, rest = text.split("\n", 1) if text.startswith("#!") else ("", text)
    return f"{shebang}\n{MARKER} {kind}\n{rest}" if shebang else f"{MARKER} {kind}\n{rest}"
