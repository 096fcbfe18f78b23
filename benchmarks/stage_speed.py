"""Stage throughput on one GPU (issue 12 item 1): tokens/s, step time and peak memory of the
teacher's forward, stage 1 with each objective and stage 2, in one run.

    python -m benchmarks.stage_speed --out DIR              # 8B shape, T 1k and 4k (one GPU)
    python -m benchmarks.stage_speed --tiny --out DIR       # CPU smoke run

The model is a Llama-3-8B-shaped ``LlamaForCausalLM`` with random weights in bf16 (no hub), built
once and converted (window 64, the default mixer and feature maps); every measurement runs on it
under bf16 autocast, 8,192 tokens per step (B=8 at T=1024, B=2 at T=4096), the median of
``--steps`` steps after ``--warmup``, synchronised host timing (a step is many kernels and an
optimiser step), peak memory over the timed steps.

    teacher_forward          the model in softmax mode, no grad, LM head on one position: what
                             stage 1 runs to get the teacher's q, k, v
    transfer/<objective>     stage 1 as ``AttentionTransfer`` runs it: the teacher forward with an
                             observer that computes each layer's loss (``ops.transfer.
                             transfer_loss``) and backpropagates it at once, then AdamW on the
                             feature maps. ``weights_xent`` runs the blocked PyTorch version
                             (``[blocked]``) and the fused kernel (``[fused]``, ops.triton_xent,
                             patched in for this row); ``la_output_mse`` takes the fused hybrid
                             kernel (la_only, every causal key)
    transfer/lolcats_tt      hybrid_output_mse with a LoLCATs-style materialised T x T student
    finetune/hybrid          stage 2: peft LoRA (r 8 on q, k, v, o), activation checkpointing,
                             next-token loss, the layers in hybrid mode (SSD off)
    finetune/softmax         the same LoRA step with the layers in softmax mode
    finetune/hybrid [kl]     the same LoRA step with stage 2's KL objective, as
                             ``HybridFinetune(loss="kl")`` computes it (its ``_objective``):
                             the teacher's forward (softmax mode, adapters off, no grad), then
                             the student's, the exact KL chunked over positions (issue 48: >=
                             0.8x the tokens/s of ``finetune/hybrid``, its peak memory beside)
    finetune/hybrid [kl top-k]   the same with ``kl_topk`` (the teacher's 64 most likely tokens
                             and one bucket; shortest T)
    finetune/<mode> [no checkpointing], [mlp checkpointing]   both modes without activation
                             checkpointing, and with only the MLP blocks checkpointed
                             (``activation_checkpointing="mlp"``; shortest T)
    <...> [recomputed]       the same with ``KernelConfig.save_branches`` off (the backward
                             recomputes both branches: less memory, more time)
    <...> [overlap]          the same with each layer's student on a side stream beside the
                             teacher forward (``AttentionTransfer(overlap_student=True)``)
    <...> [pytorch phi]      the same with the feature maps' PyTorch path (the fused map is
                             the modules' default on CUDA)

Results: ``stage_speed.json`` and ``stage_speed.md`` in ``--out``, and the issue's ratios in
``--summary`` (default ``<out>/summary.json``, merged with attention_speed's). ``--profile``
adds torch.profiler tables (top CUDA kernels) of one step each: stage 1 (fused xent, output
MSE) and, at the shortest length, stage 2 in hybrid and in softmax mode (where the LoRA gap
goes) and with the KL. Every row runs in its own try block: a failure is a row with an ``error``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from hedgecats.lightning_modules.student_stream import StudentStream
from hedgecats.models import HybridConfig, convert_to_hybrid, hybrid_layers, set_attention_mode
from hedgecats.models.feature_maps import HedgehogFeatureMap as _FM_CLASS
from hedgecats.models.ops.transfer import losses as transfer

from benchmarks.layer import default_tiles_changed, materialised_hybrid
from benchmarks.summary import update_summary

LLAMA3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rope_theta": 500000.0}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 258,
        "max_position_embeddings": 1024}
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
#: the teacher's tokens kept by the ``[kl top-k]`` row (docs/method.md's worked example)
KL_TOPK = 64


def random_llama(shape: dict, dtype: torch.dtype, device: str):
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


class Bench:
    def __init__(self, a):
        self.a = a
        self.device = "cpu" if a.tiny else "cuda"
        self.cuda = self.device == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else \
            contextlib.nullcontext()

    def measure(self, step, tokens: int) -> dict:
        """Median seconds of ``step()`` over ``--steps`` after ``--warmup``; peak memory."""
        for _ in range(self.a.warmup):
            step()
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(self.a.steps):
            t0 = time.perf_counter()
            loss = step()
            self.sync()
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None
        return {"step_s": round(s, 5), "tokens_per_s": round(tokens / s, 1),
                "step_s_all": [round(t, 5) for t in times], "peak_gib": peak,
                "last_loss": None if loss is None else float(loss)}


# ----------------------------------------------------------------------------- stage steps
def _loss_of(res):
    return res[0] if isinstance(res, tuple) else res


def transfer_step(model, opt, ids, bench: Bench, objective: str, students=None):
    """One AttentionTransfer step: teacher forward, per-layer loss backpropagated at once;
    with ``students`` (a ``StudentStream``) each layer's student on its side stream, as
    ``AttentionTransfer(overlap_student=True)`` runs it."""
    layers = list(hybrid_layers(model))
    n = len(layers)
    params = inspect.signature(transfer.transfer_loss).parameters
    takes_hidden = "hidden_states" in params
    losses = []

    def observer(module, query, key, value, key_padding_mask, *rest, teacher_output=None):
        side = contextlib.nullcontext() if students is None else students.layer(
            query, key, value, key_padding_mask, *rest, teacher_output)
        with side, torch.enable_grad():
            extra = {"hidden_states": rest[0] if rest else None} if takes_hidden else {}
            if teacher_output is not None:
                extra["teacher_output"] = teacher_output
            loss = _loss_of(transfer.transfer_loss(objective, module, query, key, value,
                                                   key_padding_mask, **extra))
            (loss / n).backward()
        losses.append(loss.detach())

    # as AttentionTransfer: the output-MSE objectives take the teacher forward's own output
    observer.wants_teacher_output = "teacher_output" in params and objective != "weights_xent"
    set_attention_mode(model, "softmax", observer=observer)
    try:
        with torch.no_grad(), bench.autocast():
            model(input_ids=ids, logits_to_keep=1)
    finally:
        set_attention_mode(model, observer=None)
        if students is not None:
            students.join()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return torch.stack(losses).mean()


def teacher_step(model, ids, bench: Bench):
    set_attention_mode(model, "softmax")
    with torch.no_grad(), bench.autocast():
        model(input_ids=ids, logits_to_keep=1)


def finetune_step(peft_model, inner, opt, ids, bench: Bench, mode: str):
    set_attention_mode(inner, mode)
    with bench.autocast():
        loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def distilling_stage(peft_model, kl_topk: int | None = None):
    """A ``HybridFinetune(loss="kl")`` holding ``peft_model`` (LoRA on, feature maps frozen)
    as its model, as ``configure_model`` leaves it: the stage's own objective runs on the
    benchmark's model, and its start-of-fit checks (what the teacher would read, ``kl_topk``
    against the vocabulary) are made here."""
    from hedgecats.lightning_modules.stages import HybridFinetune

    stage = HybridFinetune("random weights (benchmarks.stage_speed)", loss="kl", kl_topk=kl_topk)
    stage._check_teacher_trainables(peft_model)
    stage.model = peft_model
    return stage


def kl_finetune_step(stage, inner, opt, ids, bench: Bench):
    """One stage-2 step by distillation: ``stage._objective`` (the teacher's forward, the
    student's, the KL), backward, AdamW; the layers in hybrid mode."""
    set_attention_mode(inner, "hybrid")
    with bench.autocast():
        loss, _ = stage._objective({"input_ids": ids})
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def pytorch_phi(self, *args, **kwargs):
    """HedgehogFeatureMap._fused (and kernel_form) declining every call: the module's PyTorch
    path, the maps not folded into the fused hybrid's Function either."""
    return None


@contextlib.contextmanager
def pytorch_maps():
    """The feature maps on their PyTorch path for the block (``pytorch_phi``)."""
    with patched(_FM_CLASS, "_fused", pytorch_phi), patched(_FM_CLASS, "kernel_form",
                                                            pytorch_phi):
        yield


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def blocked_xent():
    """Inside, ``transfer_loss`` runs the blocked PyTorch ``weights_xent`` even where it would
    take the fused kernel (CUDA with Triton): the ``[blocked]`` row (without the patch it would
    measure the fused kernel a second time)."""
    from hedgecats.models.ops.transfer import dispatch as triton_xent

    with patched(triton_xent, "weights_xent", transfer.weights_xent):
        yield


@contextlib.contextmanager
def recomputed_branches():
    """The fused hybrid kernel's default tiles without ``save_branches`` (the backward
    recomputes both branches instead of reading the forward's stored ones): the
    ``[recomputed]`` rows, set against the default rows of the same run."""
    with default_tiles_changed({"save_branches": False}):
        yield


def materialised_student(q, k, v, fq, fk, *, window, mode="hybrid", g=0.5, shared_norm=False,
                         overlap=False, key_padding_mask=None, scale=None, eps=None,
                         backend="auto", maps=None, **_):
    """``hybrid_attention``'s signature, computed LoLCATs-style with T x T scores, for the calls
    stage 1 makes with ``hybrid_output_mse`` (mode hybrid, no overlap, no padding); anything
    else is refused rather than computed as something else. ``maps`` (stage 1 hands over the
    modules): fq = phi_q(q), fk = phi_k(k) first."""
    if fq is None and maps is not None:
        fq, fk = maps[0](q), maps[1](k)
    if mode != "hybrid" or overlap or key_padding_mask is not None:
        raise NotImplementedError(f"the materialised student computes mode 'hybrid' without "
                                  f"overlap or padding; got mode={mode!r}, overlap={overlap!r}, "
                                  f"padding={key_padding_mask is not None}")
    kw = {} if eps is None else {"eps": eps}
    return materialised_hybrid(q, k, v, fq, fk, window=window, g=g, shared_norm=shared_norm,
                               scale=scale, **kw)


# ----------------------------------------------------------------------------- the run
def run(a, on_row=None) -> dict:
    bench = Bench(a)
    dev = bench.device
    shape = TINY if a.tiny else LLAMA3_8B
    dtype = torch.float32 if a.tiny else torch.bfloat16
    t0 = time.time()
    model = random_llama(shape, dtype, dev)
    model.requires_grad_(False)
    convert_to_hybrid(model, HybridConfig(window=a.window, seed=0))
    model.requires_grad_(False)
    phi = [p for name, p in model.named_parameters()
           if ".phi_q." in name or ".phi_k." in name]
    for p in phi:
        p.requires_grad_(True)
    build_s = time.time() - t0
    rows = []

    def log(row):
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        if "error" in row:
            print(f"T={row['T']:5d} {row['name']:32s} ERROR {row['error']}", flush=True)
        else:
            peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f} GiB"
            print(f"T={row['T']:5d} {row['name']:32s} {row['tokens_per_s']:>12,.0f} tokens/s  "
                  f"step {row['step_s'] * 1e3:8.1f} ms  peak {peak}", flush=True)

    def attempt(name, T, fn):
        if bench.cuda:
            torch.cuda.empty_cache()
        try:
            row = {"name": name, "T": T, **fn()}
        except Exception as e:  # a failing row is a finding, not the end of the run
            row = {"name": name, "T": T, "error": f"{type(e).__name__}: {e}"[:600],
                   "traceback": traceback.format_exc()[-1500:]}
            for p in phi:
                p.grad = None
        log(row)

    def has_triton():
        from hedgecats.models.ops.hybrid import backends

        return backends.available("triton")

    profile = []
    for T in (int(t) for t in a.seq_lens.split(",")):
        B = max(1, a.tokens // T)
        tokens = B * T
        gen = torch.Generator().manual_seed(T)
        ids = torch.randint(0, shape["vocab_size"], (B, T), generator=gen).to(dev)
        opt = torch.optim.AdamW(phi, lr=1e-3)
        model.eval()  # no dropout; SSD off in stage 1 (softmax mode) anyway
        attempt("teacher_forward", T, lambda: bench.measure(lambda: teacher_step(model, ids, bench),
                                                             tokens))
        variants = []
        if T <= a.blocked_xent_max_t:
            variants.append(("transfer/weights_xent [blocked]", "weights_xent", blocked_xent))
        if has_triton():
            from hedgecats.models.ops.transfer import dispatch as triton_xent

            variants.append(("transfer/weights_xent [fused]", "weights_xent",
                             ("weights_xent", triton_xent.weights_xent)))
        short = T == min(int(t) for t in a.seq_lens.split(","))
        if short or a.all_rows:  # the long length needs only what transfer_vs_lolcats_T4k reads
            variants.append(("transfer/la_output_mse", "la_output_mse", None))
        variants.append(("transfer/hybrid_output_mse", "hybrid_output_mse", None))
        if T <= a.lolcats_max_t:
            variants.append(("transfer/lolcats_tt", "hybrid_output_mse",
                             ("hybrid_attention", materialised_student)))
        if has_triton() and short:
            from hedgecats.models.ops.transfer import dispatch as triton_xent

            # the feature maps' PyTorch path too (the fused map is the default)
            variants.append(("transfer/weights_xent [fused, pytorch phi]", "weights_xent",
                             ("weights_xent", triton_xent.weights_xent), True))
            variants.append(("transfer/hybrid_output_mse [pytorch phi]", "hybrid_output_mse",
                             None, True))
            variants.append(("transfer/hybrid_output_mse [recomputed]", "hybrid_output_mse",
                             recomputed_branches))
            # each layer's student on a side stream beside the teacher (overlap_student)
            variants.append(("transfer/weights_xent [fused, overlap]", "weights_xent",
                             ("weights_xent", triton_xent.weights_xent), False, True))
            variants.append(("transfer/hybrid_output_mse [overlap]", "hybrid_output_mse",
                             None, False, True))
        for name, objective, patch, *flags in variants:
            torch_phi, overlap = (list(flags) + [False, False])[:2]

            def fn(objective=objective, patch=patch, torch_phi=torch_phi, overlap=overlap):
                with contextlib.ExitStack() as stack:
                    if callable(patch):  # a context of its own (blocked_xent)
                        stack.enter_context(patch())
                    elif patch:
                        stack.enter_context(patched(transfer, *patch))
                    if torch_phi:
                        stack.enter_context(pytorch_maps())
                    students = StudentStream(dev) if overlap else None
                    return bench.measure(lambda: transfer_step(model, opt, ids, bench, objective,
                                                               students), tokens)
            attempt(name, T, fn)
        if a.profile and not profile and has_triton():
            from hedgecats.models.ops.transfer import dispatch as triton_xent

            with patched(transfer, "weights_xent", triton_xent.weights_xent):
                profile.append(profile_step(lambda: transfer_step(model, opt, ids, bench,
                                                                  "weights_xent"), T, bench,
                                            "transfer/weights_xent [fused]"))
            profile.append(profile_step(lambda: transfer_step(model, opt, ids, bench,
                                                              "hybrid_output_mse"), T, bench,
                                        "transfer/hybrid_output_mse"))
    # stage 2 on the same model: LoRA added once (it cannot be taken off)
    from hedgecats.models.stage_files import add_lora

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for p in phi:
        p.requires_grad_(False)
    peft_model = add_lora(model, LORA)
    peft_model.train()
    lora = [p for p in peft_model.parameters() if p.requires_grad]
    for T in (int(t) for t in a.seq_lens.split(",")):
        B = max(1, a.tokens // T)
        gen = torch.Generator().manual_seed(T + 1)
        ids = torch.randint(0, shape["vocab_size"], (B, T), generator=gen).to(dev)
        opt = torch.optim.AdamW(lora, lr=1e-4)
        for mode in ("hybrid", "softmax"):
            attempt(f"finetune/{mode}", T, lambda mode=mode: bench.measure(
                lambda: finetune_step(peft_model, model, opt, ids, bench, mode), B * T))
        # stage 2 by distillation: the exact KL at every length, the top-k KL at the shortest
        short = T == min(int(t) for t in a.seq_lens.split(","))
        for name, topk in [("finetune/hybrid [kl]", None)] + \
                ([("finetune/hybrid [kl top-k]", KL_TOPK)] if short else []):
            def kl_row(topk=topk):
                stage = distilling_stage(peft_model, topk)
                return bench.measure(lambda: kl_finetune_step(stage, model, opt, ids, bench),
                                     B * T)
            attempt(name, T, kl_row)
        if has_triton() and T == min(int(t) for t in a.seq_lens.split(",")):
            for tag, variant in (("pytorch phi", pytorch_maps),
                                 ("recomputed", recomputed_branches)):
                def row(variant=variant):
                    with variant():
                        return bench.measure(lambda: finetune_step(
                            peft_model, model, opt, ids, bench, "hybrid"), B * T)
                attempt(f"finetune/hybrid [{tag}]", T, row)
        if T == min(int(t) for t in a.seq_lens.split(",")):
            # both modes without activation checkpointing, and with only the MLP blocks
            # checkpointed (HybridFinetune(activation_checkpointing="mlp"))
            from hedgecats.models.activation_checkpointing import checkpoint_mlps, uncheckpoint_mlps

            model.gradient_checkpointing_disable()
            try:
                for tag, mlps in (("no checkpointing", False), ("mlp checkpointing", True)):
                    if mlps:
                        checkpoint_mlps(model)
                    for mode in ("hybrid", "softmax"):
                        attempt(f"finetune/{mode} [{tag}]", T,
                                lambda mode=mode: bench.measure(lambda: finetune_step(
                                    peft_model, model, opt, ids, bench, mode), B * T))
            finally:
                uncheckpoint_mlps(model)
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
        if a.profile and T == min(int(t) for t in a.seq_lens.split(",")):
            # where stage 2's gap to the softmax LoRA step goes, kernel by kernel
            for mode in ("hybrid", "softmax"):
                profile.append(profile_step(lambda mode=mode: finetune_step(
                    peft_model, model, opt, ids, bench, mode), T, bench, f"finetune/{mode}"))
            stage = distilling_stage(peft_model)
            profile.append(profile_step(lambda: kl_finetune_step(stage, model, opt, ids, bench),
                                        T, bench, "finetune/hybrid [kl]"))
    return {"rows": rows, "build_s": round(build_s, 1), "profile": profile,
            "trainable": {"feature_maps": sum(p.numel() for p in phi),
                          "lora": sum(p.numel() for p in lora)}}


def profile_step(step, T, bench: Bench, name: str):
    """Where one step's time goes (CUDA kernels, top 25)."""
    if not bench.cuda:
        return None
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(f"== profile of one {name} step, T={T}\n{table}", flush=True)
    ev = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:25]
    return {"name": name, "T": T, "kernels": [{"name": e.key[:120], "cuda_ms": round(e.device_time_total / 1e3,
                                                                       3), "calls": e.count}
                                for e in ev]}


def _row(rows, name, T):
    for r in rows:
        if r["name"] == name and r["T"] == T and "tokens_per_s" in r:
            return r
    return None


def ratios(rows, short: int = 1024, long: int | None = 4096) -> dict:
    """The issue's ratios at the short (1k) and long (4k) sequence lengths; ``long`` None: no
    long length was run (``transfer_vs_lolcats_T4k`` is then None, not a ratio at another T)."""
    def tps(name, T):
        r = _row(rows, name, T)
        return None if r is None else r["tokens_per_s"]

    def div(x, y):
        return None if x is None or y is None else round(x / y, 4)

    teacher = tps("teacher_forward", short)
    xent = tps("transfer/weights_xent [fused]", short) or \
        tps("transfer/weights_xent [blocked]", short)
    mse = [v for v in (tps("transfer/la_output_mse", short),
                       tps("transfer/hybrid_output_mse", short)) if v is not None]
    peaks = [r["peak_gib"] for r in rows if r["name"].startswith("transfer/")
             and "lolcats" not in r["name"] and r.get("peak_gib") is not None]
    tf = _row(rows, "teacher_forward", short)
    lora, kl = _row(rows, "finetune/hybrid", short), _row(rows, "finetune/hybrid [kl]", short)
    return {
        "transfer_xent_vs_teacher_forward": div(xent, teacher),
        "transfer_mse_vs_teacher_forward": div(min(mse) if mse else None, teacher),
        "lora_vs_softmax_lora": div(tps("finetune/hybrid", short), tps("finetune/softmax", short)),
        "transfer_vs_lolcats_T4k": None if long is None else div(
            tps("transfer/hybrid_output_mse", long), tps("transfer/lolcats_tt", long)),
        "transfer_peak_gib_over_teacher": None if not peaks or tf is None or tf["peak_gib"] is None
        else round(max(peaks) - tf["peak_gib"], 2),
        "scaling_efficiency_transfer_2gpu": None,
        "scaling_efficiency_lora_2gpu": None,
        "kl_vs_lora": div(tps("finetune/hybrid [kl]", short), tps("finetune/hybrid", short)),
        "kl_peak_gib_over_lora": None if lora is None or kl is None or lora["peak_gib"] is None
        or kl["peak_gib"] is None else round(kl["peak_gib"] - lora["peak_gib"], 2),
    }


def ratios_pytorch_phi(rows, short: int = 1024) -> dict:
    """The stage ratios with the feature maps' PyTorch path (rows named ``[... pytorch phi]``)."""
    def tps(name):
        r = _row(rows, name, short)
        return None if r is None else r["tokens_per_s"]

    def div(x, y):
        return None if x is None or y is None else round(x / y, 4)

    teacher = tps("teacher_forward")
    return {"transfer_xent_vs_teacher_forward": div(tps("transfer/weights_xent [fused, pytorch phi]"),
                                                    teacher),
            "transfer_hybrid_mse_vs_teacher_forward": div(
                tps("transfer/hybrid_output_mse [pytorch phi]"), teacher),
            "lora_vs_softmax_lora": div(tps("finetune/hybrid [pytorch phi]"),
                                        tps("finetune/softmax"))}


TARGETS = {"transfer_xent_vs_teacher_forward": ">= 0.5", "transfer_mse_vs_teacher_forward":
           ">= 0.7", "lora_vs_softmax_lora": ">= 0.9", "transfer_vs_lolcats_T4k": ">= 3",
           "transfer_peak_gib_over_teacher": "<= 10", "scaling_efficiency_transfer_2gpu": ">= 0.9",
           "scaling_efficiency_lora_2gpu": ">= 0.9", "kl_vs_lora": ">= 0.8",
           "kl_peak_gib_over_lora": "recorded (no target)"}


def environment(tiny: bool) -> dict:
    env = {"gpu": "cpu (--tiny smoke run)" if tiny else torch.cuda.get_device_name(),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": datetime.date.today().isoformat()}
    for mod in ("triton", "fla", "transformers", "peft"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    return env


def markdown(res) -> str:
    e = res["environment"]
    lines = [f"# stage_speed ({e['gpu']}, {e['date']})", "", f"`{res['command']}`", "",
             f"torch {e['torch']}, triton {e['triton']}, fla {e['fla']}, transformers "
             f"{e['transformers']}, peft {e['peft']}. Model: {res['model']}, {res['tokens']} "
             f"tokens per step, median of {res['steps']} steps after {res['warmup']}.", "",
             "| T | row | tokens/s | step ms | peak GiB |", "| --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['T']} | {r['name']} | error: "
                         f"{r['error'][:120].replace('|', '/')} | | |")
        else:
            peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
            lines.append(f"| {r['T']} | {r['name']} | {r['tokens_per_s']:,.0f} | "
                         f"{r['step_s'] * 1e3:.1f} | {peak} |")
    lines += ["", "| ratio | measured | target |", "| --- | --- | --- |"]
    for k, v in res["ratios"].items():
        lines.append(f"| {k} | {'-' if v is None else v} | {TARGETS[k]} |")
    lines += ["", "With the feature maps' PyTorch path instead of the fused map (ops.triton_phi, "
              "the default on CUDA): "
              + ", ".join(f"{k} {v}" for k, v in res.get("ratios_with_pytorch_phi", {}).items()),
              "", "Two-GPU scaling is not measured by this script (one GPU): `null`."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU, tiny model: smoke test")
    p.add_argument("--seq-lens", default=None,
                   help="comma list (default 1024,4096; tiny 32,64); the ratios use the "
                   "shortest as 'T1k' and the longest as 'T4k'")
    p.add_argument("--tokens", type=int, default=None, help="tokens per step (default 8192)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 3; tiny 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 1)")
    p.add_argument("--window", type=int, default=None, help="SWA window (default 64; tiny 8)")
    p.add_argument("--blocked-xent-max-t", type=int, default=1024,
                   help="run the blocked weights_xent up to this T (it is quadratic and slow)")
    p.add_argument("--lolcats-max-t", type=int, default=4096)
    p.add_argument("--all-rows", action="store_true",
                   help="every stage-1 objective at every length (default: the MSE objectives "
                   "at the shortest only, hybrid_output_mse and the T x T student at all)")
    p.add_argument("--profile", action="store_true",
                   help="profile one step each of: fused-xent stage 1, stage 2 hybrid, softmax, "
                   "KL")
    p.add_argument("--out", required=True, help="folder for stage_speed.{json,md}")
    p.add_argument("--summary", default=None,
                   help="the summary to merge the ratios into (default <out>/summary.json; "
                   "benchmarks/results/summary.json is the summary of record)")
    a = p.parse_args(argv)
    a.seq_lens = a.seq_lens or ("32,64" if a.tiny else "1024,4096")
    a.tokens = a.tokens or (64 if a.tiny else 8192)
    a.steps = a.steps or (1 if a.tiny else 3)
    a.warmup = a.warmup if a.warmup is not None else 1
    a.window = a.window or (8 if a.tiny else 64)
    if not a.tiny and not torch.cuda.is_available():
        print("stage_speed needs a GPU (or --tiny for the CPU smoke run)", file=sys.stderr)
        return 2
    t0 = time.time()
    res = {"command": " ".join(["python", "-m", "benchmarks.stage_speed", *(argv or sys.argv[1:])]),
           "environment": environment(a.tiny), "model": "tiny" if a.tiny else
           "llama3-8b-shaped (random, bf16)", "tokens": a.tokens, "steps": a.steps,
           "warmup": a.warmup, "window": a.window, "rows": []}
    lens = [int(t) for t in a.seq_lens.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = Path(a.summary) if a.summary else out / "summary.json"

    # the T4k ratio at a shorter length would be another number under the same key; the tiny
    # smoke run has no 4k
    long = max(lens) if a.tiny or max(lens) >= 4096 else None

    def write(rows):  # after every row: a run cut short by a time limit keeps what it measured
        res["rows"] = rows
        res["ratios"] = ratios(rows, min(lens), long)
        res["ratio_lengths"] = {"short": min(lens), "long": long}
        res["ratios_with_pytorch_phi"] = ratios_pytorch_phi(rows, min(lens))
        res["targets"] = TARGETS
        res["seconds"] = round(time.time() - t0, 1)
        (out / "stage_speed.json").write_text(json.dumps(res, indent=1) + "\n")
        (out / "stage_speed.md").write_text(markdown(res))
        env = res["environment"]
        update_summary(summary_path, res["ratios"], f"stage_speed {env['date']}",
                       {"file": str(out / "stage_speed.json"), "command": res["command"],
                        "machine": env["gpu"], "date": env["date"]})

    res.update(run(a, on_row=write))
    write(res["rows"])
    print(json.dumps(res["ratios"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
