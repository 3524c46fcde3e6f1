"""benchmarks/gpu_profile.py: attributing measured GPU kernel time to ops and scopes (the join and
the trace parsing here on synthetic events; the script end to end on the CPU, where it finds none)."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import load


@pytest.fixture(scope="module")
def prof():
    return load("gpu_profile")


def _trace(*events):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    return {"traceEvents": meta + list(events)}


def _event(pid, ts, dur, name, op=None):
    return {"ph": "X", "pid": pid, "tid": 1, "ts": ts, "dur": dur, "name": name,
            "args": {"hlo_op": op} if op else {}}


def test_device_events_are_the_gpu_processes_complete_events(prof):
    trace = _trace(_event(1, 0, 5, "k"), _event(2, 0, 50, "host"), {"ph": "i", "pid": 1, "ts": 3, "name": "mark"})
    assert [e["name"] for e in prof.device_events(trace)] == ["k"]


def test_kernel_time_is_joined_to_its_op_scope_and_estimate(prof):
    hlo_cost = prof.hlo_cost
    kernels = [hlo_cost.Kernel("fusion.1", "fusion:loop", "jit(step)/sga/add", 0.0, 3.35e9),  # 1 ms + launch
               hlo_cost.Kernel("custom-call.2", "__gpu$xla.gpu.triton", "jit(step)/transpose(jvp(sga))/pallas",
                               0.0, 3.35e8, launches=2),
               hlo_cost.Kernel("fusion.3", "fusion:input_reduce", "jit(step)/optimizer/reduce", 0.0, 0.0)]
    # two steps: fusion.1 once a step, the Triton call twice, one command buffer, one copy XLA added
    events = []
    for s in range(2):
        t0 = s * 10_000
        events += [_event(1, t0, 2_000, "loop_fusion_1", "fusion.1"),
                   _event(1, t0 + 2_000, 1_000, "pass", "custom-call.2"),
                   _event(1, t0 + 3_000, 1_000, "pass", "custom-call.2"),
                   _event(1, t0 + 4_000, 500, "input_reduce_fusion", "command_buffer_7"),
                   _event(1, t0 + 5_000, 10, "memcpy32_post")]
    r = prof.attribute(events, kernels, steps=2)
    assert r["launches"] == 5 and r["busy_ms"] == pytest.approx(4.51)
    assert r["span_ms"] == pytest.approx((15_010 - 0) / 2 / 1e3)
    sga = r["scopes"]["sga"]
    assert sga["ms"] == pytest.approx(4.0) and sga["launches"] == 3
    assert sga["est_ms"] == pytest.approx(1.002 + 2 * 0.102) and sga["gb"] == pytest.approx(3.35 + 0.67)
    assert r["scopes"]["(command buffer)"]["ms"] == pytest.approx(0.5)
    assert r["scopes"]["(not in the module)"]["launches"] == 1
    assert "optimizer" not in r["scopes"]  # not run: no row
    assert [o["op"] for o in r["ops"][:2]] == ["fusion.1", "custom-call.2"]
    assert r["kinds"]["__gpu$xla.gpu.triton"]["ms"] == pytest.approx(2.0)
    text = prof.tables(r)
    assert "| sga | 4.00 | 3 | 1.21 | 4.02 | 3.3 |" in text, text
    assert "| fusion.1 | sga | fusion:loop | 2000.0 | 1 | 1002.0 | 2.0 | loop_fusion_1 |" in text, text


def test_the_script_runs_end_to_end_and_says_it_needs_a_gpu(prof, tmp_path, capsys):
    result = prof.main(["--config", "configs/isic.py:demo", "--size", "32", "--batch", "8", "--steps", "1",
                        "--input-grad-by-xla", "--passes-apart", "--out", str(tmp_path)])
    # the flags are the policy's values, not module switches flipped for the whole process
    assert result["sparse_sga_blocks"] == {"products": False, "sweep_rows": 0, "input_grad_features": 0}
    assert result["input_grad_by_xla"] and result["passes_apart"]
    assert result["launches"] == 0 and result["latency_s"] > 0 and result["compile_s"] > 0
    assert "this profile needs a GPU" in capsys.readouterr().out
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["step"] == "isic_rat" and saved["px"] == 32 and (tmp_path / "step.hlo.gz").stat().st_size > 0
