"""``python -m hps.server --config out/ps.json``: the KServe v2 inference server
(:mod:`hps.serving.server`) on the models of a ``ps.json``."""

from __future__ import annotations

from hps.serving.server import main

if __name__ == "__main__":
    raise SystemExit(main())
