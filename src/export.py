"""``hedgecats export``: a finished stage -> a transformers-native hybrid directory + model card.

    hedgecats export runs/hedgecats/finetune/stage.pt out/my-hybrid            # a stage checkpoint
    hedgecats export runs/hedgecats out/my-hybrid [--overwrite]                # a run directory
        [--merge-lora (default) | --keep-adapter] [--base-model PATH] [--results results.json]
        [--check] [--push-to-hub ORG/NAME [--private]]

The directory is what ``save_hybrid`` writes (``models.hf``: config.json with the hybrid
section, safetensors, LoRA merged or as a peft adapter in ``adapter/``), the base model's
tokenizer, and a ``README.md`` model card: base model, recipe, the stages that led to this one
(steps and tokens), the architecture, and the evaluation table when the run has one.

A run directory (``hedgecats pipeline --output``) holds one directory per stage; the stage
exported is the one ``results.json`` evaluated, else the last of the ``init_from`` chain, and a
run whose stages do not form one chain must be given the ``stage.pt`` itself. A run with a
stage that started but did not finish (``checkpoints/`` without ``done``) is refused, naming
it: finish it, or name the stage to export (``models.stage_source``, as ``evaluate`` and
``generate`` read theirs).

The output: an earlier export (a ``config.json`` of a hedgecats hybrid) is only replaced with
``--overwrite``; a file, or a non-empty directory that is not an export, is refused unless
``--force`` (the pipeline's rule for ``--output``). The directory is written beside the old
one, then swapped in: a failed export (a full disk, a read-only location: one line in the
pipeline's wording, exit 1) leaves it as it was. Files follow the umask.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

__all__ = ["check_output", "export", "main", "model_card", "stage_chain"]


# ----------------------------------------------------------------------------- finding the stage
def _read_stage(path: Path) -> dict:
    from .models.stage_files import read_stage

    return read_stage(path)


def stage_chain(stage_pt: Path) -> list[dict]:
    """The stages that led to ``stage_pt``, first to last: name, class, steps, tokens (``None``
    when the stage's config does not say), read from each ``stage.pt`` and its ``config.yaml``."""
    chain, seen, p = [], set(), stage_pt
    while p is not None and p.is_file() and p.resolve() not in seen:
        seen.add(p.resolve())
        d = _read_stage(p)
        steps = d["meta"].get("global_step")
        chain.append({"name": p.parent.name, "stage": d.get("stage"), "steps": steps,
                      "tokens": _tokens(p.parent / "config.yaml", steps),
                      "base_model": d.get("base_model"), "lora": d.get("lora_config") is not None})
        nxt = d["meta"].get("init_from")
        p = Path(nxt) if nxt else None
    return chain[::-1]


def _tokens(config_yaml: Path, steps: int | None) -> int | None:
    """Optimizer steps x sequences per step x sequence length, from the stage's data config."""
    if steps is None or not config_yaml.is_file():
        return None
    cfg = yaml.safe_load(config_yaml.read_text()) or {}
    args = ((cfg.get("data") or {}).get("init_args") or {})
    per_step = args.get("global_batch_size", args.get("batch_size"))
    seq = args.get("seq_len")
    if not isinstance(per_step, int) or not isinstance(seq, int):
        return None
    return int(steps) * per_step * seq


# ----------------------------------------------------------------------------- the card
def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 10 else f"{x:.2f}"
    return "-" if x is None else str(x)


def results_table(results: dict) -> str | None:
    """Markdown table of a ``results.json``: ``hedgecats evaluate``'s (rows = modes, columns =
    tasks, AVG, Rec. Perf) or a pipeline's recall evaluation (rows = modes, columns = metrics).
    ``None`` for a format it does not know."""
    if isinstance(results.get("modes"), dict):
        modes = results["modes"]
        tasks = sorted({t for row in modes.values() for t in row.get("tasks", {})})
        if not tasks:  # ``hedgecats evaluate --tasks none``: the probes are the results
            from .evaluation.report import probe_sections

            return "\n".join(probe_sections(results)).strip() or None
        lines = ["| mode | " + " | ".join(tasks) + " | AVG | Rec. Perf |",
                 "|---" * (len(tasks) + 3) + "|"]
        for label, row in modes.items():
            cells = [_fmt(row.get("tasks", {}).get(t, {}).get("score")) for t in tasks]
            lines.append(f"| {label} | " + " | ".join(cells)
                         + f" | {_fmt(row.get('avg'))} | {_fmt(row.get('rec_perf'))} |")
        if results.get("delta_la") is not None:
            lines.append(f"\nDelta_LA = AVG(hybrid) - AVG(swa_only) = "
                         f"{_fmt(results['delta_la'])} points.")
        return "\n".join(lines)
    rows = results.get("results")
    if isinstance(rows, dict) and rows and all(isinstance(v, dict) for v in rows.values()):
        metrics = list(dict.fromkeys(k for v in rows.values() for k in v))
        lines = ["| mode | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
        for mode, v in rows.items():
            lines.append(f"| {mode} | " + " | ".join(_fmt(v.get(m)) for m in metrics) + " |")
        return "\n".join(lines)
    return None


def _is_hub_id(name: str | None) -> bool:
    return bool(name) and not Path(name).expanduser().exists() and name.count("/") == 1 \
        and not name.startswith((".", "/", "~"))


def _shown(path_or_id: str | None) -> str:
    """A hub id as it is; a local path by its last two parts (an absolute path says nothing to a
    reader of the card and tells where the exporter keeps their files)."""
    if path_or_id is None or _is_hub_id(path_or_id):
        return str(path_or_id)
    return "/".join(Path(path_or_id).parts[-2:])


def model_card(*, name: str, section: dict, chain: list[dict], lora: str | None,
               results: dict | None, results_source: str | None, recipe: str | None) -> str:
    """The README.md of an exported hybrid."""
    hc = section["config"]
    base_id = chain[-1]["base_model"] if chain else None
    base = _shown(base_id)
    meta = ["---", "library_name: transformers", "tags:", "- hedgecats", "- linear-attention",
            "- sliding-window-attention"]
    if _is_hub_id(base_id):
        meta.append(f"base_model: {base_id}")
    meta.append("---")
    windows = f"{hc['window']}" + (f" (per layer: {hc['layer_windows']})"
                                   if hc.get("layer_windows") else "")
    layers = "all" if hc.get("layers") is None else str(hc["layers"])
    out = meta + [
        "", f"# {name}", "",
        f"A hybrid of linear attention (learned Hedgehog feature maps) and sliding-window softmax "
        f"attention, converted from **{base}**{'' if _is_hub_id(base_id) else ' (local)'} "
        f"with hedgecats (format "
        f"`{section['format']}`, hedgecats {section.get('hedgecats_version')}).", "",
        "Load it with hedgecats installed and imported (it registers the model classes; without "
        "it transformers does not know the model type and refuses to load it):", "",
        "```python", "import hedgecats  # registers the hybrid classes with transformers",
        "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        f'model = AutoModelForCausalLM.from_pretrained("{name}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
        "out = model.generate(**tokenizer(\"Hello\", return_tensors=\"pt\"), max_new_tokens=20)"
        "  # constant-memory cache", "```", "",
        "## Architecture", "",
        "| | |", "|---|---|",
        f"| base model | {base} ({section['family']}{'' if _is_hub_id(base_id) else ', local'}) |",
        f"| converted layers | {layers} |",
        f"| SWA window | {windows} |",
        f"| feature map | {hc['feature_activation']}, {hc['feature_projection']} projection |",
        f"| LA span | {'every causal key' if hc['overlap'] else 'keys outside the window'} |",
        f"| mixer | {hc['mixer']} (g = {hc['g']}) |",
        f"| mode saved | {hc['mode']} |",
        f"| base model's own window | {section.get('base_sliding_window') or 'none'} |",
        f"| LoRA | {_lora_text(lora)} |", "",
        "Ablation modes are switched after loading: `hedgecats.models.set_attention_mode(model, "
        "'swa_only')` (also `la_only`, `sinks_only`, `none`, `softmax`).", "",
        "## Training", "", f"Recipe: {recipe or 'not recorded'}.", "",
        "| stage | class | optimizer steps | tokens |", "|---|---|---|---|",
    ]
    for st in chain:
        tok = f"{st['tokens']:,}" if st["tokens"] is not None else "not recorded"
        out.append(f"| {st['name']} | {st['stage']} | {_fmt(st['steps'])} | {tok} |")
    out += ["", "(Tokens = optimizer steps x sequences per step x sequence length, from each "
            "stage's config.yaml.)", "", "## Evaluation", ""]
    table = results_table(results) if results is not None else None
    if results is None:
        out.append("No evaluation results were found for this run.")
    elif table is None:
        out.append(f"`{results_source}` is in a format this card does not render.")
    else:
        out += [f"From `{_shown(results_source)}`:", "", table]
    return "\n".join(out) + "\n"


def _lora_text(lora: str | None) -> str:
    return {None: "none", "merge": "merged into the weights",
            "adapter": "peft adapter in `adapter/` (loaded with the model)"}[lora]


# ----------------------------------------------------------------------------- export
def export(source: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
           lora: str = "merge", base_model: str | None = None, results: str | None = None,
           check: bool = False, push_to_hub: str | None = None, private: bool | None = None,
           device: str = "cpu", force: bool = False) -> Path:
    """Export a stage (file, stage directory or run directory) to ``out``; returns ``out``.

    Args:
        overwrite: replace an earlier export at ``out``.
        force: replace whatever ``out`` is (a file, a directory that is not an export).
        lora: ``merge`` (default) or ``adapter``; ignored (the card says so) without LoRA.
        base_model: load the base model from here instead of the path recorded in the stage.
        results: a ``results.json`` for the card (default: the run directory's).
        check: reload the export and require bit-identical logits in every mode.
        push_to_hub: a repo id: the exported model goes up through transformers' own
            ``push_to_hub`` (and the tokenizer's), then the model card.
    """
    from .models.stage_files import load_hybrid
    from .models.hf import hybrid_section, save_hybrid
    from .models.io import WriteFailedError, atomic_directory, write_failed

    if lora not in ("merge", "adapter"):
        raise ValueError(f"lora={lora!r}; valid: merge, adapter")
    out = check_output(out, overwrite=overwrite, force=force)
    from .models.stage_source import resolve_stage

    stage_pt, run_dir = resolve_stage(source)
    res_path = Path(results) if results else (run_dir / "results.json" if run_dir else None)
    res = json.loads(res_path.read_text()) if res_path is not None and res_path.is_file() else None
    if results and res is None:
        raise FileNotFoundError(f"--results {results!r} does not exist")
    model, tokenizer, info = load_hybrid(stage_pt, merge_lora=False, base_model=base_model,
                                         device=device)
    has_lora = info["lora_config"] is not None
    lora_used = lora if has_lora else None
    if not has_lora and lora == "adapter":
        log.warning("%s has no LoRA: --keep-adapter has nothing to keep", stage_pt)
    chain = stage_chain(stage_pt)
    card = model_card(name=push_to_hub or out.name, section=hybrid_section(model, None),
                      chain=chain, lora=lora_used, results=res,
                      results_source=str(res_path) if res is not None else None,
                      recipe=(res or {}).get("pipeline") or (run_dir.name if run_dir else None))
    try:
        with atomic_directory(out) as tmp:  # a file there (--force) stays until the swap
            save_hybrid(model, tmp, lora=lora_used)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            (tmp / "README.md").write_text(card)
            if check:
                _check_export(model, tmp)
    except Exception as err:
        cause = _os_error(err)
        if cause is None or isinstance(err, WriteFailedError):
            raise
        raise write_failed(out, cause, "nothing was written" if not out.exists() else
                           "the directory there is as it was") from err
    if push_to_hub:
        push(out, push_to_hub, private=private)
    return out


def _os_error(err: BaseException) -> OSError | None:
    """The operating system's error behind a failed write: ``err`` itself, or the one that
    safetensors' writer reports in its own exception type (``... (os error 28)``)."""
    if isinstance(err, OSError):
        return err
    import re

    m = re.search(r"os error (\d+)", str(err))
    if m and type(err).__name__ == "SafetensorError":
        return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
    return None


def _is_export(path: Path) -> bool:
    """A directory that ``hedgecats export`` (or ``save_pretrained`` of a hybrid) wrote."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and str(cfg.get("model_type", "")).startswith("hedgecats_")


def check_output(out: str | os.PathLike, *, overwrite: bool = False, force: bool = False) -> Path:
    """``out`` as a Path, or an error saying why it may not be written (before any model is
    loaded): an earlier export needs ``overwrite``; a file or a non-empty directory that is not
    an export needs ``force``; the nearest existing directory must be writable."""
    out = Path(out).expanduser()
    if out.is_file() and not force:
        raise FileExistsError(f"{str(out)!r} is a file, not a directory: choose a directory, or "
                              f"pass --force to replace the file")
    if out.is_dir() and any(out.iterdir()) and not force:
        if not _is_export(out):
            raise FileExistsError(
                f"{str(out)!r} is not empty and is not a hedgecats export (no config.json of a "
                f"hybrid): export would delete everything in it. Choose another directory, or "
                f"pass --force to replace it")
        if not overwrite:
            raise FileExistsError(f"{str(out)!r} exists and is not empty: pass --overwrite to "
                                  f"replace that export, or choose another directory")
    parent = next(q for q in (out, *out.parents) if q.exists()) if not out.exists() \
        else out.parent
    if not os.access(parent, os.W_OK):
        from .models.io import write_failed

        raise write_failed(out, PermissionError(13, f"{str(parent)!r} is not writable"),
                           "nothing was written")
    return out


class ExportCheckError(RuntimeError):
    """``--check``: the reloaded export does not reproduce the stage's logits."""


def _check_export(model, path: Path) -> None:
    """Reload ``path`` and compare logits with ``model`` in every mode (bit-identical)."""
    import torch

    from .models import attention_mode
    from .models.structure import unwrap
    from .models.config import MODES
    from .models.hf import load_pretrained_hybrid

    loaded = load_pretrained_hybrid(str(path), dtype=next(model.parameters()).dtype)
    merged = json.loads((path / "config.json").read_text())["hybrid"]["adapter"] is None
    ref = model.merge_and_unload() if merged and hasattr(model, "merge_and_unload") else model
    vocab = loaded.config.vocab_size
    x = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for mode in MODES:
            with attention_mode(unwrap(ref), mode), attention_mode(loaded, mode):
                a, b = ref(input_ids=x).logits, loaded(input_ids=x).logits
            if not torch.equal(a, b):
                raise ExportCheckError(f"the export does not reproduce the stage in "
                                   f"mode {mode!r} (max |diff| {(a - b).abs().max().item():.3g})")


def push(path: Path, repo_id: str, *, private: bool | None = None) -> None:
    """Upload an exported directory: the model and tokenizer through transformers' own
    ``push_to_hub``, then the model card (transformers writes its own README otherwise)."""
    from huggingface_hub import HfApi
    from transformers import AutoTokenizer

    from .models.hf import load_pretrained_hybrid

    model = load_pretrained_hybrid(str(path))
    model.push_to_hub(repo_id, private=private, commit_message="Upload hedgecats hybrid")
    if (path / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(path).push_to_hub(repo_id, private=private)
    HfApi().upload_file(path_or_fileobj=str(path / "README.md"), path_in_repo="README.md",
                        repo_id=repo_id, commit_message="Model card (hedgecats export)")


# ----------------------------------------------------------------------------- command line
def main(argv: list[str]) -> int:
    from .models.io import WriteFailedError

    p = argparse.ArgumentParser(prog="hedgecats export", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a stage.pt, a stage directory or a run directory")
    p.add_argument("out", help="the directory to write (a transformers model directory)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export")
    p.add_argument("--force", action="store_true",
                   help="replace OUT even if it is a file or a directory that is not an export")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--merge-lora", dest="lora", action="store_const", const="merge",
                   help="merge LoRA into the weights (default)")
    g.add_argument("--keep-adapter", dest="lora", action="store_const", const="adapter",
                   help="keep LoRA as a peft adapter in OUT/adapter")
    p.add_argument("--base-model", help="load the base model from here (the run moved)")
    p.add_argument("--results", help="results.json for the model card (default: the run's)")
    p.add_argument("--check", action="store_true",
                   help="reload the export and require bit-identical logits in every mode")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="then upload it to the hub")
    p.add_argument("--private", action="store_true", default=None, help="a private hub repo")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    try:
        out = export(a.source, a.out, overwrite=a.overwrite, lora=a.lora or "merge",
                     base_model=a.base_model, results=a.results, check=a.check,
                     push_to_hub=a.push_to_hub, private=a.private, device=a.device,
                     force=a.force)
    except (FileExistsError, FileNotFoundError, ValueError, KeyError) as err:
        print(f"hedgecats export: {err}", file=sys.stderr)
        return 2
    except ExportCheckError as err:  # raised inside the export's temporary directory
        print(f"hedgecats export: check failed: {err}; nothing was written to {a.out!r}",
              file=sys.stderr)
        return 1
    except WriteFailedError as err:  # a full disk, a read-only location: as the pipeline says
        print(f"hedgecats export: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    print(f"exported to {out}")
    if a.check:
        from .models.config import MODES

        print(f"check passed: the reloaded export gives the stage's logits bit for bit in every "
              f"mode ({', '.join(MODES)})")
    return 0
