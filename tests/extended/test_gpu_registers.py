"""The Pallas (Triton) kernels fit in an H100's registers: benchmarks/gpu_registers.py compiles the ISIC
first layer's sparse SGA (both forms), fused MLP, layer norm and fused AdamW for the H100 here and asks
ptxas what each kernel needs per thread. A kernel that spills runs its inner loop through local memory.

ptxas is part of the test install (scripts/setup_gpu_aot.sh, which scripts/test.sh runs): when it is
missing these tests fail, they do not skip. The script runs in a process of its own (XLA's dump folder
is set before jax starts).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner import without_test_flags

REPO = Path(__file__).resolve().parents[2]
SPARSE = {f"sparse_sga_{n}" for n in ("groups_lse", "sweep_colsum_update", "sweep_gd_grad", "inputs_keys")}
MLP = {f"fused_mlp_{n}" for n in ("forward", "inputs", "weights")}


def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # At XLA's default flags: the suite's -O0 reaches ptxas too, which then spills.
    flags = without_test_flags(os.environ.get("XLA_FLAGS", ""))
    return subprocess.run([sys.executable, "benchmarks/gpu_registers.py", *argv], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env={**os.environ, "XLA_FLAGS": flags, **(env or {})})


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("registers") / "registers.json"
    proc = _run("--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| sparse_taps | sparse_sga_sweep_gd_grad |" in proc.stdout  # the table
    return json.loads(out.read_text())["rows"]


def test_every_kernel_of_both_sparse_forms_and_the_mlp_is_compiled_and_measured(rows):
    found = {(r["program"], r["kernel"]) for r in rows}
    want = {(p, k) for p in ("sparse_taps", "sparse_products") for k in SPARSE}
    want |= {("fused_mlp", k) for k in MLP}
    want |= {("multi_tensor_adamw", "multi_tensor_adamw")}  # one call's 48 leaves: 337 kernel arguments
    want |= {("multi_tensor_cast", "multi_tensor_cast")}  # one call's 96 leaves: 192 pointers
    want |= {("multi_tensor_ema", "multi_tensor_ema")}  # one call's 64 leaves: 193 kernel arguments
    want |= {("sparse_projection", "sparse_sga_projection")}  # the first layer's keys and values, laid out
    want |= {("sparse_keys_dx", "sparse_sga_inputs_keys_dx")}  # its keys' pass, writing the input's gradient
    want |= {("layer_norm", "layer_norm_forward"), ("layer_norm", "layer_norm_backward")}
    assert found == want
    assert all(0 < r["registers"] <= 255 for r in rows), rows


def test_no_kernel_spills_registers(rows):
    """At 32 groups a tile the product form's gradient pass spilled (6 KB a thread with float32 weights,
    152 bytes with bfloat16 ones), and with dropout drawn in the kernels the MLP's inputs' and weights'
    passes did at 128 hidden units and 64 tokens a step (224 and 460 bytes): the defaults now spill none."""
    spilling = [r for r in rows
                if r["spill_stores"] or r["spill_loads"] or r["stack"] > _TRIG_STACK.get(r["kernel"], 0)]
    assert not spilling, spilling


# The keys' pass that turns the keys' gradients back by RoSE's angles computes their sines and cosines:
# the reduction of a huge angle (Payne-Hanek, on a path the RAT's angles never take) keeps 7 words of
# 2/pi's bits in a local array (28 bytes, a 32-byte frame). That is no spill: the check above allows it.
_TRIG_STACK = {"sparse_sga_inputs_keys_dx": 32}


def test_the_product_form_and_the_mlp_multiply_on_the_tensor_cores(rows):
    """mma.sync or Hopper's wgmma (Triton's choice for tiles of 64 rows and more) in every kernel of the
    product form, of the MLP and of the projection; none in the tap form, which multiplies on the CUDA cores (nor in the
    AdamW, the casts, the averages and the layer norm, which multiply no matrices)."""
    for r in rows:
        tensor_cores = r["mma"] + r["wgmma"]
        if r["program"] in ("sparse_taps", "multi_tensor_adamw", "multi_tensor_cast", "multi_tensor_ema", "layer_norm"):
            assert tensor_cores == 0, r
        else:
            assert tensor_cores > 0, r


def test_without_ptxas_it_says_how_to_install_it():
    proc = _run(env={"JAXRAT_PTXAS_DIR": "/nonexistent", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert "ptxas not found; run bash scripts/setup_gpu_aot.sh" in proc.stderr
    assert "Traceback" not in proc.stderr
