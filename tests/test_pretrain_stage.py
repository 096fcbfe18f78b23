"""TeacherPretraining with the second seed's options: plain stays today's Llama, variants train,
report their parameter counts, save and reload with identical logits; bad configs fail at once."""

import json

import lightning.pytorch as pl
import pytest
import torch
from hedgecats.lightning_modules import RecallDataModule, TeacherPretraining
from hedgecats.models import HybridConfig, attention_mode, convert_to_hybrid, load_pretrained
from hedgecats.models.pretrain import PretrainLlamaForCausalLM, parameter_counts
from lightning.pytorch.loggers import CSVLogger
from transformers import LlamaConfig, LlamaForCausalLM

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "warmup_steps": 2,
        "max_position_embeddings": 64}


def _fit(module, root, steps=3):
    dm = RecallDataModule(seq_len=48, window=8, far_min=16, far_max=40, num_train=24, num_val=4,
                          num_test=4, batch_size=4)
    tr = pl.Trainer(max_steps=steps, default_root_dir=str(root), enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                    logger=CSVLogger(str(root), name="logs", version="v"))
    tr.fit(module, datamodule=dm)
    return tr


def test_default_teacher_is_the_llama_it_always_was():
    m = TeacherPretraining(**TINY, init_seed=4)
    m.configure_model()
    assert type(m.model) is LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                      rope_theta=10000.0, pad_token_id=257, eos_token_id=256, bos_token_id=None,
                      tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        old = LlamaForCausalLM(cfg)
    sd = m.model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in old.state_dict().items())


def test_gated_swa_teacher_trains_reports_and_reloads(tmp_path):
    m = TeacherPretraining(**TINY, attention_pattern="SF", sliding_window=8, output_gate="lowrank",
                           gate_rank=4, rope_fraction=0.5)
    _fit(m, tmp_path)
    assert type(m.model) is PretrainLlamaForCausalLM
    # parameter counts: logged as hyperparameters, and written with the config at the start
    arch = json.loads((tmp_path / "architecture.json").read_text())
    counts = parameter_counts(m.model)
    assert arch["parameters"] == counts and counts["gates"] == 2 * (32 * 4 + 4 * 32 + 32)
    assert arch["pattern"] == "SF" and arch["config"]["layer_windows"] == [8, None]
    assert arch["rotary_dim"] == 8 and arch["model_class"] == "PretrainLlamaForCausalLM"
    hparams = (tmp_path / "logs" / "v" / "hparams.yaml").read_text()
    assert f"params/total: {counts['total']}" in hparams
    # the saved model reloads with identical logits, its architecture record beside it
    assert json.loads((tmp_path / "model" / "architecture.json").read_text()) == arch
    loaded = load_pretrained(tmp_path / "model").eval()
    ids = torch.randint(0, 256, (2, 40))
    assert torch.equal(loaded(ids).logits, m.model.eval()(ids).logits)


def test_bad_architecture_fails_when_the_module_is_built():
    with pytest.raises(ValueError, match=r"output_gate='gated' is not valid; choose one of none, "
                                         r"elementwise, lowrank"):
        TeacherPretraining(**TINY, output_gate="gated")
    with pytest.raises(ValueError, match=r"attention_pattern='SL'.*bad characters: \['L'\]"):
        TeacherPretraining(**TINY, attention_pattern="SL", sliding_window=8)


def test_plain_teacher_still_converts_to_a_hybrid(tmp_path):
    """The saved default teacher is a plain Llama: convert_to_hybrid works on it and its
    softmax mode reproduces the teacher's logits."""
    m = TeacherPretraining(**TINY)
    _fit(m, tmp_path, steps=2)
    teacher = load_pretrained(tmp_path / "model").eval()
    assert type(teacher) is LlamaForCausalLM
    ids = torch.randint(0, 256, (2, 40))
    want = teacher(ids).logits
    convert_to_hybrid(teacher, HybridConfig(window=8))
    with attention_mode(teacher, "softmax"):
        torch.testing.assert_close(teacher(ids).logits, want)
    teacher(ids)  # the hybrid runs


def test_gated_swa_pipeline_config_builds_each_kind_of_variant(tmp_path):
    """configs/gated-swa/teacher.yaml through LightningCLI (as hedgecats pipeline builds a stage):
    a pattern string, a per-layer list and the plain teacher (vars set to null) all parse, with
    the downstream callback and its probes."""
    import copy
    from pathlib import Path

    from hedgecats.cli import load_pipeline
    from hedgecats.lightning_modules import DownstreamEval
    from lightning.pytorch.cli import LightningCLI

    path = Path(__file__).resolve().parents[1] / "configs" / "gated-swa" / "teacher.yaml"
    cases = [({}, (256, 256, 256, None), "elementwise", 64),
             ({"pattern": [64, "full", 256, "full"], "window": None, "gate": "lowrank",
               "rope_fraction": 0.5}, (64, None, 256, None), "lowrank", 32)]
    for variables, windows, gate, rotary in cases:
        spec = load_pipeline(path, output=tmp_path, variables=variables)
        cfg = copy.deepcopy(spec["stages"][0]["fit"])
        cfg["trainer"] |= {"accelerator": "cpu", "default_root_dir": str(tmp_path),
                           "logger": False}
        cli = LightningCLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                           subclass_mode_data=True, args=cfg, run=False,
                           save_config_callback=None)
        arch = cli.model.arch
        assert (arch.layer_windows, arch.output_gate, arch.rotary_dim) == (windows, gate, rotary)
        (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, DownstreamEval)]
        assert [p.name for p in cb.probes] == ["recall", "mc_near", "mc_far"]
    plain = load_pipeline(path, output=tmp_path,
                          variables={"pattern": None, "window": None, "gate": "none"})
    args = plain["stages"][0]["fit"]["model"]["init_args"]
    assert TeacherPretraining(**args).arch.is_plain


def test_teacher_weights_follow_the_run_seed_unless_named(monkeypatch):
    """Seeds reach every stage: without an ``init_seed`` the teacher's weights come from the
    run's seed (``seed_everything`` exports ``PL_GLOBAL_SEED``); a named ``init_seed`` wins. The
    first version always used 0, so ``--seed 0/1/2`` pretrained one teacher three times."""
    def weights(**kw):
        m = TeacherPretraining(**TINY, **kw)
        m.configure_model()
        return next(m.model.parameters()).detach().clone(), m.hparams.init_seed

    monkeypatch.setenv("PL_GLOBAL_SEED", "1")
    w1, s1 = weights()
    monkeypatch.setenv("PL_GLOBAL_SEED", "2")
    w2, s2 = weights()
    named, s_named = weights(init_seed=1)
    assert (s1, s2, s_named) == (1, 2, 1)
    assert not torch.equal(w1, w2) and torch.equal(w1, named)
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert weights()[1] == 0  # no seed set anywhere: 0, as before


@pytest.mark.parametrize("seed", [0, 3])
def test_teacher_built_by_lightning_cli_takes_the_seed_everything(seed):
    """What the pipeline does: LightningCLI seeds, then builds the module with ``init_seed``
    unset (it passes None explicitly, and its hyperparameters override the constructor's
    locals); the weights must still come from the run's seed."""
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(TeacherPretraining, RecallDataModule, run=False, save_config_callback=None,
                       args=["--seed_everything", str(seed),
                             *[f"--model.{k}={v}" for k, v in TINY.items()]])
    cli.model.configure_model()
    assert cli.model.hparams.init_seed == seed
    direct = TeacherPretraining(**TINY, init_seed=seed)
    direct.configure_model()
    assert torch.equal(next(cli.model.model.parameters()), next(direct.model.parameters()))


def test_tied_teacher_is_a_plain_llama_that_saves_reloads_and_converts(tmp_path):
    """``tie_word_embeddings``: one matrix for input and output, kept tied through training,
    save and reload (identical logits), and still a plain Llama that converts to a hybrid."""
    m = TeacherPretraining(**TINY, tie_word_embeddings=True)
    _fit(m, tmp_path, steps=2)
    assert m.model.lm_head.weight is m.model.model.embed_tokens.weight
    teacher = load_pretrained(tmp_path / "model").eval()
    assert type(teacher) is LlamaForCausalLM and teacher.config.tie_word_embeddings
    assert teacher.lm_head.weight.data_ptr() == teacher.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 256, (2, 40))
    m.model.eval()
    with torch.no_grad():
        want = m.model(ids).logits
        torch.testing.assert_close(teacher(ids).logits, want)
        convert_to_hybrid(teacher, HybridConfig(window=8))
        with attention_mode(teacher, "softmax"):
            torch.testing.assert_close(teacher(ids).logits, want)
    untied = TeacherPretraining(**TINY)
    untied.configure_model()
    assert untied.model.lm_head.weight is not untied.model.model.embed_tokens.weight
