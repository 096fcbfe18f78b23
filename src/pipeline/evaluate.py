"""The ``evaluate:`` section of a pipeline: what runs after its stages (``hedgecats pipeline``).

``kind: recall`` scores a stage's ``stage.pt`` (or a transformers ``model`` converted with a
``hybrid`` config) on the held-out documents of a recall DataModule in every requested mode and
variant (``hedgecats.evaluation.recall``), optionally with the unconverted teacher, prints the
table and returns the results.json section (``recall_summary``). ``kind: command`` runs
``hedgecats evaluate`` with the given ``argv`` (lm-eval tasks, retrieval, branch usage).
``evaluations(spec)`` reads the section (one mapping or a list); ``EVALUATORS`` maps a kind to
its function ``(spec, evaluation, console) -> dict``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EVALUATORS", "eval_device", "evaluations"]


def _instantiate(spec: dict):
    from .validate import resolve_class  # a dotted path or a short class name

    return resolve_class(spec["class_path"])(**spec.get("init_args", {}))


def eval_device(ev: dict) -> tuple[str, str]:
    """(device, precision) of a recall evaluation: ``device: auto`` (default) is the GPU when
    there is one, like the trainer's; ``precision`` defaults to ``bf16-mixed`` there (what the
    stages train in) and ``32`` on the CPU."""
    import torch

    device = ev.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"evaluate.device={device!r} but no CUDA device is available; use "
                         "'auto' or 'cpu'")
    precision = str(ev.get("precision", "bf16-mixed" if device.startswith("cuda") else "32"))
    if precision not in ("32", "bf16-mixed"):
        raise ValueError(f"evaluate.precision={precision!r} is not valid; choose '32' or "
                         "'bf16-mixed'")
    return device, precision


def _evaluate_recall(spec: dict, ev: dict, console) -> dict:
    import torch

    from ..evaluation.recall import EVAL_MODES, evaluate_recall, format_table, recall_summary
    from ..models import HybridConfig, convert_to_hybrid
    from ..models.stage_files import load_hybrid
    from ..models.config import parse_variant_mapping

    output = Path(spec["output"])
    device, precision = eval_device(ev)
    amp = torch.bfloat16 if precision == "bf16-mixed" else None
    if ("stage" in ev) == ("model" in ev):
        raise ValueError("a recall evaluation names either a 'stage' of this pipeline (its "
                         "stage.pt) or a transformers 'model' (with a 'hybrid' config to convert "
                         f"it with), not {'both' if 'stage' in ev else 'neither'}")
    if "stage" in ev:
        source = stage_pt = output / ev["stage"] / "stage.pt"
        model, _, info = load_hybrid(stage_pt)
        base_model, window = info["base_model"], info["hybrid_config"]["window"]
    else:  # a plain model, converted with fresh feature maps (softmax / SWA modes make sense)
        from transformers import AutoModelForCausalLM

        source = base_model = ev["model"]
        hybrid = HybridConfig.from_dict(ev.get("hybrid") or {})
        model = convert_to_hybrid(AutoModelForCausalLM.from_pretrained(base_model), hybrid)
        window = hybrid.window
    model.to(device)
    dm = _instantiate(ev["data"])
    dm.setup("test")
    corpus = dm.test_corpus()
    modes = tuple(ev.get("modes", EVAL_MODES))
    bs = int(ev.get("batch_size", 16))
    console.print(f"evaluating {len(modes)} modes on {len(corpus.input_ids)} held-out documents "
                  f"({len(corpus.answers)} recalls; model window {window}; near: distance <= "
                  f"{corpus.near_max}, far: >= {corpus.far_min}) on {device}, precision "
                  f"{precision}")
    results = evaluate_recall(model, corpus, modes=modes, batch_size=bs, autocast_dtype=amp)
    for name, variant in (ev.get("variants") or {}).items():
        variant_modes, switches = parse_variant_mapping(variant)
        for mode, r in evaluate_recall(model, corpus, modes=variant_modes, batch_size=bs,
                                       autocast_dtype=amp, **switches).items():
            results[f"{mode} ({name})"] = r
    rows = {}
    if ev.get("teacher"):  # the unconverted base model, for reference
        from transformers import AutoModelForCausalLM

        teacher = AutoModelForCausalLM.from_pretrained(base_model).to(device)
        convert_to_hybrid(teacher, HybridConfig(window=window, mode="softmax"))
        rows["teacher"] = evaluate_recall(teacher, corpus, modes=("softmax",), batch_size=bs,
                                          autocast_dtype=amp)["softmax"]
        del teacher
    rows.update(results)
    console.print(format_table(rows, title=f"{spec['name']}: {ev.get('stage', source)} on "
                               "held-out recall "
                               f"documents (near: fact <= {corpus.near_max} tokens back; far: >= "
                               f"{corpus.far_min}; model window {window})"))
    return recall_summary(rows, corpus, stage=ev.get("stage"), checkpoint=str(source),
                          window=window, device=device, precision=precision)


def _evaluate_command(spec: dict, ev: dict, console) -> dict:
    from ..evaluation.cli import main as evaluate_main

    argv = [str(a) for a in ev.get("argv", [])]
    console.print(f"hedgecats evaluate {' '.join(argv)}")
    rc = evaluate_main(argv)
    if rc:
        raise RuntimeError(f"hedgecats evaluate exited with {rc}")
    return {"stage": ev.get("stage"), "command": ["hedgecats", "evaluate", *argv]}


EVALUATORS = {"recall": _evaluate_recall, "command": _evaluate_command}


def evaluations(spec: dict) -> list[dict]:
    """The ``evaluate:`` section as a list: one mapping (results.json keeps its keys at the top
    level) or a list of them (results.json lists them under ``evaluations``, in order)."""
    ev = spec.get("evaluate")
    if not ev:
        return []
    evals = [ev] if isinstance(ev, dict) else ev
    if not isinstance(evals, list) or not all(isinstance(e, dict) for e in evals):
        raise ValueError("'evaluate' must be a mapping (one evaluation) or a list of mappings")
    return evals
