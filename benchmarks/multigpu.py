"""Stages 1 and 2 through FSDP2 (``ModelParallelStrategy``) on 1..N devices: throughput, peak
memory, loss curves, checkpoint resume, and loading the stage checkpoint on one device.

    # one GPU, then two, same global batch; then compare and load on one GPU
    NCCL_NVLS_ENABLE=0 python -m benchmarks.multigpu run --devices 1 --out r
    NCCL_NVLS_ENABLE=0 python -m benchmarks.multigpu run --devices 2 --out r
    python -m benchmarks.multigpu summarize --out r          # -> r/multigpu.json

``--tiny`` runs the same code on CPU (gloo) with a tiny model: the CI smoke test.
The base model is a Llama-3-8B-shaped model with random weights (the same seed on every rank),
built directly on the device: no hub, no 16 GB download. Data: random token ids, the same global
batches at every world size (DistributedSampler splits each global batch across ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from hedgecats.lightning_modules.stages import AttentionTransfer, HybridFinetune
from hedgecats.lightning_modules.strategies import ModelParallelStrategy
from hedgecats.models import HybridConfig, convert_to_hybrid
from hedgecats.models.stage_files import add_lora, load_tensors, read_stage
from torch.utils.data import DataLoader, Dataset

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def random_base(shape: dict, dtype: torch.dtype, hybrid: HybridConfig, device, seed: int = 0):
    """An untrained Llama of ``shape``, converted, everything frozen; identical on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape))
    finally:
        torch.set_default_dtype(old)
    model.requires_grad_(False)
    convert_to_hybrid(model, hybrid)
    for name in ("phi_q", "phi_k", "mixer"):  # one dtype per FSDP group
        for _, a in ((i, layer.self_attn) for i, layer in enumerate(model.model.layers)):
            getattr(a, name).to(dtype)
    model.requires_grad_(False)
    return model


class _RandomBase:
    """Mixin: build the base from ``shape`` instead of ``from_pretrained``."""

    shape: dict = LLAMA3_8B

    def _build_base(self):
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        if dev == "cuda":
            dev = f"cuda:{torch.cuda.current_device()}"
        return random_base(self.shape, torch.bfloat16 if dev != "cpu" else torch.float32,
                           self.hybrid_config, dev)


class Transfer(_RandomBase, AttentionTransfer):
    pass


class Finetune(_RandomBase, HybridFinetune):
    pass


class Tokens(Dataset):
    def __init__(self, n: int, T: int, vocab: int, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, T), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


class Meter(pl.Callback):
    """Per-step wall time (synchronised) and the loss averaged over ranks."""

    def __init__(self):
        self.times, self.losses = [], []

    def _sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._sync()
        self.times.append(time.perf_counter() - self.t0)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        loss = trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")
        self.losses.append(float(loss))


def run_stage(stage_cls, kwargs, *, devices, micro, global_batch, T, steps, root, accel,
              ckpt_path=None, vocab=None):
    meter = Meter()
    trainer = pl.Trainer(
        accelerator=accel, devices=devices, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1,
                                       **({"process_group_backend": "gloo"} if accel == "cpu" else {})),
        default_root_dir=str(root), num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[meter])
    module = stage_cls(**kwargs)
    n = global_batch * (steps + 2)
    loader = DataLoader(Tokens(n, T, vocab), batch_size=micro, shuffle=False)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return trainer, module, meter, peak


def cmd_run(a):
    accel = "cpu" if a.tiny else "gpu"
    shape = TINY if a.tiny else LLAMA3_8B
    _RandomBase.shape = shape
    T = 64 if a.tiny else a.seq_len
    micro = a.global_batch // a.devices
    if micro * a.devices != a.global_batch:
        raise SystemExit(f"--global-batch {a.global_batch} is not divisible by {a.devices} devices")
    hybrid = dict(window=16 if a.tiny else 64)
    out = Path(a.out)
    res = {"devices": a.devices, "global_batch": a.global_batch, "seq_len": T,
           "activation_checkpointing": a.activation_checkpointing,
           "micro_batch": micro, "shape": shape, "stages": {}}
    common = dict(model_name_or_path="random-llama3-8b-shape", hybrid=hybrid,
                  torch_dtype="bfloat16" if not a.tiny else None)
    stages = {
        "attention_transfer": (Transfer, dict(common, objective="weights_xent", lr=1e-2)),
        "hybrid_finetune": (Finetune, dict(common, lr=1e-4,
                                           activation_checkpointing=a.activation_checkpointing)),
    }
    for name, (cls, kw) in stages.items():
        root = out / f"ws{a.devices}" / name
        trainer, module, meter, peak = run_stage(cls, kw, devices=a.devices, micro=micro,
                                                 global_batch=a.global_batch, T=T, steps=a.steps,
                                                 root=root, accel=accel, vocab=shape["vocab_size"])
        warm = meter.times[a.warmup:] or meter.times
        step_s = statistics.median(warm)
        r = {"tokens_per_s": a.global_batch * T / step_s, "median_step_s": step_s,
             "peak_mem_gib_per_gpu": peak, "losses": meter.losses, "steps": len(meter.times)}
        if name == "hybrid_finetune":  # save, resume for 2 more steps at the same world size
            ckpt = root / "resume.ckpt"
            trainer.save_checkpoint(ckpt)
            t2, _, m2, _ = run_stage(cls, kw, devices=a.devices, micro=micro,
                                     global_batch=a.global_batch, T=T, steps=a.steps + 2,
                                     root=root, accel=accel, ckpt_path=str(ckpt),
                                     vocab=shape["vocab_size"])
            r["resume"] = {"from_step": trainer.global_step, "to_step": t2.global_step,
                           "losses_after_resume": m2.losses}
        res["stages"][name] = r
        if trainer.is_global_zero:
            print(f"[ws={a.devices}] {name}: {r['tokens_per_s']:.0f} tokens/s, step "
                  f"{step_s * 1e3:.0f} ms, peak {peak if peak is None else round(peak, 1)} GiB, "
                  f"losses {[round(x, 4) for x in meter.losses]}", flush=True)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("RANK", "0")) == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"ws{a.devices}.json").write_text(json.dumps(res, indent=1))


def cmd_summarize(a):
    out = Path(a.out)
    runs = {int(p.stem[2:]): json.loads(p.read_text()) for p in sorted(out.glob("ws*.json"))}
    if 1 not in runs:
        raise SystemExit(f"no ws1.json in {out}: run with --devices 1 first")
    summary = {"command": "benchmarks/multigpu.py", "world_sizes": {}}
    for ws, r in sorted(runs.items()):
        entry = {}
        for stage, s in r["stages"].items():
            base = runs[1]["stages"][stage]
            n = min(len(s["losses"]), len(base["losses"]))
            diffs = [abs(x - y) for x, y in zip(s["losses"][:n], base["losses"][:n])]
            entry[stage] = {
                "tokens_per_s": round(s["tokens_per_s"]),
                "scaling_efficiency": round(s["tokens_per_s"] / ws / base["tokens_per_s"], 4),
                "peak_mem_gib_per_gpu": s["peak_mem_gib_per_gpu"],
                "max_abs_loss_diff_vs_ws1": max(diffs) if diffs else None,
                "losses": s["losses"], **({"resume": s["resume"]} if "resume" in s else {}),
            }
        summary["world_sizes"][ws] = entry
    # the largest world size's stage-2 checkpoint, loaded into a one-device model
    ws_max = max(runs)
    stage_pt = out / f"ws{ws_max}" / "hybrid_finetune" / "stage.pt"
    if stage_pt.exists():
        payload = read_stage(stage_pt)
        shape = TINY if a.tiny else LLAMA3_8B
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        model = random_base(shape, torch.bfloat16 if dev == "cuda" else torch.float32,
                            HybridConfig.from_dict(payload["hybrid_config"]), dev)
        model = add_lora(model, payload["lora_config"])
        load_tensors(model, payload["tensors"], required=list(payload["tensors"]))
        ids = torch.randint(0, shape["vocab_size"], (1, 128), device=dev)
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss.item()
        summary["stage_checkpoint_on_one_device"] = {"path": str(stage_pt), "loss": loss,
                                                     "tensors": len(payload["tensors"])}
    (out / "multigpu.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({ws: {k: {m: v for m, v in e.items() if m in ("tokens_per_s",
                     "scaling_efficiency", "peak_mem_gib_per_gpu", "max_abs_loss_diff_vs_ws1")}
                          for k, e in ent.items()} for ws, ent in summary["world_sizes"].items()},
                     indent=1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--devices", type=int, default=1)
    r.add_argument("--global-batch", type=int, default=8)
    r.add_argument("--seq-len", type=int, default=1024)
    r.add_argument("--steps", type=int, default=8)
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--tiny", action="store_true", help="CPU, gloo, tiny model (smoke test)")
    r.add_argument("--activation-checkpointing", default="layer", choices=("layer", "mlp"),
                   help="stage 2's (HybridFinetune): whole decoder layers (true in YAML) or "
                   "only their MLP blocks")
    r.add_argument("--out", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("--out", required=True)
    s.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)
    {"run": cmd_run, "summarize": cmd_summarize}[a.cmd](a)


if __name__ == "__main__":
    main()
