"""Where stage 1's Lightning time goes: one GPU, Llama-3-8B shape (random bf16), B 8 x T 1024,
weights_xent (``--objective`` another); every variant in one process, median of --steps after --warmup, a JSON row written
after each variant (a run cut short keeps what it measured).

    source scripts/gpu_env.sh && python -m benchmarks.lightning_gap --out $OUT     (~4-6 min)
    python -m benchmarks.lightning_gap --tiny --out /tmp/g                            (CPU smoke)

Lightning (benchmarks.multigpu's Transfer):
  L0  as is: ModelParallelStrategy (FSDP2, ws 1), precision 32-true, bf16 maps, fused kernels
  L1  L0 under HEDGECATS_TRITON=0: blocked PyTorch xent + PyTorch maps, no autocast
  L1t L1 with TF32 matmuls (set_float32_matmul_precision('high')): how much of L1 is fp32 GEMMs
  L3  L0 without the 65 self.log calls per step (AttentionTransfer._log_losses)
  L4  L0 without FSDP2 (strategy 'auto': one device, manual_backward)
  L5  L3 + L4 (what is left: Lightning's loop)
  L6  the recipes' precision: bf16-mixed, fp32 maps (configs/pipelines/base/hedgecats.yaml)
stage_speed.transfer_step on one unsharded model (no Lightning):
  S0  bf16 autocast, fp32 maps (stage_speed's row)
  S1  S0 with the blocked xent (stage_speed.blocked_xent; the fused feature map stays, as in
      stage_speed's fixed '[blocked]' row)
  S2  no autocast, bf16 maps (Lightning L0's numerics without Lightning)
  S3  S2 under HEDGECATS_TRITON=0 (L1 without Lightning)
Profiles (--profile, default on): one step of L0 and of S0 under torch.profiler (top kernels,
GPU-busy share of the step, host-sync calls) and L0's synchronising calls
(torch.cuda.set_sync_debug_mode) with their call sites.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import torch
from hedgecats.lightning_modules.strategies import ModelParallelStrategy
from hedgecats.models.structure import unwrap
from hedgecats.models.ops.hybrid import backends
from torch.utils.data import DataLoader

from benchmarks import multigpu, stage_speed


# ----------------------------------------------------------------------------- Lightning variants
class LoopMeter(pl.Callback):
    """Step time from one batch's start to the next's (synchronised), so the whole loop is
    timed: data fetch, the batch's move to the device and Lightning's end-of-batch logging
    (which reads the progress-bar loss on the host) included, not only the training step as
    ``multigpu.Meter`` times it. The last step ends at ``on_train_end``."""

    def __init__(self):
        self.starts: list[float] = []
        self.end: float | None = None
        self._losses: list[torch.Tensor] = []

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(self._now())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._losses.append(loss.detach())  # read at the end: no host sync of ours per step

    def on_train_end(self, trainer, pl_module):
        self.end = self._now()

    @property
    def losses(self) -> list[float]:
        return [float(x) for x in self._losses]

    @property
    def times(self) -> list[float]:
        marks = self.starts + ([self.end] if self.end is not None else [])
        return [b - a for a, b in zip(marks, marks[1:])]


class NoLog(multigpu.Transfer):
    """``AttentionTransfer`` without its per-step ``self.log`` calls (the mean loss only)."""

    def _log_losses(self, prefix, losses, extras, on_step):
        return torch.stack([losses[i] for i in sorted(losses)]).mean()


class Fp32Maps(multigpu.Transfer):
    def _build_base(self):
        model = super()._build_base()
        for layer in model.model.layers:
            for name in ("phi_q", "phi_k", "mixer"):
                getattr(layer.self_attn, name).float()
        return model


class Probe(pl.Callback):
    """Profiles one loop iteration (``at``: from its batch start to the next one's, so
    Lightning's end-of-batch work is inside) and records the synchronising calls of the next
    iteration over the same span. Registered before the step timer, so its own work at a batch
    start lands before the timer's mark, in the two iterations that are not timed."""

    def __init__(self, at: int, cuda: bool):
        self.at, self.cuda, self.prof, self.result = at, cuda, None, {}
        self._w = None

    def _stop_profile(self):
        if self.prof is not None:
            self.result["profile"] = profile_stop(self.prof, self.cuda,
                                                  time.perf_counter() - self.t0)
            self.prof = None

    def _stop_sync_debug(self):
        if self._w is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._w.__exit__(None, None, None)
            self.result["sync_calls"] = sync_sites(self.records)
            self._w = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            self.t0 = time.perf_counter()
            self.prof = profile_start(self.cuda)
        elif batch_idx == self.at + 1:
            self._stop_profile()
            if self.cuda:
                torch.cuda.set_sync_debug_mode("warn")
                self._w = warnings.catch_warnings(record=True)
                self.records = self._w.__enter__()
                warnings.simplefilter("always")
        elif batch_idx == self.at + 2:
            self._stop_sync_debug()

    def on_train_end(self, trainer, pl_module):
        self._stop_profile()
        self._stop_sync_debug()


def lightning_variant(cls, a, *, strategy="fsdp2", precision="32-true", probe=False):
    cuda = torch.cuda.is_available() and not a.tiny
    accel = "gpu" if cuda else "cpu"
    if strategy == "fsdp2":
        strat = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1,
                                      **({} if cuda else {"process_group_backend": "gloo"}))
    else:
        strat = "auto"
    meter = LoopMeter()
    pr = Probe(a.warmup, cuda) if probe else None
    callbacks = ([pr] if pr else []) + [meter]  # the probe first: its work before the marks
    steps = a.warmup + a.steps + (2 if probe else 0)
    trainer = pl.Trainer(accelerator=accel, devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, strategy=strat, precision=precision,
                         default_root_dir=str(Path(a.out) / "lt"), num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=callbacks)
    module = cls(model_name_or_path="random-llama3-8b-shape", hybrid=dict(window=a.window),
                 torch_dtype="bfloat16" if cuda else None, objective=a.objective, lr=1e-2)
    vocab = multigpu._RandomBase.shape["vocab_size"]
    loader = DataLoader(multigpu.Tokens(a.batch * (steps + 2), a.seq_len, vocab),
                        batch_size=a.batch, shuffle=False)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    trainer.fit(module, train_dataloaders=loader)
    times = meter.times[a.warmup:a.warmup + a.steps]
    if probe:  # the profiled / sync-debug steps are not timed
        times = meter.times[a.warmup + 2:]
    row = timing(times, a)
    row.update(all_steps_s=[round(t, 4) for t in meter.times], fit_s=round(time.time() - t0, 1),
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               precision_plugin=type(trainer.precision_plugin).__name__,
               strategy=type(trainer.strategy).__name__,
               map_dtype=str(next(p for n, p in unwrap(module.model).named_parameters()
                                  if ".phi_q." in n).dtype),
               losses=[round(x, 4) for x in meter.losses])
    if pr:
        row.update(pr.result)
    del trainer, module
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------- stage_speed variants
class _Bench(stage_speed.Bench):
    def __init__(self, a, autocast: bool):
        super().__init__(SimpleNamespace(tiny=a.tiny, warmup=a.warmup, steps=a.steps))
        self._autocast = autocast

    def autocast(self):
        return super().autocast() if self._autocast else contextlib.nullcontext()


def stage_speed_model(a):
    from hedgecats.models import HybridConfig, convert_to_hybrid

    dev = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
    shape = dict(multigpu._RandomBase.shape)
    model = stage_speed.random_llama(shape, torch.bfloat16 if dev == "cuda" else torch.float32,
                                     dev)
    model.requires_grad_(False)
    convert_to_hybrid(model, HybridConfig(window=a.window, seed=0))
    model.requires_grad_(False)
    phi = [p for n, p in model.named_parameters() if ".phi_q." in n or ".phi_k." in n]
    for p in phi:
        p.requires_grad_(True)
    model.eval()
    ids = torch.randint(0, shape["vocab_size"], (a.batch, a.seq_len),
                        generator=torch.Generator().manual_seed(1)).to(dev)
    return model, phi, ids


def stage_speed_variant(model, phi, ids, a, *, autocast: bool, probe=False):
    bench = _Bench(a, autocast)
    opt = torch.optim.AdamW(phi, lr=1e-3)

    def step():
        return stage_speed.transfer_step(model, opt, ids, bench, a.objective)

    row = {}
    if probe:
        step()
        bench.sync()
        t0 = time.perf_counter()
        prof = profile_start(bench.cuda)
        step()
        bench.sync()
        row["profile"] = profile_stop(prof, bench.cuda, time.perf_counter() - t0)
    r = bench.measure(step, ids.numel())
    row.update(timing(r["step_s_all"], a), peak_gib=r["peak_gib"], last_loss=r["last_loss"],
               map_dtype=str(phi[0].dtype), autocast=autocast)
    for p in phi:
        p.grad = None
    return row


# ----------------------------------------------------------------------------- helpers
def timing(times, a):
    s = statistics.median(times) if times else float("nan")
    return {"median_step_s": round(s, 4), "tokens_per_s": round(a.batch * a.seq_len / s, 1),
            "steps_s": [round(t, 4) for t in times]}


def profile_start(cuda):
    acts = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=acts)
    prof.__enter__()
    return prof


def profile_stop(prof, cuda, wall_s):
    if cuda:
        torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    ev = prof.key_averages()
    dev_total = gpu_busy_s(prof) if cuda else None
    syncs = {e.key: {"calls": e.count, "cpu_ms": round(e.cpu_time_total / 1e3, 2)}
             for e in ev if "Synchronize" in e.key or e.key in ("cudaMemcpyAsync", "aten::item",
                                                               "aten::_local_scalar_dense")}
    launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                   "cuLaunchKernelEx", "cudaLaunchKernelExC"))
    top = sorted(ev, key=lambda e: -(e.self_device_time_total if cuda else e.self_cpu_time_total))
    return {"wall_s": round(wall_s, 4),
            "gpu_busy_s": None if dev_total is None else round(dev_total, 4),
            "gpu_busy_share": None if dev_total is None else round(dev_total / wall_s, 3),
            "kernel_launches": launches, "sync_events": syncs,
            "cpu_self_s": round(sum(e.self_cpu_time_total for e in ev) / 1e6, 4),
            "top": [{"name": e.key[:90], "calls": e.count,
                     "self_dev_ms": round(e.self_device_time_total / 1e3, 2) if cuda else None,
                     "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in top[:18]]}


def gpu_busy_s(prof):
    """Union of the device events' time ranges (kernels, memcpy, memset): the GPU-busy time."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, cur_s, cur_e = 0.0, None, None
    for s_, e_ in spans:
        if cur_e is None or s_ > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s_, e_
        else:
            cur_e = max(cur_e, e_)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / 1e6


def sync_sites(records):
    sites = collections.Counter()
    for w in records:
        if "synchroniz" not in str(w.message).lower():
            continue
        sites[f"{Path(w.filename).name}:{w.lineno}"] += 1  # the Python line that synchronised
    return {"total": sum(sites.values()), "sites": sites.most_common(12)}


VARIANTS = {
    "L0": ("lightning as multigpu.py runs it", lambda a: lightning_variant(
        multigpu.Transfer, a, probe=a.profile)),
    "L1": ("L0, HEDGECATS_TRITON=0 (blocked xent, PyTorch maps, fp32 GEMMs: the 11-29 path)",
           lambda a: with_triton_off(lambda: lightning_variant(multigpu.Transfer, a))),
    "L1t": ("L1 with torch.set_float32_matmul_precision('high') (TF32): the fp32 GEMMs' share",
            lambda a: with_tf32(lambda: with_triton_off(
                lambda: lightning_variant(multigpu.Transfer, a)))),
    "L3": ("L0 without self.log", lambda a: lightning_variant(NoLog, a)),
    "L4": ("L0 without FSDP2 (strategy auto)",
           lambda a: lightning_variant(multigpu.Transfer, a, strategy="auto")),
    "L5": ("L0 without self.log and FSDP2",
           lambda a: lightning_variant(NoLog, a, strategy="auto")),
    "L6": ("L0 with bf16-mixed and fp32 maps (the recipes)",
           lambda a: lightning_variant(Fp32Maps, a, precision="bf16-mixed")),
}
S_VARIANTS = {
    "S0": "stage_speed: autocast bf16, fp32 maps (stage_speed.md's row)",
    "S1": "S0 with the blocked xent (fused maps kept)",
    "S2": "stage_speed: no autocast, bf16 maps (L0's numerics)",
    "S3": "S2 with HEDGECATS_TRITON=0 (blocked xent, fp32 GEMMs, no Lightning)",
}


def with_tf32(fn):
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        return fn()
    finally:
        torch.set_float32_matmul_precision(old)


def with_triton_off(fn):
    with backends.triton_disabled():
        return fn()


#: (label, a, b): step-time differences a - b that separate the causes (module docstring)
READINGS = [("Lightning's cost at HEAD (L0 - S2)", "L0", "S2"),
            ("... of it, self.log (L0 - L3)", "L0", "L3"),
            ("... of it, FSDP2 at one GPU (L0 - L4)", "L0", "L4"),
            ("Lightning's cost on the 11-29 path (L1 - S3)", "L1", "S3"),
            ("the code path since 11-29 (L1 - L0)", "L1", "L0"),
            ("... of it, fp32 GEMMs (L1 - L1t)", "L1", "L1t"),
            ("autocast against bf16 maps without it (S0 - S2)", "S0", "S2")]


def markdown(res: dict) -> str:
    """The rows and the differences that read them, as a table."""
    rows = res["rows"]
    lines = ["# Stage 1 through Lightning against the stage harness", "",
             f"`{res['command']}`  ",
             f"{res['env']}; {res.get('objective', 'weights_xent')}, B {res['batch']} x "
             f"T {res['seq_len']}, "
             f"median of {res['steps']} steps after {res['warmup']}.", "",
             "| row | what | tokens/s | step ms | peak GiB | GPU busy share |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | {r['what']} | error: {r['error'][:120]} | | | |")
            continue
        busy = (r.get("profile") or {}).get("gpu_busy_share")
        peak = r.get("peak_gib")
        lines.append(f"| {name} | {r['what']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['median_step_s'] * 1e3:.1f} | "
                     f"{'' if peak is None else f'{peak:.1f}'} | {'' if busy is None else busy} |")
    lines += ["", "| reading | step ms |", "| --- | ---: |"]
    for label, x, y in READINGS:
        if all(k in rows and "error" not in rows[k] for k in (x, y)):
            d = (rows[x]["median_step_s"] - rows[y]["median_step_s"]) * 1e3
            lines.append(f"| {label} | {d:+.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 6; tiny 2)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--only", default=None, help="comma list of variant names (default: all)")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--objective", default="weights_xent",
                   choices=("weights_xent", "la_output_mse", "hybrid_output_mse"),
                   help="stage 1's objective, in every variant (default weights_xent)")
    a = p.parse_args(argv)
    a.steps = a.steps or (2 if a.tiny else 6)
    a.seq_len = a.seq_len or (64 if a.tiny else 1024)
    a.window = a.window or (16 if a.tiny else 64)
    multigpu._RandomBase.shape = multigpu.TINY if a.tiny else multigpu.LLAMA3_8B
    if a.tiny:
        a.warmup = min(a.warmup, 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    only = None if a.only is None else set(a.only.split(","))
    env = {"torch": torch.__version__, "lightning": pl.__version__,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "triton_enabled": backends.triton_enabled(),
           "fp32_matmul_precision": torch.get_float32_matmul_precision()}
    res = {"command": " ".join(["python", "-m", "benchmarks.lightning_gap", *(argv or sys.argv[1:])]),
           "env": env, "objective": a.objective, "batch": a.batch, "seq_len": a.seq_len, "steps": a.steps,
           "warmup": a.warmup, "rows": {}}

    def save():
        (out / "lightning_gap.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        (out / "lightning_gap.md").write_text(markdown(res))

    def attempt(name, desc, fn):
        t0 = time.time()
        try:
            row = fn()
        except Exception as e:  # a failed variant is a finding; go on with the others
            row = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-1500:]}
        row = {"what": desc, **row, "variant_s": round(time.time() - t0, 1)}
        res["rows"][name] = row
        save()
        msg = row.get("error") or f"{row['tokens_per_s']:>10,.0f} tokens/s  step " \
            f"{row['median_step_s'] * 1e3:8.1f} ms"
        print(f"{name}  {msg}   ({desc})", flush=True)
        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()

    # the core rows first (a run cut short keeps them); the stage_speed model is built for the
    # first S row and freed after the last one
    order = ["L0", "L1", "S0", "S1", "S2", "S3", "L1t", "L3", "L4", "L5", "L6"]
    todo = [n for n in order if only is None or n in only]
    s_left = [n for n in todo if n in S_VARIANTS]
    sm = None
    for name in todo:
        if torch.cuda.is_available():
            res.setdefault("allocated_gib_before", {})[name] = round(
                torch.cuda.memory_allocated() / 2**30, 2)
        if name in VARIANTS:
            desc, fn = VARIANTS[name]
            attempt(name, desc, lambda fn=fn: fn(a))
            continue
        if sm is None:
            sm = stage_speed_model(a)
        model, phi, ids = sm
        if name in ("S2", "S3") and phi[0].dtype != torch.bfloat16:
            for p_ in phi:
                p_.data = p_.data.to(torch.bfloat16)
        ctx = {"S1": stage_speed.blocked_xent, "S3": backends.triton_disabled}.get(
            name, contextlib.nullcontext)
        with ctx():
            attempt(name, S_VARIANTS[name], lambda n=name: stage_speed_variant(
                model, phi, ids, a, autocast=n in ("S0", "S1"), probe=a.profile and n == "S0"))
        s_left.remove(name)
        if not s_left:
            del model, phi, ids
            sm = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
