"""Build the compiled lookup kernel of hps into its cache folder.

    python -m hps.build_ext [-v]

Without it the library builds the kernel on first use (:func:`hps.kernels.load_extension`). A
command-line module only: the library never imports it. Exit status 1 when the build failed.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hps.kernels import EXT_NAME, build_dir, build_extension

__all__ = ["main"]

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    """Build (or find built) the extension; 0 on success, 1 when the build failed."""
    ap = argparse.ArgumentParser(description="Build the compiled lookup kernel of hps.")
    ap.add_argument("-v", "--verbose", action="store_true", help="show compiler output")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        build_extension(verbose=args.verbose)
    except (RuntimeError, OSError, ImportError) as e:
        log.error("hps: build failed: %s", e)
        return 1
    log.info("hps: built %s in %s", EXT_NAME, build_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
