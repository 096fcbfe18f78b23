"""Which layer's output gate costs a gated hybrid the short tasks? lm-eval accuracy of finished
testbed runs as trained and with one layer's gate replaced by a constant (its own mean gate,
measured by ``experiments/gate_usage.py``), in ``hybrid`` and ``swa_only`` mode.

    python -m experiments.gate_intervention RUN [RUN ...] --tasks MC_TASKS_DIR \\
        --gates gate_usage.json [--layer 0] [--out gate_intervention.json]

RUN: ``<recipe>-s<seed>`` run directories (``finetune/stage.pt``) of a gated-mixer recipe;
MC_TASKS_DIR: the testbed's multiple-choice tasks (local YAMLs: no hub); ``--gates``: the JSON
``gate_usage.py`` wrote for the same runs. CPU, about a minute per run. Prints per run and
condition the short and far task accuracy; the JSON keeps them all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path


@contextlib.contextmanager
def constant_gate(model, layer: int, g: float):
    """Inside, converted layer ``layer`` mixes with the fixed ``g`` instead of its mixer."""
    from hedgecats.models import hybrid_layers
    from hedgecats.models.mixers import FixedMixer

    attn = dict(hybrid_layers(model))[layer]
    saved = attn.mixer
    attn.mixer = FixedMixer(g)
    try:
        yield
    finally:
        attn.mixer = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--gates", required=True, help="gate_usage.py's JSON for these runs")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from hedgecats.evaluation.ablation import ModeSpec, run_modes
    from hedgecats.evaluation.lm_eval_bridge import resolve_tasks
    from hedgecats.evaluation.loading import load_for_eval

    gates = json.loads(Path(a.gates).read_text())["runs"]
    selection = resolve_tasks([a.tasks])
    specs = [ModeSpec.parse("hybrid"), ModeSpec.parse("swa_only")]
    res = {"command": "python -m experiments.gate_intervention " + " ".join(argv or sys.argv[1:]),
           "layer": a.layer, "runs": {}}
    for run in a.runs:
        if run not in gates:
            raise SystemExit(f"{a.gates} has no gate measurement of {run}")
        g = round(gates[run]["short"][str(a.layer)]["mean_g_first_window"], 3)
        loaded = load_for_eval(str(Path(run) / "finetune" / "stage.pt"))
        out = {}
        for label in ("as trained", f"layer {a.layer} gate = {g}"):
            ctx = contextlib.nullcontext() if label == "as trained" else \
                constant_gate(loaded.model, a.layer, g)
            with ctx:
                scores = run_modes(loaded.model, loaded.tokenizer, specs, selection,
                                   bootstrap_iters=0, progress=lambda s: None)
            out[label] = {m: {t: s.score for t, s in sc.items()} for m, sc in scores.items()}
            print(f"{Path(run).name} | {label} | " + " | ".join(
                f"{m} {t} {v:.1f}" for m, sc in out[label].items() for t, v in sc.items()),
                flush=True)
        res["runs"][run] = out
    by_recipe: dict = {}
    for run, out in res["runs"].items():
        recipe = Path(run).name.rsplit("-s", 1)[0]
        for k, (label, sc) in enumerate(out.items()):
            for m, tasks in sc.items():
                for t, v in tasks.items():
                    key = (recipe, "as trained" if k == 0 else "constant gate", m, t)
                    by_recipe.setdefault(key, []).append(v)
    res["summary"] = [{"recipe": r, "condition": c, "mode": m, "task": t,
                       "mean": statistics.fmean(v),
                       "std": statistics.stdev(v) if len(v) > 1 else 0.0, "n": len(v)}
                      for (r, c, m, t), v in by_recipe.items()]
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
