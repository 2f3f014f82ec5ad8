"""Generated job scripts: pinned text (golden files), valid bash, clean under shellcheck.
Regenerate the golden files after an intended change with MESHTRAIN_UPDATE_GOLDEN=1."""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import assert_user_error, run_cli

GOLDEN = Path(__file__).parent / "golden"
FITS = ["--training.micro_batch_size", "1"]  # tiny.toml's batch of 16 on the 16 ranks of 2 x 8 GPUs
LAUNCHED = ["--config", "configs/tiny.toml", "--nodes", "2", "--time", "02:00:00"]  # mpirun, torchrun: no account
COMMON = [*LAUNCHED, "--account", "proj42"]
CASES = {
    "slurm": ["slurm", *COMMON, "--gpus-per-node", "8", "--partition", "gpu", "--module", "cuda/12.4"],
    "slurm-agent-container": [
        "slurm",
        *COMMON,
        "--gpus-per-node",
        "8",
        "--mode",
        "agent-per-node",
        "--container-image",
        "nvcr.io#nvidia/pytorch:25.01-py3",
        "--container-mounts",
        "/fsx:/fsx",
        "--container-workdir",
        "/fsx/meshtrain",
    ],
    "slurm-cpu": ["slurm", *COMMON, "--procs-per-node", "2"],
    "sge": ["sge", *COMMON, "--gpus-per-node", "4", "--module", "cuda/12.4", "--module", "nccl/2.21"],
    "sge-pe": ["sge", *COMMON, "--gpus-per-node", "4", "--pe", "mpi"],
    "pbs": ["pbs", *COMMON, "--gpus-per-node", "4", "--partition", "workq"],
    "mpirun": ["mpirun", *LAUNCHED, "--procs-per-node", "4"],
    "torchrun": ["torchrun", *LAUNCHED, "--gpus-per-node", "8"],
    "pcluster": ["pcluster", *COMMON, "--gpus-per-node", "8", "--instance-type", "p5.48xlarge"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_jobscript_matches_golden_and_lints(case, cli_env, tmp_path):
    out = tmp_path / "job"
    result = run_cli(
        [
            "jobscript",
            *CASES[case],
            "--out",
            str(out),
            "--",
            "--training.steps",
            "5",
            "--training.micro_batch_size",
            "1",
        ],
        cli_env,
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 0, result.stderr
    files = {p.name.removeprefix("job"): p.read_text() for p in tmp_path.iterdir() if p.is_file()}
    # Slurm and SGE open the log before the script runs: the directory must exist already.
    assert (tmp_path / "logs").is_dir() == any("logs/" in text for text in files.values())
    for suffix, text in files.items():
        golden = GOLDEN / f"{case}{suffix}.txt"
        if os.environ.get("MESHTRAIN_UPDATE_GOLDEN"):
            golden.write_text(text)
        assert text == golden.read_text(), f"{golden} differs; regenerate with MESHTRAIN_UPDATE_GOLDEN=1 if intended"
        if text.startswith("#!/bin/bash"):
            assert "--training.steps 5" in text
            assert subprocess.run(["bash", "-n", str(tmp_path / f"job{suffix}")]).returncode == 0
            if shutil.which("shellcheck") is None:
                if os.environ.get("CI"):
                    pytest.fail("shellcheck is missing on CI: `make test` installs it")
                continue
            lint = subprocess.run(
                ["shellcheck", "-s", "bash", str(tmp_path / f"job{suffix}")], capture_output=True, text=True
            )
            assert lint.returncode == 0, lint.stdout


def test_slurm_script_has_the_preemption_and_rank_settings(cli_env):
    text = run_cli(["jobscript", *CASES["slurm"], "--", *FITS], cli_env).stdout
    for line in (
        "#SBATCH --signal=USR1@90",
        "#SBATCH --requeue",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --output=logs/%x.%j.log",
        "srun --kill-on-bad-exit=1",
    ):
        assert line in text
    agent = run_cli(["jobscript", *CASES["slurm-agent-container"], "--", *FITS], cli_env).stdout
    assert "--ntasks-per-node=1" in agent and "--nproc 8" in agent and "--container-image=" in agent


def test_bad_jobscript_requests(cli_env, tmp_path):
    assert_user_error(run_cli(["jobscript", "lsf", "--config", "c.toml"], cli_env), "lsf", "slurm")
    assert_user_error(run_cli(["jobscript", "slurm", "--config", "c.toml", "--nodes", "0"], cli_env), "--nodes")
    config = tmp_path / "mine.toml"  # the script never replaces the config it runs
    config.write_text(Path("configs/tiny.toml").read_text())
    result = run_cli(["jobscript", "slurm", "--config", str(config), "--out", str(config)], cli_env)
    assert_user_error(result, f"--out {config} is the --config file it is made from")
    assert config.read_text() == Path("configs/tiny.toml").read_text()
    notes = tmp_path / "notes.md"  # it mentions meshtrain, but no jobscript wrote it
    notes.write_text("# my notes on the meshtrain 7B run\n")
    result = run_cli(["jobscript", "slurm", "--config", "configs/tiny.toml", "--out", str(notes)], cli_env)
    assert_user_error(result, f"--out {notes} exists and was not written by `meshtrain jobscript`")
    assert notes.read_text() == "# my notes on the meshtrain 7B run\n"
    earlier = tmp_path / "earlier.sbatch"  # a script of a version before the marker line: replaced too
    earlier.write_text((GOLDEN / "slurm.txt").read_text().replace("# written by `meshtrain jobscript` slurm\n", ""))
    made = run_cli(["jobscript", "slurm", "--config", "configs/tiny.toml", "--out", str(earlier)], cli_env)
    assert made.returncode == 0 and "# written by `meshtrain jobscript` slurm" in earlier.read_text(), made.stderr
    script = tmp_path / "job.sbatch"  # its own earlier script is replaced
    for nodes in ("1", "2"):
        made = run_cli(
            ["jobscript", "slurm", "--config", "configs/tiny.toml", "--nodes", nodes, "--out", str(script)], cli_env
        )
        assert made.returncode == 0, made.stderr
    assert "#SBATCH --nodes=2" in script.read_text()


def test_flags_a_kind_does_not_use_are_refused(cli_env):
    """Every flag takes effect or is refused in one line naming it and the kinds that take it."""
    tiny = ["--config", "configs/tiny.toml"]
    unused = {
        ("mpirun", "--module", "cuda/12"): "slurm, sge, pbs, pcluster",
        ("mpirun", "--account", "acct"): "slurm, sge, pbs, pcluster",
        ("torchrun", "--job-name", "foo"): "slurm, sge, pbs, pcluster",
        ("torchrun", "--container-image", "img"): "slurm, pcluster",
        ("sge", "--partition", "p"): "slurm, pbs, pcluster",
        ("sge", "--mode", "agent-per-node"): "slurm, pcluster",
        ("pbs", "--container-image", "img"): "slurm, pcluster",
        ("pbs", "--pe", "mpi"): "it is for sge)",
        ("slurm", "--pe", "mpi"): "it is for sge)",
    }
    for (kind, flag, value), takers in unused.items():
        result = run_cli(["jobscript", kind, *tiny, flag, value], cli_env)
        assert_user_error(result, f"{flag} {value}: {kind} jobs do not use it", takers, f"leave {flag} out")
    conflicts = {
        ("--procs-per-node", "3", "--gpus-per-node", "2"): "--procs-per-node 3 with --gpus-per-node 2",
        ("--container-mounts", "/fsx:/fsx"): "--container-mounts /fsx:/fsx applies to a container",
        ("--container-workdir", "/fsx"): "--container-workdir /fsx applies to a container: add --container-image",
        ("--gpus-per-node", "4", "--", "--launch.device", "cpu"): "reserves GPUs, but launch.device = cpu",
        ("--", "--launch.device", "cuda"): "launch.device = cuda, but the script reserves no GPUs",
    }
    for flags, fragment in conflicts.items():
        assert_user_error(run_cli(["jobscript", "slurm", *tiny, *flags], cli_env), fragment)


def test_the_configs_time_limit_is_kept_or_refused(cli_env, tmp_path):
    """A training.time_limit in the config file is the user's: kept when it fits --time (less the
    checkpoint lead), refused when the job could never reach it; mpirun and torchrun apply --time."""
    repo = Path(__file__).parents[1]
    config = tmp_path / "tl.toml"
    text = (repo / "configs/tiny.toml").read_text()
    config.write_text(text.replace("[training]\n", '[training]\ntime_limit = "00:20:00"\n', 1))
    kept = run_cli(["jobscript", "sge", "--config", str(config), "--time", "02:00:00"], cli_env, cwd=repo)
    assert kept.returncode == 0, kept.stderr
    assert "--training.time_limit" not in kept.stdout  # the config's 20 minutes, not 7110 s
    for kind, time in (("sge", "00:15:00"), ("pbs", "00:15:00"), ("slurm", "00:20:00"), ("mpirun", "00:20:00")):
        refused = run_cli(["jobscript", kind, "--config", str(config), "--time", time], cli_env, cwd=repo)
        assert_user_error(refused, "training.time_limit = '00:20:00' does not fit the job", f"--time {time}")
    launched = run_cli(
        ["jobscript", "mpirun", "--config", "configs/tiny.toml", "--time", "00:30:00"], cli_env, cwd=repo
    )
    assert "--training.time_limit 1710" in launched.stdout, launched.stderr
    untimed = run_cli(["jobscript", "torchrun", "--config", "configs/tiny.toml"], cli_env, cwd=repo)
    assert untimed.returncode == 0 and "--training.time_limit" not in untimed.stdout, untimed.stderr


def test_an_sge_parallel_environment_gets_its_gpus_and_whole_nodes(cli_env, tmp_path):
    """With --pe the job asked only for slots: no GPUs, and nothing said the PE's allocation rule put
    --nodes hosts of the ranks per node that `mpirun -npernode` assumes. Now a GPU per slot is
    requested, and a placement other than whole nodes stops the job before mpirun, naming it. What the
    job exported (network knobs, meshtrain's settings) reaches the ranks on every host (mpirun -x)."""
    script = tmp_path / "job.sge"
    flags = ["sge", "--config", "configs/tiny.toml", "--nodes", "2", "--gpus-per-node", "4", "--pe", "mpi"]
    made = run_cli(["jobscript", *flags, "--out", str(script), "--", *FITS], cli_env, cwd=Path(__file__).parents[1])
    assert made.returncode == 0, made.stderr
    text = script.read_text()
    assert "#$ -pe mpi 8 " in text and "#$ -l gpu=1 " in text
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mpirun").write_text('#!/bin/sh\necho "mpirun ran $*" >&2\n')
    (fake / "mpirun").chmod(0o755)
    placements = {  # the PE's host file -> how the refusal names it (None: whole nodes, mpirun runs)
        "a 4 all.q UNDEFINED\nb 4 all.q UNDEFINED\n": None,
        "a 2 all.q UNDEFINED\na 2 gpu.q UNDEFINED\nb 4 all.q UNDEFINED\n": None,  # a host on two queues' lines
        "a 8 all.q UNDEFINED\n": "placed its slots as a:8 but the job needs 2 hosts with 4 each",
        "a 4 all.q UNDEFINED\nb 2 all.q UNDEFINED\nc 2 all.q UNDEFINED\n": "a:4 b:2 c:2 but the job needs 2 hosts",
    }
    for placed, refusal in placements.items():
        hosts = tmp_path / "pe_hostfile"
        hosts.write_text(placed)
        env = {"PATH": f"{fake}:{os.environ['PATH']}", "PE_HOSTFILE": str(hosts), "HOME": str(tmp_path)}
        env |= {"NCCL_SOCKET_IFNAME": "ib0", "MESHTRAIN_MAX_REQUEUES": "3"}  # exported: to every host's ranks
        env |= {"CUDA_VISIBLE_DEVICES": "0,1"}  # each host's own
        ran = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        if refusal is None:
            assert "mpirun ran" in ran.stderr and "meshtrain:" not in ran.stderr, ran.stderr
            assert "-x NCCL_SOCKET_IFNAME" in ran.stderr and "-x MESHTRAIN_MAX_REQUEUES" in ran.stderr
            assert "-x HOME" not in ran.stderr and "-x CUDA_VISIBLE_DEVICES" not in ran.stderr
        else:
            assert ran.returncode == 1 and refusal in ran.stderr and "mpirun ran" not in ran.stderr, ran.stderr


def test_the_trainium_compile_trial_starts_whatever_the_end_of_run_keys_say(cli_env, tmp_path):
    """The Trainium job first runs a 10-step trial of itself. A config it could not start with (a
    stop_at_step beyond its 10 steps; sample and save keys its "nothing saved" switched off) failed on
    the cluster after the wait in the queue. The trial sets what it needs, and jobscript loads and
    preflights it (a refusal would name the trial)."""
    import shlex

    from meshtrain.config import load_config
    from meshtrain.job import resolve

    repo = Path(__file__).parents[1]
    config = tmp_path / "trial.toml"
    tiny = (repo / "configs/tiny.toml").read_text().replace("steps = 100", "steps = 100\nstop_at_step = 50")
    config.write_text(tiny.replace("[run]", "[run]\nsave_model_max_gb = 3.0"))
    with_config = [*TRAINIUM[:2], str(config), *TRAINIUM[3:]]
    flags = [*with_config, "--out", str(tmp_path / "c.yaml"), "--", *FITS_TRAINIUM, "--run.sample_tokens", "32"]
    made = run_cli(["jobscript", *flags], cli_env, cwd=repo)
    assert made.returncode == 0, made.stderr
    job = (tmp_path / "c.yaml.sbatch").read_text()
    trial = shlex.split(job[job.index("neuron_parallel_compile /") :].splitlines()[0])
    start = trial.index("--config")
    overrides = trial[start + 2 :]
    del overrides[overrides.index("--nproc") : overrides.index("--nproc") + 2]
    cfg = load_config(trial[start + 1], overrides)
    assert cfg.training.steps == 10 and cfg.training.stop_at_step == 0 and not cfg.run.save_model
    resolve(cfg, 128, None)  # the trial's 2 x 64 ranks start


def test_pcluster_gpu_nodes_run_one_rank_per_gpu(cli_env, tmp_path):
    import yaml

    p4d = ["pcluster", "--config", "configs/tiny.toml", "--nodes", "2", "--instance-type", "p4d.24xlarge"]
    # the preflight runs at the job's world: 2 nodes x 8 GPUs, too many ranks for tiny's batch of 16 x 8
    assert_user_error(run_cli(["jobscript", *p4d], cli_env), "the job's 16 ranks")
    # on standard output the cluster config and its job would run together as one file
    assert_user_error(run_cli(["jobscript", *p4d, "--", *FITS], cli_env), "writes 2 files", "--out PREFIX")
    out = tmp_path / "cluster.yaml"
    result = run_cli(["jobscript", *p4d, "--partition", "train", "--out", str(out), "--", *FITS], cli_env)
    assert result.returncode == 0, result.stderr
    (queue,) = yaml.safe_load(out.read_text())["Scheduling"]["SlurmQueues"]
    assert queue["Name"] == "train" and queue["ComputeResources"][0]["InstanceType"] == "p4d.24xlarge"
    job = Path(f"{out}.sbatch").read_text()
    for line in ("#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=train"):
        assert line in job
    base = ["pcluster", "--config", "configs/tiny.toml"]
    unknown = run_cli(["jobscript", *base, "--instance-type", "g4dn.12xlarge"], cli_env)
    assert_user_error(unknown, "--instance-type g4dn.12xlarge", "--gpus-per-node")
    too_many = run_cli(["jobscript", *base, "--instance-type", "g5.12xlarge", "--gpus-per-node", "8"], cli_env)
    assert_user_error(too_many, "--gpus-per-node 8", "g5.12xlarge node has 4 GPUs")


TRAINIUM = ["pcluster", "--config", "configs/tiny.toml", "--nodes", "2", "--accelerator", "trainium"]
FITS_TRAINIUM = ["--training.micro_batch_size", "1", "--training.global_batch_size", "128"]  # 2 x 64 NeuronCores


def test_pcluster_trainium_writes_cluster_job_and_neuron_setup(cli_env, tmp_path):
    import yaml

    out = tmp_path / "cluster.yaml"
    result = run_cli(
        ["jobscript", *TRAINIUM, "--out", str(out), "--", *FITS_TRAINIUM], cli_env, cwd=Path(__file__).parents[1]
    )
    assert result.returncode == 0, result.stderr
    cluster = yaml.safe_load(out.read_text())
    (queue,) = cluster["Scheduling"]["SlurmQueues"]
    (node,) = queue["ComputeResources"]
    assert queue["Name"] == "trainium" and node["InstanceType"] == "trn2.48xlarge" and node["MaxCount"] == 2
    assert node["Efa"]["Enabled"] and queue["Networking"]["PlacementGroup"]["Enabled"]
    assert cluster["SharedStorage"][0]["StorageType"] == "FsxLustre"
    for where in (cluster["HeadNode"], queue):
        assert where["CustomActions"]["OnNodeConfigured"]["Args"] == ["/fsx/meshtrain/.venv"]

    setup = Path(f"{out}.neuron-setup.sh").read_text()
    for package in ("aws-neuronx-dkms", "aws-neuronx-runtime-lib", "aws-neuronx-collectives", "aws-neuronx-tools"):
        assert package in setup
    assert "torch-neuronx" in setup and "neuronx-cc" in setup and "pip.repos.neuron.amazonaws.com" in setup

    job = Path(f"{out}.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=64" in job and "#SBATCH --partition=trainium" in job
    assert "--gpus-per-node" not in job and "export FI_PROVIDER=efa" in job and "FI_EFA_USE_DEVICE_RDMA=1" in job
    compile_at, train_at = job.index("neuron_parallel_compile /fsx/"), job.index("status=0\nsrun")
    assert compile_at < train_at
    assert "--launch.device neuron --nproc 64" in job[compile_at:train_at]
    assert "--launch.device neuron" in job[train_at:].splitlines()[1]
    for script in (f"{out}.sbatch", f"{out}.neuron-setup.sh"):
        assert subprocess.run(["bash", "-n", script]).returncode == 0
        if shutil.which("shellcheck"):
            lint = subprocess.run(["shellcheck", "-s", "bash", script], capture_output=True, text=True)
            assert lint.returncode == 0, lint.stdout


def test_trainium_options_take_effect_or_are_refused(cli_env):
    slurm = ["slurm", "--config", "configs/tiny.toml"]
    assert_user_error(run_cli(["jobscript", *slurm, "--accelerator", "trainium"], cli_env), "--accelerator", "pcluster")
    assert_user_error(run_cli(["jobscript", *slurm, "--instance-type", "p5.48xlarge"], cli_env), "--instance-type")
    refused = {
        ("--instance-type", "p5.48xlarge"): "is not one of trn2.48xlarge",
        ("--instance-type", "trn1.32xlarge"): "Trainium2",
        ("--gpus-per-node", "8"): "one rank per logical NeuronCore (64)",
        ("--procs-per-node", "4"): "leave --procs-per-node out",
    }
    for flags, fragment in refused.items():
        assert_user_error(run_cli(["jobscript", *TRAINIUM, *flags, "--", *FITS_TRAINIUM], cli_env), fragment)
    cpu_after = run_cli(["jobscript", *TRAINIUM, "--", *FITS_TRAINIUM, "--launch.device", "cpu"], cli_env)
    assert_user_error(cpu_after, "--launch.device cpu")
    gpu_with_trn = ["pcluster", "--config", "configs/tiny.toml", "--instance-type", "trn2.48xlarge"]
    assert_user_error(run_cli(["jobscript", *gpu_with_trn], cli_env), "add --accelerator trainium")


def test_trainium_refuses_another_device_in_the_config_file(cli_env, tmp_path):
    """The job puts --launch.device neuron before the arguments after --: a config file's cuda or cpu
    would be silently replaced, so it is refused; one overridden after -- by neuron is the user's."""
    repo = Path(__file__).parents[1]
    config = tmp_path / "device.toml"
    with_config = [*TRAINIUM[:2], str(config), *TRAINIUM[3:]]
    for device in ("cuda", "cpu"):
        config.write_text((repo / "configs/tiny.toml").read_text() + f'\n[launch]\ndevice = "{device}"\n')
        refused = run_cli(["jobscript", *with_config, "--", *FITS_TRAINIUM], cli_env, cwd=repo)
        assert_user_error(refused, f"launch.device = '{device}' in --config {config}", "make it auto or neuron")
    out = tmp_path / "cluster.yaml"
    overridden = run_cli(
        ["jobscript", *with_config, "--out", str(out), "--", *FITS_TRAINIUM, "--launch.device", "neuron"], cli_env
    )
    assert overridden.returncode == 0, overridden.stderr
    assert "--launch.device neuron" in Path(f"{out}.sbatch").read_text()


def test_neuron_device_without_torch_neuronx_is_refused_before_workers_start(cli_env, tmp_path):
    from meshtrain.errors import ConfigError
    from meshtrain.launch.distributed import pick_device
    from meshtrain.launch.env import LaunchEnv

    if importlib.util.find_spec("torch_neuronx") is not None:
        pytest.skip("torch-neuronx is installed here")
    result = run_cli(
        ["train", "--nproc", "2", "--launch.device", "neuron", "--run.dir", str(tmp_path / "run")], cli_env
    )
    assert_user_error(result, "launch.device = 'neuron' needs torch-neuronx", "pip install torch-neuronx")
    assert not (tmp_path / "run").exists()  # refused before the launcher prepared anything
    with pytest.raises(ConfigError, match="torch-neuronx"):
        pick_device(LaunchEnv("single"), "neuron")
    assert pick_device(LaunchEnv("single"), "auto").type != "neuron"  # only an explicit "neuron" picks it


@pytest.mark.parametrize(
    ("given", "seconds", "clock"),
    [
        ("3600", 3600, "01:00:00"),
        ("1-12", 129600, "36:00:00"),
        ("2-00:30", 174600, "48:30:00"),
        ("90:00", 5400, "01:30:00"),
    ],
)
def test_time_means_one_duration_and_is_written_as_every_scheduler_reads_it(given, seconds, clock):
    """--time in seconds or with Slurm's days (D-HH, D-HH:MM) is one duration to meshtrain, and is
    written as HH:MM:SS: Slurm would read a bare 3600 as minutes, and SGE and PBS read no day count."""
    from meshtrain.config import parse_duration
    from meshtrain.launch.jobs import prepare, render
    from meshtrain.launch.jobscript import JobSpec

    assert parse_duration(given, "--time") == seconds
    repo = Path(__file__).parents[1]
    for kind, line in (("slurm", "#SBATCH --time="), ("sge", "#$ -l h_rt="), ("pbs", "#PBS -l walltime=")):
        spec = prepare(kind, JobSpec(config=str(repo / "configs" / "tiny.toml"), time=given, gpus_per_node=1))
        assert f"{line}{clock} " in render(kind, spec)[""] or f"{line}{clock}\n" in render(kind, spec)[""]


def test_mpich_scripts_use_hydras_flags(tmp_path):
    """launch.env = mpich: Hydra has no -npernode or -x (it passes the environment on itself); the
    sge, pbs and mpirun scripts use -ppn and forward nothing by name."""
    from meshtrain.launch.jobs import prepare, render
    from meshtrain.launch.jobscript import JobSpec

    config = tmp_path / "mpich.toml"
    config.write_text(Path("configs/tiny.toml").read_text() + '\n[launch]\nenv = "mpich"\n')
    for kind in ("sge", "pbs", "mpirun"):
        spec = prepare(kind, JobSpec(config=str(config), nodes=2, procs_per_node=2, time="01:00:00"))
        text = render(kind, spec)[""]
        (command,) = [line for line in text.splitlines() if line.startswith("mpirun ")]
        assert " -x " not in command and "FORWARD" not in text and "-npernode" not in command, command
        assert ("-ppn 2" in command) == (kind != "pbs"), command
