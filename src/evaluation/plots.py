"""The paper's figures from ``results.json`` files of several runs (used by
``notebooks/01-component-ablation.ipynb``): AVG per mode across training stages, Delta_LA bars,
retrieval accuracy by distance bucket. Only reads run outputs; never loads a model."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from ..data.buckets import WINDOW_BUCKETS as BUCKETS
from .report import read_results

__all__ = ["avg_by_run", "delta_la_bars", "load_runs", "retrieval_curves"]


def load_runs(paths: Iterable[str | Path]) -> list[tuple[str, dict]]:
    """``[(label, results)]`` in the given order; label = ``meta.run_name`` or the directory name.

    ``paths`` are ``results.json`` files or directories holding one, of ``hedgecats evaluate``
    or of ``hedgecats pipeline`` (``report.read_results``: a pipeline's rows have recall
    scores and no AVG, so only the recall plots show them).
    """
    runs = []
    for p in paths:
        res = read_results(p)  # hedgecats evaluate's or a pipeline's results.json
        f = Path(p) / "results.json" if Path(p).is_dir() else Path(p)
        label = (res.get("meta") or {}).get("run_name") or f.parent.name
        runs.append((label, res))
    if not runs:
        raise ValueError("no runs to plot")
    return runs


def _modes(runs: Sequence[tuple[str, dict]]) -> list[str]:
    seen: dict[str, None] = {}
    for _, res in runs:
        for m in res["modes"]:
            seen.setdefault(m, None)
    return list(seen)


def avg_by_run(runs: Sequence[tuple[str, dict]], ax=None):
    """AVG (± stderr) of every mode across runs (e.g. training stages); baseline dashed."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 4))[1]
    x = list(range(len(runs)))
    for mode in _modes(runs):
        ys = [res["modes"].get(mode, {}).get("avg") for _, res in runs]
        es = [res["modes"].get(mode, {}).get("avg_stderr") or 0.0 for _, res in runs]
        pts = [(i, y, e) for i, y, e in zip(x, ys, es) if y is not None]
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts],
                        marker="o", capsize=3, label=mode)
    base = [(i, res["baseline"]["avg"]) for i, (_, res) in zip(x, runs) if res.get("baseline")]
    if base:
        ax.plot([b[0] for b in base], [b[1] for b in base], "k--", label="baseline (softmax)")
    ax.set_xticks(x, [label for label, _ in runs])
    ax.set_ylabel("AVG over tasks (%)")
    ax.set_title("AVG per ablation mode across runs")
    ax.legend(fontsize=8)
    return ax


def delta_la_bars(runs: Sequence[tuple[str, dict]], ax=None):
    """Delta_LA = AVG(hybrid) - AVG(swa_only) per run, with ± 2 stderr bars (paired stderr when
    the run has it, else the conservative unpaired one); runs without Delta_LA are skipped."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    labels, vals, errs = [], [], []
    for label, res in runs:
        if res.get("delta_la") is None:
            continue
        labels.append(label)
        vals.append(res["delta_la"])
        se = res.get("delta_la_stderr_paired")  # paired over documents when known
        errs.append(2 * ((se if se is not None else res.get("delta_la_stderr")) or 0.0))
    if not labels:
        raise ValueError("no run has Delta_LA (it needs the hybrid and swa_only modes)")
    colors = ["tab:green" if abs(v) > e > 0 else "tab:gray" for v, e in zip(vals, errs)]
    ax.bar(range(len(vals)), vals, yerr=errs, capsize=4, color=colors)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xticks(range(len(vals)), labels)
    ax.set_ylabel("Delta_LA (points)")
    ax.set_title("Delta_LA per run (bars: ± 2 s.e.; gray: not distinguishable from 0)")
    return ax


def retrieval_curves(runs: Sequence[tuple[str, dict]], axes=None):
    """Exact-match recall by distance bucket, one line per mode, one panel per run with a probe."""
    import matplotlib.pyplot as plt

    with_probe = [(label, res) for label, res in runs if res.get("retrieval")]
    if not with_probe:
        raise ValueError("no run has a retrieval section (run hedgecats evaluate --retrieval)")
    if axes is None:
        _, axes = plt.subplots(1, len(with_probe), figsize=(4.5 * len(with_probe), 3.5),
                                 squeeze=False, sharey=True)
        axes = axes[0]
    for ax, (label, res) in zip(axes, with_probe):
        r = res["retrieval"]
        buckets = r.get("buckets") or list(BUCKETS)
        for mode, row in r["modes"].items():
            xs = [i for i, b in enumerate(buckets) if row[b]["n"]]
            ax.plot(xs, [row[buckets[i]]["accuracy"] for i in xs], marker="o", label=mode)
        ax.set_xticks(range(len(buckets)), [f"{b}\n(w={r['window']})" if b == "inside" else b
                                            for b in buckets])
        ax.set_ylim(-5, 105)
        ax.set_title(f"{label}: recall by distance")
        ax.set_xlabel("distance to the fact (relative to window w)")
    axes[0].set_ylabel("exact match (%)")
    axes[-1].legend(fontsize=8)
    return axes
