"""Compiling for an H100 without one keeps working, and benchmarks/gpu_cost.py counts what it should.

The CUDA plugin's compiler is part of the test install (the ``gpu-aot`` extra, scripts/test.sh): when it
is missing these tests fail, they do not skip.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmark_scripts import load

gpu_cost = load("gpu_cost")


@pytest.fixture(scope="module")
def h100():
    why = gpu_cost.plugin_missing()
    assert why is None, why
    return gpu_cost.load_gpu("h100_sxm")


def _bf16(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


def _kernels(fn, *args, gpu):
    compiled, _ = gpu_cost.compile_for(fn, *args, device=gpu_cost.target_device(gpu))
    assert "H100" in str(gpu_cost.target_device(gpu).device_kind)
    return gpu_cost.kernels_of(compiled.as_text(), gpu.roofline)


def test_a_matmul_and_softmax_compile_for_the_h100_and_are_counted(h100):
    m, k, n = 256, 512, 1024

    def f(x, w):
        with jax.named_scope("head"):
            return jax.nn.softmax(x @ w, axis=-1)

    kernels = _kernels(f, _bf16(m, k), _bf16(k, n), gpu=h100)
    gemms = [x for x in kernels if "matmul" in x.kind or "gemm" in x.kind]
    assert len(gemms) == 1 and gemms[0].flops == 2 * m * k * n, kernels
    assert gemms[0].bytes == 2 * (m * k + k * n + m * n)  # bf16 in and out; cuBLAS's scratch left out
    assert sum(x.flops for x in kernels) == 2 * m * k * n  # the softmax's arithmetic counts nothing
    assert 2 <= len(kernels) <= 6, kernels  # the gemm, then the softmax's reductions and normalisation
    summary = gpu_cost.summarize(kernels, h100.roofline)
    assert set(summary["by_scope"]) == {"head"}
    assert summary["total"]["kernels"] == len(kernels)
    # The roofline of the data file: H100 HBM bandwidth, the measured bf16 matmul rate, a launch.
    assert h100.roofline.seconds(gemms[0].flops, gemms[0].bytes) == pytest.approx(
        max(2 * m * k * n / 662e12, 2 * (m * k + k * n + m * n) / 3.35e12) + 2e-6)


def test_an_elementwise_op_moves_its_input_and_output_once(h100):
    kernels = _kernels(lambda x: x * 2.0 + 1.0, jax.ShapeDtypeStruct((1024, 1024), jnp.float32), gpu=h100)
    assert len(kernels) == 1 and kernels[0].kind.startswith("fusion:")
    assert kernels[0].bytes == 2 * 1024 * 1024 * 4 and kernels[0].flops == 0


def test_a_loop_body_counts_once_per_iteration(h100):
    def f(x, w):
        return jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ w), x)

    kernels = _kernels(f, _bf16(128, 256), _bf16(256, 256), gpu=h100)
    gemms = [x for x in kernels if "matmul" in x.kind or "gemm" in x.kind]
    assert [g.launches for g in gemms] == [5]
    assert gpu_cost.summarize(kernels, h100.roofline)["total"]["flops"] == 5 * 2 * 128 * 256 * 256


def test_the_quick_step_is_priced_per_scope(h100, tmp_path):
    """The --quick path: the trainer's RAT step (gpu kernels, bf16) compiled for the H100, every part of
    the model's scopes found, and the JSON written."""
    out = tmp_path / "cost.json"
    assert gpu_cost.main(["--quick", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["step"] == "quick" and row["compile_s"] > 0
    assert {"sga", "mr_blocks", "head", "loss", "optimizer"} <= set(row["by_scope"])
    assert row["by_scope"]["sga"]["bytes"] > 0 and row["total"]["kernels"] > 50
    assert any(kind.startswith("__cudnn$fmha") for kind in row["by_kind"])  # MR attention is cuDNN's on a GPU
    scoped = sum(s["kernels"] for s in row["by_scope"].values())
    assert scoped == row["total"]["kernels"]
    np.testing.assert_allclose(sum(s["bytes"] for s in row["by_kind"].values()), row["total"]["bytes"])


def test_without_the_plugin_the_command_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if "cuda" in name else real(name, *a))
    assert gpu_cost.main(["--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gpu_cost: error: the CUDA compiler for jax {jax.__version__} is not installed; run pip install "
                   f"-e '.[gpu-aot]' (jax-cuda12-plugin=={jax.__version__}, no CUDA libraries needed)."]
