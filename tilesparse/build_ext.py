"""Build the fast CPU kernel of ``tilesparse::tw_linear`` into its cache folder.

    python -m tilesparse.build_ext [-v]

``make install`` runs it once; without it the library builds the kernel on first use
(:func:`tilesparse.kernels.cpu.load_extension`). A command-line module only: the library never
imports it. Exit status 1 when the build failed.
"""

from __future__ import annotations

import sys

from tilesparse.kernels.cpu import EXT

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Build (or find built) the extension; 0 on success, 1 when the build failed."""
    return EXT.command_line(argv, detail=lambda m: f"fp32 micro-kernel: {m.simd()}")


if __name__ == "__main__":
    sys.exit(main())
