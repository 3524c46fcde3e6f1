"""The ONNX graph being written and the jaxpr interpreter that writes it, for
:mod:`jaxrat.inference.onnx_convert`: constants, the rule table each primitive is looked up in
(filled by :mod:`jaxrat.inference.onnx_rules`), and the helpers the rules share."""

from __future__ import annotations

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



def dims(shape: Sequence[Any]) -> list[Any]:
    return [d if isinstance(d, int) else str(d) for d in shape]


def onnx_type(dtype: Any) -> int:
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



class Graph:
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
        rule = RULES.get(prim)
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


def placed_shape(shape: Sequence[Any], in_shape: Sequence[Any], dims: Sequence[int]) -> list[Any]:
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
        np.reshape(x, placed_shape(shape, np.shape(x), broadcast_dimensions)), shape),
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
RULES: dict[str, Rule] = {}


def rule(*names: str) -> Callable[[Rule], Rule]:
    def deco(f: Rule) -> Rule:
        for n in names:
            RULES[n] = f
        return f
    return deco
