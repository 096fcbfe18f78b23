"""Run each training stage a few steps on a Llama-3-8B-shaped model with random weights.

    PYTHONPATH=/tmp/pkg python scripts/gpu_stages.py            # one GPU, bf16, T=1024
    python scripts/gpu_stages.py --tiny                          # CPU smoke test (seconds)

For AttentionTransfer and HybridFinetune: tokens/s (median step time after warm-up, all tokens
of the micro-batch) and peak GPU memory, through Lightning exactly as the pipelines run them
(bf16 base weights, fp32 feature maps / LoRA, bf16-mixed autocast; activation checkpointing in
stage 2; stage 1 backpropagates each layer's loss inside the forward). Results are printed and
written to ``$OUT/gpu_stages.json`` (or ``--out``). Nothing is downloaded: the model is built
from a ``LlamaConfig`` with random weights, the data is random tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from hedgecats.lightning_modules import AttentionTransfer, HybridFinetune
from hedgecats.models import convert_to_hybrid
from torch.utils.data import DataLoader, Dataset

LLAMA3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rope_theta": 500000.0}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 258,
        "max_position_embeddings": 1024}


def random_llama(shape: dict, dtype: torch.dtype, device: str):
    """A LlamaForCausalLM with random weights, built directly on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, tie_word_embeddings=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.config._attn_implementation = "sdpa"
    return model


class _RandomBase:
    """Mixin: build the base from a config instead of ``from_pretrained`` (no weights on disk)."""

    shape: dict = LLAMA3_8B
    dtype = torch.bfloat16
    device = "cuda"

    def _build_base(self):
        model = random_llama(self.shape, self.dtype, self.device)
        model.requires_grad_(False)
        convert_to_hybrid(model, self.hybrid_config)
        model.requires_grad_(False)
        return model

    def on_fit_end(self) -> None:  # nothing worth exporting
        pass


class BenchTransfer(_RandomBase, AttentionTransfer):
    pass


class BenchFinetune(_RandomBase, HybridFinetune):
    pass


class RandomTokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class StepTimer(pl.Callback):
    def __init__(self, tokens_per_step: int) -> None:
        self.tokens = tokens_per_step
        self.times: list[float] = []
        self.losses: list[float] = []

    def _sync(self, trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_start(self, trainer, pl_module) -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync(trainer)
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(trainer)
        self.times.append(time.perf_counter() - self.t0)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        print(f"  step {len(self.times)}: {self.times[-1]:.3f} s, loss {self.losses[-1]:.4f}",
              flush=True)


def run_stage(name: str, cls, args, shape: dict, device: str) -> dict:
    cls.shape, cls.device = shape, device
    cls.dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hybrid = {"window": args.window}
    common = {"model_name_or_path": f"random:{'llama3-8b' if shape is LLAMA3_8B else 'tiny'}",
              "hybrid": hybrid, "torch_dtype": "bfloat16" if device == "cuda" else None}
    if cls is BenchTransfer:
        module = cls(**common, objective=args.objective)
    else:
        module = cls(**common, activation_checkpointing=not args.no_checkpointing)
    steps = args.warmup + args.steps
    ds = RandomTokens(steps * args.micro_batch, args.seq_len, shape["vocab_size"])
    timer = StepTimer(args.micro_batch * args.seq_len)
    trainer = pl.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1,
                         precision="bf16-mixed" if device == "cuda" else "32-true",
                         max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[timer])
    t = time.perf_counter()
    trainer.fit(module, train_dataloaders=DataLoader(ds, batch_size=args.micro_batch))
    measured = timer.times[args.warmup:] or timer.times
    step_s = statistics.median(measured)
    res = {"stage": name, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
           "steps_timed": len(measured), "median_step_s": round(step_s, 4),
           "tokens_per_s": round(args.micro_batch * args.seq_len / step_s, 1),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
           if device == "cuda" else None,
           "losses": [round(x, 4) for x in timer.losses], "wall_s": round(time.perf_counter() - t, 1),
           "trainable_params": sum(p.numel() for p in module.model.parameters() if p.requires_grad)}
    del module, trainer
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 6; tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; tiny 1)")
    p.add_argument("--seq-len", type=int, default=None, help="T (default 1024; tiny 64)")
    p.add_argument("--micro-batch", type=int, default=None, help="B per step (default 4; tiny 2)")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--objective", default="weights_xent")
    p.add_argument("--stages", default="transfer,finetune")
    p.add_argument("--no-checkpointing", action="store_true", help="stage 2 without activation "
                   "checkpointing")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_stages.json)")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.steps = args.steps or (2 if tiny else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 2)
    args.seq_len = args.seq_len or (64 if tiny else 1024)
    args.micro_batch = args.micro_batch or (2 if tiny else 4)
    device = "cpu" if tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    shape = TINY if tiny else LLAMA3_8B
    stages = {"transfer": BenchTransfer, "finetune": BenchFinetune}
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "torch": torch.__version__, "model": "tiny" if tiny else "llama3-8b-shaped (random)",
               "command": " ".join(["python", "scripts/gpu_stages.py", *(argv or sys.argv[1:])]),
               "stages": []}
    for name in args.stages.split(","):
        if name not in stages:
            raise SystemExit(f"unknown stage {name!r}; valid: {', '.join(stages)}")
        print(f"== {name}: B={args.micro_batch} T={args.seq_len} on {results['device']}", flush=True)
        r = run_stage(name, stages[name], args, shape, device)
        print(f"   {r['tokens_per_s']} tokens/s, median step {r['median_step_s']} s, "
              f"peak {r['peak_mem_gib']} GiB", flush=True)
        results["stages"].append(r)
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "gpu_stages.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
