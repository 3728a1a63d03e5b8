"""An inference process for the scale-out test: serves a ps.json (Redis-cluster volatile DB,
Redis-Stream updates) and answers JSON commands on stdin, one per line."""

from __future__ import annotations

import json
import sys

import torch

from hps.parameter_server import HierarchicalParameterServer


def main() -> None:
    ps = HierarchicalParameterServer.from_config(sys.argv[1], load=False)
    session = ps.session("m")
    applier = ps.update_applier()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "lookup":
            rows = session.lookup(cmd["table"], torch.tensor(cmd["keys"], dtype=torch.int64))
            print(json.dumps({"rows": rows.tolist()}), flush=True)
        elif cmd["op"] == "poll":
            print(json.dumps({"applied": applier.poll()}), flush=True)
        else:
            break
    ps.close()


if __name__ == "__main__":
    main()
