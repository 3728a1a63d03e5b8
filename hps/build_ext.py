"""Build the compiled lookup kernel of hps into its cache folder.

    python -m hps.build_ext [-v]

Without it the library builds the kernel on first use (:func:`hps.kernels.load_extension`). A
command-line module only: the library never imports it. Exit status 1 when the build failed.
"""

from __future__ import annotations

import sys

from hps.kernels import EXT

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Build (or find built) the extension; 0 on success, 1 when the build failed."""
    return EXT.command_line(argv)


if __name__ == "__main__":
    sys.exit(main())
