"""The ``hedgecats`` command.

    hedgecats fit|validate|test --config stage.yaml [...]   one stage through LightningCLI
    hedgecats pipeline configs/pipelines/tiny.yaml [--output DIR] [--seed N] [--var K=V] [--dry-run]
    hedgecats evaluate ...                                   hedgecats.evaluation.cli
    hedgecats export STAGE_OR_RUN OUT [--keep-adapter] ...   hedgecats.export (a hybrid directory)
    hedgecats generate --model MODEL [PROMPT ...] ...        hedgecats.generate

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
vary them too). The run directory:

    <output>/<stage>/config.yaml          the resolved LightningCLI config (the run record)
    <output>/<stage>/checkpoints/last.ckpt   resumes an interrupted stage (ckpt_path)
    <output>/<stage>/stage.pt             the stage checkpoint handed to the next stage
    <output>/<stage>/done                 written when the stage finished: it is skipped next time
    <output>/<stage>/logs/attempt_N/metrics.csv   the logged metrics (N: 0, then one per resume)
    <output>/results.json                 the evaluation (``evaluate`` section)

Re-running the same command skips finished stages and resumes an interrupted one.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import time
from pathlib import Path

import yaml

__all__ = ["load_pipeline", "main", "run_pipeline"]

USAGE = __doc__.split("\n\n")[1]
_REF = re.compile(r"\$\{(output|seed|stages\.([A-Za-z0-9_\-]+)|vars\.([A-Za-z0-9_\-]+))\}")


# ----------------------------------------------------------------------------- pipeline spec
def _substitute(obj, values: dict):
    """Replace ``${...}`` references (see the module docstring); ``values`` maps each reference
    name (``output``, ``seed``, ``stages.X``, ``vars.X``) to its value."""
    if isinstance(obj, dict):
        return {k: _substitute(v, values) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_substitute(v, values) for v in obj]
    if isinstance(obj, str):
        def lookup(m: re.Match):
            name = m.group(1)
            if name not in values:
                kind = name.split(".")[0]
                known = sorted(k.split(".", 1)[1] for k in values if k.startswith(kind + "."))
                raise ValueError(f"${{{name}}} names no {kind[:-1] if kind.endswith('s') else kind}"
                                 f"; defined: {known}")
            return values[name]

        whole = _REF.fullmatch(obj)
        if whole:  # a value that is one reference keeps its type (seed: an int)
            return lookup(whole)
        return _REF.sub(lambda m: str(lookup(m)), obj)
    return obj


def _parse_vars(pairs: list[str] | None) -> dict[str, object]:
    """``["NAME=VALUE", ...]`` from the command line; VALUE is read as YAML (``3`` an int)."""
    out = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_\-]+", name):
            raise ValueError(f"--var takes NAME=VALUE, got {pair!r}")
        out[name] = yaml.safe_load(value)
    return out


def load_pipeline(path: str | Path, output: str | Path | None = None, seed: int | None = None,
                  variables: dict | None = None) -> dict:
    """Read a pipeline YAML, check its shape, and resolve its ``${...}`` references; ``seed``
    (``--seed``) and ``variables`` (``--var``) override the YAML's ``seed`` and ``vars``."""
    path = Path(path)
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict) or not isinstance(spec.get("stages"), list) or not spec["stages"]:
        raise ValueError(f"{str(path)!r}: a pipeline is a mapping with a non-empty 'stages' list")
    unknown = sorted(set(spec) - {"name", "description", "output", "checkpoint_every_n_steps",
                                  "stages", "evaluate", "seed", "vars"})
    if unknown:
        raise ValueError(f"{str(path)!r}: unknown top-level keys {unknown}")
    names = []
    for i, st in enumerate(spec["stages"]):
        if not isinstance(st, dict) or "name" not in st or "fit" not in st:
            raise ValueError(f"{str(path)!r}: stage {i} needs 'name' and 'fit' (a LightningCLI "
                             f"config), got {st!r:.200}")
        extra = sorted(set(st) - {"name", "fit", "description"})
        if extra:
            raise ValueError(f"{str(path)!r}: stage {st['name']!r} has unknown keys {extra}")
        if "model" not in st["fit"]:
            raise ValueError(f"{str(path)!r}: stage {st['name']!r} has no fit.model")
        names.append(st["name"])
    if len(set(names)) != len(names):
        raise ValueError(f"{str(path)!r}: stage names must be unique, got {names}")
    yaml_vars = spec.get("vars") or {}
    if not isinstance(yaml_vars, dict):
        raise ValueError(f"{str(path)!r}: 'vars' must be a mapping of names to values")
    undeclared = sorted(set(variables or {}) - set(yaml_vars))
    if undeclared:
        raise ValueError(f"--var {undeclared} not declared in {str(path)!r}'s vars: "
                         f"{sorted(yaml_vars)} (declare each with its default)")
    run_seed = spec.get("seed", 0) if seed is None else seed
    if isinstance(run_seed, bool) or not isinstance(run_seed, int):
        raise ValueError(f"{str(path)!r}: seed must be an integer, got {run_seed!r}")
    for st in spec["stages"]:
        if seed is not None or "seed_everything" not in st["fit"]:
            st["fit"]["seed_everything"] = run_seed
    out = Path(output or spec.get("output") or Path("runs") / spec.get("name", path.stem))
    values = {"output": str(out.resolve()), "seed": run_seed,
              **{f"stages.{n}": str(out.resolve() / n) for n in names},
              **{f"vars.{k}": v for k, v in {**yaml_vars, **(variables or {})}.items()}}
    spec = _substitute(spec, values)
    spec["output"] = str(out.resolve())
    spec["seed"] = run_seed
    spec.setdefault("name", path.stem)
    spec.setdefault("checkpoint_every_n_steps", 50)
    return spec


# ----------------------------------------------------------------------------- running a stage
def _stage_config(stage: dict, stage_dir: Path, every_n: int) -> dict:
    cfg = copy.deepcopy(stage["fit"])
    trainer = cfg.setdefault("trainer", {})
    trainer["default_root_dir"] = str(stage_dir)
    # one log directory per attempt: CSVLogger empties its directory when a run starts again
    attempt = len(list((stage_dir / "logs").glob("attempt_*")))
    trainer.setdefault("logger", {"class_path": "lightning.pytorch.loggers.CSVLogger",
                                  "init_args": {"save_dir": str(stage_dir), "name": "logs",
                                                "version": f"attempt_{attempt}"}})
    ckdir = str(stage_dir / "checkpoints")
    callbacks = list(trainer.get("callbacks") or [])
    callbacks += [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": ckdir, "save_last": True, "save_top_k": 0,
                       "every_n_train_steps": every_n}},
        {"class_path": "hedgecats.lightning_modules.CheckpointOnInterrupt",
         "init_args": {"dirpath": ckdir}},
    ]
    trainer["callbacks"] = callbacks
    return cfg


def _cli(args, run: bool = True):
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    argv, sys.argv = sys.argv, sys.argv[:1]  # the config comes from args, not the command line
    try:
        return LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                            subclass_mode_data=True, args=args, run=run,
                            save_config_kwargs={"overwrite": True},
                            **({} if run else {"save_config_callback": None}))
    finally:
        sys.argv = argv


def _run_stage(stage: dict, stage_dir: Path, every_n: int) -> None:
    from lightning.pytorch.trainer.states import TrainerStatus

    cfg = _stage_config(stage, stage_dir, every_n)
    stage_dir.mkdir(parents=True, exist_ok=True)
    (stage_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    last = stage_dir / "checkpoints" / "last.ckpt"
    ckpt = str(last) if last.exists() else None
    cli = _cli(cfg, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt)
    if cli.trainer.state.status != TrainerStatus.FINISHED or cli.trainer.interrupted:
        raise RuntimeError(f"stage {stage['name']!r} did not finish "
                           f"(status {cli.trainer.state.status}); run again to resume it")
    if cli.trainer.is_global_zero:
        (stage_dir / "done").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))


def _warn_if_changed(stage: dict, stage_dir: Path, every_n: int, console) -> None:
    """A stage that is skipped or resumed keeps what it was run with: say so when the YAML
    changed since (the saved config.yaml is the record)."""
    saved = stage_dir / "config.yaml"
    if not saved.exists():
        return
    old = yaml.safe_load(saved.read_text())
    new = _stage_config(stage, stage_dir, every_n)
    for cfg in (old, new):  # the logger version differs per attempt by design
        cfg.get("trainer", {}).pop("logger", None)
    if old != new:
        console.print(f"[yellow]warning: stage {stage['name']!r} was run with a different "
                      f"config ({saved}); it is skipped or resumed as it was -- delete "
                      f"{stage_dir} to run it again with the new one[/yellow]", soft_wrap=True)


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


def _status(stage_dir: Path) -> str:
    if (stage_dir / "done").exists():
        return "done (skipped)"
    if (stage_dir / "checkpoints" / "last.ckpt").exists():
        return "resume from checkpoints/last.ckpt"
    return "new"


# ----------------------------------------------------------------------------- evaluation
def _instantiate(spec: dict):
    import importlib

    mod, _, cls = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(mod), cls)(**spec.get("init_args", {}))


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

    from .lightning_modules.recall_eval import EVAL_MODES, evaluate_recall, format_table
    from .models import HybridConfig, convert_to_hybrid
    from .models.checkpoint import load_hybrid

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
        switches = dict(variant)
        variant_modes = tuple(switches.pop("modes", ("swa_only", "la_only")))
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
    return {"stage": ev.get("stage"), "checkpoint": str(source), "window": window,
            "near_max": corpus.near_max, "far_min": corpus.far_min, "far_max": corpus.far_max,
            "buckets": [list(b) for b in corpus.buckets()], "device": device,
            "precision": precision, "n_docs": len(corpus.input_ids), "results": rows}


def _evaluate_command(spec: dict, ev: dict, console) -> dict:
    try:
        from .evaluation.cli import main as evaluate_main
    except ImportError as err:
        raise RuntimeError("the pipeline's evaluate step needs hedgecats.evaluation.cli "
                           f"(not available here: {err})") from err
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
                 console=None, seed: int | None = None, variables: dict | None = None
                 ) -> dict | None:
    """Run (or, with ``dry_run``, describe) a pipeline; returns what went to results.json."""
    from rich.console import Console

    console = console or Console()
    spec = load_pipeline(path, output, seed=seed, variables=variables)
    out = Path(spec["output"])
    n = len(spec["stages"])
    console.print(f"[bold]pipeline {spec['name']}[/bold] -> {out} (seed {spec['seed']})",
                  soft_wrap=True)
    for i, st in enumerate(spec["stages"], 1):
        console.print(f"  {i}/{n} {st['name']} [{_status(out / st['name'])}]: {_describe(st)}",
                      soft_wrap=True, markup=False)
        _warn_if_changed(st, out / st["name"], int(spec["checkpoint_every_n_steps"]), console)
    evals = _evaluations(spec)
    for ev in evals:
        console.print(f"  evaluate: {ev.get('kind', 'recall')} on stage {ev.get('stage')!r}")
    if dry_run:
        return None
    t0 = time.time()
    for i, st in enumerate(spec["stages"], 1):
        stage_dir = out / st["name"]
        if (stage_dir / "done").exists():
            console.print(f"[dim]stage {i}/{n} {st['name']}: done, skipped[/dim]")
            continue
        console.rule(f"stage {i}/{n}: {st['name']} ({_status(stage_dir)})")
        t = time.time()
        _run_stage(st, stage_dir, int(spec["checkpoint_every_n_steps"]))
        console.print(f"stage {st['name']} finished in {time.time() - t:.0f} s")
    summary = {"pipeline": spec["name"], "output": str(out), "seed": spec["seed"]}
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
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    console.print(f"run directory: {out}\n  results.json, <stage>/config.yaml, <stage>/stage.pt, "
                  "<stage>/checkpoints/last.ckpt, <stage>/logs/attempt_*/metrics.csv", soft_wrap=True,
                  markup=False)
    return summary


# ----------------------------------------------------------------------------- entry point
def _pipeline_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hedgecats pipeline",
                                description="Run a recipe's stages in order (see configs/pipelines).")
    p.add_argument("config", help="pipeline YAML, e.g. configs/pipelines/tiny.yaml")
    p.add_argument("--output", help="run directory (default: the YAML's output, else runs/<name>)")
    p.add_argument("--seed", type=int, default=None,
                   help="every stage's seed_everything and ${seed} (default: the YAML's seed, 0)")
    p.add_argument("--var", action="append", metavar="NAME=VALUE",
                   help="override one of the YAML's vars (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved stages and exit")
    a = p.parse_args(argv)
    import warnings

    # noise that says nothing about this run: stage 1 optimises by hand on purpose, and the
    # stages pass their ckpt_path explicitly
    for msg in ("Using ModelCheckpoint with manual optimization", r".*\.fit\(ckpt_path=",
                "isinstance.treespec, LeafSpec"):
        warnings.filterwarnings("ignore", message=msg)
    run_pipeline(a.config, a.output, a.dry_run, seed=a.seed, variables=_parse_vars(a.var))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "pipeline":
        return _pipeline_main(rest)
    if cmd == "evaluate":
        try:
            from .evaluation.cli import main as evaluate_main
        except ImportError as err:
            print(f"hedgecats evaluate is not available: hedgecats.evaluation.cli cannot be "
                  f"imported ({err})", file=sys.stderr)
            return 2
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
    print(f"unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
