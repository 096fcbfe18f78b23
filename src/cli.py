"""The ``hedgecats`` command: ``COMMANDS`` names its subcommands, each with a one-line
description and its usage (``hedgecats --help`` prints them; ``hedgecats COMMAND --help`` the
subcommand's options). ``fit|validate|test`` run one stage through LightningCLI; ``evaluate``,
``export``, ``generate`` and ``import-lolcats`` live in ``hedgecats.evaluation.cli``,
``hedgecats.export``, ``hedgecats.generate`` and ``hedgecats.import_lolcats``.

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
import logging
import os
import shlex
import sys
from pathlib import Path

from .pipeline.run import run_pipeline
from .pipeline.spec import load_pipeline, parse_overrides
from .pipeline.spec import parse_vars as _parse_vars

__all__ = ["load_pipeline", "main", "run_pipeline"]

#: subcommand -> (one-line description, usage); ``main`` dispatches every one of them
COMMANDS: dict[str, tuple[str, str]] = {
    "pipeline": ("run a recipe's stages in order (resuming an interrupted one), then evaluate",
                 "hedgecats pipeline RECIPE.yaml [--output DIR] [--seed N] [--var NAME=VALUE]\n"
                 "    [--set PATH=VALUE] [--dry-run] [--restart-changed | --resume-changed]"),
    "fit": ("train one stage from a LightningCLI config (model / data / trainer)",
            "hedgecats fit --config STAGE.yaml [--model.help CLASS] [...]"),
    "validate": ("run one stage's validation loop from a LightningCLI config",
                 "hedgecats validate --config STAGE.yaml [...]"),
    "test": ("run one stage's test loop from a LightningCLI config",
             "hedgecats test --config STAGE.yaml [...]"),
    "evaluate": ("score a model in every attention mode: lm-eval tasks, retrieval, branch usage",
                 "hedgecats evaluate --model MODEL [--tasks T,...] [--modes M,...] "
                 "[--retrieval] [...]"),
    "export": ("write a finished stage as a transformers model directory with a model card",
               "hedgecats export STAGE_OR_RUN OUT [--keep-adapter] [--check] [--overwrite]"),
    "generate": ("generate text with a converted model and its constant-memory cache",
                 "hedgecats generate --model MODEL [PROMPT ...] [--mode MODE] [...]"),
    "import-lolcats": ("convert a released LoLCATs checkpoint into a hedgecats model directory",
                       "hedgecats import-lolcats --base MODEL --distill CKPT [--lora CKPT] OUT"),
    "select-layers": ("rank stage 1's converted layers by a measured score; keep the worst softmax",
                      "hedgecats select-layers STAGE_OR_RUN [...] --output DIR [--score kl]\n"
                      "    (--keep K | [--max-softmax N] [--kl-below X]) [--data YAML | --text FILE]"),
}


def usage() -> str:
    """What ``hedgecats --help`` prints: the usage line, then each subcommand."""
    width = max(map(len, COMMANDS)) + 2
    lines = ["usage: hedgecats COMMAND [ARGS ...] | --version | --help", "",
             "Convert pretrained Transformers into hybrids of linear attention (Hedgehog feature "
             "maps)", "and sliding-window softmax attention.", "", "commands:"]
    for name, (summary, synopsis) in COMMANDS.items():
        lines.append(f"  {name:<{width}}{summary}")
        lines += [" " * (width + 4) + part for part in synopsis.split("\n")]
    lines += ["", "Run 'hedgecats COMMAND --help' for a command's options."]
    return "\n".join(lines)


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
    p.add_argument("--reevaluate", action="store_true",
                   help="run the evaluation again on a finished run whose results.json is "
                        "current (by default it is kept and nothing runs)")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an error (also HEDGECATS_DEBUG=1)")
    a = p.parse_args(argv)
    debug = a.debug or os.environ.get("HEDGECATS_DEBUG", "") not in ("", "0")
    import warnings

    # noise that says nothing about this run: stage 1 optimises by hand on purpose, and the
    # stages pass their ckpt_path explicitly
    for msg in ("Using ModelCheckpoint with manual optimization", r".*\.fit\(ckpt_path="):
        warnings.filterwarnings("ignore", message=msg)
    overrides = list(a.overrides or [])
    if a.loggers:
        overrides.append(f"loggers=[{a.loggers}]")
    try:
        run_pipeline(a.config, a.output, a.dry_run, seed=a.seed, variables=_parse_vars(a.var),
                     overrides=parse_overrides(overrides), restart_changed=a.restart_changed,
                     resume_changed=a.resume_changed, force=a.force,
                     resume_command=_resume_command(argv, a), reevaluate=a.reevaluate)
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
    once = {"--dry-run", "--restart-changed", "--resume-changed", "--force", "--reevaluate",
            "--debug"}
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


# ----------------------------------------------------------------------------- foreign noise
#: warnings of other libraries that no user of this command can act on: (message regex,
#: category, emitting module regex); each is matched by all three, so the same libraries' other
#: warnings, and ours, still show
FOREIGN_WARNINGS = (
    # Lightning's pytree helper builds torch's deprecated LeafSpec
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning,
     r"lightning\.pytorch\.utilities\._pytree$"),
    # peft reads transformers' deprecated alias when it wraps a model in LoRA
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning,
     r"transformers\.modeling_utils$"),
)
#: Lightning's info loggers, and the start of the advertisements they print for every Trainer
ADVERTISING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
ADVERTISEMENTS = ("💡 Tip: For seamless cloud",)


class _NoAdvertisements(logging.Filter):
    """Drop Lightning's tips to install its cloud products; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ADVERTISEMENTS)


def quiet_foreign_noise() -> None:
    """Silence ``FOREIGN_WARNINGS`` and ``ADVERTISEMENTS`` for this process (idempotent)."""
    import warnings

    for message, category, module in FOREIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name in ADVERTISING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoAdvertisements) for f in logger.filters):
            logger.addFilter(_NoAdvertisements())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_foreign_noise()
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
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
    if cmd == "select-layers":
        from .selection.cli import main as select_main

        return select_main(rest)
    import difflib

    near = difflib.get_close_matches(cmd, COMMANDS, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    print(f"hedgecats: unknown command {cmd!r}{hint} Commands: {', '.join(COMMANDS)} "
          "(hedgecats --help describes each)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
