"""Launcher detection from synthetic environments (no JAX processes are started here).

Each case is an environment a real launcher produces (checked against Slurm 22.05 on the CI
cluster for the SLURM ones) or a broken one that must fail with a sentence naming the variable.
"""

from __future__ import annotations

import socket

import ml_collections
import pytest

from jaxrat import cluster as D
from jaxrat.cluster.init import _preflight
from jaxrat.cluster.launchers import expand_hostlist, expand_tasks_per_node
from jaxrat.runtime.errors import ConfigError, UserError


def slurm_step(**over: str) -> dict[str, str]:
    """`srun -N2 --ntasks-per-node=8 --gpus-per-node=8` task 9 (second node), as Slurm sets it."""
    env = dict(
        SLURM_JOB_ID="12345", SLURM_STEP_ID="0", SLURM_STEP_NODELIST="gpu[001-002]",
        SLURM_NTASKS="16", SLURM_STEP_NUM_TASKS="16", SLURM_PROCID="9", SLURM_LOCALID="1",
        SLURM_NODEID="1", SLURMD_NODENAME="gpu002", SLURM_STEP_TASKS_PER_NODE="8(x2)",
        CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7", SLURM_STEP_GPUS="0,1,2,3,4,5,6,7", SLURM_GPUS_ON_NODE="8",
    )
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


def drop(env: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in names}


def cfg(**fields) -> ml_collections.ConfigDict:
    """The lead's config.distributed defaults ("" and -1 mean unset) with overrides."""
    c = ml_collections.ConfigDict(dict(
        launcher="auto", coordinator_address="", num_processes=-1, process_id=-1, local_device_ids="",
        initialization_timeout=300, heartbeat_timeout=100, coordinator_port=-1,
    ))
    c.update(fields)
    return c


# ------------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize("text, hosts", [
    ("vm", ["vm"]),
    ("a,b", ["a", "b"]),
    ("node[001-003],x", ["node001", "node002", "node003", "x"]),
    ("node[001,007-008]", ["node001", "node007", "node008"]),
    ("gpu-[8-10]", ["gpu-8", "gpu-9", "gpu-10"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["node[1-2", "node[a-b]", "node]1["])
def test_expand_hostlist_rejects_garbage(bad):
    with pytest.raises(UserError, match="host list"):
        expand_hostlist(bad)


@pytest.mark.parametrize("text, counts", [
    ("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("8(x2)", [8, 8]), ("1,3(x2)", [1, 3, 3]),
])
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


def test_expand_tasks_per_node_rejects_garbage():
    with pytest.raises(UserError, match="tasks-per-node"):
        expand_tasks_per_node("2x3")


# ------------------------------------------------------------------------------ single / none


def test_clean_environment_is_a_single_process():
    assert D.detect(None, {}) == D.ClusterSpec("single", 1, 0)
    assert D.detect(cfg(), {}) == D.ClusterSpec("single", 1, 0)


# -------------------------------------------------------------------------------------- SLURM


def test_slurm_one_task_per_gpu_takes_its_gpu():
    spec = D.detect(None, slurm_step())
    assert (spec.launcher, spec.num_processes, spec.process_id) == ("slurm", 16, 9)
    assert spec.coordinator_address == "gpu001:61497"  # jax's own port for step 0: 12345 % 4096 + 61440
    assert spec.local_device_ids == (1,)


def test_slurm_one_task_per_node_drives_all_gpus():
    env = slurm_step(SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0",
                     SLURM_STEP_TASKS_PER_NODE="1(x2)")
    spec = D.detect(None, env)
    assert (spec.num_processes, spec.process_id, spec.local_device_ids) == (2, 1, None)


def test_slurm_two_tasks_per_node_split_the_gpus():
    env = slurm_step(SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="3", SLURM_LOCALID="1",
                     SLURM_STEP_TASKS_PER_NODE="2(x2)")
    assert D.detect(None, env).local_device_ids == (4, 5, 6, 7)


def test_slurm_gpus_per_task_is_already_bound():
    # srun -n2 --gpus-per-task=1: each task sees only its own GPU.
    env = slurm_step(SLURM_STEP_NODELIST="vm", SLURMD_NODENAME="vm", SLURM_NTASKS="2",
                     SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_NODEID="0",
                     SLURM_STEP_TASKS_PER_NODE="2", CUDA_VISIBLE_DEVICES="1", SLURM_STEP_GPUS="1",
                     SLURM_GPUS_ON_NODE="2")
    assert D.detect(None, env).local_device_ids is None


def test_slurm_uneven_compressed_tasks_per_node():
    # 7 tasks over 4 nodes as "2(x3),1": the last node runs one task with all its GPUs.
    env = slurm_step(SLURM_STEP_NODELIST="n[1-4]", SLURMD_NODENAME="n4", SLURM_NODEID="3",
                     SLURM_NTASKS="7", SLURM_STEP_NUM_TASKS="7", SLURM_PROCID="6", SLURM_LOCALID="0",
                     SLURM_STEP_TASKS_PER_NODE="2(x3),1", CUDA_VISIBLE_DEVICES="0,1", SLURM_STEP_GPUS="0,1",
                     SLURM_GPUS_ON_NODE="2")
    spec = D.detect(None, env)
    assert spec.coordinator_address.startswith("n1:")
    assert spec.local_device_ids is None
    env.update(SLURMD_NODENAME="n2", SLURM_NODEID="1", SLURM_PROCID="3", SLURM_LOCALID="1")
    assert D.detect(None, env).local_device_ids == (1,)


def test_slurm_cpu_only_has_no_device_restriction():
    env = drop(slurm_step(), "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE")
    assert D.detect(None, env).local_device_ids is None


def test_slurm_concurrent_steps_get_different_ports():
    ports = {D.detect(None, slurm_step(SLURM_STEP_ID=str(s))).coordinator_address for s in range(64)}
    assert len(ports) == 64
    assert all(61440 <= int(p.rsplit(":", 1)[1]) <= 65535 for p in ports)


def test_slurm_port_overrides():
    assert D.detect(None, slurm_step(JAX_COORDINATOR_PORT="50000")).coordinator_address == "gpu001:50000"
    assert D.detect(cfg(coordinator_port=40000), slurm_step(JAX_COORDINATOR_PORT="50000")).coordinator_address \
        == "gpu001:40000"


def test_slurm_batch_script_with_many_tasks_asks_for_srun():
    env = drop(slurm_step(SLURM_PROCID="0", SLURM_LOCALID="0"), "SLURM_STEP_ID", "SLURM_STEP_NODELIST")
    with pytest.raises(UserError, match="srun"):
        D.detect(None, env)


def test_slurm_batch_script_with_one_task_is_single_process():
    env = dict(SLURM_JOB_ID="7", SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_JOB_NODELIST="vm")
    assert D.detect(None, env) == D.ClusterSpec("slurm", 1, 0)


@pytest.mark.parametrize("missing", ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST"])
def test_slurm_missing_variable_is_named(missing):
    with pytest.raises(UserError, match=missing):
        D.detect(None, drop(slurm_step(), missing))


def test_slurm_missing_task_count_is_named():
    with pytest.raises(UserError, match="SLURM_NTASKS"):
        D.detect(None, drop(slurm_step(), "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"))


def test_slurm_non_integer_is_named():
    with pytest.raises(UserError, match="SLURM_PROCID='x'"):
        D.detect(None, slurm_step(SLURM_PROCID="x"))


@pytest.mark.parametrize("over, needle", [
    (dict(SLURM_PROCID="16"), "SLURM_PROCID=16"),
    (dict(SLURM_STEP_TASKS_PER_NODE="8,7"), "tasks per node"),
    (dict(SLURM_STEP_TASKS_PER_NODE="8(x3)"), "tasks per node"),
    (dict(SLURM_LOCALID="8"), "SLURM_LOCALID=8"),
    (dict(SLURMD_NODENAME="elsewhere", SLURM_NODEID="5"), "SLURM_NODEID=5"),
])
def test_slurm_contradictions_fail(over, needle):
    with pytest.raises(UserError, match=needle):
        D.detect(None, slurm_step(**over))


def test_gpus_that_do_not_split_evenly_fail():
    env = slurm_step(SLURM_NTASKS="6", SLURM_STEP_NUM_TASKS="6", SLURM_PROCID="1", SLURM_LOCALID="1",
                     SLURM_STEP_TASKS_PER_NODE="3(x2)")
    with pytest.raises(UserError, match="split evenly"):
        D.detect(None, env)


def test_more_tasks_than_shared_gpus_fail():
    env = slurm_step(SLURM_STEP_NODELIST="vm", SLURMD_NODENAME="vm", SLURM_NODEID="0", SLURM_NTASKS="4",
                     SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_STEP_TASKS_PER_NODE="4",
                     CUDA_VISIBLE_DEVICES="0,1", SLURM_STEP_GPUS="0,1", SLURM_GPUS_ON_NODE="2")
    with pytest.raises(UserError, match="share 2 visible GPUs"):
        D.detect(None, env)


# ----------------------------------------------------------------------------------- torchrun


def torchrun(**over: str) -> dict[str, str]:
    env = dict(RANK="5", WORLD_SIZE="16", LOCAL_RANK="5", LOCAL_WORLD_SIZE="8", MASTER_ADDR="10.0.0.1",
               MASTER_PORT="29500", TORCHELASTIC_RUN_ID="abc", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    env.update(over)
    return env


def test_torchrun_env():
    spec = D.detect(None, torchrun())
    # torchrun's agent holds MASTER_PORT itself, so the JAX coordinator takes the next one.
    assert spec == D.ClusterSpec("torchrun", 16, 5, "10.0.0.1:29501", (5,))


def test_plain_master_env_uses_master_port():
    env = drop(torchrun(), "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")
    assert D.detect(None, env) == D.ClusterSpec("torchrun", 16, 5, "10.0.0.1:29500", None)


def test_torchrun_inside_slurm_wins():
    env = {**slurm_step(), **torchrun()}
    assert D.detect(None, env).launcher == "torchrun"


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT", "RANK"])
def test_torchrun_missing_variable_is_named(missing):
    with pytest.raises(UserError, match=missing):
        D.detect(None, drop(torchrun(), missing))


def test_torchrun_contradictions_fail():
    with pytest.raises(UserError, match="RANK=16"):
        D.detect(None, torchrun(RANK="16"))
    with pytest.raises(UserError, match="LOCAL_RANK=9"):
        D.detect(None, torchrun(LOCAL_RANK="9"))


# ----------------------------------------------------------------------------------- Open MPI


def ompi4(**over: str) -> dict[str, str]:
    env = dict(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_LOCAL_RANK="1",
               OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_MCA_orte_hnp_uri="1531576320.0;tcp://10.96.0.1,10.148.0.1:34911")
    env.update(over)
    return env


def test_open_mpi_4():
    spec = D.detect(None, ompi4())
    assert (spec.launcher, spec.num_processes, spec.process_id) == ("mpi", 4, 3)
    assert spec.coordinator_address == f"10.96.0.1:{61440 + (1531576320 // 4096) % 4096}"


def test_open_mpi_4_ipv6():
    uri = "1314521088.0;tcp6://[fe80::b9b:ac5d:9cf0:b858,2620:10d:c083:150e::3000:2]:43370"
    address = D.detect(None, ompi4(OMPI_MCA_orte_hnp_uri=uri)).coordinator_address
    assert address.startswith("[fe80::b9b:ac5d:9cf0:b858]:")


def test_open_mpi_splits_gpus_by_local_rank():
    assert D.detect(None, ompi4(CUDA_VISIBLE_DEVICES="0,1,2,3")).local_device_ids == (2, 3)


def test_open_mpi_5_single_host_uses_loopback():
    env = drop(ompi4(OMPI_COMM_WORLD_LOCAL_SIZE="4", PMIX_NAMESPACE="prterun-vm-123@1"), "OMPI_MCA_orte_hnp_uri")
    assert D.detect(None, env).coordinator_address.startswith("127.0.0.1:")


def test_open_mpi_5_many_hosts_needs_an_address():
    env = drop(ompi4(PMIX_NAMESPACE="prterun-vm-123@1"), "OMPI_MCA_orte_hnp_uri")
    with pytest.raises(UserError, match="JAX_COORDINATOR_ADDRESS"):
        D.detect(None, env)
    env["JAX_COORDINATOR_ADDRESS"] = "head:1234"
    assert D.detect(None, env).coordinator_address == "head:1234"


def test_mpirun_inside_slurm_wins():
    assert D.detect(None, {**slurm_step(), **ompi4()}).launcher == "mpi"


def test_open_mpi_missing_rank_is_named():
    with pytest.raises(UserError, match="OMPI_COMM_WORLD_RANK"):
        D.detect(None, drop(ompi4(), "OMPI_COMM_WORLD_RANK"))


# ---------------------------------------------------------------------------------------- LSF


def lsf(**over: str) -> dict[str, str]:
    env = dict(LSB_JOBID="4242", LSB_MCPU_HOSTS="hostA 4 hostB 4", LSF_PM_TASKID="6",
               CUDA_VISIBLE_DEVICES="0,1,2,3")
    env.update(over)
    return env


def test_lsf_blaunch_task():
    spec = D.detect(None, lsf())
    assert spec == D.ClusterSpec("lsf", 8, 5, f"hostA:{61440 + 4242 % 4096}", (1,))


def test_lsf_hosts_list_form():
    env = drop(lsf(LSB_HOSTS="hostA hostA hostB hostB", LSF_PM_TASKID="1"), "LSB_MCPU_HOSTS")
    spec = D.detect(None, env)
    assert (spec.num_processes, spec.process_id, spec.local_device_ids) == (4, 0, (0, 1))


def test_lsf_jsrun():
    env = lsf(JSM_NAMESPACE_RANK="2", JSM_NAMESPACE_SIZE="4", JSM_NAMESPACE_LOCAL_RANK="0",
              JSM_NAMESPACE_LOCAL_SIZE="2")
    assert D.detect(None, env) == D.ClusterSpec("lsf", 4, 2, f"hostA:{61440 + 4242 % 4096}", (0, 1))


def test_lsf_job_script_on_one_host_is_single_process():
    env = drop(lsf(LSB_MCPU_HOSTS="hostA 8"), "LSF_PM_TASKID")
    assert D.detect(None, env) == D.ClusterSpec("lsf", 1, 0)


def test_lsf_job_script_on_many_hosts_asks_for_blaunch():
    with pytest.raises(UserError, match="blaunch"):
        D.detect(None, drop(lsf(), "LSF_PM_TASKID"))


def test_lsf_missing_hosts_is_named():
    with pytest.raises(UserError, match="LSB_MCPU_HOSTS"):
        D.detect(None, drop(lsf(), "LSB_MCPU_HOSTS"))


def test_lsf_bad_hosts_list():
    with pytest.raises(UserError, match="LSB_MCPU_HOSTS"):
        D.detect(None, lsf(LSB_MCPU_HOSTS="hostA four"))


# ---------------------------------------------------------------------------- explicit config


def test_explicit_config_ignores_a_broken_launcher_environment():
    c = cfg(coordinator_address="10.1.1.1:7777", num_processes=2, process_id=1)
    assert D.detect(c, drop(slurm_step(), "SLURM_PROCID")) == D.ClusterSpec("explicit", 2, 1, "10.1.1.1:7777")


def test_explicit_fields_override_detection():
    c = cfg(num_processes=32, process_id=3, local_device_ids="0,1")
    spec = D.detect(c, slurm_step())
    assert (spec.launcher, spec.num_processes, spec.process_id, spec.local_device_ids) == ("slurm", 32, 3, (0, 1))


def test_explicit_address_without_port_takes_the_port_field():
    c = cfg(coordinator_address="head", num_processes=2, process_id=0, coordinator_port=5555)
    assert D.detect(c, {}).coordinator_address == "head:5555"


def test_jax_env_variables_are_honoured():
    env = dict(JAX_COORDINATOR_ADDRESS="h:1", JAX_LOCAL_DEVICE_IDS="2,3")
    spec = D.detect(cfg(num_processes=2, process_id=1), env)
    assert spec == D.ClusterSpec("explicit", 2, 1, "h:1", (2, 3))


@pytest.mark.parametrize("fields, needle", [
    (dict(num_processes=2, process_id=0), "coordinator_address"),
    (dict(coordinator_address="h:1", num_processes=2), "process_id"),
    (dict(coordinator_address="h:1", process_id=0), "num_processes"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), "process_id=2 is not below"),
    (dict(coordinator_address="h", num_processes=2, process_id=0), "no port"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=0, coordinator_port=2), "different ports"),
    (dict(coordinator_address="h:1:2:3", num_processes=2, process_id=0), "host:port"),
    (dict(launcher="pbs"), "launcher='pbs' is unknown"),
    (dict(launcher="single", num_processes=4), "contradicts"),
    (dict(local_device_ids="a,b"), "local_device_ids"),
    (dict(num_processes=0), "num_processes"),
    (dict(coordinator_port=70000, num_processes=2, process_id=0, coordinator_address="h"), "TCP port"),
])
def test_bad_explicit_config_fails_clearly(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        D.detect(cfg(**fields), {})


def test_forced_launcher_without_its_environment_names_the_variable():
    with pytest.raises(UserError, match="SLURM_JOB_ID"):
        D.detect(cfg(launcher="slurm"), {})
    with pytest.raises(UserError, match="WORLD_SIZE"):
        D.detect(cfg(launcher="torchrun"), {})


def test_forced_single_ignores_the_launcher():
    assert D.detect(cfg(launcher="single"), slurm_step()) == D.ClusterSpec("single", 1, 0)


def test_plain_dict_config_works():
    assert D.detect({"num_processes": 1}, {}).num_processes == 1


# ----------------------------------------------------------------------------- initialization


def test_summary_line_names_everything():
    info = D.WorldInfo("slurm", 1, 2, "vm:61453", (0, 1), 2, 4)
    assert info.summary() == ("launcher=slurm process=1/2 local_devices=2 local_device_ids=0,1 global_devices=4 "
                              "coordinator=vm:61453")


def test_preflight_reports_a_busy_coordinator_port():
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UserError, match=f"port {port} is already in use"):
            _preflight(D.ClusterSpec("explicit", 2, 0, f"127.0.0.1:{port}"))


def test_preflight_reports_an_unknown_host():
    with pytest.raises(UserError, match="does not resolve"):
        _preflight(D.ClusterSpec("slurm", 2, 1, "no-such-host.invalid:61440"))


def test_initialize_single_process(monkeypatch):
    for name in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "LSB_JOBID",
                 "RANK", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    info = D.initialize(cfg())
    assert (info.launcher, info.process_index, info.process_count, info.coordinator) == ("single", 0, 1, None)
    assert info.global_device_count == info.local_device_count >= 1


def test_initialize_after_jax_use_explains(monkeypatch):
    import jax

    jax.devices()  # the backend is up: a multi-process join is no longer possible
    with pytest.raises(UserError, match="before any jax.devices"):
        D.initialize(cfg(coordinator_address="127.0.0.1:1", num_processes=2, process_id=1))
