"""The paper's training budget in wall time and GPU-hours per recipe (issue 12, item 4), from the
measured stage throughputs, on one H200 and extrapolated to eight.

    python -m experiments.paper_budget [--stage-speed STAGE_SPEED_JSON] [--multigpu MULTIGPU_JSON]
        [--lightning-gap LIGHTNING_GAP_JSON ...] [--lightning-run MULTIGPU_RUN_WS1_JSON]
        [--out experiments/results/paper_budget]

(defaults: the measurements in benchmarks/results, ``DEFAULTS``)

The paper's budget (docs/method.md; the paper's sections 5-6): stage 1 one epoch, stage 2 1-5 epochs
of ~25M tokens (FineWeb-Edu, 1,024-token sequences); per recipe:

    lolcats            stage 1 hybrid-output MSE (rectangular map), stage 2 hybrid LoRA 1-5 epochs
    inference_hybrid   stage 1 weights cross-entropy, stage 2 optional LA-only LoRA (0-1 epoch)
    hedgecats          stage 1 weights cross-entropy, stage 2 hybrid LoRA 1 epoch
    ssd_dropout        stage 1 weights cross-entropy, stage 2 with SSD, 5 epochs (the paper's row;
                       the schedule has four phases)
    ssd_window         the same, 5 epochs (five windows)
    ssd_fixed          the same, 1-5 epochs

Throughputs (tokens/s per GPU, Llama-3-8B shape, T = 1,024) come from ``stage_speed.json``, the
rows with the fused feature map (the default since 2026-12-02) where present. Stated
assumptions, each printed with the table: the square-map stage-1 row stands in for LoLCATs'
rectangular map (F = D, fewer FLOPs: an upper bound on its time); the hybrid LoRA row stands for
SSD's steps (the same layer, some samples' window zeroed) and for the LA-only LoRA; eight GPUs
run at the two-GPU scaling efficiency of ``multigpu.json`` (measured through Lightning / FSDP2;
that it holds at eight is an assumption), and evaluation is not counted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EPOCH_TOKENS = 25_000_000
#: the measurements of record
DEFAULTS = {
    "stage_speed": "benchmarks/results/stage_speed.json",
    "multigpu": "benchmarks/results/multigpu.json",
    # stage 1 through Lightning, one JSON per objective (each names its own; one without the
    # key measured weights_xent)
    "lightning_gap": ["benchmarks/results/lightning_gap_weights_xent.json",
                      "benchmarks/results/lightning_gap.json"],
    # both stages through Lightning at one GPU (multigpu run --devices 1; stage 1 with
    # weights_xent), newer than the two above: it wins for what it measured
    "lightning_run": "benchmarks/results/multigpu_1gpu.json",
}

#: recipe -> (stage-1 objective row, stage-2 epochs (min, max), stage-2 row)
RECIPES = {
    "lolcats": ("hybrid_output_mse", (1, 5), "hybrid"),
    "inference_hybrid": ("weights_xent", (0, 1), "hybrid"),
    "hedgecats": ("weights_xent", (1, 1), "hybrid"),
    "ssd_dropout": ("weights_xent", (5, 5), "hybrid"),
    "ssd_window": ("weights_xent", (5, 5), "hybrid"),
    "ssd_fixed": ("weights_xent", (1, 5), "hybrid"),
}


def _path(p: str) -> Path:
    """A results path as given, else relative to the project root (the defaults are)."""
    return Path(p) if Path(p).exists() or Path(p).is_absolute() else ROOT / p


def _pick(rows: list[dict], T: int, *names: str) -> tuple[str, float]:
    """The first of ``names`` measured at length T: (row name, tokens/s)."""
    by_name = {r["name"]: r for r in rows if r.get("T") == T and r.get("tokens_per_s")}
    for name in names:
        if name in by_name:
            return name, float(by_name[name]["tokens_per_s"])
    raise SystemExit(f"stage_speed.json has none of {names} at T={T}")


def throughputs(stage_speed: dict) -> dict[str, tuple[str, float]]:
    rows = stage_speed["rows"]
    return {
        "weights_xent": _pick(rows, 1024, "transfer/weights_xent [fused, fused phi]",
                              "transfer/weights_xent", "transfer/weights_xent [fused]"),
        "hybrid_output_mse": _pick(rows, 1024, "transfer/hybrid_output_mse [fused phi]",
                                   "transfer/hybrid_output_mse"),
        "hybrid": _pick(rows, 1024, "finetune/hybrid [fused phi]", "finetune/hybrid"),
    }


def scaling(multigpu: dict | None) -> dict[str, float | None]:
    """Two-GPU scaling efficiency per stage, or None when not measured."""
    two = (multigpu or {}).get("world_sizes", {}).get("2", {})
    return {"transfer": two.get("attention_transfer", {}).get("scaling_efficiency"),
            "finetune": two.get("hybrid_finetune", {}).get("scaling_efficiency")}


def lightning_one_gpu(multigpu: dict | None, gaps: list[dict] = (),
                      run: dict | None = None) -> dict:
    """One-GPU tokens/s of the stages through Lightning (the path ``hedgecats pipeline``
    runs), each with where it comes from. Stage 1 per objective (``transfer``: objective ->
    tokens/s): ``lightning_gap.py``'s ``L0`` row of each JSON (``multigpu.py``'s Transfer as it
    runs; a JSON without ``objective`` measured ``weights_xent``; a later JSON of the same
    objective wins), else ``weights_xent`` from ``multigpu.json``; ``run`` (a ``multigpu.py
    run --devices 1`` JSON, the newest) overrides stage 1's ``weights_xent`` and stage 2, which
    otherwise come from ``multigpu.json`` (None where not measured)."""
    one = (multigpu or {}).get("world_sizes", {}).get("1", {})
    out = {"transfer": {}, "transfer_source": {},
           "finetune": one.get("hybrid_finetune", {}).get("tokens_per_s"),
           "finetune_source": "multigpu.json"}
    if one.get("attention_transfer", {}).get("tokens_per_s"):
        out["transfer"]["weights_xent"] = one["attention_transfer"]["tokens_per_s"]
        out["transfer_source"]["weights_xent"] = "multigpu.json"
    for i, gap in enumerate(gaps):
        l0 = ((gap or {}).get("rows") or {}).get("L0") or {}
        if l0.get("tokens_per_s"):
            objective = gap.get("objective", "weights_xent")
            out["transfer"][objective] = l0["tokens_per_s"]
            out["transfer_source"][objective] = f"lightning_gap #{i + 1}, row L0"
    stages = (run or {}).get("stages") or {}
    if (stages.get("attention_transfer") or {}).get("tokens_per_s"):
        out["transfer"]["weights_xent"] = stages["attention_transfer"]["tokens_per_s"]
        out["transfer_source"]["weights_xent"] = "lightning_run"
    if (stages.get("hybrid_finetune") or {}).get("tokens_per_s"):
        out["finetune"] = stages["hybrid_finetune"]["tokens_per_s"]
        out["finetune_source"] = "lightning_run"
    return out


def budget(tp: dict, eff: dict, lightning: dict | None = None) -> list[dict]:
    rows = []
    for recipe, (objective, (lo, hi), ft) in RECIPES.items():
        s1 = EPOCH_TOKENS / tp[objective][1]
        s2 = EPOCH_TOKENS / tp[ft][1]
        row = {"recipe": recipe, "stage1_objective": objective, "stage2_epochs": [lo, hi],
               "stage1_h_1gpu": s1 / 3600, "stage2_h_1gpu": [lo * s2 / 3600, hi * s2 / 3600]}
        row["total_h_1gpu"] = [row["stage1_h_1gpu"] + x for x in row["stage2_h_1gpu"]]
        # through Lightning: this objective's stage 1 where measured, else weights_xent's
        l_tp = (lightning or {}).get("transfer") or {}
        l_s1 = l_tp.get(objective) or l_tp.get("weights_xent")
        if l_s1 and (lightning or {}).get("finetune"):
            l1 = EPOCH_TOKENS / l_s1
            l2 = EPOCH_TOKENS / lightning["finetune"]
            row["total_h_1gpu_lightning"] = [(l1 + n * l2) / 3600 for n in (lo, hi)]
            row["stage1_lightning_objective"] = objective if objective in l_tp else \
                "weights_xent"
        if eff["transfer"] and eff["finetune"]:
            s1_8 = s1 / (8 * eff["transfer"])
            s2_8 = s2 / (8 * eff["finetune"])
            row["total_h_8gpu"] = [(s1_8 + n * s2_8) / 3600 for n in (lo, hi)]
            row["gpu_hours_8gpu"] = [8 * h for h in row["total_h_8gpu"]]
        rows.append(row)
    return rows


def _span(pair, fmt="{:.2f}") -> str:
    a, b = pair
    return fmt.format(a) if abs(a - b) < 1e-9 else f"{fmt.format(a)}-{fmt.format(b)}"


def _num(x) -> str:
    return "not measured" if x is None else f"{x:,.0f}"


def markdown(rows: list[dict], tp: dict, eff: dict, sources: dict, lightning: dict) -> str:
    out = ["| recipe | stage 1 (1 epoch) h | stage-2 epochs | stage 2 h | total h, 1 H200 (= GPU-hours) "
           "| total h, 8 H200 (extrapolated) | GPU-hours, 8 H200 | total h, 1 H200, through "
           "Lightning |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        eight = (_span(r["total_h_8gpu"]), _span(r["gpu_hours_8gpu"], "{:.1f}")) \
            if "total_h_8gpu" in r else ("not measured", "-")
        light = _span(r["total_h_1gpu_lightning"]) if "total_h_1gpu_lightning" in r else "-"
        out.append(f"| {r['recipe']} | {r['stage1_h_1gpu']:.2f} | {_span(r['stage2_epochs'], '{}')} "
                   f"| {_span(r['stage2_h_1gpu'])} | {_span(r['total_h_1gpu'])} | {eight[0]} "
                   f"| {eight[1]} | {light} |")
    out += ["", f"Per epoch of {EPOCH_TOKENS / 1e6:.0f}M tokens, T = 1,024, Llama-3-8B shape, bf16. "
            "Throughputs (tokens/s, one H200): "
            + "; ".join(f"{k} {v[1]:,.0f} (`{v[0]}`)" for k, v in tp.items())
            + f" (`{sources['stage_speed']}`). Eight GPUs: the two-GPU scaling efficiency "
            f"(transfer {eff['transfer']}, fine-tune {eff['finetune']}; `{sources['multigpu']}`, "
            "measured on 2026-11-29 on the code of then, when stage 1 was bound by its blocked "
            "cross-entropy's launches; no two-GPU machine has been lent since) assumed to hold at "
            "eight. Assumptions: LoLCATs' rectangular map timed as the square "
            "one (an upper bound); SSD's and the LA-only LoRA's steps as the hybrid LoRA's; "
            "evaluation not counted. The throughputs are `stage_speed.py`'s, which runs each "
            "stage's computation outside Lightning; the last column uses the one-GPU tokens/s "
            "of the stages through Lightning with the FSDP2 strategy: stage 1 "
            + (", ".join(f"{_num(v)} ({k}; `{sources['transfer_lightning'][k]}`)"
                         for k, v in lightning["transfer"].items())
               + " (a recipe whose objective was not measured so uses weights_xent's)"
               if lightning["transfer"] else "not measured")
            + f", stage 2 {_num(lightning['finetune'])}"
            + (f" (`{sources['finetune_lightning']}`)." if lightning["finetune"] else ".")]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage-speed", default=DEFAULTS["stage_speed"])
    ap.add_argument("--multigpu", default=DEFAULTS["multigpu"])
    ap.add_argument("--lightning-gap", nargs="*", default=DEFAULTS["lightning_gap"],
                    help="lightning_gap.py's JSONs: stage 1 through Lightning (their L0 rows; "
                    "one per objective)")
    ap.add_argument("--lightning-run", default=None,
                    help="multigpu.py run --devices 1's JSON: both stages through Lightning "
                    "(stage 1 with weights_xent); default: the committed one, unless --multigpu "
                    "names another file (then only that file's one-GPU rows)")
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    a = ap.parse_args(argv)
    stage = json.loads(_path(a.stage_speed).read_text())
    if a.lightning_run is None:
        a.lightning_run = DEFAULTS["lightning_run"] if a.multigpu == DEFAULTS["multigpu"] else ""
    mg_path = _path(a.multigpu)
    run_path = _path(a.lightning_run) if a.lightning_run else None
    multigpu = json.loads(mg_path.read_text()) if mg_path.exists() else None
    gap_paths = [p for p in a.lightning_gap if _path(p).exists()]
    gaps = [json.loads(_path(p).read_text()) for p in gap_paths]
    run = json.loads(run_path.read_text()) if run_path and run_path.exists() else None
    tp, eff = throughputs(stage), scaling(multigpu)
    lightning = lightning_one_gpu(multigpu, gaps, run)
    rows = budget(tp, eff, lightning)

    def where(src: str) -> str:
        if src.startswith("lightning_gap #"):
            n, rest = src[len("lightning_gap #"):].split(",", 1)
            return f"{gap_paths[int(n) - 1]},{rest}"
        return {"multigpu.json": a.multigpu, "lightning_run": a.lightning_run}.get(src, src)

    sources = {"stage_speed": a.stage_speed, "multigpu": a.multigpu if multigpu else "none",
               "transfer_lightning": {k: where(v)
                                      for k, v in lightning["transfer_source"].items()},
               "finetune_lightning": where(lightning["finetune_source"])}
    command = " ".join(["python -m experiments.paper_budget", *(sys.argv[1:] if argv is None
                                                                else argv)])
    md = (f"# The paper's training budget per recipe\n\n`{command}` "
          f"({datetime.date.today().isoformat()}; the measurements named below)\n\n"
          + markdown(rows, tp, eff, sources, lightning))
    print(md)
    if a.out:
        Path(f"{a.out}.json").write_text(json.dumps(
            {"command": command,
             "epoch_tokens": EPOCH_TOKENS, "throughputs": tp, "scaling_2gpu": eff,
             "lightning_1gpu_tokens_per_s": lightning,
             "sources": sources, "rows": rows}, indent=1))
        Path(f"{a.out}.md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
