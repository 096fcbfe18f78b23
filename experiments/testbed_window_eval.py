"""Near / far recall of finished testbed runs at their own final window and at another one.

    python -m experiments.testbed_window_eval --root /tmp/testbed --runs ssd_fixed-s0,hedgecats-s0 \\
        --window 64 --docs 64 --out ssd_recall_window64.json

An SSD run ends at its last phase's window (16 for ``ssd_fixed``, 32 for ``ssd_dropout``) and
is evaluated there, as the paper does; its ``swa_only`` near recall then measures the shorter
window as much as the training. This evaluates ``swa_only`` and ``hybrid`` of each run's
``finetune/stage.pt`` at both windows on the first ``--docs`` held-out documents of the
run's own recall data (its stage's saved ``RecallDataModule`` settings; the same documents for
every run and window, so the rows are paired). CPU is fine (~25 s per run and window at 64 documents).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

def evaluate_run(stage_dir: Path, window: int, n_docs: int, modes=("swa_only", "hybrid")) -> dict:
    """``stage_dir``: a finished stage (``stage.pt``, and the ``config.yaml`` whose data is the
    run's own recall data, read from it rather than restated here)."""
    import yaml
    from hedgecats.data.recall_bytes import RecallDataModule
    from hedgecats.evaluation.recall import evaluate_recall
    from hedgecats.models.stage_files import load_hybrid

    model, _, info = load_hybrid(stage_dir / "stage.pt")
    final = info["hybrid_config"]["window"]
    data = yaml.safe_load((stage_dir / "config.yaml").read_text())["data"]["init_args"]
    dm = RecallDataModule(**{**data, "num_test": n_docs})
    dm.setup("test")
    corpus = dm.test_corpus()
    rows = {}
    for w in sorted({final, window}):
        for mode, r in evaluate_recall(model, corpus, modes=modes, batch_size=16,
                                       window=w).items():
            rows[f"{mode}@w{w}"] = {k: r[k] for k in ("near_acc", "far_acc", "n_near", "n_far")}
    return {"final_window": final, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True)
    p.add_argument("--runs", required=True, help="comma-separated run names, e.g. ssd_fixed-s0")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    out = {"command": "python -m experiments.testbed_window_eval " + " ".join(
               argv if argv is not None else __import__("sys").argv[1:]),
           "docs": a.docs, "runs": {}}
    for run in a.runs.split(","):
        t = time.time()
        out["runs"][run] = evaluate_run(Path(a.root) / run / "finetune", a.window, a.docs)
        print(run, f"{time.time() - t:.0f} s", json.dumps(out["runs"][run]["rows"]), flush=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
