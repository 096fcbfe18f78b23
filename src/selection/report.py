"""The selection report: ``selection.json`` (everything), ``selection.md`` (the tables) and
``selection.png`` (the scores per layer, and the held-out KL against the softmax layers kept)."""

from __future__ import annotations

import json
from pathlib import Path

from ..models.io import atomic_write_text

__all__ = ["REPORT_FILES", "format_markdown", "plot_selection", "write_report"]

REPORT_FILES = ("selection.json", "selection.md", "selection.png")


def _plain(obj):
    """JSON keys as strings (layer indices are ints here)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def format_markdown(sel: dict) -> str:
    """The per-layer table (every score and its rank, worst = 1), the held-out KL curve, how
    each compared score agrees with the selection score, and the stability across inputs."""
    scores = [sel["score"], *sel["compare"]]
    ranks = {s: {i: r + 1 for r, i in enumerate(sorted(sel["scores"][s],
                                                        key=lambda i: (-sel["scores"][s][i], i)))}
             for s in scores}
    held = sel["held_out"]
    lines = ["# Layer selection", "",
             f"Score: **{sel['score']}** (higher = worse: kept softmax first); budget: "
             f"{sel['budget_text']}. Held-out: {held['tokens']} tokens in {held['batches']} "
             f"batch{'es' if held['batches'] != 1 else ''} ({held['source']})"
             + (f"; {len(sel['inputs'])} inputs (the mean of their scores, the ranking by mean "
                "position)" if len(sel["inputs"]) > 1 else "") + ".", "",
             f"**layers:** {sel['layers']} (hybrid; what the next stage converts); kept softmax: "
             f"{sel['kept_softmax']}", "",
             "| layer | " + " | ".join(f"{s} | rank" for s in scores) + " | kept softmax |",
             "| ---: | " + " | ".join("---: | ---:" for _ in scores) + " | :---: |"]
    for i in sel["converted"]:
        cells = " | ".join(f"{sel['scores'][s][i]:.4g} | {ranks[s][i]}" for s in scores)
        lines.append(f"| {i} | {cells} | {'yes' if i in sel['kept_softmax'] else ''} |")
    lines += ["", "Held-out KL to the teacher (nats per token) with the n worst layers softmax, "
              "the rest hybrid:", "", "| n | softmax layers | KL |", "| ---: | --- | ---: |"]
    lines += [f"| {n} | {p['softmax']} | {p['kl']:.4g} |" for n, p in enumerate(sel["curve"])]
    if sel["agreement"]:
        k = next(iter(sel["agreement"].values()))["k"]
        lines += ["", f"How each score ranks the layers against {sel['score']} (Kendall's tau; "
                  f"overlap of the first {k}; mean over inputs):", "",
                  "| score | Kendall tau | top-k overlap |", "| --- | ---: | ---: |"]
        lines += [f"| {c} | {a['kendall_tau']:.3f} | {a['top_k_overlap']:.2f} |"
                  for c, a in sel["agreement"].items()]
    if sel["stability"]:
        first = next(iter(sel["stability"].values()))
        lines += ["", f"Stability across the {first['rankings']} inputs (every pair: Kendall's "
                  f"tau mean and lowest, top-{first['k']} overlap mean):", "",
                  "| score | tau mean | tau min | top-k overlap |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {s} | {st['kendall_tau_mean']:.3f} | {st['kendall_tau_min']:.3f} | "
                  f"{st['top_k_overlap_mean']:.2f} |" for s, st in sel["stability"].items()]
    return "\n".join(lines) + "\n"


def plot_selection(sel: dict, path: str | Path) -> Path:
    """Left: each score per layer, scaled to its largest value (kept layers marked); right: the
    held-out KL against the number of worst layers kept softmax, with the target if any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    scores = [sel["score"], *sel["compare"]]
    layers = sel["converted"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(max(8.0, 0.5 * len(layers) + 5), 3.6))
    width = 0.8 / len(scores)
    x = np.arange(len(layers))
    for j, s in enumerate(scores):
        v = np.array([sel["scores"][s][i] for i in layers], dtype=float)
        top = np.abs(v).max()
        ax.bar(x + (j - (len(scores) - 1) / 2) * width, v / top if top > 0 else v, width,
               label=s)
    ax.set_xticks(x, [f"{i}*" if i in sel["kept_softmax"] else str(i) for i in layers])
    ax.set_xlabel("layer (* kept softmax)")
    ax.set_ylabel("score / its largest value")
    ax.legend(fontsize=7)
    ax.set_title(f"scores (selection: {sel['score']})")
    kls = [p["kl"] for p in sel["curve"]]
    bx.plot(range(len(kls)), kls, marker="o", label="mean" if len(sel["inputs"]) > 1 else None)
    if len(sel["inputs"]) > 1:
        for inp in sel["inputs"]:
            bx.plot(range(len(inp["curve"])), inp["curve"], color="grey", alpha=0.4, lw=0.8)
    if "kl_below" in sel["budget"]:
        bx.axhline(sel["budget"]["kl_below"], color="red", ls="--", lw=0.8, label="kl_below")
    bx.axvline(len(sel["kept_softmax"]), color="black", ls=":", lw=0.8, label="chosen")
    bx.set_xlabel("worst layers kept softmax")
    bx.set_ylabel("held-out KL to the teacher (nats/token)")
    bx.set_xticks(range(len(kls)))
    bx.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(sel: dict, out: str | Path) -> dict[str, Path]:
    """Write ``REPORT_FILES`` into ``out`` (created); returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in REPORT_FILES}
    atomic_write_text(paths["selection.json"], json.dumps(_plain(sel), indent=1))
    atomic_write_text(paths["selection.md"], format_markdown(sel))
    plot_selection(sel, paths["selection.png"])
    return paths
