"""gRPC served by front processes (``python -m hps.server --grpc-processes N``).

grpcio's Python server spends about 0.4 ms of CPU per call on this project's 2-core host,
inside the interpreter that also batches and infers, so one process serves gRPC at most as
fast as one core runs that work (docs/benchmarks.md). With front processes, each runs
grpcio's asyncio server on the same port (``SO_REUSEPORT``) and carries every call's bytes to
the server's process over a Unix socket: the server's process decodes, checks, batches and
encodes exactly as for its own grpcio threads, so answers, status codes and statistics are
the same; grpcio's work runs in the fronts, beside it.

- :mod:`hps.serving.grpc_front.wire`: the frames on the Unix socket (the standard library only).
- :mod:`hps.serving.grpc_front.front`: a front process (grpcio, ``wire`` and, on the
  server's ``--loop uvloop``, uvloop: it imports neither torch nor the servers).
- :mod:`hps.serving.grpc_front.relay`: the server's side: starts the fronts, answers their
  calls, starts another when one dies, stops them.

Nothing is imported here, so that a front imports only what it runs.
"""
