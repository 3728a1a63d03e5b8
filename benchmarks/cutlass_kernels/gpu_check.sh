#!/usr/bin/env bash
# Build the CUTLASS TW kernels, check them against the reference (nonzero exit on any numeric
# mismatch), and benchmark TW vs dense cuBLAS and 2:4 on BERT and DLRM-DCNv2 shapes.
# Usage: benchmarks/cutlass_kernels/gpu_check.sh [--quick] [--out FILE] [--dtype f16|bf16]
# Budget: < 8 min on one H100/H200 (new shapes stop at 440 s, a hard 470 s timeout below).
#
# Needs a python whose torch sees the GPU, nvcc, and nvidia-cutlass (module cutlass_library, for
# the headers and tag tables). A GPU machine without a package index gets nvidia-cutlass as a
# wheel: on a machine with one, `pip download --no-deps nvidia-cutlass==4.2.0.0 -d .whl` in the
# repo root (.whl/ is git-ignored), ship .whl along, and this script installs it from there.
set -euo pipefail
cd "$(dirname "$0")/../.."

# An interpreter whose torch sees a GPU: $PYTHON, the repo venv, then the system python3.
PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3; do
  if [ -n "$cand" ] && "$cand" -c "import torch" >/dev/null 2>&1; then
    if "$cand" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
      PY="$cand"; break
    fi
    [ -z "${FALLBACK:-}" ] && FALLBACK="$cand"
  fi
done
if [ -z "$PY" ]; then
  if [ -n "${FALLBACK:-}" ]; then
    # Let the python side print what it sees (CPU-only torch, no device) and exit nonzero.
    PY="$FALLBACK"
  else
    echo "gpu_check: no python with torch found (tried \$PYTHON, .venv/bin/python, python3)" >&2
    exit 3
  fi
fi
if ! "$PY" -c "import cutlass_library" >/dev/null 2>&1; then
  whl=$(ls .whl/nvidia_cutlass-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$whl" ]; then
    site="${TMPDIR:-/tmp}/tilerec-cutlass-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$whl"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_check: nvidia-cutlass installed from $whl into $site"
  fi
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if ! command -v nvcc >/dev/null; then
  for d in "${CUDA_HOME:-}" /usr/local/cuda; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then export PATH="$d/bin:$PATH"; break; fi
  done
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"   # parallel nvcc in the torch extension build
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_check: $PY ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')), nvcc: $(command -v nvcc || echo none)"
exec timeout 470 "$PY" -m benchmarks.cutlass_kernels.gpu_check "$@"
