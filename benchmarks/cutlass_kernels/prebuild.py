"""Compile the TW GEMM instance objects on a machine without a GPU, to carry them to one.

``nvcc -c`` of every manifest instance of ``--arch`` (the same objects, keyed the same way, that
``cutlass_kernels.build`` compiles on the GPU machine) into ``$TILEREC_CUTLASS_CACHE`` (default
``.cutlass-cache/`` in the repository root, git-ignored), plus ``prebuilt.json`` naming the
objects, the nvcc version and the input keys. ``gpu_check.sh`` uses that folder when it exists.
An object is reused there only when the GPU machine's nvcc has the same version (the version is
part of every object's key); otherwise ``gpu_check`` compiles it again.

    TILEREC_CUTLASS_CACHE=$PWD/.cutlass-cache python -m benchmarks.cutlass_kernels.prebuild \\
        --arch sm_90a [--jobs N] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 every instance compiled, 1 one failed (the rest are kept), 4 no nvcc."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--arch", default="sm_90a", choices=["sm_80", "sm_90a"])
    p.add_argument("--jobs", type=int, default=None, help="parallel nvcc (default: CPU count)")
    p.add_argument("--only", nargs="*", default=None, help="instance names (default: all)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("TILEREC_CUTLASS_CACHE", str(ROOT / ".cutlass-cache"))
    from cutlass_kernels import build, toolchain
    from cutlass_kernels.manifest import manifest

    nvcc = toolchain.find_nvcc()
    if nvcc is None:
        print("prebuild: nvcc not found", file=sys.stderr)
        return 4
    version = toolchain.nvcc_version(nvcc)
    kernels = [k for k in manifest(args.arch, version) if args.only is None or k.name in args.only]
    t0 = time.perf_counter()
    objects, failed = build.compile_objects(kernels, nvcc=nvcc, jobs=args.jobs, skip_failed=True)
    cache = toolchain.cache_dir()
    listing = {
        "arch": args.arch,
        "nvcc": list(version),
        "seconds": round(time.perf_counter() - t0, 1),
        "objects": {
            n: {"key": r.key, "path": str(r.path.relative_to(cache))} for n, r in objects.items()
        },
        "failed": failed,
    }
    tmp = cache / "prebuilt.json.tmp"
    tmp.write_text(json.dumps(listing, indent=1) + "\n")
    tmp.replace(cache / "prebuilt.json")
    print(f"prebuild: {len(objects)} objects in {cache} ({len(failed)} failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
