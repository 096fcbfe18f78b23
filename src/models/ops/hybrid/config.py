"""The fused hybrid kernels' configuration: the tiles and options of a call
(``KernelConfig``), the defaults per head dim and dtype (``default_config``), the tiles derived
from a config, and the configs tried in turn where one does not compile here (``SAFE_CONFIG``,
``_with_retry``). The measurements behind the defaults are in docs/performance.md."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..instrument import TRACE
from ..triton_common import errors



@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and options of the kernels. ``block_m`` queries and ``block_n`` keys per
    tile of the forward; ``state_chunk`` positions between stored LA states (a power of two, a
    multiple of every key tile); ``state_f`` x ``state_d`` the state tile of one program of
    the state kernels. Every option computes the same function."""

    block_m: int = 64
    block_n: int = 64
    state_chunk: int = 64
    warps: int = 4
    stages: int = 2
    bwd_block_m: int = 64
    bwd_block_n: int = 64
    bwd_warps: int = 8
    state_f: int = 64
    state_d: int = 64
    state_warps: int = 4
    #: the feature-dimension slice of the forward's and the dq pass's LA products: no program
    #: holds an F-wide operand and an F-wide accumulator at once
    f_chunk: int = 128
    #: the feature slice of one ``_bwd_dfq`` / ``_bwd_dkv_la`` program (their grid's third
    #: axis; None: ``f_chunk``). Each such program computes the D-wide dO . v product before
    #: its slice's share, so a whole F computes it once
    grad_f_chunk: int | None = None
    #: the forward stores both branches' outputs (SWA_t and LA_t, (B, H, T, D) each, in the
    #: input dtype) and its LA states when a backward will follow; the backward then reads
    #: SWA_t . dO_t and LA_t . dO_t from them (as flash attention's rowsum(dO o O)) instead of
    #: recomputing both branches, and does not build the states again. Costs that memory until
    #: the backward. A call whose output is its one branch (``hybrid_kernel``'s
    #: ``output_is_branch``) saves its output instead of a copy
    save_branches: bool = True
    #: the LA states in two steps (``_state_local``: every chunk's share at once, in fp32;
    #: ``_state_scan``: their running sums) instead of one walk over T per state tile
    #: (``_state_fwd`` / ``_state_rev``, whose parallelism is B x Hkv x tiles). Costs an fp32
    #: buffer of the states while they are built. ``None``: split past
    #: ``SPLIT_STATES_MIN_CHUNKS`` chunks (``use_split_states``)
    split_states: bool | None = None
    #: the state kernels read their tiles through device-side tensor descriptors (TMA,
    #: ``triton_common.tma_ok``: sm_90+, 16-byte aligned); ``None``: wherever allowed; False:
    #: the pointer path everywhere (the same values)
    tma: bool | None = None
    #: the key tile of the key-side backward kernels (``_bwd_dkv_swa``, ``_bwd_dkv_la``,
    #: ``_bwd_kv``); None: ``bwd_block_n``. A multiple of 64 lets Triton use Hopper's wgmma
    dkv_block_n: int | None = None
    #: the (F, D) state tile of one ``_state_local`` program (split states): ``split_tile`` x
    #: ``split_tile``; None: ``state_f`` x ``state_d``. Larger tiles re-read the keys and
    #: queries fewer times; the pointer path takes at most 64 (it spills past it)
    split_tile: int | None = None
    #: the query tile of the query-side backward kernels (``_bwd_dq``, ``_bwd_dfq``,
    #: ``_bwd_q``); None: ``bwd_block_m``, which the key-side kernels keep as the query tile of
    #: their loops
    dq_block_m: int | None = None
    #: query heads of one kv head that one forward or query-side backward program takes
    #: (``_fwd``'s P): its rows are rows / P positions of P heads, which share the keys,
    #: values and LA state the program loads, so the block's key range spans rows / P
    #: positions. Taken: the largest power of two that divides the group, is at most this and
    #: leaves at least 16 positions (``pack_of``)
    pack_heads: int = 1
    #: the walked state kernels' tiles (``state_f`` x ``state_d``) are halved while their grid
    #: has fewer programs than this (about two per multiprocessor of an H100 / H200)
    state_programs: int = 264
    #: the LA state's share in the forward (and the recomputing dq pass): 0, its F / f_chunk
    #: feature slices unrolled; n > 0, a loop the compiler pipelines over n stages (the next
    #: slice's tiles copied in while this one multiplies). The same sums in the same order
    state_product_stages: int = 0
    #: the query side of the backward in one kernel (``_bwd_q``: the dq pass, then dfq or the
    #: map's du over all F features from the dO, GF and DDEN it holds) where one dfq program
    #: takes all F features (``_grad_fc`` = F) and the LA branch runs: one launch and one read
    #: of dO fewer, the same results bit for bit. Its dfq buffer is then allocated while the
    #: reverse states' dnum is alive, so it applies to walked states only
    #: (``use_split_states`` False)
    fuse_q_side: bool = False
    #: the key side of the backward in one grid (``_bwd_kv``: ``_bwd_dkv_la``'s grid, its dv
    #: programs doing ``_bwd_dkv_swa``'s work first) where both branches run and dk and dv are
    #: asked for: one launch fewer, and no fp32 buffer of the window's dv share; the same
    #: results bit for bit
    fuse_kv_side: bool = False
    #: ``_bwd_kv`` (where ``fuse_kv_side`` applies) as one program a key block doing the dfk
    #: and the dv work (``_dkv_la_both``: each LA query tile's fq and dO loaded once for both;
    #: dv's terms summed in another order) where one dfk program takes all F features
    #: (``_grad_fc`` = F); otherwise, and off, a key block's dfk programs then its dv program
    #: in the grid's third axis
    kv_one_program: bool = False
    #: the LA state kernels' vector sums (z = sum fk_i, the value sums, u = sum dden_t fq_t,
    #: w = sum dnum_t) as tensor-core products (``_sums_mma``, ``_wsums_mma``: dden split into
    #: two 16-bit parts, u within ~2^-16 of the fp32 sum; the other sums exact products summed
    #: in fp32) instead of reductions across the tile's rows; bf16 / fp16 inputs only
    state_sums_mma: bool = False
    #: ``_fwd``'s pipeline stages (None: ``stages``): the shared memory its loops' copies take
    fwd_stages: int | None = None


#: The forward's tiles at D 128 bf16: 64 rows (16 positions of 4 query heads), 32-key blocks,
#: 4 warps, the state product pipelined: 248 registers and 80 KB of shared memory, so two
#: programs share a multiprocessor
FORWARD_TILES_D128 = dict(block_m=64, block_n=32, warps=4, state_product_stages=2)


@functools.lru_cache(maxsize=64)  # (a KernelConfig is frozen: one per shape, not per call)
def default_config(D: int, F: int, dtype: torch.dtype) -> KernelConfig:
    """Tiles that fit an H100/H200's shared memory and registers, chosen from ptxas's register
    report for sm_90a compiled with a launch's divisibility hints (tests/test_triton_compile.py)
    and measured (docs/performance.md). fp32 operands take twice the space of bf16 ones, so
    fp32 runs on 32-wide tiles; D <= 64 spills nothing at 64 x 64; D >= 128 bf16 takes
    ``FORWARD_TILES_D128``, LA states every 128 positions, the query heads of a kv
    head packed into one program, whole-F gradient programs and the backward's fused
    kernels."""
    if dtype == torch.float32:
        return KernelConfig(block_m=32, block_n=32, state_chunk=64, warps=4, stages=1,
                            bwd_block_m=32, bwd_block_n=32, bwd_warps=4, state_f=32, state_d=32,
                            f_chunk=64)
    if D >= 128:
        return KernelConfig(**FORWARD_TILES_D128, state_chunk=128, stages=2, bwd_block_m=64,
                            bwd_block_n=32, bwd_warps=8, f_chunk=64, state_warps=8,
                            grad_f_chunk=256, dkv_block_n=64, split_tile=128,
                            dq_block_m=128, pack_heads=4, state_f=128, state_d=128,
                            state_programs=128, fuse_q_side=True, fuse_kv_side=True,
                            kv_one_program=True, state_sums_mma=True)
    return KernelConfig(block_m=64, block_n=64, warps=4, stages=2, bwd_block_m=64,
                        bwd_block_n=64, bwd_warps=8, f_chunk=128)


def check(cfg: KernelConfig) -> None:
    """Refuse a config the kernels cannot launch, with a message naming what is wrong, before
    anything compiles (Triton's compiler would fail, and the retry fall to the safe tiles)."""
    blocks = (cfg.block_n, cfg.bwd_block_n, dkv_block_n(cfg))
    if any(cfg.state_chunk % n for n in blocks):
        raise ValueError(f"state_chunk {cfg.state_chunk} must be a multiple of the key blocks "
                         f"(block_n, bwd_block_n, dkv_block_n: {blocks})")
    n = cfg.state_chunk
    if n <= 0 or n & (n - 1):  # (the state kernels' tl.arange)
        raise ValueError(f"state_chunk {n} must be a power of two (the state kernels take a "
                         f"chunk's positions as one tile): e.g. 64 or 128")
    if cfg.fwd_stages is not None and cfg.fwd_stages < 1:
        raise ValueError(f"fwd_stages {cfg.fwd_stages}: at least 1 pipeline stage, or None for "
                         f"the config's stages ({cfg.stages})")


def state_tile(cfg: KernelConfig, heads: int, F: int, D: int) -> tuple[int, int]:
    """(F, D) tile of one state-kernel program: the configured one, halved (down to 32) while
    the grid has fewer than ``KernelConfig.state_programs`` programs (the state kernels walk T
    sequentially, so at batch 1 their parallelism is the grid)."""
    bf, bd = min(cfg.state_f, F), min(cfg.state_d, D)
    while heads * (F // bf) * (D // bd) < cfg.state_programs and (bf > 32 or bd > 32):
        if bf >= bd and bf > 32:
            bf //= 2
        elif bd > 32:
            bd //= 2
        else:
            bf //= 2
    return bf, bd


#: the split states are faster from 16 chunks on, the walk at 8 (H200, the 8B's heads,
#: 8,192 tokens a call: docs/performance.md)
SPLIT_STATES_MIN_CHUNKS = 8


def use_split_states(cfg: KernelConfig, NC: int) -> bool:
    """Whether the LA states of a sequence of ``NC`` chunks are built split
    (``KernelConfig.split_states``; ``None``: more than ``SPLIT_STATES_MIN_CHUNKS`` chunks)."""
    if cfg.split_states is None:
        return NC > SPLIT_STATES_MIN_CHUNKS
    return cfg.split_states


def pack_of(cfg: KernelConfig, G: int, rows: int | None = None) -> int:
    """Query heads one program takes for groups of G: the largest power of two that divides
    G, is at most ``KernelConfig.pack_heads`` and leaves at least 16 of the program's ``rows``
    (default the forward's ``block_m``) to each head."""
    rows = cfg.block_m if rows is None else rows
    p = 1
    while 2 * p <= cfg.pack_heads and G % (2 * p) == 0 and rows // (2 * p) >= 16:
        p *= 2
    return p


def dq_pack_of(cfg: KernelConfig, G: int) -> int:
    """Query heads a program of the query-side backward (dq, dfq) takes for groups of G: as
    ``pack_of`` on its ``dq_block_m`` rows."""
    return pack_of(cfg, G, rows=dq_block_m(cfg))


def fc(cfg: KernelConfig, F: int) -> int:
    """The feature slice of the forward's and the dq pass's LA products (``f_chunk``)."""
    return min(cfg.f_chunk, F)


def grad_fc(cfg: KernelConfig, F: int) -> int:
    """The feature slice of a ``_bwd_dfq`` / ``_bwd_dkv_la`` program (``grad_f_chunk``)."""
    return min(cfg.grad_f_chunk or cfg.f_chunk, F)


def dq_block_m(cfg: KernelConfig) -> int:
    """The query tile of the query-side backward kernels (``KernelConfig.dq_block_m``)."""
    return cfg.dq_block_m or cfg.bwd_block_m


def dkv_block_n(cfg: KernelConfig) -> int:
    """The key tile of the key-side backward kernels (``KernelConfig.dkv_block_n``)."""
    return cfg.dkv_block_n or cfg.bwd_block_n


#: tiles that fit any Hopper / Ampere part, tried when the configured ones fail to compile
#: (out of shared memory or registers)
SAFE_CONFIG = KernelConfig(block_m=32, block_n=32, state_chunk=64, warps=4, stages=1,
                           bwd_block_m=32, bwd_block_n=32, bwd_warps=4, state_f=32, state_d=32,
                           state_warps=4, f_chunk=64, save_branches=False, split_states=False,
                           tma=False)
#: (phase, config, problem key) combinations that failed to compile, and the retries made
_FAILED: set = set()
#: (phase, problem key) -> the error of ``SAFE_CONFIG`` failing too: raised again at once (a
#: compile failure is the device's and the tiles', not the call's; each retry compiled anew)
_SAFE_FAILED: dict = {}


@functools.lru_cache(maxsize=64)
def _retry_chain(cfg: KernelConfig) -> tuple[KernelConfig, ...]:
    """The configs ``_with_retry`` tries before ``SAFE_CONFIG`` (built once per config: host
    time per call): ``cfg``; its tiles without the fused backward kernels (``fuse_q_side``,
    ``fuse_kv_side``: the separate kernels, each smaller); then also without
    ``save_branches``."""
    chain = [cfg]
    if cfg.fuse_q_side or cfg.fuse_kv_side:
        chain.append(dataclasses.replace(cfg, fuse_q_side=False, fuse_kv_side=False))
    if cfg.save_branches:
        chain.append(dataclasses.replace(chain[-1], save_branches=False))
    return tuple(c for c in chain if c != SAFE_CONFIG)


def _with_retry(phase: str, key: tuple, cfg: KernelConfig, fn):
    """``fn(cfg)``; where ``cfg``'s kernels do not compile here (once per problem key; logged
    once, recorded in ``TRACE.retries``), the same tiles without the fused backward kernels, then
    without ``save_branches`` (each where it was on), then ``SAFE_CONFIG``. Every config
    computes the same function: a forward retried without saved branches leaves its backward
    to recompute them."""
    chain = _retry_chain(cfg)
    errs = errors()
    # (the sets are tested only where not empty: a config's hash is ~30 fields, twice a call)
    safe_failed = _SAFE_FAILED.get((phase, key)) if _SAFE_FAILED else None
    if safe_failed is not None:  # (every config of this problem failed here: no new compile)
        raise safe_failed
    for i, c in enumerate(chain):
        if _FAILED and (phase, c, key) in _FAILED:
            continue
        try:
            return fn(c)
        except errs as e:
            _FAILED.add((phase, c, key))
            nxt = chain[i + 1] if i + 1 < len(chain) else SAFE_CONFIG
            TRACE.retry("hybrid", f"hybrid {phase} {key}", e, f"tiles {c} replaced by {nxt}")
    try:
        return fn(SAFE_CONFIG)
    except errs as e:
        _SAFE_FAILED[(phase, key)] = e
        raise
