"""A JAX function as an ONNX graph: jaxrat's own converter, from the function's jaxpr.

Why not a converter package: jax2onnx (the maintained Flax-NNX converter) cannot be installed beside
jaxrat from 0.13 to 0.17.1 (it pins ``orbax-checkpoint<0.11.37``; jaxrat needs ``>=0.12.8``), 0.12.5
gives the U-Net's convolutions wrong shapes and a max pooling onnxruntime rejects, and 0.17.1 fails on
the U-Net (its patch of ``nnx.max_pool`` takes the window by keyword only: TypeError; traced without
the patches, its NHWC max pooling is again a MaxPool onnxruntime rejects) and on the RAT (``Aval
missing dtype`` on dead PRNG-key slices, a symbolic batch in ``pad``). No maintained StableHLO-to-ONNX
converter exists. What the models need is small: the jaxpr of the portable form is a few dozen ``lax``
primitives, each one ONNX operator or a few (:mod:`jaxrat.inference.onnx_rules`), checked one by one against JAX
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

from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxrat.inference import onnx_rules  # noqa: F401  (fills the rule table)
from jaxrat.inference.onnx_graph import BATCH, OPSET, Graph, Unsupported, dims, onnx_type

__all__ = ["BATCH", "OPSET", "Unsupported", "to_onnx"]


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
    g = Graph()
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
        graph_outputs.append(helper.make_tensor_value_info(name, onnx_type(var.aval.dtype), dims(var.aval.shape)))
    graph_inputs = [helper.make_tensor_value_info(name, onnx_type(np.dtype(dtype)), [BATCH, *shape])
                    for name, shape, dtype in inputs]
    graph = helper.make_graph(g.nodes, "jaxrat", graph_inputs, graph_outputs, g.initializers, doc_string=doc)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="jaxrat")
    onnx.checker.check_model(model)
    return model
