#!/usr/bin/env bash
# Build the CUTLASS TW kernels, check them against the reference (nonzero exit on any numeric
# mismatch), and benchmark TW vs dense cuBLAS and 2:4 on BERT and DLRM-DCNv2 shapes.
# Then verifies and times K-major TW chains (gpu_chains.py: single layers, BERT FFN blocks,
# the DLRM-DCNv2 MLPs at 50/75/90%, bias + activation fused in the kernel's epilogue, eager and
# through CUDA graphs) into benchmarks/results/cutlass_chains.json.
# Usage: benchmarks/cutlass_kernels/gpu_check.sh [--quick] [--out FILE] [--dtype f16|bf16|both]
#        benchmarks/cutlass_kernels/gpu_check.sh --dry-run   (CPU: the chain path, emulated)
# Budget: < 8 min on one H100/H200, counted from this script's start: the kernel check starts
# no verification child or shape after 280 s (--budget-s gets what is left of it; hard timeout
# at 310 s), the chains get the rest: no chain row starts after 440 s, a hard timeout at 470 s.
# Objects compiled beforehand on a CPU machine (python -m benchmarks.cutlass_kernels.prebuild,
# docs/cutlass.md) are used from .cutlass-cache/ when it was carried along.
#
# Needs a python whose torch sees the GPU, nvcc, and nvidia-cutlass (module cutlass_library, for
# the headers and tag tables). A GPU machine without a package index gets nvidia-cutlass as a
# wheel: on a machine with one, `pip download --no-deps nvidia-cutlass==4.2.0.0 -d .whl` in the
# repo root (.whl/ is git-ignored), ship .whl along, and this script installs it from there.
set -euo pipefail
SECONDS=0
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "--dry-run" ]; then
  shift
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  exec "${PYTHON:-python3}" -m benchmarks.cutlass_kernels.gpu_chains --dry-run "$@"
fi

# One probe per interpreter: "<cuda available 0|1> <cutlass_library 0|1> <torch> <torch cuda>".
PROBE='import importlib.util as u, torch
print(int(torch.cuda.is_available()), int(u.find_spec("cutlass_library") is not None), torch.__version__, torch.version.cuda)'
# An interpreter whose torch sees a GPU: $PYTHON, the repo venv, then the system python3.
PY="" INFO="" FALLBACK="" FALLBACK_INFO=""
for cand in "${PYTHON:-}" .venv/bin/python python3; do
  [ -n "$cand" ] || continue
  info=$("$cand" -c "$PROBE" 2>/dev/null) || continue
  if [ "${info%% *}" = 1 ]; then PY="$cand" INFO="$info"; break; fi
  [ -z "$FALLBACK" ] && FALLBACK="$cand" FALLBACK_INFO="$info"
done
if [ -z "$PY" ]; then
  if [ -n "$FALLBACK" ]; then
    # Let the python side print what it sees (CPU-only torch, no device) and exit nonzero.
    PY="$FALLBACK" INFO="$FALLBACK_INFO"
  else
    echo "gpu_check: no python with torch found (tried \$PYTHON, .venv/bin/python, python3)" >&2
    exit 3
  fi
fi
read -r _cuda have_cutlass torch_version torch_cuda <<<"$INFO"
if [ "$have_cutlass" != 1 ]; then
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
if [ -z "${TILEREC_CUTLASS_CACHE:-}" ] && [ -d .cutlass-cache ]; then
  export TILEREC_CUTLASS_CACHE="$PWD/.cutlass-cache"   # objects prebuilt elsewhere
  echo "gpu_check: using the carried objects in $TILEREC_CUTLASS_CACHE"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
budget=$((280 - SECONDS)); [ "$budget" -gt 0 ] || budget=0
hard=$((310 - SECONDS)); [ "$hard" -gt 30 ] || hard=30
echo "gpu_check: $PY (torch $torch_version, cuda $torch_cuda), nvcc: $(command -v nvcc || echo none); budget ${budget} s, hard limit ${hard} s"
# --budget-s first: a --budget-s among the arguments overrides it. -k: SIGKILL 10 s after SIGTERM.
rc=0
timeout -k 10 "$hard" "$PY" -m benchmarks.cutlass_kernels.gpu_check --budget-s "$budget" "$@" || rc=$?
# The chains get what is left of the 8 minutes (their kernels are built by now, cached).
left=$((470 - SECONDS))
cbudget=$((440 - SECONDS))
if [ "$left" -gt 30 ]; then
  crc=0
  timeout -k 10 "$left" "$PY" -m benchmarks.cutlass_kernels.gpu_chains --reps 10 \
    --budget-s "$cbudget" || crc=$?
  [ "$rc" -ne 0 ] || rc=$crc
else
  echo "gpu_check: no time left for the chains (${SECONDS} s used)" >&2
fi
exit "$rc"
