"""Retrieval beyond the window: key-value recall at controlled distances, per ablation mode.

Each probe document (from the data package's seeded recall corpus, ``hedgecats.data.recall``)
states one fact, ``The code for KEY is VALUE.``, then filler, then queries it: ``Recall that the
code for KEY is VALUE.`` The filler has no digits and never says "code for", so the value's
tokens in the query can only be predicted by recalling the statement.

Scoring: **greedy exact match**. A fact counts as recovered when, at every token of the queried
value, the model's argmax next-token prediction (given the true prefix) is that token. With the
correct prefix fed back this is exactly the greedy continuation reproducing the value, computed
in one forward pass per document. Token accuracy (share of value tokens predicted) is reported
too. Chance is about 0 (5-digit random values).

Distances are counted in tokens of the model's own tokenizer (the filler is sized by token
count), so the probe works with any fast HF tokenizer. A fact's distance is that of its first
value token, ``(p - 1) - f`` (``recall_answers``' convention): it is inside a causal window of
``w`` keys exactly when ``distance < w``. Buckets, relative to ``w``:
``inside`` (< w), ``1-4x`` (w to 4w), ``4-16x`` (4w to 16w), ``beyond`` (>= 16w). ``w`` is the
smallest window over the converted layers (per-layer windows may differ; the report says which
was used; a mode's ``window=N`` switch changes the model's window but not the buckets, which
stay relative to the converted window); target distances default to ``w/2, 2w, 8w, 24w``. The filler is cut at sentence
boundaries and the query's own lead counts towards the distance, so the actual distances differ
from the targets; every fact is bucketed by its actual distance. Documents longer than
``max_length`` are not generated (their distances are listed as skipped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..data import recall as _recall_data
from ..data.buckets import WINDOW_BUCKETS as BUCKETS
from ..data.buckets import window_bucket
from ..models import attention_mode, hybrid_layers
from .ablation import ModeSpec, is_converted

log = logging.getLogger(__name__)

__all__ = ["BUCKETS", "TEACHER_FLOOR", "ProbeDocument", "default_distances",
           "format_retrieval_markdown", "make_probe_documents", "probe_window", "retrieval_probe",
           "score_documents", "teacher_verdict"]

#: below this exact-match percentage in its best bucket, the teacher (mode ``softmax``, the
#: original attention) has not learned what the probe asks, and no row can be read
TEACHER_FLOOR = 10.0

SCORING = ("greedy exact match of the queried value (argmax at every value token given the true "
           "prefix = greedy decoding); token accuracy alongside")


def bucket_of(distance: int, window: int) -> str:
    """``inside`` / ``1-4x`` / ``4-16x`` / ``beyond`` (``hedgecats.data.buckets``)."""
    return window_bucket(distance, window)


def probe_window(model, default: int | None = None) -> tuple[int, str]:
    """(window, how it was chosen): the smallest window over converted layers."""
    if is_converted(model):
        windows = sorted({a.hedgecats.window for _, a in hybrid_layers(model)})
        note = (f"window {windows[0]} (all converted layers)" if len(windows) == 1 else
                f"window {windows[0]}: the smallest of the per-layer windows {windows}")
        return windows[0], note
    if default is None:
        raise ValueError("the model is not converted, so it has no window: give the retrieval "
                         "window explicitly (--retrieval-window)")
    return default, f"window {default} (given; the model is not converted)"


def default_distances(window: int) -> tuple[int, ...]:
    """Target distances, one per bucket: w/2, 2w, 8w, 24w."""
    return (max(1, window // 2), 2 * window, 8 * window, 24 * window)


@dataclass(frozen=True)
class ProbeDocument:
    input_ids: list[int]
    value_positions: list[int]  # positions of the queried value's tokens
    distance: int  # of the first value token
    target_distance: int


def make_probe_documents(tokenizer, distances: Sequence[int], n_per_distance: int, *,
                         seed: int = 0, max_length: int | None = None,
                         add_special_tokens: bool = True) -> tuple[list[ProbeDocument], list[int]]:
    """One-fact recall documents, ``n_per_distance`` per target distance.

    Returns the documents and the target distances skipped because a document would exceed
    ``max_length`` tokens.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("the retrieval probe needs a fast tokenizer (token offsets)")
    recall = _recall_data
    docs, skipped = [], []
    for k, d in enumerate(distances):
        batch = []
        for i in range(n_per_distance):
            doc = recall.generate_recall_document(
                k * 100_003 + i, seed=seed, distances=(d,), facts_per_doc=1, tokenizer=tokenizer,
                prefix_units=32, gap_units=0)
            ids = tokenizer(doc.text, add_special_tokens=add_special_tokens)["input_ids"]
            if max_length is not None and len(ids) > max_length:
                batch = None
                break
            answers = recall.recall_answers(doc.text, tokenizer, add_special_tokens=add_special_tokens)
            if not answers:
                raise RuntimeError(f"recall document for distance {d} has no answer tokens")
            batch.append(ProbeDocument(ids, [a.position for a in answers], answers[0].distance, d))
        if batch is None:
            skipped.append(d)
        else:
            docs.extend(batch)
    return docs, skipped


def _value_predictions(model, docs: list[ProbeDocument], pad_id: int, batch_size: int,
                       device) -> list[list[bool]]:
    """For every document, whether the argmax at position ``p - 1`` equals token ``p``, for each
    value position ``p``. Right padding: with causal attention it cannot change real positions."""
    decoder = getattr(model, "get_decoder", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    out: list[list[bool]] = []
    order = sorted(range(len(docs)), key=lambda i: len(docs[i].input_ids))  # similar lengths
    results: dict[int, list[bool]] = {}
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        T = max(len(docs[i].input_ids) for i in idx)
        ids_BT = torch.full((len(idx), T), pad_id, dtype=torch.long)
        mask_BT = torch.zeros((len(idx), T), dtype=torch.long)
        for b, i in enumerate(idx):
            n = len(docs[i].input_ids)
            ids_BT[b, :n] = torch.tensor(docs[i].input_ids)
            mask_BT[b, :n] = 1
        ids_BT, mask_BT = ids_BT.to(device), mask_BT.to(device)
        rows = torch.tensor([b for b, i in enumerate(idx) for _ in docs[i].value_positions])
        pos = torch.tensor([p for i in idx for p in docs[i].value_positions])
        with torch.no_grad():
            if decoder is not None and head is not None:
                h_BTH = decoder(input_ids=ids_BT, attention_mask=mask_BT).last_hidden_state
                logits_NV = head(h_BTH[rows, pos - 1])
            else:  # only the needed positions would be cheaper, but not every model exposes them
                logits_NV = model(input_ids=ids_BT, attention_mask=mask_BT).logits[rows, pos - 1]
        hit = (logits_NV.argmax(-1).cpu() == ids_BT.cpu()[rows, pos]).tolist()
        k = 0
        for i in idx:
            n = len(docs[i].value_positions)
            results[i] = hit[k:k + n]
            k += n
    out = [results[i] for i in range(len(docs))]
    return out


def score_documents(hits: list[list[bool]], docs: list[ProbeDocument], window: int) -> dict:
    """Per bucket: exact-match accuracy and token accuracy (percent), counts, distances."""
    table = {}
    for bucket in BUCKETS:
        sel = [(h, d) for h, d in zip(hits, docs) if bucket_of(d.distance, window) == bucket]
        if not sel:
            table[bucket] = {"accuracy": None, "token_accuracy": None, "n": 0}
            continue
        exact = [all(h) for h, _ in sel]
        tokens = [x for h, _ in sel for x in h]
        dist = [d.distance for _, d in sel]
        table[bucket] = {"accuracy": 100.0 * sum(exact) / len(exact),
                         "token_accuracy": 100.0 * sum(tokens) / len(tokens), "n": len(sel),
                         "distance_min": min(dist), "distance_max": max(dist)}
    return table


def retrieval_probe(model, tokenizer, specs: list[ModeSpec], *, window: int | None = None,
                    distances: Sequence[int] | None = None, n_per_distance: int = 16,
                    max_length: int | None = None, seed: int = 0, batch_size: int = 4,
                    device=None, progress: Callable[[str], None] = print) -> dict:
    """Score recall per distance bucket in every mode of ``specs`` (run on ``model`` in place).

    Args:
        window: bucket window for an unconverted model (ignored when the model is converted:
            the smallest converted window is used).
        distances: target distances (default ``default_distances(window)``).
        max_length: longest document in tokens (default: the model's
            ``max_position_embeddings``).
    Returns:
        the ``retrieval`` section of ``results.json``.
    """
    w, note = probe_window(model, window)
    distances = list(distances) if distances else list(default_distances(w))
    if max_length is None:
        max_length = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    device = device or next(model.parameters()).device
    docs, skipped = make_probe_documents(tokenizer, distances, n_per_distance, seed=seed,
                                         max_length=max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    converted = is_converted(model)
    modes = {}
    for i, spec in enumerate(specs, 1):
        progress(f"[retrieval {i}/{len(specs)}] mode {spec.label}: {len(docs)} documents")
        if converted:
            with attention_mode(model, spec.mode, **spec.switches):
                hits = _value_predictions(model, docs, pad, batch_size, device)
        else:
            hits = _value_predictions(model, docs, pad, batch_size, device)
        modes[spec.label] = score_documents(hits, docs, w)
    return {"scoring": SCORING, "window": w, "window_note": note, "buckets": list(BUCKETS),
            "target_distances": distances, "skipped_distances": skipped,
            "n_per_distance": n_per_distance, "max_length": max_length, "seed": seed,
            "distance_unit": "tokens of the model's tokenizer", "modes": modes}


def teacher_verdict(r: dict) -> str | None:
    """A line saying the probe does not fit the model when its teacher (the ``softmax`` row)
    scores under ``TEACHER_FLOOR`` in every bucket with facts; ``None`` otherwise."""
    row = r["modes"].get("softmax")
    scores = [c["accuracy"] for c in (row or {}).values() if c["n"]]
    if not scores or max(scores) >= TEACHER_FLOOR:
        return None
    best = max(scores)
    said = "0" if best == 0 else f"at most {best:.1f}%"
    return (f"**The teacher scores {said}: this probe does not fit this model.** Mode "
            f"`softmax` (the original attention) does not recall the probe's facts (\"The code "
            f"for KEY is VALUE.\": natural language, 5-digit values) at any distance measured, "
            f"so no row above says what the branches carry. Evaluate recall on the "
            f"documents the model learned instead: the pipeline's `evaluate:` section with "
            f"`kind: recall` (configs/pipelines/tiny.yaml), which scores near and far recalls of "
            f"its training corpus in every mode.")


def format_retrieval_markdown(r: dict) -> list[str]:
    """Rows = modes, columns = buckets; cells 'exact% (n)'; a line under the table when the
    teacher scores ~0 (``teacher_verdict``)."""
    head = [f"{b} (d {'<' if b == 'inside' else '>='} "
            f"{dict(zip(BUCKETS, ('w', 'w', '4w', '16w')))[b]})" for b in BUCKETS]
    lines = ["## Retrieval beyond the window", "",
             (f"Key-value recall, {r['window_note']}; distance in {r['distance_unit']}. "
              f"Scoring: {r['scoring']}. Cells: exact-match % (token accuracy %, n facts)."), "",
             "| mode | " + " | ".join(head) + " |", "| --- |" + " ---: |" * len(BUCKETS)]
    for label, row in r["modes"].items():
        cells = []
        for b in BUCKETS:
            c = row[b]
            cells.append("n/a (n=0)" if not c["n"] else
                         f"{c['accuracy']:.1f} ({c['token_accuracy']:.1f}, n={c['n']})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    verdict = teacher_verdict(r)
    if verdict:
        lines += ["", verdict]
    first = next(iter(r["modes"].values()), {})
    empty = [b for b in BUCKETS if first and not first[b]["n"]]
    if empty:
        reached = [first[b]["distance_min"] for b in BUCKETS if first[b]["n"]]
        lines += ["", (f"No fact fell in {', '.join(empty)}. Distances reached: "
                       f"{min(reached) if reached else 'n/a'} to "
                       f"{max((first[b]['distance_max'] for b in BUCKETS if first[b]['n']), default='n/a')}"
                       " tokens; the query's own words count towards the distance, so a window "
                       "shorter than them leaves the near buckets empty, and the far buckets need "
                       "larger --retrieval-distances (within --retrieval-max-length).")]
    if r.get("skipped_distances"):
        lines += ["", (f"Skipped target distances (documents longer than max_length "
                       f"{r['max_length']}): {r['skipped_distances']}.")]
    return lines
