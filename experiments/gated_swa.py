"""The pretraining study at testbed scale (docs/method.md#pretraining-study; issue 15, item 4).

    bash scripts/gated_swa.sh --variants full,swa_large,swa_large_gate      # one GPU call
    bash scripts/gated_swa.sh --variants swa_small,swa_small_gate           # another
    bash scripts/gated_swa.sh --variants swa_large_lowrank,swa_large_prope_lowrank
    python -m experiments.gated_swa --merge a/gated_swa.json b/gated_swa.json c/gated_swa.json
    python -m experiments.gated_swa --tiny               # CPU smoke test (seconds)

Seven teachers pretrained from scratch on the testbed teacher's recall corpus and budget (task
``marker``, 6,000 steps x 32 x 1,024 tokens at lr 3e-3: the budget in which the testbed teacher
learned far recall, 0.459, in 185 s alone on an H200; the key-value task of the first version
of this study learned no recall in that budget, docs/testbed.md), one process each, the
variants of one call at once (processes share the GPU by time slicing), the same token budget
each. Seven at once ran at 1.34M tokens/s together on an H200 (2026-12-02: 3,000 steps each in
513 s, evaluations included), so 6,000 steps of all seven need two or three 10-minute calls:
run them with ``--variants`` and merge the reports (``--deadline`` stops
unfinished runs and reports them as stopped early):

    full                      every layer full attention, no gate (today's teacher)
    swa_small / swa_large     the pattern's S layers see --small-window / --large-window keys
    swa_small_gate / swa_large_gate   ... plus an elementwise output gate
    swa_large_lowrank         ... a low-rank gate (rank --gate-rank)
    swa_large_prope_lowrank   ... a low-rank gate and RoPE on --rope-fraction of each head

The architecture is the testbed teacher's (configs/testbed/teacher.yaml: 4 layers, hidden 384,
6 heads of 64, 2 KV heads, MLP 1024, T = 1024, byte vocabulary); the data its corpus (a secret
letter recalled 3-63 tokens after its previous occurrence, near, or 150-400, far). With the default windows 64 and
256 the far recalls split into those a large window still sees (150-255) and those beyond
every window (256-400); only the full layer reaches them.

Each run carries ``DownstreamEval`` (every 10% of training): held-out LM loss and recall
accuracy per distance bucket (``RecallProbe``), and two multiple-choice probes scored by
log-likelihood (``RecallChoiceProbe``): near recalls with a short context (the window sees the
whole question) and far recalls with the whole prefix. The report has, per variant: loss at
50% and 100% of training, the downstream scores, far recall, parameters, throughput; and the
differences the seed asks about, with the paired standard error of the held-out loss over
documents (one training seed is not a noise estimate: see ``--seeds``). Each saved model is
reloaded and its logits compared with the trained one's.

Outputs (``--out``, default ``$OUT``): ``gated_swa.json`` (everything, curves included),
``gated_swa.md`` (the tables), ``gated_swa.log`` (the end of every run's log).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

#: name -> (layers that use the window: "small" | "large" | None, gate, RoPE on a fraction?)
VARIANTS: dict[str, tuple[str | None, str, bool]] = {
    "full": (None, "none", False),
    "swa_small": ("small", "none", False),
    "swa_small_gate": ("small", "elementwise", False),
    "swa_large": ("large", "none", False),
    "swa_large_gate": ("large", "elementwise", False),
    "swa_large_lowrank": ("large", "lowrank", False),
    "swa_large_prope_lowrank": ("large", "lowrank", True),
}

#: the testbed teacher (configs/testbed/teacher.yaml) and its corpus; --tiny shrinks both
SCALES = {
    "testbed": {"hidden_size": 384, "num_layers": 4, "num_heads": 6, "num_kv_heads": 2,
                "intermediate_size": 1024, "seq_len": 1024, "near_window": 64, "far_min": 150,
                "far_max": 400, "facts_per_doc": 8, "num_train": 16384, "batch_size": 32,
                "steps": 6000, "lr": 3e-3, "warmup_steps": 200, "small_window": 64,
                "large_window": 256, "pattern": "SSSF", "gate_rank": 16, "probe_docs": 64,
                "max_seconds": 540, "threads": 2, "task": "marker"},
    "tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
             "intermediate_size": 64, "seq_len": 96, "near_window": 16, "far_min": 40,
             "far_max": 80, "facts_per_doc": 4, "num_train": 64, "batch_size": 4, "steps": 6,
             "lr": 3e-3, "warmup_steps": 2, "small_window": 8, "large_window": 60,
             "pattern": "SF", "gate_rank": 4, "probe_docs": 16, "max_seconds": 120,
             "threads": 1, "task": "marker"},
}


def _buckets(a) -> list[list[int]]:
    """Near, far inside the large window, far beyond it (or the far range whole)."""
    near = [3, a.near_window - 1]
    if a.far_min < a.large_window <= a.far_max:
        return [near, [a.far_min, a.large_window - 1], [a.large_window, a.far_max]]
    return [near, [a.far_min, a.far_max]]


def _probes(a):
    from hedgecats.lightning_modules import RecallChoiceProbe, RecallProbe

    corpus = {"seq_len": a.seq_len, "near_max": a.near_window - 1, "far_min": a.far_min,
              "far_max": a.far_max, "facts_per_doc": a.facts_per_doc, "task": a.task}
    return [RecallProbe("recall", num_docs=a.probe_docs, buckets=_buckets(a), batch_size=16,
                        **corpus),
            RecallChoiceProbe("mc_near", num_docs=a.probe_docs, distances=[3, a.near_window - 1],
                              context=a.near_window + 1, max_items=4 * a.probe_docs, **corpus),
            RecallChoiceProbe("mc_far", num_docs=a.probe_docs, distances=[a.far_min, a.far_max],
                              max_items=4 * a.probe_docs, **corpus)]


def _arch(name: str, a) -> dict:
    window, gate, prope = VARIANTS[name]
    arch = {"output_gate": gate, "gate_rank": a.gate_rank,
            "rope_fraction": a.rope_fraction if prope else 1.0}
    if window is not None:
        arch |= {"attention_pattern": a.pattern,
                 "sliding_window": a.small_window if window == "small" else a.large_window}
    return arch


class _Recorder:
    """Training loss per step and the wall time of the training loop (a Lightning callback,
    built lazily so that the module imports without Lightning)."""

    @staticmethod
    def make():
        import lightning.pytorch as pl
        import torch

        class Recorder(pl.Callback):
            def __init__(self):
                self.losses: list[float] = []
                self.t0 = self.t1 = 0.0

            def _sync(self, trainer):
                if trainer.strategy.root_device.type == "cuda":
                    torch.cuda.synchronize()

            def on_train_start(self, trainer, pl_module):
                self._sync(trainer)
                self.t0 = time.perf_counter()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.losses.append(float(outputs["loss"]))

            def on_train_end(self, trainer, pl_module):
                self._sync(trainer)
                self.t1 = time.perf_counter()

        return Recorder()


def run_variant(name: str, seed: int, a, root: Path) -> dict:
    """Train one variant, evaluate it, reload its saved model; the result as a dict."""
    import lightning.pytorch as pl
    import torch
    from hedgecats.lightning_modules import DownstreamEval, RecallDataModule, TeacherPretraining
    from hedgecats.lightning_modules.downstream_eval import recall_scores
    from hedgecats.models import load_pretrained
    from lightning.pytorch.loggers import CSVLogger

    torch.set_num_threads(a.threads)
    cuda = not a.tiny
    run_dir = root / f"{name}-s{seed}"
    pl.seed_everything(seed, verbose=False)
    arch = _arch(name, a)
    module = TeacherPretraining(
        hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads, intermediate_size=a.intermediate_size,
        max_position_embeddings=a.seq_len, lr=a.lr, warmup_steps=a.warmup_steps,
        init_seed=seed, **arch)
    dm = RecallDataModule(seq_len=a.seq_len, window=a.near_window, far_min=a.far_min,
                          far_max=a.far_max, task=a.task, facts_per_doc=a.facts_per_doc,
                          num_train=a.num_train, num_val=4, num_test=4,
                          batch_size=a.batch_size, seed=0)  # the same documents for every run
    probes = _probes(a)
    evals = DownstreamEval(probes, every_fraction=a.eval_every)
    rec = _Recorder.make()
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1,
        precision="bf16-mixed" if cuda else "32-true", max_steps=a.steps,
        max_time=timedelta(seconds=a.max_seconds), default_root_dir=str(run_dir),
        logger=CSVLogger(str(run_dir), name="logs", version=""), callbacks=[rec, evals],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=50)
    trainer.fit(module, datamodule=dm)

    steps = trainer.global_step
    device = module.device
    model = module.model.eval()
    final = evals.history[-1] if evals.history and evals.history[-1]["step"] == steps else None
    if final is None:  # stopped by max_time between two evaluations
        with trainer.precision_plugin.forward_context():
            final = {"step": steps, **evals.evaluate(model, device)}
    with torch.no_grad(), trainer.precision_plugin.forward_context():
        doc_loss, _, _ = recall_scores(model, probes[0].corpus, batch_size=16, device=device)
        # the saved model, reloaded, against the trained one (fp32, no autocast)
    loaded = load_pretrained(run_dir / "model").to(device).eval()
    ids = probes[0].corpus.input_ids[:4].to(device)
    with torch.no_grad():
        reload_diff = (loaded(input_ids=ids).logits - model(input_ids=ids).logits).abs().max()
    eval_s = sum(h.get("downstream/seconds", 0.0) for h in evals.history)
    train_s = max(rec.t1 - rec.t0 - eval_s, 1e-9)
    tokens = steps * a.batch_size * a.seq_len
    return {
        "variant": name, "seed": seed, "arch": arch,
        "architecture": json.loads((run_dir / "model" / "architecture.json").read_text()),
        "steps": steps, "max_steps": a.steps, "stopped_early": steps < a.steps,
        "tokens": tokens, "train_seconds": round(train_s, 2), "eval_seconds": round(eval_s, 2),
        "tokens_per_s": round(tokens / train_s, 1),
        "reload_max_abs_diff": float(reload_diff),
        "train_loss": [round(x, 5) for x in rec.losses[:: max(1, len(rec.losses) // 200)]],
        "train_loss_stride": max(1, len(rec.losses) // 200),
        "train_loss_windows": {f"{p:g}": _window_mean(rec.losses, p, a.steps) for p in (0.5, 1.0)},
        "history": evals.history, "final": final, "doc_loss": doc_loss.tolist(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }


def _window_mean(losses: list[float], point: float, total: int) -> float | None:
    """Mean training loss over the 5% of steps before ``point * total`` (None if not reached)."""
    end = round(point * total)
    if end > len(losses) or end < 1:
        return None
    width = max(1, round(0.05 * total))
    return statistics.fmean(losses[max(0, end - width):end])


# ----------------------------------------------------------------------------- the report
def _at(result: dict, point: float, key: str) -> float | None:
    """``key`` from the evaluation at ``point`` of the planned steps (None if not reached)."""
    want = round(point * result["max_steps"])
    for h in result["history"]:
        if h["step"] == want:
            return h.get(key)
    return None


def _mean(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def _fmt(vals, digits=3) -> str:
    m, s = _mean(vals)
    if m is None:
        return "n/a"
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if s is not None else "")


#: recall accuracy at which a bucket counts as learned (chance is ~0.04: 26 letters)
LEARNED = 0.5


def learned_at(result: dict, bucket: str) -> int | None:
    """The first evaluated step at which ``bucket``'s recall accuracy reached ``LEARNED`` (the
    recall is learned in a jump, an induction-head-like transition, so its step says more than
    the final loss), or None if it never did."""
    for h in result["history"]:
        acc = h.get(f"downstream/recall/{bucket}/acc")
        if acc is not None and acc >= LEARNED:
            return h["step"]
    return None


def summarize(results: list[dict], buckets: list[str]) -> dict:
    """Per-variant means over seeds, and the paired differences the seed asks about;
    ``buckets``: the recall probe's bucket names (``d<lo>-<hi>``)."""
    ok = [r for r in results if "error" not in r]
    rows = {}
    for name in VARIANTS:
        rs = [r for r in ok if r["variant"] == name]
        if not rs:
            continue
        rows[name] = {
            "seeds": [r["seed"] for r in rs],
            "loss_50": [_at(r, 0.5, "downstream/recall/lm_loss") for r in rs],
            "loss_100": [r["final"].get("downstream/recall/lm_loss") for r in rs],
            "recall": {b: [r["final"].get(f"downstream/recall/{b}/acc") for r in rs]
                       for b in buckets},
            "mc_near": [r["final"].get("downstream/mc_near/acc") for r in rs],
            "mc_far": [r["final"].get("downstream/mc_far/acc") for r in rs],
            "params": rs[0]["architecture"]["parameters"],
            "pattern": rs[0]["architecture"]["pattern"],
            "windows": rs[0]["architecture"]["config"]["layer_windows"],
            "rotary_dim": rs[0]["architecture"]["rotary_dim"],
            "gate": rs[0]["arch"]["output_gate"],
            "tokens_per_s": [r["tokens_per_s"] for r in rs],
            "stopped_early": any(r["stopped_early"] for r in rs),
            "steps": [r["steps"] for r in rs],
            "learned_at": {b: [learned_at(r, b) for r in rs] for b in (buckets[0], buckets[-1])},
        }
    pairs = [("swa_small", "swa_large", "smaller window (no gate)"),
             ("swa_small_gate", "swa_large_gate", "smaller window (elementwise gate)"),
             ("swa_large_gate", "full", "SWA large + gate vs full, no gate"),
             ("swa_small_gate", "swa_small", "gate at the small window"),
             ("swa_large_gate", "swa_large", "gate at the large window"),
             ("swa_large_lowrank", "swa_large_gate", "low-rank vs elementwise gate"),
             ("swa_large_prope_lowrank", "swa_large_lowrank", "partial RoPE (low-rank gate)")]
    deltas = []
    for x, y, what in pairs:
        rx = {r["seed"]: r for r in ok if r["variant"] == x}
        ry = {r["seed"]: r for r in ok if r["variant"] == y}
        seeds = sorted(set(rx) & set(ry))
        if not seeds:
            continue
        d_loss, d_se, d_far, d_mc = [], [], [], []
        for s in seeds:
            dx, dy = rx[s]["doc_loss"], ry[s]["doc_loss"]
            diff = [u - v for u, v in zip(dx, dy)]
            d_loss.append(statistics.fmean(diff))
            d_se.append(statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else None)
            far = buckets[-1]
            d_far.append(rx[s]["final"][f"downstream/recall/{far}/acc"]
                         - ry[s]["final"][f"downstream/recall/{far}/acc"])
            d_mc.append(rx[s]["final"]["downstream/mc_near/acc"]
                        - ry[s]["final"]["downstream/mc_near/acc"])
        deltas.append({"a": x, "b": y, "what": what, "seeds": seeds, "d_loss": d_loss,
                       "d_loss_paired_se": d_se, "d_far_recall": d_far, "d_mc_near": d_mc,
                       "far_bucket": buckets[-1], "near_bucket": buckets[0]})
    return {"rows": rows, "deltas": deltas, "buckets": buckets}


def _seeds(vals, digits=3, signed=False) -> str:
    """The mean, then every seed's value in brackets when there are several."""
    vals = [v for v in vals if v is not None]
    if not vals:
        return "n/a"
    f = (lambda v: f"{v:+.{digits}f}") if signed else (lambda v: f"{v:.{digits}f}")
    if len(vals) == 1:
        return f(vals[0])
    return f"{f(statistics.fmean(vals))} ({', '.join(f(v) for v in vals)})"


def _step(v: int | None) -> str:
    return "never" if v is None else str(v)


def markdown(summary: dict, results: list[dict], meta: dict) -> str:
    b = summary["buckets"]
    lines = ["# Gated SWA pretraining at testbed scale", "",
             f"Command: `{meta['command']}`  ", (f"Device: {meta['device']}; torch "
             f"{meta['torch']}, transformers {meta['transformers']}; wall {meta['wall_s']} s.  "),
             (f"Per variant: {meta['steps']} steps x {meta['batch_size']} x {meta['seq_len']} "
             f"tokens = {meta['tokens_per_run'] / 1e6:.1f}M tokens; pattern `{meta['pattern']}` "
             f"(S layers at the variant's window); seeds {meta['seeds']}."), "",
             ("Loss: held-out next-token loss (nats/byte, 'recall' probe documents) at 50% and "
             "100% of the planned steps. Recall: argmax accuracy of the recalled value by "
             "distance bucket. MC: 4-way multiple choice by log-likelihood (chance 0.25): "
             f"near recalls with a {meta['near_window'] + 1}-token context, far recalls with "
             "the whole prefix. With several seeds: the mean, then each seed's value in "
             f"brackets (column 'seeds' says how many). 'Learned': runs whose {b[0]} / {b[-1]} "
             f"recall reached {LEARNED} at some evaluation (the step of each run in the per-run "
             "table). Tokens/s: each run's training throughput while all runs of its call share "
             "the GPU. Training-loss means at both points are in the JSON "
             "(train_loss_windows)."), "",
             "| variant | windows | gate | RoPE dims | params (gates) | seeds | loss 50% | "
             "loss 100% | " + " | ".join(f"recall {x}" for x in b)
             + " | MC near | MC far | learned near / far | tokens/s per run |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: | "
             + " | ".join("---:" for _ in b) + " | ---: | ---: | ---: | ---: |"]
    for name, r in summary["rows"].items():
        windows = ",".join("F" if w is None else str(w) for w in r["windows"])
        flag = " (stopped by time)" if r["stopped_early"] else ""
        n = len(r["seeds"])
        learned = " / ".join(f"{sum(x is not None for x in r['learned_at'][k])} of {n}"
                             for k in (b[0], b[-1]))
        lines.append(
            f"| {name}{flag} | {windows} | {r['gate']} | {r['rotary_dim']} | "
            f"{r['params']['total'] / 1e6:.2f}M ({r['params']['gates'] / 1e3:.0f}k) | {n} | "
            f"{_seeds(r['loss_50'])} | {_seeds(r['loss_100'])} | "
            + " | ".join(_seeds(r["recall"][x], 2) for x in b)
            + f" | {_seeds(r['mc_near'], 2)} | {_seeds(r['mc_far'], 2)} | {learned} | "
            f"{_seeds(r['tokens_per_s'], 0)} |")
    lines += ["", "## Differences (first minus second, same seeds)", "",
              ("Mean over the seeds both variants ran, each seed's value in brackets. Paired SE: "
              "the held-out loss difference's standard error over the probe documents, the "
              "mean over seeds (evaluation noise only; the spread between seeds is the training "
              "noise)."), "",
              f"| comparison | seeds | Δ loss | paired SE | Δ recall {b[-1]} | Δ MC near |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for d in summary["deltas"]:
        se = [s for s in d["d_loss_paired_se"] if s is not None]
        se_txt = f"{statistics.fmean(se):.4f}" if se else "n/a"
        lines.append(f"| {d['what']}: {d['a']} - {d['b']} | {len(d['seeds'])} | "
                     f"{_seeds(d['d_loss'], 4, signed=True)} | {se_txt} | "
                     f"{_seeds(d['d_far_recall'], 2, signed=True)} | "
                     f"{_seeds(d['d_mc_near'], 2, signed=True)} |")
    ok = [r for r in results if "error" not in r]
    if ok:
        lines += ["", "## Every run", "",
                  (f"| variant | seed | loss 50% | loss 100% | recall {b[0]} | recall {b[-1]} | "
                   f"MC near | MC far | {b[0]} learned at step | {b[-1]} learned at step |"),
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in sorted(ok, key=lambda r: (list(VARIANTS).index(r["variant"]), r["seed"])):
            fin = r["final"] or {}
            lines.append(
                f"| {r['variant']} | {r['seed']} | "
                f"{_fmt([_at(r, 0.5, 'downstream/recall/lm_loss')])} | "
                f"{_fmt([fin.get('downstream/recall/lm_loss')])} | "
                f"{_fmt([fin.get(f'downstream/recall/{b[0]}/acc')], 2)} | "
                f"{_fmt([fin.get(f'downstream/recall/{b[-1]}/acc')], 2)} | "
                f"{_fmt([fin.get('downstream/mc_near/acc')], 2)} | "
                f"{_fmt([fin.get('downstream/mc_far/acc')], 2)} | "
                f"{_step(learned_at(r, b[0]))} | {_step(learned_at(r, b[-1]))} |")
    failed = [r for r in results if "error" in r]
    if failed:
        lines += ["", "## Failed runs", ""]
        lines += [f"- {r['variant']} seed {r['seed']}: {r['error']}" for r in failed]
    reload = [r["reload_max_abs_diff"] for r in results if "error" not in r]
    if reload:
        lines += ["", (f"Saved models reloaded with `load_pretrained`: largest logit difference "
                      f"{max(reload):.3g}.")]
    return "\n".join(lines) + "\n"


def plot_curves(results: list[dict], buckets: list[str], path: Path) -> Path | None:
    """Near and far recall and the held-out loss against the step, one line per run (every
    seed drawn, so the figure shows the spread); None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r and r["history"]]
    names = [v for v in VARIANTS if any(r["variant"] == v for r in ok)]
    colors = {v: plt.get_cmap("tab10")(i) for i, v in enumerate(names)}
    seeds = sorted({r["seed"] for r in ok})
    styles = ["-", "--", ":", "-."]
    keys = [(f"downstream/recall/{buckets[0]}/acc", f"recall {buckets[0]}"),
            (f"downstream/recall/{buckets[-1]}/acc", f"recall {buckets[-1]}"),
            ("downstream/recall/lm_loss", "held-out loss (nats/byte)")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, label) in zip(axes, keys):
        for r in ok:
            xs = [h["step"] for h in r["history"] if h.get(key) is not None]
            ys = [h[key] for h in r["history"] if h.get(key) is not None]
            ax.plot(xs, ys, styles[seeds.index(r["seed"]) % len(styles)],
                    color=colors[r["variant"]], lw=1.4,
                    label=r["variant"] if r["seed"] == min(
                        x["seed"] for x in ok if x["variant"] == r["variant"]) else None)
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Gated SWA pretraining: one line per run ({len(seeds)} seed(s): "
                 + ", ".join(f"seed {s} '{styles[i % len(styles)]}'" for i, s in enumerate(seeds))
                 + ")", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- driver
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default="0", help="comma-separated init seeds (e.g. 0,1,2)")
    p.add_argument("--parallel", type=int, default=None,
                   help="runs at once, as separate processes (default: all on GPU, 1 in-process "
                        "with --tiny)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after which unfinished runs are stopped and the report written "
                        "anyway (default 540: the device tool allows 600 per command)")
    p.add_argument("--eval-every", type=float, default=0.1, help="DownstreamEval every_fraction")
    p.add_argument("--rope-fraction", type=float, default=0.5)
    for key, value in SCALES["testbed"].items():
        flag = "--" + key.replace("_", "-")
        p.add_argument(flag, type=type(value), default=None,
                       help=f"default {value} ({SCALES['tiny'][key]} with --tiny)")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else .)")
    p.add_argument("--work", default=None, help="run folders (default $TMPDIR/gated_swa)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="only report: merge the runs of earlier gated_swa.json files (e.g. one "
                        "per seed) into one report in --out")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-seed", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _resolve(argv: list[str]):
    a = _parser().parse_args(argv)
    scale = SCALES["tiny" if a.tiny else "testbed"]
    for key, value in scale.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    unknown = [v for v in a.variants.split(",") if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    if a.parallel is None:
        a.parallel = 1 if a.tiny else len(a.variants.split(",")) * len(a.seeds.split(","))
    if a.deadline is None:
        a.deadline = 540.0
    return a


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without ``flags`` and their values (``--flag v`` or ``--flag=v``)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in flags:
            skip = True
        elif not any(x.startswith(f + "=") for f in flags):
            out.append(x)
    return out


def _spawn(job: tuple[str, int], argv: list[str], work: Path, threads: int):
    name, seed = job
    log = (work / f"{name}-s{seed}.log").open("w")
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--work", str(work),
           "--worker", name, "--worker-seed", str(seed)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log


def _result_path(work: Path, name: str, seed: int) -> Path:
    return work / f"{name}-s{seed}.json"


def _run_processes(jobs, a, argv, work: Path, t0: float) -> list[dict]:
    """Every job as its own process, ``a.parallel`` at a time, stopped at ``a.deadline``."""
    passthrough = _without(argv, ("--work", "--out", "--parallel", "--deadline"))
    results, pending, running = [], list(jobs), []
    while pending or running:
        while pending and len(running) < a.parallel:
            job = pending.pop(0)
            proc, log = _spawn(job, passthrough, work, a.threads)
            running.append((job, proc, log))
            print(f"started {job[0]} seed {job[1]} (pid {proc.pid})", flush=True)
        time.sleep(0.5)
        late = time.perf_counter() - t0 > a.deadline
        for item in list(running):
            job, proc, log = item
            if proc.poll() is None and not late:
                continue
            if proc.poll() is None:  # past the deadline: stop it, report what is missing
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            running.remove(item)
            log.close()
            path = _result_path(work, *job)
            if proc.returncode == 0 and path.exists():
                results.append(json.loads(path.read_text()))
            else:
                tail = (work / f"{job[0]}-s{job[1]}.log").read_text().splitlines()[-5:]
                why = "stopped at the deadline" if late else f"exit {proc.returncode}"
                results.append({"variant": job[0], "seed": job[1],
                                "error": f"{why}: {' | '.join(tail)}"})
            print(f"finished {job[0]} seed {job[1]}: exit {proc.returncode} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if late:
            for job in pending:
                results.append({"variant": job[0], "seed": job[1],
                                "error": "not started before the deadline"})
            pending = []
    return results


def _write(out: Path, meta: dict, results: list[dict], logs: list[str]) -> None:
    names = [f"d{lo}-{hi}" for lo, hi in meta["buckets"]]
    results = sorted(results, key=lambda r: (r["seed"], list(VARIANTS).index(r["variant"])))
    summary = summarize(results, names)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gated_swa.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "runs": results}, indent=1) + "\n")
    (out / "gated_swa.md").write_text(markdown(summary, results, meta))
    png = plot_curves(results, names, out / "gated_swa_curves.png")
    if logs:
        (out / "gated_swa.log").write_text("\n".join(logs) + "\n")
    print((out / "gated_swa.md").read_text())
    print(f"wrote {out / 'gated_swa.json'}, gated_swa.md" + (", gated_swa.log" if logs else "")
          + (f", {png.name}" if png else ""))


def _merge(paths: list[str], out: Path) -> int:
    """One report from the runs of several gated_swa.json files of the same settings."""
    files = [json.loads(Path(p).read_text()) for p in paths]
    base = {k: v for k, v in files[0]["meta"]["settings"].items() if k != "parallel"}
    for p, f in zip(paths[1:], files[1:]):
        other = {k: v for k, v in f["meta"]["settings"].items() if k != "parallel"}
        if other != base:
            diff = sorted(k for k in base.keys() | other.keys() if base.get(k) != other.get(k))
            raise SystemExit(f"{p} was run with other settings than {paths[0]}: {diff}")
    runs = [r for f in files for r in f["runs"]]
    seen = [(r["variant"], r["seed"]) for r in runs]
    if len(set(seen)) != len(seen):
        twice = sorted({x for x in seen if seen.count(x) > 1})
        raise SystemExit(f"the files repeat runs (variant, seed): {twice}")
    meta = {**files[0]["meta"], "command": " ".join(["python", "-m", "experiments.gated_swa",
                                                      "--merge", *paths]),
            "seeds": ",".join(str(s) for s in sorted({r["seed"] for r in runs})),
            "wall_s": sum(f["meta"]["wall_s"] for f in files)}
    _write(out, meta, runs, [])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _resolve(argv)
    out = Path(a.out or os.environ.get("OUT", "."))
    if a.merge:
        return _merge(a.merge, out)
    if not a.tiny:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: use --tiny for the CPU smoke test", file=sys.stderr)
            return 2
    work = Path(a.work) if a.work else Path(os.environ.get("TMPDIR", "/tmp")) / "gated_swa"
    work.mkdir(parents=True, exist_ok=True)
    if a.worker is not None:  # one run, in this process
        res = run_variant(a.worker, a.worker_seed, a, work)
        _result_path(work, a.worker, a.worker_seed).write_text(json.dumps(res))
        return 0

    t0 = time.perf_counter()
    jobs = [(v, int(s)) for s in a.seeds.split(",") for v in a.variants.split(",")]
    if a.parallel == 1:
        results = []
        for name, seed in jobs:
            print(f"== {name} seed {seed}", flush=True)
            try:
                results.append(run_variant(name, seed, a, work))
            except Exception as e:  # noqa: BLE001 - reported in the outputs, the others go on
                results.append({"variant": name, "seed": seed, "error": repr(e)})
    else:
        results = _run_processes(jobs, a, argv, work, t0)

    import torch
    import transformers

    ok = [r for r in results if "error" not in r]
    meta = {"command": " ".join(["python", "-m", "experiments.gated_swa", *argv]),
            "device": ok[0]["device"] if ok else "n/a", "torch": torch.__version__,
            "transformers": transformers.__version__,
            "wall_s": round(time.perf_counter() - t0, 1), "steps": a.steps,
            "batch_size": a.batch_size, "seq_len": a.seq_len, "pattern": a.pattern,
            "tokens_per_run": a.steps * a.batch_size * a.seq_len, "seeds": a.seeds,
            "near_window": a.near_window, "buckets": _buckets(a),
            "settings": {k: getattr(a, k) for k in (*SCALES["testbed"], "rope_fraction",
                                                    "eval_every", "parallel")}}
    logs = []
    for name, seed in jobs:
        path = work / f"{name}-s{seed}.log"
        if path.exists():
            logs += [f"==== {name} seed {seed}", *path.read_text().splitlines()[-60:]]
    _write(out, meta, results, logs)
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
