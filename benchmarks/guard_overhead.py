"""What the parameter finiteness check of ``TrainingGuard`` costs per optimiser step.

Two loops train a Llama-shaped model (random weights) for the same steps, each step as a stage
does it: forward, the loss read on the host (``_check_finite``, one sync), backward, AdamW step.
The second loop adds what ``TrainingGuard`` does after every step (``check_every_n_steps=1``):
``parameters_finite`` over the trainable tensors (one fused ``_foreach_norm``) and a second
host sync. Reported: the check alone (median of ``--repeats`` calls), the median step,
and the overhead of the whole second loop against the first (interleaved rounds, medians).

CPU (what was measured here; 2 cores, shared machine)::

    python -m benchmarks.guard_overhead --device cpu --hidden 256 --layers 4 --batch 4 --seq 256

GPU (an H200: every parameter trainable, as in teacher pretraining, then LoRA on an
8B-shaped model, as in stage 2; bf16)::

    python -m benchmarks.guard_overhead --device cuda --dtype bfloat16 --preset llama-1b \\
        --batch 8 --seq 1024 --out FILE
    python -m benchmarks.guard_overhead --device cuda --dtype bfloat16 --preset llama-8b \\
        --trainable lora --batch 4 --seq 1024 --checkpointing \\
        --out FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

PRESETS = {  # Llama shapes: hidden, layers, heads, kv heads, intermediate, vocab
    "llama-1b": (2048, 16, 32, 8, 8192, 128256),
    "llama-8b": (4096, 32, 32, 8, 14336, 128256),
}


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.preset:
        h, n, heads, kv, inter, vocab = PRESETS[args.preset]
    else:
        h, n, heads, kv, inter, vocab = (args.hidden, args.layers, max(1, args.hidden // 64),
                                         max(1, args.hidden // 128), 4 * args.hidden, 32000)
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                      max_position_embeddings=max(2048, args.seq))
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(dtype)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.trainable == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"))
    model.train()
    return model, vocab


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--trainable", choices=["all", "lora"], default="all")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=10, help="optimiser steps per round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of each loop")
    p.add_argument("--repeats", type=int, default=50, help="calls of the check alone")
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args(argv)
    from hedgecats.lightning_modules.guard import parameters_finite

    torch.manual_seed(0)
    model, vocab = build(a)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, vocab, (a.batch, a.seq), device=a.device)

    def step(check: bool) -> None:
        loss = model(input_ids=ids, labels=ids).loss
        bool(torch.isfinite(loss.detach()))  # the stage's loss check: one host sync
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if check:
            parameters_finite(params)  # TrainingGuard, every step (one host sync)

    for _ in range(2):  # warm-up (allocator, kernels, optimiser state)
        step(True)
    sync(a.device)
    times = {False: [], True: []}
    for _ in range(a.rounds):
        for check in (False, True):
            sync(a.device)
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step(check)
            sync(a.device)
            times[check].append((time.perf_counter() - t0) / a.steps)
    alone = []
    for _ in range(a.repeats):
        sync(a.device)
        t0 = time.perf_counter()
        parameters_finite(params)
        alone.append(time.perf_counter() - t0)
    base, guarded = statistics.median(times[False]), statistics.median(times[True])
    result = {
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "args": vars(a), "trainable_params": sum(q.numel() for q in params),
        "all_params": sum(q.numel() for q in model.parameters()),
        "step_s_median": base, "step_s_with_check_median": guarded,
        "check_alone_s_median": statistics.median(alone),
        "check_alone_fraction_of_step": statistics.median(alone) / base,
        "loop_overhead_fraction": guarded / base - 1,
        "rounds_s": {"without": times[False], "with": times[True]},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rounds_s"}, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
