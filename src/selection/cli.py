"""``hedgecats select-layers``: rank the converted layers of stage-1 models by a measured score,
choose the layers kept softmax by a budget, and write the report, the ``layers:`` and (for one
input) the hand-off ``stage.pt`` (docs/layer-selection.md).

Several inputs (the same recipe's stage 1 under several seeds) are ranked together: by the
mean of each layer's position, the held-out KL curve averaged, and the report says how stable
every score's ranking is across them and how each compared score agrees with the chosen one.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from itertools import islice
from pathlib import Path

__all__ = ["build_parser", "main"]

PROG = "hedgecats select-layers"


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip() and t.strip() != "none"]


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    from .scores import CHEAP, SCORES

    p = argparse.ArgumentParser(
        prog=PROG, description="Rank the converted layers of stage-1 models by a measured "
        "score, keep the worst softmax within a budget, and write the report, the layers: and "
        "(one input) the hand-off stage.pt (docs/layer-selection.md).",
        epilog="scores (higher = worse, kept softmax first): "
               + "; ".join(f"{k}: {v}" for k, v in SCORES.items())
               + ". Exit status: 0 done; 1 the budget cannot be met or scoring failed; 2 a "
                 "mistake in the arguments or the inputs (nothing scored).")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="stage 1's stage.pt, its stage directory, or a run directory (its stage "
                        "--stage); several: seeds of one recipe, ranked together")
    p.add_argument("--output", required=True, help="directory for selection.json / .md / .png "
                   "(and stage.pt for one input)")
    p.add_argument("--stage", default="transfer",
                   help="the stage of a run directory to read (default: transfer)")
    p.add_argument("--score", default="kl", choices=list(SCORES),
                   help="what ranks the layers (default: kl)")
    p.add_argument("--compare", type=_csv, default=list(CHEAP),
                   help="scores reported beside it, with their agreement (comma-separated, or "
                        f"none; default: {','.join(CHEAP)})")
    b = p.add_argument_group("budget: --keep, or --max-softmax and / or --kl-below")
    b.add_argument("--keep", type=int, help="keep the K worst layers softmax")
    b.add_argument("--max-softmax", type=int, metavar="N", help="at most N softmax layers")
    b.add_argument("--kl-below", type=float, metavar="X",
                   help="keep softmax layers until the held-out KL to the teacher (nats per "
                        "token) is below X")
    d = p.add_argument_group("held-out text (default: recall-corpus documents, --tokens of them)")
    src = d.add_mutually_exclusive_group()
    src.add_argument("--text", metavar="FILE", help="a UTF-8 text file")
    src.add_argument("--data", metavar="YAML",
                     help="a DataModule (a YAML / JSON mapping with class_path and init_args, "
                          "or a file holding one), e.g. a pipeline's RecallDataModule: its "
                          "validation split is scored")
    d.add_argument("--tokens", type=_positive, default=8192,
                   help="tokens of the default documents (default 8192)")
    d.add_argument("--seq-len", type=_positive, default=1024,
                   help="tokens per sequence for --text and the default (default 1024)")
    d.add_argument("--batch-size", type=_positive, default=4,
                   help="sequences per batch for --text and the default (default 4)")
    d.add_argument("--max-batches", type=_positive, help="score at most this many batches")
    d.add_argument("--min-tokens", type=_positive, default=256,
                   help="fewer held-out tokens are an error (default 256)")
    p.add_argument("--base-model", help="load the base model from here (the run moved)")
    p.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu, cuda")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16, float16")
    p.add_argument("--seed", type=int, default=0,
                   help="the random score's seed and the default documents' (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier selection")
    return p


def resolve_input(value: str, stage: str) -> Path:
    """The ``stage.pt`` an input names (a file, a stage directory, a run directory)."""
    from ..models.stage_source import is_run_directory

    p = Path(value).expanduser()
    if p.is_file():
        return p
    if (p / "stage.pt").is_file():
        return p / "stage.pt"
    if p.is_dir() and is_run_directory(p):
        if (p / stage / "stage.pt").is_file():
            return p / stage / "stage.pt"
        raise FileNotFoundError(f"{value!r} is a run directory without {stage}/stage.pt (did "
                                "its stage 1 finish? another stage: --stage NAME)")
    raise FileNotFoundError(f"no such stage.pt, stage directory or run directory: {value!r}")


def _batches_of(ids, seq_len: int, batch_size: int) -> list[dict]:
    import torch

    ids = ids[: ids.numel() // seq_len * seq_len] if ids.numel() >= seq_len else ids
    rows = ids.reshape(-1, min(seq_len, ids.numel()))
    return [{"input_ids": rows[i:i + batch_size],
             "attention_mask": torch.ones_like(rows[i:i + batch_size])}
            for i in range(0, rows.shape[0], batch_size)]


def _held_out(a, first: Path, base_model: str | None) -> tuple[list[dict], str]:
    """The held-out batches and what they are."""
    if a.data:
        import yaml

        text = a.data if _inline(a.data) else Path(a.data).read_text()
        spec = yaml.safe_load(text)
        if not isinstance(spec, dict) or "class_path" not in spec:
            raise ValueError(f"--data {a.data!r}: a mapping with class_path and init_args")
        dm = _data_class(spec["class_path"])(**(spec.get("init_args") or {}))
        dm.setup("validate")
        batches = [{k: v for k, v in b.items() if k in ("input_ids", "attention_mask")}
                   for b in islice(dm.val_dataloader(), a.max_batches)]
        return batches, f"{type(dm).__name__}'s validation split"
    from transformers import AutoTokenizer

    from ..models.stage_files import read_stage, resolve_base_model

    payload = read_stage(first)
    tok = AutoTokenizer.from_pretrained(base_model or resolve_base_model(payload, first))
    if a.text:
        try:
            text = Path(a.text).read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"--text {a.text!r} is not UTF-8 text ({err.reason})") from None
        source = f"{a.text}"
    else:
        from ..evaluation.branch_usage import default_text

        window = (payload["hybrid_config"] or {}).get("window", 64)
        text = default_text(tok, a.tokens, window, seed=a.seed)
        source = f"recall-corpus documents (seed {a.seed})"
    ids = tok(text, return_tensors="pt")["input_ids"][0]
    if not a.text:
        ids = ids[: a.tokens]
    batches = _batches_of(ids, a.seq_len, a.batch_size)
    return batches[: a.max_batches] if a.max_batches else batches, source


def _inline(value: str) -> bool:
    """Whether ``--data`` is the mapping itself rather than a file's path: a YAML / JSON
    mapping (a ``{``, or more than one line). Decided without the filesystem: a mapping
    longer than a file name's limit is no path (``Path.is_file`` raises on it)."""
    text = value.strip()
    return text.startswith("{") or "\n" in text


def _data_class(name: str):
    import importlib

    if "." in name:
        mod, _, attr = name.rpartition(".")
        return getattr(importlib.import_module(mod), attr)
    from .. import data

    if hasattr(data, name):
        return getattr(data, name)
    raise ValueError(f"--data: class_path {name!r} is not a DataModule hedgecats knows (give "
                     "the full class path)")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from .budget import Budget, BudgetNotMetError

    try:
        budget = Budget(keep=a.keep, max_softmax=a.max_softmax, kl_below=a.kl_below)
        from .scores import check_scores

        check_scores(a.compare, "--compare")
        paths = [resolve_input(x, a.stage) for x in a.inputs]
        from ..models.stage_files import converted_layers, read_stage

        budget.check(len(converted_layers(read_stage(paths[0]))), str(paths[0]))
        out = Path(a.output)
        if (out / "selection.json").exists() and not a.overwrite:
            raise FileExistsError(f"{str(out)!r} holds a selection already; --overwrite "
                                  "replaces it")
        batches, source = _held_out(a, paths[0], a.base_model)
    except (ValueError, FileNotFoundError, FileExistsError, OSError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    return _run(a, budget, paths, batches, source, BudgetNotMetError)


def _run(a, budget, paths, batches, source, BudgetNotMetError) -> int:
    import torch

    from ..models.stage_files import resolve_dtype
    from .report import format_markdown, write_report
    from .select import load_stage_model, select_layers, write_selected_stage

    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    try:
        dtype = resolve_dtype(a.dtype, device)
        models = [lambda p=p: load_stage_model(p, base_model=a.base_model, dtype=dtype,
                                               device=device)[0] for p in paths]
        sel = select_layers(models, batches, score=a.score, budget=budget, compare=a.compare,
                            names=[str(p) for p in paths], seed=a.seed,
                            min_tokens=a.min_tokens, source=source,
                            context=contextlib.nullcontext)
    except BudgetNotMetError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    except (ValueError, KeyError, FileNotFoundError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    out = Path(a.output)
    written = write_report(sel, out)
    if len(paths) == 1:
        written["stage.pt"] = write_selected_stage(paths[0], out / "stage.pt", sel,
                                                   base_model=a.base_model)
    print(format_markdown(sel))
    print(f"layers: {sel['layers']}")
    print(f"written: {', '.join(str(p) for p in written.values())}")
    return 0
