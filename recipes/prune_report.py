"""The report of ``recipes.prune_dlrm``: PNG plots (matplotlib, Agg backend), ``report.md`` and
the terminal summary, all from the report dict ``prune_dlrm.main`` builds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["write_plots", "write_markdown", "terminal_summary", "results_table"]

_PATTERN_NAMES = {
    "tw": "TW",
    "tw_rows": "TW rows-only",
    "tew": "TEW",
    "ew": "EW (unstructured)",
    "nm": "2:4 (N:M)",
    "bw": "BW (block-wise)",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def write_plots(
    out: Path, report: dict[str, Any], masks: dict[str, torch.Tensor], run: dict[str, Any]
) -> list[str]:
    """Write ``auc_vs_sparsity.png``, ``layer_sparsity.png`` and ``mask_<layer>.png`` (the
    largest pruned layer of ``run``); returns the file names."""
    plt = _pyplot()
    files = []

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_pattern: dict[str, list[tuple[float, float]]] = {}
    for r in report["runs"]:
        by_pattern.setdefault(r["pattern"], []).append((r["sparsity"], r["eval_auc"]))
    for pattern, pts in by_pattern.items():
        pts.sort()
        ax.plot(
            [100 * s for s, _ in pts],
            [a for _, a in pts],
            marker="o",
            label=_PATTERN_NAMES.get(pattern, pattern),
        )
    ax.axhline(
        report["dense_auc"], color="k", ls="--", lw=1, label=f"dense ({report['dense_auc']:.4f})"
    )
    ax.set_xlabel("sparsity of the pruned layers (%)")
    ax.set_ylabel("eval AUC")
    ax.set_title(f"{report['workload']['name']}: AUC after the same fine-tuning budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "auc_vs_sparsity.png", dpi=110)
    plt.close(fig)
    files.append("auc_vs_sparsity.png")

    layers = run["layers"]
    fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(layers) + 1.2))
    names = [f"{s['fqn']} ({s['in_features']}x{s['out_features']})" for s in layers]
    ax.barh(names, [100 * s["sparsity"] for s in layers], color="tab:blue")
    ax.axvline(100 * run["achieved_sparsity"], color="k", ls="--", lw=1, label="overall")
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("sparsity (%)")
    ax.set_title(f"per-layer sparsity, {run['pattern']} {run['sparsity']:.0%} (global threshold)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "layer_sparsity.png", dpi=110)
    plt.close(fig)
    files.append("layer_sparsity.png")

    fqn = max(layers, key=lambda s: s["params"])["fqn"]
    mask = masks[fqn]
    tile = int(run["config"]["tile"])
    kept_cols = torch.nonzero(mask.any(dim=0)).flatten()
    fig, (a0, a1) = plt.subplots(
        1,
        2,
        figsize=(10, 4.6),
        gridspec_kw={"width_ratios": [mask.shape[1], max(1, kept_cols.numel())]},
    )
    a0.imshow(mask.numpy(), cmap="Greys", aspect="auto", interpolation="nearest")
    a0.set_title(f"{fqn}: mask, K={mask.shape[0]} x N={mask.shape[1]} (black = kept)")
    a0.set_xlabel("output column n")
    a0.set_ylabel("input row k")
    if kept_cols.numel():
        a1.imshow(mask[:, kept_cols].numpy(), cmap="Greys", aspect="auto", interpolation="nearest")
        for x in range(tile, kept_cols.numel(), tile):
            a1.axvline(x - 0.5, color="tab:red", lw=1)
    a1.set_title(f"kept columns, tiles G={tile}", fontsize=9)
    a1.set_xlabel("kept column")
    fig.tight_layout()
    name = f"mask_{_safe(fqn)}.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    files.append(name)
    return files


def results_table(report: dict[str, Any]) -> str:
    """The markdown table: dense, then each run."""
    lines = [
        "| model | sparsity (target / achieved) | eval AUC | AUC drop vs dense | compressed AUC | kept weights |",
        "|---|---|---|---|---|---|",
        f"| dense | 0% | {report['dense_auc']:.4f} | — | — | {report['dense_linear_params']} |",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {_PATTERN_NAMES.get(r['pattern'], r['pattern'])} | {r['sparsity']:.0%} / "
            f"{r['achieved_sparsity']:.2%} | {r['eval_auc']:.4f} | {r['auc_drop']:+.4f} | "
            f"{r['compressed_auc']:.4f} | {r['kept_params']} / {r['pruned_params']} |"
        )
    return "\n".join(lines)


def _layer_table(run: dict[str, Any]) -> str:
    lines = [
        "| layer | K x N | weights | kept | sparsity | kept columns | tiles |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in run["layers"]:
        lines.append(
            f"| `{s['fqn']}` | {s['in_features']} x {s['out_features']} | {s['params']} | {s['kept']} | "
            f"{s['sparsity']:.1%} | {s['kept_columns']} / {s['out_features']} | {s['tiles']} |"
        )
    return "\n".join(lines)


def write_markdown(report: dict[str, Any], main_index: int) -> str:
    """The text of ``report.md``."""
    k = report["knobs"]
    run = report["runs"][main_index]
    plots = "\n".join(f"![{p}]({p})" for p in report["plots"])
    return f"""# prune_dlrm report

Workload `{report["workload"]["name"]}`, {k["dense_steps"]} dense training steps, then
{k["steps"]} fine-tuning steps for every model (the dense baseline too), batch {k["batch_size"]},
Adagrad lr {k["lr"]} (dense training warmed up over {k["warmup_steps"]} steps), eval on {k["eval_batches"]} x {k["batch_size"]} samples.
Teacher AUC (ceiling) {report["teacher_auc"]:.4f}; dense before fine-tuning {report["dense_pretrain_auc"]:.4f}.

{results_table(report)}

## Layers of `{run["pattern"]}` at {run["sparsity"]:.0%}

Thresholds are global across the pruned layers, so each layer lands at its own sparsity.
Weights of the pruned `nn.Linear` layers: {run["pruned_params"]}, kept {run["kept_params"]}.

{_layer_table(run)}

{_speed_section(report)}{_serving_section(report)}{plots}

Total time {report["seconds"]["total"]:.0f} s.
"""


def _speed_section(report: dict[str, Any]) -> str:
    sp = report.get("speed")
    if not sp:
        return ""
    if "skipped" in sp:
        return f"## Speed\n\nNot measured: {sp['skipped']}.\n\n"
    return f"""## Speed: {sp["model"]}

{_PATTERN_NAMES.get(sp["pattern"], sp["pattern"])} at {sp["sparsity"]:.0%} (achieved {sp["achieved_sparsity"]:.2%}) on every
linear, G={sp["tile"]}, condensed; `dense_forward` at batch {sp["batch"]}, {sp["threads"]} threads,
median of {sp["repeats"]} interleaved rounds.

| model | ms | speedup | ideal | linear weights |
|---|---|---|---|---|
| dense | {sp["dense_ms"]:.1f} | — | — | {sp["dense_weight_bytes"] / 2**20:.1f} MiB |
| pruned + condensed | {sp["pruned_ms"]:.1f} | {sp["speedup"]:.2f}× | {sp["ideal"]:.1f}× | {sp["pruned_weight_bytes"] / 2**20:.1f} MiB |

Largest difference from the masked dense model: {sp["max_abs_err"]:.1e}.

"""


def _serving_section(report: dict[str, Any]) -> str:
    sv = report.get("serving")
    if not sv:
        return ""
    return f"""## Serving

The condensed model exported to `{sv["artifacts"]}` (`dense.onnx` {sv["dense_onnx_bytes"] / 1024:.0f} KiB,
sparse files, `ps.json`) and served by the v2 inference server (`python -m hps.server`);
{sv["samples"]} eval samples sent by `tritonclient.http` in {sv["requests"]} requests of {sv["request_batch"]}.

| | value |
|---|---|
| largest logit difference, served vs eager | {sv["max_abs_logit_diff"]:.1e} |
| AUC served / eager | {sv["served_auc"]:.4f} / {sv["eager_auc"]:.4f} |
| request latency p50 / p99 | {sv["latency_ms_p50"]:.1f} / {sv["latency_ms_p99"]:.1f} ms |

"""


def terminal_summary(report: dict[str, Any], main_index: int, out: Path) -> str:
    """A short plain-text summary for the terminal."""
    run = report["runs"][main_index]
    rows = [
        f"dense AUC {report['dense_auc']:.4f} (teacher ceiling {report['teacher_auc']:.4f}, "
        f"before fine-tuning {report['dense_pretrain_auc']:.4f})",
        f"{'pattern':<18}{'target':>8}{'achieved':>10}{'AUC':>9}{'drop':>9}{'compressed':>12}",
    ]
    for r in report["runs"]:
        rows.append(
            f"{_PATTERN_NAMES.get(r['pattern'], r['pattern']):<18}{r['sparsity']:>8.0%}"
            f"{r['achieved_sparsity']:>10.2%}{r['eval_auc']:>9.4f}{r['auc_drop']:>+9.4f}"
            f"{r['compressed_auc']:>12.4f}"
        )
    rows.append(f"layers of {run['pattern']} {run['sparsity']:.0%}:")
    for s in run["layers"]:
        rows.append(
            f"  {s['fqn']:<18} {s['in_features']:>4} x {s['out_features']:<4} "
            f"sparsity {s['sparsity']:6.1%}  kept {s['kept']:>6} / {s['params']:<6} tiles {s['tiles']}"
        )
    sp = report.get("speed")
    if sp and "skipped" in sp:
        rows.append(f"speed: not measured ({sp['skipped']})")
    elif sp:
        rows.append(
            f"speed, DLRM-DCNv2 dense part at full width, batch {sp['batch']}, {sp['threads']} threads: "
            f"dense {sp['dense_ms']:.0f} ms, {sp['pattern']} {sp['sparsity']:.0%} condensed "
            f"{sp['pruned_ms']:.0f} ms = {sp['speedup']:.2f}x (ideal {sp['ideal']:.1f}x)"
        )
    sv = report.get("serving")
    if sv:
        rows.append(
            f"served {sv['samples']} samples through the v2 server ({sv['artifacts']}): AUC "
            f"{sv['served_auc']:.4f} (eager {sv['eager_auc']:.4f}), max |logit diff| "
            f"{sv['max_abs_logit_diff']:.1e}, p50 {sv['latency_ms_p50']:.1f} ms per {sv['request_batch']}-sample request"
        )
    rows.append(f"report: {out / 'report.md'} ({report['seconds']['total']:.0f} s)")
    return "\n".join(rows)
