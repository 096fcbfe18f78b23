"""Hybrids as transformers-native models: save_pretrained / AutoModelForCausalLM.from_pretrained
round trips bit-exactly in every mode, LoRA merged or kept as an adapter, push_to_hub up to the
upload, and clear errors for what is not a hybrid or does not match."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import hedgecats
import pytest
import torch
from hedgecats.models import HybridConfig, attention_mode, convert_to_hybrid, set_attention_mode
from hedgecats.models.cache import HybridCache, generated_cache
from hedgecats.models.stage_files import add_lora
from hedgecats.models.hf import (
    HedgecatsLlamaForCausalLM,
    hybrid_section,
    load_pretrained_hybrid,
    save_hybrid,
)
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
MODES = ("hybrid", "swa_only", "la_only", "sinks_only", "none", "softmax")
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    # Mistral with its own window (shorter than the test sequences), one layer left softmax
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=9)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)),
}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def hybrid(family="llama", cfg: HybridConfig | None = None, seed=0):
    torch.manual_seed(seed)
    model = FAMILIES[family]().eval()
    convert_to_hybrid(model, cfg or HybridConfig(window=4, layer_windows={2: 6},
                                                 mixer="learned_head"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".phi_" in n or ".mixer." in n:
                p.add_(0.2 * torch.randn_like(p))
    return model


def ids(B=2, T=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (B, T), generator=g)


def logits_by_mode(model, x) -> dict[str, torch.Tensor]:
    out = {}
    with torch.no_grad():
        for mode in MODES:
            with attention_mode(model, mode):
                out[mode] = model(x).logits
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_is_bit_identical_in_every_mode(family, tmp_path):
    cfg = HybridConfig(window=4, layer_windows={2: 6}, mixer="learned_head",
                       layers=[0, 2] if family == "mistral" else None)
    model = hybrid(family, cfg)
    x = ids()
    want = logits_by_mode(model, x)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == f"hedgecats_{family}"
    assert saved["architectures"] == [type(model).__name__]
    assert saved["hybrid"]["config"]["layer_windows"] == {"2": 6}
    if family == "mistral":
        assert saved["hybrid"]["base_sliding_window"] == 9 and saved["sliding_window"] is None
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    got = logits_by_mode(loaded, x)
    for mode in MODES:
        assert torch.equal(got[mode], want[mode]), mode


def test_bf16_round_trip_is_bit_identical_in_every_mode(tmp_path):
    """A bf16 hybrid (built as ``from_pretrained(dtype=bf16)`` builds one: feature maps fp32,
    rotary inv_freq fp32) reloads in bf16 with the same logits in every mode."""
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**SMALL), dtype=torch.bfloat16).eval()
    convert_to_hybrid(model, HybridConfig(window=4, layer_windows={2: 6}, mixer="learned_head"))
    x = ids()
    want = logits_by_mode(model, x)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for n, p in loaded.named_parameters() if ".phi_" in n} == {torch.float32}
    got = logits_by_mode(loaded, x)
    for mode in MODES:
        assert torch.equal(got[mode], want[mode]), mode


def test_saved_section_is_the_live_state(tmp_path):
    """Switches changed after conversion are what the directory records."""
    model = hybrid()
    set_attention_mode(model, "la_only", window=3, la_span="all")
    x = ids()
    with torch.no_grad():
        want = model(x).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    rt = loaded.model.layers[2].self_attn.hedgecats
    assert (rt.mode, rt.window, rt.la_span) == ("la_only", 3, "all")
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, want)


def test_bf16_load_keeps_feature_maps_in_fp32(tmp_path):
    hybrid().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    attn = loaded.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == torch.bfloat16
    assert attn.phi_q.weight.dtype == torch.float32 and attn.mixer.logit_g.dtype == torch.float32


def test_generate_of_a_loaded_hybrid_uses_the_constant_memory_cache(tmp_path):
    hybrid().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        out = loaded.generate(ids(B=1, T=5), max_new_tokens=4, do_sample=False, pad_token_id=0,
                              return_dict_in_generate=True)
    assert isinstance(generated_cache(out), HybridCache)


# ----------------------------------------------------------------------------- LoRA
def _with_lora(seed=0):
    peft_model = add_lora(hybrid(seed=seed), LORA)
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.add_(0.1 * torch.randn_like(p))
    return peft_model.eval()


def test_lora_kept_as_a_peft_adapter(tmp_path):
    peft_model = _with_lora()
    x = ids()
    with torch.no_grad():
        want = peft_model(input_ids=x).logits
    save_hybrid(peft_model, tmp_path, lora="adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "config.json").read_text())["hybrid"]["adapter"] == "adapter"
    adapter_cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] is None  # it belongs to the hybrid beside it
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, want)
    # a loaded adapter model saves again the same way, with save_hybrid or save_pretrained
    save_hybrid(loaded, tmp_path / "again", lora="adapter")
    loaded.save_pretrained(tmp_path / "plain")
    for d in ("again", "plain"):
        assert (tmp_path / d / "adapter" / "adapter_model.safetensors").is_file()
        again = AutoModelForCausalLM.from_pretrained(tmp_path / d)
        with torch.no_grad():
            assert torch.equal(again(x).logits, want)


def test_lora_merged(tmp_path):
    peft_model = _with_lora()
    x = ids()
    save_hybrid(peft_model, tmp_path, lora="merge")  # does not modify the model
    assert not (tmp_path / "adapter").exists()
    merged = peft_model.merge_and_unload()  # peft's merge: the reference
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, merged(x).logits)


def test_lora_needs_a_choice(tmp_path):
    peft_model = _with_lora()
    with pytest.raises(ValueError, match="lora must be 'merge' or 'adapter'"):
        save_hybrid(peft_model, tmp_path)
    with pytest.raises(ValueError, match="has LoRA layers: save it with"):
        peft_model.get_base_model().save_pretrained(tmp_path)


# ----------------------------------------------------------------------------- bad input
def test_without_hedgecats_transformers_refuses_and_names_it(tmp_path):
    hybrid().save_pretrained(tmp_path)
    code = ("from transformers import AutoModelForCausalLM\n"
            f"AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode != 0
    assert "model type `hedgecats_llama`" in res.stderr, res.stderr[-2000:]


def test_a_plain_model_directory_is_not_a_hybrid(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMALL)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is not a hedgecats hybrid: its config.json has "
                                         "model_type 'llama'"):
        load_pretrained_hybrid(str(tmp_path))
    with pytest.raises(ValueError, match="not a hedgecats hybrid \\(config.json has no 'hybrid'"):
        HedgecatsLlamaForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_pretrained_hybrid(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_pretrained_hybrid(str(tmp_path / "empty"))


def _edit_section(path: Path, fn) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg["hybrid"])
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit, match", [
    (lambda h: h["config"].update(layers=[0, 1], layer_windows=None), "unexpected keys"),
    (lambda h: h["config"].update(feature_projection="rectangular"), "mismatched keys"),
    (lambda h: h["config"].update(mixer="fixed"), "unexpected keys"),
    (lambda h: h.update(extra=1), "unknown keys \\['extra'\\] in the hybrid section"),
    (lambda h: h["config"].update(window=0), "window=0 must be an integer >= 1"),
], ids=["fewer_layers", "projection", "mixer", "unknown_key", "bad_window"])
def test_a_section_that_does_not_match_the_weights_is_refused(tmp_path, edit, match):
    hybrid().save_pretrained(tmp_path)
    _edit_section(tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_missing_feature_maps_are_an_error_not_a_fresh_init(tmp_path):
    model = hybrid()
    model.save_pretrained(tmp_path)
    _edit_section(tmp_path, lambda h: h["config"].update(layers=None))  # saved: all 3 layers
    from safetensors.torch import load_file, save_file

    sd = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in sd.items() if "layers.1.self_attn.phi_q" not in k},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing keys.*layers.1.self_attn.phi_q"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------- the hub
class _FakeHub:
    """Stands in for the Hub API that transformers' push_to_hub calls: records the repo and the
    commit, and keeps a copy of every uploaded file (the upload is the only thing mocked)."""

    def __init__(self, store: Path):
        self.store, self.repo, self.paths = store, None, []

    def create_repo(self, repo_id, **kw):
        self.repo = repo_id
        return type("Repo", (), {"repo_id": repo_id})()

    def create_commit(self, repo_id, operations, **kw):
        for op in operations:
            dest = self.store / op.path_in_repo
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(op.path_or_fileobj, dest)
            self.paths.append(op.path_in_repo)
        return "https://huggingface.co/" + repo_id


def test_push_to_hub_through_transformers_up_to_the_upload(tmp_path, monkeypatch):
    from huggingface_hub import ModelCard
    from transformers.utils import hub

    fake = _FakeHub(tmp_path / "uploaded")
    monkeypatch.setattr(hub, "hf_api", lambda: fake)
    monkeypatch.setattr(hub, "create_and_tag_model_card",
                        lambda repo_id, tags=None, token=None: ModelCard("# card\n"))
    model = hybrid()
    x = ids()
    with torch.no_grad():
        want = model(x).logits
    model.push_to_hub("someone/tiny-hybrid")
    assert fake.repo == "someone/tiny-hybrid"
    assert {"config.json", "model.safetensors"} <= set(fake.paths)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "uploaded")
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, want)


def test_section_names_family_and_version():
    section = hybrid_section(hybrid("qwen2"))
    assert section["family"] == "qwen2" and section["format"] == "hedgecats-hybrid/1"
    assert section["hedgecats_version"] == hedgecats.__version__
