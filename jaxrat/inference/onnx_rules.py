"""The ONNX form of each jax primitive the portable models use: one rule per primitive (or family),
``(graph, equation, input values, **params) -> output value(s)``, registered in
:data:`jaxrat.inference.onnx_graph.RULES`. Values are numpy constants or tensor names; jax's elementwise
primitives take equal shapes or scalars, which ONNX broadcasting covers."""

from __future__ import annotations

import string
from typing import Any, Sequence

import numpy as np

from jaxrat.inference.onnx_graph import OPSET, RULES, Graph, Rule, Unsupported, onnx_type, placed_shape, rule


def _simple(prim: str, op: str) -> None:
    RULES[prim] = lambda g, eqn, ins, **_: g.op(op, *ins)


for _prim, _op in {"add": "Add", "add_any": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max",
                   "min": "Min", "pow": "Pow", "neg": "Neg", "abs": "Abs", "exp": "Exp", "log": "Log", "sin": "Sin",
                   "cos": "Cos", "tanh": "Tanh", "sqrt": "Sqrt", "logistic": "Sigmoid", "sign": "Sign",
                   "floor": "Floor", "ceil": "Ceil", "eq": "Equal", "gt": "Greater", "ge": "GreaterOrEqual",
                   "lt": "Less", "le": "LessOrEqual", "erf": "Erf"}.items():
    _simple(_prim, _op)


@rule("and", "or", "xor", "not")
def _logical(g: Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    if eqn.outvars[0].aval.dtype != np.bool_:
        raise Unsupported(f"the bitwise {eqn.primitive} on {eqn.outvars[0].aval.dtype} (ONNX opset {OPSET} has "
                          f"logical ones only)")
    return g.op(str(eqn.primitive).capitalize(), *ins)


@rule("ne")
def _ne(g: Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    return g.op("Not", g.op("Equal", *ins))


@rule("square")
def _square(g: Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    return g.op("Mul", ins[0], ins[0])


@rule("rsqrt")
def _rsqrt(g: Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    return g.op("Reciprocal", g.op("Sqrt", ins[0]))


@rule("erfc")
def _erfc(g: Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    return g.op("Sub", np.array(1, eqn.outvars[0].aval.dtype), g.op("Erf", ins[0]))


@rule("is_finite")
def _is_finite(g: Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    return g.op("Not", g.op("Or", g.op("IsInf", ins[0]), g.op("IsNaN", ins[0])))


@rule("rem")
def _rem(g: Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    return g.op("Mod", *ins, fmod=1)  # C's remainder (sign of the dividend), as lax.rem


@rule("integer_pow")
def _integer_pow(g: Graph, eqn: Any, ins: list[Any], *, y: int, **_: Any) -> Any:
    x, n, dtype = ins[0], abs(int(y)), eqn.outvars[0].aval.dtype
    if n == 0:
        return g.op("Add", g.op("Mul", x, np.array(0, dtype)), np.array(1, dtype))
    out = x
    for _ in range(n - 1):
        out = g.op("Mul", out, x)
    return g.op("Reciprocal", out) if y < 0 else out


@rule("clamp")
def _clamp(g: Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    lo, x, hi = ins
    return g.op("Min", g.op("Max", x, lo), hi)


@rule("select_n")
def _select_n(g: Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    pred, cases = ins[0], ins[1:]
    if len(cases) == 1:
        return cases[0]
    if eqn.invars[0].aval.dtype == np.bool_:
        return g.op("Where", pred, cases[1], cases[0])
    out = cases[0]
    for k in range(1, len(cases)):
        out = g.op("Where", g.op("Equal", pred, np.array(k, eqn.invars[0].aval.dtype)), cases[k], out)
    return out


@rule("convert_element_type")
def _convert(g: Graph, eqn: Any, ins: list[Any], *, new_dtype: Any, **_: Any) -> Any:
    if np.dtype(new_dtype) == np.dtype(eqn.invars[0].aval.dtype):
        return ins[0]
    return g.op("Cast", ins[0], to=onnx_type(new_dtype))


@rule("reduce_precision")
def _reduce_precision(g: Graph, eqn: Any, ins: list[Any], *, exponent_bits: int, mantissa_bits: int) -> Any:
    if (exponent_bits, mantissa_bits) != (8, 23):
        raise Unsupported(f"reduce_precision to {exponent_bits}/{mantissa_bits} bits")
    return ins[0]


@rule("reshape")
def _reshape(g: Graph, eqn: Any, ins: list[Any], *, new_sizes: Sequence[Any], dimensions: Any, **_: Any) -> Any:
    if dimensions is not None:
        raise Unsupported("reshape with dimensions")
    return g.reshape(ins[0], new_sizes)


@rule("squeeze")
def _squeeze(g: Graph, eqn: Any, ins: list[Any], *, dimensions: Sequence[int]) -> Any:
    return g.op("Squeeze", ins[0], np.array(dimensions, np.int64)) if dimensions else ins[0]


@rule("broadcast_in_dim")
def _broadcast_in_dim(g: Graph, eqn: Any, ins: list[Any], *, shape: Sequence[Any],
                      broadcast_dimensions: Sequence[int], **_: Any) -> Any:
    x, in_shape = ins[0], eqn.invars[0].aval.shape
    kept = [int(d) for d in broadcast_dimensions]
    # The operand's dimensions in place, 1 elsewhere: then Expand, which keeps a dimension where its
    # target is 1 and broadcasts where the operand has 1.
    placed = placed_shape(shape, in_shape, kept)
    x = g.reshape(x, placed) if list(placed) != list(in_shape) else x
    target = [1 if (i in kept and placed[i] == shape[i]) else shape[i] for i in range(len(shape))]
    if all(isinstance(t, int) and t == 1 for t in target):
        return x
    return g.op("Expand", x, g.shape_tensor(target))


@rule("transpose")
def _transpose(g: Graph, eqn: Any, ins: list[Any], *, permutation: Sequence[int]) -> Any:
    return g.transpose(ins[0], permutation)


@rule("concatenate")
def _concatenate(g: Graph, eqn: Any, ins: list[Any], *, dimension: int) -> Any:
    return g.op("Concat", *ins, axis=int(dimension))


@rule("stack")
def _stack(g: Graph, eqn: Any, ins: list[Any], *, axis: int) -> Any:
    return g.op("Concat", *[g.op("Unsqueeze", v, np.array([axis], np.int64)) for v in ins], axis=int(axis))


@rule("unstack")
def _unstack(g: Graph, eqn: Any, ins: list[Any], *, axis: int) -> list[Any]:
    n = len(eqn.outvars)
    parts = g.node("Split", [g.name(ins[0]), g.name(np.ones(n, np.int64))], [g.fresh("split") for _ in range(n)],
                   axis=int(axis))
    return [g.op("Squeeze", p, np.array([axis], np.int64)) for p in parts]


@rule("split")
def _split(g: Graph, eqn: Any, ins: list[Any], *, sizes: Sequence[int], axis: int) -> list[Any]:
    return g.node("Split", [g.name(ins[0]), g.name(np.array(sizes, np.int64))],
                  [g.fresh("split") for _ in sizes], axis=int(axis))


@rule("tile")
def _tile(g: Graph, eqn: Any, ins: list[Any], *, reps: Sequence[int]) -> Any:
    return g.op("Tile", ins[0], np.array(reps, np.int64))


@rule("slice")
def _slice(g: Graph, eqn: Any, ins: list[Any], *, start_indices: Sequence[int], limit_indices: Sequence[int],
           strides: Sequence[int] | None) -> Any:
    axes = [i for i, (s, e, d) in enumerate(zip(start_indices, limit_indices, strides or [1] * len(start_indices)))
            if (s, d) != (0, 1) or e != eqn.invars[0].aval.shape[i]]
    if not axes:
        return ins[0]
    return g.slice(ins[0], [start_indices[i] for i in axes], [limit_indices[i] for i in axes], axes,
                   [strides[i] for i in axes] if strides else None)


@rule("rev")
def _rev(g: Graph, eqn: Any, ins: list[Any], *, dimensions: Sequence[int]) -> Any:
    axes = [int(d) for d in dimensions]
    return g.slice(ins[0], [-1] * len(axes), [-(2**62)] * len(axes), axes, [-1] * len(axes)) if axes else ins[0]


@rule("pad")
def _pad(g: Graph, eqn: Any, ins: list[Any], *, padding_config: Sequence[tuple[int, int, int]]) -> Any:
    x, value = ins
    if any(interior for _, _, interior in padding_config):
        raise Unsupported("pad with interior padding")
    lo = [max(int(a), 0) for a, _, _ in padding_config]
    hi = [max(int(b), 0) for _, b, _ in padding_config]
    if any(lo) or any(hi):
        x = g.op("Pad", x, np.array(lo + hi, np.int64), value, mode="constant")
    cut = [i for i, (a, b, _) in enumerate(padding_config) if a < 0 or b < 0]
    if cut:  # negative padding crops
        shape = eqn.outvars[0].aval.shape
        starts = [-min(int(padding_config[i][0]), 0) for i in cut]
        x = g.slice(x, starts, [s + int(shape[i]) for s, i in zip(starts, cut)], cut)
    return x


def _reduce(op: str, attribute_axes: bool) -> Rule:
    def rule(g: Graph, eqn: Any, ins: list[Any], *, axes: Sequence[int], **_: Any) -> Any:
        axes = [int(a) for a in axes]
        if not axes:
            return ins[0]
        if attribute_axes:  # opset 17: ReduceMax/Min/Prod take axes as an attribute, ReduceSum as an input
            return g.op(op, ins[0], axes=axes, keepdims=0)
        return g.op(op, ins[0], np.array(axes, np.int64), keepdims=0)
    return rule


RULES["reduce_sum"] = _reduce("ReduceSum", False)
RULES["reduce_max"] = _reduce("ReduceMax", True)
RULES["reduce_min"] = _reduce("ReduceMin", True)
RULES["reduce_prod"] = _reduce("ReduceProd", True)


@rule("argmax", "argmin")
def _argmax(g: Graph, eqn: Any, ins: list[Any], *, axes: Sequence[int], index_dtype: Any) -> Any:
    op = "ArgMax" if str(eqn.primitive) == "argmax" else "ArgMin"
    out = g.op(op, ins[0], axis=int(axes[0]), keepdims=0)  # the first of equal values, as jax
    return g.op("Cast", out, to=onnx_type(index_dtype))


@rule("top_k")
def _top_k(g: Graph, eqn: Any, ins: list[Any], *, k: int, axis: int = -1, **_: Any) -> list[Any]:
    values, indices = g.node("TopK", [g.name(ins[0]), g.name(np.array([k], np.int64))],
                             [g.fresh("topk"), g.fresh("topk_i")], axis=int(axis), largest=1, sorted=1)
    return [values, g.op("Cast", indices, to=onnx_type(eqn.outvars[1].aval.dtype))]


@rule("cumsum")
def _cumsum(g: Graph, eqn: Any, ins: list[Any], *, axis: int, reverse: bool) -> Any:
    return g.op("CumSum", ins[0], np.array(axis, np.int64), reverse=int(reverse))


@rule("dot_general")
def _dot_general(g: Graph, eqn: Any, ins: list[Any], *, dimension_numbers: Any,
                 preferred_element_type: Any = None, **_: Any) -> Any:
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = ([int(i) for i in t] for t in (lc, rc, lb, rb))
    a, b = ins
    la, ra = eqn.invars[0].aval.ndim, eqn.invars[1].aval.ndim
    if not lb and not rb and lc == [la - 1] and rc == [0] and ra == 2:
        out = g.op("MatMul", a, b)  # x @ W: a dense layer
    else:  # einsum: batch dimensions, then the free dimensions of each operand in order, as lax
        letters = iter(string.ascii_letters)
        sa = [next(letters) for _ in range(la)]
        sb = [""] * ra
        for i, j in zip(lb, rb):
            sb[j] = sa[i]
        for i, j in zip(lc, rc):
            sb[j] = sa[i]
        sb = [s or next(letters) for s in sb]
        free_a = [sa[i] for i in range(la) if i not in lb and i not in lc]
        free_b = [sb[j] for j in range(ra) if j not in rb and j not in rc]
        spec = f"{''.join(sa)},{''.join(sb)}->{''.join([sa[i] for i in lb] + free_a + free_b)}"
        out = g.op("Einsum", a, b, equation=spec)
    want = eqn.outvars[0].aval.dtype
    return g.op("Cast", out, to=onnx_type(want)) if np.dtype(want) != np.dtype(eqn.invars[0].aval.dtype) else out


@rule("conv_general_dilated")
def _conv(g: Graph, eqn: Any, ins: list[Any], *, window_strides: Sequence[int], padding: Sequence[tuple[int, int]],
          lhs_dilation: Sequence[int], rhs_dilation: Sequence[int], dimension_numbers: Any,
          feature_group_count: int, batch_group_count: int, **_: Any) -> Any:
    if batch_group_count != 1:
        raise Unsupported("a convolution with batch_group_count > 1")
    dn = dimension_numbers
    x = g.transpose(ins[0], dn.lhs_spec)  # (N, C, spatial...)
    w = g.transpose(ins[1], dn.rhs_spec)  # (O, I, kernel...)
    kernel = [int(eqn.invars[1].aval.shape[d]) for d in dn.rhs_spec[2:]]
    pads = [(int(lo), int(hi)) for lo, hi in padding]
    if any(d != 1 for d in lhs_dilation):  # a transposed convolution (U-Net's upsampling)
        if any(s != 1 for s in window_strides) or feature_group_count != 1 or any(d != 1 for d in rhs_dilation):
            raise Unsupported("a dilated-input convolution with strides, groups or kernel dilation")
        # conv(dilate(x), w) with padding (lo, hi) == ConvTranspose(x, flip(w)^T) with pads (k-1-lo, k-1-hi).
        begin = [k - 1 - lo for k, (lo, _) in zip(kernel, pads)]
        end = [k - 1 - hi for k, (_, hi) in zip(kernel, pads)]
        if min(begin + end) < 0:
            raise Unsupported("a transposed convolution padded beyond its kernel")
        if isinstance(w, str):
            flipped = g.op("Transpose", w, perm=[1, 0, *range(2, 2 + len(kernel))])
            for ax in range(2, 2 + len(kernel)):
                flipped = g.slice(flipped, [-1], [-(2**62)], [ax], [-1])
        else:
            flipped = np.ascontiguousarray(np.flip(np.swapaxes(w, 0, 1), axis=tuple(range(2, 2 + len(kernel)))))
        y = g.op("ConvTranspose", x, flipped, strides=[int(d) for d in lhs_dilation], pads=begin + end,
                 kernel_shape=kernel)
    else:
        if any(lo < 0 or hi < 0 for lo, hi in pads):  # negative padding crops the input first
            shape = [eqn.invars[0].aval.shape[d] for d in dn.lhs_spec]
            axes = [2 + i for i, (lo, hi) in enumerate(pads) if lo < 0 or hi < 0]
            x = g.slice(x, [-min(pads[a - 2][0], 0) for a in axes],
                        [int(shape[a]) + min(pads[a - 2][1], 0) for a in axes], axes)
            pads = [(max(lo, 0), max(hi, 0)) for lo, hi in pads]
        y = g.op("Conv", x, w, strides=[int(s) for s in window_strides], dilations=[int(d) for d in rhs_dilation],
                 pads=[lo for lo, _ in pads] + [hi for _, hi in pads], group=int(feature_group_count),
                 kernel_shape=kernel)
    return g.transpose(y, np.argsort(dn.out_spec))


@rule("reduce_window_max", "reduce_window_sum")
def _reduce_window(g: Graph, eqn: Any, ins: list[Any], *, window_dimensions: Sequence[int],
                   window_strides: Sequence[int], padding: Sequence[tuple[int, int]], base_dilation: Sequence[int],
                   window_dilation: Sequence[int]) -> Any:
    shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    pads = [tuple(int(p) for p in pad) for pad in padding]
    if any(d != 1 for d in base_dilation):
        raise Unsupported("a reduce_window with base dilation")
    pooled = [i for i, (w, s, p) in enumerate(zip(window_dimensions, window_strides, pads))
              if (w, s, p) != (1, 1, (0, 0))]
    if not pooled:
        return ins[0]
    if (list(window_dimensions) == list(window_strides) and all(p == (0, 0) for p in pads)
            and all(d == 1 for d in window_dilation)
            and all(int(shape[i]) % window_dimensions[i] == 0 for i in pooled)):
        # Non-overlapping windows (U-Net's 2x2 max pooling): split each pooled dimension into
        # (windows, window) and reduce over the window dimensions; exact, and no layout change.
        split, axes = [], []
        for i, w in enumerate(window_dimensions):
            split += [int(shape[i]) // w, int(w)] if i in pooled else [shape[i]]
            if i in pooled:
                axes.append(len(split) - 1)
        x = g.reshape(ins[0], split)
        if str(eqn.primitive) == "reduce_window_sum":
            return g.op("ReduceSum", x, np.array(axes, np.int64), keepdims=0)
        return g.op("ReduceMax", x, axes=axes, keepdims=0)
    if str(eqn.primitive) != "reduce_window_max":
        raise Unsupported("an overlapping or padded reduce_window_sum")
    # Overlapping or padded max pooling (the RAT's mask dilation): ONNX MaxPool on (N, 1, pooled...),
    # the other dimensions folded into N; its padding never wins a max, as jax's -inf padding.
    rest = [i for i in range(len(shape)) if i not in pooled]
    x = g.transpose(ins[0], rest + pooled)
    x = g.op("Reshape", x, np.array([-1, 1, *[int(shape[i]) for i in pooled]], np.int64))
    y = g.op("MaxPool", x, kernel_shape=[int(window_dimensions[i]) for i in pooled],
             strides=[int(window_strides[i]) for i in pooled], dilations=[int(window_dilation[i]) for i in pooled],
             pads=[pads[i][0] for i in pooled] + [pads[i][1] for i in pooled])
    y = g.reshape(y, [shape[i] for i in rest] + [out_shape[i] for i in pooled])
    return g.transpose(y, np.argsort(rest + pooled))


@rule("iota")
def _iota(g: Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    raise Unsupported("an iota of batch size")  # a static one is folded into a constant before this


@rule("gather")
def _gather(g: Graph, eqn: Any, ins: list[Any], *, dimension_numbers: Any, slice_sizes: Sequence[int],
            **_: Any) -> Any:
    """``jnp.take_along_axis`` on one axis (DETR's top-k boxes and labels), batched or not: ONNX
    GatherElements with the indices laid out like the output. Other gathers are folded when constant."""
    dn = dimension_numbers
    operand, indices = ins
    shape, ishape = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    out_shape = eqn.outvars[0].aval.shape
    ob = [int(d) for d in getattr(dn, "operand_batching_dims", ())]
    ib = [int(d) for d in getattr(dn, "start_indices_batching_dims", ())]
    axis = [int(d) for d in dn.start_index_map]
    offset = [d for d in range(len(shape)) if d not in axis and d not in ob]
    simple = (len(axis) == 1 and [int(d) for d in dn.collapsed_slice_dims] == axis and ishape[-1] == 1
              and all(slice_sizes[d] == (shape[d] if d in offset else 1) for d in range(len(shape))))
    if simple:
        # Which operand dimension each output dimension comes from: offset dims from the operand in
        # order, the others from the indices (batching ones paired with the operand's, the free one at axis).
        index_dims = [d for d in range(len(ishape) - 1)]
        free = [d for d in index_dims if d not in ib]
        from_indices = iter(index_dims)
        from_operand = iter(offset)
        source = []
        for p in range(len(out_shape)):
            if p in [int(o) for o in dn.offset_dims]:
                source.append(next(from_operand))
            else:
                d = next(from_indices)
                source.append(ob[ib.index(d)] if d in ib else (axis[0] if d in free else -1))
        simple = len(free) == 1 and source == list(range(len(shape)))
    if not simple:
        raise Unsupported("a gather on computed values other than take_along_axis")
    idx = g.op("Squeeze", indices, np.array([len(ishape) - 1], np.int64))
    # indices' dims -> operand order: batching dims where their operand dims are, the free one at axis
    order = [ib[ob.index(d)] if d in ob else free[0] for d in range(len(shape)) if d not in offset]
    idx = g.transpose(idx, order)
    if offset:
        idx = g.op("Unsqueeze", idx, np.array(offset, np.int64))
        idx = g.op("Expand", idx, g.shape_tensor([out_shape[d] if d in offset else 1 for d in range(len(shape))]))
    return g.op("GatherElements", operand, g.op("Cast", idx, to=onnx_type(np.int64)), axis=axis[0])
