"""Kernels, bytes and FLOPs of an optimized XLA-GPU module, read from its text, and a roofline price.

A GPU executable compiled without a GPU (benchmarks/gpu_cost.py) has no ``cost_analysis()``, and XLA's own
count would see a while loop's body once, so the module text (``compiled.as_text()``) is read instead:

- a **kernel** is a top-level instruction of the entry computation, or of a computation it runs through
  ``while`` (times the loop's ``known_trip_count``; 1 when XLA does not know it), ``call`` or
  ``conditional`` (the costliest branch), that is not bookkeeping (parameters, tuples, bitcasts...);
  a loop's condition computation is not counted;
- its **bytes** are its operands plus its results, at full size except where a fusion touches part of
  one: an operand the fusion only slices (``slice``/``dynamic-slice``, through bitcasts) counts the
  slices it takes; a buffer it updates in place (``dynamic-update-slice``, a loop stacking its
  results) counts the update written, not the whole buffer; the scratch buffer a cuBLAS or
  cuDNN call returns is left out;
- its **FLOPs** are those of its matmuls and convolutions (inside a fusion, or cuBLAS/cuDNN calls, and cuDNN
  fused attention from its dot dimensions); elementwise arithmetic counts nothing, convolution padding
  counts as work;
- its **time** is ``max(FLOPs / flops_per_s, bytes / bytes_per_s) + launch_s``.

Each kernel carries the ``op_name`` it is charged to (benchmarks/step_profile.py's ``instruction_scopes``:
a fusion's first matmul, else its own, else a neighbour's), so kernels can be grouped by the model's
``jax.named_scope``s. A Pallas/Triton kernel is priced by its operands and results, whatever it re-reads
inside: only a GPU tells how much that costs.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from math import prod

from step_profile import instruction_scopes

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_BOOKKEEPING = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
                "replica-id", "opt-barrier", "async-done", "async-update", "copy-done", "add-dependency", ""}
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "negate", "convert", "maximum", "minimum", "select",
                "compare", "exponential", "log", "tanh", "abs", "sqrt", "rsqrt", "power", "and", "or", "xor", "not",
                "clamp", "sign", "floor", "ceil", "round-nearest-even", "exponential-minus-one", "log-plus-one",
                "logistic", "erf", "cosine", "sine", "copy"}
# A named scope as one op_name path component, possibly wrapped by transforms ("transpose(jvp(sga))").
SCOPES = ("sga", "mr_blocks", "head", "loss", "optimizer", "ema")
_SCOPE = re.compile(r"(?:^|[/(])(" + "|".join(SCOPES) + r")(?=[)/;]|$)")


@dataclass(frozen=True)
class Roofline:
    """What a kernel costs on a device: compute and memory ceilings and a fixed launch overhead."""

    flops_per_s: float
    bytes_per_s: float
    launch_s: float

    def seconds(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s) + self.launch_s


@dataclass
class Kernel:
    """One kernel of a module; ``launches`` times per run of the module (its loops' trip counts)."""

    name: str
    kind: str
    op_name: str
    flops: float  # per launch
    bytes: float  # per launch
    launches: int = 1

    @property
    def scope(self) -> str:
        """The outermost named scope in the kernel's op_name, else "other"."""
        m = _SCOPE.search(self.op_name)
        return m.group(1) if m else "other"


@dataclass
class _Instruction:
    name: str
    shape: str  # the result type, a tuple in parentheses or one array
    opcode: str
    rest: str  # the whole right-hand side


def _result_type(rhs: str) -> str:
    if not rhs.startswith("("):
        return rhs.split(" ", 1)[0]
    depth = 0
    for i, ch in enumerate(rhs):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rhs[:i + 1]
    return rhs


def array_bytes(type_text: str) -> int:
    """Bytes of every array in a type (``bf16[16,256]{1,0}`` or a tuple of them)."""
    return sum(_BYTES[t] * prod(int(d) for d in dims.split(",") if d) for t, dims in _ARRAY.findall(type_text))


def array_elements(type_text: str) -> int:
    """Elements of the first array in a type (0 for none)."""
    m = _ARRAY.search(type_text)
    return prod(int(d) for d in m.group(2).split(",") if d) if m else 0


def _dims(type_text: str) -> list[int]:
    m = _ARRAY.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def parse_module(text: str) -> tuple[dict[str, list[_Instruction]], str]:
    """(computation name -> its instructions, the entry computation's name) of a module's text."""
    computations: dict[str, list[_Instruction]] = defaultdict(list)
    current = entry = ""
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(2)
            entry = current if m.group(1) else entry
            continue
        m = _INSTRUCTION.match(line)
        if m and current:
            name, rhs = m.groups()
            shape = _result_type(rhs)
            op = re.match(r"\s*([a-z][\w\-]*)\(", rhs[len(shape):])
            computations[current].append(_Instruction(name, shape, op.group(1) if op else "", rhs))
    return computations, entry


class _Module:
    def __init__(self, text: str) -> None:
        self.computations, self.entry = parse_module(text)
        self.shape = {i.name: i.shape for body in self.computations.values() for i in body}
        self.charged, _ = instruction_scopes(text)

    def operands(self, ins: _Instruction) -> list[str]:
        args = ins.rest[len(ins.shape):].split(", metadata=", 1)[0]
        args = re.split(r"\b(?:calls|to_apply|body|condition|custom_call_target|branch_computations|"
                        r"true_computation|control-predecessors)=", args)[0]
        return [a for a in re.findall(r"%([\w.\-]+)", args) if a in self.shape]

    def dot_flops(self, ins: _Instruction, out: str, lhs: str) -> float:
        contract = (re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
                    or re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.rest))
        dims = _dims(self.shape.get(lhs, ""))
        k = prod(dims[int(d.strip('" '))] for d in contract.group(1).split(",") if d.strip('" ')) if contract else 1
        return 2.0 * prod(_dims(out)) * k

    def conv_flops(self, ins: _Instruction, forward_out: str, kernel: str) -> float:
        """2 x (the forward convolution's output elements) x (filter elements per output feature)."""
        labels = re.search(r"dim_labels=\w+_(\w+)->", ins.rest)
        filt = _dims(kernel)
        o = filt[labels.group(1).index("o")] if labels and filt and "o" in labels.group(1) else 1
        return 2.0 * prod(_dims(forward_out)) * prod(filt) / max(o, 1)

    def attention_flops(self, ins: _Instruction, args: list[str]) -> float:
        """cuDNN fused attention: two B N T S H matmuls forward, five backward (logits recomputed)."""
        q, k = _dims(self.shape[args[0]]), _dims(self.shape[args[1]])
        rhs = re.search(r'"bmm1_dot_dimension_numbers":\{(.*?)\}', ins.rest)
        if rhs:
            field = lambda key: [int(x) for x in re.findall(r'"(\d+)"', re.search(  # noqa: E731
                rf'"{key}":\[([^\]]*)\]', rhs.group(1)).group(1))]
            keep = set(field("rhs_contracting_dimensions")) | set(field("rhs_batch_dimensions"))
            s = prod(d for i, d in enumerate(k) if i not in keep)
        else:  # (B, S, N, H), as jax lays out its cuDNN calls
            s = k[1]
        return (10 if "Backward" in ins.rest.split("custom_call_target=", 1)[1][:80] else 4) * prod(q) * s

    def fusion_bytes(self, computation: str, args: list[str], out: str) -> float:
        """Operands and results of a fusion calling ``computation``, each counted for the part of it
        the fusion touches (module docstring)."""
        body = self.computations.get(computation, [])
        users: dict[str, list[_Instruction]] = defaultdict(list)
        for ins in body:
            for a in self.operands(ins):
                users[a].append(ins)

        root = body[-1] if body else None  # XLA prints a computation's ROOT last
        results = set() if root is None else set(self.operands(root)) if root.opcode == "tuple" else {root.name}

        def touched(name: str, seen: int = 0) -> float:
            """The fraction of ``name``'s elements the fusion reads: its slices' share, through
            bitcasts and elementwise ops (computed only where their results are used), 0 for a
            buffer updated in place, else all of it."""
            if name in results:  # a result of the fusion is computed whole
                return 1.0
            size = max(array_elements(self.shape.get(name, "")), 1)
            total = 0.0
            for u in users.get(name, []):
                if seen > 64:
                    return 1.0
                if u.opcode == "bitcast" or (u.opcode in _ELEMENTWISE and array_elements(u.shape) == size):
                    total += touched(u.name, seen + 1)
                elif u.opcode in ("slice", "dynamic-slice") and self.operands(u)[:1] == [name]:
                    total += array_elements(u.shape) / size
                elif u.opcode == "dynamic-update-slice" and self.operands(u)[:1] == [name]:
                    continue  # the buffer updated in place: only the update moves (counted as written)
                else:
                    return 1.0
                if total >= 1.0:
                    return 1.0
            return total

        params = {int(m.group(1)): ins.name for ins in body if ins.opcode == "parameter"
                  for m in [re.search(r"parameter\((\d+)\)", ins.rest)] if m}
        read = sum(array_bytes(self.shape[a]) * (touched(params[i]) if i in params else 1.0)
                   for i, a in enumerate(args))
        # A result that is a dynamic-update-slice in place writes its update only.
        updates = {ins.name: ins for ins in body if ins.opcode == "dynamic-update-slice"}
        written = float(array_bytes(out))
        if root is not None:
            parts = self.operands(root) if root.opcode == "tuple" else [root.name]
            if any(p in updates for p in parts):
                written = 0.0
                for p in parts:
                    if p in updates:
                        upd = self.operands(updates[p])
                        written += array_bytes(self.shape[upd[1]]) if len(upd) > 1 else array_bytes(updates[p].shape)
                    else:
                        written += array_bytes(self.shape.get(p, ""))
        return read + written

    def inner_flops(self, computation: str) -> float:
        total = 0.0
        for ins in self.computations.get(computation, []):
            args = self.operands(ins)
            if ins.opcode == "dot" and args:
                total += self.dot_flops(ins, ins.shape, args[0])
            elif ins.opcode == "convolution" and len(args) > 1:
                total += self.conv_flops(ins, ins.shape, self.shape[args[1]])
            elif ins.opcode == "fusion":
                called = re.search(r"calls=%([\w.\-]+)", ins.rest)
                total += self.inner_flops(called.group(1)) if called else 0.0
        return total

    def kernel(self, ins: _Instruction, launches: int) -> Kernel:
        args = self.operands(ins)
        out = ins.shape
        kind, flops = ins.opcode, 0.0
        if ins.opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', ins.rest).group(1)
            kind = target
            first = _result_type(out[1:]) if out.startswith("(") else out
            if out.startswith("(") and re.search(r"\b[su]8\[\d+\]\{0\}\)$", out):  # drop the scratch buffer
                out = out[:out.rindex(",")] + ")"
            if "fmha" in target and len(args) > 1:
                flops = self.attention_flops(ins, args)
            elif ("gemm" in target or "matmul" in target) and args:
                flops = self.dot_flops(ins, first, args[0])
            elif "convBackwardInput" in target and len(args) > 1:
                flops = self.conv_flops(ins, self.shape[args[0]], self.shape[args[1]])
            elif "convBackwardFilter" in target and len(args) > 1:
                flops = self.conv_flops(ins, self.shape[args[1]], first)
            elif "conv" in target and len(args) > 1:
                flops = self.conv_flops(ins, first, self.shape[args[1]])
        elif ins.opcode == "fusion":
            called = re.search(r"calls=%([\w.\-]+)", ins.rest)
            flops = self.inner_flops(called.group(1)) if called else 0.0
            custom = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', ins.rest)
            kind = "fusion:" + (custom.group(1) if custom else re.sub(r"[_.]?\d+$", "", ins.name.split(".")[0]))
        elif ins.opcode == "dot" and args:
            flops = self.dot_flops(ins, out, args[0])
        elif ins.opcode == "convolution" and len(args) > 1:
            flops = self.conv_flops(ins, out, self.shape[args[1]])
        called = re.search(r"calls=%([\w.\-]+)", ins.rest) if ins.opcode == "fusion" else None
        if called and called.group(1) in self.computations:
            nbytes = self.fusion_bytes(called.group(1), args, out)
        else:
            nbytes = array_bytes(out) + sum(array_bytes(self.shape[a]) for a in args)
        return Kernel(ins.name, kind, self.charged.get(ins.name, ""), flops, float(nbytes), launches)

    def walk(self, computation: str, launches: int, roofline: Roofline, depth: int = 0) -> list[Kernel]:
        out: list[Kernel] = []
        for ins in self.computations.get(computation, []):
            if ins.opcode in _BOOKKEEPING or depth > 32:
                continue
            if ins.opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.rest)
                body = re.search(r"body=%([\w.\-]+)", ins.rest).group(1)
                out += self.walk(body, launches * (int(trips.group(1)) if trips else 1), roofline, depth + 1)
            elif ins.opcode in ("call", "async-start"):
                called = re.search(r"(?:to_apply|calls)=%([\w.\-]+)", ins.rest)
                out += self.walk(called.group(1), launches, roofline, depth + 1) if called else []
            elif ins.opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", ins.rest)
                names = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else re.findall(
                    r"(?:true|false)_computation=%([\w.\-]+)", ins.rest)
                priced = [self.walk(b, launches, roofline, depth + 1) for b in names]
                out += max(priced, key=lambda ks: sum(k.launches * roofline.seconds(k.flops, k.bytes) for k in ks),
                           default=[])
            else:
                out.append(self.kernel(ins, launches))
        return out


def kernels_of(hlo_text: str, roofline: Roofline) -> list[Kernel]:
    """Every kernel one run of the optimized module ``hlo_text`` launches (see the module docstring)."""
    module = _Module(hlo_text)
    return module.walk(module.entry, 1, roofline)


def summarize(kernels: list[Kernel], roofline: Roofline) -> dict:
    """Totals, and the same per named scope and per kernel kind: kernels (launches), bytes, FLOPs, seconds."""

    def add(row: dict, k: Kernel) -> None:
        row["kernels"] += k.launches
        row["bytes"] += k.bytes * k.launches
        row["flops"] += k.flops * k.launches
        row["seconds"] += roofline.seconds(k.flops, k.bytes) * k.launches

    new = lambda: {"kernels": 0, "bytes": 0.0, "flops": 0.0, "seconds": 0.0}  # noqa: E731
    total, scopes, kinds = new(), defaultdict(new), defaultdict(new)
    for k in kernels:
        add(total, k)
        add(scopes[k.scope], k)
        add(kinds[k.kind], k)
    order = lambda rows: dict(sorted(rows.items(), key=lambda kv: -kv[1]["seconds"]))  # noqa: E731
    top = sorted(kernels, key=lambda k: -roofline.seconds(k.flops, k.bytes) * k.launches)[:10]
    return {"total": total, "by_scope": order(scopes), "by_kind": order(kinds),
            "top_kernels": [{**asdict(k), "scope": k.scope} for k in top], "roofline": asdict(roofline)}
