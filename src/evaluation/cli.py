"""``hedgecats evaluate``: lm-eval component ablations, retrieval beyond the window, branch usage.

Run as ``hedgecats evaluate ...`` or ``python -m hedgecats.evaluation.cli ...``.
Every input is checked before the model is loaded; results are written atomically.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shlex
import sys
import time
from pathlib import Path

from hedgecats.models.config import variant_syntax

from .ablation import (
    DEFAULT_MODES,
    ModeSpec,
    check_modes_supported,
    is_converted,
    parse_modes,
    run_modes,
)
from .lm_eval_bridge import (
    PAPER_TASKS,
    check_metric_overrides,
    parse_metric_overrides,
    resolve_tasks,
)
from .report import (
    atomic_output_dir,
    build_results,
    check_output_dir,
    format_markdown,
    write_results,
)

log = logging.getLogger(__name__)

__all__ = ["build_parser", "main"]

_MODES_HELP = ("comma-separated ablation modes, each with optional '+switch' parts (syntax "
               "below); default: %(default)s")

_MODE_SYNTAX = variant_syntax() + """
  A switch where it has no effect is an error. The whole string is the row label, e.g.
  --modes hybrid,swa_only,la_only,la_only+la_span=all,la_only+rescale+la_span=all,swa_only+window=128
  'softmax' is the original attention (the only mode of a model that is not converted).
"""

_EPILOG = _MODE_SYNTAX + """
examples:
  hedgecats evaluate --model runs/stage2/stage.pt --output results/stage2
  hedgecats evaluate --model runs/hedgecats --retrieval --output results/run  # its final stage
  hedgecats evaluate --model meta-llama/Meta-Llama-3-8B-Instruct --hybrid hybrid.yaml \\
      --tasks piqa,arc_easy --modes hybrid,swa_only,la_only+la_span=all --output results/init
  hedgecats evaluate --model ckpt --tasks my_tasks/ --metric my_task=acc_norm --output out
  hedgecats evaluate --model runs/seed0/stage.pt --model runs/seed1/stage.pt --retrieval \
      --branch-usage --output results/two-seeds

Baseline for Rec. Perf: --baseline MODEL if given; otherwise a converted model in mode 'softmax'
(exactly the original model's attention, same weights); a plain model is its own baseline.
Outputs in --output: results.json, results.md (rows = modes; columns = tasks + AVG + Rec. Perf),
results.csv, and branch_usage.png when branch usage is measured."""


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes comma-separated integers, got {text!r}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds needs distinct integers, got {text!r}")
    return seeds


def _ints(text: str) -> list[int]:
    try:
        vals = [int(t) for t in _csv(text)]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return vals


def _is_hybrid_directory(spec: str) -> bool:
    """A saved hedgecats hybrid (``hedgecats export``, ``import-lolcats``, ``save_pretrained``
    of a converted model): a local directory whose config.json names a ``hedgecats_*`` type."""
    cfg = Path(spec).expanduser() / "config.json"
    try:
        return cfg.is_file() and str(json.loads(cfg.read_text()).get("model_type", "")
                                     ).startswith("hedgecats_")
    except (OSError, ValueError):
        return False


def _batch_size(text: str) -> int | str:
    if text == "auto" or text.startswith("auto:"):
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--batch-size takes an integer >= 1 or 'auto', got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hedgecats evaluate",
        description="lm-eval component ablations (zero-shot, every mode on one loaded model), "
                    "retrieval beyond the window, branch usage; results.json/md/csv.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG)
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, action="append", dest="models", metavar="MODEL",
                   help="a stage checkpoint (stage.pt, its directory, or a pipeline run "
                        "directory: its final stage, as hedgecats export takes it), or a "
                        "transformers model (local directory or hub id). "
                        "Repeat it with stage checkpoints of the same base model trained with "
                        "different seeds to report mean, sd and 95%% CI over them")
    g.add_argument("--hybrid", metavar="YAML",
                   help="HybridConfig YAML: convert a plain transformers --model on the fly, with "
                        "freshly initialised feature maps")
    g.add_argument("--baseline", metavar="MODEL",
                   help="reference model for Rec. Perf (transformers path or id). A stage "
                        "checkpoint's base model must match it")
    g.add_argument("--expect-base", metavar="MODEL",
                   help="fail unless the stage checkpoint was trained from this base model")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--dtype", default="auto",
                   help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    g = p.add_argument_group("lm-eval")
    g.add_argument("--tasks", action="append", metavar="TASKS",
                   help="comma-separated lm-eval task names, directories of task YAMLs, or task "
                        f"YAML files; repeatable (default: {','.join(PAPER_TASKS)}); 'none': "
                        "no lm-eval task, the probes only (--retrieval, --branch-usage; needs no "
                        "task data)")
    g.add_argument("--modes", default=",".join(DEFAULT_MODES), help=_MODES_HELP)
    g.add_argument("--metric", action="append", metavar="TASK=METRIC",
                   help="score TASK by METRIC (default: acc_norm for arc_challenge and hellaswag, "
                        "acc otherwise, acc_norm if a task has no acc); repeatable")
    g.add_argument("--limit", type=float, default=None,
                   help="lm-eval limit: documents per task (int) or fraction (<1); for quick checks")
    g.add_argument("--batch-size", type=_batch_size, default=8, help="lm-eval batch size or 'auto'")
    g.add_argument("--max-length", type=int, default=None, help="lm-eval max sequence length")
    g.add_argument("--bootstrap-iters", type=int, default=100_000,
                   help="lm-eval bootstrap iterations for stderrs of non-mean metrics (acc and "
                        "acc_norm stderrs are analytic; 0 turns every stderr off)")
    g.add_argument("--seeds", type=_seeds, default=None, metavar="S1,S2,...",
                   help="with --hybrid: convert once per seed (feature-map initialisation) and "
                        "report mean, sd and 95%% CI over seeds")
    g = p.add_argument_group("retrieval beyond the window (key-value recall per distance bucket)")
    g.add_argument("--retrieval", action="store_true",
                   help="run the recall probe in every mode (and softmax); scoring: greedy exact "
                        "match of the queried value")
    g.add_argument("--retrieval-docs", type=int, default=16, metavar="N",
                   help="probe documents per target distance (default %(default)s)")
    g.add_argument("--retrieval-distances", type=_ints, default=None, metavar="D1,D2,...",
                   help="target distances in tokens (default: w/2, 2w, 8w, 24w for the smallest "
                        "converted window w)")
    g.add_argument("--retrieval-window", type=int, default=None, metavar="W",
                   help="bucket window for a model that is not converted")
    g.add_argument("--retrieval-max-length", type=int, default=None, metavar="T",
                   help="longest probe document in tokens (default: max_position_embeddings)")
    g = p.add_argument_group("branch usage (share of the output norm from SWA and LA, per layer "
                             "and head)")
    g.add_argument("--branch-usage", action="store_true",
                   help="measure branch usage in hybrid mode; numbers in results.json, heatmap in "
                        "branch_usage.png")
    g.add_argument("--branch-usage-text", metavar="FILE",
                   help="text sample (default: a synthetic recall-corpus document)")
    g.add_argument("--branch-usage-tokens", type=int, default=1024, metavar="N",
                   help="tokens of the sample to use (default %(default)s)")
    g = p.add_argument_group("output")
    g.add_argument("--output", required=True, metavar="DIR", help="directory for the results")
    g.add_argument("--overwrite", action="store_true",
                   help="replace an earlier evaluation's --output (one with results.json)")
    g.add_argument("--force", action="store_true",
                   help="replace a non-empty --output that holds no earlier evaluation")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return p


def _device(name: str | None) -> str:
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _free() -> None:
    """Collect what the caller just dropped (call after clearing its last reference)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _probe_specs(model, specs: list[ModeSpec]) -> list[ModeSpec]:
    """The modes plus 'softmax' (the original attention) as a reference row."""
    if is_converted(model) and not any(s.label == "softmax" for s in specs):
        return specs + [ModeSpec.parse("softmax")]
    return specs


def _probes_only(args, task_specs: list[str]) -> bool:
    """``--tasks none``: no lm-eval task, only the probes (``--retrieval``, ``--branch-usage``);
    checked here, before any model is loaded."""
    if "none" not in task_specs:
        return False
    if task_specs != ["none"]:
        raise ValueError(f"--tasks none means no lm-eval task; it cannot be combined with "
                         f"others (got {task_specs})")
    if not (args.retrieval or args.branch_usage):
        raise ValueError("--tasks none runs no lm-eval task, so there would be nothing to "
                         "evaluate: add --retrieval and/or --branch-usage, or name tasks")
    for flag, given in (("--baseline", args.baseline), ("--metric", args.metric),
                        ("--seeds", args.seeds)):
        if given:
            raise ValueError(f"{flag} applies to lm-eval's scores; --tasks none has none")
    if len(args.models) > 1:
        raise ValueError("--tasks none with several --model checkpoints: the probes run on one "
                         "model; evaluate each checkpoint on its own")
    return True


def _probes(args, loaded, specs, device, say) -> dict:
    """Retrieval probe and branch usage on the loaded model; ``{}`` when none is asked for."""
    out = {}
    if args.retrieval:
        from .retrieval import retrieval_probe

        out["retrieval"] = retrieval_probe(
            loaded.model, loaded.tokenizer, _probe_specs(loaded.model, specs),
            window=args.retrieval_window, distances=args.retrieval_distances,
            n_per_distance=args.retrieval_docs, max_length=args.retrieval_max_length,
            device=device, progress=say)
    if args.branch_usage:
        from .branch_usage import branch_usage

        say("branch usage (mode hybrid)")
        out["branch_usage"] = branch_usage(
            loaded.model, loaded.tokenizer, text=args.branch_usage_sample,
            max_tokens=args.branch_usage_tokens, text_source=args.branch_usage_text,
            device=device)
    return out


def _check_paths(args) -> None:
    """A ``--model`` or ``--baseline`` that can only be a local path and is not there: said so,
    instead of "not a converted model" or a hub error after every task has run."""
    from ..models.io import missing_local_path

    for flag, values in (("--model", args.models), ("--baseline", [args.baseline])):
        for value in values:
            missing = missing_local_path(value) if value else None
            if missing:
                raise ValueError(f"{flag} {missing}")


def _final_stage(spec: str, say) -> str:
    """``--model`` that is a pipeline run directory: its final stage's ``stage.pt``, taken as
    ``hedgecats export`` takes it; a run whose last stage did not finish is refused naming
    it. Anything else is returned as given."""
    from ..models.stage_source import is_run_directory, resolve_stage

    if not is_run_directory(spec):
        return spec
    stage_pt, _ = resolve_stage(spec, command="evaluate")
    say(f"--model {spec}: the run's final stage, {stage_pt}")
    return str(stage_pt)


def _branch_usage_sample(args) -> str | None:
    """The text of ``--branch-usage-text``, read now (a file that is not UTF-8 text fails
    here, not after the lm-eval tasks)."""
    if not args.branch_usage_text:
        return None
    path = Path(args.branch_usage_text)
    if not path.is_file():
        raise ValueError(f"--branch-usage-text {args.branch_usage_text!r} is not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--branch-usage-text {args.branch_usage_text!r} is not UTF-8 text "
                         f"({err.reason} at byte {err.start}); re-encode it as UTF-8") from None


def _check_numbers(args) -> None:
    """Numbers that lm-eval or a probe would refuse only once it runs."""
    for flag, value, low in (("--retrieval-docs", args.retrieval_docs, 1),
                             ("--retrieval-window", args.retrieval_window, 1),
                             ("--retrieval-max-length", args.retrieval_max_length, 2),
                             ("--max-length", args.max_length, 1),
                             ("--bootstrap-iters", args.bootstrap_iters, 0)):
        if value is not None and value < low:
            raise ValueError(f"{flag}={value!r} must be >= {low}")
    if args.limit is not None and not args.limit > 0:
        raise ValueError(f"--limit={args.limit!r} must be > 0 (documents per task, or a fraction "
                         "below 1)")


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    """Everything after parsing; raises ``ValueError`` on bad input before writing anything."""
    import lm_eval

    from .loading import (
        check_base_model,
        is_stage_checkpoint,
        load_for_eval,
        peek_base_model,
        peek_stage,
        read_hybrid_config,
        resolve_dtype,
    )

    say = (lambda *_: None) if args.quiet else (lambda msg: print(msg, flush=True))
    started = time.time()
    # ---- check every input before loading anything: after this, only a model or a task that
    # cannot be loaded stops the run before the results are written
    _check_paths(args)
    args.models = [_final_stage(m, say) for m in args.models]
    specs: list[ModeSpec] = parse_modes(args.modes)
    overrides = parse_metric_overrides(args.metric)
    out_dir = check_output_dir(args.output, args.overwrite, args.force)
    hybrid = read_hybrid_config(args.hybrid) if args.hybrid else None
    task_specs = [t for item in (args.tasks or [",".join(PAPER_TASKS)]) for t in _csv(item)]
    probes_only = _probes_only(args, task_specs)
    args.model = args.models[0]
    if len(args.models) > 1:
        if len(set(args.models)) != len(args.models):
            raise ValueError(f"--model given twice with the same value: {args.models}")
        if args.seeds:
            raise ValueError("give either several --model checkpoints or --seeds, not both")
        plain = [m for m in args.models if not is_stage_checkpoint(m)]
        if plain:
            raise ValueError(f"several --model values must all be stage checkpoints (runs with "
                             f"different seeds); not checkpoints: {plain}")
        first = peek_base_model(args.models[0])
        for m in args.models[1:]:
            check_base_model(peek_base_model(m), first, f"the base model of {args.models[0]!r}")
    if is_stage_checkpoint(args.model):
        if hybrid is not None:
            raise ValueError(f"--hybrid converts a plain transformers model; {args.model!r} is a "
                             "stage checkpoint, which carries its own HybridConfig")
        recorded = peek_base_model(args.model)
        check_base_model(recorded, args.expect_base, "--expect-base")
        check_base_model(recorded, args.baseline, "--baseline")
    elif args.expect_base:
        raise ValueError("--expect-base checks a stage checkpoint's base model; --model "
                         f"{args.model!r} is not a stage checkpoint")
    converted = hybrid is not None or _is_hybrid_directory(args.model) or (
        is_stage_checkpoint(args.model) and peek_stage(args.model).get("hybrid_config") is not None)
    needs = [s.label for s in specs if s.mode != "softmax"]
    if needs and not converted:
        raise ValueError(f"modes {needs} need a converted (hybrid) model, but {args.model!r} is "
                         "not one; pass a stage checkpoint of a hybrid, or --hybrid <HybridConfig "
                         "YAML> to convert it, or evaluate it with --modes softmax")
    if args.retrieval and args.retrieval_window is None and hybrid is None \
            and not is_stage_checkpoint(args.model):
        raise ValueError("--retrieval on a model that is not converted needs --retrieval-window "
                         "(the window that defines the distance buckets)")
    if args.branch_usage and hybrid is None and not is_stage_checkpoint(args.model):
        raise ValueError("--branch-usage needs a converted model: a stage checkpoint, or --hybrid")
    args.branch_usage_sample = _branch_usage_sample(args)
    if args.branch_usage_tokens < 2:
        raise ValueError(f"--branch-usage-tokens={args.branch_usage_tokens!r} must be >= 2")
    _check_numbers(args)
    if args.seeds and hybrid is None:
        raise ValueError("--seeds re-initialises the feature maps and needs --hybrid; a stage "
                         "checkpoint has trained ones (give one --model per training seed "
                         "instead)")
    device = _device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if probes_only:
        selection = None
        say("no lm-eval tasks (--tasks none): the probes only")
    else:
        say(f"resolving tasks: {', '.join(task_specs)}")
        selection = resolve_tasks(task_specs)
        check_metric_overrides(selection, overrides)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    common = {"metric_overrides": overrides, "limit": limit, "batch_size": args.batch_size,
              "max_length": args.max_length, "device": device,
              "bootstrap_iters": args.bootstrap_iters, "progress": say}

    # ---- load; check modes and the base model
    # one item per run: (model, HybridConfig or None, lm-eval seed); several runs = seeds
    if args.seeds:
        items = [(args.model, type(hybrid).from_dict({**hybrid.to_dict(), "seed": s}), s)
                 for s in args.seeds]
        seed_labels, seed_kind = list(args.seeds), "feature-map initialisation seed (--hybrid)"
    else:
        items = [(m, hybrid, 0) for m in args.models]
        seed_labels = list(args.models) if len(args.models) > 1 else None
        seed_kind = "stage checkpoint (one per training seed)" if seed_labels else None
    runs, baseline, baseline_source, extra = [], None, "", {}
    loaded = None
    for k, (model_spec, cfg, seed) in enumerate(items):
        say(f"loading {model_spec}" + (f" (feature-map seed {seed})" if args.seeds else ""))
        loaded = load_for_eval(model_spec, hybrid=cfg, device=device, dtype=dtype)
        if k == 0:
            source, base_model = loaded.source, loaded.base_model
            check_modes_supported(loaded.model, specs)
        if probes_only:
            runs.append({s.label: {} for s in specs})
        else:
            runs.append(run_modes(loaded.model, loaded.tokenizer, specs, selection, seed=seed,
                                  **common))
        if k == 0 and args.baseline is None and not probes_only:
            if is_converted(loaded.model):
                baseline_source = "same model in mode 'softmax' (the original attention)"
                say("baseline: " + baseline_source)
                prior = next((s.label for s in specs if s.mode == "softmax" and not s.switches),
                             None)
                baseline = runs[0][prior] if prior else run_modes(
                    loaded.model, loaded.tokenizer, [ModeSpec.parse("softmax")], selection,
                    **common)["softmax"]
            else:
                baseline_source = "the model itself (not converted)"
                baseline = runs[0][specs[0].label]
        if k == 0:
            extra = _probes(args, loaded, specs, device, say)
        if k < len(items) - 1:
            loaded = None
            _free()
    if args.baseline is not None:
        loaded = None
        _free()
        say(f"baseline: loading {args.baseline}")
        base = load_for_eval(args.baseline, device=device, dtype=dtype)
        spec = ModeSpec.parse("softmax")
        baseline = run_modes(base.model, base.tokenizer, [spec], selection, **common)["softmax"]
        baseline_source = args.baseline
        base = None
        _free()

    meta = {
        "model": args.model if len(args.models) == 1 else ", ".join(args.models),
        "model_source": source, "base_model": base_model,
        "baseline": baseline_source, "lm_eval_version": getattr(lm_eval, "__version__", "?"),
        "command": "hedgecats evaluate " + shlex.join(argv), "device": device, "dtype": str(dtype),
        "limit": limit, "num_fewshot": 0, "seconds": None,
    }
    if hybrid is not None:
        meta["hybrid_config"] = hybrid.to_dict()
    specs_map = {s.label: (s.mode, s.switches) for s in specs}
    meta["seconds"] = round(time.time() - started, 1)
    if seed_labels:
        meta["seed_kind"] = seed_kind
        if extra:
            meta["probes_run"] = str(seed_labels[0])  # retrieval / branch usage: first run only
    task_names = [] if probes_only else selection.names
    results = build_results(runs, task_names, specs=specs_map, baseline=baseline,
                            baseline_source=baseline_source, seeds=seed_labels, meta=meta,
                            retrieval=extra.get("retrieval"), branch_usage=extra.get("branch_usage"))
    _write(results, out_dir, args)
    return results


def _write(results: dict, out_dir: Path, args) -> None:
    """results.json, .md, .csv (and the branch-usage plot) into ``out_dir``, whole or not at
    all; a failed write (a full disk, a read-only location) is ``WriteFailedError`` naming it,
    in the pipeline's wording."""
    from ..models.io import WriteFailedError, write_failed

    existed = out_dir.exists()
    try:
        with atomic_output_dir(out_dir, args.overwrite, args.force) as tmp:
            write_results(results, tmp)
            if results["branch_usage"]:
                from .branch_usage import plot_branch_usage

                plot_branch_usage(results["branch_usage"], tmp / "branch_usage.png",
                                  title=f"LA share: {args.model}")
    except OSError as err:
        if isinstance(err, WriteFailedError):
            raise
        raise write_failed(out_dir, err, "--output is as it was" if existed else
                           "nothing was written") from err


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hedgecats evaluate``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with usage on syntax errors
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ..models.io import WriteFailedError

    try:
        results = run(args, argv)
    except ValueError as e:
        print(f"hedgecats evaluate: error: {e}", file=sys.stderr)
        return 2
    except WriteFailedError as e:  # the results are lost: a full disk, a read-only location
        print(f"hedgecats evaluate: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    if not args.quiet:
        print()
        print(format_markdown(results))
        out = Path(args.output).expanduser().resolve()
        print(f"results written to {out}/ (results.json, results.md, results.csv"
              + (", branch_usage.png" if results.get("branch_usage") else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
