"""The ``hedgecats`` command silences what other libraries print that a user cannot act on (a
logger advertisement, a ``LeafSpec`` deprecation, a gradient-checkpointing ``FutureWarning``),
each by its message and the module that emits it, and keeps every other warning: ours, and
those libraries' other warnings."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Started by the command's entry point, the real emitters run (a Trainer, Lightning's pytree
# flattening, transformers' deprecated property), then warnings that must still show.
SCRIPT = textwrap.dedent("""
    import logging, warnings
    from hedgecats.cli import main

    main(["--version"])
    import lightning.pytorch as pl
    import transformers
    from lightning.pytorch.utilities._pytree import _tree_flatten
    from lightning.pytorch.utilities import rank_zero_info

    pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False)
    _tree_flatten(1)
    cfg = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=16)
    getattr(transformers.LlamaForCausalLM(cfg), "is_gradient_checkpointing")

    # what stays: ours, and the same libraries' other messages
    exec(compile("import warnings; warnings.warn('OURS-WARNING: check the window')",
                 "ours.py", "exec"), {"__name__": "hedgecats.lightning_modules.callbacks"})
    logging.getLogger("hedgecats.pipeline.run").warning("OURS-LOG: the stage diverged")
    rank_zero_info("Lightning says something else")
    exec(compile("import warnings; warnings.warn('another deprecation', FutureWarning)",
                 "mu.py", "exec"), {"__name__": "transformers.modeling_utils"})
""")


def test_the_command_silences_foreign_noise_and_keeps_other_warnings():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    for noise in ("litlogger", "litmodels", "LeafSpec", "is_gradient_checkpointing"):
        assert noise not in text, text
    for kept in ("OURS-WARNING: check the window", "OURS-LOG: the stage diverged",
                 "Lightning says something else", "another deprecation"):
        assert kept in text, text
