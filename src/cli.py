"""The ``hedgecats`` command.

    hedgecats fit|validate|test --config stage.yaml [...]   one stage through LightningCLI
    hedgecats pipeline configs/pipelines/tiny.yaml [--output DIR] [--seed N] [--var K=V]
              [--set PATH=VALUE] [--dry-run] [--restart-changed | --resume-changed]
    hedgecats --version
    hedgecats evaluate ...                                   hedgecats.evaluation.cli
    hedgecats export STAGE_OR_RUN OUT [--keep-adapter] ...   hedgecats.export (a hybrid directory)
    hedgecats generate --model MODEL [PROMPT ...] ...        hedgecats.generate
    hedgecats import-lolcats --base M --distill CKPT [--lora CKPT] OUT
                                                             hedgecats.import_lolcats

A pipeline YAML names its stages in order; each has a LightningCLI ``fit`` config
(``model`` / ``data`` / ``trainer`` with ``class_path`` / ``init_args``). Strings may use
``${output}`` (the run directory), ``${stages.NAME}`` (``<output>/NAME``), which is how a stage
points at the previous one's ``stage.pt`` (``init_from``) or saved model, ``${seed}`` and
``${vars.NAME}`` (the top-level ``vars:`` mapping, overridden by ``--var NAME=VALUE``); a value
that is exactly one ``${...}`` keeps the type of what it stands for.

Seeds: the top-level ``seed`` (default 0; ``--seed N`` overrides it) is every stage's
``seed_everything`` unless the stage sets its own, and ``--seed`` overrides those too, so one
flag makes a seed sweep. ``seed_everything`` reaches the feature maps' initialisation (a
``hybrid`` without its own ``seed`` takes the run's), LoRA's initialisation and the SSD draws;
data order and data content stay with each DataModule's own ``seed`` (link it to ``${seed}`` to
vary them too). ``--set PATH=VALUE`` overrides any key of the YAML for every stage or one
(``--set stages.*.fit.trainer.max_steps=5``; ``hedgecats.pipeline.spec``). The run directory:

    <output>/hedgecats-run.json           marks it as a run (another directory is refused)
    <output>/pipeline.lock                the pipeline running there now (one at a time)
    <output>/<stage>/config.yaml          the resolved LightningCLI config (the run record)
    <output>/<stage>/checkpoints/last.ckpt   resumes an interrupted stage (previous.ckpt: the one
                                          before, used when last.ckpt cannot be read)
    <output>/<stage>/stage.pt             the stage checkpoint handed to the next stage
    <output>/<stage>/done                 the config, inputs and output hashes of a finished
                                          stage: it is verified and skipped next time
    <output>/<stage>/logs/attempt_N/metrics.csv   the logged metrics (N: 0, then one per resume)
    <output>/results.json                 the evaluation (``evaluate`` section)

Re-running the same command skips finished stages and resumes an interrupted one; a stage whose
config changed is refused with the differing keys (``--restart-changed``, ``--resume-changed``).
Signals, divergence, damaged files, exit statuses: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from .pipeline.spec import load_pipeline, parse_overrides
from .pipeline.spec import parse_vars as _parse_vars

__all__ = ["load_pipeline", "main", "run_pipeline"]

USAGE = __doc__.split("\n\n")[1]


# ----------------------------------------------------------------------------- one stage: fit
def _cli(args, run: bool = True):
    """``hedgecats fit|validate|test``: LightningCLI over every LightningModule and DataModule,
    short class names included (``--model HybridFinetune``); CSV logs by default (a new
    ``version_N`` per run, so resuming keeps the earlier metrics) and a step-counting progress
    bar."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.cli import LightningCLI

    from .lightning_modules import StepProgressBar

    class HedgecatsCLI(LightningCLI):
        def instantiate_trainer(self, **kwargs):
            cfg = self._get(self.config_init, "trainer", default={}) or {}
            if cfg.get("logger") is None:
                from lightning.pytorch.loggers import CSVLogger

                kwargs["logger"] = CSVLogger(save_dir=cfg.get("default_root_dir") or os.getcwd(),
                                             name="lightning_logs")
            given = cfg.get("callbacks") or []
            given = list(given) if isinstance(given, list) else [given]
            if cfg.get("enable_progress_bar") is not False and \
                    not any(isinstance(c, ProgressBar) for c in given):
                kwargs["callbacks"] = [*given, StepProgressBar()]
            return super().instantiate_trainer(**kwargs)

    argv, sys.argv = sys.argv, sys.argv[:1]  # the config comes from args, not the command line
    try:
        return HedgecatsCLI(pl.LightningModule, pl.LightningDataModule,
                            subclass_mode_model=True, subclass_mode_data=True, args=args,
                            run=run, save_config_kwargs={"overwrite": True},
                            **({} if run else {"save_config_callback": None}))
    finally:
        sys.argv = argv


def _describe(stage: dict) -> str:
    fit = stage["fit"]
    model = fit["model"]
    cls = model.get("class_path", "?").rsplit(".", 1)[-1] if isinstance(model, dict) else model
    init = model.get("init_args", {}) if isinstance(model, dict) else {}
    tr = fit.get("trainer", {})
    budget = ", ".join(f"{k}={tr[k]}" for k in ("max_steps", "max_epochs", "max_time")
                       if tr.get(k) not in (None, -1))
    keys = ("model_name_or_path", "init_from", "objective", "hybrid", "mode", "lr")
    args = "; ".join(f"{k}={init[k]}" for k in keys if k in init)
    data = fit.get("data", {})
    dcls = data.get("class_path", "-").rsplit(".", 1)[-1] if isinstance(data, dict) else data
    return f"{cls} [{budget}] data={dcls} {args}"


# ----------------------------------------------------------------------------- evaluation
def _instantiate(spec: dict):
    from .pipeline.validate import resolve_class  # a dotted path or a short class name

    return resolve_class(spec["class_path"])(**spec.get("init_args", {}))


def _eval_device(ev: dict) -> tuple[str, str]:
    """(device, precision) of a recall evaluation: ``device: auto`` (default) is the GPU when
    there is one, like the trainer's; ``precision`` defaults to ``bf16-mixed`` there (what the
    stages train in) and ``32`` on the CPU."""
    import torch

    device = ev.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"evaluate.device={device!r} but no CUDA device is available; use "
                         "'auto' or 'cpu'")
    precision = str(ev.get("precision", "bf16-mixed" if device.startswith("cuda") else "32"))
    if precision not in ("32", "bf16-mixed"):
        raise ValueError(f"evaluate.precision={precision!r} is not valid; choose '32' or "
                         "'bf16-mixed'")
    return device, precision


def _evaluate_recall(spec: dict, ev: dict, console) -> dict:
    import torch

    from .evaluation.recall import EVAL_MODES, evaluate_recall, format_table, recall_summary
    from .models import HybridConfig, convert_to_hybrid
    from .models.checkpoint import load_hybrid
    from .models.config import parse_variant_mapping

    output = Path(spec["output"])
    device, precision = _eval_device(ev)
    amp = torch.bfloat16 if precision == "bf16-mixed" else None
    if ("stage" in ev) == ("model" in ev):
        raise ValueError("a recall evaluation names either a 'stage' of this pipeline (its "
                         "stage.pt) or a transformers 'model' (with a 'hybrid' config to convert "
                         f"it with), not {'both' if 'stage' in ev else 'neither'}")
    if "stage" in ev:
        source = stage_pt = output / ev["stage"] / "stage.pt"
        model, _, info = load_hybrid(stage_pt)
        base_model, window = info["base_model"], info["hybrid_config"]["window"]
    else:  # a plain model, converted with fresh feature maps (softmax / SWA modes make sense)
        from transformers import AutoModelForCausalLM

        source = base_model = ev["model"]
        hybrid = HybridConfig.from_dict(ev.get("hybrid") or {})
        model = convert_to_hybrid(AutoModelForCausalLM.from_pretrained(base_model), hybrid)
        window = hybrid.window
    model.to(device)
    dm = _instantiate(ev["data"])
    dm.setup("test")
    corpus = dm.test_corpus()
    modes = tuple(ev.get("modes", EVAL_MODES))
    bs = int(ev.get("batch_size", 16))
    console.print(f"evaluating {len(modes)} modes on {len(corpus.input_ids)} held-out documents "
                  f"({len(corpus.answers)} recalls; model window {window}; near: distance <= "
                  f"{corpus.near_max}, far: >= {corpus.far_min}) on {device}, precision "
                  f"{precision}")
    results = evaluate_recall(model, corpus, modes=modes, batch_size=bs, autocast_dtype=amp)
    for name, variant in (ev.get("variants") or {}).items():
        variant_modes, switches = parse_variant_mapping(variant)
        for mode, r in evaluate_recall(model, corpus, modes=variant_modes, batch_size=bs,
                                       autocast_dtype=amp, **switches).items():
            results[f"{mode} ({name})"] = r
    rows = {}
    if ev.get("teacher"):  # the unconverted base model, for reference
        from transformers import AutoModelForCausalLM

        teacher = AutoModelForCausalLM.from_pretrained(base_model).to(device)
        convert_to_hybrid(teacher, HybridConfig(window=window, mode="softmax"))
        rows["teacher"] = evaluate_recall(teacher, corpus, modes=("softmax",), batch_size=bs,
                                          autocast_dtype=amp)["softmax"]
        del teacher
    rows.update(results)
    console.print(format_table(rows, title=f"{spec['name']}: {ev.get('stage', source)} on "
                               "held-out recall "
                               f"documents (near: fact <= {corpus.near_max} tokens back; far: >= "
                               f"{corpus.far_min}; model window {window})"))
    return recall_summary(rows, corpus, stage=ev.get("stage"), checkpoint=str(source),
                          window=window, device=device, precision=precision)


def _evaluate_command(spec: dict, ev: dict, console) -> dict:
    from .evaluation.cli import main as evaluate_main

    argv = [str(a) for a in ev.get("argv", [])]
    console.print(f"hedgecats evaluate {' '.join(argv)}")
    rc = evaluate_main(argv)
    if rc:
        raise RuntimeError(f"hedgecats evaluate exited with {rc}")
    return {"stage": ev.get("stage"), "command": ["hedgecats", "evaluate", *argv]}


EVALUATORS = {"recall": _evaluate_recall, "command": _evaluate_command}


def _evaluations(spec: dict) -> list[dict]:
    """The ``evaluate:`` section as a list: one mapping (results.json keeps its keys at the top
    level) or a list of them (results.json lists them under ``evaluations``, in order)."""
    ev = spec.get("evaluate")
    if not ev:
        return []
    evals = [ev] if isinstance(ev, dict) else ev
    if not isinstance(evals, list) or not all(isinstance(e, dict) for e in evals):
        raise ValueError("'evaluate' must be a mapping (one evaluation) or a list of mappings")
    return evals


# ----------------------------------------------------------------------------- pipeline
def run_pipeline(path: str | Path, output: str | Path | None = None, dry_run: bool = False,
                 console=None, seed: int | None = None, variables: dict | None = None,
                 overrides: list | None = None, *, restart_changed: bool = False,
                 resume_changed: bool = False, force: bool = False,
                 resume_command: str | None = None) -> dict | None:
    """Run (or, with ``dry_run``, check and describe) a pipeline; returns what went to
    results.json. Everything is validated, and every stage planned (done / resume / new /
    refused), before the first stage trains (docs/reliability.md)."""
    from rich.console import Console
    from rich.markup import escape

    from .evaluation.report import RESULTS_SCHEMA
    from .models.io import atomic_write_text
    from .pipeline import rundir, runner
    from .pipeline.errors import ConfigError, Interrupted
    from .pipeline.validate import validate_pipeline

    if restart_changed and resume_changed:
        raise ConfigError("--restart-changed and --resume-changed exclude each other")
    console = console or Console()

    def warn(msg: str) -> None:
        console.print(f"[yellow]{escape(msg)}[/yellow]", soft_wrap=True)

    spec = load_pipeline(path, output, seed=seed, variables=variables, overrides=overrides)
    out = Path(spec["output"])
    names = [st["name"] for st in spec["stages"]]
    rundir.check_output(out, pipeline=spec["name"], stage_names=names, force=force)
    spec["run_id"] = rundir.run_id(out)
    validate_pipeline(spec, warn=warn)
    resume_command = resume_command or shlex.join(
        ["hedgecats", "pipeline", str(path), "--output", str(out)])
    flags = {"restart_changed": restart_changed, "resume_changed": resume_changed}

    def plan_all() -> list:
        plans, runs = [], set()
        for st in spec["stages"]:
            plan = runner.plan_stage(spec, st, upstream_runs=runs, check_inputs=not runs, **flags)
            if plan.status != "done":
                runs.add(st["name"])
            plans.append(plan)
        return plans

    plans = plan_all()  # a changed or damaged stage is refused here, before anything trains
    n = len(spec["stages"])
    console.print(f"[bold]pipeline {escape(spec['name'])}[/bold] -> {escape(str(out))} "
                  f"(seed {spec['seed']})", soft_wrap=True)
    for i, (st, plan) in enumerate(zip(spec["stages"], plans), 1):
        console.print(f"  {i}/{n} {st['name']} [{plan.describe()}]: {_describe(st)}",
                      soft_wrap=True, markup=False)
        for note in plan.notes:
            warn(f"    note: {note}")
    evals = _evaluations(spec)
    for ev in evals:
        console.print(f"  evaluate: {ev.get('kind', 'recall')} on stage {ev.get('stage')!r}")
    if dry_run:
        console.print("dry run: the pipeline is valid; nothing was run", soft_wrap=True)
        return None
    rank0 = rundir.is_rank_zero()
    lock = rundir.acquire_lock(out, resume_command, warn=warn) if rank0 else None
    phase = "before the first stage"
    try:
        with runner.SignalGuard() as signals:
            if rank0:
                rundir.write_marker(out, pipeline=spec["name"], source=spec["source"])
                for tmp in runner.stale_temporaries(out):  # left by a killed write
                    tmp.unlink(missing_ok=True)
            spec["run_id"] = rundir.run_id(out)
            ctx = runner.RunContext(spec, console, signals, resume_command, rank0)
            t0 = time.time()
            ran: set[str] = set()
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
            summary = {"schema": RESULTS_SCHEMA, "pipeline": spec["name"], "output": str(out),
                       "seed": spec["seed"]}
            done = []
            for ev in evals:
                console.rule(f"evaluation: {ev.get('kind', 'recall')}")
                kind = ev.get("kind", "recall")
                if kind not in EVALUATORS:
                    raise ValueError(f"unknown evaluate kind {kind!r}; valid: {', '.join(EVALUATORS)}")
                done.append({"kind": kind, **EVALUATORS[kind](spec, ev, console)})
            if isinstance(spec.get("evaluate"), dict):
                summary.update({k: v for k, v in done[0].items() if k != "kind"})
            elif done:
                summary["evaluations"] = done
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


# ----------------------------------------------------------------------------- entry point
def _pipeline_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="hedgecats pipeline",
        description="Run a recipe's stages in order (see configs/pipelines); what it promises "
                    "on signals, divergence and damaged files: docs/reliability.md.",
        epilog="exit status: 0 done; 1 a stage or the evaluation failed; 2 a mistake in the "
               "pipeline or the command line (nothing ran); 3 the run directory is in use; "
               "130 / 143 interrupted by SIGINT / SIGTERM (a checkpoint was saved)")
    p.add_argument("config", help="pipeline YAML, e.g. configs/pipelines/tiny.yaml")
    p.add_argument("--output", help="run directory (default: the YAML's output, else runs/<name>)")
    p.add_argument("--seed", type=int, default=None,
                   help="every stage's seed_everything and ${seed} (default: the YAML's seed, 0)")
    p.add_argument("--var", action="append", metavar="NAME=VALUE",
                   help="override one of the YAML's vars (repeatable)")
    p.add_argument("--set", action="append", dest="overrides", metavar="PATH=VALUE",
                   help="override any key, dotted as the YAML is nested; stages.NAME is one "
                        "stage, stages.* every stage (repeatable), e.g. "
                        "--set stages.*.fit.trainer.max_steps=5")
    p.add_argument("--loggers", metavar="NAMES",
                   help="comma-separated loggers for every stage: csv (default), tensorboard, "
                        "wandb (same as --set loggers=[...])")
    p.add_argument("--dry-run", action="store_true",
                   help="validate every stage and the evaluation, print the plan, run nothing")
    p.add_argument("--restart-changed", action="store_true",
                   help="start every stage whose config changed again from its beginning "
                        "(its earlier files move to <stage>/superseded/)")
    p.add_argument("--resume-changed", action="store_true",
                   help="continue an interrupted stage whose config changed from its last good "
                        "checkpoint, under the new config")
    p.add_argument("--force", action="store_true",
                   help="use an --output that is not empty and not a hedgecats run")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an error (also HEDGECATS_DEBUG=1)")
    a = p.parse_args(argv)
    debug = a.debug or os.environ.get("HEDGECATS_DEBUG", "") not in ("", "0")
    import warnings

    # noise that says nothing about this run: stage 1 optimises by hand on purpose, and the
    # stages pass their ckpt_path explicitly
    for msg in ("Using ModelCheckpoint with manual optimization", r".*\.fit\(ckpt_path=",
                "isinstance.treespec, LeafSpec"):
        warnings.filterwarnings("ignore", message=msg)
    overrides = list(a.overrides or [])
    if a.loggers:
        overrides.append(f"loggers=[{a.loggers}]")
    try:
        run_pipeline(a.config, a.output, a.dry_run, seed=a.seed, variables=_parse_vars(a.var),
                     overrides=parse_overrides(overrides), restart_changed=a.restart_changed,
                     resume_changed=a.resume_changed, force=a.force,
                     resume_command=_resume_command(argv, a))
        return 0
    except BaseException as err:  # one line for the user; the traceback with --debug
        if debug or isinstance(err, SystemExit) and not _is_ours(err):
            raise
        code, message = _error_line(err)
        print(f"hedgecats pipeline: {message}", file=sys.stderr, flush=True)
        return code


def _resume_command(argv: list[str], a) -> str:
    """The command that resumes this run: the same words, the run directory made explicit,
    without the flags that only apply once."""
    words, skip = [], False
    once = {"--dry-run", "--restart-changed", "--resume-changed", "--force", "--debug"}
    for w in argv:
        if skip:
            skip = False
            continue
        if w in once:
            continue
        if w == "--output":
            skip = True
            continue
        if w.startswith("--output="):
            continue
        words.append(w)
    out = a.output
    if out is None:
        return shlex.join(["hedgecats", "pipeline", *words])
    return shlex.join(["hedgecats", "pipeline", *words, "--output", str(Path(out).resolve())])


def _is_ours(err: BaseException) -> bool:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    return isinstance(err, SIGTERMException)


def _error_line(err: BaseException) -> tuple[int, str]:
    """(exit status, one line) for an error; see ``hedgecats pipeline --help``."""
    from .pipeline.errors import EXIT_FAILED, Interrupted, PipelineError

    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, Interrupted):
        return err.exit_code, text
    if isinstance(err, PipelineError):
        return err.exit_code, f"error: {text}"
    if isinstance(err, KeyboardInterrupt):
        return 130, "interrupted by SIGINT"
    if isinstance(err, SystemExit):
        return int(err.code or 0) if isinstance(err.code, int) else EXIT_FAILED, text
    hint = " (run with --debug for the traceback)"
    if isinstance(err, (ValueError, KeyError, TypeError, OSError)):  # raised with a message
        return EXIT_FAILED, f"error: {text}{hint}"
    return EXIT_FAILED, f"error: {type(err).__name__}: {text}{hint}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("--version", "-V", "version"):
        from . import __version__

        print(f"hedgecats {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "pipeline":
        return _pipeline_main(rest)
    if cmd == "evaluate":
        from .evaluation.cli import main as evaluate_main

        return int(evaluate_main(rest) or 0)
    if cmd in ("fit", "validate", "test"):
        _cli([cmd, *rest])
        return 0
    if cmd == "export":
        from .export import main as export_main

        return export_main(rest)
    if cmd == "generate":
        from .generate import main as generate_main

        return generate_main(rest)
    if cmd == "import-lolcats":
        from .import_lolcats import main as import_main

        return import_main(rest)
    print(f"unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
