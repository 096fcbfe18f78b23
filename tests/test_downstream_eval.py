"""DownstreamEval and its probes: the schedule, the scorers against hand-written references
(an oracle model with known logits, a rule-based recall model, per-sequence log-likelihoods),
and the callback through a real Trainer with a tiny model: logged next to the loss, at the
scheduled steps, without changing training."""

import csv
import json
import math
import string
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from hedgecats.lightning_modules import (
    ChoiceProbe,
    DownstreamEval,
    RecallChoiceProbe,
    RecallDataModule,
    RecallProbe,
    TeacherPretraining,
    evaluation_steps,
)
from hedgecats.lightning_modules.downstream_eval import ChoiceItem, score_choices
from hedgecats.models.pretrain import PretrainConfig, build_pretrain_model
from lightning.pytorch.loggers import CSVLogger
from torch import nn

V = 259
CORPUS = {"seq_len": 96, "near_max": 15, "far_min": 40, "far_max": 80, "facts_per_doc": 4}


# ----------------------------------------------------------------------------- schedule
@pytest.mark.parametrize("total, n, f, want", [
    (100, 30, None, (30, 60, 90, 100)),
    (100, None, 0.25, (25, 50, 75, 100)),
    (10, None, 0.3, (3, 6, 9, 10)),
    (7, 10, None, (7,)),
    (5, None, 1.0, (5,)),
    (3, None, 0.1, (1, 2, 3)),
])
def test_evaluation_steps(total, n, f, want):
    assert evaluation_steps(total, n, f) == want


@pytest.mark.parametrize("kw, match", [
    ({}, r"exactly one of every_n_steps \(None\) and every_fraction \(None\)"),
    ({"every_n_steps": 5, "every_fraction": 0.5}, r"exactly one"),
    ({"every_n_steps": 0}, r"every_n_steps=0 must be an int >= 1"),
    ({"every_fraction": 1.5}, r"every_fraction=1.5 must lie in \(0, 1\]"),
])
def test_bad_schedules_fail_when_the_callback_is_built(kw, match):
    with pytest.raises(ValueError, match=match):
        DownstreamEval([RecallProbe(num_docs=2, **CORPUS)], **kw)


# ----------------------------------------------------------------------------- reference models
class Oracle(nn.Module):
    """Looks at the next token (cheating) and puts logit 5 on it, except at the recalled values
    of ``wrong`` answers, where it puts 5 on another token. Its losses are known in closed form."""

    def __init__(self, corpus, wrong):
        super().__init__()
        self.corpus, self.wrong = corpus, wrong
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids):
        B, T = input_ids.shape
        logits = torch.zeros(B, T, V)
        target = torch.roll(input_ids, -1, dims=1)
        logits.scatter_(2, target[..., None], 5.0)
        for b in range(B):  # find the row in the corpus to know its answers
            doc = int((self.corpus.input_ids == input_ids[b].cpu()).all(1).nonzero()[0])
            for m in self.wrong:
                d, p, _ = self.corpus.answers[m].tolist()
                if d == doc:
                    logits[b, p - 1] = 0.0
                    logits[b, p - 1, (input_ids[b, p] + 1) % 256] = 5.0
        return SimpleNamespace(logits=logits)


def test_recall_probe_against_an_oracle():
    probe = RecallProbe(num_docs=6, **CORPUS, buckets=[[3, 15], [40, 59], [60, 80]], batch_size=4)
    ans = probe.corpus.answers
    far = (ans[:, 2] >= 60).nonzero().flatten().tolist()
    out = probe.evaluate(Oracle(probe.corpus, far), torch.device("cpu"))
    z = math.exp(5) + V - 1  # the oracle's softmax normaliser
    right, wrong = -math.log(math.exp(5) / z), -math.log(1 / z)
    n_tok = probe.corpus.input_ids.numel() - len(probe.corpus.input_ids)
    assert out["d3-15/acc"] == 1.0 and out["d40-59/acc"] == 1.0 and out["d60-80/acc"] == 0.0
    assert out["d3-15/loss"] == pytest.approx(right) and out["d60-80/loss"] == pytest.approx(wrong)
    assert out["acc"] == pytest.approx(1 - len(far) / len(ans))
    # every document has T-1 predictions; the wrong answers cost (wrong - right) each
    per_doc = torch.full((6,), right)
    for m in far:
        per_doc[ans[m, 0]] += (wrong - right) / (CORPUS["seq_len"] - 1)
    assert out["lm_loss"] == pytest.approx(per_doc.mean().item(), rel=1e-5)
    assert out["lm_loss_se"] == pytest.approx(per_doc.std().item() / math.sqrt(6), rel=1e-4)
    assert n_tok == 6 * 95


def test_recall_probe_buckets_are_checked():
    default = RecallProbe(num_docs=4, **CORPUS)
    assert default.buckets[0][0] == "near"
    with pytest.raises(ValueError, match=r"bucket 'd20-30' \(20..30\) holds no recall.*near "
                                         r"distances are 3..15, far ones 40..80"):
        RecallProbe(num_docs=4, **CORPUS, buckets=[[20, 30]])
    with pytest.raises(ValueError, match=r"bucket \[9, 3\] is not valid"):
        RecallProbe(num_docs=4, **CORPUS, buckets=[[9, 3]])


class RecallRule(nn.Module):
    """A hand-written solver of the kv task: after '?K' it predicts the letter that followed
    '#K' earlier in its input (logit 10), or 'a' when it cannot find one."""

    def __init__(self):
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids):
        B, T = input_ids.shape
        logits = torch.zeros(B, T, V)
        for b in range(B):
            row = input_ids[b].tolist()
            for t in range(1, T):
                guess = ord("a")
                if row[t - 1] == ord("?") and chr(row[t]).isupper():
                    for f in range(t - 2, 0, -1):
                        if row[f - 1] == ord("#") and row[f] == row[t] and f + 1 < T:
                            guess = row[f + 1]
                            break
                logits[b, t, guess] = 10.0
        return SimpleNamespace(logits=logits)


def test_recall_choice_items_and_scores():
    full = RecallChoiceProbe(num_docs=6, **CORPUS, distances=[40, 80], max_items=12, seed=3)
    again = RecallChoiceProbe(num_docs=6, **CORPUS, distances=[40, 80], max_items=12, seed=3)
    assert full.items == again.items and len(full.items) == 12
    for it in full.items:
        assert chr(it.context[-1]).isupper() and it.context[-2] == ord("?")
        gold = it.choices[it.gold][0]
        assert all(chr(c[0]) in string.ascii_lowercase for c in it.choices)
        assert len({c[0] for c in it.choices}) == 4 and gold not in it.context[-2:]
    # the rule finds the fact in the whole prefix: every item right
    assert full.evaluate(RecallRule(), torch.device("cpu"))["acc"] == 1.0
    # a short context holds the fact only for near recalls
    near = RecallChoiceProbe(num_docs=6, **CORPUS, distances=[3, 15], context=17, seed=3)
    assert near.evaluate(RecallRule(), torch.device("cpu"))["acc"] == 1.0
    assert all(len(it.context) <= 17 for it in near.items)
    with pytest.raises(ValueError, match=r"context=17 cannot reach a fact 80 tokens back"):
        RecallChoiceProbe(num_docs=6, **CORPUS, distances=[40, 80], context=17)


def _tiny_model(seed=0):
    cfg = PretrainConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=2,
                         intermediate_size=48, max_position_embeddings=128)
    return build_pretrain_model(cfg, seed=seed).eval()


def _reference_logprob(model, context, choice):
    ids = torch.tensor([list(context) + list(choice)])
    logp = model(input_ids=ids).logits.float().log_softmax(-1)[0]
    return sum(logp[len(context) - 1 + k, tok].item() for k, tok in enumerate(choice))


def test_score_choices_against_per_sequence_log_likelihoods():
    model = _tiny_model()
    g = torch.Generator().manual_seed(0)

    def rand(n):
        return tuple(torch.randint(0, 256, (n,), generator=g).tolist())

    single = [ChoiceItem(rand(5 + i), tuple((c,) for c in rand(3)), 0, (1, 1, 1))
              for i in range(5)]
    multi = [ChoiceItem(rand(4 + i), (rand(1), rand(3), rand(2)), 1, (1, 3, 2)) for i in range(4)]
    with torch.no_grad():
        for items in (single, multi, single + multi):  # fast path, general path, mixed
            got = score_choices(model, items, batch_size=3, device="cpu")
            want = [[_reference_logprob(model, it.context, c) for c in it.choices] for it in items]
            for g_row, w_row in zip(got, want):
                assert g_row == pytest.approx(w_row, rel=1e-5, abs=1e-5)


def test_choice_probe_reads_jsonl_and_scores_acc_and_acc_norm(tmp_path):
    from hedgecats.data.tokenization import byte_level_tokenizer

    path = tmp_path / "tasks.jsonl"
    rows = [{"context": "the cat sat on the", "choices": [" mat", " hat rack", " x"], "gold": 0},
            {"context": "one two", "choices": [" three", " four"], "gold": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    probe = ChoiceProbe("toy", path=str(path))
    with pytest.raises(RuntimeError, match="call bind"):
        probe.evaluate(_tiny_model(), torch.device("cpu"))
    probe.bind(byte_level_tokenizer())
    model = _tiny_model()
    with torch.no_grad():
        out = probe.evaluate(model, torch.device("cpu"))
        acc, norm = [], []
        for r in rows:
            s = [_reference_logprob(model, r["context"].encode(), c.encode()) for c in r["choices"]]
            acc.append(max(range(len(s)), key=s.__getitem__) == r["gold"])
            n = [v / len(c) for v, c in zip(s, r["choices"])]
            norm.append(max(range(len(n)), key=n.__getitem__) == r["gold"])
    assert out == {"acc": sum(acc) / 2, "acc_norm": sum(norm) / 2, "n": 2}
    path.write_text('{"context": "a", "choices": ["b"], "gold": 0}\n')
    with pytest.raises(ValueError, match=r"tasks.jsonl:1: .* need \{\"context\": str"):
        ChoiceProbe("bad", path=str(path))


# ----------------------------------------------------------------------------- the callback
DM = {"seq_len": 96, "window": 16, "far_min": 40, "far_max": 80, "facts_per_doc": 4,
      "num_train": 48, "num_val": 4, "num_test": 4, "batch_size": 4}


def _probes():
    return [RecallProbe(num_docs=4, **CORPUS, batch_size=4),
            RecallChoiceProbe(num_docs=4, **CORPUS, distances=[3, 15], context=17, max_items=8)]


class LossRecorder(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _fit(root, callbacks, steps=6, logger=True):
    pl.seed_everything(0)
    module = TeacherPretraining(hidden_size=32, num_layers=2, num_heads=2, warmup_steps=2,
                                max_position_embeddings=128, attention_pattern="SF",
                                sliding_window=16, output_gate="elementwise")
    tr = pl.Trainer(max_steps=steps, default_root_dir=str(root), enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                    log_every_n_steps=1,
                    logger=CSVLogger(str(root), name="logs", version="v") if logger else False,
                    callbacks=callbacks)
    tr.fit(module, datamodule=RecallDataModule(**DM))
    return module, tr


def test_callback_logs_next_to_the_loss_without_changing_training(tmp_path):
    rec_with, rec_without = LossRecorder(), LossRecorder()
    cb = DownstreamEval(_probes(), every_fraction=0.5, at_start=True)
    module, tr = _fit(tmp_path / "with", [cb, rec_with])
    _fit(tmp_path / "without", [rec_without], logger=False)
    assert rec_with.losses == rec_without.losses  # bit for bit

    assert [h["step"] for h in cb.history] == [0, 3, 6]
    with (tmp_path / "with" / "logs" / "v" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    by_step = {}
    for r in rows:
        for k, v in r.items():
            if v != "":
                by_step.setdefault(int(r["step"]), {})[k] = v
    assert {s for s, r in by_step.items() if "downstream/recall/acc" in r} == {0, 3, 6}
    assert all("train/loss" in by_step[s] for s in (3, 5))  # the loss in the same file
    for key in ("downstream/recall/lm_loss", "downstream/recall/near/acc",
                "downstream/recall_choice/acc", "downstream/recall_choice/acc_norm",
                "downstream/seconds"):
        assert key in by_step[6], key
    # the last evaluation is what the probes say of the final model
    direct = cb.evaluate(module.model, torch.device("cpu"))
    assert {k: v for k, v in cb.history[-1].items() if k in direct} == direct
    assert tr.callback_metrics["downstream/recall/acc"].item() == direct["downstream/recall/acc"]


def test_callback_state_resumes_without_repeating_an_evaluation(tmp_path):
    cb = DownstreamEval(_probes()[:1], every_n_steps=2)
    _fit(tmp_path, [cb], steps=4, logger=False)
    assert [h["step"] for h in cb.history] == [2, 4]
    again = DownstreamEval(_probes()[:1], every_n_steps=2)
    again.load_state_dict(cb.state_dict())
    assert again.history == cb.history and again.last_step == 4
    fake = SimpleNamespace(global_step=4)
    again._steps = (2, 4)
    again.on_train_batch_end(fake, None, None, None, 0)  # step 4 was done: nothing runs
    assert len(again.history) == 2


def test_sharded_strategies_are_refused():
    from lightning.pytorch.strategies import ModelParallelStrategy

    cb = DownstreamEval(_probes()[:1], every_n_steps=1)
    trainer = SimpleNamespace(strategy=ModelParallelStrategy())
    with pytest.raises(TypeError, match="ModelParallelStrategy shards the model"):
        cb.setup(trainer, None, "fit")
