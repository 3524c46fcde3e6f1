"""One typed description of a RAT: :class:`RATConfig`, built once from ``config.model.rat``.

Every constructor argument of the PyTorch reference's ``ResolutionAwareTransformer`` is a field
with the reference's name and default (docs/reference.md), except ``sga_attention_type``, which is
``attention`` here because its values differ: the reference's only working form is "dense"
(anything else selects its broken sparse class), ours are listed below. jaxrat's own options
follow. The same field names are the config keys (``--config.model.rat.<field>``) in every config
that builds a RAT, and the layers take the whole config rather than a relay of arguments.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Mapping, Optional, Sequence

import ml_collections as mlc
from ml_collections import config_dict

SGA_TYPES = ("dense", "sparse", "standard", "mixed")
BLOCK_SGA_TYPES = ("dense", "sparse", "standard")
MR_ATTENTION_TYPES = ("global", "windowed")
REMAT_TYPES = ("none", "blocks")
POSITIONAL_ENCODINGS = ("rose", "rope", "absolute", "none")
PYRAMID_SPACINGS = ("relative", "unit")


def as_tuple(value: Any, n: int, cast=None) -> tuple:
    """Broadcast a scalar to an n-tuple, or check a sequence has length n."""
    if isinstance(value, (int, float, str)) or value is None:
        out = (value,) * n
    else:
        out = tuple(value)
        if len(out) != n:
            raise ValueError(f"expected {n} values, got {value!r}")
    return tuple(cast(v) for v in out) if cast else out


def _is_int(value: Any) -> bool:
    """An integer, or a float that is one (a JSON or command-line 7.0 built the layers as 7)."""
    return _is_number(value) and float(value).is_integer()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_axes(name: str, value: Any, n: int, good: Callable[[Any], bool], what: str) -> None:
    """Refuse ``value`` unless it is one ``good`` value or ``n`` of them (one per spatial axis)."""
    try:
        ok = all(good(v) for v in as_tuple(value, n))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be {what} or {n} of them (one per axis), got {value!r}")


def _check_ints(name: str, value: Any, n: int, least: int, also: str = "") -> None:
    """Refuse ``value`` unless it is an integer >= ``least`` or ``n`` of them."""
    _check_axes(name, value, n, lambda v: _is_int(v) and v >= least,
                f"{also}, an integer >= {least}" if also else f"an integer >= {least}")


def _frozen(value: Any) -> Any:
    """Lists (as ml_collections and JSON give them) to tuples, so the config stays hashable."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class RATConfig:
    """A Resolution Aware Transformer, whole.

    Reference arguments (names and defaults as the reference's constructor):
      spatial_dims: 1, 2 or 3. input_features: image channels C.
      proj_kernel_size, proj_padding: the initial C -> D convolution ("same" padding).
      feature_dims: D. num_blocks: SGA + multi-resolution blocks. num_heads: H.
      sga_kernel_size, stride: the SGA layers' strided convolution (stride None: max(1, k // 2)).
      iters: grouping iterations per SGA layer.
      mlp_ratio, mlp_dropout, mlp_bias, qkv_bias: transformer MLP and projections.
      base_theta, frequency_scaling, init_jitter_std, rotary_ratio: RoSE's frequencies, and the
        fraction of the features (whole heads) that is rotated.
      learnable_rose, learnable_rose_scaling, rose_initial_scaling: RoSE's trainable frequencies and
        spacing transform, and the transform's initial mode ("log", "rope", "index" (ours: grid-index
        coordinates, what the reference's "rope" means to be), "identity", "linear", "power").
      leading_tokens: learned tokens prepended to every multi-resolution block (unused by the
        reference, flaw 11; used here, e.g. as a class token).
      spacing: default input spacing (None: 1.0 per axis).

    jaxrat's options:
      attention: the SGA form, "dense" (the reference), "sparse" (each group sees its convolution
        window: linear in pixels), "standard" (plain cross-attention, an ablation), "mixed" (sparse
        in the first half of the blocks, dense after), or one of dense/sparse/standard per block.
      positional_encoding: "rose" (as configured above), "rope" (RoSE on grid-index coordinates:
        the transform starts as "index"), "absolute" (a learned absolute table on
        ``absolute_pos_grid``, resized to every scale, and no rotation), "none" (no position).
      absolute_pos_grid: the absolute table's grid (used with ``positional_encoding="absolute"``).
      mr_attention, mr_window: the multi-resolution blocks' attention, "global" (the reference:
        quadratic in pixels) or "windowed" (grids wider than ``mr_window`` tokens attend in tiles
        plus the small grids: linear).
      remat: "none" or "blocks" (recompute every SGA layer and MR block in the backward pass).
      scales, pyramid_spacing: the image pyramid the task models build from one input (empty: a
        single image; e.g. (256, 128, 64): level i is the input resized by scales[i] / scales[0])
        and its spacing, "relative" (the physical pixel size scales[0] / scales[i]) or "unit"
        (spacing 1 at every level, as the reference's experiments).
      reference_compat: the reference's value-head reshaping in SGA (flaw 1) and unused leading
        tokens (flaw 11), to reproduce its outputs exactly.
    """

    spatial_dims: int = 2
    input_features: int = 3
    proj_kernel_size: Any = 7
    proj_padding: Any = "same"
    feature_dims: int = 128
    num_blocks: int = 4
    attention: Any = "dense"
    sga_kernel_size: Any = 7
    stride: Any = None
    num_heads: int = 16
    iters: int = 3
    mlp_ratio: float = 4.0
    mlp_dropout: float = 0.0
    mlp_bias: bool = True
    qkv_bias: bool = True
    base_theta: float = 1e4
    learnable_rose: bool = True
    learnable_rose_scaling: bool = True
    rose_initial_scaling: Optional[str] = "log"
    init_jitter_std: float = 0.02
    rotary_ratio: float = 0.5
    frequency_scaling: str = "sqrt"
    leading_tokens: int = 0
    spacing: Any = None
    positional_encoding: str = "rose"
    absolute_pos_grid: Any = (32, 32)
    mr_attention: str = "global"
    mr_window: int = 16
    remat: str = "none"
    scales: Any = ()
    pyramid_spacing: str = "relative"
    reference_compat: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _frozen(getattr(self, f.name)))
        if self.spatial_dims not in (1, 2, 3):
            raise ValueError(f"spatial_dims must be 1, 2 or 3, got {self.spatial_dims}")
        if self.iters < 0:
            raise ValueError(f"iters must be >= 0, got {self.iters}")
        for name, allowed in (("mr_attention", MR_ATTENTION_TYPES), ("remat", REMAT_TYPES),
                              ("positional_encoding", POSITIONAL_ENCODINGS), ("pyramid_spacing", PYRAMID_SPACINGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.mr_window < 1:
            raise ValueError(f"mr_window must be >= 1, got {self.mr_window}")
        self._check_sizes()
        self.block_attention()  # validates ``attention``

    def _check_sizes(self) -> None:
        """Refuse sizes the layers cannot build or run (a kernel of 0, a stride of -1, a scale of 0):
        each ended in a traceback from inside JAX, or later, in the first step."""
        sd = self.spatial_dims
        for name, least in (("input_features", 1), ("feature_dims", 1), ("num_blocks", 1), ("num_heads", 1),
                            ("leading_tokens", 0)):
            if not _is_int(getattr(self, name)) or getattr(self, name) < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {getattr(self, name)!r}")
        if self.feature_dims % self.num_heads:
            raise ValueError(f"feature_dims={self.feature_dims} must be a multiple of num_heads={self.num_heads}")
        if not 0.0 <= self.rotary_ratio <= 1.0:
            raise ValueError(f"rotary_ratio must be between 0 and 1, got {self.rotary_ratio!r}")
        if not self.mlp_ratio > 0 or not 0.0 <= self.mlp_dropout < 1.0:
            raise ValueError(f"mlp_ratio must be > 0 and mlp_dropout in [0, 1), got {self.mlp_ratio!r} and "
                             f"{self.mlp_dropout!r}")
        _check_ints("proj_kernel_size", self.proj_kernel_size, sd, 1)
        if self.proj_padding != "same":
            _check_ints("proj_padding", self.proj_padding, sd, 0, also='"same"')
        _check_ints("sga_kernel_size", self.sga_kernel_size, sd, 1)
        if self.stride is not None:
            _check_ints("stride", self.stride, sd, 1, also="None (half the kernel)")
        if self.positional_encoding == "absolute":
            _check_ints("absolute_pos_grid", self.absolute_pos_grid, sd, 1)
        if self.spacing is not None:
            _check_axes("spacing", self.spacing, sd, lambda v: _is_number(v) and v > 0, "None, a number > 0")
        if self.scales is not None and (not isinstance(self.scales, tuple)
                                        or not all(_is_int(v) and v >= 1 for v in self.scales)):
            raise ValueError(f"scales must be () or image sizes >= 1 (e.g. (256, 128, 64)), got {self.scales!r}")

    def block_attention(self) -> tuple[str, ...]:
        """Per-block SGA form; "mixed" = sparse for the first ceil(n/2) (large-grid) blocks, then dense."""
        a, n = self.attention, self.num_blocks
        if isinstance(a, str):
            if a == "mixed":
                n_sparse = (n + 1) // 2
                return ("sparse",) * n_sparse + ("dense",) * (n - n_sparse)
            if a not in SGA_TYPES:
                raise ValueError(f"attention must be one of {SGA_TYPES} or one form per block, got {a!r}")
            return (a,) * n
        if not isinstance(a, tuple):
            raise ValueError(f"attention must be one of {SGA_TYPES} or one form per block, got {a!r}")
        if len(a) != n or any(t not in BLOCK_SGA_TYPES for t in a):
            raise ValueError(f"a per-block attention needs {n} of {BLOCK_SGA_TYPES}, got {a}")
        return tuple(a)

    @property
    def rotary(self) -> float:
        """The rotated fraction after the positional encoding: none for "absolute" and "none"."""
        return 0.0 if self.positional_encoding in ("absolute", "none") else float(self.rotary_ratio)

    @property
    def rose_scaling(self) -> Optional[str]:
        """RoSE's initial spacing transform after the positional encoding ("index" for "rope")."""
        return "index" if self.positional_encoding == "rope" else self.rose_initial_scaling

    @property
    def absolute_grid(self) -> Optional[tuple[int, ...]]:
        """The absolute position table's grid, or None without one."""
        if self.positional_encoding != "absolute":
            return None
        return as_tuple(self.absolute_pos_grid, self.spatial_dims, int)

    def replace(self, **changes: Any) -> "RATConfig":
        """A copy with ``changes`` (unknown names refused as in :meth:`from_mapping`)."""
        return RATConfig.from_mapping({**dataclasses.asdict(self), **changes})

    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any], where: str = "RAT option") -> "RATConfig":
        """Build from a mapping (``config.model.rat``, a JSON of reference arguments); an unknown
        name is a ValueError naming the closest valid one. The reference's ``sga_attention_type``
        is accepted as ``attention``."""
        fields = dict(fields)
        if "sga_attention_type" in fields:
            if "attention" in fields and fields["attention"] != fields["sga_attention_type"]:
                raise ValueError("sga_attention_type and attention disagree; give attention only")
            fields["attention"] = fields.pop("sga_attention_type")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in fields:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"did you mean {close[0]}?" if close else f"valid ones: {', '.join(names)}."
                raise ValueError(f"unknown {where} {key!r}; {hint}")
        return cls(**fields)


# ml_collections needs a type for a field whose default is None or whose value may be a scalar or a
# sequence, so that the command line can set it.
_ANY_TYPE = ("proj_kernel_size", "proj_padding", "attention", "sga_kernel_size", "stride", "spacing",
             "rose_initial_scaling", "absolute_pos_grid", "scales")


def rat_config(**fields: Any) -> mlc.ConfigDict:
    """``config.model.rat`` for a config file: every :class:`RATConfig` field, its default unless
    given, so that each can be overridden from the command line and a misspelt one is refused."""
    cfg = dataclasses.asdict(RATConfig.from_mapping(fields))
    out = mlc.ConfigDict()
    for name, value in cfg.items():
        out[name] = config_dict.FieldReference(value, field_type=object) if name in _ANY_TYPE else value
    return out


def field_names() -> Sequence[str]:
    """Every RAT option's name."""
    return [f.name for f in dataclasses.fields(RATConfig)]
