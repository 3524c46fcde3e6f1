"""A JAX function as an ONNX graph: jaxrat's own converter, from the function's jaxpr.

Why not a converter package: jax2onnx (the maintained Flax-NNX converter) cannot be installed beside
jaxrat from 0.13 to 0.17.1 (it pins ``orbax-checkpoint<0.11.37``; jaxrat needs ``>=0.12.8``), 0.12.5
gives the U-Net's convolutions wrong shapes and a max pooling onnxruntime rejects, and 0.17.1 fails on
the U-Net (its patch of ``nnx.max_pool`` takes the window by keyword only: TypeError; traced without
the patches, its NHWC max pooling is again a MaxPool onnxruntime rejects) and on the RAT (``Aval
missing dtype`` on dead PRNG-key slices, a symbolic batch in ``pad``). No maintained StableHLO-to-ONNX
converter exists. What the models need is small: the jaxpr of the portable form is a few dozen ``lax``
primitives, each one ONNX operator or a few (the table :data:`_RULES`), checked one by one against JAX
in the tests.

How: the function is traced once per image (``jax.vmap`` over a symbolic batch of a function called on
a batch of one), so that every size-dependent choice of the model's code (block sizes, chunking) is made
for one image and the batch stays a free dimension; dead equations (unused PRNG keys, dropout masks of
eval mode) are dropped; ``jit``, ``custom_jvp``/``custom_vjp`` bodies and ``scan`` (unrolled) are
inlined; every equation whose inputs are all constants (positional tables, masks, gather indices) is
evaluated here (numpy where its result is bit-identical, else JAX) and stored as a constant; the rest
become ONNX nodes. A primitive without a rule
stops the conversion with :class:`Unsupported`, naming it.
"""

from __future__ import annotations

import string
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The ONNX operator set written: 17 (2022), old enough for the deployment runtimes in use (onnxruntime,
# TensorRT, OpenVINO) and new enough for every operator used here; tested with onnxruntime 1.32.
OPSET = 17
BATCH = "batch"  # the symbolic batch dimension's name, in the trace and in the ONNX graph
# A constant-only equation is evaluated at conversion time unless its outputs are larger than this
# many elements (a broadcast of a bias to a whole feature map would bloat the file; ONNX expands it).
FOLD_ELEMENTS = 1 << 18
# Container primitives whose body is converted in place, and the parameter holding it (every input of
# the equation is an input of the body, in order).
_BODIES = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
           "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr"}
# Primitives that pass their operand through at inference.
_IDENTITY = {"copy", "copy_p", "stop_gradient", "optimization_barrier", "pvary", "name", "sharding_constraint",
             "mesh_cast", "reshard"}
_NO_FOLD = {"random_seed", "random_bits", "random_wrap", "random_unwrap", "random_fold_in", "random_split"}


class Unsupported(Exception):
    """The function uses something the converter has no ONNX form for (the message names it)."""


def to_onnx(fn: Callable[..., Any], inputs: Sequence[tuple[str, tuple[int, ...], Any]],
            output_names: Sequence[str], *, doc: str = "") -> Any:
    """The ONNX ``ModelProto`` of ``fn`` applied per image to a batch.

    ``inputs``: (name, per-image shape, dtype) of each argument; the graph's inputs are
    ``(batch, *shape)`` with a free batch dimension named :data:`BATCH`. ``fn`` takes arrays with a
    leading batch dimension (it is called on batches of one) and returns an array or a tuple/dict of
    arrays with that dimension, flattened in ``jax.tree`` order and named ``output_names``.
    """
    import onnx
    from onnx import helper

    def one(*xs: jax.Array) -> list[jax.Array]:
        return [y[0] for y in jax.tree.leaves(fn(*[x[None] for x in xs]))]

    b = jax.export.symbolic_shape(BATCH)[0]
    specs = [jax.ShapeDtypeStruct((b, *shape), dtype) for _, shape, dtype in inputs]
    closed = jax.make_jaxpr(jax.vmap(one))(*specs)
    if len(closed.jaxpr.outvars) != len(output_names):
        raise ValueError(f"{len(closed.jaxpr.outvars)} outputs, {len(output_names)} names")
    g = _Graph()
    env: dict[Any, Any] = {}
    for var, (name, _, _) in zip(closed.jaxpr.invars, inputs):
        env[var] = name
    g.batch_source = inputs[0][0]
    for var, c in zip(closed.jaxpr.constvars, closed.consts):
        env[var] = np.asarray(c)
    outs = g.run(closed.jaxpr, env)
    graph_outputs = []
    for value, var, name in zip(outs, closed.jaxpr.outvars, output_names):
        g.node("Identity", [g.name(value)], [name])
        graph_outputs.append(helper.make_tensor_value_info(name, _onnx_type(var.aval.dtype), _dims(var.aval.shape)))
    graph_inputs = [helper.make_tensor_value_info(name, _onnx_type(np.dtype(dtype)), [BATCH, *shape])
                    for name, shape, dtype in inputs]
    graph = helper.make_graph(g.nodes, "jaxrat", graph_inputs, graph_outputs, g.initializers, doc_string=doc)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="jaxrat")
    onnx.checker.check_model(model)
    return model


def _dims(shape: Sequence[Any]) -> list[Any]:
    return [d if isinstance(d, int) else str(d) for d in shape]


def _onnx_type(dtype: Any) -> int:
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _static(shape: Sequence[Any]) -> bool:
    return all(isinstance(d, (int, np.integer)) for d in shape)


def _batch_multiple(d: Any) -> int:
    """k for a symbolic dimension k * batch (the only kind a per-image trace makes)."""
    text = str(d).replace(" ", "")
    if text == BATCH:
        return 1
    head, _, tail = text.partition("*")
    if tail == BATCH and head.isdigit():
        return int(head)
    raise Unsupported(f"the symbolic dimension {text} (only multiples of the batch are converted)")


class _Graph:
    """The ONNX nodes and constants being written, and the jaxpr interpreter that writes them."""

    def __init__(self) -> None:
        from onnx import numpy_helper

        self._numpy_helper = numpy_helper
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._count = 0
        self._const_names: dict[int, tuple[np.ndarray, str]] = {}
        self.batch_source = ""
        self._batch: str | None = None

    # ------------------------------------------------------------------ building blocks
    def fresh(self, hint: str = "t") -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def node(self, op: str, inputs: Sequence[str], outputs: Sequence[str] | None = None, **attrs: Any) -> list[str]:
        from onnx import helper

        outputs = list(outputs) if outputs is not None else [self.fresh(op.lower())]
        self.nodes.append(helper.make_node(op, list(inputs), outputs, name=self.fresh("n_" + op), **attrs))
        return outputs

    def op(self, op: str, *inputs: Any, **attrs: Any) -> str:
        """One ONNX node on values (constants or tensor names); its single output's name."""
        return self.node(op, [self.name(v) for v in inputs], **attrs)[0]

    def name(self, value: Any) -> str:
        """The graph name of a value: a tensor name as is, a constant as an initializer."""
        if isinstance(value, str):
            return value
        arr = np.asarray(value)
        known = self._const_names.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        name = self.fresh("c")
        self.initializers.append(self._numpy_helper.from_array(arr, name))
        self._const_names[id(value)] = (value, name)
        return name

    def batch(self) -> str:
        """The batch size as an int64 vector of one (read from the first input's shape)."""
        if self._batch is None:
            shape = self.op("Shape", self.batch_source)
            self._batch = self.op("Slice", shape, np.array([0], np.int64), np.array([1], np.int64))
        return self._batch

    def shape_tensor(self, dims: Sequence[Any], reshape: bool = False) -> Any:
        """An int64 shape for ONNX: a constant when static (or, for Reshape, when one dimension is
        symbolic: -1), else built from the batch size."""
        if _static(dims):
            return np.array([int(d) for d in dims], np.int64)
        symbolic = [i for i, d in enumerate(dims) if not isinstance(d, (int, np.integer))]
        if reshape and len(symbolic) == 1:
            return np.array([-1 if i in symbolic else int(d) for i, d in enumerate(dims)], np.int64)
        parts = []
        for d in dims:
            if isinstance(d, (int, np.integer)):
                parts.append(np.array([int(d)], np.int64))
            else:
                k = _batch_multiple(d)
                parts.append(self.batch() if k == 1 else self.op("Mul", self.batch(), np.array([k], np.int64)))
        return self.op("Concat", *parts, axis=0)

    # ------------------------------------------------------------------ the interpreter
    def run(self, jaxpr: Any, env: dict[Any, Any], needed: Sequence[bool] | None = None) -> list[Any]:
        """Convert ``jaxpr``'s live equations with ``env`` (var -> constant or tensor name); its outputs."""
        outvars = jaxpr.outvars
        wanted = [o for o, n in zip(outvars, needed or [True] * len(outvars)) if n]
        for eqn in _live(jaxpr.eqns, wanted):
            ins = [_literal(v) if _is_literal(v) else env[v] for v in eqn.invars]
            used = [not _is_drop(v) for v in eqn.outvars]
            outs = self.equation(eqn, ins, used)
            for var, value in zip(eqn.outvars, outs):
                if not _is_drop(var):
                    env[var] = value
        return [(_literal(v) if _is_literal(v) else env[v]) if n else None
                for v, n in zip(outvars, needed or [True] * len(outvars))]

    def equation(self, eqn: Any, ins: list[Any], used: list[bool]) -> list[Any]:
        prim = str(eqn.primitive)
        if prim in _BODIES or prim == "scan":
            return self.body(eqn, prim, ins, used)
        if prim in _IDENTITY:
            return list(ins[:len(eqn.outvars)])
        if prim not in _NO_FOLD and all(not isinstance(v, str) for v in ins):
            sizes = sum(int(np.prod(v.aval.shape)) if _static(v.aval.shape) else FOLD_ELEMENTS + 1
                        for v in eqn.outvars)
            if sizes <= max(FOLD_ELEMENTS, sum(np.size(v) for v in ins)):
                return self.fold(eqn, ins)
        rule = _RULES.get(prim)
        if rule is None:
            raise Unsupported(f"the primitive {prim}")
        out = rule(self, eqn, ins, **eqn.params)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def fold(self, eqn: Any, ins: list[Any]) -> list[Any]:
        """Evaluate a constant-only equation: with numpy where numpy's result is bit-identical (moving
        data, IEEE's exactly rounded arithmetic), else with JAX (each of those costs an XLA compile)."""
        exact = _EXACT.get(str(eqn.primitive))
        if exact is not None and (str(eqn.primitive) != "div" or np.dtype(eqn.outvars[0].aval.dtype).kind == "f"):
            out = exact(*ins, **eqn.params)
            return [np.asarray(out, eqn.outvars[0].aval.dtype)]
        params = eqn.primitive.get_bind_params(eqn.params)  # as jax.core.eval_jaxpr binds it
        with jax.ensure_compile_time_eval():
            out = eqn.primitive.bind(*[jnp.asarray(v) for v in ins], **params)
        outs = out if eqn.primitive.multiple_results else [out]
        return [np.asarray(jax.device_get(o)) for o in outs]

    def body(self, eqn: Any, prim: str, ins: list[Any], used: list[bool]) -> list[Any]:
        """Inline a call's body, or unroll a scan."""
        if prim == "scan":
            return self.scan(eqn, ins)
        sub = eqn.params[_BODIES[prim]]
        jaxpr, consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, [])
        if len(jaxpr.invars) != len(ins):
            raise Unsupported(f"a {prim} whose body takes {len(jaxpr.invars)} inputs for {len(ins)}")
        env = {v: np.asarray(c) for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, ins))
        return self.run(jaxpr, env, used)

    def scan(self, eqn: Any, ins: list[Any]) -> list[Any]:
        p = eqn.params
        body, length = p["jaxpr"], int(p["length"])
        nc, nk = int(p["num_consts"]), int(p["num_carry"])
        consts, carry, xs = ins[:nc], list(ins[nc:nc + nk]), ins[nc + nk:]
        ys: list[list[Any]] = []
        steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for i in steps:
            x_i = [x[i] if not isinstance(x, str) else
                   self.op("Squeeze", self.op("Slice", x, np.array([i], np.int64), np.array([i + 1], np.int64),
                                              np.array([0], np.int64)), np.array([0], np.int64)) for x in xs]
            env = {v: np.asarray(c) for v, c in zip(body.jaxpr.constvars, body.consts)}
            env.update(zip(body.jaxpr.invars, [*consts, *carry, *x_i]))
            out = self.run(body.jaxpr, env)
            carry, y = out[:nk], out[nk:]
            ys.append(y)
        if p["reverse"]:
            ys.reverse()
        stacked = []
        for k in range(len(ys[0]) if ys else 0):
            items = [step[k] for step in ys]
            if all(not isinstance(v, str) for v in items):
                stacked.append(np.stack(items))
            else:
                stacked.append(self.op("Concat", *[self.op("Unsqueeze", v, np.array([0], np.int64)) for v in items],
                                       axis=0))
        return [*carry, *stacked]

    # ------------------------------------------------------------------ helpers for the rules
    def transpose(self, v: Any, perm: Sequence[int]) -> Any:
        perm = [int(p) for p in perm]
        if perm == list(range(len(perm))):
            return v
        if not isinstance(v, str):
            return np.ascontiguousarray(np.transpose(v, perm))
        return self.op("Transpose", v, perm=perm)

    def reshape(self, v: Any, dims: Sequence[Any]) -> Any:
        if not isinstance(v, str) and _static(dims):
            return np.reshape(v, [int(d) for d in dims])
        target = self.shape_tensor(dims, reshape=True)
        zero = _static(dims) and any(int(d) == 0 for d in dims)
        return self.op("Reshape", v, target, **({"allowzero": 1} if zero else {}))

    def slice(self, v: Any, starts: Sequence[int], ends: Sequence[int], axes: Sequence[int],
              steps: Sequence[int] | None = None) -> Any:
        args = [v, np.array(starts, np.int64), np.array(ends, np.int64), np.array(axes, np.int64)]
        if steps is not None:
            args.append(np.array(steps, np.int64))
        return self.op("Slice", *args)


def _is_literal(v: Any) -> bool:
    return hasattr(v, "val") and not hasattr(v, "count")


def _is_drop(v: Any) -> bool:
    return type(v).__name__ == "DropVar"


def _literal(v: Any) -> np.ndarray:
    return np.asarray(v.val, dtype=v.aval.dtype)


def _live(eqns: Sequence[Any], outvars: Sequence[Any]) -> list[Any]:
    """The equations the outputs depend on, in order (inference has no effects to keep)."""
    needed = {v for v in outvars if not _is_literal(v)}
    keep = []
    for eqn in reversed(eqns):
        if any(o in needed for o in eqn.outvars if not _is_drop(o)):
            keep.append(eqn)
            needed.update(v for v in eqn.invars if not _is_literal(v))
    return keep[::-1]


def _placed(shape: Sequence[Any], in_shape: Sequence[Any], dims: Sequence[int]) -> list[Any]:
    """``in_shape`` at ``dims`` of a ``len(shape)`` shape, 1 elsewhere (broadcast_in_dim's reshape)."""
    placed: list[Any] = [1] * len(shape)
    for src, dst in enumerate(dims):
        placed[int(dst)] = in_shape[src]
    return placed


def _iota(dtype: Any, shape: Sequence[int], dimension: int, **_: Any) -> np.ndarray:
    line = np.arange(shape[dimension], dtype=dtype).reshape([-1 if i == dimension else 1 for i in range(len(shape))])
    return np.broadcast_to(line, shape)


def _select(pred: np.ndarray, *cases: np.ndarray) -> np.ndarray:
    return np.choose(np.asarray(pred, np.int32), np.broadcast_arrays(*cases)) if len(cases) > 1 else cases[0]


# Constant folding in numpy, for primitives whose numpy result is bit-identical to XLA's.
_EXACT: dict[str, Callable[..., Any]] = {
    "reshape": lambda x, new_sizes, **_: np.reshape(x, new_sizes),
    "broadcast_in_dim": lambda x, shape, broadcast_dimensions, **_: np.broadcast_to(
        np.reshape(x, _placed(shape, np.shape(x), broadcast_dimensions)), shape),
    "transpose": lambda x, permutation: np.transpose(x, permutation),
    "rev": lambda x, dimensions: np.flip(x, tuple(dimensions)),
    "squeeze": lambda x, dimensions: np.squeeze(x, tuple(dimensions)),
    "concatenate": lambda *xs, dimension: np.concatenate(xs, int(dimension)),
    "slice": lambda x, start_indices, limit_indices, strides: x[tuple(
        slice(s, e, d) for s, e, d in zip(start_indices, limit_indices, strides or [1] * len(start_indices)))],
    "convert_element_type": lambda x, new_dtype, **_: np.asarray(x).astype(new_dtype),
    "iota": _iota, "select_n": _select,
    "add": np.add, "sub": np.subtract, "mul": lambda a, b, **_: np.multiply(a, b), "div": np.divide,
    "max": np.maximum, "min": np.minimum, "neg": np.negative, "abs": np.abs, "square": np.square,
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "and": np.logical_and, "or": np.logical_or, "not": np.logical_not,
}


# ---------------------------------------------------------------------------------------------- rules
# Each rule: (graph, equation, input values, **params) -> output value(s). Values are numpy constants
# or tensor names; jax's elementwise primitives take equal shapes or scalars, which ONNX broadcasting covers.
Rule = Callable[..., Any]
_RULES: dict[str, Rule] = {}


def _rule(*names: str) -> Callable[[Rule], Rule]:
    def deco(f: Rule) -> Rule:
        for n in names:
            _RULES[n] = f
        return f
    return deco


def _simple(prim: str, op: str) -> None:
    _RULES[prim] = lambda g, eqn, ins, **_: g.op(op, *ins)


for _prim, _op in {"add": "Add", "add_any": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max",
                   "min": "Min", "pow": "Pow", "neg": "Neg", "abs": "Abs", "exp": "Exp", "log": "Log", "sin": "Sin",
                   "cos": "Cos", "tanh": "Tanh", "sqrt": "Sqrt", "logistic": "Sigmoid", "sign": "Sign",
                   "floor": "Floor", "ceil": "Ceil", "eq": "Equal", "gt": "Greater", "ge": "GreaterOrEqual",
                   "lt": "Less", "le": "LessOrEqual", "erf": "Erf"}.items():
    _simple(_prim, _op)


@_rule("and", "or", "xor", "not")
def _logical(g: _Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    if eqn.outvars[0].aval.dtype != np.bool_:
        raise Unsupported(f"the bitwise {eqn.primitive} on {eqn.outvars[0].aval.dtype} (ONNX opset {OPSET} has "
                          f"logical ones only)")
    return g.op(str(eqn.primitive).capitalize(), *ins)


@_rule("ne")
def _ne(g: _Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    return g.op("Not", g.op("Equal", *ins))


@_rule("square")
def _square(g: _Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    return g.op("Mul", ins[0], ins[0])


@_rule("rsqrt")
def _rsqrt(g: _Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    return g.op("Reciprocal", g.op("Sqrt", ins[0]))


@_rule("erfc")
def _erfc(g: _Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    return g.op("Sub", np.array(1, eqn.outvars[0].aval.dtype), g.op("Erf", ins[0]))


@_rule("is_finite")
def _is_finite(g: _Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    return g.op("Not", g.op("Or", g.op("IsInf", ins[0]), g.op("IsNaN", ins[0])))


@_rule("rem")
def _rem(g: _Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    return g.op("Mod", *ins, fmod=1)  # C's remainder (sign of the dividend), as lax.rem


@_rule("integer_pow")
def _integer_pow(g: _Graph, eqn: Any, ins: list[Any], *, y: int, **_: Any) -> Any:
    x, n, dtype = ins[0], abs(int(y)), eqn.outvars[0].aval.dtype
    if n == 0:
        return g.op("Add", g.op("Mul", x, np.array(0, dtype)), np.array(1, dtype))
    out = x
    for _ in range(n - 1):
        out = g.op("Mul", out, x)
    return g.op("Reciprocal", out) if y < 0 else out


@_rule("clamp")
def _clamp(g: _Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    lo, x, hi = ins
    return g.op("Min", g.op("Max", x, lo), hi)


@_rule("select_n")
def _select_n(g: _Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    pred, cases = ins[0], ins[1:]
    if len(cases) == 1:
        return cases[0]
    if eqn.invars[0].aval.dtype == np.bool_:
        return g.op("Where", pred, cases[1], cases[0])
    out = cases[0]
    for k in range(1, len(cases)):
        out = g.op("Where", g.op("Equal", pred, np.array(k, eqn.invars[0].aval.dtype)), cases[k], out)
    return out


@_rule("convert_element_type")
def _convert(g: _Graph, eqn: Any, ins: list[Any], *, new_dtype: Any, **_: Any) -> Any:
    if np.dtype(new_dtype) == np.dtype(eqn.invars[0].aval.dtype):
        return ins[0]
    return g.op("Cast", ins[0], to=_onnx_type(new_dtype))


@_rule("reduce_precision")
def _reduce_precision(g: _Graph, eqn: Any, ins: list[Any], *, exponent_bits: int, mantissa_bits: int) -> Any:
    if (exponent_bits, mantissa_bits) != (8, 23):
        raise Unsupported(f"reduce_precision to {exponent_bits}/{mantissa_bits} bits")
    return ins[0]


@_rule("reshape")
def _reshape(g: _Graph, eqn: Any, ins: list[Any], *, new_sizes: Sequence[Any], dimensions: Any, **_: Any) -> Any:
    if dimensions is not None:
        raise Unsupported("reshape with dimensions")
    return g.reshape(ins[0], new_sizes)


@_rule("squeeze")
def _squeeze(g: _Graph, eqn: Any, ins: list[Any], *, dimensions: Sequence[int]) -> Any:
    return g.op("Squeeze", ins[0], np.array(dimensions, np.int64)) if dimensions else ins[0]


@_rule("broadcast_in_dim")
def _broadcast_in_dim(g: _Graph, eqn: Any, ins: list[Any], *, shape: Sequence[Any],
                      broadcast_dimensions: Sequence[int], **_: Any) -> Any:
    x, in_shape = ins[0], eqn.invars[0].aval.shape
    kept = [int(d) for d in broadcast_dimensions]
    # The operand's dimensions in place, 1 elsewhere: then Expand, which keeps a dimension where its
    # target is 1 and broadcasts where the operand has 1.
    placed = _placed(shape, in_shape, kept)
    x = g.reshape(x, placed) if list(placed) != list(in_shape) else x
    target = [1 if (i in kept and placed[i] == shape[i]) else shape[i] for i in range(len(shape))]
    if all(isinstance(t, int) and t == 1 for t in target):
        return x
    return g.op("Expand", x, g.shape_tensor(target))


@_rule("transpose")
def _transpose(g: _Graph, eqn: Any, ins: list[Any], *, permutation: Sequence[int]) -> Any:
    return g.transpose(ins[0], permutation)


@_rule("concatenate")
def _concatenate(g: _Graph, eqn: Any, ins: list[Any], *, dimension: int) -> Any:
    return g.op("Concat", *ins, axis=int(dimension))


@_rule("stack")
def _stack(g: _Graph, eqn: Any, ins: list[Any], *, axis: int) -> Any:
    return g.op("Concat", *[g.op("Unsqueeze", v, np.array([axis], np.int64)) for v in ins], axis=int(axis))


@_rule("unstack")
def _unstack(g: _Graph, eqn: Any, ins: list[Any], *, axis: int) -> list[Any]:
    n = len(eqn.outvars)
    parts = g.node("Split", [g.name(ins[0]), g.name(np.ones(n, np.int64))], [g.fresh("split") for _ in range(n)],
                   axis=int(axis))
    return [g.op("Squeeze", p, np.array([axis], np.int64)) for p in parts]


@_rule("split")
def _split(g: _Graph, eqn: Any, ins: list[Any], *, sizes: Sequence[int], axis: int) -> list[Any]:
    return g.node("Split", [g.name(ins[0]), g.name(np.array(sizes, np.int64))],
                  [g.fresh("split") for _ in sizes], axis=int(axis))


@_rule("tile")
def _tile(g: _Graph, eqn: Any, ins: list[Any], *, reps: Sequence[int]) -> Any:
    return g.op("Tile", ins[0], np.array(reps, np.int64))


@_rule("slice")
def _slice(g: _Graph, eqn: Any, ins: list[Any], *, start_indices: Sequence[int], limit_indices: Sequence[int],
           strides: Sequence[int] | None) -> Any:
    axes = [i for i, (s, e, d) in enumerate(zip(start_indices, limit_indices, strides or [1] * len(start_indices)))
            if (s, d) != (0, 1) or e != eqn.invars[0].aval.shape[i]]
    if not axes:
        return ins[0]
    return g.slice(ins[0], [start_indices[i] for i in axes], [limit_indices[i] for i in axes], axes,
                   [strides[i] for i in axes] if strides else None)


@_rule("rev")
def _rev(g: _Graph, eqn: Any, ins: list[Any], *, dimensions: Sequence[int]) -> Any:
    axes = [int(d) for d in dimensions]
    return g.slice(ins[0], [-1] * len(axes), [-(2**62)] * len(axes), axes, [-1] * len(axes)) if axes else ins[0]


@_rule("pad")
def _pad(g: _Graph, eqn: Any, ins: list[Any], *, padding_config: Sequence[tuple[int, int, int]]) -> Any:
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
    def rule(g: _Graph, eqn: Any, ins: list[Any], *, axes: Sequence[int], **_: Any) -> Any:
        axes = [int(a) for a in axes]
        if not axes:
            return ins[0]
        if attribute_axes:  # opset 17: ReduceMax/Min/Prod take axes as an attribute, ReduceSum as an input
            return g.op(op, ins[0], axes=axes, keepdims=0)
        return g.op(op, ins[0], np.array(axes, np.int64), keepdims=0)
    return rule


_RULES["reduce_sum"] = _reduce("ReduceSum", False)
_RULES["reduce_max"] = _reduce("ReduceMax", True)
_RULES["reduce_min"] = _reduce("ReduceMin", True)
_RULES["reduce_prod"] = _reduce("ReduceProd", True)


@_rule("argmax", "argmin")
def _argmax(g: _Graph, eqn: Any, ins: list[Any], *, axes: Sequence[int], index_dtype: Any) -> Any:
    op = "ArgMax" if str(eqn.primitive) == "argmax" else "ArgMin"
    out = g.op(op, ins[0], axis=int(axes[0]), keepdims=0)  # the first of equal values, as jax
    return g.op("Cast", out, to=_onnx_type(index_dtype))


@_rule("top_k")
def _top_k(g: _Graph, eqn: Any, ins: list[Any], *, k: int, axis: int = -1, **_: Any) -> list[Any]:
    values, indices = g.node("TopK", [g.name(ins[0]), g.name(np.array([k], np.int64))],
                             [g.fresh("topk"), g.fresh("topk_i")], axis=int(axis), largest=1, sorted=1)
    return [values, g.op("Cast", indices, to=_onnx_type(eqn.outvars[1].aval.dtype))]


@_rule("cumsum")
def _cumsum(g: _Graph, eqn: Any, ins: list[Any], *, axis: int, reverse: bool) -> Any:
    return g.op("CumSum", ins[0], np.array(axis, np.int64), reverse=int(reverse))


@_rule("dot_general")
def _dot_general(g: _Graph, eqn: Any, ins: list[Any], *, dimension_numbers: Any,
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
    return g.op("Cast", out, to=_onnx_type(want)) if np.dtype(want) != np.dtype(eqn.invars[0].aval.dtype) else out


@_rule("conv_general_dilated")
def _conv(g: _Graph, eqn: Any, ins: list[Any], *, window_strides: Sequence[int], padding: Sequence[tuple[int, int]],
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


@_rule("reduce_window_max", "reduce_window_sum")
def _reduce_window(g: _Graph, eqn: Any, ins: list[Any], *, window_dimensions: Sequence[int],
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


@_rule("iota")
def _iota(g: _Graph, eqn: Any, ins: list[Any], **_: Any) -> Any:
    raise Unsupported("an iota of batch size")  # a static one is folded into a constant before this


@_rule("gather")
def _gather(g: _Graph, eqn: Any, ins: list[Any], *, dimension_numbers: Any, slice_sizes: Sequence[int],
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
    return g.op("GatherElements", operand, g.op("Cast", idx, to=_onnx_type(np.int64)), axis=axis[0])
