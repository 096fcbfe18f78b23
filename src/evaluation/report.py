"""``results.json`` / ``results.md`` / ``results.csv``: building, formatting, atomic writing.

``results.json`` (scores in percent, stderrs in points, ``null`` where unknown)::

    {"schema": "hedgecats.results/1",
     "modes": {"<label>": {"mode": "la_only", "switches": {...},
                           "tasks": {"<task>": {"metric": "acc_norm", "score": 41.2,
                                                "stderr": 1.1, "n": 1172}},
                           "avg": 40.3, "avg_stderr": 0.5, "rec_perf": 95.2,
                           "rec_perf_stderr": 1.3}},
     "baseline": {"source": "...", "tasks": {...}, "avg": 42.3, "avg_stderr": 0.5},
     "delta_la": 0.8, "delta_la_stderr": 0.7,   # unpaired: conservative
     "delta_la_stderr_paired": 0.3,               # paired over documents (null if unknown)
     "seeds": [...]            # only with several seeds: per-seed tables and summaries
     "retrieval": {...}, "branch_usage": {...},
     "meta": {"model": ..., "lm_eval_version": ..., "command": ..., ...}}

With several seeds a task's ``score`` is the mean over seeds, ``stderr`` the mean lm-eval stderr
of one run, ``seed_std`` the standard deviation over seeds; ``avg`` is the mean of the per-seed
AVGs and ``avg_seeds`` its summary (std, 95% t interval).

One schema, two writers: ``hedgecats evaluate`` writes the file above; ``hedgecats pipeline``
writes ``{"schema", "pipeline", "output", "seed", ...}`` with its recall evaluations
(``evaluation.recall.recall_summary``: ``{"stage", "window", "buckets", "results": {label:
{lm_loss, near_acc, far_acc, acc_<bucket>, ...}}, ...}``) at the top level (one evaluation) or
under ``evaluations`` (several, each with its ``kind``). ``read_results`` reads both (and files
written before the ``schema`` field, recognised by their keys) into one view: ``modes`` always
holds one row per evaluated mode label -- for a pipeline's file ``{"mode", "switches", "stage",
"recall": {...}, "avg": null}`` -- and ``recall`` lists the recall evaluations (``[]`` for
``hedgecats evaluate``'s file), everything else as written.

Writing is atomic: everything goes to a hidden temporary directory beside ``<dir>``, which is
renamed to ``<dir>`` only when every file is written; a failure leaves ``<dir>`` as it was.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

from ..models.io import atomic_directory
from . import metrics
from .lm_eval_bridge import TaskScore

__all__ = [
    "RESULTS_SCHEMA",
    "atomic_output_dir",
    "build_results",
    "check_output_dir",
    "format_markdown",
    "probe_sections",
    "read_results",
    "write_csv",
    "write_results",
]

DELTA_MODES = ("hybrid", "swa_only")
#: the version of the results.json schema (module docstring), written by both writers
RESULTS_SCHEMA = "hedgecats.results/1"


# ----------------------------------------------------------------------------- building
def _table_row(scores: dict[str, TaskScore | dict], tasks: list[str]) -> dict:
    if not tasks:  # ``hedgecats evaluate --tasks none``: the probes only, no AVG
        return {"tasks": {}, "avg": None, "avg_stderr": None}
    rows = {t: (scores[t].to_dict() if isinstance(scores[t], TaskScore) else dict(scores[t]))
            for t in tasks}
    vals = [rows[t]["score"] for t in tasks]
    ses = [rows[t].get("stderr") for t in tasks]
    return {"tasks": rows, "avg": metrics.avg(vals), "avg_stderr": metrics.avg_stderr(ses)}


def _seed_row(per_seed: list[dict[str, TaskScore]], tasks: list[str]) -> dict:
    """Mean over seeds of each task, and the spread of the AVG over seeds."""
    rows = {}
    for t in tasks:
        vals = [s[t].score for s in per_seed]
        ses = [s[t].stderr for s in per_seed]
        summ = metrics.seed_summary(vals)
        se = None if any(math.isnan(x) for x in ses) else sum(ses) / len(ses)
        rows[t] = {"metric": per_seed[0][t].metric, "score": summ["mean"], "stderr": se,
                   "seed_std": summ["std"], "seed_values": summ["values"]}
    avgs = [metrics.avg([s[t].score for t in tasks]) for s in per_seed]
    summ = metrics.seed_summary(avgs)
    return {"tasks": rows, "avg": summ["mean"],
            "avg_stderr": metrics.avg_stderr([rows[t]["stderr"] for t in tasks]),
            "avg_seeds": summ}


def build_results(mode_runs: list[dict[str, dict[str, TaskScore]]], tasks: list[str], *,
                  specs: dict[str, tuple[str, dict]] | None = None,
                  baseline: dict[str, TaskScore] | None = None, baseline_source: str = "",
                  seeds: list[int] | None = None, retrieval: dict | None = None,
                  branch_usage: dict | None = None, meta: dict | None = None) -> dict:
    """Assemble ``results.json`` from per-seed ``{label: {task: TaskScore}}`` tables.

    Args:
        mode_runs: one table per seed (a single table when no seeds are used).
        tasks: task order of the columns.
        specs: ``{label: (mode, switches)}`` recorded beside each row.
        baseline: the reference model's scores (Rec. Perf = AVG / baseline AVG * 100).
        seeds: labels of the runs in ``mode_runs`` (feature-map seeds, or checkpoint paths);
            ``None`` for one run.
    """
    if not mode_runs:
        raise ValueError("no results to report")
    labels = list(mode_runs[0])
    out: dict = {"schema": RESULTS_SCHEMA, "tasks": list(tasks), "modes": {}}
    for label in labels:
        per_seed = [run[label] for run in mode_runs]
        row = _seed_row(per_seed, tasks) if len(per_seed) > 1 else _table_row(per_seed[0], tasks)
        if specs and label in specs:
            row = {"mode": specs[label][0], "switches": specs[label][1], **row}
        out["modes"][label] = row
    if baseline is not None:
        base = _table_row(baseline, tasks)
        out["baseline"] = {"source": baseline_source, **base}
        for row in out["modes"].values():
            row["rec_perf"], row["rec_perf_stderr"] = metrics.rec_perf(
                row["avg"], base["avg"], row["avg_stderr"], base["avg_stderr"])
    else:
        out["baseline"] = None
    h, s = DELTA_MODES
    if tasks and h in out["modes"] and s in out["modes"]:
        d, se = metrics.delta(out["modes"][h]["avg"], out["modes"][s]["avg"],
                              out["modes"][h]["avg_stderr"], out["modes"][s]["avg_stderr"])
        out["delta_la"], out["delta_la_stderr"] = d, se
        if len(mode_runs) == 1:
            run = mode_runs[0]
            out["delta_la_stderr_paired"] = metrics.paired_delta_stderr(
                [getattr(run[h][t], "samples", None) for t in tasks],
                [getattr(run[s][t], "samples", None) for t in tasks])
        if len(mode_runs) > 1:
            per = [metrics.avg([r[h][t].score for t in tasks]) - metrics.avg([r[s][t].score for t in tasks])
                   for r in mode_runs]
            out["delta_la_seeds"] = metrics.seed_summary(per)
    else:
        out["delta_la"] = out["delta_la_stderr"] = None
    out.setdefault("delta_la_stderr_paired", None)
    if seeds is not None:
        out["seeds"] = list(seeds)
        out["per_seed"] = [{label: _table_row(run[label], tasks) for label in labels}
                           for run in mode_runs]
    out["retrieval"] = retrieval
    out["branch_usage"] = branch_usage
    out["meta"] = dict(meta or {})
    return out


# ----------------------------------------------------------------------------- reading
def _recall_evaluations(res: dict) -> list[dict]:
    """A pipeline results.json's recall evaluations, in order."""
    if "evaluations" in res:
        return [e for e in res["evaluations"] if e.get("kind", "recall") == "recall"
                and "results" in e]
    return [res] if "results" in res else []


def read_results(path: str | Path) -> dict:
    """A ``results.json`` (or a directory holding one) of ``hedgecats evaluate`` or of a
    pipeline, in the one view described in the module docstring."""
    p = Path(path)
    f = p / "results.json" if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"no results.json at {str(p)!r}")
    res = json.loads(f.read_text())
    schema = res.get("schema") if isinstance(res, dict) else None
    if schema not in (None, RESULTS_SCHEMA):
        raise ValueError(f"{str(f)!r} has schema {schema!r}; this reader knows {RESULTS_SCHEMA!r}")
    if isinstance(res, dict) and "modes" in res:  # hedgecats evaluate
        return {"recall": [], **res}
    if not isinstance(res, dict) or "pipeline" not in res:
        raise ValueError(f"{str(f)!r} is not a hedgecats results.json (neither 'modes' of "
                         "hedgecats evaluate nor 'pipeline' of hedgecats pipeline)")
    recall = _recall_evaluations(res)
    modes: dict[str, dict] = {}
    for ev in recall:
        for label, row in ev["results"].items():
            mode = "softmax" if label == "teacher" else label.split(" (", 1)[0]
            key = f"{ev.get('stage')}: {label}" if len(recall) > 1 else label
            modes[key] = {"mode": mode, "switches": {}, "stage": ev.get("stage"),
                          "recall": dict(row), "avg": None, "avg_stderr": None}
    return {**res, "modes": modes, "recall": recall}


# ----------------------------------------------------------------------------- formatting
def _pm(value: float | None, se: float | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" + (f" ± {se:.{digits}f}" if se is not None else "")


def _row_cells(row: dict, tasks: list[str], base: bool) -> list[str]:
    cells = [_pm(row["tasks"][t]["score"], row["tasks"][t].get("stderr")) for t in tasks]
    seeds = row.get("avg_seeds")
    if seeds and seeds.get("std") is not None:
        cells.append(f"{seeds['mean']:.2f} ± {seeds['std']:.2f} (sd over {seeds['n']} runs)")
    else:
        cells.append(_pm(row["avg"], row.get("avg_stderr")))
    cells.append("100.00" if base else _pm(row.get("rec_perf"), row.get("rec_perf_stderr")))
    return cells


def format_markdown(results: dict) -> str:
    """The paper's table (rows = modes; columns = tasks + AVG + Rec. Perf) and the sections
    for Delta_LA, retrieval and branch usage."""
    tasks = results["tasks"]
    meta = results.get("meta", {})
    lines = [f"# Component ablation: {meta.get('model', '?')}", ""]
    if not tasks:
        lines += [f"No lm-eval tasks (`--tasks none`): the probes below only, in the modes "
                  f"{', '.join(results['modes'])}.", ""]
        return "\n".join(lines + probe_sections(results) + _run_section(meta))
    first = next(iter(results["modes"].values()))
    metric = {t: first["tasks"][t]["metric"] for t in tasks}
    header = ["mode"] + [f"{t} ({metric[t]})" for t in tasks] + ["AVG", "Rec. Perf"]
    lines += ["| " + " | ".join(header) + " |",
              "| --- |" + " ---: |" * (len(header) - 1)]
    base = results.get("baseline")
    if base:
        lines.append("| " + " | ".join([f"baseline: {base['source']}"] + _row_cells(base, tasks, True))
                     + " |")
    for label, row in results["modes"].items():
        lines.append("| " + " | ".join([label] + _row_cells(row, tasks, False)) + " |")
    lines += ["", "Scores in percent, ± one standard error (lm-eval's per-task stderr; AVG: "
              "sqrt(sum se^2)/n). Rec. Perf = AVG / baseline AVG * 100."
              + ("" if base else " No baseline: Rec. Perf not computed."), ""]
    d, se = results.get("delta_la"), results.get("delta_la_stderr")
    se_p = results.get("delta_la_stderr_paired")
    if d is None:
        lines.append("Delta_LA = AVG(hybrid) - AVG(swa_only): not computed (needs both modes).")
    else:
        verdict = ""
        se_v = se_p if se_p is not None else se
        if se_v:
            z = abs(d) / se_v
            verdict = (f"; |Delta|/se = {z:.1f}: "
                       + ("within 2 standard errors of 0, not a finding" if z < 2
                          else "more than 2 standard errors from 0"))
        if se_p is not None:
            lines.append(f"Delta_LA = AVG(hybrid) - AVG(swa_only) = {d:+.2f} ± {se_p:.2f} points "
                         f"(paired over the same documents){verdict}. Unpaired (conservative): "
                         + (f"± {se:.2f}." if se is not None else "n/a."))
        else:
            lines.append(f"Delta_LA = AVG(hybrid) - AVG(swa_only) = {d:+.2f}"
                         + (f" ± {se:.2f}" if se is not None else "") + f" points{verdict}. "
                         "(The stderr treats the two modes as independent; they share documents, "
                         "so it is conservative.)")
        ds = results.get("delta_la_seeds")
        if ds and ds.get("std") is not None:
            lo, hi = ds["ci95"]
            lines.append(f"Over {ds['n']} runs (seeds): Delta_LA mean {ds['mean']:+.2f}, sd {ds['std']:.2f},"
                         f" 95% CI [{lo:+.2f}, {hi:+.2f}].")
    lines.append("")
    return "\n".join(lines + probe_sections(results) + _run_section(meta))


def probe_sections(results: dict) -> list[str]:
    """The retrieval and branch-usage sections of a ``results.json`` (markdown lines; none
    when it has neither): the report's, and the model card's for a probes-only run."""
    lines: list[str] = []
    if results.get("retrieval"):
        from .retrieval import format_retrieval_markdown

        lines += format_retrieval_markdown(results["retrieval"]) + [""]
    if results.get("branch_usage"):
        from .branch_usage import format_branch_usage_markdown

        lines += format_branch_usage_markdown(results["branch_usage"]) + [""]
    return lines


def _run_section(meta: dict) -> list[str]:
    if not meta:
        return []
    return ["## Run", ""] + [f"- {k}: `{v}`" for k, v in meta.items()
                             if isinstance(v, (str, int, float, bool)) or v is None] + [""]


def write_csv(results: dict, path: Path) -> None:
    """One row per table row: label, per-task score and stderr, AVG (+se), Rec. Perf (+se)."""
    tasks = results["tasks"]
    cols = ["row", "kind"] + [c for t in tasks for c in (t, f"{t}_stderr")] + \
        ["AVG", "AVG_stderr", "Rec. Perf", "Rec. Perf_stderr"]
    rows = []
    base = results.get("baseline")
    entries = ([("baseline", "baseline", base)] if base else []) + \
        [(label, "mode", r) for label, r in results["modes"].items()]
    for label, kind, r in entries:
        rec = 100.0 if kind == "baseline" else r.get("rec_perf")
        rec_se = None if kind == "baseline" else r.get("rec_perf_stderr")
        row = [label, kind] + [x for t in tasks for x in (r["tasks"][t]["score"], r["tasks"][t].get("stderr"))]
        row += [r["avg"], r.get("avg_stderr"), rec, rec_se]
        rows.append(["" if x is None else x for x in row])
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows(rows)


# ----------------------------------------------------------------------------- writing
def check_output_dir(path: str | Path, overwrite: bool = False, force: bool = False) -> Path:
    """Fail early (before any model is loaded) if ``path`` cannot receive the results: an
    earlier evaluation's output (its ``results.json``) is replaced with ``overwrite``; a
    non-empty directory that is not one only with ``force`` (export's rule: ``--overwrite``
    never deletes what it did not write)."""
    p = Path(path).expanduser().resolve()
    if p.exists() and not p.is_dir():
        raise ValueError(f"--output {str(p)!r} exists and is not a directory")
    if p.is_dir() and any(p.iterdir()) and not force:
        if not (p / "results.json").is_file():
            raise ValueError(f"--output {str(p)!r} is not empty and holds no earlier evaluation "
                             "(no results.json); choose another directory, or pass --force to "
                             "replace what it holds")
        if not overwrite:
            raise ValueError(f"--output {str(p)!r} holds an earlier evaluation; choose another "
                             "directory or pass --overwrite")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise ValueError(f"cannot create --output {str(p)!r}: {str(parent)!r} is not writable")
    return p


@contextlib.contextmanager
def atomic_output_dir(path: str | Path, overwrite: bool = False,
                      force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces ``path``, on error it is removed
    (``check_output_dir`` first, then ``models.io.atomic_directory``)."""
    with atomic_directory(check_output_dir(path, overwrite, force)) as tmp:
        yield tmp


def _json_default(o):
    if isinstance(o, TaskScore):
        return o.to_dict()
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"cannot serialise {type(o).__name__}")


def _clean(o):
    """NaN/inf -> None so that results.json is strict JSON."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def write_results(results: dict, out_dir: Path) -> dict[str, Path]:
    """Write results.json, results.md and results.csv into ``out_dir`` (an existing directory)."""
    out_dir = Path(out_dir)
    paths = {"json": out_dir / "results.json", "md": out_dir / "results.md",
             "csv": out_dir / "results.csv"}
    clean = _clean(json.loads(json.dumps(results, default=_json_default)))
    paths["json"].write_text(json.dumps(clean, indent=2, allow_nan=False) + "\n")
    paths["md"].write_text(format_markdown(clean))
    write_csv(clean, paths["csv"])
    return paths
