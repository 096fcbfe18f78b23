"""Is a hybrid's far recall lost in its mixer? Recall of converted stages as trained and with
another mixer swapped into every converted layer, nothing retrained (issue 49's intervention).

    python -m experiments.mixer_swap STAGE [STAGE ...] [--mixers as_trained,fixed,la_mass] \\
        [--docs 128] [--base-model DIR] [--out mixer_swap.json]

STAGE: a ``stage.pt`` (stage 1's ``transfer/stage.pt`` or stage 2's ``finetune/stage.pt``) with
its run's ``config.yaml`` beside it: the held-out documents are the test split of that stage's
``RecallDataModule`` (the same at every share ``q``), the first ``--docs`` of them.
``--base-model``: the teacher's directory, where the recorded one has moved (runs brought back
from the GPU machine). Mixers: ``as_trained`` (the stage's own), ``fixed`` (``g = 0.5``, the
paper's), ``la_mass``. Each is read in ``hybrid``, ``swa_only`` and ``la_only`` mode (LM loss,
near and far recall). Prints a table per stage and the mean ± std over the stages (each is one
seed); ``--out`` keeps them all. CPU: about a minute per stage and mixer at 128 documents of
1,024 tokens (4-layer testbed teacher, 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

MIXERS = ("as_trained", "fixed", "la_mass")
MODES = ("hybrid", "swa_only", "la_only")
FIELDS = ("lm_loss", "near_acc", "far_acc")


@contextlib.contextmanager
def swapped_mixer(model, name: str):
    """Inside, every converted layer mixes with ``name`` (``as_trained``: unchanged)."""
    from hedgecats.models import hybrid_layers
    from hedgecats.models.mixers import FixedMixer, LAMassMixer

    if name == "as_trained":
        yield
        return
    make = {"fixed": lambda: FixedMixer(0.5), "la_mass": LAMassMixer}[name]
    layers = [attn for _, attn in hybrid_layers(model)]
    saved = [attn.mixer for attn in layers]
    try:
        for attn in layers:
            attn.mixer = make()
        yield
    finally:
        for attn, mixer in zip(layers, saved):
            attn.mixer = mixer


def test_corpus(stage: Path, n_docs: int):
    """The first ``n_docs`` test documents of the data in the stage's ``config.yaml``."""
    import dataclasses

    import yaml

    from hedgecats.lightning_modules import RecallDataModule

    config = stage.parent / "config.yaml"
    if not config.is_file():
        raise SystemExit(f"{config}: no such file (the stage's run config names its data)")
    data = yaml.safe_load(config.read_text())["data"]
    if not data["class_path"].endswith("RecallDataModule"):
        raise SystemExit(f"{config}: data is {data['class_path']}, not a RecallDataModule")
    corpus = RecallDataModule(**data["init_args"]).test_corpus()
    keep = corpus.answers[:, 0] < n_docs
    return dataclasses.replace(corpus, input_ids=corpus.input_ids[:n_docs],
                               answers=corpus.answers[keep])


def swap_table(stage: Path, mixers, n_docs: int, base_model: str | None,
               batch_size: int = 8) -> dict:
    """``{mixer: {mode: {lm_loss, near_acc, far_acc}}}`` for one stage."""
    from hedgecats.evaluation.recall import evaluate_recall
    from hedgecats.models.stage_files import load_hybrid

    corpus = test_corpus(stage, n_docs)
    model, _, _ = load_hybrid(stage, base_model=base_model, dtype="float32")
    out = {}
    for mixer in mixers:
        with swapped_mixer(model, mixer):
            rows = evaluate_recall(model, corpus, modes=MODES, batch_size=batch_size)
        out[mixer] = {m: {f: rows[m][f] for f in FIELDS} for m in MODES}
        print(f"  {stage}: {mixer}: " + ", ".join(
            f"{m} {rows[m]['lm_loss']:.3f} / {rows[m]['near_acc']:.3f} / {rows[m]['far_acc']:.3f}"
            for m in MODES), flush=True)
    return out


def summary_markdown(tables: dict[str, dict]) -> str:
    """Mean ± std over the stages (one per seed) of each mixer x mode x field."""
    mixers = list(next(iter(tables.values())))
    n = len(tables)
    lines = [f"mean ± std over {n} stage(s); LM loss / near recall / far recall", "",
             "| mixer | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]

    def cell(mixer, mode):
        parts = []
        for f in FIELDS:
            vals = [t[mixer][mode][f] for t in tables.values()]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            parts.append(f"{statistics.fmean(vals):.3f} ± {sd:.3f}")
        return " / ".join(parts)

    for mixer in mixers:
        lines.append(f"| {mixer} | " + " | ".join(cell(mixer, m) for m in MODES) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stages", nargs="+", type=Path)
    ap.add_argument("--mixers", default=",".join(MIXERS))
    ap.add_argument("--docs", type=int, default=128)
    ap.add_argument("--base-model", default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    mixers = [m for m in a.mixers.split(",") if m]
    unknown = sorted(set(mixers) - set(MIXERS))
    if unknown:
        ap.error(f"unknown mixers {unknown}; valid: {', '.join(MIXERS)}")
    if a.docs < 1:
        ap.error(f"--docs {a.docs}: at least 1")
    import torch

    with torch.no_grad():  # (scoped: a caller's grad mode is its own)
        tables = {str(s): swap_table(s, mixers, a.docs, a.base_model) for s in a.stages}
    md = summary_markdown(tables)
    print(md)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"command": "python -m experiments.mixer_swap " + " ".join(
            sys.argv[1:] if argv is None else argv), "docs": a.docs, "stages": tables,
            "summary": md}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
