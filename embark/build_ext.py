"""Build the compiled fused backward of FP16/BF16 tables into its cache folder.

    python -m embark.build_ext [-v]

Without it the library builds the kernel on first use
(:func:`embark.training.half_kernel.load_extension`). A command-line module only: the library
never imports it. Exit status 1 when the build failed.
"""

from __future__ import annotations

import argparse
import logging
import sys

from embark.training.half_kernel import EXT_NAME, build_dir, build_extension

__all__ = ["main"]

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    """Build (or find built) the extension; 0 on success, 1 when the build failed."""
    ap = argparse.ArgumentParser(description="Build the compiled half-table update of embark.")
    ap.add_argument("-v", "--verbose", action="store_true", help="show compiler output")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        build_extension(verbose=args.verbose)
    except (RuntimeError, OSError, ImportError) as e:
        log.error("embark: build failed: %s", e)
        return 1
    log.info("embark: built %s in %s", EXT_NAME, build_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
