"""AWS ParallelCluster 3 (`meshtrain jobscript pcluster`): the cluster config, GPU or Trainium nodes,
and the sbatch job for its queue; on Trainium also the script that installs the Neuron SDK on its
nodes, and an ahead-of-time compile before training."""

from __future__ import annotations

import shlex
import textwrap
from dataclasses import fields, replace

from meshtrain.config.schema import RunConfig
from meshtrain.errors import MeshtrainError
from meshtrain.launch.jobscript import TRAINIUM, JobSpec, _srun, slurm

FSX = "/fsx"  # the cluster's shared FSx for Lustre

GPUS = {
    **dict.fromkeys(("p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge"), 8),
    **dict.fromkeys(("g5.48xlarge", "g6e.48xlarge"), 8),
    **dict.fromkeys(("g5.12xlarge", "g5.24xlarge", "g6e.12xlarge", "g6e.24xlarge"), 4),
}
"""NVIDIA GPUs of an EC2 instance type: the job's ranks (and --gpus-per-node) per node, unless
--gpus-per-node says fewer. Another GPU type needs --gpus-per-node: the job cannot guess its ranks."""

NEURON_ENV = """\
# Neuron and EFA settings for training across nodes:
export FI_PROVIDER=efa                 # Neuron collectives between nodes go over EFA (libfabric)
export FI_EFA_USE_DEVICE_RDMA=1        # EFA reads and writes device memory directly
export FI_EFA_FORK_SAFE=1              # data loader workers fork after EFA is opened
export NEURON_CC_FLAGS="--model-type=transformer"   # the Neuron compiler's tuning for transformer models
export NEURON_COMPILE_CACHE_URL=/fsx/neuron-cache   # compiled graphs, shared by every node and later runs
# export NEURON_RT_LOG_LEVEL=INFO      # print what the Neuron runtime does (first run on a new cluster)
"""


def pcluster(spec: JobSpec) -> str:
    """An AWS ParallelCluster 3 config: HeadNode, a Slurm queue of GPU or Trainium nodes with EFA in a
    placement group, FSx for Lustre. `render` adds the sbatch script for it, and for Trainium the
    OnNodeConfigured script that installs the Neuron SDK (the config names it, on S3)."""
    trainium = spec.accelerator == "trainium"
    os_line = "ubuntu2404                     # torch-neuronx's wheels need Python 3.12" if trainium else "ubuntu2204"
    setup = f"""\
CustomActions:
  OnNodeConfigured:                    # after shared storage is mounted, as root
    Script: s3://REPLACE_ME/neuron-setup.sh   # upload the .neuron-setup.sh file written beside this one
    Args:
      - {spec.venv}
"""
    head_setup = textwrap.indent(setup, "  ") if trainium else ""
    queue_setup = textwrap.indent(setup, "      ") if trainium else ""
    disk = """\
      ComputeSettings:
        LocalStorage:
          RootVolume:
            Size: 512                    # GB: the Neuron docs ask for 512 on Trn instances
"""
    return f"""\
# AWS ParallelCluster 3: pcluster create-cluster --cluster-name meshtrain --cluster-configuration cluster.yaml
Region: us-east-1
Image:
  Os: {os_line}
HeadNode:
  InstanceType: c5.2xlarge
  Networking:
    SubnetId: subnet-REPLACE_ME          # a public subnet
  Ssh:
    KeyName: REPLACE_ME
{head_setup}Scheduling:
  Scheduler: slurm
  SlurmSettings:
    QueueUpdateStrategy: DRAIN
  SlurmQueues:
    - Name: {_queue(spec)}
{disk if trainium else ""}      ComputeResources:
        - Name: {spec.instance.replace(".", "-")}
          InstanceType: {spec.instance}
          MinCount: 0                    # scale to zero when idle
          MaxCount: {spec.nodes}
          Efa:
            Enabled: true                # EFA for {"Neuron collectives" if trainium else "NCCL"} across nodes
      Networking:
        SubnetIds:
          - subnet-REPLACE_ME            # a private subnet in one availability zone
        PlacementGroup:
          Enabled: true                  # nodes close together on the network
{queue_setup}SharedStorage:
  - MountDir: {FSX}
    Name: fsx
    StorageType: FsxLustre
    FsxLustreSettings:
      StorageCapacity: 1200
      DeploymentType: PERSISTENT_2
      PerUnitStorageThroughput: 250
"""


def _queue(spec: JobSpec) -> str:
    """The Slurm queue of the cluster, which its job is submitted to: --partition, or by accelerator."""
    return spec.partition or ("trainium" if spec.accelerator == "trainium" else "gpu")


# What the Trainium compile trial sets after the job's own arguments: ten steps of the same job,
# nothing kept (no checkpoint resumed, no weights saved, no sample), no stop inside the ten steps.
# `meshtrain jobscript` loads the job's config with them, so a trial that could not start is refused
# before the job is queued.
_RUN_DEFAULTS = {f.name: f.default for f in fields(RunConfig)}
NEURON_TRIAL = (
    *("--training.steps", "10", "--training.stop_at_step", "0", "--checkpoint.resume", "none"),
    *("--run.save_model", "false", "--run.sample_prompt", ""),
    *("--run.save_model_max_gb", str(_RUN_DEFAULTS["save_model_max_gb"])),
    *("--run.sample_tokens", str(_RUN_DEFAULTS["sample_tokens"])),
)


def _pcluster_job(spec: JobSpec) -> str:
    """The sbatch for the cluster's queue. On Trainium it first compiles ahead of time, as the Neuron
    docs describe: neuron_parallel_compile runs a short trial of the same job (same nodes, ranks and
    layout) to collect its graphs, and compiles them in parallel into the shared cache."""
    job = replace(spec, partition=_queue(spec))
    if spec.accelerator != "trainium":
        return slurm(job)
    trial = f"{FSX}/meshtrain/neuron-compile.$SLURM_JOB_ID"
    compile_step = (
        # one task per node (its agent starts the node's ranks), with the node's CPUs for the compiler
        " ".join(_srun(job))
        + ' --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" neuron_parallel_compile '
        + job.train_command(job.per_node)
        + f' --run.dir "{trial}" --checkpoint.dir "{trial}/checkpoints" '
        + shlex.join(NEURON_TRIAL)
    )
    return slurm(
        job,
        NEURON_ENV,
        (
            f'export PATH="{job.venv}/bin:$PATH"   # neuron_parallel_compile comes with torch-neuronx',
            "# Ahead-of-time compilation: a 10-step trial run (its own run directory, nothing saved) whose",
            "# graphs neuron_parallel_compile compiles in parallel into NEURON_COMPILE_CACHE_URL; training",
            "# then finds them there. A requeued job skips it: the cache holds them already.",
            'if [ "${SLURM_RESTART_COUNT:-0}" -eq 0 ]; then',
            f"    {compile_step}",
            "fi",
            "",
        ),
    )


def neuron_setup(spec: JobSpec) -> str:
    """The OnNodeConfigured script of a Trainium cluster (AWS's ParallelCluster + Trainium samples do
    the same): the compute nodes get the Neuron driver, runtime, collectives and tools from AWS's apt
    repository; the head node makes the job's Python environment on the shared FSx, with torch-neuronx
    (TorchNeuron, the native device) and the Neuron compiler from AWS's pip repository."""
    return f"""\
#!/bin/bash
# ParallelCluster runs this on every node once it is configured (CustomActions in the cluster config):
# upload it to the S3 path the config names. Argument: the Python environment to make ({spec.venv}).
set -euo pipefail
VENV="${{1:?the Python environment to make, from Args in the cluster config}}"

# ParallelCluster's description of this node: cfn_node_type (HeadNode or ComputeFleet), cfn_cluster_user
# shellcheck disable=SC1091
. /etc/parallelcluster/cfnconfig
# shellcheck disable=SC1091
. /etc/os-release

if [ "${{cfn_node_type:-}}" = ComputeFleet ]; then
    # AWS's Neuron apt repository, trusted through its signing key
    REPO=https://apt.repos.neuron.amazonaws.com KEYRING=/usr/share/keyrings/neuron-archive-keyring.gpg
    curl -fsSL "$REPO/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB" | gpg --dearmor --yes -o "$KEYRING"
    echo "deb [signed-by=$KEYRING] $REPO ${{VERSION_CODENAME}} main" > /etc/apt/sources.list.d/neuron.list
    apt-get update -y
    # the driver (built for this kernel), the runtime, its collectives over EFA, and neuron-ls/neuron-top
    apt-get install -y "linux-headers-$(uname -r)" aws-neuronx-dkms aws-neuronx-runtime-lib \\
        aws-neuronx-collectives aws-neuronx-tools
elif [ ! -x "$VENV/bin/python" ]; then
    # the head node: one environment on the shared FSx, used by every node's ranks
    apt-get update -y
    apt-get install -y python3-venv
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --upgrade pip
    "$VENV/bin/pip" install "torch-neuronx==2.14.*" "neuronx-cc==2.*" \\
        --extra-index-url https://pip.repos.neuron.amazonaws.com --extra-index-url https://download.pytorch.org/whl/cpu
    chown -R "${{cfn_cluster_user:-ubuntu}}" "$VENV"
    echo "made $VENV: install meshtrain into it ($VENV/bin/pip install ...) before submitting the job"
fi
"""


def pcluster_spec(spec: JobSpec) -> JobSpec:
    """The job as the cluster runs it: its nodes checked, a GPU node's ranks its GPUs (unless
    --gpus-per-node says fewer), and on Trainium the venv on the FSx (every node sees it there)."""
    check_nodes(spec)
    if spec.accelerator == "gpu":
        return replace(spec, gpus_per_node=spec.gpus_per_node or GPUS[spec.instance])
    return replace(spec, venv=spec.venv if spec.venv.startswith("/") else f"{FSX}/meshtrain/{spec.venv}")


def pcluster_files(spec: JobSpec) -> dict[str, str]:
    """The cluster config (""), its job (".sbatch") and on Trainium the nodes' setup (".neuron-setup.sh"),
    from a spec that pcluster_spec made."""
    files = {"": pcluster(spec), ".sbatch": _pcluster_job(spec)}
    if spec.accelerator == "trainium":
        files[".neuron-setup.sh"] = neuron_setup(spec)
    return files


def check_nodes(spec: JobSpec) -> None:
    """The compute-node options take effect or are refused: a GPU node runs one rank per GPU (GPUS, or
    --gpus-per-node for an instance type not in it); on Trainium the node sets the ranks (one per
    logical NeuronCore) and the device (neuron)."""
    if spec.accelerator == "gpu":
        if spec.instance.startswith("trn"):
            raise MeshtrainError(f"--instance-type {spec.instance} is a Trainium instance: add --accelerator trainium")
        gpus = GPUS.get(spec.instance)
        if gpus is None and not spec.gpus_per_node:
            raise MeshtrainError(
                f"--instance-type {spec.instance}: how many GPUs it has is not known here: give --gpus-per-node G"
            )
        if gpus is not None and spec.gpus_per_node > gpus:
            raise MeshtrainError(
                f"--gpus-per-node {spec.gpus_per_node}: a {spec.instance} node has {gpus} GPUs: give at most {gpus}"
            )
        return
    if spec.instance not in TRAINIUM:
        raise MeshtrainError(
            f"--accelerator trainium trains on torch-neuronx's native device, which runs on Trainium2: "
            f"--instance-type {spec.instance} is not one of {', '.join(TRAINIUM)}"
        )
    if spec.gpus_per_node:  # --procs-per-node: refused for every pcluster job (jobscript.USES)
        raise MeshtrainError(
            f"--gpus-per-node {spec.gpus_per_node}: a {spec.instance} node runs one rank per logical NeuronCore "
            f"({TRAINIUM[spec.instance].cores}) by itself: leave --gpus-per-node out"
        )
    _check_neuron_device(spec)


def _check_neuron_device(spec: JobSpec) -> None:
    """A Trainium job trains with --launch.device neuron, put before the arguments after --: another
    device in the config file would be silently replaced by it, and one after -- would override it."""
    from meshtrain.config import load_config, parse_overrides

    device = load_config(spec.config, spec.train_args).launch.device
    if device in ("auto", "neuron"):
        return
    after = any(key == "launch.device" for key, _ in parse_overrides(spec.train_args))
    where = f"--launch.device {device} after --" if after else f"launch.device = {device!r} in --config {spec.config}"
    raise MeshtrainError(
        f"{where}: --accelerator trainium trains on the NeuronCores (the job sets --launch.device neuron): "
        "leave it out, or make it auto or neuron"
    )
