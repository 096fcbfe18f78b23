"""``hedgecats generate``: text from a hybrid, with the constant-memory cache, streamed.

    hedgecats generate --model out/my-hybrid "The capital of France is"
    hedgecats generate --model runs/hedgecats/finetune/stage.pt --prompt-file prompts.txt \\
        --mode swa_only --max-new-tokens 64 --do-sample --temperature 0.7 --top-p 0.9

``--model`` is a hybrid directory (``hedgecats export``, ``save_pretrained``), a stage
checkpoint (``stage.pt``, its directory or a run directory) or a hub id of a hybrid. Prompts
come from the command line and/or a file (one per line, blank lines skipped). Each prompt is
generated on its own and streamed as it comes; ``--batch-size N`` generates N prompts at once
(left padding) and prints each when done. ``--mode`` and ``--switch name=value`` set the
ablation mode and switches (as ``set_attention_mode``); ``softmax`` generates with a full KV
cache (it reads every key), every other mode with the ``HybridCache``, whose size does not grow
with the context. A summary (tokens/s, cache size) goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from transformers import TextStreamer

from .models.config import MODES

__all__ = ["load_for_generation", "main", "parse_switch", "read_prompts"]

DTYPES = ("auto", "float32", "bfloat16", "float16")


def parse_switch(text: str) -> tuple[str, object]:
    """``name=value`` -> (name, value): true/false -> bool, an integer -> int, a number with a
    point or exponent -> float, else the string (``set_attention_mode`` checks names and
    values)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--switch {text!r}: expected name=value, e.g. la_span=all")
    low = value.lower()
    if low in ("true", "false"):
        return name, low == "true"
    for cast in (int, float):
        try:
            return name, cast(value)
        except ValueError:
            pass
    return name, value


def read_prompts(prompts: list[str], prompt_file: str | None) -> list[str]:
    out = list(prompts)
    if prompt_file:
        path = Path(prompt_file)
        if not path.is_file():
            raise FileNotFoundError(f"--prompt-file {prompt_file!r} does not exist")
        out += [line.rstrip("\n") for line in path.read_text().splitlines() if line.strip()]
    if not out:
        raise ValueError("no prompt: give one on the command line or with --prompt-file")
    return out


def load_for_generation(spec: str, *, device: str, dtype: str = "auto",
                        base_model: str | None = None, tokenizer: str | None = None):
    """``(model, tokenizer)`` for a hybrid directory, a stage checkpoint / stage or run
    directory, or a hub id; a directory that is not a hybrid is an error that says so."""
    import torch
    from transformers import AutoTokenizer

    from .models import hf
    from .models.io import missing_local_path
    from .models.stage_source import resolve_stage
    from .models.stage_files import load_hybrid
    from .models.hf import read_hybrid_config

    missing = missing_local_path(spec)
    if missing:
        raise FileNotFoundError(f"--model {missing}")
    torch_dtype = None if dtype == "auto" else getattr(torch, dtype)
    p = Path(spec).expanduser()
    tok = None
    if p.is_dir() and (p / "config.json").is_file():
        read_hybrid_config(p)
        model = hf.load_pretrained_hybrid(str(p), dtype=torch_dtype or "auto")
        tok_source = str(p)
    elif p.exists():
        stage_pt, _ = resolve_stage(p, command="generate")
        model, tok, info = load_hybrid(stage_pt, device=device, dtype=torch_dtype,
                                       base_model=base_model)
        tok_source = base_model or info["base_model"]
    else:  # a hub id
        try:
            model = hf.load_pretrained_hybrid(spec, dtype=torch_dtype or "auto")
        except OSError as err:  # not on the hub, or the hub cannot be reached
            raise ValueError(f"--model {spec!r} is not a local path, and the hub does not give "
                             f"it: {str(err).splitlines()[0][:300]}") from err
        tok_source = spec
    if tokenizer is not None or tok is None:
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer or tok_source)
        except (OSError, ValueError) as err:
            raise ValueError(f"no tokenizer for {spec!r} ({err}); pass --tokenizer") from err
    return model.to(device).eval(), tok


def _generate_kwargs(a, tok) -> dict:
    kw = dict(max_new_tokens=a.max_new_tokens, do_sample=a.do_sample, num_beams=a.num_beams,
              pad_token_id=tok.pad_token_id, repetition_penalty=a.repetition_penalty)
    if a.do_sample:
        kw.update(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    if a.num_beams > 1 and not a.no_stream and a.batch_size == 1:
        raise ValueError("beam search cannot stream (the best beam is known only at the end): "
                         "add --no-stream")
    return kw


def run(a, out=None, err=None) -> None:
    """Generate for the parsed arguments ``a`` (``build_parser``); text to ``out``, the
    summary to ``err`` (default: stdout, stderr)."""
    import torch

    from .models import set_attention_mode
    from .models.cache import HybridCache, generated_cache

    out, err = out or sys.stdout, err or sys.stderr
    prompts = read_prompts(a.prompt, a.prompt_file)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_for_generation(a.model, device=device, dtype=a.dtype,
                                     base_model=a.base_model, tokenizer=a.tokenizer)
    switches = dict(parse_switch(s) for s in a.switch)
    if a.mode or switches:
        set_attention_mode(model, a.mode, **switches)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    kw = _generate_kwargs(a, tok)
    _check_not_empty(prompts, tok)
    if a.seed is not None:
        torch.manual_seed(a.seed)
    n_new, t0, cache_bytes = 0, time.perf_counter(), None
    for i in range(0, len(prompts), a.batch_size):
        batch = prompts[i:i + a.batch_size]
        enc = tok(batch, return_tensors="pt", padding=True).to(device)
        stream = not a.no_stream and len(batch) == 1
        if stream:
            print(batch[0], end="", file=out, flush=True)
        streamer = _Streamer(tok, out) if stream else None
        with torch.no_grad():
            res = model.generate(**enc, **kw, streamer=streamer, return_dict_in_generate=True)
        seqs = res.sequences[:, enc["input_ids"].shape[1]:]
        n_new += int((seqs != tok.pad_token_id).sum()) if tok.pad_token_id is not None \
            else seqs.numel()
        cache = generated_cache(res)
        if isinstance(cache, HybridCache):
            cache_bytes = cache.state_bytes()
        if not stream:
            for prompt, s in zip(batch, seqs):
                print(prompt + tok.decode(s, skip_special_tokens=True), file=out)
        print(file=out)
    dt = time.perf_counter() - t0
    kind = (f"HybridCache, {cache_bytes / 2**20:.2f} MiB for the last batch"
            if cache_bytes is not None else "full KV cache")
    print(f"[{len(prompts)} prompt(s), {n_new} new tokens in {dt:.1f} s "
          f"({n_new / max(dt, 1e-9):.1f} tokens/s); {kind}]", file=err)


def _check_not_empty(prompts: list[str], tok) -> None:
    """Each prompt gives at least one token (a tokenizer that adds BOS makes '' a valid
    prompt; one that adds nothing leaves nothing to continue)."""
    for i, prompt in enumerate(prompts, 1):
        if not tok(prompt)["input_ids"]:
            raise ValueError(f"prompt {i} is empty ({prompt!r} gives no token with this "
                             "tokenizer, which adds no BOS token): there is nothing to continue; "
                             "give some text")


class _Streamer(TextStreamer):
    """transformers' ``TextStreamer``, writing to ``out`` instead of stdout."""

    def __init__(self, tok, out) -> None:
        super().__init__(tok, skip_prompt=True, skip_special_tokens=True)
        self.out = out

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        print(text, end="", file=self.out, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hedgecats generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="*", help="prompt(s)")
    p.add_argument("--model", required=True,
                   help="hybrid directory, stage.pt / stage or run directory, or hub id")
    p.add_argument("--prompt-file", help="one prompt per line")
    p.add_argument("--mode", help=" | ".join(MODES))
    p.add_argument("--switch", action="append", default=[], metavar="NAME=VALUE",
                   help="a runtime switch, e.g. la_span=all, overlap=true, window=32 (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--num-beams", type=int, default=1)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="seed for sampling")
    p.add_argument("--batch-size", type=int, default=1, help="prompts generated together")
    p.add_argument("--no-stream", action="store_true", help="print each output when done")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--base-model", help="stage checkpoints: load the base model from here")
    p.add_argument("--tokenizer", help="tokenizer to use (default: the model's)")
    return p


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    if a.batch_size < 1 or a.max_new_tokens < 1 or a.num_beams < 1:
        print("hedgecats generate: --batch-size, --max-new-tokens and --num-beams must be >= 1",
              file=sys.stderr)
        return 2
    try:
        run(a)
    except (FileNotFoundError, ValueError, KeyError) as err:
        print(f"hedgecats generate: {err}", file=sys.stderr)
        return 2
    return 0
