"""The GPU testbed (docs/testbed.md): teacher, every recipe x seeds, and the report.

    python -m experiments.testbed run --root runs/testbed --seeds 0,1,2 --jobs 7
    python -m experiments.testbed run --root runs/testbed --legacy-objective \\
        --recipes hedgecats,ssd_dropout,ssd_window,ssd_fixed        # the "before" of issue 20
    python -m experiments.testbed run --root R --no-mc ...    # then, anywhere:
    python -m experiments.testbed mc --root R --jobs 2 --device cpu
    python -m experiments.testbed report --root runs/testbed --out docs/testbed
    python -m experiments.testbed run --root runs/testbed_strong --teacher-config teacher_strong \\
        --q 0,0.1,0.5 --seeds 0,1,2                                  # the regime axis (issue 49)
    python -m experiments.testbed data --recipe hedgecats --teacher-config teacher_strong \\
        --q 0,0.1,0.5                  # what each split holds at each q (CPU, seconds)
    python -m experiments.testbed run ... --recipes hedgecats_keep1 --tag la_rel_err \
        --set stages.select-layers.fit.model.init_args.score=la_rel_err   # a variant of a recipe

``run`` writes the multiple-choice tasks (``<root>/mc_tasks``, at the teacher's scale and letters),
trains the teacher through ``hedgecats pipeline configs/testbed/<teacher config>.yaml``
(``--teacher-config``, default ``teacher``) unless ``--teacher`` names one, then runs ``hedgecats
pipeline configs/testbed/<recipe>.yaml --seed S --var filler=<the teacher's>`` (and the teacher
config's other ``SCALE_VARS``: its data's scale and precision) for every recipe and seed,
``--jobs`` of them at once (small models leave one GPU mostly idle: concurrent pipelines share it),
each into ``<root>/<recipe>-s<S>`` (``<root>/legacy/...`` with ``--legacy-objective``, which runs
``experiments/testbed_legacy.py``), logs in ``<root>/logs``. ``--q`` runs each recipe and seed at
every share q (``--var far_share=q``: docs/testbed.md#regime) into ``<root>/<recipe>-q<q>-s<S>``.
``--set`` (a variant of the recipes) needs ``--tag T``: its runs are ``<recipe>+T-...``, rows of
their own. On a re-run, runs with a ``results.json`` are skipped (``--again`` evaluates them again)
and a run cut short resumes. ``report`` reads every run's ``results.json`` (and
``mc/results.json``) and writes ``testbed.json``, ``testbed.md`` and the plots (far recall per mode
per recipe; Delta_LA per recipe; with runs at several q, far recall against q), every number a mean
+- std over the seeds found, with the seed count; a recipe at a share q is its own row, ``<recipe>
q=<q>``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIGS = REPO / "configs" / "testbed"
RECIPES = ("lolcats", "lolcats_shared_norm", "lolcats_window_max", "lolcats_gate_elementwise",
           "lolcats_gate_lowrank", "inference_hybrid", "hedgecats", "ssd_dropout", "ssd_window",
           "ssd_fixed", "hedgecats_kl", "hedgecats_keep1", "hedgecats_keep2", "hedgecats_la_mass")
#: recall-evaluation rows shown in the tables, in order (label in results.json -> column)
RECALL_ROWS = {"teacher": "teacher", "softmax": "softmax", "hybrid": "hybrid",
               "hybrid (overlap)": "hybrid+overlap", "swa_only": "swa_only",
               "la_only": "la_only", "la_only (la_span_all)": "la_only+all",
               "sinks_only": "sinks_only", "none": "none",
               # SSD recipes also at the configured window (they end at their last phase's)
               "hybrid (window64)": "hybrid@w64", "swa_only (window64)": "swa_only@w64"}
FAR_TASK = "recall_mc_far"
#: the teacher configs (``--teacher-config``): configs/testbed/teacher*.yaml
TEACHERS = tuple(sorted(p.stem for p in CONFIGS.glob("teacher*.yaml")))
#: a run directory: ``<recipe>-s<seed>``, or ``<recipe>-q<q>-s<seed>`` at a share q
RUN_NAME = re.compile(r"(?P<recipe>.+?)(?:-q(?P<q>\d+(?:\.\d+)?))?-s(?P<seed>\d+)")


def q_text(q: float) -> str:
    """A share as run names and row labels write it: ``0``, ``0.1``, ``1`` (no exponent)."""
    return f"{q:.6f}".rstrip("0").rstrip(".")


def run_name(recipe: str, seed: int, q: float | None = None) -> str:
    """``<recipe>-s<seed>``, or ``<recipe>-q<q>-s<seed>`` at a share q; ``recipe`` may carry a
    variant's tag (``hedgecats_kl+mixed``: ``run --tag``)."""
    return f"{recipe}-s{seed}" if q is None else f"{recipe}-q{q_text(q)}-s{seed}"


def tagged(recipe: str, tag: str | None) -> str:
    """A recipe's name with a variant's tag (``run --set ... --tag T``): ``<recipe>+<tag>``."""
    return recipe if not tag else f"{recipe}+{tag}"


def base_recipe(recipe: str) -> str:
    """The recipe file a (possibly tagged) run name comes from: ``hedgecats_kl+mixed`` ->
    ``hedgecats_kl``."""
    return recipe.partition("+")[0]


def variant_tag(text: str) -> str:
    """``run --tag``: lower-case letters, digits and underscores (it goes into run names)."""
    if not re.fullmatch(r"[a-z0-9_]+", text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a tag is lower-case letters, digits and underscores, e.g. la_rel_err")
    return text


def parse_run_name(name: str) -> tuple[str, float | None, int] | None:
    """``(recipe, q, seed)`` of a run directory's name (``q`` None off the regime axis);
    ``None`` for a name that is not a run's."""
    m = RUN_NAME.fullmatch(name)
    if not m:
        return None
    return m["recipe"], None if m["q"] is None else float(m["q"]), int(m["seed"])


def run_label(recipe: str, q: float | None) -> str:
    """A report row: the recipe, and its share q where it ran at one."""
    return recipe if q is None else f"{recipe} q={q_text(q)}"


def split_label(label: str) -> tuple[str, float | None]:
    recipe, _, q = label.partition(" q=")
    return recipe, float(q) if q else None


def shares(text: str) -> list[float]:
    """``--q 0,0.1,0.5``: distinct shares in [0, 1]."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0.0 <= v <= 1.0 for v in values) or \
            len({q_text(v) for v in values}) != len(values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give distinct shares in [0, 1] separated by commas, e.g. 0,0.1,0.5")
    return values


#: what a teacher config fixes for every recipe run on it (``--var``): its data's scale and
#: letters, and its precision (``teacher_tiny.yaml``: the testbed at CPU scale)
SCALE_VARS = ("filler", "seq_len", "window", "far_min", "far_max", "precision")


def teacher_scale(config: Path) -> dict:
    """The ``SCALE_VARS`` of a teacher config: its first stage's data and trainer precision."""
    from hedgecats.pipeline.spec import load_pipeline

    fit = load_pipeline(config)["stages"][0]["fit"]
    data = fit["data"]["init_args"]
    scale = {"filler": data.get("filler", string.ascii_lowercase),
             **{k: data[k] for k in ("seq_len", "window", "far_min", "far_max")},
             "precision": fit.get("trainer", {}).get("precision", "bf16-mixed")}
    return {k: scale[k] for k in SCALE_VARS}


def _short(tasks) -> list[str]:
    """The short multiple-choice tasks present (the whole question inside the window)."""
    return sorted(t for t in tasks if t.startswith("recall_mc_short"))
MC_MODES = {"hybrid": "hybrid", "swa_only": "swa_only", "la_only": "la_only",
            "la_only+la_span=all": "la_only+all", "none": "none",
            "hybrid+window=64": "hybrid@w64", "swa_only+window=64": "swa_only@w64"}


# ----------------------------------------------------------------------------- run
def _pipeline_cmd(config: Path, output: Path, seed: int | None, variables: dict,
                  legacy: bool, overrides: list[str] = (), reevaluate: bool = False
                  ) -> list[str]:
    entry = [sys.executable, str(HERE / "testbed_legacy.py")] if legacy else \
        [sys.executable, "-m", "hedgecats.cli"]
    cmd = [*entry, "pipeline", str(config), "--output", str(output)]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    for k, v in variables.items():
        cmd += ["--var", f"{k}={v}"]
    for o in overrides:
        cmd += ["--set", o]
    return cmd + (["--reevaluate"] if reevaluate else [])


def _without_mc(config: Path, out_dir: Path) -> Path:
    """``config`` without its multiple-choice step (the ``command`` evaluation): a file that
    ``extends`` it and lists the other evaluations (a list replaces the inherited one whole).
    ``run --no-mc`` trains and recall-evaluates with it; ``mc`` runs the step afterwards."""
    import yaml
    from hedgecats.pipeline.spec import read_pipeline

    spec = read_pipeline(config)
    kept = [e for e in spec.get("evaluate") or [] if e.get("kind") != "command"]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / config.name
    path.write_text(f"# {config.name} without its multiple-choice step (experiments/testbed.py "
                    "run --no-mc)\n" + yaml.safe_dump({"extends": str(config.resolve()),
                                                       "evaluate": kept}, sort_keys=False))
    return path


def mc_command(config: Path, run: Path, variables: dict, seed: int | None,
               device: str | None) -> list[str]:
    """The ``hedgecats evaluate`` command of ``config``'s multiple-choice step for ``run``, its
    ``${...}`` resolved as the pipeline resolves them (``--device`` added when given)."""
    from hedgecats.pipeline.spec import load_pipeline

    spec = load_pipeline(config, output=run, seed=seed, variables=variables)
    steps = [e for e in spec.get("evaluate") or [] if e.get("kind") == "command"]
    if len(steps) != 1:
        raise SystemExit(f"{config}: expected one multiple-choice (command) evaluation, found "
                         f"{len(steps)}")
    argv = [str(x) for x in steps[0]["argv"]]
    return [sys.executable, "-m", "hedgecats.cli", "evaluate", *argv,
            *(["--device", device] if device else [])]


def _run_jobs(jobs: list[tuple[str, list[str]]], n_parallel: int, logs: Path) -> dict:
    """Run ``(name, command)`` jobs, ``n_parallel`` at once; ``{name: {rc, wall_s}}``."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    pending, running, done = list(jobs), {}, {}
    t0 = time.time()
    while pending or running:
        while pending and len(running) < n_parallel:
            name, cmd = pending.pop(0)
            log = open(logs / f"{name}.log", "w")
            running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              cwd=REPO), time.time(), log)
            print(f"[{time.time() - t0:6.0f}s] start {name}", flush=True)
        for name, (proc, start, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            done[name] = {"rc": proc.returncode, "wall_s": round(time.time() - start, 1)}
            del running[name]
            print(f"[{time.time() - t0:6.0f}s] {'ok ' if proc.returncode == 0 else 'FAILED'} "
                  f"{name} ({done[name]['wall_s']} s)" +
                  ("" if proc.returncode == 0 else f" -> {logs / (name + '.log')}"), flush=True)
        time.sleep(1)
    return done


#: what the multiple-choice tasks are built for: the teacher's letters and scale
MC_SCALE = ("filler", "seq_len", "window", "far_min", "far_max")


def mc_tasks(root: Path, task: str, n_docs: int, scale: dict) -> Path:
    """``<root>/mc_tasks``: the multiple-choice tasks, written once per root at the teacher's
    scale (``MC_SCALE``: its filler letters, document length, window and far distances;
    ``tasks.json`` records them; a root's tasks built for another scale are refused: one root
    per teacher)."""
    from hedgecats.data.recall_bytes import write_recall_mc_tasks

    want = {k: scale[k] for k in MC_SCALE}
    tasks = root / "mc_tasks"
    stamp = tasks / "tasks.json"
    if (tasks / f"{FAR_TASK}.yaml").exists():
        # what a stamp lacks (tasks written before it recorded the scale) is the writer's default
        defaults = inspect.signature(write_recall_mc_tasks).parameters
        built = {k: defaults[k].default for k in MC_SCALE}
        built.update(json.loads(stamp.read_text()) if stamp.exists() else {})
        differ = [k for k in MC_SCALE if built[k] != want[k]]
        if differ:
            def said(d: dict) -> str:
                return ", ".join(f"{k} {d[k]!r}" for k in differ)
            raise SystemExit(f"{tasks} holds multiple-choice tasks built with {said(built)}; "
                             f"this teacher's is {said(want)}: give each teacher its own --root")
        return tasks
    write_recall_mc_tasks(tasks, task=task, n_docs=n_docs, seed=1234, **want)
    stamp.write_text(json.dumps({"task": task, "docs": n_docs, **want, "seed": 1234}))
    return tasks


def cmd_run(a: argparse.Namespace) -> int:
    root = Path(a.root).resolve()
    teacher_config = CONFIGS / f"{a.teacher_config}.yaml"
    scale = teacher_scale(teacher_config)
    filler = scale["filler"]
    recipes = RECIPES if a.recipes == "all" else tuple(a.recipes.split(","))
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}; valid: {', '.join(RECIPES)}")
    tasks = mc_tasks(root, a.mc_task, a.mc_docs, scale)
    teacher = Path(a.teacher).resolve() if a.teacher else root / "teacher" / "teacher" / "model"
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "teacher_config": a.teacher_config,
              "filler": filler, "q": a.q, "jobs": {}}
    if not a.teacher:
        cmd = _pipeline_cmd(teacher_config, root / "teacher", None,
                            {} if a.teacher_steps is None else {"steps": a.teacher_steps},
                            legacy=False)
        report["jobs"].update(_run_jobs([("teacher", cmd)], 1, root / "logs"))
        if report["jobs"]["teacher"]["rc"]:
            print(f"the teacher failed: {root / 'logs' / 'teacher.log'}", file=sys.stderr)
            return 1
    base = root / "legacy" if a.legacy_objective else root
    variables = {"teacher": teacher, "tasks": tasks, "transfer_steps": a.transfer_steps,
                 "finetune_steps": a.finetune_steps, **scale}
    configs = {r: _without_mc(CONFIGS / f"{r}.yaml", root / "configs-no-mc") if a.no_mc
               else CONFIGS / f"{r}.yaml" for r in recipes}
    if a.set and not a.tag:
        raise SystemExit("run --set changes what the recipes train: give it a --tag, so that "
                         "its runs get names of their own (<recipe>+<tag>-...)")
    names = {r: tagged(r, a.tag) for r in recipes}
    jobs, finished = [], []
    for q in a.q or [None]:
        for s in a.seeds:
            for r in recipes:
                run = base / run_name(names[r], s, q)
                if (run / "results.json").exists() and not a.again:
                    finished.append(run.name)  # the pipeline would only evaluate it again
                    continue
                jobs.append((f"{'legacy-' if a.legacy_objective else ''}{run.name}",
                             _pipeline_cmd(configs[r], run, s,
                                           {**variables, **({} if q is None else {"far_share": q})},
                                           a.legacy_objective, a.set or [],
                                           reevaluate=a.again)))
    if finished:
        print(f"{len(finished)} finished runs skipped (results.json; --again runs them again): "
              f"{', '.join(finished)}")
    report["jobs"].update(_run_jobs(jobs, a.jobs, root / "logs"))
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    (root / f"jobs{'-legacy' if a.legacy_objective else ''}.json").write_text(
        json.dumps(report, indent=2))
    failed = [n for n, r in report["jobs"].items() if r["rc"]]
    print(f"{len(report['jobs']) - len(failed)} ok, {len(failed)} failed {failed}")
    return 1 if failed else 0


# ----------------------------------------------------------------------------- data
def cmd_data(a: argparse.Namespace) -> int:
    """What a recipe's data holds at each share q, split by split (documents, those with far
    recalls, near and far recalls, filler share), generated here as the pipeline would (its
    config with ``--var far_share=q --var filler=<the teacher's>`` and ``--set``); exit 1 when
    the test documents differ between the shares."""
    import hashlib

    from hedgecats.data.recall_bytes import RecallDataModule
    from hedgecats.pipeline.spec import load_pipeline, parse_overrides

    scale = teacher_scale(CONFIGS / f"{a.teacher_config}.yaml")
    filler = scale["filler"]
    out = {"recipe": a.recipe, "teacher_config": a.teacher_config, "filler": filler,
           "set": a.set or [], "shares": {}}
    lines = ["| q | split | docs | docs with far recalls | near recalls | far recalls | "
             "far share of recalls | filler share | filler letters |",
             "|---|---|---|---|---|---|---|---|---|"]
    test_hashes = set()
    for q in a.q or [None]:
        spec = load_pipeline(CONFIGS / f"{a.recipe}.yaml", output=Path(a.root) / "data-check",
                             variables={**scale, "far_share": q},
                             overrides=parse_overrides(a.set))
        datas = {json.dumps(st["fit"]["data"]["init_args"], sort_keys=True)
                 for st in spec["stages"] if st["fit"].get("data")}
        if len(datas) != 1:
            raise SystemExit(f"{a.recipe}: its stages train on {len(datas)} different data "
                             "settings; this check reads one")
        dm = RecallDataModule(**json.loads(datas.pop()))
        per = {}
        for split in ("train", "val", "test"):
            corpus = dm.corpus(split)
            st = per[split] = corpus.stats()
            recalls = st["near_recalls"] + st["far_recalls"]
            lines.append(f"| {'-' if q is None else q_text(q)} | {split} | {st['docs']} | "
                         f"{st['docs_with_far']} | {st['near_recalls']} | {st['far_recalls']} | "
                         f"{st['far_recalls'] / max(recalls, 1):.3f} | "
                         f"{st['filler_share']:.3f} | {st['filler_letters']} |")
        per["test_sha256"] = hashlib.sha256(corpus.input_ids.numpy().tobytes()).hexdigest()
        test_hashes.add(per["test_sha256"])
        out["shares"]["-" if q is None else q_text(q)] = per
    same = len(test_hashes) == 1
    out["test_documents_identical"] = same
    print("\n".join(lines))
    print(f"test documents identical across the shares: {'yes' if same else 'NO'} "
          f"(sha256 {', '.join(sorted(h[:12] for h in test_hashes))})")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if same else 1


# ----------------------------------------------------------------------------- mc
def cmd_mc(a: argparse.Namespace) -> int:
    """The multiple-choice step of every run whose stage 2 is done and that has no
    ``mc/results.json`` yet: the recipe's own ``hedgecats evaluate`` command (e.g. after
    ``run --no-mc`` on the GPU, on another machine, all runs on one device and dtype)."""
    root = Path(a.root).resolve()
    teacher = Path(a.teacher).resolve() if a.teacher else root / "teacher" / "teacher" / "model"
    scale = teacher_scale(CONFIGS / f"{a.teacher_config or _recorded_teacher_config(root)}.yaml")
    variables = {"teacher": teacher, "tasks": mc_tasks(root, a.mc_task, a.mc_docs, scale)}
    jobs = []
    for run in sorted(root.glob("*-s[0-9]*")):
        parsed = parse_run_name(run.name)
        if parsed is None or base_recipe(parsed[0]) not in RECIPES:
            continue
        if not (run / "finetune" / "stage.pt").exists() or \
                ((run / "mc" / "results.json").exists() and not a.again):
            continue
        config = CONFIGS / f"{base_recipe(parsed[0])}.yaml"
        jobs.append((f"mc-{run.name}", mc_command(config, run, variables, parsed[2], a.device)))
    if not jobs:
        print(f"no run under {root} needs its multiple-choice step")
        return 0
    done = _run_jobs(jobs, a.jobs, root / "logs")
    failed = [n for n, r in done.items() if r["rc"]]
    print(f"{len(done) - len(failed)} ok, {len(failed)} failed {failed}")
    return 1 if failed else 0


# ----------------------------------------------------------------------------- recover
_CELL = re.compile(r"[│┃]")


def tables_from_log(text: str) -> list[dict[str, dict[str, float]]]:
    """The recall tables a pipeline printed (``hedgecats.evaluation.recall.format_table``), in order, as
    ``{mode label: {column: value}}``: for runs stopped before they wrote results.json (values
    rounded to the printed 3 decimals). A label split over two lines (``la_only`` /
    ``(la_span_al…``) is joined, the ellipsis completed from the variant names."""
    tables, cols, rows = [], None, None
    for line in text.splitlines():
        if line.startswith("┃"):
            cols = [c.strip() for c in _CELL.split(line)[1:-1]]
            rows = []
        elif line.startswith("│") and cols is not None:
            cells = [c.strip() for c in _CELL.split(line)[1:-1]]
            if cells[0].startswith("(") and all(not c for c in cells[1:]):  # a label's 2nd line
                variant = cells[0].strip("()…")
                full = next((v for v in ("la_span_all", "rescale", "overlap", "window_only",
                                         "window64")
                             if v.startswith(variant)), variant)
                rows[-1] = (f"{rows[-1][0]} ({full})", rows[-1][1])
                continue
            rows.append((cells[0], {("acc_" + c if c.startswith("d") and c[1:2].isdigit() else c):
                                    float(v) for c, v in zip(cols[1:], cells[1:])}))
        elif line.startswith("└") and rows is not None:
            tables.append(dict(rows))
            cols = rows = None
    return tables


def cmd_recover(a: argparse.Namespace) -> int:
    """results.json for runs whose evaluation was cut short, from the tables in their logs."""
    root = Path(a.root)
    n = 0
    for log in sorted((root / "logs").glob("*-s[0-9]*.log")):
        # a --legacy-objective run logs as legacy-<recipe>-s<S> and lives in <root>/legacy/
        run = (root / "legacy" / log.stem.removeprefix("legacy-")
               if log.stem.startswith("legacy-") else root / log.stem)
        if (run / "results.json").exists() or not run.is_dir():
            continue
        tables = tables_from_log(log.read_text(errors="replace"))
        if len(tables) < 2:
            continue
        evaluations = [{"kind": "recall", "stage": "transfer", "results": tables[0]},
                       {"kind": "recall", "stage": "finetune", "results": tables[1]}]
        (run / "results.json").write_text(json.dumps(
            {"pipeline": log.stem, "recovered_from_log": str(log), "evaluations": evaluations},
            indent=2))
        n += 1
    print(f"recovered {n} runs' recall tables from {root / 'logs'}")
    return 0


# ----------------------------------------------------------------------------- report
def _stats(values: list[float]) -> dict:
    vals = [v for v in values if v is not None and v == v]
    if not vals:
        return {"mean": None, "std": None, "n": 0, "values": []}
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "n": len(vals), "values": vals}


def _fmt(s: dict, scale: float = 1.0, digits: int = 2) -> str:
    if not s or s["mean"] is None:
        return "-"
    return f"{s['mean'] * scale:.{digits}f} ± {s['std'] * scale:.{digits}f}"


def _read_run(run: Path) -> dict:
    """One run's numbers: recall per mode after stage 2 and after stage 1, MC accuracy per
    mode and task, stage-1 health."""
    res = json.loads((run / "results.json").read_text())
    evals = res.get("evaluations") or [res]
    out = {"final": {}, "transfer": {}, "mc": {}, "health": None, "window": None}
    for ev in evals:
        if ev.get("kind", "recall") == "recall" and "results" in ev:
            out["final" if ev.get("stage") == "finetune" else "transfer"] = ev["results"]
            if ev.get("stage") == "finetune":
                out["window"] = ev.get("window")  # SSD recipes end at their last phase's
    mc = run / "mc" / "results.json"
    if mc.exists():
        modes = json.loads(mc.read_text())["modes"]
        out["mc"] = {label: {t: row["tasks"][t]["score"] for t in row["tasks"]}
                     for label, row in modes.items()}
        base = json.loads(mc.read_text()).get("baseline") or {}
        if base.get("tasks"):
            out["mc"]["softmax"] = {t: v["score"] for t, v in base["tasks"].items()}
    stage = run / "transfer" / "stage.pt"
    if stage.exists():
        import torch

        out["health"] = torch.load(stage, weights_only=True)["meta"].get("health")
    return out


def collect(root: Path) -> dict[str, dict[int, dict]]:
    """``{row label: {seed: run numbers}}`` for every finished run under ``root``: the label
    is the recipe, with its share where it ran at one (``run_label``)."""
    runs: dict[str, dict[int, dict]] = {}
    for d in sorted(root.glob("*-s[0-9]*")):
        parsed = parse_run_name(d.name)
        if parsed and (d / "results.json").exists():
            recipe, q, seed = parsed
            runs.setdefault(run_label(recipe, q), {})[seed] = _read_run(d)
    return runs


def row_order(labels) -> list[str]:
    """Rows in RECIPES order (others after, by name), each recipe's shares ascending, the
    recipe without a share first."""
    def key(label):
        recipe, q = split_label(label)
        known = base_recipe(recipe) in RECIPES
        return (not known, RECIPES.index(base_recipe(recipe)) if known else 0, recipe,
                -1.0 if q is None else q)

    return sorted(labels, key=key)


def aggregate(runs: dict[str, dict[int, dict]]) -> dict:
    agg = {}
    for recipe, by_seed in runs.items():
        seeds = sorted(by_seed)
        r = {"seeds": seeds, "far_acc": {}, "near_acc": {}, "lm_loss": {}, "mc_short": {},
             "mc_far": {}, "transfer_far_acc": {}, "transfer_lm_loss": {}, "health": {},
             "windows": sorted({by_seed[s]["window"] for s in seeds
                                if by_seed[s].get("window") is not None})}
        for label in RECALL_ROWS:
            rows = [by_seed[s]["final"].get(label) for s in seeds]
            if any(rows):
                for key, name in (("far_acc", "far_acc"), ("near_acc", "near_acc"),
                                  ("lm_loss", "lm_loss")):
                    r[key][RECALL_ROWS[label]] = _stats([x[name] for x in rows if x])
            rows = [by_seed[s]["transfer"].get(label) for s in seeds]
            if any(rows):
                r["transfer_far_acc"][RECALL_ROWS[label]] = _stats([x["far_acc"] for x in rows if x])
                r["transfer_lm_loss"][RECALL_ROWS[label]] = _stats([x["lm_loss"] for x in rows if x])
        for label, col in {**MC_MODES, "softmax": "softmax"}.items():
            per = [by_seed[s]["mc"].get(label) for s in seeds]
            if any(per):
                r["mc_short"][col] = _stats([statistics.fmean(p[t] for t in _short(p))
                                             for p in per if p])
                r["mc_far"][col] = _stats([p[FAR_TASK] for p in per if p])

        def delta(table, a="hybrid", b="swa_only"):
            vals = []
            for s in seeds:
                x, y = table(s, a), table(s, b)
                if x is not None and y is not None:
                    vals.append(x - y)
            return _stats(vals)

        def mc(kind):
            return lambda s, m: (None if not by_seed[s]["mc"].get(m) else
                                 statistics.fmean(by_seed[s]["mc"][m][t]
                                                  for t in _short(by_seed[s]["mc"][m]))
                                 if kind == "short" else by_seed[s]["mc"][m][FAR_TASK])

        r["delta_la_mc_short"] = delta(mc("short"))
        r["delta_la_mc_far"] = delta(mc("far"))
        for where in ("far", "near"):
            r[f"delta_la_{where}_recall"] = delta(
                lambda s, m, w=where: (by_seed[s]["final"].get(m) or {}).get(f"{w}_acc"))
            # SSD recipes evaluated at the configured window too (recall variant window64)
            r[f"delta_la_{where}_recall_w64"] = delta(
                lambda s, m, w=where: (by_seed[s]["final"].get(m) or {}).get(f"{w}_acc"),
                "hybrid (window64)", "swa_only (window64)")
        r["delta_la_mc_short_w64"] = delta(mc("short"), "hybrid+window=64", "swa_only+window=64")
        r["delta_la_mc_far_w64"] = delta(mc("far"), "hybrid+window=64", "swa_only+window=64")
        for metric in ("la_rel_err", "den_collapsed"):
            vals = [statistics.fmean(by_seed[s]["health"][metric].values())
                    for s in seeds if by_seed[s]["health"]]
            r["health"][metric] = _stats(vals)
        agg[recipe] = r
    return agg


def _windows_other_than(r: dict, window: int) -> str:
    """The evaluation windows of a recipe's runs when they are not the configured ``window``
    (SSD ends at its last phase's), e.g. ``"16"``; ``""`` otherwise."""
    w = r.get("windows") or []
    return "" if w in ([], [window]) else "/".join(map(str, w))


def _table(agg: dict, key: str, cols: list[str], scale: float, digits: int,
           window: int = 64) -> str:
    present = [c for c in cols if any(c in r[key] for r in agg.values())]
    lines = ["| recipe (seeds) | " + " | ".join(present) + " |",
             "|---|" + "---|" * len(present)]
    for recipe, r in agg.items():
        w = _windows_other_than(r, window)
        note = f"; window {w}" if w else ""
        lines.append(f"| {recipe} ({len(r['seeds'])}{note}) | " +
                     " | ".join(_fmt(r[key].get(c), scale, digits) for c in present) + " |")
    return "\n".join(lines)


def _delta_w64_table(agg: dict) -> list[str]:
    """Delta_LA at the configured window 64 for the recipes evaluated there as well (SSD);
    nothing when no run has those rows."""
    keys = ("delta_la_near_recall_w64", "delta_la_far_recall_w64", "delta_la_mc_short_w64",
            "delta_la_mc_far_w64")
    rows = {k: r for k, r in agg.items() if any(r.get(x, {}).get("mean") is not None for x in keys)}
    if not rows:
        return []
    return ["### Delta_LA at window 64 (recipes that end at another window, evaluated at 64 too)",
            "\n".join(["| recipe (seeds) | near recall | far recall | short MC (points) | far MC "
                       "(points) |", "|---|---|---|---|---|",
                       *(f"| {k} ({len(r['seeds'])}) | {_fmt(r[keys[0]], 1, 3)} | "
                         f"{_fmt(r[keys[1]], 1, 3)} | {_fmt(r[keys[2]], 1, 1)} | "
                         f"{_fmt(r[keys[3]], 1, 1)} |" for k, r in rows.items())])]


def render(agg: dict, data: dict | None = None) -> str:
    """The report's tables; ``data``: the runs' scale (``teacher_scale``; default the testbed
    teacher's), which the headings name."""
    data = data or teacher_scale(CONFIGS / "teacher.yaml")
    w, far = data["window"], f"{data['far_min']}-{data['far_max']}"
    cols = list(RECALL_ROWS.values())
    mc_cols = ["softmax", *MC_MODES.values()]
    parts = [
        f"### Far recall after stage 2 (accuracy, distance {far}; evaluated at window {w} unless "
        "the row names another: SSD ends at its last phase's window, as the paper evaluates)",
        _table(agg, "far_acc", cols, 1.0, 3, w),
        f"### Near recall after stage 2 (accuracy, distance 3-{w - 1})",
        _table(agg, "near_acc", cols, 1.0, 3, w),
        "### LM loss after stage 2 (nats per byte, held-out documents)",
        _table(agg, "lm_loss", cols, 1.0, 3, w),
        "### Short multiple-choice tasks (lm-eval acc, %, mean of the recall_mc_short tasks: the "
        "whole question inside the window; chance 25)",
        _table(agg, "mc_short", mc_cols, 1.0, 1),
        f"### Far multiple-choice task (lm-eval acc, %, recall_mc_far: the answer {far} tokens "
        "back; chance 25)",
        _table(agg, "mc_far", mc_cols, 1.0, 1),
        "### Delta_LA = hybrid - swa_only",
        "\n".join(["| recipe (seeds) | near recall (accuracy; inside the window) | far recall "
                   "(accuracy; beyond it) | short MC (points) | far MC (points) |",
                   "|---|---|---|---|---|",
                   *(f"| {k} ({len(r['seeds'])}) | {_fmt(r['delta_la_near_recall'], 1, 3)} | "
                     f"{_fmt(r['delta_la_far_recall'], 1, 3)} | "
                     f"{_fmt(r['delta_la_mc_short'], 1, 1)} | "
                     f"{_fmt(r['delta_la_mc_far'], 1, 1)} |" for k, r in agg.items())]),
        *_delta_w64_table(agg),
        "### Right after stage 1 (no LoRA yet): far recall accuracy",
        _table(agg, "transfer_far_acc", cols, 1.0, 3, w),
        "### Stage-1 health at its end (mean over layers)",
        "\n".join(["| recipe (seeds) | LA output rel. error | rows with LA normaliser < 1e-6 |",
                   "|---|---|---|",
                   *(f"| {k} ({len(r['seeds'])}) | {_fmt(r['health'].get('la_rel_err'), 1, 3)} "
                     f"| {_fmt(r['health'].get('den_collapsed'), 1, 3)} |"
                     for k, r in agg.items())]),
        *_regime_table(agg),
    ]
    return "\n\n".join(parts) + "\n"


#: the regime table's columns: (heading, metric, mode)
REGIME_COLUMNS = (("far: hybrid", "far_acc", "hybrid"), ("far: la_only", "far_acc", "la_only"),
                  ("far: swa_only", "far_acc", "swa_only"), ("far: softmax", "far_acc", "softmax"),
                  ("near: hybrid", "near_acc", "hybrid"), ("LM loss: hybrid", "lm_loss", "hybrid"))


def _regime_table(agg: dict) -> list[str]:
    """Far / near recall and LM loss against q for the rows that ran at a share (nothing when
    none did): one line per recipe and share."""
    rows = [k for k in agg if split_label(k)[1] is not None]
    if not rows:
        return []
    lines = ["| recipe | q | seeds | " + " | ".join(c[0] for c in REGIME_COLUMNS)
             + " | Delta_LA far |", "|---|---|---|" + "---|" * (len(REGIME_COLUMNS) + 1)]
    for k in rows:
        recipe, q = split_label(k)
        r = agg[k]
        lines.append(f"| {recipe} | {q_text(q)} | {len(r['seeds'])} | "
                     + " | ".join(_fmt(r[metric].get(mode), 1, 3)
                                  for _, metric, mode in REGIME_COLUMNS)
                     + f" | {_fmt(r['delta_la_far_recall'], 1, 3)} |")
    return ["### Regime: against q, the share of conversion documents with far recalls (test "
            "documents the same for every q; mean ± std over seeds)", "\n".join(lines)]


def plot(agg: dict, out: Path, runs: dict, data: dict | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recipes = list(agg)
    # an SSD recipe is evaluated at its last phase's window: say so under its bar
    data = data or teacher_scale(CONFIGS / "teacher.yaml")
    labels = [r + (f" (w {w})" if (w := _windows_other_than(agg[r], data["window"])) else "")
              for r in recipes]
    n = sorted({len(agg[r]["seeds"]) for r in recipes})
    seeds = f"mean ± std over {'/'.join(map(str, n))} seeds; dots: seeds"
    p1 = _per_mode_bars(plt, agg, recipes, labels, "far_acc", out / "far_recall.png",
                        "far recall accuracy", 1.05,
                        f"Far recall ({data['far_min']}-{data['far_max']} tokens back, window "
                        f"{data['window']}) per mode\n{seeds}")
    written = [p1]
    if any(agg[r].get("mc_short") for r in recipes):
        written.append(_per_mode_bars(
            plt, agg, recipes, labels, "mc_short", out / "short_mc.png", "accuracy, %", 100,
            f"Short multiple-choice tasks (the prompt inside the window; chance 25) per mode\n"
            f"{seeds}"))

    panels = [("delta_la_near_recall", "near recall (inside the window)", "accuracy"),
              ("delta_la_far_recall", "far recall (beyond the window)", "accuracy")]
    panels += [(key, title, "points") for key, title in (
        ("delta_la_mc_short", "short MC task (lm-eval)"), ("delta_la_mc_far", "far MC task (lm-eval)"))
        if any(agg[r].get(key, {}).get("mean") is not None for r in recipes)]
    # at least 3.6 inches a panel, so that few recipes still leave room for the titles
    fig, axes = plt.subplots(1, len(panels), figsize=(
        max(8, 3.6 * len(panels), 0.8 * len(panels) * len(recipes)), 4.0), squeeze=False)
    for ax, (key, title, unit) in zip(axes[0], panels):
        st = [agg[r][key] for r in recipes]
        ax.bar(range(len(recipes)), [s["mean"] if s["mean"] is not None else float("nan")
                                     for s in st], yerr=[s["std"] or 0 for s in st], capsize=3)
        for i, s in enumerate(st):
            ax.scatter([i] * len(s["values"]), s["values"], s=8, color="k", zorder=3)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(recipes)), labels, rotation=20, ha="right")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(unit)
    fig.suptitle(f"Delta_LA = hybrid - swa_only; mean ± std over {'/'.join(map(str, n))} seeds, "
                 "dots: seeds", fontsize=10)
    fig.tight_layout()
    p2 = out / "delta_la.png"
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    written.append(p2)
    if any(split_label(r)[1] is not None for r in recipes):
        written.append(_regime_plot(plt, agg, out / "regime.png"))
    return written


def _regime_plot(plt, agg: dict, path: Path) -> Path:
    """Far recall against q per recipe: hybrid (solid) and la_only (dashed), mean over seeds,
    each seed a dot."""
    by_recipe: dict[str, list[tuple[float, dict]]] = {}
    for label, r in agg.items():
        recipe, q = split_label(label)
        if q is not None:
            by_recipe.setdefault(recipe, []).append((q, r))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, (recipe, points) in enumerate(by_recipe.items()):
        color = f"C{i % 10}"
        points.sort(key=lambda p: p[0])
        for mode, style in (("hybrid", "-"), ("la_only", "--")):
            st = [(q, r["far_acc"].get(mode)) for q, r in points]
            st = [(q, x) for q, x in st if x and x["mean"] is not None]
            if not st:
                continue
            ax.plot([q for q, _ in st], [x["mean"] for _, x in st], style, color=color,
                    marker="o", ms=3, label=f"{recipe} {mode}")
            for q, x in st:
                ax.scatter([q] * len(x["values"]), x["values"], s=8, color=color, zorder=3)
    ax.set_xlabel("q: share of conversion documents with far recalls")
    ax.set_ylabel("far recall accuracy (held-out test documents)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Far recall against q (solid: hybrid, dashed: la_only; dots: seeds)", fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _per_mode_bars(plt, agg: dict, recipes: list, labels: list, key: str, path: Path,
                   ylabel: str, ymax: float, title: str) -> Path:
    """Grouped bars: metric ``key`` per recipe and mode, mean ± std, the seeds as dots."""
    modes = [m for m in ("softmax", "hybrid", "swa_only", "la_only", "la_only+all", "none")
             if any(m in agg[r].get(key, {}) for r in recipes)]
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(recipes)), 4.2))
    width = 0.8 / max(1, len(modes))
    for j, m in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(recipes))]
        st = [agg[r].get(key, {}).get(m) or {"mean": float("nan"), "std": 0, "values": []}
              for r in recipes]
        ax.bar(xs, [s["mean"] for s in st], width, yerr=[s["std"] or 0 for s in st], capsize=2,
               label=m)
        for x, s in zip(xs, st):
            ax.scatter([x] * len(s["values"]), s["values"], s=6, color="k", zorder=3)
    ax.set_xticks(range(len(recipes)), labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, ymax)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _recorded_teacher_config(root: Path) -> str:
    """The teacher config ``run`` recorded under ``root`` (``jobs.json``), else ``teacher``."""
    jobs = root / "jobs.json"
    if jobs.exists():
        return json.loads(jobs.read_text()).get("teacher_config") or "teacher"
    return "teacher"


def cmd_report(a: argparse.Namespace) -> int:
    root, out = Path(a.root), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = collect(root)
    if not runs:
        raise SystemExit(f"no finished runs (<recipe>-s<seed>/results.json) under {root}")
    agg = aggregate({r: runs[r] for r in row_order(runs)})
    teacher_config = a.teacher_config or _recorded_teacher_config(root)
    data = teacher_scale(CONFIGS / f"{teacher_config}.yaml")
    (out / "testbed.json").write_text(json.dumps(
        {"teacher_config": teacher_config, "scale": data, "aggregate": agg, "runs": runs},
        indent=1, default=str))
    (out / "testbed.md").write_text(render(agg, data))
    paths = plot(agg, out, runs, data) if not a.no_plots else []
    print(render(agg, data))
    print("wrote", out / "testbed.json", out / "testbed.md", *paths)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="teacher + recipes x seeds through hedgecats pipeline")
    r.add_argument("--root", default="runs/testbed")
    r.add_argument("--teacher", help="an existing teacher model directory (skips training one)")
    r.add_argument("--teacher-steps", type=int,
                   help="the teacher's training steps (default: its config's)")
    r.add_argument("--recipes", default="all", help=f"comma-separated, of {', '.join(RECIPES)}")
    r.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")], default=[0, 1, 2])
    r.add_argument("--jobs", type=int, default=7, help="pipelines at once")
    r.add_argument("--transfer-steps", type=int, default=300)
    r.add_argument("--finetune-steps", type=int, default=400)
    r.add_argument("--mc-docs", type=int, default=128, help="documents per multiple-choice task")
    r.add_argument("--mc-task", default="marker", choices=("marker", "kv"),
                   help="the corpus task the multiple-choice tasks are built like (the teacher's)")
    r.add_argument("--set", action="append", metavar="PATH=VALUE",
                   help="passed to every pipeline (hedgecats pipeline --set), repeatable; "
                        "needs --tag")
    r.add_argument("--again", action="store_true",
                   help="also run the runs that have a results.json (the pipeline skips their "
                        "done stages and evaluates them again)")
    r.add_argument("--tag", type=variant_tag,
                   help="the variant --set makes: runs go to <recipe>+<tag>[-q<q>]-s<seed> and "
                        "get their own rows in the report")
    r.add_argument("--legacy-objective", action="store_true",
                   help="the first weights_xent (experiments/testbed_legacy.py), into <root>/legacy")
    r.add_argument("--no-mc", action="store_true",
                   help="leave out the multiple-choice step (run it later with `mc`)")
    r.add_argument("--teacher-config", default="teacher", choices=TEACHERS,
                   help="configs/testbed/<name>.yaml: the teacher trained (without --teacher) "
                        "and whose filler letters every recipe and task uses")
    r.add_argument("--q", type=shares, metavar="Q[,Q...]",
                   help="shares of conversion documents with far recalls (docs/testbed.md#regime)"
                        ": every recipe and seed at each, into <recipe>-q<q>-s<seed>; without "
                        "it the data as the earlier runs had it")
    r.set_defaults(fn=cmd_run)
    d = sub.add_parser("data", help="what a recipe's data splits hold at each q (CPU)")
    d.add_argument("--recipe", default="hedgecats", choices=RECIPES)
    d.add_argument("--teacher-config", default="teacher", choices=TEACHERS)
    d.add_argument("--q", type=shares, metavar="Q[,Q...]", help="shares (default: none)")
    d.add_argument("--set", action="append", metavar="PATH=VALUE",
                   help="as hedgecats pipeline --set (e.g. a smaller num_train), repeatable")
    d.add_argument("--root", default="runs/testbed", help="the run root the config resolves to")
    d.add_argument("--out", help="also write the counts as JSON here")
    d.set_defaults(fn=cmd_data)
    m = sub.add_parser("mc", help="the multiple-choice step of finished runs that lack it")
    m.add_argument("--root", default="runs/testbed")
    m.add_argument("--teacher", help="the teacher directory, if not <root>/teacher/teacher/model")
    m.add_argument("--jobs", type=int, default=2)
    m.add_argument("--device", help="passed to hedgecats evaluate (default: its own)")
    m.add_argument("--again", action="store_true", help="also runs that have mc/results.json")
    m.add_argument("--teacher-config", choices=TEACHERS,
                   help="the runs' teacher config, whose scale the tasks are built for (default: "
                        "the one run recorded in <root>/jobs.json, else teacher)")
    m.add_argument("--mc-task", default="marker", choices=("marker", "kv"),
                   help="the corpus task the tasks are built like, where <root>/mc_tasks is not "
                        "built yet")
    m.add_argument("--mc-docs", type=int, default=128,
                   help="documents per task, where <root>/mc_tasks is not built yet")
    m.set_defaults(fn=cmd_mc)
    q = sub.add_parser("report", help="tables and plots from finished runs")
    q.add_argument("--root", default="runs/testbed")
    q.add_argument("--out", default="runs/testbed/report")
    q.add_argument("--no-plots", action="store_true")
    q.add_argument("--teacher-config", choices=TEACHERS,
                   help="the runs' teacher config, whose scale the headings name (default: the "
                        "one run recorded in <root>/jobs.json, else teacher)")
    q.set_defaults(fn=cmd_report)
    v = sub.add_parser("recover", help="results.json from the logs of runs cut short "
                       "(recall tables only)")
    v.add_argument("--root", default="runs/testbed")
    v.set_defaults(fn=cmd_recover)
    a = p.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
