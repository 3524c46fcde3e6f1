"""Compiling for an H100 without one keeps working, and benchmarks/gpu_cost.py counts what it should.

The CUDA compiler is part of the test install (scripts/test.sh runs scripts/setup_gpu_aot.sh): when it
is missing these tests fail, they do not skip. Each compile runs in a process of its own
(tests/gpu_cost_probe.py, or the command itself), where jax starts with the compiler on its path.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
M, K, N = 256, 512, 1024  # tests/gpu_cost_probe.py's matmul


def _run(*argv: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def probe():
    proc = _run("tests/gpu_cost_probe.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "missing" not in out, out.get("missing")
    return out


def _gemms(kernels):
    return [k for k in kernels if "matmul" in k["kind"] or "gemm" in k["kind"]]


def test_a_matmul_and_softmax_compile_for_the_h100_and_are_counted(probe):
    assert "H100" in probe["device_kind"]
    kernels = probe["matmul_softmax"]["kernels"]
    gemms = _gemms(kernels)
    assert len(gemms) == 1 and gemms[0]["flops"] == 2 * M * K * N, kernels
    assert gemms[0]["bytes"] == 2 * (M * K + K * N + M * N)  # bf16 in and out; cuBLAS's scratch left out
    assert sum(k["flops"] for k in kernels) == 2 * M * K * N  # the softmax's arithmetic counts nothing
    assert 2 <= len(kernels) <= 6, kernels  # the gemm, then the softmax's reductions and normalisation
    summary = probe["matmul_softmax"]["summary"]
    assert set(summary["by_scope"]) == {"head"} and summary["total"]["kernels"] == len(kernels)
    # The data file's roofline: the measured bf16 matmul rate, the H100's HBM bandwidth, a launch.
    assert probe["roofline"] == {"flops_per_s": 662e12, "bytes_per_s": 3.35e12, "launch_s": 2e-6}
    gemm_s = max(2 * M * K * N / 662e12, 2 * (M * K + K * N + M * N) / 3.35e12) + 2e-6
    assert summary["top_kernels"][0]["kind"] == gemms[0]["kind"]
    assert summary["by_kind"][gemms[0]["kind"]]["seconds"] == pytest.approx(gemm_s)


def test_an_elementwise_op_moves_its_input_and_output_once(probe):
    kernels = probe["elementwise"]["kernels"]
    assert len(kernels) == 1 and kernels[0]["kind"].startswith("fusion:")
    assert kernels[0]["bytes"] == 2 * 1024 * 1024 * 4 and kernels[0]["flops"] == 0


def test_a_loop_body_counts_once_per_iteration(probe):
    kernels = probe["loop"]["kernels"]
    assert [g["launches"] for g in _gemms(kernels)] == [5]
    assert probe["loop"]["summary"]["total"]["flops"] == 5 * 2 * 128 * 256 * 256


def test_the_fused_sparse_sga_kernels_compile_for_the_h100(probe):
    """XLA compiles each Triton kernel to GPU code here (Triton rejects what interpret mode accepts,
    e.g. a tensor dim that is not a power of two or a matmul under 16). Two uses of keys laid out
    once: two kernels forward (the log-sum-exps, then the column sums and the update as one sweep) and
    one backward each (d's gradient and the queries' as one sweep), one pass for the keys' and values'
    summed gradients, and of the keys' size outside them only the layout's transposes, once each way."""
    kernels = probe["sparse_sga"]["kernels"]
    triton = [k for k in kernels if k["kind"] == "__gpu$xla.gpu.triton"]
    assert len(triton) == 7 and sum("sparse_sga_sweep_" in k["op_name"] for k in triton) == 4
    assert sum("sparse_sga_inputs_keys" in k["op_name"] for k in triton) == 1
    assert not any("cublas" in k["kind"] or "concatenate" in k["kind"] for k in kernels)
    keys = 2 * 8 * 64 * 64 * 16 * 2  # bytes of the full-resolution keys (bf16)
    large = [k for k in kernels if k["kind"] != "__gpu$xla.gpu.triton" and k["bytes"] >= keys]
    assert len(large) == 4 and all("transpose" in k["kind"] and k["bytes"] == 2 * keys for k in large), large


def test_the_passes_as_matrix_products_compile_for_the_h100(probe):
    """The same program with the passes as products over row segments (SparseSGABlocks.products):
    Triton accepts their tiles (sides of 16 at least) and the same kernels run, sweeps included, nothing
    else. Products a use: lse 1, update 2, grad 4, colsum 1, gd 2 (the input tiles' twice in their sweep:
    its first rows, then each step's); the keys' pass 4 a use."""
    kinds = lambda name: sorted(k["kind"] for k in probe[name]["kernels"])
    assert kinds("sparse_sga_products") == kinds("sparse_sga")
    names = lambda name: sorted(k["op_name"].split(")/", 1)[1].split("/")[0] for k in probe[name]["kernels"]
                                if k["kind"] == "__gpu$xla.gpu.triton")
    assert names("sparse_sga_products") == names("sparse_sga") == sorted(
        ["jvp(sparse_sga_groups_lse)", "jvp(sparse_sga_sweep_colsum_update)",
         "transpose(jvp(sparse_sga_sweep_gd_grad))"] * 2 + ["transpose(jvp(sparse_sga_inputs_keys))"])
    # and they are products: the kernels' bodies (in the program's jaxpr) multiply matrices, the taps' do not
    assert probe["sparse_sga"]["dot_generals"] == 0
    assert probe["sparse_sga_products"]["dot_generals"] == 2 * (1 + 2 + 4 + 2 * 1 + 2 * 2) + 2 * 4


def test_the_fused_mlp_kernels_compile_for_the_h100(probe):
    """Its three Triton kernels (forward, and the inputs' and weights' gradients) compile, and no
    product or kernel of the hidden activation's size runs outside them."""
    kernels = probe["fused_mlp"]["kernels"]
    names = sorted(k["op_name"].split("(")[-1].split(")")[0] for k in kernels if k["kind"] == "__gpu$xla.gpu.triton")
    assert names == ["fused_mlp_forward", "fused_mlp_inputs", "fused_mlp_weights"], names
    assert not any("cublas" in k["kind"] for k in kernels)
    tokens = 2 * 4096 * 128 * 2  # bytes of the tokens (bf16), a quarter of the hidden activation's
    outside = [k for k in kernels if k["kind"] != "__gpu$xla.gpu.triton"]
    # the weights' pass leaves float32 partial sums of the weights' gradients, one set per share of the
    # tokens (8 shares of 64-token tiles here, jaxrat.ops.gpu.mlp.WeightsPass), which XLA adds in one
    # kernel: per share a (2 D + 1, chunk) block per hidden chunk and one more for b2's gradient
    from jaxrat.ops.gpu.mlp import WEIGHTS

    shares = min(WEIGHTS.max_splits, 8192 // 64 // WEIGHTS.min_share)
    weights = (512 // WEIGHTS.chunk + 1) * (2 * 128 + 1) * WEIGHTS.chunk * 4
    partials = [k for k in outside if k["bytes"] > 2 * tokens]
    assert len(partials) <= 1 and all(k["bytes"] <= (shares + 1) * weights for k in partials), partials
    # outside them otherwise at most the loss's own gradient (the tokens read and written once) ...
    assert all(k["bytes"] <= 2 * tokens for k in outside if k not in partials), outside
    # ... and the dropout seed's few words: the masks are drawn in the kernels, none by XLA
    draws = [k for k in outside if any(w in k["op_name"] for w in ("xor", "threefry", "bernoulli", "random"))]
    assert all(k["bytes"] <= 64 for k in draws), draws


def test_the_gradient_norm_and_its_clip_are_one_reduction_not_one_per_leaf(probe):
    """Per leaf, each norm ran one reduction kernel (the ISIC step's ~190 leaves: ~280 of its 1,600
    kernels); concatenated, the norm is one reduction (and the clip's, if XLA keeps it apart, one more),
    and the clip one scaling kernel per leaf."""
    kernels = probe["clipped"]["kernels"]
    reductions = [k for k in kernels if "reduce" in k["kind"]]
    assert len(reductions) <= 2, [k["kind"] for k in kernels]
    assert len(kernels) <= 60 + 6, [k["kind"] for k in kernels]


def test_an_upsampling_resize_is_gathers_not_matrix_products(probe):
    """jax.image.resize multiplies by a dense weight matrix per axis (padded cuBLAS calls and transposes,
    forward and backward); the gpu policy's upsampling gathers two inputs per output and, backward, each
    input's few outputs: no matmul, no scatter, a handful of fused kernels."""
    kernels = probe["resized"]["kernels"]
    assert not _gemms(kernels) and not any("scatter" in k["kind"] for k in kernels), [k["kind"] for k in kernels]
    assert len(kernels) <= 6, [k["kind"] for k in kernels]


def test_the_quick_step_is_priced_per_scope(tmp_path):
    """The --quick path: the trainer's RAT step (gpu kernels, bf16) compiled for the H100, every part of
    the model's scopes found, and the JSON written."""
    out = tmp_path / "cost.json"
    proc = _run("benchmarks/gpu_cost.py", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| quick | all | 32 | 2 |" in proc.stdout
    row = json.loads(out.read_text())["rows"][0]
    assert row["step"] == "quick" and row["compile_s"] > 0
    assert row["memory"]["temp"] > 0 and row["memory"]["argument"] > 0
    assert {"sga", "mr_blocks", "head", "loss", "optimizer"} <= set(row["by_scope"])
    assert row["by_scope"]["sga"]["bytes"] > 0 and row["total"]["kernels"] > 50
    assert any(kind.startswith("__cudnn$fmha") for kind in row["by_kind"])  # MR attention is cuDNN's on a GPU
    # AdamW in a few kernels (jaxrat/optim/gpu_adamw.py), not one per parameter leaf (65 here before, 240 in ISIC's)
    assert row["by_scope"]["optimizer"]["kernels"] <= 8, row["by_scope"]["optimizer"]
    # the weights read once as bfloat16 cast in one kernel up front (jaxrat/trainer/param_cast.py), not one
    # standalone cast kernel each before its matmul (14 here before): the one left is the images'
    assert row["by_kind"].get("fusion:wrapped_convert", {"kernels": 0})["kernels"] <= 1, row["by_kind"]
    assert sum(s["kernels"] for s in row["by_scope"].values()) == row["total"]["kernels"]
    assert sum(s["bytes"] for s in row["by_kind"].values()) == pytest.approx(row["total"]["bytes"])


def test_without_the_compiler_the_command_says_how_to_install_it(tmp_path):
    import importlib.util

    if importlib.util.find_spec("jax_cuda12_plugin") or importlib.util.find_spec("jax_cuda13_plugin"):
        pytest.fail("the CUDA plugin is installed in this environment itself: every jax process loads it")
    proc = _run("benchmarks/gpu_cost.py", "--quick", env={"JAXRAT_GPU_AOT_DIR": str(tmp_path)}, timeout=60)
    assert proc.returncode == 2
    jax_version = importlib.metadata.version("jax")
    assert proc.stderr.strip().splitlines() == [
        f"gpu_cost: error: the CUDA compiler for jax {jax_version} is not installed; run bash scripts/setup_gpu_aot.sh "
        f"(jax-cuda12-plugin=={jax_version} into {tmp_path}, no CUDA libraries needed)."]


MODULE = """HloModule m
%body (p: (s32[], bf16[64,64])) -> (s32[], bf16[64,64], f32[4], f32[4], f32[4], /*index=5*/f32[4]) {
  %p = (s32[], bf16[64,64]{1,0}) parameter(0)
  %x = bf16[64,64]{1,0} get-tuple-element(%p), index=1
  %g = (bf16[64,64]{1,0}, s8[4194304]{0}) custom-call(%x, %x), custom_call_target="__cublas$lt$matmul", \
metadata={op_name="jit(f)/while/body/sga/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":\
{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %y = bf16[64,64]{1,0} get-tuple-element(%g), index=0
  ROOT %t = (s32[], bf16[64,64]{1,0}) tuple(%i, %y)
}
%cond (p: (s32[], bf16[64,64])) -> pred[] {
  %p = (s32[], bf16[64,64]{1,0}) parameter(0)
  ROOT %lt = pred[] compare(%p, %p), direction=LT
}
%cheap (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%a), metadata={op_name="jit(f)/head/neg"}
}
%dear (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %c1 = f32[1024]{0} copy(%a), metadata={op_name="jit(f)/head/copy"}
  ROOT %c2 = f32[8]{0} copy(%a), metadata={op_name="jit(f)/head/copy"}
}
ENTRY %main (x: bf16[64,64], v: f32[8], k: pred[]) -> f32[8] {
  %x = bf16[64,64]{1,0} parameter(0)
  %v = f32[8]{0} parameter(1)
  %k = pred[] parameter(2)
  %w = (s32[], bf16[64,64]{1,0}) while(%x), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  %o = f32[8]{0} conditional(%k, %v, %v), true_computation=%cheap, false_computation=%dear
  ROOT %z = f32[8]{0} copy(%o), control-predecessors={%w}, metadata={op_name="jit(f)/optimizer/copy"}
}
"""


def test_the_module_text_is_read_kernel_by_kernel():
    """benchmarks/hlo_cost.py alone, on a written module: a loop's body counted per trip (its condition not),
    cuBLAS's scratch left out, a conditional's costlier branch, operands without control dependencies."""
    from benchmark_scripts import load

    hlo_cost = load("hlo_cost")
    roofline = hlo_cost.Roofline(flops_per_s=1e12, bytes_per_s=1e9, launch_s=1e-6)
    kernels = {k.name: k for k in hlo_cost.kernels_of(MODULE, roofline)}
    assert set(kernels) == {"g", "c1", "c2", "z"}
    g = kernels["g"]
    assert (g.kind, g.launches, g.scope) == ("__cublas$lt$matmul", 3, "sga")
    assert (g.flops, g.bytes) == (2 * 64**3, 3 * 64 * 64 * 2)
    assert kernels["c1"].bytes == 4 * (1024 + 8) and kernels["z"].bytes == 4 * (8 + 8)
    summary = hlo_cost.summarize(list(kernels.values()), roofline)
    assert summary["total"]["kernels"] == 3 + 3
    assert set(summary["by_scope"]) == {"sga", "head", "optimizer"}


SLICING = """HloModule s
%fused_slice (p0: bf16[16,1024], p1: bf16[16,1024]) -> (bf16[16,256], bf16[16,256]) {
  %p0 = bf16[16,1024]{1,0} parameter(0)
  %p1 = bf16[16,1024]{1,0} parameter(1)
  %sum = bf16[16,1024]{1,0} add(%p0, %p1)
  %b = bf16[16,4,256]{2,1,0} bitcast(%sum)
  %lo = bf16[16,1,256]{2,1,0} slice(%b), slice={[0:16], [0:1], [0:256]}
  %hi = bf16[16,1,256]{2,1,0} slice(%b), slice={[0:16], [3:4], [0:256]}
  %l = bf16[16,256]{1,0} bitcast(%lo)
  %h = bf16[16,256]{1,0} bitcast(%hi)
  ROOT %t = (bf16[16,256]{1,0}, bf16[16,256]{1,0}) tuple(%l, %h)
}
%fused_stack (q0: f32[8,4096], q1: f32[1,4096], q2: s32[]) -> f32[8,4096] {
  %q0 = f32[8,4096]{1,0} parameter(0)
  %q1 = f32[1,4096]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %e = f32[1,4096]{1,0} exponential(%q1)
  ROOT %u = f32[8,4096]{1,0} dynamic-update-slice(%q0, %e, %q2, %z)
}
%fused_all (r0: f32[4096]) -> f32[4096] {
  %r0 = f32[4096]{0} parameter(0)
  ROOT %n = f32[4096]{0} negate(%r0)
}
ENTRY %main (a: bf16[16,1024], b: bf16[16,1024], c: f32[8,4096], d: f32[1,4096], i: s32[], w: f32[4096]) \
-> f32[8,4096] {
  %a = bf16[16,1024]{1,0} parameter(0)
  %b = bf16[16,1024]{1,0} parameter(1)
  %c = f32[8,4096]{1,0} parameter(2)
  %d = f32[1,4096]{1,0} parameter(3)
  %i = s32[] parameter(4)
  %w = f32[4096]{0} parameter(5)
  %s = (bf16[16,256]{1,0}, bf16[16,256]{1,0}) fusion(%a, %b), kind=kLoop, calls=%fused_slice
  %n = f32[4096]{0} fusion(%w), kind=kLoop, calls=%fused_all
  ROOT %k = f32[8,4096]{1,0} fusion(%c, %d, %i), kind=kLoop, calls=%fused_stack
}
"""


def test_a_fusion_counts_the_part_of_an_operand_it_touches():
    """Slices taken after an elementwise op read only their part of each operand; a buffer updated in
    place moves only its update; a whole-array fusion moves its operand and result whole."""
    from benchmark_scripts import load

    hlo_cost = load("hlo_cost")
    roofline = hlo_cost.Roofline(flops_per_s=1e12, bytes_per_s=1e9, launch_s=1e-6)
    kernels = {k.name: k for k in hlo_cost.kernels_of(SLICING, roofline)}
    # two of the four rows of each operand read, both results written
    assert kernels["s"].bytes == 2 * (2 * 16 * 256 * 2) + 2 * 16 * 256 * 2
    # the update read and written (and the index), not the 8-row buffer
    assert kernels["k"].bytes == 4096 * 4 + 4 + 4096 * 4
    assert kernels["n"].bytes == 2 * 4096 * 4
