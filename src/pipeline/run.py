"""``run_pipeline``: a pipeline's stages in order, then its evaluation (``hedgecats pipeline``).

Loads the YAML (``spec``), checks the run directory (``rundir``), validates every stage
(``validate``), plans each one (done / resume / new / refused) before the first trains, runs them
(``runner``) under the run's lock and signal guard, then the ``evaluate:`` section
(``evaluate``), and writes ``results.json``. ``hedgecats.cli`` only parses the command line.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from pathlib import Path

from .evaluate import EVALUATORS, evaluations
from .spec import load_pipeline

__all__ = ["evaluation_key", "run_pipeline"]


def _describe(stage: dict) -> str:
    fit = stage["fit"]
    model = fit["model"]
    cls = model.get("class_path", "?").rsplit(".", 1)[-1] if isinstance(model, dict) else model
    init = model.get("init_args", {}) if isinstance(model, dict) else {}
    tr = fit.get("trainer", {})
    budget = ", ".join(f"{k}={tr[k]}" for k in ("max_steps", "max_epochs", "max_time")
                       if tr.get(k) not in (None, -1))
    keys = ("model_name_or_path", "init_from", "objective", "hybrid", "mode", "lr", "score",
            "keep", "max_softmax", "kl_below")
    args = "; ".join(f"{k}={init[k]}" for k in keys if k in init)
    data = fit.get("data", {})
    dcls = data.get("class_path", "-").rsplit(".", 1)[-1] if isinstance(data, dict) else data
    return f"{cls} [{budget}] data={dcls} {args}"


def _start(path, output, *, seed, variables, overrides, force, flags, console, warn):
    """Load, check and validate the pipeline, plan every stage (a changed or damaged stage is
    refused here, before anything trains) and print the plan; returns ``(spec, run directory,
    evaluations)``. Writes nothing."""
    from rich.markup import escape

    from . import rundir, runner
    from .validate import validate_pipeline

    spec = load_pipeline(path, output, seed=seed, variables=variables, overrides=overrides)
    out = Path(spec["output"])
    names = [st["name"] for st in spec["stages"]]
    rundir.check_output(out, pipeline=spec["name"], stage_names=names, force=force)
    spec["run_id"] = rundir.run_id(out)
    validate_pipeline(spec, warn=warn)
    plans, runs = [], set()
    for st in spec["stages"]:
        plan = runner.plan_stage(spec, st, upstream_runs=runs, check_inputs=not runs, **flags)
        if plan.status != "done":
            runs.add(st["name"])
        plans.append(plan)
    n = len(spec["stages"])
    console.print(f"[bold]pipeline {escape(spec['name'])}[/bold] -> {escape(str(out))} "
                  f"(seed {spec['seed']})", soft_wrap=True)
    for i, (st, plan) in enumerate(zip(spec["stages"], plans), 1):
        console.print(f"  {i}/{n} {st['name']} [{plan.describe()}]: {_describe(st)}",
                      soft_wrap=True, markup=False)
        for note in plan.notes:
            warn(f"    note: {note}")
    evals = evaluations(spec)
    for ev in evals:
        console.print(f"  evaluate: {ev.get('kind', 'recall')} on stage {ev.get('stage')!r}")
    return spec, out, evals


def evaluation_key(spec: dict, evals: list[dict]) -> str:
    """The inputs of an evaluation that a run directory records: the ``evaluate:`` section and
    every stage's outputs (the checksums their ``done`` records vouch for). Not hedgecats' code,
    nor a model outside the run directory: ``--reevaluate`` covers those."""
    from . import rundir

    stages = {st["name"]: (rundir.read_done(Path(spec["output"]) / st["name"]) or {}).get("files")
              for st in spec["stages"]}
    text = json.dumps({"evaluate": evals, "stages": stages}, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _evaluate(spec: dict, evals: list[dict], key: str, out: Path, console) -> dict:
    """Run every evaluation of ``evals`` on the finished stages; the results.json summary."""
    from ..evaluation.report import RESULTS_SCHEMA

    summary = {"schema": RESULTS_SCHEMA, "pipeline": spec["name"], "output": str(out),
               "seed": spec["seed"], "evaluation_key": key}
    done = []
    for ev in evals:
        kind = ev.get("kind", "recall")
        console.rule(f"evaluation: {kind}")
        if kind not in EVALUATORS:
            raise ValueError(f"unknown evaluate kind {kind!r}; valid: {', '.join(EVALUATORS)}")
        done.append({"kind": kind, **EVALUATORS[kind](spec, ev, console)})
    if isinstance(spec.get("evaluate"), dict):
        summary.update({k: v for k, v in done[0].items() if k != "kind"})
    elif done:
        summary["evaluations"] = done
    return summary


def _current_results(path: Path, key: str) -> dict | None:
    """results.json when it was written for ``key``, else None (absent, unreadable, older)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("evaluation_key") == key else None


def run_pipeline(path: str | Path, output: str | Path | None = None, dry_run: bool = False,
                 console=None, seed: int | None = None, variables: dict | None = None,
                 overrides: list | None = None, *, restart_changed: bool = False,
                 resume_changed: bool = False, force: bool = False,
                 resume_command: str | None = None, reevaluate: bool = False) -> dict | None:
    """Run (or, with ``dry_run``, check and describe) a pipeline; returns what went to
    results.json. Everything is validated, and every stage planned (done / resume / new /
    refused), before the first stage trains (docs/reliability.md). On a finished run whose
    results.json holds the same ``evaluation_key``, nothing runs and that file is returned as it
    is, unless ``reevaluate``."""
    from rich.console import Console
    from rich.markup import escape

    from ..models.io import atomic_write_text
    from . import rundir, runner
    from .errors import ConfigError, Interrupted

    if restart_changed and resume_changed:
        raise ConfigError("--restart-changed and --resume-changed exclude each other")
    console = console or Console()

    def warn(msg: str) -> None:
        console.print(f"[yellow]{escape(msg)}[/yellow]", soft_wrap=True)

    flags = {"restart_changed": restart_changed, "resume_changed": resume_changed}
    given_resume = resume_command

    # a signal during start-up (validating and planning: seconds to minutes) prints its line
    # too; before, SIGTERM's default action ended the process silently with 143
    resume_command = resume_command or shlex.join(
        ["hedgecats", "pipeline", str(path)] + (["--output", str(output)] if output else []))
    phase = "during start-up (nothing ran in this invocation)"
    lock = None
    try:
        with runner.SignalGuard() as signals:
            try:
                spec, out, evals = _start(
                    path, output, seed=seed, variables=variables, overrides=overrides,
                    force=force, flags=flags, console=console, warn=warn)
            except Exception as err:  # a signal that a library caught and reported otherwise
                if signals.received and not isinstance(err, Interrupted):
                    raise Interrupted(signals.received, "") from err
                raise
            if signals.received:
                raise Interrupted(signals.received, "")
            if dry_run:
                console.print("dry run: the pipeline is valid; nothing was run", soft_wrap=True)
                return None
            resume_command = given_resume or shlex.join(
                ["hedgecats", "pipeline", str(path), "--output", str(out)])
            rank0 = rundir.is_rank_zero()
            lock = rundir.acquire_lock(out, resume_command, warn=warn) if rank0 else None
            phase = "before the first stage"
            if rank0:
                rundir.write_marker(out, pipeline=spec["name"], source=spec["source"])
                for tmp in runner.stale_temporaries(out):  # left by a killed write
                    tmp.unlink(missing_ok=True)
            spec["run_id"] = rundir.run_id(out)
            ctx = runner.RunContext(spec, console, signals, resume_command, rank0)
            t0 = time.time()
            ran: set[str] = set()
            n = len(spec["stages"])
            for i, st in enumerate(spec["stages"], 1):
                phase = f"before stage {st['name']!r}"
                plan = runner.plan_stage(spec, st, upstream_runs=ran, check_inputs=True, **flags)
                for note in plan.notes:
                    warn(f"note: {note}")
                if plan.status == "done":
                    if plan.restore_config and rank0:
                        runner.restore_config(plan)
                    console.print(f"[dim]stage {i}/{n} {st['name']}: done, skipped[/dim]")
                    continue
                console.rule(f"stage {i}/{n}: {st['name']} ({plan.describe()})")
                t = time.time()
                phase = f"in stage {st['name']!r}"
                runner.run_stage(ctx, st, plan)
                ran.add(st["name"])
                console.print(f"stage {st['name']} finished in {time.time() - t:.0f} s")
            phase = "during the evaluation (every stage is done)"
            key = evaluation_key(spec, evals)
            current = None if ran or reevaluate else _current_results(out / "results.json", key)
            if current is not None:
                console.print("[dim]evaluation: results.json is current (the same stages and "
                              "evaluate: section), skipped; --reevaluate runs it again[/dim]")
                summary = current
            else:
                summary = _evaluate(spec, evals, key, out, console)
                summary["wall_s"] = round(time.time() - t0, 1)
                if rank0:
                    atomic_write_text(out / "results.json", json.dumps(summary, indent=2))
    except Interrupted as err:
        if str(err):
            raise
        raise Interrupted(err.signum, f"interrupted by {err.signal_name} {phase}; what finished "
                          f"is kept -- resume with: {resume_command}") from None
    finally:
        if lock is not None:
            lock.release()
    console.print(f"run directory: {out}\n  results.json, <stage>/config.yaml, <stage>/stage.pt, "
                  "<stage>/done, <stage>/checkpoints/last.ckpt, <stage>/logs/attempt_*/metrics.csv",
                  soft_wrap=True, markup=False)
    return summary
