"""Branch usage: per layer and head, how much of the attention output comes from SWA and LA.

The model runs once on a text sample in ``hybrid`` mode (or another mode: its q/k/v then follow
that mode's earlier layers). An observer on every converted layer recomputes, from the layer's
own q, k, v, the two weighted branch outputs that the hybrid adds up,

    c_swa = w_swa * SWA          c_la = w_la * LA          (hybrid output = c_swa + c_la)

(``hybrid_attention`` in ``swa_only`` / ``la_only`` mode with ``rescale=False``; the weights come
from the layer's mixer: fixed ``g``, learned per head, output gates, or shared-norm ``alpha_t``).
Per head:

    la_share = sum_t ||c_la[t]|| / sum_t (||c_swa[t]|| + ||c_la[t]||)       swa_share = 1 - la_share

with ``||.||`` the L2 norm over the head dimension, summed over the positions where LA can see a
key (``t >= w`` for non-overlapping LA; every position with ``overlap``). Shares of norms, not of
the output's norm: the two vectors may partly cancel. ``*_all_positions`` repeats the numbers over
every position (where for ``t < w`` non-overlapping LA is 0 by construction).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from hedgecats.models import attention_mode, hybrid_attention, hybrid_layers
from hedgecats.models.ops.hybrid.windows import outside_limit

log = logging.getLogger(__name__)

__all__ = ["branch_norms", "branch_usage", "default_text", "far_positions",
           "format_branch_usage_markdown", "plot_branch_usage"]


def default_text(tokenizer, n_tokens: int, window: int, seed: int = 0) -> str:
    """A recall-corpus document (filler English with facts recalled 2w-8w tokens later)."""
    from hedgecats.data.recall import generate_recall_document

    facts = max(1, n_tokens // (6 * window))
    doc = generate_recall_document(0, seed=seed, distances=(2 * window, 4 * window),
                                   facts_per_doc=facts, tokenizer=tokenizer)
    return doc.text


def branch_norms(module, query, key, value, key_padding_mask, hidden_states
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The norms over the head dimension of a converted layer's two weighted branches,
    ``||w_swa SWA_t||`` and ``||w_la LA_t||``, each (B, H, T) fp32, recomputed from the layer's
    own q, k, v (the arguments of a layer observer, ``LayerRuntime.observer``)."""
    rt = module.hedgecats
    fq, fk = module.phi_q(query), module.phi_k(key)
    common = {"window": rt.window, "g": module.mixer(hidden_states),
              "shared_norm": module.mixer.shared_norm, "overlap": rt.overlap,
              "la_span": "outside", "n_sinks": rt.n_sinks, "key_padding_mask": key_padding_mask,
              "scale": getattr(module, "scaling", None), "eps": rt.eps, "backend": rt.backend,
              "window_shape": getattr(rt, "window_shape", "sliding")}
    return tuple(hybrid_attention(query, key, value, fq, fk, mode=mode, rescale=False, **common)
                 .float().norm(dim=-1) for mode in ("swa_only", "la_only"))


def far_positions(rt, T: int, device) -> torch.Tensor:
    """(T,) bool: the positions where a converted layer's LA sees a key (every position with
    ``overlap``; ``t >= w`` for a sliding window), given its runtime ``rt``."""
    if not rt.overlap and getattr(rt, "window_shape", "sliding") != "sliding":
        # terraced windows (ops.windows): LA sees keys from the third block on
        return outside_limit(rt.window_shape, rt.window, None, 1, T, T, device)[0] > 0
    return torch.arange(T, device=device) >= (0 if rt.overlap else rt.window)


def branch_usage(model, tokenizer, *, text: str | None = None, max_tokens: int = 1024,
                 mode: str = "hybrid", text_source: str | None = None, device=None) -> dict:
    """Measure branch shares on ``text`` (default: ``default_text``), cut to ``max_tokens``.

    ``max_tokens`` past the model's ``max_position_embeddings`` is cut to it, as the retrieval
    probe cuts its documents: a researcher asking for the default 1,024 tokens of a model with
    fewer positions wants the measurement over the positions it has (RoPE and the feature maps
    never saw the others, and a converted model refuses them), not an error after every lm-eval
    task has run. The section records both numbers and says so (``note``).

    Returns the ``branch_usage`` section of ``results.json``: per converted layer, per head.
    """
    layers = list(hybrid_layers(model))
    if not layers:
        raise ValueError("branch usage needs a converted (hybrid) model")
    if mode not in ("hybrid", "swa_only", "la_only"):
        raise ValueError(f"branch usage runs in a mode with both branches' inputs: hybrid, "
                         f"swa_only or la_only, not {mode!r}")
    min_window = min(a.hedgecats.window for _, a in layers)
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    n_tokens, note = max_tokens, None
    if isinstance(positions, int) and max_tokens > positions:
        n_tokens = positions
        note = (f"the sample is cut to max_position_embeddings={positions} tokens (asked: "
                f"{max_tokens}): the model has no later positions")
        log.warning("branch usage: %s", note)
    if text is None:
        text = default_text(tokenizer, n_tokens, min_window)
        text_source = text_source or "recall-corpus document (hedgecats.data.recall, seed 0)"
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :n_tokens]
    device = device or next(model.parameters()).device
    ids = ids.to(device)

    sums: dict[int, dict[str, torch.Tensor]] = {}

    def observer(module, query, key, value, key_padding_mask, hidden_states):
        rt = module.hedgecats
        n_swa_BHT, n_la_BHT = branch_norms(module, query, key, value, key_padding_mask,
                                           hidden_states)
        T = n_swa_BHT.shape[-1]
        far_T = far_positions(rt, T, n_swa_BHT.device)
        s = sums.setdefault(rt.layer_idx, {"window": rt.window})
        for name, val in (("swa", n_swa_BHT), ("la", n_la_BHT)):
            s[name] = s.get(name, 0) + val[..., far_T].sum(dim=(0, 2)).double().cpu()  # (H,)
            s[name + "_all"] = s.get(name + "_all", 0) + val.sum(dim=(0, 2)).double().cpu()
        s["n_far"] = s.get("n_far", 0) + int(far_T.sum()) * n_swa_BHT.shape[0]
        s["n_all"] = s.get("n_all", 0) + T * n_swa_BHT.shape[0]

    with attention_mode(model, mode, observer=observer), torch.no_grad():
        model(input_ids=ids)

    def share(a, b):
        tot = a + b
        return [None if t == 0 else float(x / t) for x, t in zip(a.tolist(), tot.tolist())]

    out_layers = []
    for i, _ in layers:
        s = sums[i]
        la = share(s["la"], s["swa"]) if s["n_far"] else [None] * len(s["swa_all"])
        out_layers.append({
            "layer": i, "window": s["window"], "n_positions": s["n_far"],
            "la_share": la, "swa_share": [None if x is None else 1.0 - x for x in la],
            "la_share_all_positions": share(s["la_all"], s["swa_all"]),
            "mean_norm_swa": (s["swa"] / max(s["n_far"], 1)).tolist(),
            "mean_norm_la": (s["la"] / max(s["n_far"], 1)).tolist(),
        })
    return {"mode": mode, "text_source": text_source or "given text", "n_tokens": int(ids.shape[1]),
            "max_tokens": max_tokens, "note": note,
            "definition": "la_share = sum_t ||w_la LA_t|| / sum_t (||w_swa SWA_t|| + ||w_la LA_t||) "
                          "per head, over positions where LA sees a key",
            "layers": out_layers}


def plot_branch_usage(bu: dict, path: str | Path, title: str = "") -> Path:
    """Heatmap of the LA share, layers x heads (0 = all SWA, 1 = all LA)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [[np.nan if x is None else x for x in layer["la_share"]] for layer in bu["layers"]]
    data = np.array(rows, dtype=float)  # (layers, heads)
    L, H = data.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * H + 2), max(3.0, 0.3 * L + 1.5)))
    im = ax.imshow(data, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_yticks(range(L), [str(layer["layer"]) for layer in bu["layers"]])
    if L * H <= 256:
        for y in range(L):
            for x in range(H):
                if not np.isnan(data[y, x]):
                    ax.text(x, y, f"{data[y, x]:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if data[y, x] < 0.5 else "black")
    fig.colorbar(im, ax=ax, label="LA share of the branch output norms")
    ax.set_title(title or f"Branch usage ({bu['mode']}, {bu['n_tokens']} tokens)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_branch_usage_markdown(bu: dict) -> list[str]:
    """Per layer: mean, min and max LA share over heads (every head is in results.json)."""
    lines = ["## Branch usage", "",
             (f"LA share of the branch output norms, mode {bu['mode']}, {bu['n_tokens']} tokens of "
              f"{bu['text_source']}; {bu['definition']}. Heatmap: branch_usage.png."
              + (f" Note: {bu['note']}." if bu.get("note") else "")), "",
             "| layer | window | LA share mean | min | max |", "| ---: | ---: | ---: | ---: | ---: |"]
    for layer in bu["layers"]:
        v = [x for x in layer["la_share"] if x is not None]
        if v:
            lines.append(f"| {layer['layer']} | {layer['window']} | {sum(v) / len(v):.3f} | "
                         f"{min(v):.3f} | {max(v):.3f} |")
        else:
            lines.append(f"| {layer['layer']} | {layer['window']} | n/a | n/a | n/a |")
    return lines
