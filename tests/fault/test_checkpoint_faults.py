"""Checkpoints that cannot be read back, and saves onto a full disk: never lose what was saved before."""

import glob
import logging
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrat.checkpointing import Checkpointer, Policy, inspect, store
from jaxrat.checkpointing.recovery import is_disk_full
from jaxrat.runtime.errors import CheckpointError, ConfigError


def _mesh(n=8):
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))


def _state(step, n=64):
    mesh = _mesh()
    w = jax.random.normal(jax.random.key(step), (n, n)) + step
    return {"step": jnp.int32(step), "params": {"w": jax.device_put(w, NamedSharding(mesh, P("data")))}}


def _abstract(n=64):
    rep = NamedSharding(_mesh(4), P())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), _state(0, n))


def _saved(directory, steps, **policy):
    ck = Checkpointer(directory, Policy(**policy))
    for s in steps:
        ck.save(s, _state(s), reason="steps")
    ck.close()


def _files(path):
    return [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]


def test_truncated_newest_is_moved_aside_and_the_previous_restored(tmp_path, caplog):
    directory = str(tmp_path / "checkpoints")
    _saved(directory, [1, 2, 3])
    for f in _files(os.path.join(directory, "3", "state")):
        os.truncate(f, 0)

    ck = Checkpointer(directory, Policy())
    with caplog.at_level(logging.WARNING):
        step, state, _ = ck.restore_latest(_abstract())
    ck.close()
    assert step == 2
    np.testing.assert_array_equal(state["params"]["w"], _state(2)["params"]["w"])
    aside = glob.glob(os.path.join(directory, "damaged", "3-*"))
    assert len(aside) == 1 and os.path.isdir(os.path.join(aside[0], "state"))  # kept, never deleted
    assert store.committed_steps(directory) == [1, 2]
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "cannot be read" in r.message]
    assert len(warning) == 1 and os.path.join(directory, "3") in warning[0] and aside[0] in warning[0]
    assert warning[0].count(". ") == 0 and warning[0].endswith(".")  # one sentence
    info = inspect.describe(str(tmp_path))
    assert info["latest"] == 2 and info["damaged"] == [os.path.relpath(aside[0], directory)]
    assert "damaged (found unreadable at a restore" in inspect.format_table(info)

    ck = Checkpointer(directory, Policy(keep=2))  # the manager ignores damaged/ and saves on
    ck.save(4, _state(4), reason="steps")
    ck.close()
    assert store.committed_steps(directory) == [2, 4] and os.path.isdir(aside[0])


def test_a_flipped_bit_that_orbax_reads_without_error_is_caught_by_the_digest(tmp_path, caplog):
    directory = str(tmp_path / "checkpoints")
    _saved(directory, [1, 2])
    biggest = max(_files(os.path.join(directory, "2", "state")), key=os.path.getsize)
    data = bytearray(open(biggest, "rb").read())
    data[len(data) * 2 // 3] ^= 0x10  # inside the stored array bytes, which OCDBT does not checksum
    open(biggest, "wb").write(data)

    ck = Checkpointer(directory, Policy())
    unverified, _ = ck.restore(2, _abstract())
    assert not np.array_equal(unverified["params"]["w"], _state(2)["params"]["w"])
    with caplog.at_level(logging.WARNING):
        step, state, _ = ck.restore_latest(_abstract())
    ck.close()
    assert step == 1
    np.testing.assert_array_equal(state["params"]["w"], _state(1)["params"]["w"])
    assert any("params/w reads back different from what was saved" in r.getMessage() for r in caplog.records)


def test_every_checkpoint_unreadable_gives_none_and_keeps_them_all(tmp_path):
    directory = str(tmp_path / "checkpoints")
    _saved(directory, [1, 2])
    for step in (1, 2):
        for f in _files(os.path.join(directory, str(step), "state")):
            os.truncate(f, 0)
    ck = Checkpointer(directory, Policy())
    assert ck.restore_latest(_abstract()) is None
    ck.close()
    assert sorted(os.listdir(os.path.join(directory, "damaged")))[0].startswith("1-")
    assert len(os.listdir(os.path.join(directory, "damaged"))) == 2


def test_a_checkpoint_of_another_model_is_a_config_error_and_stays(tmp_path):
    directory = str(tmp_path / "checkpoints")
    _saved(directory, [1])
    ck = Checkpointer(directory, Policy())
    with pytest.raises(ConfigError, match=r"params/w has shape \(32, 32\) but the checkpoint of step 1 .* \(64, 64\)"):
        ck.restore_latest(_abstract(n=32))
    ck.close()
    assert store.committed_steps(directory) == [1] and not os.path.exists(os.path.join(directory, "damaged"))


def test_turning_the_moving_average_on_or_off_at_resume_is_one_sentence(tmp_path):
    directory = str(tmp_path / "checkpoints")
    _saved(directory, [1])
    with_ema = _abstract()
    with_ema["ema_params"] = with_ema["params"]
    ck = Checkpointer(directory, Policy())
    with pytest.raises(ConfigError, match=r"saved without optimizer.ema_decay.*ema_decay=0.*init_from="):
        ck.restore_latest(with_ema)
    ck.close()
    ema_dir = str(tmp_path / "ema" / "checkpoints")
    ck = Checkpointer(ema_dir, Policy())
    state = _state(1)
    ck.save(1, {**state, "ema_params": state["params"]}, reason="steps")
    ck.close()
    ck = Checkpointer(ema_dir, Policy())
    with pytest.raises(ConfigError, match=r"holds a moving average of the parameters .* this run has none"):
        ck.restore_latest(_abstract())
    ck.close()
    assert store.committed_steps(directory) == [1] and store.committed_steps(ema_dir) == [1]


def test_disk_full_is_recognised_in_tensorstore_and_os_errors():
    ts = ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file "/x/": Failed '
                    'to write 1681734 bytes to file 7: No space left on device [os_error_code=\'28\']')
    assert is_disk_full(ts) and is_disk_full(OSError(28, "No space left on device"))
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(122, "Disk quota exceeded")
    assert is_disk_full(wrapped)
    assert not is_disk_full(ValueError("DATA_LOSS: checksum")) and not is_disk_full(OSError(13, "Permission denied"))


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: room for a small checkpoint, not for a 4 MiB one."""
    where = tmp_path / "disk"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield str(where)
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("async_save,atomic_rename", [(True, True), (False, False)], ids=["async", "sync_commit_file"])
def test_disk_full_keeps_the_previous_checkpoint_and_says_so_in_one_sentence(small_disk, async_save, atomic_rename):
    directory = os.path.join(small_disk, "checkpoints")
    ck = Checkpointer(directory, Policy(keep=1, async_save=async_save, atomic_rename=atomic_rename))
    ck.save(1, _state(1), reason="steps")
    ck.wait()
    with pytest.raises(CheckpointError) as err:
        ck.save(2, _state(2, n=1024), reason="steps")  # 4 MiB
        ck.wait()  # an async save fails in the background and is reported here
    ck.close()
    message = str(err.value)
    assert message.count(". ") == 0 and message.endswith(".") and "\n" not in message
    assert f"The disk holding {directory} is full" in message and "step 2" in message
    assert "the last complete checkpoint (step 1) is intact" in message
    assert sorted(os.listdir(directory)) == ["1"]  # no half-written step folder left behind
    ck = Checkpointer(directory, Policy(keep=1))
    step, state, _ = ck.restore_latest(_abstract())
    ck.close()
    assert step == 1
    np.testing.assert_array_equal(state["params"]["w"], _state(1)["params"]["w"])


_TWO_PROCESS_WORKER = '''
import glob, os, sys
i, port, where, damage = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
import jax
jax.distributed.initialize(f"127.0.0.1:{port}", 2, i)
import jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.experimental import multihost_utils
from jaxrat.checkpointing import Checkpointer, Policy
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
def state(s):
    w = jax.jit(lambda: jax.random.normal(jax.random.key(s), (64, 64)) + s,
                out_shardings=NamedSharding(mesh, P("data")))()
    return {"step": jax.jit(lambda: jnp.int32(s), out_shardings=NamedSharding(mesh, P()))(), "params": {"w": w}}
ck = Checkpointer(where, Policy())
ck.save(1, state(1), reason="steps")
ck.save(2, state(2), reason="steps")
ck.close()
multihost_utils.sync_global_devices("saved")
if i == 0:
    for f in glob.glob(os.path.join(where, "2", "state", damage, "**"), recursive=True):
        if os.path.isfile(f):
            os.truncate(f, 0)
multihost_utils.sync_global_devices("damaged")
ck = Checkpointer(where, Policy())
step, got, _ = ck.restore_latest(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                              state(0)))
same = np.array_equal(np.asarray(got["params"]["w"].addressable_data(0)),
                      np.asarray(state(1)["params"]["w"].addressable_data(0)))
ck.close()
print(f"RESULT {step} {same}", flush=True)
'''


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["", "ocdbt.process_1"], ids=["all_files", "one_process_files"])
def test_two_processes_agree_on_the_step_and_process_0_moves_the_folder(tmp_path, damage):
    import socket
    import sys

    from runner import REPO

    script = tmp_path / "worker.py"
    script.write_text(_TWO_PROCESS_WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2")
    where = str(tmp_path / "checkpoints")
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port), where, damage], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "RESULT 1 True" in out, out[-3000:]
    assert len(os.listdir(os.path.join(where, "damaged"))) == 1 and store.committed_steps(where) == [1]
