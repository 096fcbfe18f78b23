"""Light downstream evaluation during training, logged next to the loss (issue 15, item 3).

The second seed's lesson (docs/method.md#pretraining-study): with an added inductive bias (a
window, a gate), the loss can improve while what the model can *do* gets worse, so a run's curves
should show both. ``DownstreamEval`` runs a few cheap probes every N optimiser steps or every
fraction of training and logs them as ``downstream/<probe>/<metric>``:

    RecallProbe        held-out recall documents (``make_recall_corpus``): the LM loss over all
                       tokens, and accuracy / loss of the recalled values by distance bucket
    ChoiceProbe        multiple choice scored by log-likelihood (lm-eval's ``acc`` and
                       ``acc_norm``), items from a JSONL file of ``{"context", "choices", "gold"}``
    RecallChoiceProbe  multiple-choice items built from recall documents: the recalled value
                       against distractors, with the whole prefix or a short context

Everything is deterministic: probe data come from fixed seeds (held out: no ``RecallDataModule``
split uses them), the model runs in eval mode under ``no_grad`` in the trainer's precision, the
RNG state is restored afterwards, so a run with the callback trains exactly as one without.
Values are logged at ``step = trainer.global_step`` (the model after that many optimiser
steps), through the trainer's loggers directly (``LightningModule.log`` from a callback only
reaches the loggers on ``log_every_n_steps`` boundaries), and also put in
``trainer.callback_metrics`` and the callback's ``history`` (saved in checkpoints).

Distributed: under DDP only global rank 0 evaluates (on the unwrapped model: no collective runs
inside), the others wait at a barrier. Sharded models (FSDP / ``ModelParallelStrategy``) need
every rank in each forward: refused at setup.
"""

from __future__ import annotations

import json
import logging
import math
import string
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data.buckets import range_bucket
from ..data.recall_bytes import RecallCorpus, make_recall_corpus

log = logging.getLogger(__name__)

__all__ = [
    "ChoiceItem",
    "ChoiceProbe",
    "DownstreamEval",
    "Probe",
    "RecallChoiceProbe",
    "RecallProbe",
    "evaluation_steps",
    "recall_scores",
    "score_choices",
]

#: default probe seeds; RecallDataModule's splits use 1000 * seed + (0, 1, 2), never these
RECALL_PROBE_SEED, CHOICE_PROBE_SEED = 10_007, 20_011


# ----------------------------------------------------------------------------- schedule
def evaluation_steps(total_steps: int, every_n_steps: int | None = None,
                     every_fraction: float | None = None) -> tuple[int, ...]:
    """The optimiser steps after which to evaluate, the last one always included.

    ``every_n_steps=n``: n, 2n, ... and ``total_steps``; ``every_fraction=f``: round(k f total)
    for k = 1 .. floor(1/f), and ``total_steps``. Exactly one of the two must be given.
    """
    if (every_n_steps is None) == (every_fraction is None):
        raise ValueError(f"give exactly one of every_n_steps ({every_n_steps!r}) and "
                         f"every_fraction ({every_fraction!r})")
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps={total_steps!r} must be an int >= 1")
    if every_n_steps is not None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be an int >= 1")
        steps = set(range(every_n_steps, total_steps + 1, every_n_steps))
    else:
        if not 0.0 < every_fraction <= 1.0:
            raise ValueError(f"every_fraction={every_fraction!r} must lie in (0, 1]")
        n = math.floor(1.0 / every_fraction + 1e-9)
        steps = {round(k * every_fraction * total_steps) for k in range(1, n + 1)}
    return tuple(sorted((steps | {total_steps}) - {0}))


# ----------------------------------------------------------------------------- probes
class Probe(ABC):
    """One downstream measurement: ``evaluate(model, device) -> {metric: value}``.

    ``model`` is a transformers causal LM (``model(input_ids=...).logits``), already in eval
    mode under ``no_grad``. ``bind`` hands over the run's tokenizer before the first call
    (probes that tokenize text need it).
    """

    def __init__(self, name: str) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"a probe needs a non-empty name, got {name!r}")
        self.name = name

    def bind(self, tokenizer) -> None:
        """Receive the tokenizer of the run (the datamodule's, else the byte-level one)."""

    @abstractmethod
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        ...


def recall_scores(model: nn.Module, corpus: RecallCorpus, *, batch_size: int, device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-document mean next-token loss (N,), and per answer (M,) the loss and whether the
    argmax is right at the recalled value (predicted from the position before it)."""
    ids_NT = corpus.input_ids
    doc_M, pos_M = corpus.answers[:, 0], corpus.answers[:, 1]
    doc_loss = torch.empty(len(ids_NT))
    ans_loss = torch.empty(len(doc_M))
    ans_hit = torch.empty(len(doc_M), dtype=torch.bool)
    for s in range(0, len(ids_NT), batch_size):
        ids = ids_NT[s:s + batch_size].to(device)
        logits = model(input_ids=ids).logits[:, :-1].float()  # (b, T-1, V): predicts ids[:, 1:]
        tok_loss = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (b, T-1)
        doc_loss[s:s + len(ids)] = tok_loss.mean(-1).cpu()
        sel = (doc_M >= s) & (doc_M < s + len(ids))
        d, p = (doc_M[sel] - s).to(device), (pos_M[sel] - 1).to(device)
        ans_loss[sel] = tok_loss[d, p].cpu()
        ans_hit[sel] = (logits[d, p].argmax(-1) == ids[d, p + 1]).cpu()
    return doc_loss, ans_loss, ans_hit


class RecallProbe(Probe):
    """Held-out recall documents: ``lm_loss`` (all tokens; ``lm_loss_se`` its standard error over
    documents), ``acc`` (every recalled value), and ``<bucket>/acc``, ``<bucket>/loss`` per
    distance bucket.

    Args:
        num_docs, seq_len, near_max, far_min, far_max, facts_per_doc, filler, task: the corpus,
            as ``make_recall_corpus`` takes them (match the training data's).
        buckets: ``[[lo, hi], ...]`` inclusive distance ranges, named ``d<lo>-<hi>``; default:
            the corpus's own (``near`` and three slices of the far range). Every bucket must
            hold at least one recall.
        seed: corpus seed (default: one no ``RecallDataModule`` split uses).
        batch_size: documents per forward.
    """

    def __init__(self, name: str = "recall", num_docs: int = 32, seq_len: int = 256,
                 near_max: int = 31, far_min: int = 64, far_max: int = 200,
                 facts_per_doc: int = 6, filler: str = string.ascii_lowercase, task: str = "kv",
                 buckets: list[list[int]] | None = None, seed: int = RECALL_PROBE_SEED,
                 batch_size: int = 8) -> None:
        super().__init__(name)
        if num_docs < 1 or batch_size < 1:
            raise ValueError(f"num_docs={num_docs!r} and batch_size={batch_size!r} must be >= 1")
        self.batch_size = batch_size
        self.corpus = make_recall_corpus(num_docs, seq_len, near_max=near_max, far_min=far_min,
                                         far_max=far_max, facts_per_doc=facts_per_doc,
                                         filler=filler, task=task, seed=seed)
        self.buckets = self._resolve_buckets(buckets)

    def _resolve_buckets(self, buckets) -> list[tuple[str, int, int]]:
        if buckets is None:
            out = self.corpus.buckets()
        else:
            out = []
            for b in buckets:
                if len(b) != 2:
                    raise ValueError(f"bucket {b!r} is not valid: give [lo, hi] with integer "
                                     "distances lo <= hi (bounds inclusive)")
                out.append(range_bucket(*b))
        dist = self.corpus.answers[:, 2]
        for name, lo, hi in out:
            if not ((dist >= lo) & (dist <= hi)).any():
                raise ValueError(f"bucket {name!r} ({lo}..{hi}) holds no recall of this probe's "
                                 f"corpus: its near distances are 3..{self.corpus.near_max}, far "
                                 f"ones {self.corpus.far_min}..{self.corpus.far_max}")
        return out

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        doc_loss, ans_loss, ans_hit = recall_scores(model, self.corpus,
                                                    batch_size=self.batch_size, device=device)
        n = len(doc_loss)
        out = {"lm_loss": doc_loss.mean().item(),
               "lm_loss_se": (doc_loss.std().item() / math.sqrt(n)) if n > 1 else 0.0,
               "acc": ans_hit.float().mean().item()}
        dist = self.corpus.answers[:, 2]
        for name, lo, hi in self.buckets:
            sel = (dist >= lo) & (dist <= hi)
            out[f"{name}/acc"] = ans_hit[sel].float().mean().item()
            out[f"{name}/loss"] = ans_loss[sel].mean().item()
        return out


@dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice question in token ids: ``context`` then one of ``choices``;
    ``lengths``: each choice's length for ``acc_norm`` (characters, as lm-eval counts)."""

    context: tuple[int, ...]
    choices: tuple[tuple[int, ...], ...]
    gold: int
    lengths: tuple[int, ...]


def score_choices(model: nn.Module, items: Sequence[ChoiceItem], *, batch_size: int,
                  device) -> list[list[float]]:
    """``log p(choice | context)`` summed over the choice's tokens, per item and choice.

    Single-token choices (every item): one forward per context, the choices read off its last
    position. Otherwise one forward per (context + choice) sequence. Sequences are right-padded
    without an attention mask: causal attention keeps padding after a position invisible to it.
    Both paths give the same numbers (tested).
    """
    if all(len(c) == 1 for it in items for c in it.choices):
        seqs = [(i, None, it.context) for i, it in enumerate(items)]
    else:
        seqs = [(i, j, it.context + c) for i, it in enumerate(items)
                for j, c in enumerate(it.choices)]
    scores = [[0.0] * len(it.choices) for it in items]
    for s in range(0, len(seqs), batch_size):
        chunk = seqs[s:s + batch_size]
        T = max(len(x) for _, _, x in chunk)
        ids_BT = torch.zeros(len(chunk), T, dtype=torch.long)
        for b, (_, _, x) in enumerate(chunk):
            ids_BT[b, :len(x)] = torch.tensor(x)
        logp_BTV = model(input_ids=ids_BT.to(device)).logits.float().log_softmax(-1).cpu()
        for b, (i, j, x) in enumerate(chunk):
            item = items[i]
            if j is None:  # every choice is one token, predicted from the context's last position
                last = len(item.context) - 1
                scores[i] = [logp_BTV[b, last, c[0]].item() for c in item.choices]
            else:
                start = len(item.context)  # the choice's tokens: start.., predicted from start-1..
                tgt = torch.tensor(x[start:])
                scores[i][j] = logp_BTV[b, start - 1:len(x) - 1].gather(
                    -1, tgt[:, None]).sum().item()
    return scores


class ChoiceProbe(Probe):
    """Multiple choice scored by log-likelihood: ``acc`` (argmax of the summed log-probability
    is the gold choice) and ``acc_norm`` (the same divided by the choice's length in
    characters), lm-eval's two readings; ``n`` items.

    Items come from ``path``, a JSONL file with one ``{"context": str, "choices": [str, ...],
    "gold": int}`` per line, tokenized with the run's tokenizer (``bind``; no special tokens;
    a choice usually starts with its separating space, as in lm-eval). Subclasses may build
    token-id items themselves (``_build_items``).
    """

    def __init__(self, name: str = "choice", path: str | None = None,
                 max_items: int | None = None, batch_size: int = 16) -> None:
        super().__init__(name)
        if batch_size < 1 or (max_items is not None and max_items < 1):
            raise ValueError(f"batch_size={batch_size!r} and max_items={max_items!r} must be >= 1")
        self.path, self.max_items, self.batch_size = path, max_items, batch_size
        self._records = self._read(path) if path is not None else None
        self._items: list[ChoiceItem] | None = None

    @staticmethod
    def _read(path: str) -> list[dict]:
        records = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            ok = (isinstance(rec, dict) and isinstance(rec.get("context"), str)
                  and isinstance(rec.get("choices"), list) and len(rec["choices"]) >= 2
                  and all(isinstance(c, str) and c for c in rec["choices"])
                  and isinstance(rec.get("gold"), int) and 0 <= rec["gold"] < len(rec["choices"]))
            if not ok:
                raise ValueError(f"{path}:{n}: {line[:200]!r} is not a multiple-choice item: need "
                                 '{"context": str, "choices": [>= 2 non-empty str], "gold": '
                                 "index into choices}")
            records.append(rec)
        if not records:
            raise ValueError(f"{path} holds no multiple-choice item")
        return records

    def bind(self, tokenizer) -> None:
        if self._records is None or self._items is not None:
            return

        def enc(text: str) -> tuple[int, ...]:
            return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

        self._items = [ChoiceItem(enc(r["context"]), tuple(enc(c) for c in r["choices"]),
                                  r["gold"], tuple(len(c) for c in r["choices"]))
                       for r in self._records[:self.max_items]]

    @property
    def items(self) -> list[ChoiceItem]:
        if self._items is None:
            raise RuntimeError(f"probe {self.name!r}: its text items are not tokenized yet; "
                               "call bind(tokenizer) first (DownstreamEval does)")
        return self._items

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        items = self.items
        scores = score_choices(model, items, batch_size=self.batch_size, device=device)
        acc = [int(np.argmax(s)) == it.gold for s, it in zip(scores, items)]
        norm = [int(np.argmax([v / n for v, n in zip(s, it.lengths)])) == it.gold
                for s, it in zip(scores, items)]
        return {"acc": float(np.mean(acc)), "acc_norm": float(np.mean(norm)), "n": len(items)}


class RecallChoiceProbe(ChoiceProbe):
    """Multiple choice from recall documents: the context runs up to the recalled key (``?K``),
    the choices are the true value and ``num_choices - 1`` other letters of its alphabet, the
    gold at a random place (chance ``1 / num_choices``).

    Args:
        distances: ``[lo, hi]``, the recalls that become items (inclusive; default: all).
        context: tokens of context kept before the answer (``None``: the whole prefix). A short
            context is the paper's regime, where a window sees the whole question; it must
            reach back to the fact (``context >= hi + 2``).
        num_docs, seq_len, near_max, far_min, far_max, facts_per_doc, filler, task, seed: the
            corpus (``make_recall_corpus``); ``max_items``: at most this many items (in a
            seeded order).
    """

    def __init__(self, name: str = "recall_choice", num_docs: int = 32, seq_len: int = 256,
                 near_max: int = 31, far_min: int = 64, far_max: int = 200,
                 facts_per_doc: int = 6, filler: str = string.ascii_lowercase, task: str = "kv",
                 distances: list[int] | None = None, context: int | None = None,
                 num_choices: int = 4, max_items: int | None = 64,
                 seed: int = CHOICE_PROBE_SEED, batch_size: int = 16) -> None:
        super().__init__(name, None, max_items, batch_size)
        if not 2 <= num_choices <= 26:
            raise ValueError(f"num_choices={num_choices!r} must lie in 2..26 (letters)")
        lo, hi = distances if distances is not None else (0, seq_len)
        if lo > hi:
            raise ValueError(f"distances={distances!r} must be [lo, hi] with lo <= hi")
        if context is not None and context < hi + 2:
            raise ValueError(f"context={context!r} cannot reach a fact {hi} tokens back: give "
                             f"context >= {hi + 2} or smaller distances")
        corpus = make_recall_corpus(num_docs, seq_len, near_max=near_max, far_min=far_min,
                                    far_max=far_max, facts_per_doc=facts_per_doc, filler=filler,
                                    task=task, seed=seed)
        self._items = self._build_items(corpus, lo, hi, context, num_choices, seed)
        if not self._items:
            raise ValueError(f"no recall at distances {lo}..{hi} in this probe's corpus (near "
                             f"3..{near_max}, far {far_min}..{far_max})")

    def _build_items(self, corpus: RecallCorpus, lo: int, hi: int, context: int | None,
                     num_choices: int, seed: int) -> list[ChoiceItem]:
        rng = np.random.default_rng(seed)
        ans = corpus.answers
        keep = ((ans[:, 2] >= lo) & (ans[:, 2] <= hi)).nonzero().flatten().tolist()
        keep = [keep[i] for i in rng.permutation(len(keep))][:self.max_items]
        items = []
        for m in keep:
            doc, pos, _ = ans[m].tolist()
            row = corpus.input_ids[doc].tolist()
            start = 0 if context is None else max(0, pos - context)
            value = row[pos]
            alphabet = string.ascii_uppercase if chr(value).isupper() else string.ascii_lowercase
            others = [ord(c) for c in alphabet if ord(c) != value]
            choices = [value] + [int(c) for c in rng.choice(others, num_choices - 1,
                                                            replace=False)]
            order = rng.permutation(num_choices)
            items.append(ChoiceItem(tuple(row[start:pos]), tuple((choices[k],) for k in order),
                                    int(np.argmin(order)), (1,) * num_choices))
        return items


# ----------------------------------------------------------------------------- the callback
class DownstreamEval(pl.Callback):
    """Run ``probes`` every ``every_n_steps`` optimiser steps or every ``every_fraction`` of
    training (schedule: ``evaluation_steps``; the last step always), and at step 0 when
    ``at_start``. Metrics: ``<prefix>/<probe>/<metric>``, plus ``<prefix>/seconds`` (the
    evaluation's wall time). Module docstring: logging, determinism, DDP.

    The total number of steps is ``trainer.max_steps``, or ``estimated_stepping_batches`` when
    that is unset (read at ``on_train_start``, after a resume has restored the loops). The
    evaluated model is ``pl_module.model`` when the module has one (the stages do), else the
    module itself.
    """

    def __init__(self, probes: list[Probe], every_n_steps: int | None = None,
                 every_fraction: float | None = None, at_start: bool = False,
                 prefix: str = "downstream") -> None:
        super().__init__()
        if not probes:
            raise ValueError("DownstreamEval needs at least one probe")
        names = [p.name for p in probes]
        if len(set(names)) != len(names):
            raise ValueError(f"probe names must be unique, got {names!r}")
        evaluation_steps(1, every_n_steps, every_fraction)  # validates the two arguments
        self.probes = list(probes)
        self.every_n_steps, self.every_fraction = every_n_steps, every_fraction
        self.at_start, self.prefix = at_start, prefix
        self.history: list[dict] = []
        self.last_step = -1
        self._steps: tuple[int, ...] = ()

    @property
    def state_key(self) -> str:  # two instances (other prefixes) keep their own checkpoint state
        return self._generate_state_key(prefix=self.prefix)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
            raise TypeError(f"DownstreamEval evaluates on global rank 0 alone; the "
                            f"{type(trainer.strategy).__name__} shards the model, so a forward "
                            "needs every rank. Use it with single-device or DDP training.")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else \
            int(trainer.estimated_stepping_batches)
        self._steps = evaluation_steps(total, self.every_n_steps, self.every_fraction)
        dm = trainer.datamodule
        tokenizer = getattr(dm, "tokenizer", None) if dm is not None else None
        if tokenizer is None:
            from ..data.tokenization import byte_level_tokenizer

            tokenizer = byte_level_tokenizer()
        for probe in self.probes:
            probe.bind(tokenizer)
        if self.at_start and trainer.global_step == 0 and self.last_step < 0:
            self._evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step > self.last_step and step in self._steps:
            self._evaluate(trainer, pl_module)

    def state_dict(self) -> dict:
        return {"history": self.history, "last_step": self.last_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = list(state_dict["history"])
        self.last_step = int(state_dict["last_step"])

    # ------------------------------------------------------------------ work
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Every probe on ``model`` (put in eval mode, under no grad; the caller picks the
        precision): ``{"<prefix>/<probe>/<metric>": value}``."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return {f"{self.prefix}/{p.name}/{k}": float(v)
                        for p in self.probes for k, v in p.evaluate(model, device).items()}
        finally:
            model.train(was_training)

    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if trainer.is_global_zero:
            model = getattr(pl_module, "model", None)
            model = model if isinstance(model, nn.Module) else pl_module
            device = pl_module.device
            t0 = time.perf_counter()
            # probes draw nothing at random; forking keeps the training stream exact regardless
            cuda = [device.index or 0] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda), trainer.precision_plugin.forward_context():
                metrics = self.evaluate(model, device)
            metrics[f"{self.prefix}/seconds"] = time.perf_counter() - t0
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
                logger.save()
            trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
            self.history.append({"step": step, **metrics})
            log.info("step %d: %s", step, ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        self.last_step = step
        trainer.strategy.barrier("downstream_eval")
