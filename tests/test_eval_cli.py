"""``hedgecats evaluate`` end to end, offline, on a tiny converted Llama and two local tasks.

The table is checked against scores computed here independently of lm-eval: our own
log-likelihood of every choice under the model in each mode, argmax -> acc, and argmax of
log-likelihood / characters -> acc_norm.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from fixtures.eval.support import byte_tokenizer, save_tiny_model, write_hellaswag_copy, write_tasks
from hedgecats.evaluation.cli import main
from hedgecats.models import HybridConfig, attention_mode, convert_to_hybrid

MODES = "hybrid,swa_only,la_only+la_span=all"
WINDOW = 8


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("eval")
    save_tiny_model(d / "model", seed=0)
    save_tiny_model(d / "other", seed=1)
    write_tasks(d / "tasks")
    (d / "hybrid.yaml").write_text(f"# HybridConfig fields\nwindow: {WINDOW}\nseed: 0\n")
    return d


@pytest.fixture(scope="module")
def run_dir(workspace) -> Path:
    out = workspace / "out"
    rc = main(["--model", str(workspace / "model"), "--hybrid", str(workspace / "hybrid.yaml"),
               "--tasks", str(workspace / "tasks"), "--modes", MODES,
               "--metric", "toy_norm=acc_norm", "--bootstrap-iters", "10",
               "--retrieval", "--retrieval-docs", "2", "--branch-usage", "--branch-usage-tokens",
               "200", "--output", str(out)])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def our_model(workspace):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(workspace / "model", dtype=torch.float32).eval()
    return convert_to_hybrid(model, HybridConfig(window=WINDOW, seed=0))


def _our_scores(model, task_dir: Path, mode: str, switches: dict) -> dict[str, dict]:
    """Independent acc / acc_norm and their stderr (sample sd / sqrt(n)) per task, in percent.

    Every (context, choice) of a task goes through the model in one right-padded batch: with
    causal attention the padding after a sequence cannot change its log-likelihoods.
    """
    tok = byte_tokenizer()
    out = {}
    for task in ("toy_acc", "toy_norm"):
        docs = [json.loads(x) for x in (task_dir / f"{task}.jsonl").read_text().splitlines()]
        seqs = [(tok(d["question"]).input_ids, tok(" " + c).input_ids) for d in docs for c in d["choices"]]
        T = max(len(a) + len(b) for a, b in seqs)
        ids_BT = torch.full((len(seqs), T), tok.pad_token_id)
        for i, (a, b) in enumerate(seqs):
            ids_BT[i, :len(a) + len(b)] = torch.tensor(a + b)
        with attention_mode(model, mode, **switches), torch.no_grad():
            logp_BTV = model(ids_BT).logits.log_softmax(-1)
        lls = []
        for i, (a, b) in enumerate(seqs):
            pos = torch.arange(len(a) - 1, len(a) + len(b) - 1)
            lls.append(logp_BTV[i, pos, ids_BT[i, pos + 1]].sum().item())
        hits, hits_norm, k = [], [], 0
        for doc in docs:
            ll = lls[k:k + len(doc["choices"])]
            k += len(doc["choices"])
            norm = [x / len(c) for x, c in zip(ll, doc["choices"])]
            hits.append(float(max(range(len(ll)), key=ll.__getitem__) == doc["label"]))
            hits_norm.append(float(max(range(len(norm)), key=norm.__getitem__) == doc["label"]))
        metric, arr = ("acc", hits) if task == "toy_acc" else ("acc_norm", hits_norm)
        n = len(arr)
        mean = sum(arr) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in arr) / (n - 1))
        out[task] = {"metric": metric, "score": 100 * mean, "stderr": 100 * sd / math.sqrt(n),
                     "per_doc": arr}
    return out


def test_outputs_and_table_arithmetic(run_dir, workspace, our_model):
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "branch_usage.png", "results.csv", "results.json", "results.md"]
    assert not [p for p in run_dir.parent.iterdir() if p.name.startswith(".out.")]  # no temp left
    res = json.loads((run_dir / "results.json").read_text())
    assert list(res["modes"]) == MODES.split(",")
    assert res["modes"]["la_only+la_span=all"]["mode"] == "la_only"
    assert res["modes"]["la_only+la_span=all"]["switches"] == {"la_span": "all"}
    assert res["meta"]["lm_eval_version"] == "0.4.13"
    assert "softmax" in res["baseline"]["source"]

    # every score equals the one computed here without lm-eval
    ours = {"baseline": _our_scores(our_model, workspace / "tasks", "softmax", {})}
    for label, row in res["modes"].items():
        ours[label] = _our_scores(our_model, workspace / "tasks", row["mode"], row["switches"])
    rows = {"baseline": res["baseline"], **res["modes"]}
    for label, row in rows.items():
        for task in ("toy_acc", "toy_norm"):
            got, want = row["tasks"][task], ours[label][task]
            assert got["metric"] == want["metric"], (label, task)
            assert got["score"] == pytest.approx(want["score"], abs=1e-9), (label, task)
            assert got["stderr"] == pytest.approx(want["stderr"], rel=1e-6), (label, task)
    # modes must actually differ, otherwise the comparison above proves little
    assert len({tuple(r["tasks"][t]["score"] for t in ("toy_acc", "toy_norm")) for r in rows.values()}) >= 3

    # AVG, its stderr, Rec. Perf and Delta_LA from our own numbers
    def avg(label):
        return sum(ours[label][t]["score"] for t in ours[label]) / 2

    def avg_se(label):
        return math.sqrt(sum(ours[label][t]["stderr"] ** 2 for t in ours[label])) / 2

    assert res["baseline"]["avg"] == pytest.approx(avg("baseline"))
    for label, row in res["modes"].items():
        assert row["avg"] == pytest.approx(avg(label))
        assert row["avg_stderr"] == pytest.approx(avg_se(label))
        assert row["rec_perf"] == pytest.approx(avg(label) / avg("baseline") * 100)
    assert res["delta_la"] == pytest.approx(avg("hybrid") - avg("swa_only"))
    assert res["delta_la_stderr"] == pytest.approx(math.hypot(avg_se("hybrid"), avg_se("swa_only")))
    # paired over documents: stderr of the per-document differences, combined over tasks
    ses = []
    for t in ("toy_acc", "toy_norm"):
        d = [100 * (a - b) for a, b in zip(ours["hybrid"][t]["per_doc"], ours["swa_only"][t]["per_doc"])]
        m = sum(d) / len(d)
        ses.append(math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1)) / math.sqrt(len(d)))
    assert res["delta_la_stderr_paired"] == pytest.approx(math.hypot(*ses) / 2)
    assert res["delta_la_stderr_paired"] > 0


def test_markdown_and_csv_layout(run_dir):
    res = json.loads((run_dir / "results.json").read_text())
    md = (run_dir / "results.md").read_text()
    lines = [x for x in md.split("\n## ")[0].splitlines() if x.startswith("|")]  # the main table
    assert lines[0] == "| mode | toy_acc (acc) | toy_norm (acc_norm) | AVG | Rec. Perf |"
    assert lines[2].startswith("| baseline: ")
    labels = [x.split("|")[1].strip() for x in lines[3:]]
    assert labels == MODES.split(",")
    la = lines[3 + labels.index("la_only+la_span=all")].split("|")
    row = res["modes"]["la_only+la_span=all"]
    assert la[4].strip() == f"{row['avg']:.2f} ± {row['avg_stderr']:.2f}"
    assert la[5].strip().startswith(f"{row['rec_perf']:.2f}")
    assert (f"Delta_LA = AVG(hybrid) - AVG(swa_only) = {res['delta_la']:+.2f} ± "
            f"{res['delta_la_stderr_paired']:.2f} points (paired over the same documents)") in md

    with open(run_dir / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["row"] for r in table] == ["baseline"] + MODES.split(",")
    for r in table[1:]:
        m = res["modes"][r["row"]]
        assert float(r["AVG"]) == pytest.approx(m["avg"])
        assert float(r["Rec. Perf"]) == pytest.approx(m["rec_perf"])
        assert float(r["toy_norm"]) == pytest.approx(m["tasks"]["toy_norm"]["score"])
        assert float(r["toy_norm_stderr"]) == pytest.approx(m["tasks"]["toy_norm"]["stderr"])


def test_separate_baseline_and_plain_model(workspace, tmp_path, capsys):
    """A plain model evaluated as is ('softmax'), against another model as the baseline."""
    out = tmp_path / "plain"
    rc = main(["--model", str(workspace / "model"), "--modes", "softmax",
               "--baseline", str(workspace / "other"), "--tasks", str(workspace / "tasks"),
               "--bootstrap-iters", "10", "--limit", "8", "--output", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["baseline"]["source"] == str(workspace / "other")
    assert res["meta"]["model_source"] == "transformers"
    assert res["delta_la"] is None
    row = res["modes"]["softmax"]
    assert row["rec_perf"] == pytest.approx(row["avg"] / res["baseline"]["avg"] * 100)
    assert row["tasks"]["toy_norm"]["metric"] == "acc"  # no override: acc before acc_norm
    printed = capsys.readouterr().out
    assert "| softmax |" in printed and str(out) in printed


def test_seeds_report_spread(workspace, tmp_path):
    out = tmp_path / "seeds"
    rc = main(["--model", str(workspace / "model"), "--hybrid", str(workspace / "hybrid.yaml"),
               "--modes", "hybrid,swa_only", "--seeds", "0,1", "--limit", "8", "--tasks",
               str(workspace / "tasks" / "toy_norm.yaml"), "--metric", "toy_norm=acc_norm",
               "--bootstrap-iters", "10", "-q", "--output", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["seeds"] == [0, 1] and len(res["per_seed"]) == 2
    hyb = res["modes"]["hybrid"]
    per = [s["hybrid"]["avg"] for s in res["per_seed"]]
    assert hyb["avg"] == pytest.approx(sum(per) / 2)
    assert hyb["avg_seeds"]["values"] == pytest.approx(per)
    mean = sum(per) / 2
    assert hyb["avg_seeds"]["std"] == pytest.approx(math.sqrt(sum((p - mean) ** 2 for p in per) / 1))
    deltas = [s["hybrid"]["avg"] - s["swa_only"]["avg"] for s in res["per_seed"]]
    assert res["delta_la_seeds"]["mean"] == pytest.approx(sum(deltas) / 2)
    assert res["delta_la"] == pytest.approx(sum(deltas) / 2)
    # the softmax baseline does not depend on the feature-map seed: evaluated once
    assert res["baseline"]["avg"] is not None
    assert "sd over 2 runs" in (out / "results.md").read_text()


def test_retrieval_in_report(run_dir):
    res = json.loads((run_dir / "results.json").read_text())
    r = res["retrieval"]
    assert r["window"] == WINDOW
    assert list(r["modes"]) == MODES.split(",") + ["softmax"]
    for row in r["modes"].values():
        assert sum(row[b]["n"] for b in ("inside", "1-4x", "4-16x", "beyond")) == 2 * 4
    md = (run_dir / "results.md").read_text()
    assert "## Retrieval beyond the window" in md and "| la_only+la_span=all |" in md


def test_branch_usage_in_report(run_dir):
    res = json.loads((run_dir / "results.json").read_text())
    bu = res["branch_usage"]
    assert bu["mode"] == "hybrid" and bu["n_tokens"] == 200
    assert [layer["layer"] for layer in bu["layers"]] == [0, 1]
    for layer in bu["layers"]:
        assert len(layer["la_share"]) == 4 and all(0.0 <= x <= 1.0 for x in layer["la_share"])
    assert (run_dir / "branch_usage.png").read_bytes()[:4] == b"\x89PNG"
    assert "## Branch usage" in (run_dir / "results.md").read_text()


def test_tasks_none_runs_the_probes_only(workspace, run_dir, tmp_path, capsys):
    """``--tasks none``: no lm-eval task (no task data needed), the same probes as with tasks."""
    out = tmp_path / "probes"
    rc = main(["--model", str(workspace / "model"), "--hybrid", str(workspace / "hybrid.yaml"),
               "--tasks", "none", "--modes", MODES, "--retrieval", "--retrieval-docs", "2",
               "--branch-usage", "--branch-usage-tokens", "200", "-q", "--output", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    full = json.loads((run_dir / "results.json").read_text())
    assert res["tasks"] == [] and res["baseline"] is None and res["delta_la"] is None
    assert list(res["modes"]) == MODES.split(",")
    assert all(row["avg"] is None and row["tasks"] == {} for row in res["modes"].values())
    assert res["retrieval"] == full["retrieval"]  # the same probe as beside the tasks
    assert res["branch_usage"]["layers"] == full["branch_usage"]["layers"]
    md = (out / "results.md").read_text()
    assert "No lm-eval tasks (`--tasks none`)" in md and "## Retrieval beyond the window" in md
    assert "Rec. Perf" not in md and "Delta_LA" not in md  # no empty task table
    from hedgecats.evaluation.report import read_results

    assert read_results(out)["modes"].keys() == res["modes"].keys()
    rows = list(csv.reader((out / "results.csv").open()))
    assert rows[0][:2] == ["row", "kind"] and len(rows) == 1 + len(MODES.split(","))


@pytest.mark.parametrize("extra, message", [
    ([], "nothing to evaluate"),
    (["--retrieval", "--tasks", "toy"], "cannot be combined"),
    (["--retrieval", "--baseline", "x"], "--baseline applies to lm-eval's scores"),
    (["--retrieval", "--metric", "toy=acc"], "--metric applies"),
    (["--retrieval", "--model", "second"], "several --model checkpoints"),
])
def test_tasks_none_refuses_what_it_cannot_do(workspace, tmp_path, capsys, extra, message):
    rc = main(["--model", str(workspace / "model"), "--hybrid", str(workspace / "hybrid.yaml"),
               "--tasks", "none", "--modes", "hybrid", *extra, "--output", str(tmp_path / "o")])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_paper_metric_on_a_copy_of_lm_evals_hellaswag(workspace, tmp_path):
    """lm-eval's own hellaswag task code on local data: scored by acc_norm without --metric."""
    hs = write_hellaswag_copy(tmp_path / "hellaswag")
    out = tmp_path / "hs"
    rc = main(["--model", str(workspace / "model"), "--hybrid", str(workspace / "hybrid.yaml"),
               "--tasks", f"{hs},{workspace / 'tasks' / 'toy_acc.yaml'}", "--modes", "softmax",
               "--bootstrap-iters", "10", "-q", "--output", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["tasks"] == ["hellaswag", "toy_acc"]
    row = res["modes"]["softmax"]
    assert row["tasks"]["hellaswag"]["metric"] == "acc_norm"
    assert row["tasks"]["hellaswag"]["n"] == 8
    assert row["tasks"]["toy_acc"]["metric"] == "acc"
    assert res["baseline"]["tasks"] == row["tasks"]  # the softmax row is the baseline: run once
