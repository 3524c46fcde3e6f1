"""The experimental fused GPU forms (model.gpu_forms=all) keep the 16-GPU step free of activation
traffic too: their Pallas and cuDNN kernels run per device (benchmarks/gpu_scaling.py --quick), and the
one-kernel parameter cast's gradient is not all-reduced a second time.
tests/integration/test_gpu_scaling.py checks the default forms the same way."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
F32 = 4


@pytest.fixture(scope="module")
def all_forms(tmp_path_factory):
    work = tmp_path_factory.mktemp("scaling")
    out = work / "scaling.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_scaling.py", "--quick", "--gpu-forms", "all",
                           "--work", str(work), "--out", str(out)], capture_output=True, text=True,
                          timeout=900, cwd=REPO, env=os.environ)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {r["case"]: r for r in json.loads(out.read_text())["rows"]}


@pytest.mark.parametrize("case", ["quick_z0_16", "quick_z3_16"])
def test_fused_forms_on_sixteen_gpus_move_no_activation(all_forms, case):
    row = all_forms[case]
    assert row["activation_collectives"] == []
    assert row["synchronous"] == 0
    reduced = sum(v["buffer"] for k, v in row["by_kind"].items() if k.startswith(("all-reduce", "reduce-scatter")))
    assert reduced <= F32 * row["parameter_elements"], (reduced, row["parameter_elements"])
    assert row["collectives"] <= (3 if case == "quick_z0_16" else 10), row["by_kind"]
