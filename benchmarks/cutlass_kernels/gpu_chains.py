"""GPU check of K-major TW chains (``tilesparse.TWChain``): verify and time whole blocks.

Blocks (``BLOCKS``): single layers, the BERT-base/large FFN blocks (fc1 + GELU + fc2, 12,800
tokens) and the DLRM-DCNv2 dense part (bottom MLP 13-512-256-128 and top MLP
3456-1024-1024-512-256, ReLU, batch 65,536; the cross layers are not a plain chain and are not
included), at 50/75/90 % TW sparsity (G = 128), fp16 and bf16. Per block and sparsity:

* ``verify`` — the chain on ``cutlass`` (bias and activation fused in the kernel's epilogue),
  eager and through a CUDA graph, against the same chain on ``emulated`` (integer-valued
  inputs and weights in {-1, 0, 1}): ``equal`` only when bit-equal, GELU blocks included (the
  emulation computes the kernel's GELU op for op, ``cutlass_kernels.epilogue``), on a batch
  slice small enough to emulate quickly.
* ``dense_us`` — the dense ``nn.Sequential`` of ``nn.Linear`` (cuBLAS), pruned entries zero;
  ``tw_us`` — the chain on ``cutlass``, eager; ``tw_graph_us`` — the same with
  ``cuda_graph=True`` (launches replayed from one graph); ``sparse24_us`` — each weight as 2:4
  (``torch.sparse.to_sparse_semi_structured``, where it runs; its error text otherwise);
  ``speedup`` = dense / TW eager, ``speedup_graph`` = dense / TW graph. Timed with CUDA
  events, medians of ``--reps``.

Rows run in :func:`plan` order — the acceptance rows first (BERT-base FFN fp16 75/90 %, the
DLRM-DCNv2 MLPs at 75 %), then the rest — and none starts after ``--budget-s`` seconds (the
ones left are listed in the JSON's ``skipped``).

``--dry-run`` runs everything on the CPU with the ``emulated`` backend at shapes scaled down
by 32 (tokens by 256), times nothing, verifies the chain against the fused reference
(float64 products, one rounding) and writes the same JSON: the script's path end to end
without a GPU.

    python -m benchmarks.cutlass_kernels.gpu_chains [--dry-run] [--out FILE] [--reps N]
        [--budget-s S] [--dtype f16|bf16|both] [--blocks NAME ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.cutlass_kernels.gpu_verify import tw_layout
from cutlass_kernels.epilogue import Activation, apply_activation
from tilesparse import TileSparseLinear, to_chain

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)

# name -> (tokens, widths, activation between layers: "relu" / "gelu" / "none")
BLOCKS: dict[str, tuple[int, tuple[int, ...], str]] = {
    "single_bert_base_fc1": (12800, (768, 3072), "none"),
    "single_bert_base_fc2": (12800, (3072, 768), "none"),
    "ffn_bert_base": (12800, (768, 3072, 768), "gelu"),
    "ffn_bert_large": (12800, (1024, 4096, 1024), "gelu"),
    "dcnv2_bottom_mlp": (65536, (13, 512, 256, 128), "relu"),
    "dcnv2_top_mlp": (65536, (3456, 1024, 1024, 512, 256), "relu"),
}
SPARSITIES = (50, 75, 90)
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
TILE = 128
# The rows the acceptance names, run first (block, sparsity, dtype).
FIRST = (
    ("ffn_bert_base", 75, "f16"),
    ("ffn_bert_base", 90, "f16"),
    ("dcnv2_top_mlp", 75, "f16"),
    ("dcnv2_bottom_mlp", 75, "f16"),
)


def plan(blocks: list[str], dtypes: list[str]) -> list[tuple[str, int, str]]:
    """Every (block, sparsity, dtype) asked for, :data:`FIRST` rows first, then the others in
    block / sparsity / dtype order."""
    every = [(b, s, d) for b in blocks for s in SPARSITIES for d in dtypes]
    first = [r for r in FIRST if r in every]
    return first + [r for r in every if r not in first]


def _scaled(v: int, by: int, align: int = 8) -> int:
    return max(align, -(-v // by // align) * align)


def build_block(
    widths: tuple[int, ...],
    activation: str,
    sparsity: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    tile: int = TILE,
    integer: bool = False,
) -> nn.Sequential:
    """The block as an ``nn.Sequential`` of ``TileSparseLinear`` (+ activations), on the CPU.
    ``integer``: weights and biases in {-1, 0, 1} (exact comparisons); {0, 1} for a GELU
    block, so that no GELU output is a tiny negative number whose sums fp32 cannot hold."""
    lo = 0 if activation == "gelu" else -1
    mods: list[nn.Module] = []
    for i, (k, n) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        lay = tw_layout(k, n, tile, sparsity, gen, dtype)
        layer = TileSparseLinear(k, n, tile=tile, dtype=dtype)
        if integer:
            lay.values.copy_(torch.randint(lo, 2, lay.values.shape, generator=gen).to(dtype))
        layer.set_layout(lay)
        with torch.no_grad():
            assert layer.bias is not None
            layer.bias.copy_(torch.randint(lo, 2, (n,), generator=gen).to(dtype))
        mods.append(layer)
        if i < len(widths) - 2 and activation != "none":
            mods.append(nn.ReLU() if activation == "relu" else nn.GELU())
    return nn.Sequential(*mods).eval()


def fused_reference(x: torch.Tensor, block: nn.Sequential) -> torch.Tensor:
    """Per layer ``act(acc + bias)`` in fp32 from the float64 product, rounded once; ``act``
    the kernel epilogue's arithmetic (``cutlass_kernels.epilogue.apply_activation``)."""
    h = x
    mods = list(block)
    for i, m in enumerate(mods):
        if not isinstance(m, TileSparseLinear):
            continue
        w = m.to_dense().weight.detach().double().to(x.device)
        d = (h.double() @ w.T).float()
        if m.bias is not None:
            d = d + m.bias.detach().float().to(x.device)
        nxt = mods[i + 1] if i + 1 < len(mods) else None
        if isinstance(nxt, nn.ReLU):
            d = apply_activation(d, Activation.RELU)
        elif isinstance(nxt, nn.GELU):
            d = apply_activation(d, Activation.GELU)
        h = d.to(x.dtype)
    return h


def dense_block(block: nn.Sequential) -> nn.Sequential:
    """The same block with every TW layer as its dense ``nn.Linear`` (pruned entries zero)."""
    return nn.Sequential(
        *(m.to_dense() if isinstance(m, TileSparseLinear) else m for m in block)
    ).eval()


def _time_us(fn: Callable[[], object], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def _sparse24(dense: nn.Sequential) -> nn.Sequential | str:
    """Each Linear's weight pruned 2:4 (by magnitude) as a semi-structured tensor, or why not."""
    try:
        from torch.sparse import to_sparse_semi_structured

        out = []
        for m in dense:
            if isinstance(m, nn.Linear):
                w = m.weight.detach()
                groups = w.reshape(-1, 4)
                keep = groups.abs().topk(2, dim=1).indices
                mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, keep, True)
                lin = nn.Linear(m.in_features, m.out_features, device=w.device, dtype=w.dtype)
                lin.weight = nn.Parameter(
                    to_sparse_semi_structured((groups * mask).reshape_as(w)), requires_grad=False
                )
                lin.bias = m.bias
                out.append(lin)
            else:
                out.append(m)
        return nn.Sequential(*out).eval()
    except Exception as e:  # noqa: BLE001 - recorded in the row: 2:4 is a peer, not a check
        return f"{type(e).__name__}: {e}"


def run_block(
    name: str, sparsity: int, dtype_name: str, dry_run: bool, reps: int, seed: int = 0
) -> dict[str, Any]:
    """One row: verification and (on a GPU) timings of one block at one sparsity and dtype."""
    tokens, widths, act = BLOCKS[name]
    dtype = DTYPES[dtype_name]
    if dry_run:
        tokens, widths = _scaled(tokens, 256) + 3, tuple(_scaled(w, 32) + 5 for w in widths)
    gen = torch.Generator().manual_seed(seed)
    row: dict[str, Any] = {
        "block": name,
        "tokens": tokens,
        "widths": list(widths),
        "activation": act,
        "sparsity": sparsity,
        "dtype": dtype_name,
        "dry_run": dry_run,
    }
    tile = 16 if dry_run else TILE
    block = build_block(widths, act, sparsity, dtype, gen, tile=tile, integer=True)
    device = "cpu" if dry_run else "cuda"
    block = block.to(device)
    emulated = to_chain(block, backend="emulated")
    vrows = min(tokens, 64)
    lo = 0 if act == "gelu" else -1
    xv = torch.randint(lo, 2, (vrows, widths[0]), generator=gen).to(dtype).to(device)
    with torch.no_grad():
        want = emulated(xv)
        if dry_run:
            row["verify"] = "equal" if torch.equal(want, fused_reference(xv, block)) else "MISMATCH"
            return row
        chain = to_chain(block, backend="cutlass")
        graphed = to_chain(block, backend="cutlass", cuda_graph=True)
        worst = 0.0
        equal = True
        for c in (chain, graphed, graphed, graphed):  # eager; graph: warm-up, capture, replay
            got = c(xv)
            equal = equal and torch.equal(got, want)
            worst = max(worst, float((got.float() - want.float()).abs().max()))
        row["verify"] = "equal" if equal else "MISMATCH"
        row["verify_max_abs"] = worst
        x = torch.randn(tokens, widths[0], generator=gen).to(dtype).to(device)
        dense = dense_block(block).to(device)
        row["dense_us"] = _time_us(lambda: dense(x), reps)
        row["tw_us"] = _time_us(lambda: chain(x), reps)
        row["tw_graph_us"] = _time_us(lambda: graphed(x), reps)
        row["speedup"] = row["dense_us"] / row["tw_us"]
        row["speedup_graph"] = row["dense_us"] / row["tw_graph_us"]
        row["instances"] = [b.kernel.name for b in chain._bufs.bound] if chain._bufs else []
        s24 = _sparse24(dense)
        if isinstance(s24, str):
            row["sparse24_error"] = s24
        else:
            try:
                row["sparse24_us"] = _time_us(lambda: s24(x), reps)
            except Exception as e:  # noqa: BLE001 - recorded in the row
                row["sparse24_error"] = f"{type(e).__name__}: {e}"
    return row


def _publish(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 every verification bit-equal, 1 a mismatch or an error, 3 no CUDA device
    without ``--dry-run``, 5 no row ran (budget spent before the first)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cutlass_chains.json"))
    p.add_argument("--dry-run", action="store_true", help="CPU, emulated, scaled-down shapes")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtype", choices=["f16", "bf16", "both"], default="both")
    p.add_argument("--blocks", nargs="*", default=list(BLOCKS), choices=list(BLOCKS))
    p.add_argument(
        "--budget-s", type=float, default=None, help="start no row after this many seconds"
    )
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_chains: no CUDA device (use --dry-run on a CPU machine)", file=sys.stderr)
        return 3
    dtypes = list(DTYPES) if args.dtype == "both" else [args.dtype]
    meta = {
        "torch": torch.__version__,
        "device": "cpu" if args.dry_run else torch.cuda.get_device_name(),
        "dry_run": args.dry_run,
    }
    rows: list[dict[str, Any]] = []
    bad = 0
    todo = plan(args.blocks, dtypes)
    for i, (name, s, dt) in enumerate(todo):
        if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
            meta["skipped"] = [f"{n}/{sp}/{d}" for n, sp, d in todo[i:]]
            print(
                f"gpu_chains: over the {args.budget_s:.0f} s budget, {len(todo) - i} rows skipped"
            )
            _publish(Path(args.out), rows, meta)
            break
        try:
            row = run_block(name, s, dt, args.dry_run, args.reps)
        except Exception as e:  # noqa: BLE001 - one block's error is recorded, the rest go on
            row = {"block": name, "sparsity": s, "dtype": dt, "error": f"{type(e).__name__}: {e}"}
        if "error" in row or row.get("verify") != "equal":
            bad += 1
        rows.append(row)
        print(json.dumps(row), flush=True)
        _publish(Path(args.out), rows, meta)
    if todo and not rows:
        return 5  # nothing ran: the budget was spent before the first row
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
