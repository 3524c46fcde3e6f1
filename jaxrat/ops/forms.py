"""The gpu policy's fused forms, what each is made of, and which of them have run on a GPU.

Each fused GPU form (:data:`FORMS`) replaces the portable form of one operation and is named by the
sources its program is made of (files, or ``path::name`` for one top-level function or class) and
the switches it runs with (:class:`jaxrat.ops.policy.SparseSGABlocks` for sparse SGA). Its
**fingerprint** hashes both, so any change to a form's code gives it a new fingerprint; the code is
hashed without its comments and docstrings (:func:`code_of`), so editing those keeps a validation.

The **validation record** (``jaxrat/ops/gpu/validated.json``, written by ``scripts/gpu_session.sh``
through :mod:`jaxrat.ops.validation`) lists, per form, the fingerprints that passed parity on a GPU,
with the GPU, driver, versions, date, parity figures and timing. ``model.kernels=auto`` (or ``gpu``)
on a GPU then takes, per operation, the newest form whose fingerprint is in the record, else an
older one that is, else the portable form (:func:`select`); the others run only when asked
(``model.gpu_forms``). Pure Python: reading this module imports neither jax nor Pallas.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import math
import os
import pathlib
from typing import Any, Iterable, Optional

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the folder holding the jaxrat package
RECORD = pathlib.Path(__file__).resolve().parent / "gpu" / "validated.json"
F32_TOLERANCE = 1e-5  # largest relative error of a float32 fused form against the portable form
BF16_TOLERANCE = 5e-2  # largest bfloat16 error against float32 where the portable form's own is not recorded

_SGA = "jaxrat/ops/gpu/sparse_sga/"
_SPARSE = tuple(_SGA + f for f in ("__init__.py", "api.py", "passes.py", "taps.py", "tiles.py", "tiling.py")) + (
    "jaxrat/ops/per_device.py",)


@dataclasses.dataclass(frozen=True)
class Form:
    """One fused GPU form.

    Attributes:
      name: what ``model.gpu_forms`` and the record call it.
      operation: the operation it computes; forms of one operation are alternatives, newest first in
        :data:`FORMS`.
      sources: repository paths of the code its program is made of (``path::name``: one top-level
        function or class of that file).
      blocks: the switches it runs with (fields of :class:`jaxrat.ops.policy.SparseSGABlocks`), part of
        its fingerprint.
      candidate: whether it is in the experimental set (``model.gpu_forms=all``): the forms the main
        branch runs when nothing is held back; others are named to be used.
      requires: operations whose fused form it needs (else it is not used).
    """

    name: str
    operation: str
    sources: tuple[str, ...]
    blocks: tuple[tuple[str, Any], ...] = ()
    candidate: bool = True
    requires: tuple[str, ...] = ()


_FORMS = (
    Form("sparse_sga_products", "sparse_sga", _SPARSE + (_SGA + "products.py", _SGA + "sweep.py"),
         (("products", True), ("sweep_rows", 8)), candidate=False),
    Form("sparse_sga_sweep", "sparse_sga", _SPARSE + (_SGA + "sweep.py",),
         (("products", False), ("sweep_rows", 8))),
    Form("sparse_sga_tap", "sparse_sga", _SPARSE, (("products", False), ("sweep_rows", 0))),
    Form("sparse_sga_projection", "sparse_sga_projection",
         (_SGA + "projection.py", _SGA + "input_grad.py"),
         (("input_grad_features", 256),), requires=("sparse_sga",)),
    Form("dense_sga", "dense_sga", ("jaxrat/ops/gpu/dense_sga.py", "jaxrat/ops/gpu/fused.py")),
    Form("attention", "attention", ("jaxrat/ops/gpu/multires.py", "jaxrat/ops/gpu/permute.py",
                                    "jaxrat/ops/gpu/fused.py")),
    Form("masked_attention", "masked_attention", ("jaxrat/ops/gpu/masked.py", "jaxrat/ops/gpu/fused.py")),
    Form("mlp", "mlp", ("jaxrat/ops/gpu/mlp.py", "jaxrat/ops/per_device.py")),
    Form("layer_norm", "layer_norm", ("jaxrat/ops/gpu/layer_norm.py", "jaxrat/ops/norm.py",
                                      "jaxrat/ops/per_device.py")),
    Form("rotate", "rotate", ("jaxrat/ops/gpu/rotate.py",)),
    Form("resize", "resize", ("jaxrat/ops/resize.py",)),
    Form("adamw", "adamw", ("jaxrat/optim/gpu_adamw.py", "jaxrat/optim/multi_tensor.py",
                            "jaxrat/trainer/fused_optimizer.py")),
    Form("ema", "ema", ("jaxrat/optim/gpu_ema.py", "jaxrat/optim/multi_tensor.py",
                        "jaxrat/trainer/fused_optimizer.py"), requires=("adamw",)),
    Form("cast", "cast", ("jaxrat/optim/gpu_cast.py", "jaxrat/optim/multi_tensor.py",
                          "jaxrat/trainer/param_cast.py")),
)
FORMS: dict[str, Form] = {f.name: f for f in _FORMS}
SELECTIONS = ("validated", "all")  # model.gpu_forms besides a list of names


def candidates() -> frozenset:
    """The experimental set: per operation its newest candidate form (what the main branch runs)."""
    chosen: dict[str, str] = {}
    for f in _FORMS:
        if f.candidate:
            chosen.setdefault(f.operation, f.name)
    return frozenset(chosen.values())


def source_text(entry: str, read=None) -> Optional[str]:
    """The text of one source entry: a file, or ``path::name`` (one top-level definition of it); None
    where there is no such file. ``read(path)`` returns a file's text or None (default: this checkout)."""
    path, _, name = entry.partition("::")
    if read is None:
        file = ROOT / path
        text = file.read_text() if file.exists() else None
    else:
        text = read(path)
    if not name or text is None:
        return text
    for node in ast.parse(text).body:
        if getattr(node, "name", None) == name:
            return ast.get_source_segment(text, node) or ""
    return None


def code_of(text: Optional[str]) -> Optional[str]:
    """``text``'s code without comments or docstrings (the module's, classes' and functions'), as
    ``ast.unparse`` writes it: what a form's fingerprint hashes, so that only code changes count. Text
    that does not parse as Python is taken whole."""
    if text is None:
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def digest(text: Optional[str]) -> Optional[str]:
    """sha256 of ``text`` (None for None)."""
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def fingerprint_of(sources: dict[str, Optional[str]], blocks: Iterable[tuple[str, Any]]) -> str:
    """The fingerprint of a form made of ``sources`` (entry -> sha256 of its code) run with ``blocks``."""
    canonical = json.dumps({"sources": dict(sorted(sources.items())), "blocks": dict(sorted(dict(blocks).items()))},
                           sort_keys=True)
    return digest(canonical)[:16]


def source_digests(form: Form, read=None) -> dict[str, Optional[str]]:
    """sha256 of the code (:func:`code_of`) of each of ``form``'s sources as ``read`` (default: this
    checkout) gives them."""
    return {entry: digest(code_of(source_text(entry, read))) for entry in form.sources}


def fingerprint(name: str, read=None) -> str:
    """The fingerprint of form ``name`` as its code is now (or as ``read`` gives it)."""
    form = FORMS[name]
    return fingerprint_of(source_digests(form, read), form.blocks)


def load_record(path: Optional[pathlib.Path] = None) -> dict:
    """The validation record: {"forms": {name: [validation, ...]}}; none when there is no file. Default:
    the file ``$JAXRAT_GPU_RECORD`` names (a validation session's output, before it is committed), else
    the package's :data:`RECORD`."""
    path = pathlib.Path(path or os.environ.get("JAXRAT_GPU_RECORD") or RECORD)
    if not path.exists():
        return {"forms": {}}
    return json.loads(path.read_text())


def parity_failure(run: dict) -> Optional[str]:
    """Why one validation's parity figures do not pass (one sentence), or None when they do: at least one
    figure, every one a finite number; float32 ones (relative to the portable form, forward and every
    gradient) within :data:`F32_TOLERANCE`; bfloat16 ones (relative to float32) at most 1.5 times the
    largest of the portable form's own bfloat16 errors (``reference_bf16``) where those are recorded,
    else within :data:`BF16_TOLERANCE`."""
    groups = {key: dict(run.get(key) or {}) for key in ("parity_f32", "parity_bf16", "reference_bf16")}
    for key, figures in groups.items():
        bad = [k for k, x in figures.items() if not (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0)]
        if bad:
            return f"{key} figures {bad} are not finite non-negative numbers"
    f32, bf16, ref = (list(groups[k].values()) for k in ("parity_f32", "parity_bf16", "reference_bf16"))
    if not f32 and not bf16:
        return "no parity figure was measured"
    if f32 and max(f32) > F32_TOLERANCE:
        return f"float32 error {max(f32):.2e} exceeds {F32_TOLERANCE:.0e} against the portable form"
    if bf16 and ref and max(bf16) > 1.5 * max(ref):
        return f"bfloat16 error {max(bf16):.2e} exceeds 1.5 x the portable form's own ({max(ref):.2e})"
    if bf16 and not ref and max(bf16) > BF16_TOLERANCE:
        return f"bfloat16 error {max(bf16):.2e} exceeds {BF16_TOLERANCE:.0e} against float32"
    return None


def passes(run: dict) -> bool:
    """Whether one validation's parity figures pass (:func:`parity_failure`)."""
    return parity_failure(run) is None


def validated(record: Optional[dict] = None, fingerprints: Optional[dict[str, str]] = None) -> frozenset:
    """The forms whose current fingerprint (``fingerprints``: name -> fingerprint, default computed from
    this checkout) has a passing validation in ``record`` (default: :func:`load_record`)."""
    record = load_record() if record is None else record
    out = set()
    for name, runs in record.get("forms", {}).items():
        if name not in FORMS:
            continue
        now = fingerprints[name] if fingerprints is not None else fingerprint(name)
        if any(run.get("fingerprint") == now and passes(run) for run in runs):
            out.add(name)
    return frozenset(out)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which fused forms a gpu run uses (``used``) and which it holds back (``held_back``: candidates of
    the experimental set it does not use), and why (``requested``)."""

    used: frozenset
    held_back: frozenset
    requested: str

    def line(self) -> str:
        """The one log line a run prints."""
        used = ", ".join(sorted(self.used)) or "none (portable forms)"
        held = ", ".join(sorted(self.held_back)) or "none"
        return (f"GPU forms ({self.requested}): using {used}; held back (not validated on a GPU for this "
                f"code; model.gpu_forms=all or a list of names runs them): {held}")


def parse_request(request: "str | Iterable[str]") -> "str | tuple[str, ...]":
    """``model.gpu_forms`` as given: "validated", "all", or names (a list, or one string of names
    separated by commas), checked."""
    if isinstance(request, str):
        if request in SELECTIONS:
            return request
        request = [n.strip() for n in request.split(",") if n.strip()]
    names = tuple(request)
    unknown = [n for n in names if n not in FORMS]
    if unknown:
        raise ValueError(f"model.gpu_forms names unknown forms {unknown}; use 'validated', 'all' or names among "
                         f"{sorted(FORMS)}")
    return names


def select(request: "str | Iterable[str]" = "validated", valid: Optional[frozenset] = None) -> Selection:
    """The fused forms a gpu run uses: per operation, a form named in ``request`` (newest first when
    several are), else with "all" the experimental set's, else the newest validated one (``valid``,
    default :func:`validated`), else none (the portable form). A form whose ``requires`` are not met
    is not used."""
    parsed = parse_request(request)
    valid = validated() if valid is None else valid
    experimental = candidates()
    named = set(parsed) if isinstance(parsed, tuple) else set()
    chosen: dict[str, str] = {}
    for f in _FORMS:  # per operation, newest first
        if f.operation in chosen:
            continue
        if f.name in named or (parsed == "all" and f.name in experimental):
            chosen[f.operation] = f.name
    for f in _FORMS:
        if f.operation not in chosen and f.name in valid:
            chosen[f.operation] = f.name
    used = {n for n in chosen.values() if all(op in chosen for op in FORMS[n].requires)}
    label = parsed if isinstance(parsed, str) else ",".join(parsed)
    return Selection(frozenset(used), frozenset(experimental - used), label)
