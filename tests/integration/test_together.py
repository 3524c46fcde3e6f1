"""Two real processes whose first collective starts 35 s apart (one compiled slowly): Gloo's
communicator set-up gives up after 30 s, so without jaxrat.cluster.together the run dies with
DEADLINE_EXCEEDED; with it both meet at the coordination service's barrier first and succeed."""

import subprocess
import sys
import textwrap

import pytest

from runner import REPO, free_port, process_env

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SCRIPT = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxrat.cluster.together import compiled_together
    port, pid = sys.argv[1], int(sys.argv[2])
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), jnp.ones((2,)) * (pid + 1))
    total = jax.jit(lambda a: jnp.sum(a), out_shardings=NamedSharding(mesh, P()))
    step = compiled_together(total, "sum")
    if pid == 1:
        time.sleep(35)  # a compile that took 35 s longer than process 0's
    print(f"sum {float(step(x))}", flush=True)  # one write: other threads log to the same pipe
""")


def test_first_collective_waits_for_a_slow_compiling_peer(tmp_path):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(port), str(i)], cwd=REPO, env=process_env(2),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "sum 6.0" in out, out[-3000:]
