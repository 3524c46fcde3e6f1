"""DETR-family detector over multi-scale tokens (``config.model.name = "detr"``).

``model(images, pad_mask)`` takes a letterboxed batch (B, S, S, C) and its pad mask (B, S, S), > 0
where the canvas is padding, and returns ``(logits, boxes)`` stacked over decoder layers, the final
layer last: ``(L, B, Q, num_classes + 1)`` (last = no object; ``num_classes`` with ``focal``) and
``(L, B, Q, 4)`` sigmoid ``(cx, cy, w, h)`` normalised to the canvas. Earlier layers feed the
auxiliary losses.

The memory the queries attend to is every backbone stage's tokens (RAT's ``return_features``: the
initial projection and every block; or a small strided CNN for fast smoke tests), each token with a
sine embedding of its normalised grid position plus a learned level embedding, so queries know
where a token lies whatever the stage's resolution. Tokens wholly in the padding are left out of
the cross-attention, so the letterbox cannot attract queries.

``box_refine`` (DAB-DETR's anchors with Deformable DETR's iterative refinement): every query owns a
learned anchor box; its positional query is an MLP of the anchor's sine embedding, each layer
predicts a correction in logit space and the corrected (gradient-stopped) box is the next layer's
anchor. The box head's last layer starts at zero, so the first predictions are the anchors, spread
over the canvas, instead of DETR's every-box-at-the-centre start; on small data this converges many
times faster (``docs/tasks.md``, detection). With ``query_level`` too the queries are the tokens of
one backbone stage (as two-stage Deformable DETR does with its proposals): each cell's projected
feature is the query's content and the cell's centre its anchor, so a query already knows what lies
where it starts and the class and box heads learn at once; ``num_queries`` is then that stage's
cell count.

``head="reference"`` is the PyTorch reference's head instead (``docs/reference.md``, "Heads, losses and
metrics"): the final
stage's tokens only, one multi-head cross-attention from learned queries without positions, residual,
norm or FFN, then a linear class head and a linear + sigmoid box head; kept for comparison.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat import ops
from jaxrat.models import register
from jaxrat.models.layers import layer_norm, linear
from jaxrat.models.rat.segmenter import rat_from_config
from jaxrat.ops import attention as attn
from jaxrat.ops import projections
from jaxrat.runtime.errors import ConfigError

Array = jax.Array
BACKBONES = ("rat", "cnn")
HEADS = ("detr", "reference")


def sine_positions(grid: Sequence[int], dim: int, temperature: float = 1e4) -> Array:
    """(h*w, dim) DETR sine embedding of cell centres in [0, 1]; half the channels for y, half for x."""
    h, w = grid
    ys = (jnp.arange(h, dtype=jnp.float32) + 0.5) / h
    xs = (jnp.arange(w, dtype=jnp.float32) + 0.5) / w
    n = dim // 4
    freqs = temperature ** (-jnp.arange(n, dtype=jnp.float32) / max(n, 1)) * 2 * jnp.pi

    def embed(v: Array) -> Array:
        a = v[:, None] * freqs
        return jnp.concatenate([jnp.sin(a), jnp.cos(a)], -1)

    ey, ex = embed(ys), embed(xs)
    pos = jnp.concatenate([jnp.repeat(ey[:, None], w, 1), jnp.repeat(ex[None], h, 0)], -1).reshape(h * w, -1)
    return jnp.pad(pos, ((0, 0), (0, dim - pos.shape[-1])))


def box_sine(boxes: Array, dim: int, temperature: float = 1e4) -> Array:
    """(..., 4) boxes in [0, 1] -> (..., dim) sine embedding, a quarter of the channels per coordinate."""
    n = dim // 8
    freqs = temperature ** (-jnp.arange(n, dtype=jnp.float32) / max(n, 1)) * 2 * jnp.pi
    a = boxes.astype(jnp.float32)[..., None] * freqs  # (..., 4, n)
    emb = jnp.concatenate([jnp.sin(a), jnp.cos(a)], -1).reshape(*boxes.shape[:-1], -1)
    return jnp.pad(emb, [(0, 0)] * (emb.ndim - 1) + [(0, dim - emb.shape[-1])])


def sine_grid_centres(h: int, w: int) -> Array:
    """(h*w, 2) normalised (x, y) centres of a grid's cells, row-major like the tokens."""
    ys, xs = (jnp.arange(h, dtype=jnp.float32) + 0.5) / h, (jnp.arange(w, dtype=jnp.float32) + 0.5) / w
    return jnp.stack([jnp.tile(xs, h), jnp.repeat(ys, w)], -1)


def inverse_sigmoid(x: Array, eps: float = 1e-5) -> Array:
    x = jnp.clip(x, eps, 1.0 - eps)
    return jnp.log(x / (1.0 - x))


class Attention(nnx.Module):
    """Multi-head attention with separate query, key and value inputs and a key padding mask."""

    def __init__(self, dim: int, num_heads: int, *, dtype: Any, rngs: nnx.Rngs, init: str = "xavier",
                 kernels: ops.KernelPolicy) -> None:
        if dim % num_heads:
            raise ConfigError(f"model.hidden_dim={dim} must divide by model.decoder_heads={num_heads}.")
        self.num_heads = num_heads
        self.kernels = kernels
        self.q, self.k, self.v, self.o = (linear(dim, dim, dtype=dtype, rngs=rngs, init=init) for _ in range(4))

    def __call__(self, q: Array, k: Array, v: Array, key_ok: Optional[Array | attn.KeyPadding] = None) -> Array:
        b, nq, d = q.shape
        h = self.num_heads

        def split(x: Array) -> Array:
            return x.reshape(b, x.shape[1], h, d // h)

        return self.attend(q, self.k(k), self.v(v), key_ok)

    def attend(self, q: Array, k: Array, v: Array, key_ok: Optional[Array | attn.KeyPadding] = None) -> Array:
        """:meth:`__call__` with keys and values already projected (by this module's ``k`` and ``v``)."""
        b, nq, d = q.shape
        h = self.num_heads

        def split(x: Array) -> Array:
            return x.reshape(b, x.shape[1], h, d // h)

        out = attn.masked_attention(split(self.q(q)), split(k), split(v), key_ok, self.kernels)
        return self.o(out.reshape(b, nq, d))


class DecoderLayer(nnx.Module):
    """DETR's post-norm layer: query self-attention, cross-attention over the memory, FFN."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, dropout: float, *, dtype: Any, rngs: nnx.Rngs,
                 kernels: ops.KernelPolicy) -> None:
        self.self_attn = Attention(dim, num_heads, dtype=dtype, rngs=rngs, kernels=kernels)
        self.cross_attn = Attention(dim, num_heads, dtype=dtype, rngs=rngs, kernels=kernels)
        self.fc1 = linear(dim, ffn_dim, dtype=dtype, rngs=rngs, init="xavier")
        self.fc2 = linear(ffn_dim, dim, dtype=dtype, rngs=rngs, init="xavier")
        self.norm1 = layer_norm(dim, 1e-5, dtype=dtype, rngs=rngs)
        self.norm2 = layer_norm(dim, 1e-5, dtype=dtype, rngs=rngs)
        self.norm3 = layer_norm(dim, 1e-5, dtype=dtype, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, tgt: Array, query_pos: Array, keys: Array, values: Array,
                 key_ok: Array | attn.KeyPadding) -> Array:
        """``keys`` and ``values``: the memory (plus its positions, for the keys) projected by this
        layer's cross-attention (:func:`cross_projections`)."""
        q = tgt + query_pos
        tgt = self.norm1(tgt + self.drop(self.self_attn(q, q, tgt)))
        tgt = self.norm2(tgt + self.drop(self.cross_attn.attend(tgt + query_pos, keys, values, key_ok)))
        return self.norm3(tgt + self.drop(self.fc2(self.drop(jax.nn.relu(self.fc1(tgt))))))


def cross_projections(layers: Sequence[DecoderLayer], memory: Array, memory_pos: Array) -> list[tuple[Array, Array]]:
    """Each layer's cross-attention keys and values of the memory, its own products, their gradients
    taken as one product over every layer's weights (:mod:`jaxrat.ops.projections`)."""
    def project(x: Array, mods: list) -> list[Array]:
        return projections.shared_input_projections(x, [m.kernel[...] for m in mods], [m.bias[...] for m in mods],
                                                    dtype=mods[0].dtype, precision=mods[0].precision)

    keys = project(memory + memory_pos, [layer.cross_attn.k for layer in layers])
    return list(zip(keys, project(memory, [layer.cross_attn.v for layer in layers])))


class CNNBackbone(nnx.Module):
    """Stride-2 conv stages, each conv-GroupNorm-GELU then a residual conv-GroupNorm-GELU (for smoke
    tests and quick demos); every stage's tokens and grid. GroupNorm keeps it free of batch statistics."""

    def __init__(self, in_channels: int, widths: Sequence[int], *, dtype: Any, rngs: nnx.Rngs) -> None:
        chans = (in_channels, *widths)

        def norm(c: int) -> nnx.GroupNorm:
            return nnx.GroupNorm(c, num_groups=min(8, c), dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

        def conv(a: int, b: int, stride: int) -> nnx.Conv:
            return nnx.Conv(a, b, (3, 3), strides=stride, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

        self.down = nnx.List([conv(a, b, 2) for a, b in zip(chans[:-1], chans[1:])])
        self.refine = nnx.List([conv(b, b, 1) for b in widths])
        self.norm1 = nnx.List([norm(b) for b in widths])
        self.norm2 = nnx.List([norm(b) for b in widths])
        self.widths = tuple(widths)

    def __call__(self, images: Array, pad_mask: Array) -> list[tuple[Array, tuple[int, int]]]:
        x, out = images, []
        for down, refine, n1, n2 in zip(self.down, self.refine, self.norm1, self.norm2):
            x = jax.nn.gelu(n1(down(x)))
            x = x + jax.nn.gelu(n2(refine(x)))
            out.append((x.reshape(x.shape[0], -1, x.shape[-1]), tuple(x.shape[1:3])))
        return out


class DETR(nnx.Module):
    """Backbone + DETR transformer decoder; see the module docstring.

    Args:
      num_classes: object classes (the task sets it from the data); a no-object logit is added
        unless ``focal``.
      backbone: "rat" (the RAT in ``rat``: ``config.model.rat``, :class:`jaxrat.models.rat.RATConfig`)
        or "cnn" (``cnn_widths``).
      hidden_dim, num_queries, decoder_layers, decoder_heads, ffn_dim, dropout: the decoder.
      feature_levels: which backbone stages (0 = the first) the queries attend to; None = all.
        The first RAT stage is at full resolution: leave it out for large canvases.
      focal: sigmoid class logits (no no-object class) for the focal loss.
      box_refine: learned anchor boxes and layer-by-layer refinement (module docstring).
      query_level: with ``box_refine``, the backbone stage (one of ``feature_levels``) whose tokens
        are the queries; None = ``num_queries`` learned queries.
      head: "detr" (the decoder) or "reference" (the PyTorch reference's single attention layer over
        the final stage; ``hidden_dim``, ``decoder_layers``, ``ffn_dim``, ``feature_levels`` and
        ``box_refine`` are then unused).
      kernels: the kernel policy of the RAT backbone (:mod:`jaxrat.ops.policy`).
    """

    def __init__(self, *, num_classes: int, in_channels: int = 3, backbone: str = "rat", rat: Any = None,
                 cnn_widths: Sequence[int] = (32, 64, 128), hidden_dim: int = 128, num_queries: int = 100,
                 decoder_layers: int = 6, decoder_heads: int = 8, ffn_dim: int = 512, dropout: float = 0.0,
                 feature_levels: Optional[Sequence[int]] = None, focal: bool = False, box_refine: bool = False,
                 query_level: Optional[int] = None, head: str = "detr", kernels: ops.KernelPolicy,
                 dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        if backbone not in BACKBONES:
            raise ConfigError(f"model.backbone must be one of {BACKBONES}, got {backbone!r}.")
        if head not in HEADS:
            raise ConfigError(f"model.head must be one of {HEADS}, got {head!r}.")
        if backbone == "rat":
            self.backbone = rat_from_config(rat, kernels=kernels, dtype=dtype, rngs=rngs, input_features=in_channels)
            dims = [self.backbone.feature_dims] * (self.backbone.num_blocks + 1)
        else:
            self.backbone = CNNBackbone(in_channels, cnn_widths, dtype=dtype, rngs=rngs)
            dims = list(cnn_widths)
        self.head, self.box_refine, self.dtype, self.kernels = head, bool(box_refine), dtype, kernels
        n_out = num_classes + (0 if focal else 1)
        if head == "reference":
            d = dims[-1]
            self.levels = (len(dims) - 1,)
            self.query_embed = nnx.Param(jax.random.normal(rngs.params(), (num_queries, d)))
            self.ref_attn = Attention(d, decoder_heads, dtype=dtype, rngs=rngs, init="torch", kernels=kernels)
            self.class_head = linear(d, n_out, dtype=dtype, rngs=rngs, init="torch")
            self.box_head = linear(d, 4, dtype=dtype, rngs=rngs, init="torch")
            return
        self.levels = tuple(range(len(dims))) if feature_levels is None else tuple(int(i) for i in feature_levels)
        if not self.levels or any(not 0 <= i < len(dims) for i in self.levels):
            raise ConfigError(f"model.feature_levels={feature_levels} must name backbone stages 0..{len(dims) - 1}.")
        self.proj = nnx.List([linear(dims[i], hidden_dim, dtype=dtype, rngs=rngs, init="xavier") for i in self.levels])
        self.level_embed = nnx.Param(jax.random.normal(rngs.params(), (len(self.levels), hidden_dim)) * 0.02)
        self.query_level = None if query_level is None else int(query_level)
        if self.query_level is not None:
            if not box_refine or self.query_level not in self.levels:
                raise ConfigError(f"model.query_level={query_level} needs model.box_refine=True and must be one of "
                                  f"model.feature_levels={self.levels}.")
            self.query_norm = layer_norm(hidden_dim, 1e-5, dtype=dtype, rngs=rngs)
            self.anchor_size = nnx.Param(jnp.full((2,), math.log(0.2 / 0.8), jnp.float32))  # sigmoid = 0.2
        if self.box_refine and self.query_level is None:
            # Anchors spread uniformly over the canvas, a fifth of it wide (in logit space).
            key_c, key_s = jax.random.split(rngs.params())
            centres = jax.random.uniform(key_c, (num_queries, 2), minval=0.05, maxval=0.95)
            sizes = jnp.full((num_queries, 2), 0.2) * jnp.exp(0.3 * jax.random.normal(key_s, (num_queries, 2)))
            self.anchors = nnx.Param(inverse_sigmoid(jnp.concatenate([centres, sizes], -1)))
        if self.box_refine:
            self.anchor_pos = nnx.List([linear(hidden_dim, hidden_dim, dtype=dtype, rngs=rngs, init="xavier"),
                                        linear(hidden_dim, hidden_dim, dtype=dtype, rngs=rngs, init="xavier")])
        if not self.box_refine:
            self.query_embed = nnx.Param(jax.random.normal(rngs.params(), (num_queries, hidden_dim)))
        self.layers = nnx.List([DecoderLayer(hidden_dim, decoder_heads, ffn_dim, dropout, dtype=dtype, rngs=rngs,
                                             kernels=kernels) for _ in range(decoder_layers)])
        self.out_norm = layer_norm(hidden_dim, 1e-5, dtype=dtype, rngs=rngs)
        self.class_head = linear(hidden_dim, n_out, dtype=dtype, rngs=rngs, init="xavier")
        self.box_mlp = nnx.List([linear(hidden_dim, hidden_dim, dtype=dtype, rngs=rngs, init="xavier"),
                                 linear(hidden_dim, hidden_dim, dtype=dtype, rngs=rngs, init="xavier"),
                                 linear(hidden_dim, 4, dtype=dtype, rngs=rngs, init="xavier")])
        if self.box_refine:  # first predictions = the anchors
            self.box_mlp[-1].kernel[...] = jnp.zeros_like(self.box_mlp[-1].kernel[...])
        if focal:  # prior probability 0.01 per class, as RetinaNet/Deformable DETR: stable early focal loss
            self.class_head.bias[...] = jnp.full(self.class_head.bias.shape, -4.595, jnp.float32)

    def memory(self, images: Array, pad_mask: Array) -> tuple[Array, Array, Array, dict]:
        """Projected tokens of the chosen stages, their position embeddings, which are not padding, and
        {stage: (projected tokens, grid)}."""
        if isinstance(self.backbone, CNNBackbone):
            stages = self.backbone(images, pad_mask)
        else:
            out = self.backbone.features(images, pad_mask, return_features=True)[0]
            stages = list(zip(out.features, out.feature_grids))
        with jax.named_scope("head"):  # as the segmenter's head: the compiled HLO's ops say whose they are
            return self._projected(stages, pad_mask)

    def _projected(self, stages: list, pad_mask: Array) -> tuple[Array, Array, Array, dict]:
        content = (pad_mask <= 0).astype(jnp.float32)[..., None]
        tokens, pos, ok, by_stage = [], [], [], {}
        for j, i in enumerate(self.levels):
            t, grid = stages[i]
            tokens.append(t if self.head == "reference" else self.proj[j](t))
            by_stage[i] = (tokens[-1], grid)
            if self.head != "reference":
                pos.append(sine_positions(grid, self.level_embed.shape[-1]) + self.level_embed[j][None])
            # Area resize: a token whose cell holds any content stays visible.
            frac = jax.image.resize(content, (content.shape[0], *grid, 1), "linear", antialias=True)
            ok.append(frac.reshape(frac.shape[0], -1) > 1e-3)
        memory = jnp.concatenate(tokens, 1)
        if not pos:
            return memory, jnp.zeros_like(memory), jnp.concatenate(ok, 1), by_stage
        memory_pos = jnp.concatenate(pos, 0)[None].astype(memory.dtype)
        return memory, jnp.broadcast_to(memory_pos, memory.shape), jnp.concatenate(ok, 1), by_stage

    def _box_delta(self, h: Array) -> Array:
        x = h
        for k, fc in enumerate(self.box_mlp):
            x = fc(x) if k == len(self.box_mlp) - 1 else jax.nn.relu(fc(x))
        return x.astype(jnp.float32)

    def __call__(self, images: Array, pad_mask: Optional[Array] = None) -> tuple[Array, Array]:
        """(B, S, S, C) images, (B, S, S) pad mask -> stacked per-layer (logits, boxes); see the module docstring."""
        if pad_mask is None:
            pad_mask = jnp.zeros(images.shape[:3], jnp.float32)
        images = images.astype(self.dtype)
        memory, memory_pos, key_ok, by_stage = self.memory(images, pad_mask)
        with jax.named_scope("head"):
            return self._decode(memory, memory_pos, key_ok, by_stage, images.shape[0])

    def _decode(self, memory: Array, memory_pos: Array, key_ok: Array, by_stage: dict, b: int) -> tuple[Array, Array]:
        if self.head == "reference":
            queries = jnp.broadcast_to(self.query_embed[...].astype(memory.dtype)[None], (b, *self.query_embed.shape))
            h = self.ref_attn(queries, memory, memory, key_ok)
            boxes = jax.nn.sigmoid(self.box_head(h).astype(jnp.float32))
            return self.class_head(h).astype(jnp.float32)[None], boxes[None]
        if self.query_level is not None:
            tokens, (gh, gw) = by_stage[self.query_level]
            centres = sine_grid_centres(gh, gw)
            size = jnp.broadcast_to(jax.nn.sigmoid(self.anchor_size[...]), centres.shape)
            ref = jnp.broadcast_to(jnp.concatenate([centres, size], -1)[None], (b, gh * gw, 4))
            tgt = self.query_norm(tokens)
        elif self.box_refine:
            ref = jnp.broadcast_to(jax.nn.sigmoid(self.anchors[...])[None], (b, *self.anchors.shape))
            tgt = jnp.zeros((b, ref.shape[1], memory.shape[-1]), memory.dtype)
        else:
            query_pos = jnp.broadcast_to(self.query_embed[...].astype(memory.dtype)[None], (b, *self.query_embed.shape))
            tgt = jnp.zeros_like(query_pos)
        # every layer's keys and values are made token by token from these two: their padding resolved once
        padding, (memory, memory_pos) = attn.pack_keys(key_ok, (memory, memory_pos), self.kernels)
        logits, boxes = [], []
        for layer, (keys, values) in zip(self.layers, cross_projections(self.layers, memory, memory_pos)):
            if self.box_refine:
                query_pos = self.anchor_pos[1](jax.nn.relu(self.anchor_pos[0](box_sine(ref, tgt.shape[-1]).astype(
                    memory.dtype))))
            tgt = layer(tgt, query_pos, keys, values, padding)
            h = self.out_norm(tgt)
            logits.append(self.class_head(h))
            if self.box_refine:
                box = jax.nn.sigmoid(inverse_sigmoid(ref) + self._box_delta(h))
                ref = jax.lax.stop_gradient(box)
            else:
                box = jax.nn.sigmoid(self._box_delta(h))
            boxes.append(box)
        return jnp.stack(logits).astype(jnp.float32), jnp.stack(boxes)


@register("detr")
def detr(**kwargs: Any) -> DETR:
    """Factory for ``config.model.name = "detr"`` (fields as :class:`DETR`)."""
    return DETR(**kwargs)
