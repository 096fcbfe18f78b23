"""Figures and tables from run outputs, for the notebooks; only reads files, never loads a model.

- ``notebooks/01-component-ablation.ipynb``: ``results.json`` files of several runs (``load_runs``):
  AVG per mode across training stages, Delta_LA bars, retrieval accuracy by distance bucket.
- ``notebooks/02-demo.ipynb`` and ``03-testbed.ipynb``: finished pipeline runs, one directory per
  recipe and seed (``load_pipeline_runs``): the per-mode recall table (``recall_table``,
  ``recall_pivot``), recall per distance with each seed as a dot (``recall_by_distance``) and
  branch usage per layer (``branch_usage_by_layer``, from a ``hedgecats evaluate
  --branch-usage`` results.json inside the run directory).

Relative paths are taken from the repository root (``notebook_root``): a kernel started in
``notebooks/`` finds ``results/`` and ``runs/`` as the README's commands write them.
"""

from __future__ import annotations

import glob
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..data.buckets import WINDOW_BUCKETS as BUCKETS
from .report import read_results

__all__ = ["PipelineRun", "avg_by_run", "branch_usage_by_layer", "delta_la_bars",
           "expand_paths", "load_pipeline_runs", "load_runs", "notebook_root", "recall_by_distance",
           "recall_pivot", "recall_table", "retrieval_curves"]


# ----------------------------------------------------------------------------- finding runs
def notebook_root(cwd: str | Path | None = None) -> Path:
    """Where relative paths start: the repository root, i.e. the parent of ``notebooks/`` when
    the kernel runs there (Jupyter starts it in the notebook's folder), else ``cwd``."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    return cwd.parent if cwd.name == "notebooks" else cwd


def expand_paths(spec: str, root: str | Path, env: str = "HEDGECATS_RESULTS") -> list[Path]:
    """The comma-separated paths or globs of ``spec``, each relative one taken from ``root``,
    in the given order (each glob's matches sorted). A pattern matching nothing is an error
    naming it, ``root`` and the variable ``env`` that sets the paths."""
    paths: list[Path] = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        pattern = Path(item).expanduser()
        pattern = pattern if pattern.is_absolute() else Path(root) / pattern
        found = sorted(Path(m) for m in glob.glob(str(pattern)))
        if not found:
            raise FileNotFoundError(f"nothing matches {item!r} (from {str(root)!r}); set {env} to "
                                    "comma-separated run directories, results.json files or globs")
        paths += found
    if not paths:
        raise ValueError(f"no paths given ({env}={spec!r})")
    return paths


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


# ----------------------------------------------------------------------------- pipeline runs
@dataclass(frozen=True)
class PipelineRun:
    """One finished ``hedgecats pipeline`` run: its recipe (the pipeline's name), seed, recall
    evaluations (``report.read_results``' ``recall``, in order) and the branch-usage section of
    a ``hedgecats evaluate --branch-usage`` results.json in its directory (``None`` if none)."""

    path: Path
    recipe: str
    seed: int | None
    recall: list[dict]
    branch_usage: dict | None


def _branch_usage_in(run_dir: Path) -> dict | None:
    for f in sorted(run_dir.glob("*/results.json")):
        try:
            bu = json.loads(f.read_text()).get("branch_usage")
        except (OSError, ValueError, AttributeError):
            continue
        if bu:
            return bu
    return None


def load_pipeline_runs(paths: Iterable[str | Path]) -> list[PipelineRun]:
    """Finished pipeline runs (run directories or their ``results.json``), in the given order;
    a run without a recall evaluation is an error naming it."""
    runs = []
    for p in paths:
        f = Path(p) / "results.json" if Path(p).is_dir() else Path(p)
        res = read_results(f)
        if "pipeline" not in res:
            raise ValueError(f"{str(f)!r} is not a pipeline's results.json (hedgecats evaluate "
                             "wrote it: notebooks/01-component-ablation.ipynb reads those)")
        if not res["recall"]:
            raise ValueError(f"{str(f)!r} has no recall evaluation (the pipeline's evaluate: "
                             "section with kind: recall); the run may not have finished")
        runs.append(PipelineRun(f.parent, res["pipeline"], res.get("seed"), res["recall"],
                                _branch_usage_in(f.parent)))
    if not runs:
        raise ValueError("no runs to read")
    return runs


def _by_recipe(runs: Sequence[PipelineRun]) -> dict[str, list[PipelineRun]]:
    out: dict[str, list[PipelineRun]] = {}
    for r in runs:
        out.setdefault(r.recipe, []).append(r)
    return out


def _rows(run: PipelineRun, evaluation: int) -> dict[str, dict]:
    return run.recall[evaluation]["results"]


def _spread(values: list[float], digits: int = 3) -> str:
    """``mean ± sd`` over seeds (the value alone for one seed); ``-`` for none."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _labels(runs: Sequence[PipelineRun], evaluation: int) -> list[str]:
    return list(dict.fromkeys(label for r in runs for label in _rows(r, evaluation)))


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    """Aligned columns: the first left, the others right."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def recall_table(runs: Sequence[PipelineRun], metrics: Sequence[str] = ("near_acc", "far_acc",
                                                                         "lm_loss"),
                 evaluation: int = -1) -> str:
    """Per recipe, one row per evaluated mode: each metric as mean ± sd over the seeds.
    ``evaluation``: which recall evaluation of each run (default the last: the final model)."""
    blocks = []
    for recipe, group in _by_recipe(runs).items():
        seeds = ", ".join(str(r.seed) for r in group)
        ev = group[0].recall[evaluation]
        rows = [[label] + [_spread([_rows(r, evaluation).get(label, {}).get(m) for r in group])
                           for m in metrics] for label in _labels(group, evaluation)]
        blocks.append(f"{recipe}: stage {ev.get('stage')}, seeds {seeds} (mean ± sd over seeds)"
                      f"; near: fact <= {ev.get('near_max')} tokens back, far: >= "
                      f"{ev.get('far_min')}, window {ev.get('window')}\n"
                      + _text_table(["mode", *metrics], rows))
    return "\n\n".join(blocks)


def recall_pivot(runs: Sequence[PipelineRun], metric: str = "far_acc", evaluation: int = -1,
                 modes: Sequence[str] | None = None) -> str:
    """One row per recipe, one column per mode: ``metric`` as mean ± sd over the seeds."""
    modes = list(modes) if modes else _labels(runs, evaluation)
    rows = []
    for recipe, group in _by_recipe(runs).items():
        rows.append([f"{recipe} ({len(group)})"] + [
            _spread([_rows(r, evaluation).get(m, {}).get(metric) for r in group], 2)
            for m in modes])
    return f"{metric}, mean ± sd over seeds (seeds in brackets)\n" + _text_table(
        ["recipe (seeds)", *modes], rows)


def _seed_dots(ax, x0: float, values_by_seed: list[list[float | None]], color, label: str,
               width: float) -> None:
    """Each seed's values as dots around ``x0 + i`` (spread over ``width``), and the mean over
    seeds as a line."""
    n = len(values_by_seed)
    for k, values in enumerate(values_by_seed):
        dx = (k - (n - 1) / 2) * width / max(n, 1)
        pts = [(i + x0 + dx, v) for i, v in enumerate(values) if v is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=color, ms=4, alpha=0.7,
                label=None)
    means = [statistics.fmean(vs) if vs else None
             for vs in ([v[i] for v in values_by_seed if v[i] is not None]
                        for i in range(len(values_by_seed[0])))]
    xs = [i + x0 for i, m in enumerate(means) if m is not None]
    ax.plot(xs, [m for m in means if m is not None], "-", color=color, lw=1.5, label=label)


def recall_by_distance(runs: Sequence[PipelineRun], modes: Sequence[str] | None = None,
                       evaluation: int = -1, axes=None):
    """Recall accuracy per distance bucket (``near``, then slices of the far range), one panel
    per recipe, one colour per mode: a dot per seed, a line through the means."""
    import matplotlib.pyplot as plt

    groups = _by_recipe(runs)
    if axes is None:
        _, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 3.8), squeeze=False,
                               sharey=True)
        axes = axes[0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (recipe, group) in zip(axes, groups.items()):
        ev = group[0].recall[evaluation]
        buckets = [b[0] for b in ev["buckets"]]
        labels = list(modes) if modes else _labels(group, evaluation)
        for j, label in enumerate(labels):
            per_seed = [[_rows(r, evaluation).get(label, {}).get(f"acc_{b}") for b in buckets]
                        for r in group]
            offset = (j - (len(labels) - 1) / 2) * 0.5 / max(len(labels), 1)
            _seed_dots(ax, offset, per_seed, colors[j % len(colors)], label,
                       0.4 / max(len(labels), 1))
        ax.set_xticks(range(len(buckets)), [b if b.startswith("d") else f"{b}\n({lo}-{hi})"
                                            for b, lo, hi in ev["buckets"]])
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel(f"distance to the fact (tokens; window {ev.get('window')})")
        ax.set_title(f"{recipe}: recall by distance ({len(group)} "
                     f"seed{'s' if len(group) > 1 else ''})")
    axes[0].set_ylabel("accuracy")
    axes[-1].legend(fontsize=7, loc="best")
    return axes


def branch_usage_by_layer(runs: Sequence[PipelineRun], ax=None):
    """LA's share of each layer's branch output norms (mean over heads), one colour per recipe:
    a dot per seed, a line through the means. Runs without branch usage are left out; none at
    all is an error saying how to measure it."""
    import matplotlib.pyplot as plt

    groups = {recipe: [r for r in group if r.branch_usage]
              for recipe, group in _by_recipe(runs).items()}
    groups = {k: v for k, v in groups.items() if v}
    if not groups:
        raise ValueError("no run has branch usage: run hedgecats evaluate --model "
                         "RUN/finetune/stage.pt --tasks none --branch-usage --output RUN/probes")
    ax = ax or plt.subplots(figsize=(6, 3.8))[1]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    layers = sorted({layer["layer"] for g in groups.values() for r in g
                     for layer in r.branch_usage["layers"]})
    for j, (recipe, group) in enumerate(groups.items()):
        per_seed = []
        for r in group:
            by_layer = {layer["layer"]: [x for x in layer["la_share"] if x is not None]
                        for layer in r.branch_usage["layers"]}
            per_seed.append([statistics.fmean(by_layer[i]) if by_layer.get(i) else None
                             for i in layers])
        _seed_dots(ax, 0.0, per_seed, colors[j % len(colors)], f"{recipe} ({len(group)})", 0.3)
    ax.set_xticks(range(len(layers)), [str(i) for i in layers])
    ax.set_ylim(0, 1)
    ax.set_xlabel("layer")
    ax.set_ylabel("LA share (mean over heads)")
    ax.set_title("Branch usage per layer (0: all SWA, 1: all LA)")
    ax.legend(fontsize=7)
    return ax
