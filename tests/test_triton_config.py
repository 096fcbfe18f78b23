"""The fused hybrid kernel's configuration choices, on CPU (pure Python, no Triton needed):
which tiles and options a call gets, and where the LA states are built split."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hedgecats.models.ops.hybrid import config as kconfig
from hedgecats.models.ops.hybrid import forward as kforward
from hedgecats.models.ops.hybrid import function as kfunction
from hedgecats.models.ops.hybrid import states as kstates


def test_defaults_save_the_branches_and_choose_the_state_path_by_length():
    for D, F, dt in ((128, 256, torch.bfloat16), (64, 128, torch.bfloat16),
                     (64, 64, torch.float32)):
        cfg = kconfig.default_config(D, F, dt)
        assert cfg.save_branches and cfg.split_states is None, cfg


def test_states_split_past_the_threshold_only_by_default():
    cfg = kconfig.default_config(128, 256, torch.bfloat16)
    n = kconfig.SPLIT_STATES_MIN_CHUNKS
    assert not kconfig.use_split_states(cfg, 8)  # 8 x 1k at state_chunk 128: the walk measured faster
    assert not kconfig.use_split_states(cfg, n)
    assert kconfig.use_split_states(cfg, n + 1)
    assert kconfig.use_split_states(cfg, 16)  # 4 x 2k: the split measured 13% faster (fwd + bwd)
    assert kconfig.use_split_states(cfg, 512)  # 64k: the split measured 22% faster per layer
    forced = {b: dataclasses.replace(cfg, split_states=b) for b in (True, False)}
    assert all(kconfig.use_split_states(forced[True], nc) for nc in (1, 8, 512))
    assert not any(kconfig.use_split_states(forced[False], nc) for nc in (1, 8, 512))


def test_the_safe_tiles_save_nothing_and_walk():
    """SAFE_CONFIG is the last retry after a compile failure: the plainest kernels (no saved
    branches, walked states, pointer loads rather than tensor descriptors)."""
    assert not kconfig.SAFE_CONFIG.save_branches
    assert kconfig.SAFE_CONFIG.split_states is False
    assert kconfig.SAFE_CONFIG.tma is False


def test_tma_off_in_the_config_means_pointer_loads_everywhere(monkeypatch):
    """``KernelConfig.tma`` False: no kernel reads through tensor descriptors, whatever the
    device allows; None / True: where ``tma_ok`` says the tensors allow it."""
    monkeypatch.setattr(kstates, "tma_ok", lambda *t: True)
    cfg = kconfig.default_config(128, 256, torch.bfloat16)
    assert cfg.tma is None and kstates.use_tma(cfg)
    assert not kstates.use_tma(dataclasses.replace(cfg, tma=False))
    monkeypatch.setattr(kstates, "tma_ok", lambda *t: False)
    assert not kstates.use_tma(dataclasses.replace(cfg, tma=True))


def test_cached_constants_made_in_inference_mode_can_be_saved_for_a_backward():
    """The fixed mixer weights and shifts are made once and reused (``_filled``): one first
    made during an evaluation under ``torch.inference_mode`` must still serve a training call,
    whose autograd saves it for the backward (inference tensors cannot be saved)."""
    kfunction._filled.cache_clear()
    with torch.inference_mode():
        c = kfunction._filled((2, 3), 0.25, torch.float32, torch.device("cpu"))
    assert not c.is_inference()
    again = kfunction._filled((2, 3), 0.25, torch.float32, torch.device("cpu"))
    assert again is c  # made once
    w = torch.ones(2, 3, requires_grad=True)
    (w * c).sum().backward()  # saves c for the backward
    assert torch.equal(w.grad, c)
    with torch.inference_mode():
        n = kfunction._key_counts(2, 5, torch.device("cpu"))
    assert not n.is_inference() and n.tolist() == [list(range(6))] * 2


def test_the_key_side_tile_divides_the_state_chunk():
    cfg = dataclasses.replace(kconfig.default_config(128, 256, torch.bfloat16), dkv_block_n=96)
    x = torch.zeros(1, 1, 4, 128)
    f = torch.zeros(1, 1, 4, 256)
    s = torch.zeros(1, 1)
    try:
        kfunction.hybrid_kernel(x, x, x, f, f, s, s, s, s.int(), window=2, scale=1.0, eps=1e-6,
                                config=cfg)
    except ValueError as e:
        assert "dkv_block_n" in str(e) and "96" in str(e)
    else:
        raise AssertionError("a key tile of 96 against state_chunk 128 was accepted")


@pytest.mark.parametrize("change, says", [(dict(fwd_stages=0), "fwd_stages 0")])
def test_forward_launch_options_are_checked(change, says):
    """A stage count the forward cannot launch with is refused with a message naming it,
    before any kernel compiles (``fwd_stages=0`` does not read as "the config's stages",
    which only None means)."""
    cfg = dataclasses.replace(kconfig.default_config(128, 256, torch.bfloat16), **change)
    x, f, s = torch.zeros(1, 1, 4, 128), torch.zeros(1, 1, 4, 256), torch.zeros(1, 1)
    with pytest.raises(ValueError, match=says):
        kfunction.hybrid_kernel(x, x, x, f, f, s, s, s, s.int(), window=2, scale=1.0, eps=1e-6,
                                config=cfg)
    assert kforward.fwd_launch_options(dataclasses.replace(cfg, fwd_stages=1)) == {"num_stages": 1}


def test_state_chunks_must_be_powers_of_two():
    """A state spacing that is a multiple of the key blocks but not a power of two (96) is
    refused with a message naming it, before any kernel compiles (Triton's tl.arange over the
    chunk would fail inside the compiler, and the retry chain would fall to the safe tiles)."""
    base = kconfig.default_config(128, 256, torch.bfloat16)
    x = torch.zeros(1, 1, 4, 128)
    f = torch.zeros(1, 1, 4, 256)
    s = torch.zeros(1, 1)
    cfg = dataclasses.replace(base, block_n=32, bwd_block_n=32, dkv_block_n=32, state_chunk=96)
    with pytest.raises(ValueError, match="96 must be a power of two"):
        kfunction.hybrid_kernel(x, x, x, f, f, s, s, s, s.int(), window=2, scale=1.0, eps=1e-6,
                                config=cfg)


def test_forward_packs_the_query_heads_a_group_allows():
    """``pack_of``: the forward takes the query heads of a kv head P at a time (the largest
    power of two dividing the group, at most ``pack_heads``, leaving 16 positions a program):
    the 8B's groups of 4 all four at the D 128 bf16 default, Qwen2-7B's groups of 7 one, an
    MHA model one; tiles too short for it (fp32's 32 rows) fewer."""
    cfg = kconfig.default_config(128, 256, torch.bfloat16)
    assert cfg.pack_heads == 4 and cfg.block_m == 64  # (16 positions of 4 heads)
    assert [kconfig.pack_of(cfg, g) for g in (1, 2, 3, 4, 6, 7, 8, 16)] == [1, 2, 1, 4, 2, 1, 4, 4]
    fp32 = dataclasses.replace(kconfig.default_config(64, 64, torch.float32), pack_heads=4)
    assert fp32.block_m == 32 and kconfig.pack_of(fp32, 4) == 2  # 16 positions of 2 heads
    assert kconfig.pack_of(dataclasses.replace(cfg, pack_heads=1), 4) == 1
    assert kconfig.pack_of(dataclasses.replace(cfg, pack_heads=3), 4) == 2  # a power of two
    # the query-side backward: its own 128 rows
    assert kconfig.dq_pack_of(cfg, 4) == 4 and kconfig.dq_pack_of(cfg, 7) == 1
    assert kconfig.dq_pack_of(dataclasses.replace(cfg, dq_block_m=32), 4) == 2  # 16 positions


def test_walked_state_tiles_keep_a_program_a_multiprocessor():
    """The walked state kernels' tiles at D 128 bf16 (128 x 128, measured faster at 8 x 1k,
    where that is 128 programs): halved while fewer than ``state_programs`` (128)
    programs, so a small batch keeps its parallelism; the other defaults keep their configured
    64 x 64 and the threshold of two programs a multiprocessor (264)."""
    cfg = kconfig.default_config(128, 256, torch.bfloat16)
    assert kconfig.state_tile(cfg, 8 * 8, 256, 128) == (128, 128)  # 8 x 1k, 8 kv heads: 128
    assert kconfig.state_tile(cfg, 4 * 8, 256, 128) == (64, 128)  # batch 4: 128 programs
    assert kconfig.state_tile(cfg, 1 * 8, 256, 128) == (32, 64)  # batch 1: as small as allowed
    small = kconfig.default_config(64, 128, torch.bfloat16)
    assert (small.state_f, small.state_d, small.state_programs) == (64, 64, 264)
    assert kconfig.state_tile(small, 8 * 8, 128, 64) == (32, 32)  # halved to 512 programs
