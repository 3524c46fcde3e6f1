"""Config defaults shared by every jaxrat task.

A config file's ``get_config(arg)`` starts from :func:`base_config`, adds its task's fields
(``config.task.*``, ``config.model.*``) and overrides what it needs. Every field a user may
override on the command line must exist (ml_collections refuses unknown keys), with a value of
the right type or a typed placeholder.
"""

from __future__ import annotations

import functools
from typing import Any

import ml_collections as mlc

from jaxrat.runtime.dotted import flatten


def base_config() -> mlc.ConfigDict:
    """Defaults for every section; experiment configs override fields."""
    c = mlc.ConfigDict()
    c.seed = 0
    c.num_train_steps = 1000
    # Start a new run from another run's weights: "PATH[:STEP|:best|:latest]" (a workdir, its checkpoints/
    # folder or one step folder); params only unless checkpoint.init_optimizer. Ignored when resuming.
    c.init_from = ""
    # Which parameters init_from loads: regexes searched in parameter paths (e.g. "^backbone/" for the
    # RAT backbone only; exclude "^heads/" to leave a classifier's heads fresh). With init_from_strict
    # every parameter must load (a missing one or another shape stops the run); otherwise those
    # re-initialise and the log lists them.
    c.init_from_include = ""
    c.init_from_exclude = ""
    c.init_from_strict = False
    # "OLD=NEW[,...]": source path prefixes renamed first (a source model that names its parts otherwise).
    c.init_from_rename = ""
    c.data = _data()
    c.model = _model()
    c.task = _task()
    c.optimizer = _optimizer()
    c.train = _train()
    c.checkpoint = _checkpoint()
    c.mesh = _mesh()
    c.sharding = _sharding()
    c.distributed = _distributed()
    c.tracking = _tracking()
    c.workdir = _workdir()
    return c


def _data() -> mlc.ConfigDict:
    """Where the images come from, how they are batched, decoded and augmented."""
    s = mlc.ConfigDict()
    s.name = "isic2018"
    s.data_dir = ""  # empty: the dataset's default location (see the dataset's error message)
    s.synthetic = False  # generate a synthetic dataset under the workdir (off when data_dir is given)
    s.synthetic_train = 256
    s.synthetic_val = 64
    # Side the synthetic images are generated at (0: image_size). The pipeline resizes them to
    # image_size like real data, so evaluating at another image_size reads the very same images.
    s.synthetic_image_size = 0
    s.image_size = 256
    s.batch_size = 8  # global batch over all devices and hosts
    s.eval_batch_size = 8  # global
    # "auto": the largest per-device micro-batch whose compiled step fits the memory budget, with the
    # accumulation that reaches target_batch_size (0: batch_size); batch_size is then what was chosen.
    s.per_device_batch_size = ""
    s.target_batch_size = 0
    s.random_flip = True
    s.num_threads = 2  # Grain reader threads per process
    s.prefetch_buffer = 4  # batches decoded ahead, per process
    s.device_prefetch = 2  # batches copied to the devices ahead by a background thread; 0: none
    s.on_bad_file = "fail"  # "fail" or "skip" (skipped files listed in WORKDIR/skipped_files.txt)
    s.source = "files"  # "files" (official folders) or "tfds" (ArrayRecord: python -m jaxrat.data.prepare_isic)
    s.split_file = ""  # JSON {split: [image ids or indices]} re-splitting all labelled images
    # K-fold cross-validation of the training split (jaxrat.data.folds): folds=K > 0 validates on fold
    # `fold` of the training split and trains on the others (stratified by class where there are
    # classes); the assignment is written to fold_dir ("" = the workdir). jaxrat.sweep --folds K sets them.
    s.folds = 0
    s.fold = 0
    s.fold_seed = 0
    s.fold_dir = ""
    s.stage_to_local_dir = ""  # copy data_dir to this node-local folder before training
    # Decoding processes per training process. -1: this process's share of the CPU cores minus one
    # (for the step), within worker_ram_budget_gb; 0: decode in reader threads of this process.
    s.num_workers = -1
    s.worker_ram_budget_gb = 0.0  # for num_workers=-1; 0: a quarter of the available RAM
    # Augmentations (training only); each is off at its neutral value.
    s.keep_aspect_ratio = False  # resize to fit and zero-pad instead of stretching
    s.random_crop_scale = (1.0, 1.0)  # RandomResizedCrop area range, e.g. (0.5, 1.0)
    s.scale_jitter = (1.0, 1.0)  # rescale range then crop/pad back, e.g. (0.8, 1.25)
    s.rotation_degrees = 0.0  # uniform in [-x, x]
    s.color_jitter = 0.0  # brightness/contrast/saturation in [1-x, 1+x], hue in [-x/2, x/2]
    s.elastic_prob = 0.0  # probability of an elastic deformation per image
    s.elastic_alpha = 34.0  # its largest displacement, pixels
    s.elastic_sigma = 4.0  # its smoothness, pixels
    # Evaluation only: each image is resampled at this many times its pixel spacing (downsampled by
    # it after the resize to image_size, then back up), as if recorded at a coarser resolution.
    s.eval_spacing = 1.0
    return s


def _model() -> mlc.ConfigDict:
    """Which model, and how its operations are computed; the config files add its own fields."""
    s = mlc.ConfigDict()
    s.name = "unet"
    # How the model's operations are computed (jaxrat.ops.policy): "auto" (the form for the platform
    # of the mesh's devices, resolved once at start-up), "cpu", "gpu" or "portable" (plain XLA ops).
    s.kernels = "auto"
    # Which fused GPU forms the gpu form uses (jaxrat.ops.forms): "validated" (those whose code passed
    # parity on a GPU, per jaxrat/ops/gpu/validated.json; the others take the portable form), "all"
    # (every fused form of this version, validated or not), or form names separated by commas (each
    # used whether validated or not, with the validated ones for the other operations).
    s.gpu_forms = "validated"
    return s


def _task() -> mlc.ConfigDict:
    """The task owns its data, loss and metrics (jaxrat.tasks); its own fields (loss weights,
    thresholds, ...) are set by the config files that choose it."""
    s = mlc.ConfigDict()
    s.name = "segmentation"  # a built-in task, or "package.module:ClassName"
    return s


def _optimizer() -> mlc.ConfigDict:
    """AdamW with warmup and decay, clipping, weight decay, EMA and layer-wise decay."""
    s = mlc.ConfigDict()
    s.learning_rate = 1e-3
    s.end_learning_rate_factor = 0.01
    s.warmup_steps = 100
    s.weight_decay = 1e-4
    s.b1 = 0.9
    s.b2 = 0.999
    s.clip_norm = 1.0  # 0 disables global-norm clipping
    # Parameters whose path matches this regex (re.search on "backbone/sga_layers/0/rose/freqs"),
    # and every parameter with fewer than 2 dimensions, get no weight decay.
    s.weight_decay_exclude = r"(^|/)(bias|scale|freqs|table)$|embed|pos_"
    s.grad_accum_steps = 1  # micro-batches per step: batch_size must divide by it
    # Learning rate scaling when the batch is sized automatically: "none", "linear" or "sqrt" in
    # global batch / reference_batch_size (the batch the learning rate was tuned for; 0: no scaling).
    s.lr_scaling = "none"
    s.reference_batch_size = 0
    # Exponential moving average of the parameters (0: off), e.g. 0.999: kept in the train state,
    # sharded like the parameters and checkpointed; evaluation, best checkpoints and early stopping
    # then use it (eval/*), the raw parameters are logged as eval_raw/* (docs/experiments.md).
    s.ema_decay = 0.0
    # Layer-wise learning-rate decay (BEiT fine-tuning), 0 = off: jaxrat.trainer.optimizer.layer_scales.
    s.layer_decay = 0.0
    # Warm the decay up as min(ema_decay, (1 + t) / (10 + t)) at update t, so that the average of a
    # short or young run is not dominated by the random initialisation.
    s.ema_warmup = True
    return s


def _train() -> mlc.ConfigDict:
    """The loop: precision, logging, evaluation, compilation cache, memory, reductions, early stopping."""
    s = mlc.ConfigDict()
    # "auto": bfloat16 on GPUs, float32 on CPUs (resolved from the mesh's devices; the run summary
    # records what ran); or "float32" / "bfloat16". Parameters and optimizer state stay float32.
    s.compute_dtype = "auto"
    s.log_every = 10
    s.eval_every = 200
    s.eval_at_end = True
    s.log_images = True
    # curves.png (and a classifier's confusion matrices) at the run's end; matplotlib costs a few
    # seconds of CPU a run, which a run started many times (the smoke variant, tests) can skip.
    s.plots = True
    # JAX's persistent compilation cache: "" = $JAX_COMPILATION_CACHE_DIR, $JAXRAT_CACHE_DIR/xla or
    # ~/.cache/jaxrat/xla; "none" = off. A resumed or requeued run then skips most compilation.
    s.compilation_cache_dir = ""
    # Memory a device may use, for automatic batch sizing: 0 = the device's own limit (GPUs report
    # it; CPUs do not, so set it there); memory_margin of it is kept free.
    s.memory_budget_gb = 0.0
    s.memory_margin = 0.1
    # 0: XLA reduces the batch as it partitions it (fastest). N > 0: every (micro-)batch is cut into N
    # fixed shards of consecutive rows; each shard's gradient comes from one single-device program on
    # the device that holds it, and the shards' gradients are added in one fixed order, so a step gives
    # the same bits on any device and process count (measured on both demos, docs/tasks.md). Costs N
    # gradient copies on each device while they are added and N host dispatches per micro-batch; the
    # loss is then the mean of the shards' losses, like DDP over N GPUs.
    s.reduction_shards = 0
    # Early stopping: end the run after this many evaluations in a row without an improvement of
    # more than early_stop_min_delta in early_stop_metric ("" = checkpoint.best_metric, ranked by
    # checkpoint.best_mode; another metric by early_stop_mode). 0: off. The run saves its last
    # step, counts as finished for sweeps and says why in its log and summary.json.
    s.early_stop_patience = 0
    s.early_stop_min_delta = 0.0
    s.early_stop_metric = ""
    s.early_stop_mode = "max"  # for an early_stop_metric other than checkpoint.best_metric
    return s


def _checkpoint() -> mlc.ConfigDict:
    """When checkpoints are written, which are kept, and how."""
    s = mlc.ConfigDict()
    s.every_steps = 200  # 0: no step rule; the last step and preemptions always save
    s.every_minutes = 0.0  # 0: off; checked at log steps (train.log_every)
    s.keep = 3  # the latest K checkpoints
    s.keep_every = 0  # also keep every P-th step for good (0: none)
    s.best_metric = ""  # e.g. "eval/dice": keep the best keep_best by it, WORKDIR/checkpoints/best.json
    s.best_mode = "max"  # "max" or "min" (e.g. for "eval/loss")
    s.keep_best = 1
    s.async_save = True  # write in the background; the loop only waits for the device-to-host copy
    s.atomic_rename = True  # False: write in place + commit file (filesystems without atomic rename)
    s.init_optimizer = False  # with init_from: also load the optimizer state
    return s


def _mesh() -> mlc.ConfigDict:
    """The device mesh."""
    s = mlc.ConfigDict()
    # (axis name, size) pairs; -1 takes the remaining devices. Batches shard over every axis.
    s.axes = (("data", -1), ("fsdp", 1))
    return s


def _sharding() -> mlc.ConfigDict:
    """How parameters and optimizer state are sharded over the mesh."""
    s = mlc.ConfigDict()
    # ZeRO stage: 0 replicated, 1 shard optimizer state, 2 also gradients, 3 also parameters.
    s.zero = 0
    s.axis = "fsdp"  # mesh axis (or "data,fsdp") that ZeRO/FSDP shards over
    s.min_size = 2**14  # arrays smaller than this stay replicated
    # (regex on the parameter path, spec) pairs, first match wins; spec is "replicate", "fsdp" or
    # per-dimension axes like "(None, 'fsdp')". Unmatched arrays follow the ZeRO preset.
    s.rules = ()
    return s


def _distributed() -> mlc.ConfigDict:
    """How the processes find each other (jaxrat.cluster)."""
    s = mlc.ConfigDict()
    s.launcher = "auto"
    s.coordinator_address = ""
    s.num_processes = -1
    s.process_id = -1
    s.local_device_ids = ""
    s.initialization_timeout = 300
    s.heartbeat_timeout = 100
    s.coordinator_port = -1
    return s


def _tracking() -> mlc.ConfigDict:
    """Where metrics go (docs/tracking.md); only process 0 writes, and a failing tracker costs a warning."""
    s = mlc.ConfigDict()
    s.backends = ("tensorboard", "jsonl")  # add "mlflow" and/or "wandb" (pip install 'jaxrat[tracking]')
    s.experiment = "jaxrat"  # MLflow experiment
    s.run_name = ""  # empty: the workdir's name
    s.tags = ()  # (key, value) pairs for MLflow tags / W&B tags
    s.mlflow_uri = ""  # e.g. "http://mlflow:5000"; empty: $MLFLOW_TRACKING_URI, else WORKDIR/mlflow.db
    s.wandb_project = "jaxrat"
    s.wandb_entity = ""
    s.wandb_mode = "offline"  # "offline" (WORKDIR/wandb; `wandb sync` later) or "online"
    s.queue_size = 1000  # MLflow calls waiting for the server; beyond that, logs are dropped
    s.close_timeout_s = 30.0  # how long the end of a run waits for MLflow to take the last logs
    return s


def _workdir() -> mlc.ConfigDict:
    """One run per workdir and resumes with the same config (docs/workdir.md)."""
    s = mlc.ConfigDict()
    s.lock = True  # WORKDIR/run.lock; False only where the filesystem cannot hold one
    s.lease_seconds = 120.0  # another host's lock unrefreshed for this long is taken over
    s.allow_config_change = False  # resume even if model/task/data/optimizer/seed/batch changed
    return s


# What a config without the field means, where that differs from the default above: what the
# jaxrat that wrote it did before the field existed (a run's config.json resumes as it trained).
_BEFORE_THE_FIELD: dict[str, Any] = {
    "init_from_strict": True,
    "optimizer.ema_warmup": False,
    "optimizer.weight_decay_exclude": "",
}


@functools.cache
def _defaults() -> dict[str, Any]:
    return {**flatten(base_config()), **_BEFORE_THE_FIELD}


def default(key: str) -> Any:
    """The value of the dotted field ``key`` (``"model.kernels"``) for a config that lacks it: a run's
    config.json from an older jaxrat, a section a config file built whole (``c.model = ConfigDict(...)``)
    or by hand. Readers use :func:`field`, so each default is stated once, here."""
    return _defaults()[key]


def field(node: Any, key: str) -> Any:
    """The dotted field ``key`` read from ``node``, the config section that holds it (the config itself
    for a top-level field): ``field(config.model, "model.kernels")``, :func:`default` where absent."""
    name = key.rpartition(".")[2]
    return node[name] if name in node else default(key)
