"""What each Pallas (Triton) kernel needs per thread on an H100, found without a GPU (issue 37).

    python benchmarks/gpu_registers.py [--out registers.json] [--tw N] [--tx N] [--warps N]

XLA compiles the ISIC first SGA layer's sparse attention (forward and backward, tap by tap and as matrix
products), its fused MLP (with both dropouts), its layer norm (with the residual) and the fused AdamW
(one call's leaves) for an H100, as
benchmarks/gpu_cost.py does, and writes every kernel's PTX (``--xla_dump_to``); NVIDIA's assembler
(``ptxas -v``, from the nvidia-cuda-nvcc wheel scripts/setup_gpu_aot.sh installs beside the venv)
reports per kernel the registers a thread uses (255 at most), the bytes it spills to local memory and
its stack. A kernel that spills runs its inner loop through memory: compiled so, the product form's
gradient pass at 32 groups a tile spilled 6 KB a thread (its weights met keys as three TF32 products)
and still 152 bytes with bfloat16 weights, none at 16 groups. The table counts the tensor-core
instructions too (``mma.sync``, and Hopper's ``wgmma``, which Triton picks for tiles of 64 rows and
more).

``--tw``/``--tx``/``--warps`` recut both forms' tiles (groups a group tile, inputs an input tile, warps
a program) to see what a cut costs before a GPU times it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_DUMP = None
if __name__ == "__main__":  # XLA reads its flags once, at start: the PTX goes where this process says
    _DUMP = tempfile.mkdtemp(prefix="jaxrat-ptx-")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={_DUMP}".strip()

import gpu_cost  # noqa: E402  (before jax: it puts the CUDA compiler on the path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# Where scripts/setup_gpu_aot.sh installs ptxas: not on the plugin's path, so XLA keeps its own.
PTXAS_DIR = Path(os.environ.get("JAXRAT_PTXAS_DIR") or Path(sys.prefix) / "gpu-ptxas")
PROGRAMS = ("sparse_taps", "sparse_products", "sparse_projection", "sparse_keys_dx", "fused_mlp", "multi_tensor_adamw",
            "multi_tensor_cast", "multi_tensor_ema", "layer_norm")


def find_ptxas() -> str | None:
    """ptxas: $JAXRAT_PTXAS, the one setup_gpu_aot.sh installs, or one on the PATH."""
    for candidate in (os.environ.get("JAXRAT_PTXAS"), PTXAS_DIR / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return shutil.which("ptxas")


def usage(ptx: str, ptxas: str) -> dict:
    """ptxas -v's account of one PTX file's kernel: registers, spill stores and loads, stack (bytes),
    and its tensor-core instructions."""
    target = re.search(r"^\.target (\S+)", ptx, re.M).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        err = subprocess.run([ptxas, "-v", "--gpu-name", target, f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    number = lambda pattern: int(re.search(pattern, err).group(1))
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame"),
            "mma": ptx.count("mma.sync"), "wgmma": ptx.count("wgmma.mma_async")}


def kernels(dump: str, ptxas: str) -> list[dict]:
    """Every Pallas kernel of :data:`PROGRAMS` in the dump folder, with its :func:`usage`."""
    rows = []
    for path in sorted(Path(dump).glob("*.ptx")):
        program = next((p for p in PROGRAMS if f"jit_{p}." in path.name), None)
        ptx = path.read_text()
        entry = re.search(r"\.entry (\w+)", ptx)
        if program and entry and entry.group(1).startswith(("sparse_sga_", "fused_mlp_", "multi_tensor_",
                                                             "layer_norm_")):
            rows.append({"program": program, "kernel": entry.group(1), **usage(ptx, ptxas)})
    return sorted(rows, key=lambda r: (r["program"], r["kernel"]))


def compile_programs(tiles: dict, device: jax.Device) -> None:
    """The programs, compiled for ``device`` (their PTX lands in XLA's dump folder)."""
    from jaxrat.ops.gpu import layer_norm as norm
    from jaxrat.ops.gpu import mlp
    from jaxrat.ops.gpu.sparse_sga import api as sparse_sga
    from jaxrat.ops.gpu.sparse_sga import laid_out_update, lay_out_keys
    from jaxrat.ops.gpu.sparse_sga import projection as sparse_sga_projection
    from jaxrat.ops.gpu.sparse_sga.tiling import Tiling
    from jaxrat.ops.portable.sparse_sga import Geometry
    from jaxrat.optim import gpu_adamw as adamw
    from jaxrat.optim import gpu_cast as cast
    from jaxrat.optim import gpu_ema as ema

    geom = Geometry((256, 256), (7, 7), (3, 3))  # the ISIC first layer, batch 16, 8 heads of 16
    of = Tiling.of.__func__
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    def sparse(products: bool):
        def grads(q, k, v):
            def loss(q, k, v):
                keys = lay_out_keys(k, v, geom, 1)
                return jnp.sum(laid_out_update(q, keys, 0, geom).astype(jnp.float32))
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        grads.__name__ = "sparse_products" if products else "sparse_taps"
        saved = Tiling.of
        Tiling.of = classmethod(lambda cls, g, dh, dv, **kw: of(cls, g, dh, dv, **{
            **kw, **tiles, "products": products}))
        try:
            gpu_cost.compile_for(jax.jit(grads), bf16(16, 86 * 86, 8, 16), bf16(16, 256 * 256, 8, 16),
                                 bf16(16, 256 * 256, 8, 16), device=device)
        finally:
            Tiling.of = saved

    def fused_mlp(x, w1, b1, w2, b2):
        seed = jnp.arange(4, dtype=jnp.uint32)
        loss = lambda *a: jnp.sum(mlp.fused_mlp(*a, seed, (0.1, 0.1)).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, w1, b1, w2, b2)

    def multi_tensor_adamw(s, *leaves):
        n = len(leaves) // 4
        hyper = adamw.Hyper(0.9, 0.999, 1e-8, 0.0, 0.05, True)
        return adamw.multi_tensor_adamw(leaves[:n], adamw.flatten(leaves[n:2 * n]), leaves[2 * n:3 * n],
                                        leaves[3 * n:], s, hyper, [j % 2 == 0 for j in range(n)], [1.0] * n)

    def sparse_projection(x, w, b, phase):  # the ISIC first layer's: 128 channels, 8 heads of 16, 4 turned
        return sparse_sga_projection.project(x, w, b, phase, 8, 4)

    def multi_tensor_cast(*leaves):
        return cast.multi_tensor_cast(leaves, jnp.bfloat16)

    def multi_tensor_ema(decay, *leaves):
        n = len(leaves) // 2
        return ema.multi_tensor_ema(leaves[:n], leaves[n:], decay, True)

    t = Tiling.of(geom, 16, 16, heads=8)
    uses, tape_shapes = 3, sparse_sga._tape_shapes(t, 16 * 8, jnp.bfloat16, sparse_sga._TAPE_NORMALISED)

    def sparse_keys_dx(k, v, phase, w, *tapes):  # the first layer's keys' pass writing its input's gradient
        tapes = [tapes[i:i + len(tape_shapes)] for i in range(0, len(tapes), len(tape_shapes))]
        return sparse_sga.projection_gradient(k, v, phase, tapes, t, uses, True, False, (16, 256 * 256, 256),
                                              jnp.bfloat16, bias=True, weights=w)

    def layer_norm(x, residual, scale, bias):
        loss = lambda *a: jnp.sum(norm.layer_norm(*a[:3], 1e-5, a[3]).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, scale, bias, residual)

    sparse(False)
    sparse(True)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    gpu_cost.compile_for(jax.jit(sparse_projection), bf16(16, 256 * 256, 128), f32(128, 256), f32(256),
                         f32(256 * 256, 8, 8), device=device)
    gpu_cost.compile_for(jax.jit(sparse_keys_dx), bf16(16 * 8, 256 * 256 * 16), bf16(16 * 8, 256 * 256 * 16),
                         f32(256 * 256, 8, 8), bf16(128, 256), *tape_shapes * uses, device=device)
    # one call's worth of leaves (its most kernel arguments), of a RAT's shapes
    shapes = [(128, 128), (128,), (2,), (512, 128)] * (adamw.LEAVES_PER_CALL // 4)
    f32 = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    gpu_cost.compile_for(jax.jit(multi_tensor_adamw), jax.ShapeDtypeStruct((adamw.SCALARS,), jnp.float32),
                         *f32 * 4, device=device)
    shapes = [(128, 128), (128,), (3, 3, 128, 128), (512, 128)] * (cast.LEAVES_PER_CALL // 4)
    gpu_cost.compile_for(jax.jit(multi_tensor_cast), *[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes],
                         device=device)
    shapes = [(128, 128), (128,), (3, 3, 128, 128), (512, 128)] * (ema.LEAVES_PER_CALL // 4)
    gpu_cost.compile_for(jax.jit(multi_tensor_ema), jax.ShapeDtypeStruct((), jnp.float32),
                         *[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes] * 2, device=device)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # the layer's weights, rounded on chip
    gpu_cost.compile_for(jax.jit(fused_mlp), bf16(16 * 7396, 128), f32(128, 512), f32(512), f32(512, 128),
                         f32(128), device=device)
    gpu_cost.compile_for(jax.jit(layer_norm), bf16(16, 7396, 128), bf16(16, 7396, 128), f32(128), f32(128),
                         device=device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="", help="write the rows as JSON here")
    p.add_argument("--tw", type=int, default=None, help="groups a group tile (default: each form's own)")
    p.add_argument("--tx", type=int, default=None, help="inputs an input tile")
    p.add_argument("--warps", type=int, default=None, help="warps a program")
    args = p.parse_args(argv)
    if _DUMP is None:
        raise SystemExit("gpu_registers: run it as a script (python benchmarks/gpu_registers.py): XLA's dump "
                         "folder is set before jax starts.")
    ptxas = find_ptxas()
    if ptxas is None:
        print(f"gpu_registers: error: ptxas not found; run bash scripts/setup_gpu_aot.sh (it installs it into "
              f"{PTXAS_DIR}).", file=sys.stderr)
        return 2
    why = gpu_cost.plugin_missing()
    if why:
        print(f"gpu_registers: error: {why}", file=sys.stderr)
        return 2
    tiles = {k: v for k, v in (("tw", args.tw), ("tx", args.tx), ("warps", args.warps)) if v is not None}
    compile_programs(tiles, gpu_cost.target_device(gpu_cost.load_gpu()))
    rows = kernels(_DUMP, ptxas)
    print("| program | kernel | registers | spill stores B | spill loads B | stack B | mma.sync | wgmma |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['program']} | {r['kernel']} | {r['registers']} | {r['spill_stores']} | {r['spill_loads']} | "
              f"{r['stack']} | {r['mma']} | {r['wgmma']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"tiles": tiles, "ptxas": ptxas, "jax": jax.__version__,
                                              "rows": rows}, indent=1))
    shutil.rmtree(_DUMP, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
