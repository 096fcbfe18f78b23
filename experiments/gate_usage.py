"""What a trained output-gate mixer does: the gate ``g = sigmoid(W x)`` (the SWA branch's weight
per channel; LA gets ``1 - g``) of each converted layer, on prompts the window holds whole and on
long ones, inside and beyond the window.

    python -m experiments.gate_usage RUN [RUN ...] --tasks MC_TASKS_DIR [--out gate_usage.json]

RUN: a finished testbed run directory (``<recipe>-s<seed>`` with ``finetune/stage.pt``) or a
stage checkpoint; MC_TASKS_DIR: the testbed's multiple-choice tasks
(``write_recall_mc_tasks``): the short tasks' contexts (the whole prompt inside a 64-token
window) and the far task's (190-439 bytes). Per run and layer: mean gate over (a) the short
prompts' positions, (b) the far prompts' first ``window`` positions, (c) their later positions,
and the share of gate values below 0.25 (channels handed mostly to LA). A fixed mixer has
g = 0.5 everywhere. Runs on the CPU in seconds per run (testbed-sized models).

Why (docs/testbed.md, follow-up C): the gated mixers keep the fixed mixer's far-recall Delta_LA
but lose 12-24 points on the short tasks at the same LM loss; on a short prompt LA sees no key and
the hybrid is ``g * SWA``, so a gate that learned to hand channels to LA scales them down there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


def _contexts(tasks: Path, name: str, limit: int) -> list[str]:
    rows = []
    for path in sorted(tasks.glob(f"{name}*.jsonl")):
        rows += [json.loads(line)["context"] for line in path.read_text().splitlines() if line]
    return rows[:limit]


def gate_stats(model, tok, texts: list[str], window: int) -> dict[int, dict[str, float]]:
    """Per converted layer: mean gate before / from position ``window``, and the share < 0.25."""
    from hedgecats.models import hybrid_layers

    seen: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, attn in hybrid_layers(model):
        if not getattr(attn.mixer, "needs_input", False):
            raise SystemExit(f"layer {i}'s mixer is {type(attn.mixer).__name__}, not an output "
                             f"gate: nothing to measure (a fixed mixer's g is its constant)")
        hooks.append(attn.mixer.register_forward_hook(
            lambda m, args, out, i=i: seen.setdefault(i, []).append(out.detach().float())))
    sums: dict[int, dict[str, list[float]]] = {}
    try:
        with torch.no_grad():
            for text in texts:
                seen.clear()
                ids = tok(text, return_tensors="pt").input_ids
                model(ids)
                for i, outs in seen.items():
                    g = outs[-1][0]  # (H, T, D)
                    s = sums.setdefault(i, {"early": [], "late": [], "low": []})
                    s["early"].append(g[:, :window].mean().item())
                    if g.shape[1] > window:
                        s["late"].append(g[:, window:].mean().item())
                    s["low"].append((g < 0.25).float().mean().item())
    finally:
        for h in hooks:
            h.remove()
    return {i: {"mean_g_first_window": statistics.fmean(s["early"]),
                "mean_g_beyond_window": statistics.fmean(s["late"]) if s["late"] else None,
                "share_below_0.25": statistics.fmean(s["low"])} for i, s in sorted(sums.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--tasks", required=True, help="the testbed's mc_tasks directory")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per kind")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from hedgecats.evaluation.loading import load_for_eval

    tasks = Path(a.tasks)
    short = _contexts(tasks, "recall_mc_short", a.prompts)
    far = _contexts(tasks, "recall_mc_far", a.prompts)
    if not short or not far:
        raise SystemExit(f"{tasks}: no recall_mc_short*/recall_mc_far jsonl files")
    res = {"command": "python -m experiments.gate_usage " + " ".join(argv or sys.argv[1:]),
           "prompts": {"short": len(short), "far": len(far)}, "runs": {}}
    for run in a.runs:
        p = Path(run)
        spec = str(p / "finetune" / "stage.pt") if p.is_dir() else run
        loaded = load_for_eval(spec)
        window = loaded.model.hedgecats_config.window
        res["runs"][run] = {"window": window,
                            "short": gate_stats(loaded.model, loaded.tokenizer, short, window),
                            "far": gate_stats(loaded.model, loaded.tokenizer, far, window)}
        print(f"{run}:")
        for i, s in res["runs"][run]["short"].items():
            f = res["runs"][run]["far"][i]
            print(f"  layer {i}: short prompts g {s['mean_g_first_window']:.3f} (< 0.25: "
                  f"{s['share_below_0.25']:.2f}) | far prompts g first {window} "
                  f"{f['mean_g_first_window']:.3f}, beyond {f['mean_g_beyond_window']:.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
