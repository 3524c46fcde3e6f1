#!/usr/bin/env bash
# Install the CUDA plugin's compiler for the venv's jax (jax-cuda12-plugin and jax-cuda12-pjrt at the
# same version, ~180 MB, without the nvidia-* CUDA libraries) into .venv/gpu-aot, for compiling GPU
# programs on a machine without a GPU (benchmarks/gpu_cost.py, tests/extended/test_gpu_cost.py).
# Outside site-packages on purpose: there, every JAX process would load the plugin and print its
# "Could not find cuda drivers" lines on stderr; benchmarks/gpu_cost.py puts this folder on its own path.
# Also NVIDIA's assembler (ptxas, from the nvidia-cuda-nvcc wheel, ~40 MB) into .venv/gpu-ptxas, for
# benchmarks/gpu_registers.py: apart from the plugin, so that XLA keeps compiling with its own.
# Idempotent: a second run with the same jax does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('jax'))")
target=.venv/gpu-aot
ptxas_version=12.9.86
ptxas_dir=.venv/gpu-ptxas
if [ "$(cat "$ptxas_dir/VERSION" 2>/dev/null)" != "$ptxas_version" ]; then
  rm -rf "$ptxas_dir"
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps --target "$ptxas_dir" \
    "nvidia-cuda-nvcc-cu12==$ptxas_version" 2>&1 | grep -v "is ignored: it is neither" || true
  [ -x "$ptxas_dir/nvidia/cuda_nvcc/bin/ptxas" ] || { echo "setup_gpu_aot: error: no ptxas in $ptxas_dir" >&2; exit 1; }
  echo "$ptxas_version" > "$ptxas_dir/VERSION"
fi
if [ "$(cat "$target/VERSION" 2>/dev/null)" = "$version" ]; then
  exit 0
fi
rm -rf "$target"
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps --target "$target" \
  "jax-cuda12-plugin==$version" "jax-cuda12-pjrt==$version" 2>&1 | grep -v "is ignored: it is neither" || true
[ -d "$target/jax_plugins" ] || { echo "setup_gpu_aot: error: jax-cuda12-plugin==$version did not install into $target" >&2; exit 1; }
echo "$version" > "$target/VERSION"
