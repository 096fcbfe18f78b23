"""FSDP2 that checkpoints only what trains.

Lightning's ``ModelParallelStrategy`` loads a sharded (DCP) checkpoint by asking for every key of
the model's state dict; our stage checkpoints hold only the trainable tensors (the frozen base is
rebuilt from its model id), so that load fails with "Missing key in checkpoint". This
subclass loads exactly the trainable keys, then the optimiser states, and hands the tensors it
loaded back under ``checkpoint["state_dict"]`` so the stage's exact key check still runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallel

__all__ = ["ModelParallelStrategy"]


class ModelParallelStrategy(_LightningModelParallel):
    """``lightning.pytorch.strategies.ModelParallelStrategy`` (FSDP2 + optional TP) whose
    sharded checkpoints carry the trainable tensors only, and are written whole or not at all:
    every rank writes its shards into ``.<name>.tmp-dcp/``, then rank 0 renames the directory it
    replaces to ``previous.ckpt`` (for ``last.ckpt``) and the new one into place. Same
    arguments."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        import os
        import shutil

        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        tmp = path.with_name(f".{path.name}.tmp-dcp")
        if self.global_rank == 0 and tmp.exists():
            shutil.rmtree(tmp)  # a write that died part-way
        self.barrier("hedgecats_dcp_tmp")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("hedgecats_dcp_written")
        if self.global_rank == 0:
            if path.exists():
                if path.name == "last.ckpt":
                    prev = path.with_name("previous.ckpt")
                    if prev.is_dir():
                        shutil.rmtree(prev)
                    elif prev.exists():
                        prev.unlink()
                    os.replace(path, prev)
                elif path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            os.replace(tmp, path)
        self.barrier("hedgecats_dcp_renamed")

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        import torch
        import torch.distributed.checkpoint as dcp
        from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
        from lightning.fabric.utilities.load import _METADATA_FILENAME
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_checkpoint(path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        module = self.model
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        state = {"state_dict": {k: v for k, v in get_model_state_dict(module).items()
                                if k in trainable}}
        dcp.load(state, checkpoint_id=path)
        module.load_state_dict(state["state_dict"], strict=False)
        options = StateDictOptions(cpu_offload=True)
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(module, optimizer)}
            dcp.load(optim_state, checkpoint_id=path)
            set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[key],
                                     options=options)
        metadata = torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
        metadata["state_dict"] = state["state_dict"]
        return metadata
