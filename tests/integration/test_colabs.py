"""Every notebook in colabs/ runs top to bottom on CPU (code cells executed in order)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from runner import REPO, env_with_devices

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "colabs", "*.ipynb")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
    nb = json.load(open(path))
    code = "\n\n".join(
        "".join(line for line in c["source"] if not line.lstrip().startswith(("!", "%")))
        for c in nb["cells"] if c["cell_type"] == "code"
    )
    script = tmp_path / "nb.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=os.path.join(REPO, "colabs"), env=env_with_devices(1),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_there_is_a_notebook():
    assert NOTEBOOKS
