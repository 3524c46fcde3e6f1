"""benchmarks/gpu_bench.py: its smallest pieces on CPU (the XLA forms; the fused ones need a GPU)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import pytest

from benchmark_scripts import load
from jaxrat.config_schema import load_config
from runner import REPO


@pytest.fixture(scope="module")
def bench():
    return load("gpu_bench")


def test_geometry_is_the_isic_rats_first_block(bench):
    config = load_config(os.path.join(REPO, "configs/isic.py"))
    g = bench.rat_geometry(config, 256)
    # 256 px -> SGA kernel 7 stride 3 -> the 86 x 86 grid the MR block attends over (docs/rat.md)
    assert (g["grid"], g["groups"], g["pixels"], g["heads"], g["head_dim"], g["window"]) == (
        (86, 86), 7396, 65536, 8, 16, 16)
    assert bench.rat_geometry(config, 1024)["grid"] == (342, 342)


def test_fallback_is_pallas_only_where_its_blocks_fit(bench, monkeypatch):
    monkeypatch.setattr(bench, "on_gpu", lambda: True)
    assert bench.fallback_implementation([(1024, 1024, 64, 64)]) == "pallas"
    assert bench.fallback_implementation([(256, 1024, 64, 64)]) == "xla"  # its backward: as many blocks each side
    assert bench.fallback_implementation([(1024, 1024, 64, 64), (7396, 65536, 18, 18)]) == "xla"
    monkeypatch.setattr(bench, "on_gpu", lambda: False)
    assert bench.fallback_implementation([(1024, 1024, 64, 64)]) == "xla"


def test_fused_attention_flops_are_counted_from_the_cudnn_calls(bench, monkeypatch):
    import jax
    from jax._src.cudnn import fused_attention_stablehlo

    from jaxrat.ops.gpu import fused_attention

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
    q = jnp.zeros((2, 3, 128, 32), jnp.bfloat16)
    f = jax.value_and_grad(lambda q: jnp.sum(fused_attention(q, q, q).astype(jnp.float32)))
    text = jax.jit(f).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    # one forward and one backward call over (B=6, T=S=128, one head, H=32)
    assert bench.fused_attention_flops(text) == (4 + 10) * 6 * 128 * 128 * 32


def test_quick_kernels_run_and_write_json_and_markdown(bench, tmp_path):
    out = tmp_path / "gpu_bench.json"
    result = bench.main(["--quick", "--only", "kernels", "--sizes", "32", "--reps", "1", "--out", str(out)])
    rows = result["kernels"]
    assert {(r["kernel"], r["form"]) for r in rows} == {
        ("dense_sga", "fallback"), ("dense_sga", "portable"), ("sparse_sga", "portable"),
        ("mr_global", "fallback"), ("mr_global", "portable"), ("mr_windowed", "fallback"),
        ("mr_windowed", "portable")}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows), [r["status"] for r in rows]
    assert json.loads(out.read_text())["kernels"][0]["px"] == 32
    assert "| dense_sga | 32 | fallback | xla |" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_the_isic_step_is_built_by_the_trainer_and_scored(bench, monkeypatch):
    monkeypatch.chdir(REPO)
    row = bench.finish_step(bench.isic_step("configs/isic.py:demo", 32, 8, "portable", 1), peak=1e12)
    assert row["step"] == "isic_rat" and row["global_batch"] == 8 and row["dtype"] == "float32"
    assert row["xla_flops"] > 0 and row["fused_attention_calls"] == 0  # the CPU step has no cuDNN calls
    assert row["images_per_s"] == pytest.approx(8 / row["step_s"])
    # back to back (the trainer's throughput) and each step waited for (latency) are both kept
    assert row["step_s"] > 0 and row["latency_s"] > 0 and len(row["all_latency_s"]) == 1
    assert f"| {row['step_s']:.4f} | {row['latency_s']:.4f} |" in bench.step_table([row])
    assert row["mfu"] == pytest.approx(row["xla_flops"] / row["step_s"] / (1e12 * row["devices"]))


def test_an_xla_form_whose_logits_exceed_the_device_is_not_compiled(bench, monkeypatch):
    """On the H100 the materialised dense SGA at 512 and 1024 px failed inside XLA's autotuner (it
    tried to allocate 200-400 GiB, a page of errors each); such a form is reported up front."""
    config = load_config(os.path.join(REPO, "configs/isic.py"))
    g = bench.rat_geometry(config, 512)
    assert bench.materialised_logits("dense_sga", g) == 8 * g["groups"] * g["pixels"]
    assert bench.materialised_logits("mr_global", g) == 8 * g["groups"] ** 2
    assert bench.materialised_logits("mr_windowed", g) == 8 * (-(-171 // 16)) ** 2 * 256 ** 2
    assert bench.materialised_logits("sparse_sga", g) == 0
    compiled = []
    monkeypatch.setattr(bench, "measure", lambda fn, *a: compiled.append(fn) or {"status": "ok", "ms": 1.0})
    monkeypatch.setattr(bench, "_device_limit", lambda: 59.4 * 2**30)  # the H100's, as XLA reports it
    rows = bench.kernel_rows(config, [512, 1024], ("fallback",), jnp.float32, 1, 512)
    status = {(r["kernel"], r["px"]): r["status"] for r in rows}
    assert status[("dense_sga", 512)] == "not compiled: its logits alone take 228 GiB > 59.4", status
    assert status[("mr_global", 1024)] == "not compiled: its logits alone take 408 GiB > 59.4", status
    # 25 GiB of logits at 512 px: compiled, and then measured against what XLA says it needs
    assert status[("mr_global", 512)] == status[("mr_windowed", 1024)] == "ok"
    assert len(compiled) == 3


def test_the_fused_sparse_sga_form_lowers_for_cuda(bench):
    """The kernel table times the Pallas sparse SGA on a GPU; here it must build and lower."""
    from test_gpu_lowering import lower_for_cuda

    geom = bench.rat_geometry(load_config(os.path.join(REPO, "configs/isic.py")), 64)
    fn, shapes, impl = bench.kernel_cases(geom, jnp.bfloat16, ("fused",))["sparse_sga"]["fused"]
    assert impl == "pallas" and shapes[0] == (1, geom["groups"], 8, 16)
    args = [jnp.zeros(s, jnp.bfloat16) for s in shapes]
    f = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    # forward the log-sum-exps and a sweep, backward a sweep and the keys' pass
    assert lower_for_cuda(f, *args).count("custom_call @__gpu$xla.gpu.triton(") == 4
