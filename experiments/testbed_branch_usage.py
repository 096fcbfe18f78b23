"""LA's share of each converted layer's attention output (``evaluation.branch_usage``) for
finished testbed runs, aggregated over seeds: how much of the hybrid's output comes from LA where
it can see a key.

    python -m experiments.testbed_branch_usage RUN [RUN ...] --text FILE [--out branch_usage.json]

RUN: ``<recipe>-s<seed>`` (or ``<recipe>-q<q>-s<seed>``) run directories (``finetune/stage.pt``);
FILE: the text to run (the testbed's byte-level data, e.g. far multiple-choice contexts joined, up
to ``--tokens``). Prints a markdown table: recipe (with its share q), mean ± std over seeds of the
per-layer share (mean over heads), and of their mean over layers. ``hedgecats evaluate
--branch-usage`` measures the same for one model (with its lm-eval tasks); this script needs no
task data.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import torch


def _spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} ± {sd:.2f}"


def _label(run: str) -> str:
    """The row of a run directory: its recipe, with its share q (``testbed.run_label``)."""
    from experiments.testbed import parse_run_name, run_label

    parsed = parse_run_name(Path(run).name)
    return Path(run).name if parsed is None else run_label(parsed[0], parsed[1])


def table(measured: dict[str, dict]) -> str:
    """Markdown: per recipe (runs named ``<recipe>-s<seed>``) the LA share per layer and mean.
    A run's mean is over the layers it converted; a layer that some of a recipe's runs keep
    softmax (layer selection) is given over the runs that converted it, ``(k of n)``."""
    per = collections.defaultdict(lambda: collections.defaultdict(list))
    means = collections.defaultdict(list)
    for run, r in measured.items():
        recipe = _label(run)
        shares = {layer["layer"]: statistics.fmean(layer["la_share"]) for layer in r["layers"]}
        for i, v in shares.items():
            per[recipe][i].append(v)
        means[recipe].append(statistics.fmean(shares.values()))
    layers = sorted({i for rec in per.values() for i in rec})

    def cell(values: list[float], n: int) -> str:
        if not values:
            return "-"
        if len(values) < n:
            return f"{statistics.fmean(values):.2f} ({len(values)} of {n})"
        return _spread(values)

    lines = ["| recipe (seeds) | " + " | ".join(f"layer {i}" for i in layers) + " | mean |",
             "|---|" + "---|" * (len(layers) + 1)]
    for recipe, by_layer in per.items():
        n = len(means[recipe])
        lines.append(f"| {recipe} ({n}) | " + " | ".join(cell(by_layer.get(i, []), n)
                                                        for i in layers)
                     + f" | {_spread(means[recipe])} |")
    return "\n".join(lines)


def query_table(at_query: dict[str, dict]) -> str:
    """Markdown: per recipe, LA's share at the question position / elsewhere, mean over layers
    (mean ± std over seeds)."""
    per = collections.defaultdict(lambda: {"last": [], "other": []})
    for run, layers in at_query.items():
        recipe = _label(run)
        per[recipe]["last"].append(statistics.fmean(v["la_share_last"] for v in layers.values()))
        per[recipe]["other"].append(statistics.fmean(v["la_share_other"]
                                                     for v in layers.values()))
    lines = ["| recipe (seeds) | LA share at the question (last position) | LA share at the "
             "other positions beyond the window |", "|---|---|---|"]
    lines += [f"| {r} ({len(v['last'])}) | {_spread(v['last'])} | {_spread(v['other'])} |"
              for r, v in per.items()]
    return "\n".join(lines)


def query_shares(model, tokenizer, prompts: list[str]) -> dict[int, dict[str, float]]:
    """Per converted layer: LA's share of the output at each prompt's last position (where a
    multiple-choice prompt asks for the fact) against its mean share over the prompt's other
    positions beyond the window, averaged over prompts (the same share as ``branch_usage``)."""
    from hedgecats.evaluation.branch_usage import branch_norms
    from hedgecats.models import attention_mode

    acc: dict[int, dict[str, list[float]]] = {}

    def observer(module, query, key, value, key_padding_mask, hidden_states):
        rt = module.hedgecats
        n = [x[0].sum(0) for x in branch_norms(module, query, key, value, key_padding_mask,
                                                hidden_states)]  # (T,) summed over heads
        share = n[1] / (n[0] + n[1]).clamp_min(1e-30)
        if share.shape[0] > rt.window + 1:
            a = acc.setdefault(rt.layer_idx, {"last": [], "other": []})
            a["last"].append(float(share[-1]))
            a["other"].append(float(share[rt.window:-1].mean()))

    with attention_mode(model, "hybrid", observer=observer), torch.no_grad():
        for text in prompts:
            model(input_ids=tokenizer(text, return_tensors="pt")["input_ids"])
    return {i: {"la_share_last": statistics.fmean(a["last"]),
                "la_share_other": statistics.fmean(a["other"]), "prompts": len(a["last"])}
            for i, a in sorted(acc.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prompts", default=None, metavar="JSONL",
                    help="also: LA's share at each prompt's last position (the question) against "
                         "its other positions beyond the window; a jsonl with a 'context' field "
                         "per line (the testbed's recall_mc_far.jsonl)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from hedgecats.evaluation.branch_usage import branch_usage
    from hedgecats.evaluation.loading import load_for_eval

    text = Path(a.text).read_text()
    prompts = ([json.loads(line)["context"] for line in Path(a.prompts).read_text().splitlines()
                if line.strip()] if a.prompts else [])
    measured, at_query = {}, {}
    for run in a.runs:
        loaded = load_for_eval(str(Path(run) / "finetune" / "stage.pt"))
        measured[run] = branch_usage(loaded.model, loaded.tokenizer, text=text,
                                     max_tokens=a.tokens, text_source=a.text)
        if prompts:
            at_query[run] = query_shares(loaded.model, loaded.tokenizer, prompts)
    md = table(measured)
    if at_query:
        md += "\n\n" + query_table(at_query)
    print(md)
    if a.out:
        Path(a.out).write_text(json.dumps({
            "command": "python -m experiments.testbed_branch_usage " + " ".join(argv or sys.argv[1:]),
            "table": md, "runs": measured, "at_query": at_query}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
