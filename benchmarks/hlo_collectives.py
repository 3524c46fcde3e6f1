"""The collectives of an XLA-GPU optimized module (NCCL all-reduce, all-gather, ...), what they put on
the wire, what they cost on NVLink and InfiniBand, and how much of that the schedule hides.

Used by benchmarks/gpu_scaling.py (the trainer's step compiled for 8-32 H100s) and by the tests that
keep that step free of activation traffic (tests/integration/test_gpu_scaling.py).

- :func:`collectives`: every collective one run of the module launches, walked from the entry
  computation (a while body counts its trip count times), with its operand bytes, dtypes, group
  size and whether a group spans nodes (``GPUS_PER_NODE`` devices per node, device ids in order);
  bytes on the wire per GPU as NCCL's ring moves them: all-reduce 2(n-1)/n x buffer, reduce-scatter
  and all-to-all (n-1)/n x buffer, all-gather (n-1) x its operand (the local shard), a permute 1x.
- :class:`Network`: ``latency + wire / bandwidth`` on NVLink when a group stays in a node, on
  InfiniBand when it crosses; ``hierarchical`` prices a cross-node all-reduce as NCCL's tree/hier
  form (reduce-scatter in the node, all-reduce of an eighth across nodes, all-gather in the node).
- :func:`replay`: the entry computation on two streams in schedule order: kernels one after another
  on the compute stream (priced by benchmarks/hlo_cost.py's roofline, times a calibration), each
  asynchronous collective from its ``-start`` on one communication stream, its ``-done`` waiting for
  it; a collective inside a loop, or a synchronous one, is fully exposed. The result: the step time
  XLA's overlap gives, against compute plus communication end to end.
- :func:`activation_traffic`: the collectives that move activations rather than parameters or
  gradients (permutes, all-to-alls, all-gathers of anything but a parameter's shape).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from typing import Iterable

import numpy as np
from hlo_cost import _BOOKKEEPING, Roofline, _Module, array_bytes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "collective-broadcast",
         "ragged-all-to-all")
GPUS_PER_NODE = 8
_DTYPES = re.compile(r"\b(bf16|f16|f32|f64|s32|u32|s8|u8|pred)\[")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclass
class Collective:
    """One collective instruction, launched ``times`` times per step."""

    name: str
    kind: str
    dtypes: tuple[str, ...]
    buffer: int  # bytes of its operands on one device
    result: str  # its result type (an all-gather's is the gathered array)
    group: int  # devices per replica group (2 for a permute's pairs)
    cross_node: bool
    wire: float  # bytes one GPU sends per launch
    times: int
    asynchronous: bool
    computation: str
    op_name: str


def replica_groups(rest: str, partitions: int) -> list[list[int]]:
    """The device groups of a collective's attribute text (iota, explicit or mesh-named form)."""
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:  # iota: [groups, size] <= [dims] transposed by T(perm)
        ids = np.arange(prod(int(x) for x in m.group(2).split(","))).reshape([int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape([int(x) for x in m.group(1).split(",")]).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", rest)
    if m:  # mesh['a'=8,'b'=2] {'a'}: groups along the named axes
        axes = [(a, int(s)) for a, s in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        names, sizes = [a for a, _ in axes], [s for _, s in axes]
        chosen = re.findall(r"'([^']+)'", m.group(3))
        ids = np.arange(prod(sizes))
        if m.group(2):
            d = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group(2).strip())
            if not d:
                raise ValueError(f"device ids not understood: {m.group(0)}")
            ids = ids.reshape([int(x) for x in d.group(1).split(",")])
            if d.group(2):
                ids = ids.transpose([int(x) for x in d.group(2).split(",")])
        ids = ids.reshape(sizes)
        keep = [i for i, a in enumerate(names) if a not in chosen]
        pick = [names.index(a) for a in chosen]
        return ids.transpose(keep + pick).reshape(-1, prod(sizes[i] for i in pick)).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest)
    if m and m.group(1):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", rest)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return [list(range(partitions))]  # empty groups: every device


def _wire(kind: str, buffer: int, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * buffer
    if kind == "all-gather":
        return (n - 1) * buffer
    if kind in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):
        return (n - 1) / n * buffer
    return float(buffer)


def collectives(text: str, module: _Module | None = None) -> list[Collective]:
    """Every collective one run of the optimized module ``text`` launches (see the module docstring)."""
    mod = module or _Module(text)
    m = re.search(r"num_partitions=(\d+)", text)
    partitions = int(m.group(1)) if m else 1
    out: list[Collective] = []

    def found(ins) -> tuple[str, str, str] | None:  # (kind, attribute text, result type)
        base = ins.opcode.removesuffix("-start")
        if base in KINDS:
            return base, ins.rest, ins.shape
        if ins.opcode == "async-start":
            called = re.search(r"calls=%([\w.\-]+)", ins.rest)
            for inner in mod.computations.get(called.group(1), []) if called else []:
                if inner.opcode in KINDS:
                    return inner.opcode, inner.rest, inner.shape
        return None

    def walk(computation: str, times: int, depth: int) -> None:
        for ins in mod.computations.get(computation, []):
            if depth > 32:
                return
            if ins.opcode == "while":
                trips = _TRIPS.search(ins.rest)
                body = re.search(r"body=%([\w.\-]+)", ins.rest).group(1)
                walk(body, times * (int(trips.group(1)) if trips else 1), depth + 1)
                continue
            if ins.opcode in ("call", "conditional"):
                for sub in re.findall(r"(?:to_apply|calls|branch_computations)=\{?%([\w.\-]+)", ins.rest):
                    walk(sub, times, depth + 1)
                continue
            hit = found(ins)
            if not hit:
                continue
            kind, rest, result = hit
            args = mod.operands(ins)
            buffer = sum(array_bytes(mod.shape[a]) for a in args)
            groups = replica_groups(rest, partitions)
            n = 2 if kind == "collective-permute" else max(len(g) for g in groups)
            cross = any(len({d // GPUS_PER_NODE for d in g}) > 1 for g in groups)
            op = re.search(r'op_name="([^"]*)"', ins.rest)
            out.append(Collective(
                ins.name, kind, tuple(sorted(set(_DTYPES.findall(" ".join(mod.shape[a] for a in args))))), buffer,
                result, n, cross, _wire(kind, buffer, n), times,
                ins.opcode.endswith("-start") or ins.opcode == "async-start", computation,
                op.group(1) if op else ""))

    walk(mod.entry, 1, 0)
    return out


@dataclass(frozen=True)
class Network:
    """Per-GPU, per-direction bandwidths (bytes/s) and per-collective latencies (s)."""

    nvlink: float = 450e9  # NVLink 4 (H100 SXM)
    infiniband: float = 50e9  # one 400 Gb/s NDR port per GPU
    nvlink_latency: float = 15e-6
    infiniband_latency: float = 30e-6
    hierarchical: bool = False

    def seconds(self, c: Collective) -> float:
        if c.group <= 1:
            return 0.0
        if not c.cross_node:
            return self.nvlink_latency + c.wire / self.nvlink
        if self.hierarchical and c.kind == "all-reduce" and c.group % GPUS_PER_NODE == 0:
            g, nodes = GPUS_PER_NODE, c.group // GPUS_PER_NODE
            return (2 * self.nvlink_latency + self.infiniband_latency + 2 * (g - 1) / g * c.buffer / self.nvlink
                    + 2 * (nodes - 1) / nodes * (c.buffer / g) / self.infiniband)
        return self.infiniband_latency + c.wire / self.infiniband


def _priced_call(mod: _Module, ins, roofline: Roofline) -> tuple[float, int]:
    """Seconds and kernels of a loop or call instruction's body, collectives left out."""
    subs = []
    if ins.opcode == "while":
        trips = _TRIPS.search(ins.rest)
        subs = mod.walk(re.search(r"body=%([\w.\-]+)", ins.rest).group(1), int(trips.group(1)) if trips else 1,
                        roofline)
    else:
        for sub in re.findall(r"(?:to_apply|calls|branch_computations)=\{?%([\w.\-]+)", ins.rest):
            subs += mod.walk(sub, 1, roofline)
    subs = [k for k in subs if k.kind.removesuffix("-start").removesuffix("-done") not in KINDS]
    return sum(roofline.seconds(k.flops, k.bytes) * k.launches for k in subs), sum(k.launches for k in subs)


def replay(text: str, cs: list[Collective], roofline: Roofline, network: Network, calibration: float = 1.0,
           module: _Module | None = None) -> dict:
    """The step on a compute and a communication stream, in the module's schedule (module docstring):
    seconds of ``step`` (replayed), ``compute``, ``comm`` (all collectives end to end), ``exposed``
    (communication the compute stream waited for), ``serial`` (compute + comm), and ``kernels``."""
    mod = module or _Module(text)
    top = {c.name: c for c in cs if c.computation == mod.entry}
    t = comm_free = compute = comm = exposed = 0.0
    kernels = 0
    pending: dict[str, float] = {}
    for ins in mod.computations[mod.entry]:
        base = ins.opcode.removesuffix("-start").removesuffix("-done")
        if ins.name in top:
            c = top[ins.name]
            d = network.seconds(c)
            comm += d
            begin = max(t, comm_free)
            comm_free = begin + d
            if c.asynchronous:
                pending[ins.name] = comm_free
            else:
                exposed += comm_free - t
                t = comm_free
            continue
        if (ins.opcode.endswith("-done") and base in KINDS) or ins.opcode == "async-done":
            for a in mod.operands(ins):
                if a in pending and pending[a] > t:
                    exposed += pending[a] - t
                    t = pending[a]
            continue
        if ins.opcode in _BOOKKEEPING:
            continue
        if ins.opcode in ("while", "call", "conditional", "async-start"):
            d, n = _priced_call(mod, ins, roofline)
        else:
            k = mod.kernel(ins, 1)
            d, n = roofline.seconds(k.flops, k.bytes), 1
        kernels += n
        compute += d * calibration
        t += d * calibration
    for c in cs:  # inside loops: synchronous with the loop's kernels
        if c.computation != mod.entry:
            d = network.seconds(c) * c.times
            comm += d
            exposed += d
            t += d
    return {"step": t, "compute": compute, "comm": comm, "exposed": exposed, "serial": compute + comm,
            "kernels": kernels}


def activation_traffic(cs: Iterable[Collective], parameter_shapes: Iterable[tuple[int, ...]] = ()) -> list[Collective]:
    """The collectives that move activations: every permute and all-to-all, and every all-gather whose
    gathered arrays are not parameters (ZeRO-3 gathers parameters): matched by shape, or by size where
    XLA gathered a parameter reshaped (flattened, or an axis split off)."""
    shapes = {tuple(s) for s in parameter_shapes}
    sizes = {prod(s) for s in shapes}
    out = []
    for c in cs:
        if c.kind in ("collective-permute", "all-to-all", "ragged-all-to-all", "collective-broadcast"):
            out.append(c)
        elif c.kind == "all-gather":
            arrays = [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\[([\d,]*)\]", c.result)]
            if c.asynchronous and len(arrays) % 2 == 0:  # an async start's type: (operands, results)
                arrays = arrays[len(arrays) // 2:]
            if any(a not in shapes and prod(a) not in sizes for a in arrays):
                out.append(c)
    return out


def by_kind(cs: Iterable[Collective]) -> dict[str, dict]:
    """Launches, buffer bytes and wire bytes per 'kind dtype [x-node]'."""
    rows: dict[str, dict] = {}
    for c in cs:
        key = f"{c.kind} {'/'.join(c.dtypes)}{' x-node' if c.cross_node else ''}"
        row = rows.setdefault(key, {"launches": 0, "buffer": 0, "wire": 0.0})
        row["launches"] += c.times
        row["buffer"] += c.buffer * c.times
        row["wire"] += c.wire * c.times
    return rows
