"""``hedgecats import-lolcats``: a released LoLCATs conversion -> a hedgecats hybrid directory.

    hedgecats import-lolcats --base meta-llama/Meta-Llama-3.1-8B \\
        --distill lolcats-llama-3.1-8b-distill/model.pt \\
        --lora lolcats-llama-3.1-8b-ft-lora/model.pt  out/lolcats-llama-3.1-8b
        [--config LOLCATS_MODEL.yaml | --attention-type T --window-size W --softmax-layers I,J]
        [--lora-alpha 16 | --finetune-config LOLCATS_FINETUNE.yaml] [--keep-adapter]
        [--dtype auto] [--check] [--overwrite] [--device cpu]

LoLCATs' checkpoints hold the trained tensors only (feature maps, window factors, LoRA), not the
settings that give them meaning; those come from their model config (``--config``, its
``attention:`` section) or the flags, and default to the released Llama-3.1-8B conversion's
(``lolcats_llama_window_tk``, window 64, softmax_dim feature maps, eps 1e-12). The output is a
transformers-native hybrid (``models.hf``: config.json with the ``hybrid`` section, weights, LoRA
merged or kept as a peft adapter), the base model's tokenizer, a model card and
``lolcats_import.json`` (the settings and the source files, with their SHA-256), so that
``hedgecats evaluate --model OUT`` and ``AutoModelForCausalLM.from_pretrained(OUT)`` take it like
any other hybrid. ``models.lolcats`` documents the mapping; docs/diagnose.md the diagnosis.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["IMPORT_RECORD", "import_lolcats", "main"]

#: the provenance file written beside the hybrid
IMPORT_RECORD = "lolcats_import.json"
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _shown(path: str | os.PathLike) -> str:
    """A local path by its last two parts (the card never shows the importer's directories)."""
    p = Path(path)
    return "/".join(p.parts[-2:]) if p.exists() else str(path)


def _lora_alpha_from(finetune_config: str | os.PathLike) -> tuple[float, int | None]:
    """``(lora_alpha, r)`` from a LoLCATs fine-tuning config (``finetune.kwargs``)."""
    import yaml

    p = Path(finetune_config).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"--finetune-config {str(finetune_config)!r} does not exist")
    cfg = yaml.safe_load(p.read_text()) or {}
    ft = cfg.get("finetune") if isinstance(cfg, dict) else None
    kw = (ft or {}).get("kwargs") if isinstance(ft, dict) else None
    if not isinstance(kw, dict) or "lora_alpha" not in kw:
        raise ValueError(f"--finetune-config {str(finetune_config)!r} has no finetune.kwargs."
                         f"lora_alpha (a LoLCATs fine-tuning config, e.g. "
                         f"finetune_lora_qkvo_alpaca_clean.yaml)")
    if (ft or {}).get("method", "lora") != "lora":
        raise ValueError(f"--finetune-config {str(finetune_config)!r}: finetune.method is "
                         f"{ft.get('method')!r}; only LoRA fine-tuning is imported")
    return float(kw["lora_alpha"]), (int(kw["r"]) if "r" in kw else None)


def _base_shapes(model) -> dict:
    from .models.structure import decoder_layers, head_dims

    H, Hkv, D, _ = head_dims(model.config)
    attn = decoder_layers(model)[0].self_attn
    mods = {name: (getattr(attn, name).in_features, getattr(attn, name).out_features)
            for name in LORA_MODULES if hasattr(attn, name)}
    return {"num_layers": len(decoder_layers(model)), "num_heads": H, "kv_heads": Hkv,
            "head_dim": D, "lora_modules": mods}


def _apply_lora(model, weights, alpha: float, expect_r: int | None):
    """A peft ``PeftModel`` around ``model`` whose LoRA tensors are LoLCATs'."""
    import torch
    from peft import LoraConfig, get_peft_model

    ranks = {a.shape[0] for a, _ in weights.lora.values()}
    (r,) = ranks  # check_weights made them equal
    if expect_r is not None and r != expect_r:
        raise ValueError(f"the LoRA tensors have rank {r}, the fine-tuning config says r={expect_r}")
    layers = sorted({i for i, _ in weights.lora})
    per_layer = {i: sorted(m for j, m in weights.lora if j == i) for i in layers}
    modules = sorted({m for _, m in weights.lora})
    uneven = {i: ms for i, ms in per_layer.items() if ms != modules}
    if uneven:
        raise ValueError(f"LoRA covers {modules} in some layers but only {uneven} in others: "
                         f"one peft config cannot express that")
    n_layers = _base_shapes(model)["num_layers"]
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=modules, bias="none",
                     layers_to_transform=None if len(layers) == n_layers else layers)
    peft_model = get_peft_model(model, cfg)
    params = dict(peft_model.named_parameters())
    with torch.no_grad():
        for (i, mod), (a, b) in weights.lora.items():
            for ab, t in (("A", a), ("B", b)):
                name = f"base_model.model.model.layers.{i}.self_attn.{mod}.lora_{ab}.default.weight"
                if name not in params:
                    raise ValueError(f"peft made no parameter {name!r} for the LoLCATs tensor of "
                                     f"layer {i} {mod} lora_{ab}")
                params[name].copy_(t.to(params[name].dtype))
    missing = [n for n in params if ".lora_" in n
               and not any(f"layers.{i}.self_attn.{m}." in n for i, m in weights.lora)]
    if missing:
        raise ValueError(f"peft LoRA parameters {missing[:4]} have no LoLCATs tensor")
    peft_model.eval()
    return peft_model


def model_card(name: str, *, base: str, settings, record: dict, lora: str | None) -> str:
    """The README.md of an imported conversion."""
    s = settings
    shape = {"terraced_end": "terraced (a block of {w} plus the previous block, blocks ending at "
                             "the sequence's end, as LoLCATs' code)",
             "sliding": "sliding ({w} tokens)"}[s.window_shape].format(w=s.window_size)
    lora_text = {None: "none", "merge": "merged into the weights",
                 "adapter": "peft adapter in `adapter/`"}[lora]
    sources = ", ".join(f"`{_shown(v['path'])}` (sha256 {v['sha256'][:12]})"
                        for v in record["sources"].values())
    intro = (f"A LoLCATs conversion of **{_shown(base)}** (`{s.attention_type}`), imported into "
             f"hedgecats with `hedgecats import-lolcats` so that its branches can be ablated. "
             f"The weights are LoLCATs' own; the layers compute LoLCATs' formula "
             f"(window-max-shifted softmax terms and unscaled linear-attention terms under one "
             f"denominator).")
    lines = [
        "---", "library_name: transformers", "tags:", "- hedgecats", "- lolcats",
        "- linear-attention", "---", "", f"# {name}", "", intro, "",
        "```python", "import hedgecats  # registers the hybrid classes with transformers",
        "from hedgecats.models import set_attention_mode",
        "from transformers import AutoModelForCausalLM", "",
        f'model = AutoModelForCausalLM.from_pretrained("{name}")',
        'set_attention_mode(model, "swa_only")  # or la_only, none, ...', "```",
        "", "| | |", "|---|---|",
        f"| base model | {_shown(base)} |",
        f"| window | {shape} |",
        (f"| feature maps | softmax_dim (LoLCATs), {record['feature_dim']} x 2 features, "
         f"clamped at {s.eps:g}, one key map per query head |"),
        "| mixer | shared_norm, LoLCATs' window factors, `shared_norm_shift=window_max` |",
        f"| softmax layers | {s.softmax_attentions or 'none'} |",
        f"| LoRA | {lora_text} |",
        "", f"Sources: {sources}.", "",
    ]
    if s.window_shape == "terraced_end":
        lines += [
            ("The terraced window's blocks end at each sequence's last real token, as LoLCATs "
             "computes them: an output depends on the sequence's length. Right-padded batches "
             "without an attention mask (lm-eval's log-likelihood requests) move the blocks of "
             "the shorter sequences; evaluate with batch size 1, as LoLCATs' harness does, or "
             "pass attention masks."), ""]
    return "\n".join(lines) + "\n"


def import_lolcats(base: str, distill: str | os.PathLike, out: str | os.PathLike, *,
                   lora: str | os.PathLike | None = None, settings=None,
                   lora_alpha: float | None = None, finetune_config: str | None = None,
                   keep_adapter: bool = False, dtype: str = "auto", device: str = "cpu",
                   overwrite: bool = False, check: bool = False) -> Path:
    """Import a LoLCATs conversion; returns the output directory.

    Args:
        base: the base model (a local transformers directory or a hub id) LoLCATs converted.
        distill: LoLCATs' attention-transfer checkpoint (feature maps, window factors).
        out: the directory to write (replaced only with ``overwrite``).
        lora: LoLCATs' fine-tuning checkpoint (LoRA on q, k, v, o; may also hold feature maps
            and window factors, which then replace the distillation's).
        settings: ``models.lolcats.LolcatsSettings`` (default: the released Llama-3.1-8B's).
        lora_alpha: LoRA's alpha (LoLCATs: 16); ``finetune_config`` reads it from their YAML.
        keep_adapter: keep LoRA as a peft adapter (``OUT/adapter``) instead of merging it.
        dtype: the base model's dtype (``auto``: as stored).
        check: reload the directory and require logits bit-identical to the imported model's in
            every mode.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import convert_to_hybrid
    from .models.hf import save_hybrid
    from .models.io import atomic_directory
    from .models.lolcats import (
        LolcatsSettings,
        check_weights,
        hybrid_config,
        load_into,
        read_checkpoint,
        read_weights,
    )

    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r}; valid: {', '.join(_DTYPES)}")
    settings = settings if settings is not None else LolcatsSettings()
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{str(out)!r} exists and is not empty: pass --overwrite to replace "
                              f"it, or choose another directory")
    expect_r = None
    if finetune_config is not None:
        if lora_alpha is not None:
            raise ValueError("give --lora-alpha or --finetune-config, not both")
        lora_alpha, expect_r = _lora_alpha_from(finetune_config)
    if lora is None and (lora_alpha is not None or keep_adapter):
        raise ValueError("--lora-alpha / --finetune-config / --keep-adapter need --lora")
    lora_alpha = 16.0 if lora_alpha is None else float(lora_alpha)

    # the checkpoints first: a bad file fails before the base model is read
    sources = {"distill": Path(distill).expanduser()}
    weights = read_weights(read_checkpoint(sources["distill"]), str(distill), allow_lora=False)
    if lora is not None:
        sources["lora"] = Path(lora).expanduser()
        before = {k: v for k, v in weights.sources.items()}
        read_weights(read_checkpoint(sources["lora"]), str(lora), into=weights, allow_lora=True)
        replaced = sorted({k[0] for k, v in weights.sources.items()
                           if before.get(k) not in (None, v) and k[1] in ("q", "k", "factor")})
        if replaced:
            log.info("the fine-tuning checkpoint holds feature maps / window factors of layers "
                     "%s: they replace the attention-transfer checkpoint's", replaced)
        if not weights.lora:
            raise ValueError(f"--lora {str(lora)!r} holds no LoRA tensor "
                             f"(...self_attn.{{q,k,v,o}}_proj.lora_{{A,B}}.default.weight)")

    try:
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype="auto" if dtype == "auto" else getattr(torch, dtype))
    except OSError as err:
        raise ValueError(f"cannot load --base {base!r} as a transformers model (a local "
                         f"directory with config.json, or a hub id reachable from here): {err}"
                         ) from err
    model.to(device).eval()
    shapes = _base_shapes(model)
    f = check_weights(weights, settings, num_layers=shapes["num_layers"],
                      num_heads=shapes["num_heads"], head_dim=shapes["head_dim"],
                      lora_modules=shapes["lora_modules"])
    config = hybrid_config(settings, head_dim=shapes["head_dim"], feature_dim=f,
                           num_layers=shapes["num_layers"])
    convert_to_hybrid(model, config)
    filled = load_into(model, weights, settings)
    log.info("imported LoLCATs feature maps and window factors into layers %s", filled)
    hybrid = _apply_lora(model, weights, lora_alpha, expect_r) if weights.lora else model
    lora_mode = None if not weights.lora else ("adapter" if keep_adapter else "merge")

    record = {
        "format": "hedgecats-lolcats-import/1",
        "base_model": base if not Path(base).exists() else _shown(base),
        "settings": settings.to_dict(),
        "feature_dim": f,
        "lora": None if not weights.lora else {
            "r": next(iter(weights.lora.values()))[0].shape[0], "alpha": lora_alpha,
            "modules": sorted({m for _, m in weights.lora}),
            "layers": sorted({i for i, _ in weights.lora}), "saved_as": lora_mode},
        "hybrid_config": config.to_dict(),
        "sources": {k: {"path": _shown(p), "sha256": _sha256(p)} for k, p in sources.items()},
    }
    with atomic_directory(out) as tmp:
        save_hybrid(hybrid, tmp, lora=lora_mode)
        try:
            AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
        except (OSError, ValueError) as err:
            log.warning("the base model %s has no tokenizer to copy (%s): hedgecats evaluate "
                        "needs one in the directory", base, err)
        (tmp / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(out.name, base=base, settings=settings,
                                                  record=record, lora=lora_mode))
        if check:
            from .export import _check_export

            _check_export(hybrid, tmp)
    return out


def _layers(text: str) -> list[int]:
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer "
                                         f"indices (e.g. 0,31)") from None


def main(argv: list[str]) -> int:
    from .models.lolcats import ATTENTION_TYPES, LolcatsSettings

    p = argparse.ArgumentParser(prog="hedgecats import-lolcats",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the directory to write (a transformers model directory)")
    p.add_argument("--base", required=True,
                   help="the base model LoLCATs converted (local directory or hub id)")
    p.add_argument("--distill", required=True,
                   help="LoLCATs' attention-transfer checkpoint (.pt: feature maps, window factors)")
    p.add_argument("--lora", help="LoLCATs' fine-tuning checkpoint (.pt: LoRA on q, k, v, o)")
    g = p.add_argument_group("LoLCATs settings (default: the released Llama-3.1-8B conversion)")
    g.add_argument("--config", help="LoLCATs model config YAML: its attention: section")
    g.add_argument("--attention-type", help=f"one of {', '.join(ATTENTION_TYPES)}")
    g.add_argument("--window-size", type=int, help="window / block length (LoLCATs: 64)")
    g.add_argument("--softmax-layers", type=_layers,
                   help="layers LoLCATs left as softmax attention, e.g. 0,31")
    g.add_argument("--tie-qk-kernels", action="store_true", default=None,
                   help="the key feature maps are the query maps (tie_qk_kernels: true)")
    g2 = p.add_mutually_exclusive_group()
    g2.add_argument("--lora-alpha", type=float, help="LoRA alpha (LoLCATs: 16)")
    g2.add_argument("--finetune-config", help="LoLCATs fine-tuning YAML: finetune.kwargs")
    p.add_argument("--keep-adapter", action="store_true",
                   help="keep LoRA as a peft adapter in OUT/adapter (default: merged)")
    p.add_argument("--dtype", default="auto", choices=_DTYPES,
                   help="the base model's dtype (default: as stored)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    p.add_argument("--check", action="store_true",
                   help="reload the directory and require bit-identical logits in every mode")
    a = p.parse_args(argv)
    try:
        overrides = {"attention_type": a.attention_type, "window_size": a.window_size,
                     "softmax_attentions": a.softmax_layers, "tie_qk_kernels": a.tie_qk_kernels}
        settings = (LolcatsSettings.from_yaml(a.config, **overrides) if a.config else
                    LolcatsSettings(**{k: v for k, v in overrides.items() if v is not None}))
        out = import_lolcats(a.base, a.distill, a.out, lora=a.lora, settings=settings,
                             lora_alpha=a.lora_alpha, finetune_config=a.finetune_config,
                             keep_adapter=a.keep_adapter, dtype=a.dtype, device=a.device,
                             overwrite=a.overwrite, check=a.check)
    except (FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"hedgecats import-lolcats: {err}", file=sys.stderr)
        return 2
    print(f"imported the LoLCATs conversion ({settings.attention_type}, window "
          f"{settings.window_size}) to {out}")
    if settings.window_shape == "terraced_end":
        print("note: its terraced blocks end at each sequence's end (as LoLCATs computes them); "
              "evaluate with --batch-size 1, as LoLCATs' harness does (docs/diagnose.md)")
    return 0
