"""lm-eval on a model already in memory: task resolution, zero-shot evaluation, metric choice.

``lm_eval`` (0.4.13 checked) is imported lazily so the rest of the package works without the
``eval`` extra. One :class:`HFLM` wraps the loaded model; the ablation runner switches the
model's attention mode between calls, so the weights are loaded once for every mode.

Task specs (``--tasks``) are names of lm-eval tasks or groups, directories of task YAMLs (every
task and group defined there is run), or single task YAML files. Local directories are indexed
on their own first (fast); lm-eval's ~15k built-in tasks are indexed (about 13 s on 2 cores) only
when a name is not found locally.
"""

from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

__all__ = [
    "PAPER_METRICS",
    "PAPER_TASKS",
    "TaskScore",
    "TaskSelection",
    "check_metric_overrides",
    "evaluate_tasks",
    "make_lm",
    "metric_for",
    "parse_metric_overrides",
    "resolve_tasks",
]

#: the paper's six tasks (docs/method.md#metrics), the default ``--tasks``
PAPER_TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "mmlu")
#: tasks scored by something other than ``acc`` in the paper
PAPER_METRICS = {"arc_challenge": "acc_norm", "hellaswag": "acc_norm"}


@dataclass
class TaskSelection:
    """Resolved tasks: lm-eval names in the order given, and the task directories they need."""

    names: list[str]
    include_paths: list[str] = field(default_factory=list)
    include_defaults: bool = False
    _manager: object = field(default=None, repr=False)

    @property
    def task_manager(self):
        if self._manager is None:
            from lm_eval.tasks import TaskManager

            self._manager = TaskManager(include_path=self.include_paths or None,
                                        include_defaults=self.include_defaults)
        return self._manager


@dataclass
class TaskScore:
    """One task's score in percent, with lm-eval's standard error in points (NaN if absent).

    ``samples`` (not written to results.json): the metric per document, keyed by
    ``(task, doc_id)`` (a group's subtasks are listed by their own names), for paired comparisons
    of two modes on the same documents; ``None`` when lm-eval did not log them.
    """

    metric: str
    score: float
    stderr: float
    n: int | None = None
    samples: dict[tuple[str, int], float] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        d = {"metric": self.metric, "score": self.score,
             "stderr": None if math.isnan(self.stderr) else self.stderr}
        if self.n is not None:
            d["n"] = self.n
        return d


def _yaml_task_name(path: Path) -> str:
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:  # lm-eval YAMLs may use !function tags
        cfg = yaml.load(path.read_text(), Loader=_LenientLoader) or {}
    # a task file has ``task: <name>``; a group file has ``group: <name>`` and ``task: [...]``
    name = cfg.get("task") if isinstance(cfg.get("task"), str) else cfg.get("group")
    if not isinstance(name, str):
        # ValueError, not TypeError: bad user input, reported by the CLI
        raise ValueError(f"task file {str(path)!r} defines no 'task:' (or 'group:') name")  # noqa: TRY004
    return name


class _LenientLoader(yaml.SafeLoader):
    """Reads lm-eval YAMLs with ``!function`` tags (their value is not needed here)."""


_LenientLoader.add_multi_constructor("", lambda loader, suffix, node: None)


def resolve_tasks(specs: list[str] | tuple[str, ...]) -> TaskSelection:
    """Turn ``--tasks`` entries into lm-eval task names; raise on anything unknown.

    Raises:
        ValueError: an empty list, a directory without tasks, a duplicate, or a name that
            neither the given directories nor lm-eval define (with close matches listed).
    """
    from lm_eval.tasks import TaskManager

    specs = [s.strip() for s in specs if s and s.strip()]
    if not specs:
        raise ValueError("no tasks given: pass task names and/or directories of task YAMLs")
    include: list[str] = []
    ordered: list[tuple[str, str]] = []  # (kind, value): ("name", n) or ("dir", path)
    for spec in specs:
        p = Path(spec).expanduser()
        if p.is_dir():
            include.append(str(p.resolve()))
            ordered.append(("dir", str(p.resolve())))
        elif p.is_file() and p.suffix in (".yaml", ".yml"):
            include.append(str(p.resolve().parent))
            ordered.append(("name", _yaml_task_name(p)))
        elif p.suffix in (".yaml", ".yml") or "/" in spec:
            raise ValueError(f"task path {spec!r} does not exist (give a task name, a directory "
                             "of task YAMLs, or a task YAML file)")
        else:
            ordered.append(("name", spec))
    include = list(dict.fromkeys(include))

    local = TaskManager(include_path=include, include_defaults=False) if include else None
    local_index = local.task_index if local is not None else {}
    names: list[str] = []
    for kind, value in ordered:
        if kind == "dir":
            found = [n for n, e in local_index.items()
                     if getattr(e.kind, "name", "") in ("TASK", "GROUP") and e.yaml_path is not None
                     and Path(e.yaml_path).resolve().is_relative_to(value)]
            if not found:
                raise ValueError(f"task directory {value!r} defines no lm-eval task (no YAML "
                                 "with a 'task:' key)")
            # a group's member tasks run as part of the group, not again on their own
            members = {t for n in found if local_index[n].kind.name == "GROUP"
                       for t in (local_index[n].cfg or {}).get("task") or [] if isinstance(t, str)}
            names.extend(sorted(n for n in found if n not in members))
        else:
            names.append(value)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tasks given more than once: {dup}")

    missing = [n for n in names if n not in local_index]
    selection = TaskSelection(names=names, include_paths=include, include_defaults=bool(missing),
                              _manager=None if missing else local)
    if missing:
        known = selection.task_manager.all_tasks
        unknown = [n for n in missing if n not in known]
        if unknown:
            hints = {n: difflib.get_close_matches(n, known, n=3) for n in unknown}
            hint = "; ".join(f"{n!r}: did you mean {', '.join(h)}?" for n, h in hints.items() if h)
            raise ValueError(f"unknown task(s) {unknown}: neither lm-eval nor the task directories "
                             f"{include or '(none given)'} define them" + (f" ({hint})" if hint else ""))
    return selection


def parse_metric_overrides(items: list[str] | None) -> dict[str, str]:
    """``["toy=acc_norm", ...]`` -> ``{"toy": "acc_norm"}``."""
    out: dict[str, str] = {}
    for item in items or []:
        task, sep, metric = item.partition("=")
        if not sep or not task.strip() or not metric.strip():
            raise ValueError(f"--metric {item!r} must look like TASK=METRIC, e.g. hellaswag=acc_norm")
        out[task.strip()] = metric.strip()
    return out


def check_metric_overrides(selection: TaskSelection, overrides: dict[str, str]) -> None:
    """Fail before any model runs when an override names a task that is not evaluated, or a
    metric that the task's YAML ``metric_list`` does not declare (when it declares one)."""
    unused = sorted(set(overrides) - set(selection.names))
    if unused:
        raise ValueError(f"--metric names tasks that are not evaluated: {unused}")
    index = selection.task_manager.task_index
    for task, metric in overrides.items():
        entry = index.get(task)
        cfg = getattr(entry, "cfg", None) or {}
        declared = [m.get("metric") for m in cfg.get("metric_list") or [] if isinstance(m, dict)]
        if declared and metric not in declared:
            raise ValueError(f"task {task!r} reports no metric {metric!r}; its metric_list has "
                             f"{declared}")


def metric_for(task: str, entry: dict, overrides: dict[str, str] | None = None) -> str:
    """The metric that scores ``task``: an override, else the paper's choice (``acc_norm`` for
    ARC-Challenge and HellaSwag), else ``acc``, else ``acc_norm``, else the first reported one.

    ``entry`` is ``results["results"][task]`` from ``simple_evaluate`` (keys ``"acc,none"``...).
    """
    reported = [k.split(",")[0] for k in entry if "," in k and "_stderr" not in k]
    wanted = (overrides or {}).get(task) or PAPER_METRICS.get(task)
    if wanted:
        if wanted not in reported:
            raise ValueError(f"task {task!r} reports no metric {wanted!r}; it reports {reported}")
        return wanted
    for m in ("acc", "acc_norm"):
        if m in reported:
            return m
    if not reported:
        raise ValueError(f"task {task!r} reported no metric")
    return reported[0]


def _filter_key(entry: dict, metric: str) -> str:
    keys = [k for k in entry if k.split(",")[0] == metric]
    return "none" if f"{metric},none" in entry else keys[0].split(",", 1)[1]


def make_lm(model, tokenizer, *, batch_size: int | str = 8, max_length: int | None = None,
            device: str | None = None):
    """An lm-eval ``HFLM`` around an in-memory transformers model (no reload, no copy)."""
    from lm_eval.models.huggingface import HFLM

    kwargs = {"pretrained": model, "tokenizer": tokenizer, "batch_size": batch_size}
    if max_length is not None:
        kwargs["max_length"] = max_length
    if device is not None:
        kwargs["device"] = str(device)
    return HFLM(**kwargs)


def _per_doc(raw: dict, task: str, metric: str, filt: str) -> dict[tuple[str, int], float] | None:
    """``{(task, doc_id): value}`` from lm-eval's logged samples; a group's from its subtasks."""
    samples = raw.get("samples") or {}
    if task in samples:
        out = {(task, s["doc_id"]): float(s[metric]) for s in samples[task]
               if s.get("filter", "none") == filt and isinstance(s.get(metric), (int, float))}
        return out or None
    subtasks = (raw.get("group_subtasks") or {}).get(task)
    if not subtasks:
        return None
    out: dict[tuple[str, int], float] = {}
    for sub in subtasks:
        part = _per_doc(raw, sub, metric, filt)
        if part is None:
            return None
        out.update(part)
    return out


def evaluate_tasks(lm, selection: TaskSelection, *, metric_overrides: dict[str, str] | None = None,
                   limit: float | None = None, bootstrap_iters: int = 100_000,
                   log_samples: bool = True, seed: int = 0) -> tuple[dict[str, TaskScore], dict]:
    """Zero-shot ``simple_evaluate`` of every selected task on ``lm`` as the model stands now.

    Returns:
        ``({task: TaskScore}, raw)``: scores in percent (with per-document values when
        ``log_samples``), and lm-eval's own results dict.
    """
    import lm_eval

    try:
        raw = lm_eval.simple_evaluate(
            model=lm, tasks=list(selection.names), task_manager=selection.task_manager,
            num_fewshot=0, limit=limit, bootstrap_iters=bootstrap_iters, log_samples=log_samples,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed)
    except (ConnectionError, OSError) as e:  # datasets: hub unreachable, missing data files
        raise ValueError(
            f"lm-eval could not load the data of {selection.names}: {e}. Built-in tasks download "
            "their datasets from the hub: run where it is reachable (or cached), or give local "
            "copies as task YAMLs with dataset_path: json") from e
    if raw is None:
        raise RuntimeError("lm_eval.simple_evaluate returned nothing (not rank 0?)")
    scores: dict[str, TaskScore] = {}
    for task in selection.names:
        entry = raw["results"].get(task)
        if entry is None:
            raise RuntimeError(f"lm-eval returned no result for task {task!r}; got "
                               f"{sorted(raw['results'])}")
        metric = metric_for(task, entry, metric_overrides)
        filt = _filter_key(entry, metric)
        value = entry[f"{metric},{filt}"]
        se = entry.get(f"{metric}_stderr,{filt}")
        se = float(se) if isinstance(se, (int, float)) else math.nan
        n = raw.get("n-samples", {}).get(task, {}).get("effective") or entry.get("sample_len")
        per_doc = _per_doc(raw, task, metric, filt) if log_samples else None
        if per_doc and abs(sum(per_doc.values()) / len(per_doc) - float(value)) > 1e-9:
            per_doc = None  # a group not aggregated as a plain mean over documents: no pairing
        scores[task] = TaskScore(metric=metric, score=100.0 * float(value), stderr=100.0 * se, n=n,
                                 samples=per_doc)
    return scores, raw
