"""Launch environment detection, from the variables each launcher really sets (captured on real
Slurm 22.05, Open MPI 4.1.4, MPICH 4.0.2 and SGE 8.1.9 installs: shared/reference recipes)."""

import pytest

from conftest import assert_user_error, run_cli
from meshtrain.errors import MeshtrainError
from meshtrain.launch.env import detect, port_from_job_id
from meshtrain.launch.local import rendezvous_args

SLURM_TASK = {  # srun task 1 of 2 inside sbatch job 7
    "SLURM_JOB_ID": "7",
    "SLURM_JOBID": "7",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_STEP_NODELIST": "vm",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_NNODES": "1",
}
SLURM_BATCH_STEP = {k: v for k, v in SLURM_TASK.items() if "STEP" not in k} | {
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_MCA_ess_base_jobid": "1978859521",
}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "8"}


def test_torchrun():
    env = detect(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "node7",
            "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "abc",
        }
    )
    assert (
        env.launcher,
        env.rank,
        env.world_size,
        env.local_rank,
        env.local_world_size,
        env.node_rank,
        env.master_addr,
        env.master_port,
        env.job_id,
    ) == ("torchrun", 3, 4, 1, 2, 1, "node7", 29400, "abc")


def test_rank_without_world_size_is_an_error():
    with pytest.raises(MeshtrainError, match="WORLD_SIZE is missing"):
        detect({"RANK": "0"})


def test_slurm_task():
    env = detect(SLURM_TASK)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 1, 2, 1, 2)
    assert env.master_addr == "vm" and env.master_port == 15007 and env.job_id == "7"


def test_slurm_batch_step_is_not_rank_0_of_2():
    env = detect(SLURM_BATCH_STEP)
    assert env.launcher == "single" and env.world_size == 1


def test_slurm_multi_node_hostlist_and_tasks_per_node():
    env = detect(
        SLURM_TASK
        | {
            "SLURM_STEP_NODELIST": "gpu[012-013,020]",
            "SLURM_JOB_NODELIST": "gpu[012-013,020]",
            "SLURM_STEP_NUM_TASKS": "12",
            "SLURM_STEP_TASKS_PER_NODE": "4(x3)",
            "SLURM_PROCID": "9",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "2",
        }
    )
    assert (env.master_addr, env.node_rank, env.local_world_size, env.world_size) == ("gpu012", 2, 4, 12)


def test_openmpi_wins_over_the_batch_steps_slurm_variables():
    env = detect(SLURM_BATCH_STEP | OPENMPI)
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("openmpi+slurm", 1, 2, 1)
    assert env.master_addr == "vm" and env.job_id == "7"


def test_plain_openmpi_and_mpich_on_one_node():
    env = detect(OPENMPI)
    assert (env.launcher, env.rank, env.world_size, env.master_addr) == ("openmpi", 1, 2, "127.0.0.1")
    assert env.master_port == port_from_job_id("1978859521")
    env = detect(MPICH)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("mpich", 1, 2, 1, 2)


def test_mpi_on_several_nodes_needs_a_host(tmp_path):
    two_nodes = OPENMPI | {"OMPI_COMM_WORLD_SIZE": "4"}
    with pytest.raises(MeshtrainError, match="export MASTER_ADDR"):
        detect(two_nodes)
    hostfile = tmp_path / "pe_hostfile"
    hostfile.write_text("node3 2 all.q@node3 UNDEFINED\nnode4 2 all.q@node4 UNDEFINED\n")
    env = detect(two_nodes | {"PE_HOSTFILE": str(hostfile), "JOB_ID": "42"})
    assert (env.launcher, env.master_addr, env.job_id, env.master_port) == ("openmpi+sge", "node3", "42", 15042)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("cn01\ncn01\ncn02\ncn02\n")
    env = detect(MPICH | {"PMI_SIZE": "4", "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "1234.pbs01"})
    assert (env.launcher, env.master_addr, env.job_id) == ("mpich+pbs", "cn01", "1234.pbs01")


def test_azureml():
    env = detect(OPENMPI | {"AZ_BATCH_MASTER_NODE": "10.0.0.4:6105"})
    assert (env.launcher, env.master_addr, env.master_port) == ("azureml", "10.0.0.4", 6105)


def test_forced_launcher_and_inconsistent_environments():
    assert detect(SLURM_TASK | OPENMPI, launcher="slurm").launcher == "slurm"
    with pytest.raises(MeshtrainError, match="was not started by it"):
        detect({}, launcher="openmpi")
    with pytest.raises(MeshtrainError, match="same number of tasks on every node"):
        detect(OPENMPI | {"OMPI_COMM_WORLD_SIZE": "3", "MASTER_ADDR": "h"})
    with pytest.raises(MeshtrainError, match="outside world size"):
        detect({"RANK": "2", "WORLD_SIZE": "2"})


SLURM_4_PER_NODE = SLURM_TASK | {  # rank 5 of 8, the second task of the second node
    "SLURM_STEP_NODELIST": "gpu[1-2]",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
}


@pytest.mark.parametrize("per_node", ["4(x2)", "4(x1),4"])
def test_slurm_tasks_per_node_in_each_of_slurms_forms(per_node):
    env = detect(SLURM_4_PER_NODE | {"SLURM_STEP_TASKS_PER_NODE": per_node})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (5, 8, 1, 4, 1)
    mpich = MPICH | {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "SLURM_STEP_TASKS_PER_NODE": per_node}
    del mpich["MPI_LOCALNRANKS"]  # `srun --mpi=pmi2`: the tasks per node come from Slurm
    env = detect(mpich | {"SLURM_JOB_NODELIST": "gpu[1-2]"})
    assert (env.launcher, env.local_world_size, env.node_rank) == ("mpich", 4, 1)


def test_slurm_step_tasks_need_no_job_task_count():
    """SLURM_STEP_NUM_TASKS is the step's own count: SLURM_NTASKS (set only with --ntasks) is not needed."""
    step = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_NTASKS"}
    assert detect(step).world_size == 2
    assert detect(SLURM_TASK | {"SLURM_NTASKS": "6"}).world_size == 2  # the step's count wins


MAP_BY_NODE = {"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": "h"}
BAD_ENVIRONMENTS = {
    "uneven slurm": (SLURM_4_PER_NODE | {"SLURM_STEP_TASKS_PER_NODE": "4,2"}, "SLURM_STEP_TASKS_PER_NODE='4,2': the"),
    "uneven slurm repeat": (
        SLURM_4_PER_NODE | {"SLURM_STEP_TASKS_PER_NODE": "2(x3),1"},
        "nodes run different numbers of tasks",
    ),
    "uneven job counts": (
        {k: v for k, v in SLURM_4_PER_NODE.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
        | {"SLURM_TASKS_PER_NODE": "4,3"},
        "SLURM_TASKS_PER_NODE='4,3': the nodes run different numbers of tasks",
    ),
    "uneven mpich": (
        {k: v for k, v in MPICH.items() if k != "MPI_LOCALNRANKS"} | {"SLURM_STEP_TASKS_PER_NODE": "4,3"},
        "srun --ntasks-per-node=N",
    ),
    "garbled slurm": (SLURM_TASK | {"SLURM_STEP_TASKS_PER_NODE": "4(2)"}, "is not Slurm's tasks per node"),
    "no slurm tasks per node": (
        {k: v for k, v in SLURM_TASK.items() if "TASKS_PER_NODE" not in k},
        "SLURM_STEP_TASKS_PER_NODE is missing",
    ),
    "no slurm task count": (
        {k: v for k, v in SLURM_TASK.items() if "NUM_TASKS" not in k and k != "SLURM_NTASKS"},
        "SLURM_STEP_NUM_TASKS or SLURM_NTASKS is missing",
    ),
    "openmpi --map-by node": (
        OPENMPI | MAP_BY_NODE,
        "ranks are not placed in blocks per node (rank 1 has local rank 0",
    ),
    "srun --distribution=cyclic": (
        SLURM_4_PER_NODE | {"SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_LOCALID": "2", "SLURM_NODEID": "1"},
        "srun --distribution=block",
    ),
    "torchrun without its local world size": (
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"},
        "rank 3 has local rank 1 of 4), so a node's tensor-parallel group would span nodes: set LOCAL_RANK and",
    ),
    "bad step nodelist": (SLURM_TASK | {"SLURM_STEP_NODELIST": "gpu[01-"}, "SLURM_STEP_NODELIST='gpu[01-' is not"),
    "empty job nodelist": (
        SLURM_BATCH_STEP | OPENMPI | {"SLURM_JOB_NODELIST": ","},
        "SLURM_JOB_NODELIST=',' is not a Slurm host list (it names no host)",
    ),
    "port too high": (SLURM_TASK | {"MASTER_PORT": "70000"}, "MASTER_PORT: port 70000 is outside 1..65535"),
    "port zero": (OPENMPI | {"MASTER_PORT": "0"}, "MASTER_PORT: port 0 is outside 1..65535"),
    "port not a number": ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an int"),
    "azureml port": (OPENMPI | {"AZ_BATCH_MASTER_NODE": "10.0.0.4:x1"}, "its port 'x1' is not a number"),
    "azureml port too high": (
        OPENMPI | {"AZ_BATCH_MASTER_NODE": "10.0.0.4:65536"},
        "AZ_BATCH_MASTER_NODE: port 65536 is outside 1..65535",
    ),
}


def test_local_ranks_where_a_launcher_leaves_them_out():
    """env:// without torchrun (RANK and WORLD_SIZE alone) is one node, a device a rank; Cray PALS
    names MPICH's local rank PMI_LOCAL_RANK; MPICH with no count per node is one node."""
    plain = detect({"RANK": "1", "WORLD_SIZE": "2"})
    assert (plain.local_rank, plain.local_world_size, plain.node_rank) == (1, 2, 0)
    pals = {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "4", "MASTER_ADDR": "n1"}
    cray = detect(pals)
    assert (cray.launcher, cray.local_rank, cray.local_world_size, cray.node_rank) == ("mpich", 1, 4, 1)
    alone = detect({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (alone.local_rank, alone.local_world_size, alone.node_rank) == (1, 2, 0)


@pytest.mark.parametrize("case", list(BAD_ENVIRONMENTS))
def test_bad_launch_environments_are_refused_in_one_line(case):
    env, fragment = BAD_ENVIRONMENTS[case]
    with pytest.raises(MeshtrainError) as refused:
        detect(env)
    assert fragment in str(refused.value) and "\n" not in str(refused.value)


def test_nproc_refuses_a_slurm_node_count_that_is_not_a_number(cli_env, tmp_path):
    result = run_cli(
        ["train", "--nproc", "2", "--run.dir", str(tmp_path / "run")], cli_env | {"SLURM_STEP_NUM_NODES": "2x"}
    )
    assert_user_error(result, "SLURM_STEP_NUM_NODES='2x' is not an integer")
    assert not (tmp_path / "run").exists()  # refused before the launcher prepared anything


def test_rendezvous_options():
    assert rendezvous_args(None, None, None, None, {}) == ["--standalone"]
    on_port = rendezvous_args(None, None, None, 29555, {})  # one node at a chosen port, not a random one
    assert on_port[on_port.index("--rdzv-endpoint") + 1] == "127.0.0.1:29555" and "--standalone" not in on_port
    static = rendezvous_args(2, 1, "10.1.1.1", 29400, {})
    assert static == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.1.1", "--master-port", "29400"]
    per_node_task = SLURM_TASK | {"SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "n[1-2]"}
    assert rendezvous_args(None, None, None, None, per_node_task) == [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "n1:15007",
        "--rdzv-id",
        "7",
    ]
    with pytest.raises(MeshtrainError, match="SLURM_STEP_NUM_NODES='two' is not an integer"):
        rendezvous_args(None, None, None, None, per_node_task | {"SLURM_STEP_NUM_NODES": "two"})


@pytest.mark.parametrize(
    "started",
    [{"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}, OPENMPI, MPICH],
    ids=["torchrun", "openmpi", "mpich"],
)
def test_single_is_refused_for_a_process_started_beside_others(started):
    """launch.env = single inside a Slurm allocation of several tasks running one process is what it
    is for; for a process that torchrun or mpirun started as one of several it would make each train
    the whole job alone. Stray RANK/WORLD_SIZE (a container's, no torchrun) are what it is forced against."""
    assert detect(SLURM_TASK, launcher="single").world_size == 1
    assert detect({"RANK": "0", "WORLD_SIZE": "8"}, launcher="single").world_size == 1
    with pytest.raises(MeshtrainError, match="launch.env = 'single', but .* started this process as one of 2"):
        detect(started, launcher="single")


# enroot's PyTorch hook (pyxis --container-image) copies an srun task's ids into torchrun's variables,
# but not LOCAL_WORLD_SIZE
PYXIS_TASK = SLURM_TASK | {
    "SLURM_STEP_NODELIST": "gpu[012-013,020]",
    "SLURM_JOB_NODELIST": "gpu[012-013,020]",
    "SLURM_STEP_NUM_TASKS": "12",
    "SLURM_NTASKS": "12",
    "SLURM_STEP_TASKS_PER_NODE": "4(x3)",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "RANK": "9",
    "WORLD_SIZE": "12",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "gpu012",
    "MASTER_PORT": "29500",
}


def test_a_container_hooks_torchrun_variables_leave_a_slurm_task_placed_by_slurm(monkeypatch):
    """Read as torchrun's, the hook's variables would put all 12 ranks on one node; Slurm's own
    place rank 9 on the third node of 4 ranks each. In the agent-per-node script (one srun task a
    node, --nproc) the hook's RANK is no launcher of meshtrain's workers: --nproc is not refused."""
    from meshtrain.launch.local import refuse_inside_a_launcher

    env = detect(PYXIS_TASK)
    assert (env.launcher, env.rank, env.world_size, env.local_world_size, env.node_rank) == ("slurm", 9, 12, 4, 2)
    assert detect(PYXIS_TASK | {"LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}).launcher == "torchrun"
    one_node = SLURM_TASK | {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}  # forced, the hook's are read
    assert detect(one_node, "torchrun").launcher == "torchrun" and detect(one_node).launcher == "slurm"
    agent = PYXIS_TASK | {"SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_PROCID": "2"}
    for key, value in (agent | {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "SLURM_LOCALID": "0"}).items():
        monkeypatch.setenv(key, value)
    refuse_inside_a_launcher()
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x3)")  # srun's tasks per rank: --nproc would be dropped
    with pytest.raises(MeshtrainError, match="--nproc starts meshtrain's own launcher"):
        refuse_inside_a_launcher()
