"""Seconds each test file took in a full run on a 2-core machine, for handing files out longest first.

``scripts/test.sh`` runs two xdist workers, one file at a time each. Started in xdist's default order
(files with the most tests first), the one-test fuzz and cluster files came last and one worker ran
alone for minutes at the end. tests/conftest.py hands files out longest first from this table
(a file not in it counts as ``DEFAULT``), which leaves the two workers finishing together.
The numbers only steer the order; a stale table makes the run slower, never wrong. Regenerate after
adding or reshaping slow tests::

    bash scripts/test.sh --junitxml=/tmp/junit.xml
    python tests/file_costs.py /tmp/junit.xml
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from xml.etree import ElementTree

DEFAULT = 10.0

COSTS = {
    "test_reduction_shards.py": 272,
    "test_slurm.py": 244,
    "test_task_runs.py": 202,
    "test_window_attention.py": 183,
    "test_tune_campaign.py": 120,  # measured alone (114-130 s), not yet in a full run
    "test_output_folder.py": 50,  # measured alone, not yet in a full run
    "test_best_ties.py": 25,  # measured alone, not yet in a full run
    "test_config_trust.py": 17,  # measured alone, not yet in a full run
    "test_fault_campaign.py": 116,  # measured alone, not yet in a full run
    "test_first_step_stop.py": 30,  # measured alone, not yet in a full run
    "test_kernel_policy.py": 111,
    "test_chaos.py": 111,
    "test_training.py": 107,
    "test_sga.py": 97,
    "test_rat_parity.py": 91,
    "test_slurm_campaign.py": 90,  # measured alone (79-91 s), not yet in a full run
    "test_checkpoint_kill.py": 90,
    "test_rat_demos.py": 84,
    "test_preempt_multiprocess.py": 82,
    "test_colabs.py": 78,
    "test_detection_task.py": 78,
    "test_multiprocess.py": 74,
    "test_reading_campaign.py": 70,  # measured alone (69-71 s), not yet in a full run
    "test_dead_peer.py": 57,
    "test_predict.py": 53,
    "test_gpu_bench.py": 45,
    "test_data_readonly.py": 44,
    "test_strided_conv.py": 42,
    "test_rat_model.py": 42,
    "test_gpu_kernels.py": 41,
    "test_predict_tasks.py": 41,
    "test_together.py": 37,
    "test_tune_runs.py": 37,
    "test_init_from.py": 34,
    "test_train_step.py": 33,
    "test_workdir_runs.py": 31,
    "test_folds_run.py": 29,
    "test_autotune.py": 27,
    "test_gpu_cost.py": 25,  # measured alone (22 s), not yet in a full run
    "test_preempt.py": 25,
    "test_tracking_runs.py": 24,
    "test_strip_conv.py": 24,
    "test_classification.py": 23,
    "test_worker_shutdown.py": 22,
    "test_ema.py": 22,
    "test_ema_runs.py": 20,
    "test_detection_losses.py": 20,
    "test_isic_eval.py": 18,
    "test_cli_errors.py": 18,
    "test_rose.py": 16,
    "test_gpu_registers.py": 15,  # measured alone (12 s), not yet in a full run
    "test_detection_matching.py": 16,
    "test_step_profile.py": 15,
    "test_sweep_run.py": 14,
    "test_early_stop.py": 13,
    "test_robustness.py": 12,
    "test_coco_step.py": 12,
    "test_full_disk.py": 12,
    "test_evaluate.py": 12,
    "test_checkpoint_faults.py": 10,
    "test_download.py": 8,
    "test_workdir.py": 7,
    "test_distributed_init.py": 7,
    "test_task_interface.py": 6,
    "test_layers.py": 6,
    "test_data_badfiles.py": 5,
    "test_data_training.py": 5,
    "test_segmentation_task.py": 4,
    "test_tune.py": 4,
    "test_checkpoint.py": 3,
    "test_docs.py": 3,
    "test_sweep.py": 3,
    "test_tracking.py": 3,
    "test_torch_import.py": 3,
    "test_attention_blocks.py": 3,
    "test_distributed_mpi.py": 2,
    "test_data_sources.py": 2,
    "test_input_feed.py": 2,
    "test_report.py": 2,
    "test_gpu_lowering.py": 2,
    "test_checkpoint_snapshot.py": 1,
    "test_cli_noise.py": 1,
    "test_launch.py": 1,
    "test_folds.py": 1,
    "test_staging.py": 0,
    "test_layout.py": 0,
    "test_sharding.py": 0,
    "test_isic_data.py": 0,
    "test_peers.py": 0,
    "test_coco.py": 0,
    "test_data_transforms.py": 0,
    "test_fileio.py": 0,
    "test_hugepages.py": 0,
    "test_benchmarks_runner.py": 0,
    "test_distributed.py": 0,
    "test_writers.py": 0,
    "test_compile_cache.py": 0,
    "test_gpu_precision.py": 0,
}


def costs_from_junit(path: str) -> dict[str, float]:
    """Test file name -> total seconds of its tests in a pytest junit XML report."""
    totals: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((part for part in module if part.startswith("test_")), None)
        if name:
            totals[f"{name}.py"] += float(case.get("time") or 0.0)
    return dict(totals)


def _rewrite(costs: dict[str, float]) -> None:
    here = Path(__file__)
    text = here.read_text()
    head, _, rest = text.partition("COSTS = {\n")
    _, _, tail = rest.partition("}\n")
    rows = "".join(f'    "{name}": {seconds:.0f},\n' for name, seconds in sorted(costs.items(), key=lambda kv: -kv[1]))
    here.write_text(f"{head}COSTS = {{\n{rows}}}\n{tail}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/file_costs.py JUNIT_XML")
    _rewrite(costs_from_junit(sys.argv[1]))
