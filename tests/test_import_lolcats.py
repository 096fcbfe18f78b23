"""``hedgecats import-lolcats`` end to end, offline, on checkpoints written in LoLCATs' format.

A tiny Llama (4 query heads, 2 key/value heads, head dim 16) stands in for the base model; its
LoLCATs checkpoints are written as their trainer writes them (``{'model_state_dict': {...},
'step': ...}``, bf16 feature maps and window factors under ``model.layers.{i}.self_attn.``,
LoRA under ``base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.default``;
``models.lolcats`` cites their code). The imported directory must load with ``from_pretrained``
and give the logits of an independent LoLCATs model: the base model with LoRA merged by hand and
an attention function that evaluates LoLCATs' formula (``lolcats_attention``) on the raw
checkpoint tensors.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from fixtures.eval.support import save_tiny_model, write_tasks
from hedgecats.cli import main as cli_main
from hedgecats.models import hybrid_layers, set_attention_mode
from hedgecats.models.lolcats import lolcats_attention, lolcats_feature_map
from transformers import AttentionInterface, AutoModelForCausalLM

H, HKV, D, LAYERS, HIDDEN, RANK, ALPHA = 4, 2, 16, 2, 64, 8, 16.0
WINDOW = 8
LORA_DIMS = {"q_proj": (HIDDEN, H * D), "k_proj": (HIDDEN, HKV * D),
             "v_proj": (HIDDEN, HKV * D), "o_proj": (H * D, HIDDEN)}


def distill_state(seed=0, layers=range(LAYERS), f=D // 2, prefix="model.") -> OrderedDict:
    g = torch.Generator().manual_seed(seed)
    sd = OrderedDict()
    for i in layers:
        for which in ("q", "k"):
            sd[f"{prefix}layers.{i}.self_attn.feature_map_{which}.mlp.layer"] = (
                torch.randn(H, D, f, generator=g) * 0.3).bfloat16()
        sd[f"{prefix}layers.{i}.self_attn.window_factors"] = (
            torch.randn(1, H, 1, 1, generator=g) - 2.0).bfloat16()
    return sd


def lora_state(seed=1, layers=range(LAYERS)) -> OrderedDict:
    g = torch.Generator().manual_seed(seed)
    sd = OrderedDict()
    for i in layers:
        for mod, (fin, fout) in LORA_DIMS.items():
            pre = f"base_model.model.model.layers.{i}.self_attn.{mod}.lora_"
            sd[pre + "A.default.weight"] = torch.randn(RANK, fin, generator=g) * 0.1
            sd[pre + "B.default.weight"] = torch.randn(fout, RANK, generator=g) * 0.1
    return sd


def save_ckpt(path: Path, sd: dict, wrapped: bool = True) -> Path:
    torch.save({"model_state_dict": sd, "step": 100, "eval/loss": 1.0} if wrapped else sd, path)
    return path


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lolcats")
    save_tiny_model(d / "base", seed=0)
    save_ckpt(d / "distill.pt", distill_state())
    save_ckpt(d / "ft.pt", lora_state())
    write_tasks(d / "tasks", n_docs=4)
    return d


def run(ws: Path, out: Path, *extra: str, lora: bool = True, distill: Path | None = None) -> int:
    args = ["import-lolcats", "--base", str(ws / "base"), "--distill",
            str(distill or ws / "distill.pt"), "--window-size", str(WINDOW), str(out), *extra]
    if lora:
        args += ["--lora", str(ws / "ft.pt")]
    return cli_main(args)


# ----------------------------------------------------------------------------- the oracle
def lolcats_model(ws: Path, atype: str, *, lora: bool, softmax_layers=()):
    """The base model run as LoLCATs runs it: LoRA merged (W + alpha/r B A), and every converted
    layer's attention replaced by their formula on the checkpoint's own tensors."""
    model = AutoModelForCausalLM.from_pretrained(ws / "base", dtype=torch.float32).eval()
    sd = distill_state()
    if lora:
        lo = lora_state()
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                for mod in LORA_DIMS:
                    pre = f"base_model.model.model.layers.{i}.self_attn.{mod}.lora_"
                    a, b = lo[pre + "A.default.weight"], lo[pre + "B.default.weight"]
                    getattr(layer.self_attn, mod).weight += ALPHA / RANK * b @ a

    def attention(module, q, k, v, attention_mask, scaling=None, **kw):
        i = module.layer_idx
        if i in softmax_layers:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, q, k, v, attention_mask, scaling=scaling, **kw)
        pre = f"model.layers.{i}.self_attn."
        fq = lolcats_feature_map(q, sd[pre + "feature_map_q.mlp.layer"].float())
        fk = lolcats_feature_map(k.repeat_interleave(H // HKV, 1),
                                 sd[pre + "feature_map_k.mlp.layer"].float())
        out = lolcats_attention(q, k, v, fq, fk, sd[pre + "window_factors"].float(),
                                window_size=WINDOW, attention_type=atype)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("lolcats_oracle", attention)
    model.set_attn_implementation("lolcats_oracle")
    return model


def ids(n=37, seed=0):
    return torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(seed))


def close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= 1e-4 * b.abs().max().item() + 1e-5, f"{what}: max abs err {err:.3g}"


# ----------------------------------------------------------------------------- imports
@pytest.mark.parametrize("atype", ["lolcats_llama_window_tk", "lolcats_llama_window_sw"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "distill-only"])
def test_imported_model_computes_lolcats(ws, tmp_path, atype, lora):
    out = tmp_path / "out"
    assert run(ws, out, "--attention-type", atype, lora=lora) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    x = ids()
    with torch.no_grad():
        ours = model(x).logits
        theirs = lolcats_model(ws, atype, lora=lora)(x).logits
        plain = AutoModelForCausalLM.from_pretrained(ws / "base", dtype=torch.float32)(x).logits
    close(ours, theirs, "logits")
    assert (ours - plain).abs().max() > 1e-2  # the conversion does something
    hc = json.loads((out / "config.json").read_text())["hybrid"]["config"]
    assert hc["window_shape"] == {"lolcats_llama_window_tk": "terraced_end",
                                  "lolcats_llama_window_sw": "sliding"}[atype]
    assert (hc["mixer"], hc["shared_norm_shift"], hc["key_map_heads"]) == (
        "shared_norm", "window_max", "query")
    assert (hc["feature_projection"], hc["feature_floor"], hc["window"]) == (
        "rectangular", 1e-12, WINDOW)
    record = json.loads((out / "lolcats_import.json").read_text())
    assert record["settings"]["attention_type"] == atype
    assert set(record["sources"]) == ({"distill", "lora"} if lora else {"distill"})
    assert (out / "tokenizer.json").is_file() and (out / "README.md").is_file()
    # the ablation modes run on it
    with torch.no_grad():
        set_attention_mode(model, "swa_only")
        swa = model(x).logits
        set_attention_mode(model, "la_only")
        la = model(x).logits
    assert torch.isfinite(swa).all() and torch.isfinite(la).all()
    assert (swa - ours).abs().max() > 1e-3 and (la - ours).abs().max() > 1e-3


def test_adapter_kept_loads_back_and_check_passes(ws, tmp_path):
    merged, kept = tmp_path / "merged", tmp_path / "kept"
    assert run(ws, merged) == 0
    assert run(ws, kept, "--keep-adapter", "--check") == 0
    assert (kept / "adapter" / "adapter_config.json").is_file()
    cfg = json.loads((kept / "adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"]) == (RANK, ALPHA)
    a = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(kept, dtype=torch.float32)
    with torch.no_grad():
        close(b(ids()).logits, a(ids()).logits, "adapter vs merged")


def test_config_yaml_softmax_layers_and_prefixes(ws, tmp_path):
    """LoLCATs' model YAML gives the settings; a layer it kept as softmax has no weights and
    stays softmax here; the bare state dict and 'model.model.' prefixes load too."""
    (tmp_path / "model.yaml").write_text(
        "name: llama\nmodel:\n  pretrained_model_name_or_path: base\n"
        "attention:\n  attention_type: lolcats_llama_window_sw\n  window_size: 8\n"
        "  state_chunk_len: 1024\n  affine_attention_factors: false\n"
        "  init_window_factor: -2.1972245773362196\n  feature_map: softmax_dim\n"
        "  feature_map_kwargs:\n    eps: 1e-12\n    fullspace: true\n"
        "  learned_kernel: untied_head_einsum\n  learned_kernel_kwargs:\n    feature_dim: 8\n"
        "    skip_connection: false\n    bias: false\n    zero_init: false\n"
        "  tie_qk_kernels: false\n  train_qk: false\n  softmax_attentions: [1]\n")
    ckpt = save_ckpt(tmp_path / "d.pt", distill_state(layers=[0], prefix="model.model."),
                     wrapped=False)
    out = tmp_path / "out"
    assert cli_main(["import-lolcats", "--base", str(ws / "base"), "--distill", str(ckpt),
                     "--config", str(tmp_path / "model.yaml"), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert [i for i, _ in hybrid_layers(model)] == [0]
    with torch.no_grad():
        theirs = lolcats_model(ws, "lolcats_llama_window_sw", lora=False, softmax_layers=(1,))
        close(model(ids()).logits, theirs(ids()).logits, "logits")


def test_finetune_config_gives_alpha_and_checks_rank(ws, tmp_path, capsys):
    ft = tmp_path / "ft.yaml"
    ft.write_text("finetune:\n  method: lora\n  kwargs:\n    r: 8\n    lora_alpha: 32\n"
                  "    lora_dropout: 0\n    target_modules: [q_proj, k_proj, v_proj, o_proj]\n")
    assert run(ws, tmp_path / "out", "--finetune-config", str(ft)) == 0
    record = json.loads((tmp_path / "out" / "lolcats_import.json").read_text())
    assert (record["lora"]["r"], record["lora"]["alpha"]) == (RANK, 32.0)
    ft.write_text("finetune:\n  method: lora\n  kwargs:\n    r: 4\n    lora_alpha: 8\n")
    assert run(ws, tmp_path / "out2", "--finetune-config", str(ft)) == 2
    assert "the LoRA tensors have rank 8, the fine-tuning config says r=4" in \
        capsys.readouterr().err


def test_tied_maps(ws, tmp_path):
    sd = distill_state()
    for i in range(LAYERS):
        del sd[f"model.layers.{i}.self_attn.feature_map_k.mlp.layer"]
    ckpt = save_ckpt(tmp_path / "tied.pt", sd)
    assert run(ws, tmp_path / "out", "--tie-qk-kernels", lora=False, distill=ckpt) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for _, attn in hybrid_layers(model):
        assert torch.equal(attn.phi_k.weight, attn.phi_q.weight)


def test_generate_with_a_terraced_window(ws, tmp_path):
    """The HybridCache cannot serve a terraced window: generate keeps a full cache, and its
    greedy tokens are those of full forwards."""
    out = tmp_path / "out"
    assert run(ws, out, lora=False) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    x = ids(20)
    with torch.no_grad():
        gen = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0)
        seq = x
        for _ in range(6):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(gen, seq)


def test_cache_refusal_and_branch_usage(ws, tmp_path):
    """The constant-memory cache names why it cannot serve the import; branch usage (an
    evaluation tool that calls the layer itself) runs with the terraced window, and LA's share
    is counted only where LA sees keys (from the third block of 8 on)."""
    from hedgecats.evaluation.branch_usage import branch_usage
    from hedgecats.models.cache import HybridCache
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    assert run(ws, out, lora=False) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with pytest.raises(ValueError, match="layer 0 cannot use a HybridCache because of its "
                                         "'terraced_end' window"):
        HybridCache(model)
    bu = branch_usage(model, AutoTokenizer.from_pretrained(out), text="abcdefghij" * 4,
                      max_tokens=36)
    first = bu["layers"][0]
    assert first["n_positions"] == 36 - 12  # blocks [0,4) [4,12) [12,20) ...: LA from 12 on
    assert all(0.0 <= x <= 1.0 for x in first["la_share"])


def test_evaluate_loads_the_directory_as_a_hybrid(ws, tmp_path):
    """What ``hedgecats evaluate --model DIR`` does with it before lm-eval runs: the directory
    counts as converted (ablation modes allowed) and loads as the imported hybrid."""
    from hedgecats.evaluation.cli import _is_hybrid_directory
    from hedgecats.evaluation.loading import load_for_eval

    out = tmp_path / "imported"
    assert run(ws, out) == 0
    assert _is_hybrid_directory(str(out)) and not _is_hybrid_directory(str(ws / "base"))
    loaded = load_for_eval(str(out))
    assert [i for i, _ in hybrid_layers(loaded.model)] == list(range(LAYERS))
    assert loaded.tokenizer is not None


@pytest.mark.slow
def test_evaluate_runs_on_the_directory(ws, tmp_path):
    """The whole ``hedgecats evaluate`` on an imported conversion (lm-eval on a local task)."""
    from hedgecats.evaluation.cli import main as evaluate_main

    out = tmp_path / "imported"
    assert run(ws, out) == 0
    res = tmp_path / "res"
    assert evaluate_main(["--model", str(out), "--tasks", str(ws / "tasks" / "toy_acc.yaml"),
                          "--modes", "hybrid,swa_only,la_only", "--batch-size", "1",
                          "--bootstrap-iters", "10", "--device", "cpu", "-q",
                          "--output", str(res)]) == 0
    results = json.loads((res / "results.json").read_text())
    assert {"hybrid", "swa_only", "la_only"} <= set(results["modes"])


# ----------------------------------------------------------------------------- bad input
def _edit(sd, changes: dict):
    """A copy of ``sd`` with ``changes``: a tensor sets the key, ``None`` deletes it."""
    sd = OrderedDict(sd)
    for k, v in changes.items():
        if v is None:
            del sd[k]
        else:
            sd[k] = v
    return sd


L0, L1 = "model.layers.0.self_attn.", "model.layers.1.self_attn."
P0, P1 = "base_model.model.model.layers.0.self_attn.", "base_model.model.model.layers.1.self_attn."


BAD_DISTILL = {
    "missing-layer": (
        _edit(distill_state(), {L1 + "feature_map_q.mlp.layer": None,
                                L1 + "feature_map_k.mlp.layer": None,
                                L1 + "window_factors": None}),
        (r"model\.layers\.1\.self_attn\.feature_map_q\.mlp\.layer is missing: expected a "
         r"\(4, 16, f\) tensor for layer 1 of 2; if LoLCATs kept layer 1 as softmax attention.*"
         r"--softmax-layers 1")),
    "wrong-heads": (
        _edit(distill_state(), {L0 + "feature_map_k.mlp.layer": torch.zeros(2, 16, 8)}),
        (r"model\.layers\.0\.self_attn\.feature_map_k\.mlp\.layer has shape \(2, 16, 8\), "
         r"expected \(4, 16, f\)")),
    "feature-dim": (
        distill_state(f=5),
        r"feature dimension 5 .* expected 16 \(square\) or 8 \(rectangular\)"),
    "unknown-key": (
        _edit(distill_state(), {L0 + "q_proj.weight": torch.zeros(64, 64)}),
        r"unexpected keys \['model\.layers\.0\.self_attn\.q_proj\.weight'\]"),
    "lora-in-distill": (
        OrderedDict({**distill_state(), **lora_state(layers=[0])}),
        r"unexpected keys .*lora_A.*LoRA tensors belong in --lora"),
    "layer-out-of-range": (
        distill_state(layers=range(3)),
        r"the checkpoint has layers \[2\], the base model only 2"),
    "factor-shape": (
        _edit(distill_state(), {L1 + "window_factors": torch.zeros(1, 3, 1, 1)}),
        (r"model\.layers\.1\.self_attn\.window_factors has shape \(1, 3, 1, 1\), expected "
         r"\(1, 4, 1, 1\)")),
}


@pytest.mark.parametrize("case", list(BAD_DISTILL))
def test_bad_distill_checkpoints_are_named(ws, tmp_path, capsys, case):
    sd, pattern = BAD_DISTILL[case]
    ckpt = save_ckpt(tmp_path / "bad.pt", sd)
    assert run(ws, tmp_path / "out", lora=False, distill=ckpt) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    assert not (tmp_path / "out").exists()


BAD_LORA = {
    "shape": (
        _edit(lora_state(), {P0 + "k_proj.lora_B.default.weight": torch.zeros(64, RANK)}),
        (r"base_model\.model\.model\.layers\.0\.self_attn\.k_proj\.lora_B\.default\.weight "
         r"has shape \(64, 8\), expected \(32, 8\)")),
    "partner": (
        _edit(lora_state(), {P1 + "v_proj.lora_B.default.weight": None}),
        (r"'base_model\.model\.model\.layers\.1\.self_attn\.v_proj\.lora_A\.default\.weight' "
         r"has no partner")),
    "empty": (OrderedDict(), r"holds no state dict"),
}


@pytest.mark.parametrize("case", list(BAD_LORA))
def test_bad_lora_checkpoints_are_named(ws, tmp_path, capsys, case):
    sd, pattern = BAD_LORA[case]
    bad = save_ckpt(tmp_path / "ft_bad.pt", sd)
    rc = cli_main(["import-lolcats", "--base", str(ws / "base"), "--distill",
                   str(ws / "distill.pt"), "--lora", str(bad), str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err


@pytest.mark.parametrize("args,pattern", [
    (["--attention-type", "lolcats_llama_window_xx"],
     (r"attention_type 'lolcats_llama_window_xx' is unknown; supported: "
      r"lolcats_llama_window_tk, lolcats_llama_window_sw")),
    (["--attention-type", "lolcats_llama"], r"is not imported: pure linear attention"),
    (["--attention-type", "lolcats_llama_window_tk_gen"],
     r"import it with --attention-type lolcats_llama_window_tk"),
    (["--softmax-layers", "0"], r"layers \[0\] have LoLCATs weights but are listed as softmax"),
], ids=["unknown-type", "pure-linear", "tk-gen", "softmax-layer-with-weights"])
def test_bad_settings_are_named(ws, tmp_path, capsys, args, pattern):
    assert run(ws, tmp_path / "out", *args, lora=False) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err


def test_bad_files_are_named(ws, tmp_path, capsys):
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    assert run(ws, tmp_path / "o1", lora=False, distill=tmp_path / "notes.pt") == 2
    assert "is not a readable LoLCATs checkpoint" in capsys.readouterr().err
    assert run(ws, tmp_path / "o2", lora=False, distill=tmp_path / "nowhere.pt") == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "relu.yaml").write_text("attention:\n  attention_type: lolcats_llama_window_tk\n"
                                        "  feature_map: relu\n")
    assert run(ws, tmp_path / "o3", "--config", str(tmp_path / "relu.yaml"), lora=False) == 2
    assert "feature_map='relu' with fullspace=True is not imported" in capsys.readouterr().err
    (tmp_path / "o4").mkdir()
    (tmp_path / "o4" / "x").write_text("keep me")
    assert run(ws, tmp_path / "o4", lora=False) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "o4" / "x").read_text() == "keep me"
