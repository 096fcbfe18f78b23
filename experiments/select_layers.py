"""Layer selection on the testbed: how well each cheap score ranks the layers against the
expensive one (the KL with only that layer hybrid), and how stable every score's ranking is across
seeds (issue 48; docs/layer-selection.md).

    python -m experiments.select_layers run --root DIR --seeds 0,1,2 \\
        --var teacher=runs/testbed/teacher/teacher/model --var tasks=runs/testbed/mc_tasks
    python -m experiments.select_layers compare --root DIR
    python -m experiments.select_layers tiny --root DIR      # the same at CPU scale

``run``: the recipe (default ``configs/testbed/hedgecats_keep1.yaml``) once per seed, each a whole
pipeline into ``DIR/<recipe>-s<seed>`` (its ``select-layers`` stage scores its own stage 1 and
writes ``selection.json``). ``compare``: ``hedgecats select-layers`` over every seed's stage 1
together, on the recipe's held-out data (its selector's validation split), with every score:
``DIR/compare/selection.{json,md,png}`` hold each seed's scores and rankings, each cheap score's
agreement with ``kl`` (Kendall's tau, top-k overlap; mean over seeds) and each score's stability
across seeds. ``tiny``: pretrains a 4-layer byte-level teacher on the recall corpus and runs stage 1
per seed, then ``compare`` (64 x 128 held-out tokens): minutes on a CPU, for the tooling, not for the testbed's answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

RECIPE = Path("configs/testbed/hedgecats_keep1.yaml")
SELECTOR = "select-layers"
COMPARE = "la_rel_err,hybrid_rel_err,la_share,random"


def _seeds(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def _run_dir(root: Path, recipe: Path, seed: int) -> Path:
    return root / f"{recipe.stem}-s{seed}"


def run(root: Path, recipe: Path, seeds: list[int], variables: list[str]) -> None:
    from hedgecats.cli import main

    for seed in seeds:
        argv = ["pipeline", str(recipe), "--output", str(_run_dir(root, recipe, seed)),
                "--seed", str(seed)] + [w for v in variables for w in ("--var", v)]
        if main(argv) != 0:
            raise SystemExit(f"{' '.join(argv)} failed")


def held_out_data(recipe: Path, variables: list[str]) -> dict:
    """The DataModule whose validation split the recipe's selector scores."""
    from hedgecats.pipeline.spec import load_pipeline, parse_vars

    spec = load_pipeline(recipe, output="/tmp/unused", variables=parse_vars(variables))
    stage = next(s for s in spec["stages"] if s["name"] == SELECTOR)
    return stage["fit"]["data"]


def compare(root: Path, runs: list[Path], data: dict, keep: int, stage: str = "transfer") -> int:
    """``hedgecats select-layers`` over every run's stage 1, every score beside ``kl``."""
    from hedgecats.cli import main

    return main(["select-layers", *map(str, runs), "--stage", stage, "--output",
                 str(root / "compare"), "--keep", str(keep), "--data", json.dumps(data),
                 "--compare", COMPARE, "--overwrite"])


# ----------------------------------------------------------------------------- CPU scale
TINY_DATA = {"class_path": "hedgecats.lightning_modules.RecallDataModule",
             "init_args": {"seq_len": 128, "window": 16, "far_min": 40, "far_max": 110,
                           "task": "marker", "filler": "ab", "num_train": 8192, "num_val": 64,
                           "num_test": 32, "batch_size": 16, "seed": 0}}
TRAINER = {"accelerator": "cpu", "limit_val_batches": 1, "num_sanity_val_steps": 0,
           "log_every_n_steps": 10, "enable_model_summary": False, "enable_progress_bar": False}


def tiny(root: Path, seeds: list[int], teacher_steps: int, transfer_steps: int) -> int:
    """A 4-layer teacher (seed 0), stage 1 under each seed, then ``compare``."""
    from hedgecats.cli import main

    root.mkdir(parents=True, exist_ok=True)
    teacher = {"name": "select-tiny-teacher", "stages": [{"name": "teacher", "fit": {
        "model": {"class_path": "hedgecats.lightning_modules.TeacherPretraining",
                  "init_args": {"hidden_size": 64, "num_layers": 4, "num_heads": 4, "lr": 6e-3,
                                "warmup_steps": 20, "tie_word_embeddings": True}},
        "data": TINY_DATA,
        "trainer": {**TRAINER, "max_steps": teacher_steps, "val_check_interval": teacher_steps}}}]}
    transfer = {"name": "select-tiny-transfer", "vars": {"teacher": ""}, "stages": [
        {"name": "transfer", "fit": {
            "model": {"class_path": "hedgecats.lightning_modules.AttentionTransfer",
                      "init_args": {"model_name_or_path": "${vars.teacher}", "lr": 1e-2,
                                    "hybrid": {"window": 16, "g": 0.5},
                                    "max_rel_err": None, "max_den_collapsed": None}},
            "data": TINY_DATA,
            "trainer": {**TRAINER, "max_steps": transfer_steps,
                        "val_check_interval": transfer_steps}}}]}
    for name, spec in (("teacher.yaml", teacher), ("transfer.yaml", transfer)):
        (root / name).write_text(yaml.safe_dump(spec, sort_keys=False))
    if main(["pipeline", str(root / "teacher.yaml"), "--output", str(root / "teacher")]) != 0:
        return 1
    runs = []
    for seed in seeds:
        out = root / f"transfer-s{seed}"
        if main(["pipeline", str(root / "transfer.yaml"), "--output", str(out), "--seed",
                 str(seed), "--var", f"teacher={root / 'teacher' / 'teacher' / 'model'}"]) != 0:
            return 1
        runs.append(out)
    return compare(root, runs, TINY_DATA, keep=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.select_layers",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the recipe once per seed")
    c = sub.add_parser("compare", help="every score on every seed's stage 1")
    t = sub.add_parser("tiny", help="the same at CPU scale on a tiny model")
    for q in (r, c, t):
        q.add_argument("--root", required=True, type=Path)
        q.add_argument("--seeds", type=_seeds, default=[0, 1, 2])
    for q in (r, c):
        q.add_argument("--recipe", type=Path, default=RECIPE)
        q.add_argument("--var", action="append", default=[], metavar="NAME=VALUE")
    c.add_argument("--keep", type=int, default=1)
    t.add_argument("--teacher-steps", type=int, default=300)
    t.add_argument("--transfer-steps", type=int, default=60)
    a = p.parse_args(argv)
    if a.cmd == "run":
        run(a.root, a.recipe, a.seeds, a.var)
        return 0
    if a.cmd == "compare":
        runs = [_run_dir(a.root, a.recipe, s) for s in a.seeds]
        return compare(a.root, runs, held_out_data(a.recipe, a.var), a.keep)
    return tiny(a.root, a.seeds, a.teacher_steps, a.transfer_steps)


if __name__ == "__main__":
    sys.exit(main())
