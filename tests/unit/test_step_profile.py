"""benchmarks/step_profile.py: the trainer's step profiled and its thunk time charged to the model's named scopes."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmark_scripts import load

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sp():
    return load("step_profile")


def test_bucket_of_reads_forward_and_backward_scopes(sp):
    assert sp.bucket_of("jit(step)/jvp(sga)/dot_general") == "sga"
    assert sp.bucket_of("jit(step)/transpose(jvp(mr_blocks))/add_any") == "mr_blocks"
    assert sp.bucket_of("jit(step)/transpose(jvp(head))/jvp(head)/checkpoint/mul") == "head"
    assert sp.bucket_of("jit(step)/optimizer/mul;jit(step)") == "optimizer"
    assert sp.bucket_of("jit(step)/jvp(sigmoid_binary_cross_entropy)/log") == "other"
    assert sp.bucket_of("jit(step)/heads_split/reshape") == "other"  # a scope only as a whole component
    assert sp.bucket_of("") == "other"


def test_a_fusion_is_charged_to_its_dot(sp):
    def step(w, x):
        with jax.named_scope("sga"):
            y = jnp.tanh(x @ w)
        with jax.named_scope("optimizer"):
            return w - 0.1 * jnp.sum(y)

    text = jax.jit(step).lower(jnp.ones((64, 64)), jnp.ones((32, 64))).compile().as_text()
    charged, _ = sp.instruction_scopes(text)
    dots = [n for n, op in charged.items() if "sga/dot_general" in op]
    assert dots and {sp.bucket_of(op) for op in charged.values()} >= {"sga", "optimizer"}
    assert sp.module_name(text) == "jit_step"


def test_a_computation_whose_types_hold_an_equals_sign_is_still_a_computation(sp):
    """A header such as "%fused (...) -> (f32[2], ..., /*index=5*/f32[2]) {" (six or more outputs) once
    read as an instruction, so the fusion found no body and took its own op_name instead of its dot's."""
    text = "\n".join([
        "HloModule m",
        "%before (p: f32[2]) -> f32[2] {",
        '  ROOT %neg = f32[2]{0} negate(%p), metadata={op_name="jit(step)/optimizer/neg"}',
        "}",
        "%fused (a: f32[2,2]) -> (f32[2], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2]) {",
        '  %d = f32[2]{0} dot(%a, %a), lhs_contracting_dims={1}, metadata={op_name="jit(step)/jvp(sga)/dot_general"}',
        "  ROOT %t = (f32[2], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2]) tuple(%d, %d, %d, %d, %d, %d)",
        "}",
        "ENTRY %main (x: f32[2,2]) -> (f32[2], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2]) {",
        "  %x = f32[2,2]{1,0} parameter(0)",
        "  ROOT %f = (f32[2], f32[2], f32[2], f32[2], f32[2], /*index=5*/f32[2]) fusion(%x), kind=kOutput, "
        'calls=%fused, metadata={op_name="jit(step)/optimizer/add"}',
        "}",
    ])
    charged, _ = sp.instruction_scopes(text)
    assert sp.bucket_of(charged["f"]) == "sga"


def test_real_step_time_lands_in_every_component(sp, tmp_path):
    """A tiny RAT in the real ISIC train step: if a named scope went missing, its bucket would be empty."""
    config = sp.isic_config("configs/isic.py", 32, jax.device_count(), "dense")
    config.model.rat.update(dict(feature_dims=8, num_blocks=1, num_heads=1, iters=1))
    config.model.decoder_dim = 4
    config.data.num_workers = 0  # no worker processes for a few tiny batches
    cwd = os.getcwd()
    os.chdir(REPO)  # the config path is relative to the repository, as in the benchmark
    try:
        step = sp.Step(config, str(tmp_path / "data"))
    finally:
        os.chdir(cwd)
    jax.block_until_ready(step())
    result = sp.profile(step.compiled, step, 1, str(tmp_path / "trace"))
    per_step = result["thunk_s_per_step"]
    for scope in ("sga", "mr_blocks", "head", "optimizer"):
        assert per_step[scope] > 0, (scope, per_step)
    assert sum(result["fractions"].values()) == pytest.approx(1.0, abs=1e-6)
    assert result["thunk_total_s_per_step"] == pytest.approx(sum(per_step.values()))
    assert os.path.exists(result["xplane"])
    assert sp.step_flops(step.compiled) > 0 and sp.loop_aware_flops(step.compiled.as_text()) > 0
    wait = sp.input_wait(step, 2)
    assert 0.0 <= wait["input_wait_fraction"] <= 1.0 and wait["fed_steps"] == 2


def test_run_all_arguments_parse(sp):
    run_all = load("run_all")
    for args in run_all.BENCHMARKS["step_profile"]:
        parsed = sp.parse_args([*args, "--out", "x.json"])
        assert parsed.size <= 256 and parsed.steps >= 1


def test_loop_aware_flops_counts_every_iteration(sp):
    x = jnp.ones((64, 64))
    looped = jax.jit(lambda x: jax.lax.fori_loop(0, 10, lambda i, y: jnp.tanh(y @ x), x)).lower(x).compile()
    assert sp.loop_aware_flops(looped.as_text()) == 10 * 2 * 64**3
    assert sp.step_flops(looped) < 2 * 2 * 64**3  # what the loop-aware count is for: XLA counts the body once
