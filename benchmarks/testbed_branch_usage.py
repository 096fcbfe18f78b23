"""LA's share of each converted layer's attention output (``evaluation.branch_usage``) for
finished testbed runs, aggregated over seeds: how much of the hybrid's output comes from LA where
it can see a key.

    python benchmarks/testbed_branch_usage.py RUN [RUN ...] --text FILE [--out branch_usage.json]

RUN: ``<recipe>-s<seed>`` run directories (``finetune/stage.pt``); FILE: the text to run (the
testbed's byte-level data, e.g. far multiple-choice contexts joined, up to ``--tokens``). Prints a
markdown table: recipe, mean ± std over seeds of the per-layer share (mean over heads), and of
their mean over layers. ``hedgecats evaluate --branch-usage`` measures the same for one model
(with its lm-eval tasks); this script needs no task data.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} ± {sd:.2f}"


def table(measured: dict[str, dict]) -> str:
    """Markdown: per recipe (runs named ``<recipe>-s<seed>``) the LA share per layer and mean."""
    per = collections.defaultdict(lambda: collections.defaultdict(list))
    for run, r in measured.items():
        recipe = Path(run).name.rsplit("-s", 1)[0]
        for layer in r["layers"]:
            per[recipe][layer["layer"]].append(statistics.fmean(layer["la_share"]))
    layers = sorted({i for rec in per.values() for i in rec})
    lines = ["| recipe (seeds) | " + " | ".join(f"layer {i}" for i in layers) + " | mean |",
             "|---|" + "---|" * (len(layers) + 1)]
    for recipe, by_layer in per.items():
        n = len(next(iter(by_layer.values())))
        means = [statistics.fmean(by_layer[i][k] for i in layers) for k in range(n)]
        lines.append(f"| {recipe} ({n}) | " + " | ".join(_spread(by_layer[i]) for i in layers)
                     + f" | {_spread(means)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from hedgecats.evaluation.branch_usage import branch_usage
    from hedgecats.evaluation.loading import load_for_eval

    text = Path(a.text).read_text()
    measured = {}
    for run in a.runs:
        loaded = load_for_eval(str(Path(run) / "finetune" / "stage.pt"))
        measured[run] = branch_usage(loaded.model, loaded.tokenizer, text=text,
                                     max_tokens=a.tokens, text_source=a.text)
    md = table(measured)
    print(md)
    if a.out:
        Path(a.out).write_text(json.dumps({
            "command": "python benchmarks/testbed_branch_usage.py " + " ".join(argv or sys.argv[1:]),
            "table": md, "runs": measured}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
