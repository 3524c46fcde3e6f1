"""The cuDNN fused attention calls of a program lowered for CUDA, for tests and benchmarks.

On one device the lowered StableHLO names them (``custom_call @__cudnn$fmhaSoftmax`` and
``...Backward``). On a mesh of several devices jax wraps each in ``custom_call
@CustomSPMDPartitioning`` (its sharding rule; the cuDNN call appears only when XLA partitions the
program), so those wrappers are recognised by their signature: a forward takes q, k, v (and seven
optional operands) and returns the output, with its float32 softmax statistics when trained; a
backward returns the three gradients.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_DIRECT = re.compile(r"custom_call @__cudnn\$fmhaSoftmax(Backward)?\(.*\} : \((.*?)\) -> (.*)$")
_WRAPPED = re.compile(r"custom_call @CustomSPMDPartitioning\(.*\} : \((.*?)\) -> (.*)$")
_TENSOR = re.compile(r"tensor<([\dx]*)x(\w+)>")


class FusedCall(NamedTuple):
    backward: bool
    q: tuple[int, ...]  # (B, T, N, H)
    k: tuple[int, ...]  # (B, S, N, H)

    @property
    def flops(self) -> float:
        """Matmul FLOPs: 2 products of 2 B N T S H each way forward; the backward recomputes the
        logits and runs four more (dV, dP, dQ, dK)."""
        b, t, n, h = self.q
        return (10 if self.backward else 4) * b * n * t * self.k[1] * h


def _tensors(text: str) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(int(d) for d in dims.split("x")), dtype) for dims, dtype in _TENSOR.findall(text)]


def fused_attention_calls(stablehlo: str) -> list[FusedCall]:
    """Every cuDNN fused attention call (forward or backward) of a lowered program's text."""
    calls = []
    for line in stablehlo.splitlines():
        m = _DIRECT.search(line)
        if m:
            ops = _tensors(m.group(2))
            calls.append(FusedCall(bool(m.group(1)), ops[0][0], ops[1][0]))
            continue
        m = _WRAPPED.search(line)
        if not m:
            continue
        ops, results = _tensors(m.group(1)), _tensors(m.group(2))
        if len(ops) < 3 or any(len(s) != 4 for s, _ in ops[:3]) or ops[1][0] != ops[2][0]:
            continue
        stats = len(results) == 2 and len(results[0][0]) == 4 and results[1][1] == "f32" and len(results[1][0]) == 3
        inference = len(results) == 1 and results[0][0] == ops[0][0] and len(ops) >= 10  # q, k, v + 7 optional
        forward = stats or inference
        backward = len(results) == 3 and [s for s, _ in results] == [s for s, _ in ops[:3]]
        if forward or backward:
            calls.append(FusedCall(backward, ops[0][0], ops[1][0]))
    return calls
