"""Fused Triton kernels for the hybrid layer: windowed softmax + linear attention + mixer.

One forward and one backward per call, recomputing instead of storing (issue 11). What the
kernels compute, per batch row ``b`` and query head ``h`` (``c_A, c_B, shift`` per ``(b, h)``):

    SWA_t = softmax over the window keys  t - w < i <= t           (lse_t kept, fp32)
    LA_t  = sum_{i <= t - shift} k_ti v_i / max(den_t, eps)    den_t = sum k_ti, fp32,
            k_ti = fq_t.fk_i + eps (the kernel floor of ops.reference.linear_attention_chunked:
            eps in numerator and normaliser alike; 0 where no real key i <= t - shift)
    out_t = c_A SWA_t + c_B LA_t                                    (fixed / per-head / SSD)
    out_t = alpha_t SWA_t + (1 - alpha_t) LA_t,
            alpha_t = sigmoid(log s_h + lse_t - log max(den_t, eps))   (``shared_norm``)

``shift`` is ``w`` (non-overlapping), 0 (``overlap``, or ``la_only`` with ``la_span="all"``).
``ops.hybrid.hybrid_attention``'s modes map onto it (``fused_hybrid``): ``hybrid``, ``swa_only``
(no LA pass), ``la_only`` (no SWA pass), SSD (``swa_drop``: a dropped ``(b, h)`` gets
``c_A = 0`` and the ``la_only`` weight and span) and ``shared_norm`` in ``hybrid`` mode.
Output-gate mixers (a ``g`` per position and channel, which per-head weights cannot carry) take
one call per branch at weight 1 (SWA with no features, LA with the maps) mixed in PyTorch
(``_gated``). What it does not cover returns ``None`` with the reason logged once, and the
caller runs the piece-by-piece path: sinks / softmax / none, ``shared_norm`` outside
``hybrid`` mode or with SSD, KV-cache calls (fewer queries than keys),
dtypes other than bf16 / fp32, mixed dtypes, head or feature dims that are not powers of two in
[16, 128] / [16, 256], CPU tensors.

How (all kernels take strided (B, H, T, X) tensors, no copies of q, k, v; the output and the
gradients of q, k, v are written in their inputs' memory (``_like``): the model's (B, T, H, D)
projections, which its transpose-reshape and autograd's accumulation then take as they are):

    _state_fwd    per (b, kv head, F-block, D-block), walking T: the LA state
                  S_j = sum_{i < j C} fk_i v_i^T, z_j = sum fk_i and u_j = sum v_i (the floor's
                  share) at every C-th position (C = ``state_chunk``), masked keys left out.
                  (B, Hkv, T/C, F, D) in the input dtype; z, u in fp32. Past
                  ``SPLIT_STATES_MIN_CHUNKS`` chunks (``KernelConfig.split_states``) instead
                  _state_local, per (chunk, tile, b, kv head): each chunk's share in fp32, and
                  _state_scan their running sums (a long walk at batch 1 had too few programs).
    _fwd          per (b, P query heads of one kv head, block of BM / P positions; P from
                  ``KernelConfig.pack_heads``, ``pack_of``): LA from the nearest state at or
                  before t0 - shift + 1 plus the keys between it and the block (masked), the
                  window keys (online softmax, exp2), the mixer, the output; keeps lse_t and
                  den_t (fp32). The P heads share every key, value and state load; the
                  query-side backward kernels (_bwd_dq, _bwd_dfq) take rows the same way.
    backward      _state_fwd again; _bwd_dq per query block reads LA_t . dO_t and SWA_t . dO_t
                  from the branch outputs the forward stored (``KernelConfig.save_branches``,
                  the default; without it, a first pass recomputes both), forms the mixer's
                  per-query factors, then dq (second pass, skipped when q takes no gradient);
                  _bwd_dfq per query block and feature slice: dfq (or, fq being a Hedgehog
                  map's output, the map's du: ``triton_phi.DuSlot``); _state_rev walks T
                  backwards summing fq_t dnum_t^T over the query heads of each kv head (GQA) into
                  reverse states (split as the forward's, reversed, past the threshold); per
                  key block and kv head, _bwd_dkv_swa gets dk and the window's dv from the
                  window queries, and _bwd_dkv_la dfk (per feature slice) and the rest of dv
                  from the queries between the block and the next reverse state, and that
                  state. At D 128 bf16 (``default_config``) the passes run fused, the same
                  arithmetic in fewer launches: _bwd_q the dq pass then the dfq pass
                  (``KernelConfig.fuse_q_side``, walked states), _bwd_kv the key side in one
                  grid, its dv programs doing _bwd_dkv_swa's work first (``fuse_kv_side``).
                  Passes that only serve gradients autograd does not ask for (dq,
                  the window's dk / dv, LA's dv: stage 1's teacher q, k, v) are not launched.
                  Mixer gradients (c_A, c_B or log s_h) come back as per-block partial sums,
                  reduced in torch (deterministic).

The reverse-state kernels read their tiles through device-side tensor descriptors (TMA,
``_tiles_of`` / ``_tile``; ``KernelConfig.tma``) where ``triton_common.tma_ok`` allows (sm_90+,
16-byte-aligned tensors), else through pointer tensors (same values): a loop over pointer
tensors keeps them in registers (ptxas: 255 per thread against ~100), the descriptors' loads
are pipelined. The forward kernel measured slower through them and stays on pointers.

The feature dimension is taken ``f_chunk`` at a time in the forward's and dq's products over
it, so no program holds an F-wide operand and an F-wide accumulator at once; the dfq / dfk
programs take ``grad_f_chunk`` (the whole F at D 128 bf16: one D-wide dO . v product per
block). Tile sizes were chosen from ptxas's register report for sm_90a (``default_config``).
Tiles that do not compile on a device are replaced once by ``SAFE_CONFIG`` (``RETRIES``); any
other Triton failure sends the call to the piece-by-piece path (``FALLBACK_ERRORS``), and where
the safe tiles fail too that is remembered per problem (``_SAFE_FAILED``: later calls go to that
path without compiling again).

The layer's feature maps can run inside the kernels' autograd Function (``fold_maps``,
``hybrid_kernel(maps=...)``; ``ops.hybrid.hybrid_attention(maps=...)``, the converted layer's
call): their kernels (``triton_phi``, both maps in one launch) in its forward, their backward
from the dfq pass's du and dfk in its backward; one autograd node instead of three.

Numerics: matrix products in the input dtype with fp32 accumulation (fp32 inputs: ``tf32x3``,
three tf32 products, about fp32 accuracy); the stored LA states are in the input dtype (they are
a matrix operand anyway), the key sums z, the denominators, lse and every normaliser in fp32;
per-query factors (mixer weights, 1/den) are applied in fp32 to the products' rows rather than
to a rounded operand.

Checked against ``kernel_reference`` (pure PyTorch, the same function built from
``ops.reference``) under ``TRITON_INTERPRET=1`` on CPU (tests/test_triton_interpreter.py) and
against ``hybrid_attention(backend="reference")`` on the GPU (tests/test_triton_kernels.py).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import reference as ref
from ..feature_map import kernels as triton_phi
from ..feature_map.kernels import DU_SLOT_ATTR, DuSlot
from ..triton_common import (GRID_AXIS_MAX, HAVE_TRITON, available, cast, cdiv, errors, fast,
                            interpret, next_pow2, record_fallback, tl, tma_ok, triton, warn_once)

__all__ = ["KernelConfig", "available", "fused_hybrid", "hybrid_kernel", "kernel_reference",
           "unsupported_reason"]

#: errors from Triton (compilation, resources) that sent a call to the fallback; the GPU tests
#: assert it stays empty
FALLBACK_ERRORS: list[str] = []
#: calls that ran the fused kernels (tests check that a path was taken, not only its result),
#: the backward passes launched for dq, the window's dk / dv and the LA's dv (skipped when
#: autograd does not ask for those gradients), the backwards whose per-query factors came
#: from the forward's saved branches (``KernelConfig.save_branches``), the LA state builds
#: that went split (``KernelConfig.split_states``), the backwards that took the forward's
#: LA states instead of building them again (saved with the branches), and those whose dfk
#: and dv programs ran apart, each at its own key tile (``dkv_block_n`` / ``dv_block_n``);
#: the backward's fused kernels, counted under their ``KernelConfig`` switches; the calls
#: that ran the feature maps inside the kernel's Function (``hybrid_kernel(maps=...)``), and
#: their backwards; the forwards that ran without an autograd Function (no gradient asked for:
#: evaluation, prefill); the calls of a g per position or channel (``_gated``: a call per branch);
#: the forwards that computed phi_q inside ``_fwd`` (``KernelConfig.map_q_forward``); the folded
#: backwards that released the saved branches and states before the maps' backward, and the
#: backwards that found them released (a second backward, ``retain_graph``) and recomputed; the
#: no-grad forwards at their own state spacing (``KernelConfig.forward_state_chunk``); the
#: forwards that held fq's rows in registers (``KernelConfig.hold_fq``); the forwards that read
#: their key-side tiles through tensor descriptors (``KernelConfig.fwd_tma``)
CALLS = {"forward": 0, "dq_pass": 0, "dkv_swa": 0, "dv_la": 0, "factors_from_saved": 0,
         "split_states": 0, "states_from_forward": 0, "dkv_apart": 0, "packed_forward": 0,
         "packed_dq": 0, "map_du": 0, "fuse_q_side": 0, "fuse_kv_side": 0, "kv_order_1": 0,
         "kv_order_2": 0, "state_sums_mma": 0, "maps_folded": 0, "maps_folded_backward": 0,
         "forward_without_autograd": 0, "gated": 0, "q_map_in_forward": 0,
         "saved_released": 0, "saved_recomputed": 0, "forward_state_chunk": 0,
         "held_fq_forward": 0, "forward_tma": 0,
         "parked_forward": 0}


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes of the kernels. ``block_m`` queries and ``block_n`` keys per tile;
    ``state_chunk`` positions between stored LA states; ``state_f`` x ``state_d`` the state
    tile of one program of the state kernels."""

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
    f_chunk: int = 128  # feature-dimension slice of the LA products (registers)
    #: the feature slice of one ``_bwd_dfq`` / ``_bwd_dkv_la`` program (their grid's third
    #: axis; None: ``f_chunk``). Each program of those kernels computes the D-wide product
    #: (dO_t . v_i, the same for every slice) before its slice's share, so F / slice programs
    #: compute it F / slice times; a whole F computes it once, with an (BN or BM, F) fp32
    #: accumulator (ptxas, sm_90a, D 128, F 256: 254-255 registers, no spill, at the default
    #: backward tiles). Measured on one H200 (2026-12-02, eighth session, attention_speed.py
    #: --tune, configs default / grad-f64, one run): the kernel's fwd + bwd at 8 x 1k 2.96 vs
    #: 3.36 ms, the stage-1 call 2.11 vs 2.57, at 2 x 4k 2.96 vs 3.18; profile at 8 x 1k:
    #: ``_bwd_dkv_la`` 0.66 to 0.51 ms, ``_bwd_dfq`` 0.39 to 0.28
    #: (benchmarks/results/h200_2026-12-02d/README.md)
    grad_f_chunk: int | None = None
    #: the forward stores both branches' outputs (SWA_t and LA_t, (B, H, T, D) each, in the input
    #: dtype; a call whose output is its one branch, ``hybrid_kernel``'s ``output_is_branch``,
    #: saves its output instead) when a backward will follow, and the backward's per-query
    #: factors read
    #: SWA_t . dO_t and LA_t . dO_t from them instead of recomputing both branches (as flash
    #: attention's rowsum(dO o O)): without dq (stage 1) the dq kernel then does no matrix
    #: products at all. The forward's LA states are kept too (since 2026-12-02's sixth session:
    #: the backward then does not build them again, 1 x 64k 30.1 to 29.2 ms; (B, Hkv,
    #: T / state_chunk, F, D) in the input dtype, 34 MB a layer at 8 x 1k on the 8B shape).
    #: Costs that memory
    #: until the backward, and under activation checkpointing (stage 2) more writes per layer
    #: (the discarded first forward runs with grad on and stores them too). On since measured
    #: (2026-12-02, one H200, 8 x 1k, one run):
    #: the kernel's fwd + bwd 3.41 vs 3.86 ms, the stage-1 call 2.60 vs 2.77, the
    #: ``hybrid_output_mse`` step 346 vs 355 ms; stage 2's LoRA step 982 vs 966 ms (within the
    #: run-to-run spread of that row); benchmarks/results/h200_2026-12-02b/README.md.
    save_branches: bool = True
    #: the LA states in two steps (``_state_local``: every chunk's share at once, in fp32;
    #: ``_state_scan``: their running sums) instead of one walk over T per state tile
    #: (``_state_fwd`` / ``_state_rev``, whose parallelism is only B x Hkv x tiles: at batch 1
    #: a 64k sequence is 512 chunks in a row). Costs an fp32 buffer of the states
    #: ((B, Hkv, T / state_chunk, F, D)) while they are built. ``None``: split when the
    #: sequence has more than ``SPLIT_STATES_MIN_CHUNKS`` chunks (``use_split_states``).
    split_states: bool | None = None
    #: read tiles through device-side tensor descriptors (TMA, ``triton_common.tma_ok``: sm_90+,
    #: 16-byte aligned) in the kernels that have both paths; ``None``: wherever allowed; False:
    #: the pointer path everywhere (the same values)
    tma: bool | None = None
    #: the key tile of the key-side backward kernels (``_bwd_dkv_swa``, and ``_bwd_dkv_la``'s
    #: dfk programs, launched apart from its dv programs where those take another tile,
    #: ``dv_block_n``); None: ``bwd_block_n``. A multiple of 64 lets Triton use Hopper's wgmma
    #: there: at 32-key tiles ptxas shows mma.sync only (sm_90a, D 128, F 256: the dfk part at
    #: 64 keys 254 registers, no spill)
    dkv_block_n: int | None = None
    #: the key tile of ``_bwd_dkv_la``'s dv programs; None: ``bwd_block_n``. Where it equals
    #: the dfk programs' (``dkv_block_n``), both kinds run in one grid (one kernel compiled for
    #: both parts: its registers the larger part's). ptxas (sm_90a, D 128, F 256, with the
    #: launch's hints): the dv part at 32 keys 98 registers and mma.sync only, at 64 keys 193,
    #: wgmma, no spill (the spill that kept it at 32 was read without the hints); 64 for D 128
    #: bf16 since session 14 (``default_config``)
    dv_block_n: int | None = None
    #: the (F, D) state tile of one ``_state_local`` program (split states): ``split_tile`` x
    #: ``split_tile``; None: ``state_f`` x ``state_d``, as the walked states. Larger tiles re-read
    #: the keys / queries fewer times (a 128 x 128 tile reads fk once and v twice for F 256,
    #: D 128); through descriptors 127 / 160 registers (forward / reverse, sm_90a), through
    #: pointer tensors it spills (312 B reverse), so the pointer path takes at most 64. The
    #: walked kernels keep ``state_f`` x ``state_d``: at 128 x 128 ptxas shows the forward
    #: walk spilling 16 B and the reverse walk's pointer path 700 B
    split_tile: int | None = None
    #: the query tile of the query-side backward kernels (``_bwd_dq``, ``_bwd_dfq``); None:
    #: ``bwd_block_m``, which the key-side kernels keep as the query tile of their loops (at
    #: 128 their window kernel spills 880 B, their dfk programs 320: ptxas, sm_90a, D 128, F 256,
    #: with the launch's divisibility hints; the query-side ones do not spill at 128)
    dq_block_m: int | None = None
    #: query heads of one kv head that one forward program takes (``_fwd``'s P): its
    #: ``block_m`` rows are block_m / P positions of P heads, which share the keys, values and
    #: LA state the program loads, so the block's key range (window, and LA keys between its
    #: state and the block) spans block_m / P positions instead of block_m. Taken: the largest
    #: power of two that divides the group, is at most this and leaves at least 16 positions
    #: (``pack_of``; Qwen2-7B's groups of 7: 1). 1: one head a program (before session 13)
    pack_heads: int = 1
    #: the same for the query-side backward kernels (``_bwd_dq``, ``_bwd_dfq``, on their
    #: ``dq_block_m`` rows); None: ``pack_heads``
    dq_pack_heads: int | None = None
    #: the walked state kernels' tiles (``state_f`` x ``state_d``) are halved while their grid
    #: has fewer programs than this (about two per multiprocessor of an H100 / H200)
    state_programs: int = 264
    #: the LA state's share in the forward (and the recomputing dq pass): 0, its F / f_chunk
    #: feature slices unrolled (each slice's fq and S loaded where the code reaches them); n > 0,
    #: a loop the compiler pipelines over n stages (the next slice's tiles copied in while this
    #: one multiplies; ptxas at D 128 bf16, pack 4, n 2: 254 registers, no spill, 86 async
    #: copies against 58, shared memory 160 against 192 KB). The same sums in the same order
    state_product_stages: int = 0
    #: the walked reverse states (``_state_rev``): 0, a loop over the chunks with one over the
    #: query heads in it (not pipelined: ptxas at D 128 bf16 shows the same shared memory at
    #: any stage count); n > 0, one loop over the (chunk, head) pairs pipelined over n stages
    #: (the same sums in the same order; through tensor descriptors only: ptxas at D 128 bf16,
    #: TMA, 2 stages: 255 registers, no spill, 98 against 69 KB of shared memory; the pointer
    #: path spills 92 B and keeps the nested loops). Off by default: not yet measured
    state_rev_stages: int = 0
    #: the query side of the backward in one kernel (``_bwd_q``: the dq pass, then dfq or the
    #: map's du over all F features from the dO, GF and DDEN it holds) where one dfq program
    #: takes all F features (``_grad_fc`` = F: ``grad_f_chunk``, or ``f_chunk`` where that is
    #: None, at least F) and the LA branch runs: one launch and one read of dO fewer, the
    #: same results bit for bit. Its dfq / du buffer is then allocated while the reverse
    #: states' dnum (B, H, T, D) is alive (the two-kernel path frees dnum first): more peak
    #: memory, so it applies to walked states only (``use_split_states`` False: by default
    #: the short sequences, where the launch matters; at any length with ``split_states``
    #: False). On in ``default_config`` for D >= 128 bf16 since session 17 (measured there)
    fuse_q_side: bool = False
    #: the key side of the backward in one grid (``_bwd_kv``: ``_bwd_dkv_la``'s grid, its dv
    #: programs doing ``_bwd_dkv_swa``'s work first) where both branches run, dv is asked for
    #: (dk too, or computed into scratch as the window kernel does where k takes none) and
    #: the dfk and dv programs share their key tile (``dkv_block_n`` = ``dv_block_n``): one
    #: launch fewer, and no fp32 buffer of the window's dv share
    #: (B, Hkv, T, D) written and read back; the same results bit for bit. On in
    #: ``default_config`` for D >= 128 bf16 since session 17 (measured there)
    fuse_kv_side: bool = False
    #: ``_bwd_kv``'s programs (where ``fuse_kv_side`` applies): 0, the grid's third axis holds
    #: a key block's dfk programs first and its dv program (the window's dk, dv, then LA's
    #: dv: about twice a dfk program's work) last; 1, the dv program first (the same
    #: programs, the heavier ones scheduled first: the same results bit for bit); 2, one
    #: program a key block doing all of it (``_dkv_la_both``: each LA query tile's fq and dO
    #: loaded once for dfk and dv; dv's terms summed in another order) where one dfk program
    #: takes all F features (``_grad_fc`` = F; otherwise 0: the same results, another speed).
    #: ptxas (sm_90a, D 128, F 256, the default's tiles): 0 / 1, 255 registers and 68 B of
    #: spill; 2, 255 and 120 B. 2 in ``default_config`` for D >= 128 bf16 since session 18
    #: (measured there: `_bwd_kv` at 8 x 1k 0.610 ms, 0.597 with 1, 0.565 with 2)
    kv_order: int = 0
    #: the LA state kernels (walked, ``_state_fwd`` and ``_state_rev`` at
    #: ``state_rev_stages`` 0; split, ``_state_local``), bf16 / fp16 inputs: their vector sums
    #: (z = sum fk_i, the value sums, u = sum dden_t fq_t, w = sum dnum_t) as tensor-core
    #: products (``_sums_mma``, ``_wsums_mma``: dden split into two 16-bit parts, u within
    #: ~2^-16 of the fp32 sum, tested to 2^-14 under the interpreter, ``state_sums_case``;
    #: the other sums exact products summed in fp32) instead of
    #: reductions across the tile's rows, which every step of the walks does for a
    #: 128 x 128 tile at the default tiles. On in ``default_config`` for D >= 128 bf16 since
    #: session 18 (measured there: `_state_rev` at 8 x 1k 0.166 to 0.086 ms)
    state_sums_mma: bool = False
    #: with the maps folded in (``hybrid_kernel(maps=...)``) and no backward to follow
    #: (evaluation, prefill): ``_fwd`` computes phi_q from q itself (``_mapped_q``: each
    #: packed head's rows times its own weight, the map kernel's activations), held in
    #: registers, so phi_q (B, H, T, F) is never written nor read back; the k map still runs
    #: as its own kernel (its output feeds the state kernels too). The features are the map
    #: kernel's up to the rounding of u's products (another tile shape), so the output is
    #: within bf16 rounding of the unfolded call's, not bit for bit. Off: measured slower on
    #: an H200 (session 22, 8 x 1k: `_fwd` 0.246 to 0.397 ms against the 0.103 the q map's
    #: own launch saves; each program loads its 4 heads' weights for 16 rows each, 4 times
    #: the weight traffic of the map's kernel, and multiplies on 16-row mma.sync tiles)
    map_q_forward: bool = False
    #: the LA state spacing of the forward where no backward follows (evaluation, prefill;
    #: None: ``state_chunk``): a forward program walks the keys between its state and its
    #: block, ~state_chunk / 2 + window - its positions on average, so a shorter spacing
    #: takes fewer key blocks per program for more states (``_state_fwd``). The backward's
    #: spacing (``state_chunk``) is untouched: its states come from the forward under grad.
    #: The same sums grouped otherwise (within rounding of ``state_chunk``'s, not bit for bit).
    #: 64 measured slower at 8 x 1k (session 22, with ``map_q_forward`` on: 16 chunks build
    #: their states split, 0.15 ms against the walk's 0.028, for 0.011 ms less in `_fwd`)
    forward_state_chunk: int | None = None
    #: ``_fwd`` loads each program's fq rows once, as two halves (BM, F / 2) it keeps for the
    #: state's product and every key block's (``_held_fq``; the products MAP_Q's halves
    #: take), instead of a ``f_chunk`` slice at a time for the state and again for each key
    #: block, ~3.7 times in all at 8 x 1k (the ~2.7 key blocks between a program's state and
    #: its window). Per forward program at the 8B shape (64 rows, 32-key blocks, states every
    #: 128): ~310 KB read from L2, of which fq's reloads ~86 KB; `_fwd` reads ~1.3 GB at
    #: 8 x 1k in 0.246 ms (~5.2 TB/s, near what an H100/H200's L2 delivers), so it may be
    #: bound by L2 traffic. ptxas (sm_90a, the default's tiles, launch hints): 243-255
    #: registers, no spill, 112 KB of shared memory (the halves staged there once for the
    #: products: still two programs a multiprocessor); 248 / 0 / 80 KB without. The same
    #: sums, the feature dimension in two halves instead of ``f_chunk`` slices: within
    #: rounding, not bit for bit. Off: measured no faster (session 23, one H100, 8 x 1k,
    #: `kernel_anatomy --branches layer-hold-fq`: `_fwd` 0.255 to 0.253 ms, where 0.20-0.23
    #: was predicted; results/h100_2026-12-05c): `_fwd` is not bound by its L2 bytes
    hold_fq: bool = False
    #: ``_fwd`` reads its key-side tiles (k and v of the window, fk and v of the LA keys)
    #: through tensor descriptors (TMA: into shared memory, asynchronously, no pointer tensors
    #: in registers) where ``triton_common.tma_ok`` allows; by pointers otherwise (the same
    #: values, bit for bit: rows past T read as zeros either way). Why: `_fwd` is bound neither
    #: by its products (states every 64, ~20% fewer: -4%, session 22) nor by its L2 bytes
    #: (``hold_fq``: none, session 23); its key loops issue each block's loads by pointers in
    #: the 4-warp programs' registers (240-255 a thread). Off: measured slower (session 24,
    #: one H100, 8 x 1k, ``kernel_anatomy --branches layer,layer-fwd-tma``: `_fwd` 0.255 to
    #: 0.312 ms; results/h100_2026-12-05d), so the pointer loads are not what binds `_fwd`
    fwd_tma: bool = False
    #: ``_fwd`` stores each program's LA output (in the output's dtype: into the saved LA
    #: branch where the branches are saved, else into the output, which the mixer's result
    #: then overwrites) before the window's pass and reads it back for the mixer (``PARK``),
    #: so that its (BM, D) fp32 tile is not live through the window's loop. Why: ptxas
    #: (sm_90a, the default's tiles, launch hints) reads `_fwd` at 248 registers, its LA part
    #: alone 168 and its window part alone 128: the LA tile held across the window's loop
    #: sets the peak, and at 248 only two 4-warp programs fit a multiprocessor (three need
    #: <= 168, with at most 75 KB of shared memory each: ``fwd_maxnreg``, ``fwd_stages``).
    #: The mixer then takes the LA output rounded to the output's dtype (a 16-bit output:
    #: within its rounding, not bit for bit); the saved LA branch, and so the gradients, are
    #: the same as without.
    park_la: bool = False
    #: the register cap ptxas compiles ``_fwd`` to (Triton's ``maxnreg``; None: no cap): 168
    #: lets three 4-warp programs share a multiprocessor's 64K registers, at the price of
    #: what spills past it (ptxas at the default's tiles: 172 B a thread without ``park_la``).
    #: Not applied where the q map runs in ``_fwd`` nor to held fq rows (``_fwd_launch_options``)
    fwd_maxnreg: int | None = None
    #: ``_fwd``'s pipeline stages (None: ``stages``): the shared memory its loops' copies
    #: take (ptxas, the default's tiles: 80 KB at 2, 41 KB at 1; three programs a
    #: multiprocessor need <= 75 KB)
    fwd_stages: int | None = None


#: The forward's tiles at D 128 bf16 that let two programs share a multiprocessor: 64 rows (16
#: positions of 4 query heads), 32-key blocks, 4 warps, the state product pipelined (ptxas,
#: sm_90a, launch hints: 248 registers - 254 saving the branches - and 80 KB of shared memory,
#: where the 128 x 64 8-warp tiles before (``ONE_PROGRAM_FORWARD``) take 254 and 192 KB: one
#: program a multiprocessor, its own 8 warps the only ones to hide its latency). Measured on
#: one H200 (session 19, call 1, `kernel_anatomy.py --branches layer,layer-fwd64-bn32-ss2,...`;
#: results/h200_2026-12-04c):
#: `_fwd` at 8 x 1k 0.281 to 0.249 ms (no grad) and 0.318 to 0.279 (saving the branches), the
#: layer's forward 0.452 to 0.420, fwd + bwd 1.793 to 1.754. ``default_config``'s since
#: 2026-12-05 (session 21), after the GPU tests passed with them compiled
#: (``test_options_give_the_same_results[fwd_two_programs-fixed/shared]``, call 1,
#: results/h200_2026-12-05)
TWO_PROGRAM_FORWARD = dict(block_m=64, block_n=32, warps=4, state_product_stages=2,
                           park_la=False, fwd_maxnreg=None)
#: A forward for D 128 bf16 measured faster in session 25, not the default (``DEFAULT_FORWARD``
#: says why): 128 rows (32 positions of 4 query
#: heads) on 8 warps, 32-key blocks, the state product pipelined, the LA output parked through
#: the window's loop (``park_la``) and the registers capped at 128 (``fwd_maxnreg``): ptxas
#: (sm_90a, launch hints) 128 registers, 56 B of spill, 112 KB, so two programs (16 warps) a
#: multiprocessor, where ``TWO_PROGRAM_FORWARD``'s take 248 registers and two programs of 4
#: warps. Measured on one H100 (session 25, one run, `kernel_anatomy --branches
#: layer,layer-park-r128-bm128`, 8 x 1k, device time; results/h100_2026-12-05f): the layer's
#: forward 0.409 to 0.388 ms (`_fwd` 0.255 to 0.234), fwd + bwd 1.823 to 1.830 (the saving
#: forward's `_fwd` 0.289 to 0.294). The other rows of that run: parked on 64 rows capped at
#: 168 with one stage 0.419, at 128 with one stage 0.421 (more programs, less pipelining:
#: slower), on 16-key blocks capped at 168 0.394. Its GPU tests passed there
#: (``test_options_give_the_same_results[park_la_r128_bm128-*]``). Other group sizes (Qwen2's
#: 7: one head a program, 128 positions) take these tiles unmeasured
PARKED_FORWARD = dict(block_m=128, block_n=32, warps=8, state_product_stages=2, park_la=True,
                      fwd_maxnreg=128)
#: The forward's tiles ``default_config`` gives at D >= 128 bf16 (read when it first builds a
#: shape's config: set it before the first call, or clear ``default_config``'s cache).
#: ``TWO_PROGRAM_FORWARD``: session 25's GPU run of the kernel tests with ``PARKED_FORWARD``
#: and ``triton_phi.WEIGHTS_IN_KERNEL`` "walk" as defaults (one H100, call 2,
#: results/h100_2026-12-05g) had the output gate's test read different outputs on two
#: identical calls (la_only), on the call saving its output as its branch against the one
#: storing a copy (hybrid; bit for bit by design) and 80 KB more held (swa_only); no GPU time
#: was left to
#: find which change, if either, does it (``benchmarks/validate_gpu.sh bisect-gate`` runs
#: that test with each set on alone), so neither became the default
DEFAULT_FORWARD = TWO_PROGRAM_FORWARD
#: The forward's tiles at D 128 bf16 until 2026-12-05 (sessions 11-20): 128 rows, 64-key
#: blocks, 8 warps, the state product not pipelined (the A/B of ``TWO_PROGRAM_FORWARD``)
ONE_PROGRAM_FORWARD = dict(block_m=128, block_n=64, warps=8, state_product_stages=0,
                           park_la=False, fwd_maxnreg=None)


@functools.lru_cache(maxsize=64)  # (a KernelConfig is frozen: one per shape, not per call)
def default_config(D: int, F: int, dtype: torch.dtype) -> KernelConfig:
    """Tiles that fit an H100/H200's shared memory and registers: fp32 operands take twice the
    space of bf16 ones, so fp32 runs on 32-wide tiles."""
    if dtype == torch.float32:
        return KernelConfig(block_m=32, block_n=32, state_chunk=64, warps=4, stages=1,
                            bwd_block_m=32, bwd_block_n=32, bwd_warps=4, state_f=32, state_d=32,
                            f_chunk=64)
    # chosen from ptxas's register report for sm_90a (no GPU needed to read it): with D = 128
    # the fp32 accumulators of 64 x 128 tiles need 8 warps, the key-side backward 32-key tiles
    # and the feature dimension in slices of 64 (then at most 16 bytes spill per thread; a
    # 64 x 64 backward spilled 128-388 bytes); with D <= 64 nothing spills at 64 x 64.
    # LA states every 128 positions for D = 128: half the stored states (peak at T 64k 6.95 vs
    # 7.13 GiB). Speed at B 8 x T 1024 is not settled: two H200 runs of attention_speed.py
    # --tune gave the kernel's forward 0.70 vs 0.93 ms and 0.83 vs 0.74 ms (128 vs 64), fwd +
    # bwd within 1-6% (benchmarks/results/h200_2026-12-02/README.md)
    # The key-side backward on 64-key tiles (``dkv_block_n``: wgmma, where 32-key tiles get
    # mma.sync only) and the split states on 128 x 128 tiles (``split_tile``): chosen from
    # ptxas's report, measured in session 10 (benchmarks/results/h200_2026-12-03b/README.md)
    # The forward at 128 queries a program since session 11: ptxas's report compiled with the
    # divisibility hints a real launch passes (tests/test_triton_compile.py ``launch_hints``)
    # shows 255 registers and 4 bytes of spill, the loads pipelined (196 KB of shared memory);
    # without the hints (what the tiles above were read from) it showed 1008 bytes of spill.
    # Measured on one H200 (device time, kernel alone; attention_speed.py --tune, configs
    # default / fwd128): the forward at 8 x 1k 0.508 to 0.400 ms, at 1 x 64k 4.82 to 3.84 ms
    # (benchmarks/results/h200_2026-12-03c/README.md)
    # The query-side backward (dq, dfq) at 128 queries (``dq_block_m``; 243 / 254 registers, no
    # spill with the hints) since session 12: kernel alone, fwd + bwd in device time, 8 x 1k
    # 1.828 to 1.784 ms, 1 x 64k 15.62 to 15.27 (tune configs default / dq128, one run). LA
    # states every 64 positions with it were slower (cs64: 2.006 / 16.92 ms; the forward 0.400
    # to 0.502 at 8 x 1k; benchmarks/results/h200_2026-12-03d/README.md; the slower part was
    # the split state builder those 16 chunks took, the walked cs64 is slower too: its state
    # walks 0.057 to 0.091 and 0.207 to 0.313 ms, results/h200_2026-12-03e)
    # The forward with the 4 query heads of a kv head in one program (``pack_heads``, 32
    # positions of 4 heads; 240 / 250 registers, no spill) since session 13: kernel alone,
    # device time at 8 x 1k, `_fwd` 0.351 to 0.278 ms (no grad), fwd + bwd 1.792 to 1.725; the
    # layer 2.263 to 2.205 ms, its forward 0.545 to 0.484 (kernel_anatomy.py, configs pack1 /
    # default; results/h200_2026-12-03e/README.md). The query-side backward packed the same
    # way (``dq_pack_heads`` None; 156 / 248 registers, no spill): `_bwd_dq` 0.293 to 0.244,
    # `_bwd_dfq` 0.215 to 0.175, fwd + bwd 1.739 to 1.652; the layer 2.141 ms (call 3).
    # The walked state kernels on 128 x 128 tiles while that leaves 128 programs (one a
    # multiprocessor; 202 / 253 registers, no spill): at 8 x 1k (128 programs) `_state_rev`
    # 0.208 to 0.166 ms, `_state_fwd` 0.057 to 0.044, fwd + bwd 1.663 to 1.608 (kernel_anatomy,
    # call 4) and 1.669 to 1.610 in a second run (--tune, gradients 2.7e-6 from the 64 x 64
    # tiles'); 128 x 64 gained nothing (0.209). Other batch sizes get the halved tiles the
    # rule gives (not measured); 4k and longer build their states split (``split_tile``)
    # `_bwd_dkv_la`'s dv programs at 64 keys, in one grid with its dfk programs (``dv_block_n``;
    # 225 registers, wgmma, no spill) since session 14: `_bwd_dkv_la` 0.406 (dfk launch 0.197,
    # dv launch 0.209) to 0.394 ms in one launch, fwd + bwd 1.595 to 1.581 (kernel_anatomy,
    # configs default / dv64, one run; output identical; results/h200_2026-12-03f, call 2)
    # The backward's fused kernels (``fuse_q_side``, ``fuse_kv_side``) since session 17: the
    # layer at 8 x 1k, device time, 1.980 ms without, 1.953 with either, 1.927 with both
    # (`_bwd_dq` + `_bwd_dfq` 0.461 to `_bwd_q` 0.433, `_bwd_dkv_swa` + `_bwd_dkv_la` 0.634 to
    # `_bwd_kv` 0.610; kernel_anatomy, one run; all 12 GPU variants bit for bit against the
    # separate kernels; results/h200_2026-12-04, call 1). D < 128 and fp32 keep them off (not
    # measured there)
    # ``_bwd_kv`` as one program a key block (``kv_order`` 2) and the state kernels' vector
    # sums on the tensor cores (``state_sums_mma``) since session 18: the layer at 8 x 1k,
    # device time, 1.928 ms, 1.878 with the first (`_bwd_kv` 0.610 to 0.565), 1.839 with the
    # second (`_state_rev` 0.166 to 0.086); the dv program scheduled first (``kv_order`` 1)
    # 1.910 (`_bwd_kv` 0.597). The kernel alone at 1 x 64k 13.31 to 12.92 ms with the first
    # (kernel_anatomy and attention_speed.py --tune, one run; results/h200_2026-12-04b, call 1)
    # The forward on ``TWO_PROGRAM_FORWARD``'s tiles since session 21 (see there;
    # ``DEFAULT_FORWARD``, ``PARKED_FORWARD``: session 25)
    # Measured slower and not taken (session 22, kernel_anatomy at 8 x 1k, device time;
    # results/h200_2026-12-05b): the q map inside the no-grad forward's ``_fwd``
    # (``map_q_forward``), the forward 0.413 to 0.462 ms (`_fwd` 0.246 to 0.397, the maps'
    # launch 0.131 to 0.028 for the k map alone), on 128 x 32 8-warp programs 0.508; LA states
    # every 64 positions (``state_chunk`` or ``forward_state_chunk`` 64, with the q map in
    # `_fwd`): `_fwd` 0.397 to 0.386, but 16 chunks build their states split (0.15 ms against
    # `_state_fwd`'s 0.028), the forward 0.58
    if D >= 128:
        return KernelConfig(**DEFAULT_FORWARD, state_chunk=128, stages=2, bwd_block_m=64,
                            bwd_block_n=32, bwd_warps=8, f_chunk=64, state_warps=8,
                            grad_f_chunk=256, dkv_block_n=64, split_tile=128,
                            dq_block_m=128, pack_heads=4, state_f=128, state_d=128,
                            state_programs=128, dv_block_n=64, fuse_q_side=True,
                            fuse_kv_side=True, kv_order=2, state_sums_mma=True)
    return KernelConfig(block_m=64, block_n=64, warps=4, stages=2, bwd_block_m=64,
                        bwd_block_n=64, bwd_warps=8, f_chunk=128)


# ============================================================================= the kernels
if HAVE_TRITON:
    from ..triton_common import key_block  # (defined where triton imports)
    from ..feature_map.kernels import _acts as _phi_acts  # (the maps' activations, jit)

    @triton.jit
    def _tiles_of(X, s0, s1, s2, N0, N1, T, C, BR: tl.constexpr, BC: tl.constexpr,
                  TMA: tl.constexpr):
        """Where ``_tile`` reads (BR, BC) tiles of the strided (N0, N1, T, C) tensor X from: a
        tensor descriptor (TMA: the loads go through the tensor memory accelerator, into
        shared memory, pipelined, no pointer tensors in registers), or X itself. Build it
        outside loops (the pipeliner cannot predicate a descriptor's creation)."""
        if TMA:
            return tl.make_tensor_descriptor(X, shape=[N0, N1, T, C], strides=[s0, s1, s2, 1],
                                             block_shape=[1, 1, BR, BC])
        else:
            return X

    @triton.jit
    def _tile(src, i0, i1, r0, c0, s0, s1, s2, T, BR: tl.constexpr, BC: tl.constexpr,
              TMA: tl.constexpr):
        """Rows r0 .. r0 + BR - 1 (zeros at rows past T; r0 >= 0), columns c0 .. c0 + BC - 1
        of entry (i0, i1) of the tensor ``_tiles_of`` gave ``src`` for."""
        if TMA:
            return src.load([i0, i1, r0, c0]).reshape(BR, BC)
        else:
            offs_r = r0 + tl.arange(0, BR)
            offs_c = c0 + tl.arange(0, BC)
            return tl.load(src + i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1
                           + offs_r[:, None] * s2 + offs_c[None, :], mask=(offs_r < T)[:, None],
                           other=0.0)

    @triton.jit
    def _state_fwd(FK, V, KPM, SST, ZST, VST,
                   sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t,
                   T, Hkv, NC,
                   F: tl.constexpr, D: tl.constexpr, CS: tl.constexpr, BF: tl.constexpr,
                   BD: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr,
                   SM: tl.constexpr = 0):
        """S_j = sum_{i < j CS, real} fk_i v_i^T (F x D), z_j = sum fk_i, u_j = sum v_i (the
        kernel floor's share of the numerator), for j < NC. SM: z and u as tensor-core
        products (``_sums_mma``; ``KernelConfig.state_sums_mma``)."""
        pid_bh = tl.program_id(0)
        pid_f = tl.program_id(1)
        pid_d = tl.program_id(2)
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        offs_f = pid_f * BF + tl.arange(0, BF)
        offs_d = pid_d * BD + tl.arange(0, BD)
        offs_c = tl.arange(0, CS)
        fk_base = FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
        v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
        st_base = SST + pid_bh.to(tl.int64) * NC * F * D
        z_base = ZST + pid_bh.to(tl.int64) * NC * F
        v_sum_base = VST + pid_bh.to(tl.int64) * NC * D
        S = tl.zeros([BF, BD], dtype=tl.float32)
        z = tl.zeros([BF], dtype=tl.float32)
        vs = tl.zeros([BD], dtype=tl.float32)
        c16 = tl.arange(0, 16)
        z16 = tl.zeros([BF, 16], dtype=tl.float32)
        vs16 = tl.zeros([BD, 16], dtype=tl.float32)
        for j in range(0, NC):
            if SM:
                z = _first_cols(z16, c16, 1)
                vs = _first_cols(vs16, c16, 1)
            _store_state(st_base, z_base, v_sum_base, j, S, z, vs, offs_f, offs_d, pid_f, pid_d,
                         F, D)
            offs_n = j * CS + offs_c
            keep = offs_n < T
            if HAS_KPM:
                keep = keep & (tl.load(KPM + b * T + offs_n, mask=offs_n < T, other=0) != 0)
            fk = tl.load(fk_base + offs_n[:, None] * sfk_t + offs_f[None, :], mask=keep[:, None],
                         other=0.0)
            v = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=keep[:, None],
                        other=0.0)
            S += tl.dot(tl.trans(fk), v, input_precision=PREC)
            if SM:
                z16 += _sums_mma(fk, c16, CS, PREC)
                if pid_f == 0:
                    vs16 += _sums_mma(v, c16, CS, PREC)
            else:
                z += tl.sum(fk.to(tl.float32), axis=0)
                if pid_f == 0:
                    vs += tl.sum(v.to(tl.float32), axis=0)

    @triton.jit
    def _state_local(X, Y, KPM, SHIFT, DDEN, LST, XL, YL,
                     sx_b, sx_h, sx_t, sy_b, sy_h, sy_t,
                     T, Hkv, G, NC,
                     F: tl.constexpr, D: tl.constexpr, CS: tl.constexpr, BF: tl.constexpr,
                     BD: tl.constexpr, REVERSE: tl.constexpr, HAS_KPM: tl.constexpr,
                     PREC: tl.constexpr, TMA: tl.constexpr, SM: tl.constexpr = 0):
        """One chunk's share of the LA states (``split_states``; fp32, summed by
        ``_state_scan``), all chunks in parallel. Forward (X = fk, Y = v, G = 1): chunk j holds
        L_j = sum fk_i v_i^T, sum fk_i and sum v_i over its real keys i in [j CS, (j+1) CS).
        Reverse (X = fq, Y = dnum = GF dO as ``_bwd_dq`` stored it, summed over the G query
        heads h of the kv head): positions t with t - shift_h in [j CS, (j+1) CS) give
        L_j = sum fq_t dnum_t^T, sum DDEN_t fq_t and sum dnum_t. X and Y are read through
        ``_tile`` (ptxas, sm_90a, D 128, F 256: the reverse loop 104 registers through tensor
        descriptors, 255 through pointer tensors). SM: the vector sums as tensor-core products
        (``_sums_mma``, ``_wsums_mma``; ``KernelConfig.state_sums_mma``)."""
        j = tl.program_id(0)
        pid_t = tl.program_id(1)
        pid_bh = tl.program_id(2)  # b * Hkv + hk
        pid_f = pid_t // (D // BD)
        pid_d = pid_t % (D // BD)
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        H = Hkv * G
        offs_f = pid_f * BF + tl.arange(0, BF)
        offs_d = pid_d * BD + tl.arange(0, BD)
        offs_c = tl.arange(0, CS)
        B = tl.num_programs(2) // Hkv
        NH = H if REVERSE else Hkv  # X, Y: (B, H, T, .) query-side, (B, Hkv, T, .) key-side
        xsrc = _tiles_of(X, sx_b, sx_h, sx_t, B, NH, T, F, CS, BF, TMA)
        ysrc = _tiles_of(Y, sy_b, sy_h, sy_t, B, NH, T, D, CS, BD, TMA)
        acc = tl.zeros([BF, BD], dtype=tl.float32)
        xs = tl.zeros([BF], dtype=tl.float32)
        ys = tl.zeros([BD], dtype=tl.float32)
        c16 = tl.arange(0, 16)
        xs16 = tl.zeros([BF, 16], dtype=tl.float32)
        ys16 = tl.zeros([BD, 16], dtype=tl.float32)
        if REVERSE:
            for g in range(0, G):
                h = hk * G + g
                bh = b * H + h  # the query head's row of SHIFT, DDEN
                t0 = j * CS + tl.load(SHIFT + bh)
                x = _tile(xsrc, b, h, t0, pid_f * BF, sx_b, sx_h, sx_t, T, CS, BF, TMA)
                y = _tile(ysrc, b, h, t0, pid_d * BD, sy_b, sy_h, sy_t, T, CS, BD, TMA)
                acc += tl.dot(tl.trans(x), y, input_precision=PREC)
                if pid_d == 0:
                    offs_t = t0 + offs_c
                    dd = tl.load(DDEN + bh.to(tl.int64) * T + offs_t, mask=offs_t < T,
                                 other=0.0)
                    if SM:
                        xs16 += _wsums_mma(x, dd, c16, PREC)
                    else:
                        xs += tl.sum(x.to(tl.float32) * dd[:, None], axis=0)
                if pid_f == 0:
                    if SM:
                        ys16 += _sums_mma(y, c16, CS, PREC)
                    else:
                        ys += tl.sum(y.to(tl.float32), axis=0)
            if SM:
                xs = _first_cols(xs16, c16, 2)
                ys = _first_cols(ys16, c16, 1)
        else:  # one kv head's keys (G = 1), as _state_fwd takes them
            offs_t = j * CS + offs_c
            x = _tile(xsrc, b, hk, j * CS, pid_f * BF, sx_b, sx_h, sx_t, T, CS, BF, TMA)
            y = _tile(ysrc, b, hk, j * CS, pid_d * BD, sy_b, sy_h, sy_t, T, CS, BD, TMA)
            if HAS_KPM:
                keep = tl.load(KPM + b * T + offs_t, mask=offs_t < T, other=0) != 0
                x = tl.where(keep[:, None], x, 0.0).to(x.dtype)
                y = tl.where(keep[:, None], y, 0.0).to(y.dtype)
            acc = tl.dot(tl.trans(x), y, input_precision=PREC)
            if SM:
                xs = _first_cols(_sums_mma(x, c16, CS, PREC), c16, 1)
                if pid_f == 0:
                    ys = _first_cols(_sums_mma(y, c16, CS, PREC), c16, 1)
            else:
                xs = tl.sum(x.to(tl.float32), axis=0)
                if pid_f == 0:
                    ys = tl.sum(y.to(tl.float32), axis=0)
        base = pid_bh.to(tl.int64) * NC + j
        tl.store(LST + base * F * D + offs_f[:, None] * D + offs_d[None, :], acc)
        if pid_d == 0:
            tl.store(XL + base * F + offs_f, xs)
        if pid_f == 0:
            tl.store(YL + base * D + offs_d, ys)

    @triton.jit
    def _state_scan(LST, SST, NC, N, BLK: tl.constexpr, U: tl.constexpr,
                    REVERSE: tl.constexpr):
        """The exclusive running sums of ``_state_local``'s chunk shares (LST, (rows, NC, N)
        fp32) in chunk order (forward: entry j sums the chunks before j) or reversed (entry j
        sums those after j), into SST (same shape, any dtype). One program per (row, BLK
        elements); U chunks per step, loaded at once (their loads do not wait on each other:
        one chunk a step, each load waiting for the last, held a 64k call's scan at 0.68 ms
        for 0.8 GB, benchmarks/results/h200_2026-12-02b). Entry j is the carry plus an inclusive
        scan of the step's chunks shifted by one, so no entry is a difference of two sums."""
        row = tl.program_id(0)
        offs_e = tl.program_id(1) * BLK + tl.arange(0, BLK)
        offs_u = tl.arange(0, U)
        cols = offs_e < N
        base = row.to(tl.int64) * NC * N
        carry = tl.zeros([BLK], dtype=tl.float32)
        for step in range(0, tl.cdiv(NC, U)):
            j0 = step * U
            jj = j0 + offs_u  # the step's chunks in scan order
            prev = jj - 1  # the chunk before each in scan order
            if REVERSE:
                jj = NC - 1 - jj
                prev = NC - 1 - prev
            ok = (j0 + offs_u) < NC
            share = tl.load(LST + base + jj[:, None].to(tl.int64) * N + offs_e[None, :],
                            mask=ok[:, None] & cols[None, :], other=0.0)
            before = tl.load(LST + base + prev[:, None].to(tl.int64) * N + offs_e[None, :],
                             mask=(ok & (offs_u > 0))[:, None] & cols[None, :], other=0.0)
            out = carry[None, :] + tl.cumsum(before, axis=0)
            tl.store(SST + base + jj[:, None].to(tl.int64) * N + offs_e[None, :],
                     out.to(SST.dtype.element_ty), mask=ok[:, None] & cols[None, :])
            carry += tl.sum(share, axis=0)

    @triton.jit
    def _saved_dot(SAVED, DO, s_rows, do_rows, rows, D: tl.constexpr, BM: tl.constexpr):
        """SAVED_t . dO_t for BM query rows (row r at ``SAVED + s_rows[r]``, dO at ``DO +
        do_rows[r]``), the forward's stored branch output read instead of recomputed;
        taken 32 channels at a time (dO re-read from cache) so that no (BM, D) fp32 tile
        is live: a whole-tile version spilled 232-632 bytes per thread in the dq kernel."""
        DC: tl.constexpr = 32 if D > 32 else D
        acc = tl.zeros([BM], dtype=tl.float32)
        for c in tl.static_range(D // DC):
            offs_c = c * DC + tl.arange(0, DC)
            x = tl.load(SAVED + s_rows[:, None] + offs_c[None, :], mask=rows[:, None],
                        other=0.0)
            do = tl.load(DO + do_rows[:, None] + offs_c[None, :], mask=rows[:, None], other=0.0)
            acc += tl.sum(x.to(tl.float32) * do.to(tl.float32), axis=1)
        return acc

    @triton.jit
    def _packed_rows(pid_m, pid_g, H, G, BM: tl.constexpr, P: tl.constexpr):
        """A program's BM query rows over P query heads of one kv head (``pack_of``): batch
        row, kv head, first position t0 (blocks of BM / P positions), and per row its query
        head and position."""
        BQ: tl.constexpr = BM // P
        b = pid_g // (H // P)
        h0 = (pid_g % (H // P)) * P
        r_ = tl.arange(0, BM)
        t0 = pid_m * BQ
        return b, h0 // G, t0, h0 + r_ // BQ, t0 + r_ % BQ

    @triton.jit
    def _head_sums(x, PART, b, H, pid_m, NMB, pid_g, BM: tl.constexpr, P: tl.constexpr):
        """Per query head, the sum of ``x`` over its rows of the program (``_packed_rows``),
        stored at PART[(b H + h) NMB + pid_m] (the mixer gradients' partial sums)."""
        BQ: tl.constexpr = BM // P
        h0 = (pid_g % (H // P)) * P
        part = tl.sum(tl.reshape(x, [P, BQ]), axis=1)
        heads = b * H + h0 + tl.arange(0, P)
        tl.store(PART + heads.to(tl.int64) * NMB + pid_m, part)

    @triton.jit
    def _state_share(FQ, fq_rows, rows, st, zt, sl, num, den, D: tl.constexpr,
                     FC: tl.constexpr, PREC: tl.constexpr):
        """The stored state's share of LA over feature slice ``sl`` (FC wide): num += fq S,
        den += fq . z, for the rows whose fq starts at ``FQ + fq_rows``."""
        offs_f = sl * FC + tl.arange(0, FC)
        fq = tl.load(FQ + fq_rows[:, None] + offs_f[None, :], mask=rows[:, None], other=0.0)
        return _state_slice(fq, st, zt, sl, num, den, D, FC, PREC)

    @triton.jit
    def _state_slice(fq, st, zt, sl, num, den, D: tl.constexpr, FC: tl.constexpr,
                     PREC: tl.constexpr):
        """``_state_share`` for the rows' features of slice ``sl`` given, fq (BM, FC): loaded
        (``_state_share``) or held in registers (the halves of ``_mapped_q``)."""
        offs_d = tl.arange(0, D)
        offs_f = sl * FC + tl.arange(0, FC)
        S = tl.load(st + offs_f[:, None] * D + offs_d[None, :])
        z = tl.load(zt + offs_f)
        num += tl.dot(fq, S, input_precision=PREC)
        den += tl.sum(fq.to(tl.float32) * z[None, :], axis=1)
        return num, den

    @triton.jit
    def _stack_rows(x, y):
        """x's rows, then y's: (2 R, C) from two (R, C)."""
        j = tl.permute(tl.join(x, y), (2, 0, 1))
        return tl.reshape(j, (2 * x.shape[0], x.shape[1]))

    @triton.jit
    def _head_features(Q, WQ, BW, b, h, t0, T, sq_b, sq_h, sq_t, D: tl.constexpr,
                       FH: tl.constexpr, BQ: tl.constexpr, SOFTMAX: tl.constexpr,
                       PREC: tl.constexpr):
        """phi_q of positions t0 .. t0 + BQ - 1 of query head h: its two halves (BQ, FH) in
        q's dtype, as ``triton_phi._phi_fwd`` writes them (the same products and activations:
        ``triton_phi._acts``); rows past T hold the features of a zero q (never stored)."""
        offs_i = t0 + tl.arange(0, BQ)
        offs_d = tl.arange(0, D)
        offs_f = tl.arange(0, FH)
        x = tl.load(Q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
                    + offs_i.to(tl.int64)[:, None] * sq_t + offs_d[None, :],
                    mask=(offs_i < T)[:, None], other=0.0)
        w = tl.load(WQ + h.to(tl.int64) * D * FH + offs_d[:, None] * FH + offs_f[None, :])
        bias = tl.load(BW + h * FH + offs_f).to(tl.float32)
        a1, a2 = _phi_acts(x, w, bias, SOFTMAX, PREC)
        return a1.to(Q.dtype.element_ty), a2.to(Q.dtype.element_ty)

    @triton.jit
    def _mapped_q(Q, WQ, BW, b, h0, t0, T, sq_b, sq_h, sq_t, D: tl.constexpr,
                  FH: tl.constexpr, BQ: tl.constexpr, P: tl.constexpr, SOFTMAX: tl.constexpr,
                  PREC: tl.constexpr):
        """phi_q's two halves (P BQ, FH) for a forward program's rows (``_packed_rows``: BQ
        positions from t0 of each of the P query heads h0 .. h0 + P - 1, head after head):
        each head's product with its own weight on its BQ rows, then the rows stacked (P in
        1, 2, 4)."""
        a1, a2 = _head_features(Q, WQ, BW, b, h0, t0, T, sq_b, sq_h, sq_t, D, FH, BQ,
                                SOFTMAX, PREC)
        if P >= 2:
            b1, b2 = _head_features(Q, WQ, BW, b, h0 + 1, t0, T, sq_b, sq_h, sq_t, D, FH, BQ,
                                    SOFTMAX, PREC)
            if P == 4:
                c1, c2 = _head_features(Q, WQ, BW, b, h0 + 2, t0, T, sq_b, sq_h, sq_t, D, FH,
                                        BQ, SOFTMAX, PREC)
                d1, d2 = _head_features(Q, WQ, BW, b, h0 + 3, t0, T, sq_b, sq_h, sq_t, D, FH,
                                        BQ, SOFTMAX, PREC)
                a1 = _stack_rows(_stack_rows(a1, b1), _stack_rows(c1, d1))
                a2 = _stack_rows(_stack_rows(a2, b2), _stack_rows(c2, d2))
            else:
                a1 = _stack_rows(a1, b1)
                a2 = _stack_rows(a2, b2)
        return a1, a2

    @triton.jit
    def _held_fq(FQ, fq_rows, rows, FH: tl.constexpr):
        """The rows' fq as its two halves (BM, FH), loaded once (``_fwd``'s HOLD_FQ)."""
        offs_h = tl.arange(0, FH)
        at = FQ + fq_rows[:, None] + offs_h[None, :]
        return (tl.load(at, mask=rows[:, None], other=0.0),
                tl.load(at + FH, mask=rows[:, None], other=0.0))

    @triton.jit
    def _la_num(FQ, FK, V, SST, ZST, VST, CNT, KPM, b, hk, Hkv, t0, offs_m, fq_rows, shift_r, T,
                NC, eps, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, A1, A2,
                D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                BQ: tl.constexpr, BN: tl.constexpr, CS: tl.constexpr, HAS_KPM: tl.constexpr,
                PREC: tl.constexpr, SS: tl.constexpr, HELD: tl.constexpr,
                TMA: tl.constexpr = False):
        """Numerator (BM, D) and denominator (BM) of LA over keys i <= t - shift for BM query
        rows of one kv head: row r is position ``offs_m[r]`` (in t0 .. t0 + BQ - 1) of the query
        head whose fq row starts at ``FQ + fq_rows[r]``, with its own ``shift_r[r]`` (the rows
        of a program may come from several query heads of the kv head, ``_fwd``'s P). Kernel
        values fq.fk + eps: the nearest stored state at or before t0 - max(shift) + 1 (with the
        floor's share, eps times its value sum and its count of real keys), plus the keys
        between it and t0 + BQ - min(shift), each row masked at its own t - shift. The feature
        dimension is taken FC at a time; the state's share in a pipelined loop when SS > 0
        (``KernelConfig.state_product_stages``). HELD: the rows' features are not read from
        FQ here but given, A1 and A2 (BM, F / 2), the two halves of phi_q held in registers
        (computed, ``_mapped_q``, or loaded once, ``_held_fq``): the feature dimension is then
        taken a half at a time. TMA: FK and V are tensor descriptors of (B, Hkv, T, F) with
        (1, 1, BN, F / 2 held, else FC) blocks and of (B, Hkv, T, D) with (1, 1, BN, D) blocks
        (``_fwd``'s, ``KernelConfig.fwd_tma``)."""
        offs_d = tl.arange(0, D)
        rows = offs_m < T
        if TMA:
            fk_base = FK
            v_base = V
        else:
            fk_base = FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
            v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
        jst = tl.minimum(tl.maximum(t0 - tl.max(shift_r, axis=0) + 1, 0) // CS, NC - 1)
        st = SST + (b * Hkv + hk).to(tl.int64) * NC * F * D + jst.to(tl.int64) * F * D
        zt = ZST + (b * Hkv + hk).to(tl.int64) * NC * F + jst * F
        vsum = tl.load(VST + (b * Hkv + hk).to(tl.int64) * NC * D + jst * D + offs_d)
        n_state = tl.load(CNT + b * (T + 1) + jst * CS).to(tl.float32)  # real keys < jst CS
        num = tl.zeros([BM, D], dtype=tl.float32) + eps * vsum[None, :]
        den = tl.zeros([BM], dtype=tl.float32) + eps * n_state
        if HELD:  # the halves held in registers: one product each
            num, den = _state_slice(A1, st, zt, 0, num, den, D, F // 2, PREC)
            num, den = _state_slice(A2, st, zt, 1, num, den, D, F // 2, PREC)
        elif SS == 0:  # the slices unrolled: each slice's loads issued where the code reaches them
            for c in tl.static_range(F // FC):
                num, den = _state_share(FQ, fq_rows, rows, st, zt, c, num, den, D, FC, PREC)
        else:  # a loop the compiler pipelines (SS stages): the next slice's fq and S are
            # copied in asynchronously while this one multiplies (the same sums, same order)
            for sl in tl.range(F // FC, num_stages=SS):
                num, den = _state_share(FQ, fq_rows, rows, st, zt, sl, num, den, D, FC, PREC)
        hi = tl.minimum(t0 + BQ - tl.min(shift_r, axis=0), T)
        for start in range(jst * CS, hi, BN):
            offs_n = start + tl.arange(0, BN)
            kin = offs_n < T
            a = tl.zeros([BM, BN], dtype=tl.float32)
            if HELD:
                FH: tl.constexpr = F // 2
                offs_h = tl.arange(0, FH)
                if TMA:
                    fk1 = fk_base.load([b, hk, start, 0]).reshape(BN, FH)
                else:
                    fk1 = tl.load(fk_base + offs_n[:, None] * sfk_t + offs_h[None, :],
                                  mask=kin[:, None], other=0.0)
                a += tl.dot(A1, tl.trans(fk1), input_precision=PREC)
                if TMA:
                    fk2 = fk_base.load([b, hk, start, FH]).reshape(BN, FH)
                else:
                    fk2 = tl.load(fk_base + offs_n[:, None] * sfk_t + FH + offs_h[None, :],
                                  mask=kin[:, None], other=0.0)
                a += tl.dot(A2, tl.trans(fk2), input_precision=PREC)
            else:
                for c in tl.static_range(F // FC):
                    offs_f = c * FC + tl.arange(0, FC)
                    fq = tl.load(FQ + fq_rows[:, None] + offs_f[None, :], mask=rows[:, None],
                                 other=0.0)
                    if TMA:
                        fkb = fk_base.load([b, hk, start, c * FC]).reshape(BN, FC)
                    else:
                        fkb = tl.load(fk_base + offs_n[:, None] * sfk_t + offs_f[None, :],
                                      mask=kin[:, None], other=0.0)
                    a += tl.dot(fq, tl.trans(fkb), input_precision=PREC)
            ok = (offs_n[None, :] <= offs_m[:, None] - shift_r[:, None]) & kin[None, :]
            if HAS_KPM:
                real = tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0
                ok = ok & real[None, :]
            a = tl.where(ok, a + eps, 0.0)
            den += tl.sum(a, axis=1)
            if TMA:
                vb = v_base.load([b, hk, start, 0]).reshape(BN, D)
            else:
                vb = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :],
                             mask=kin[:, None], other=0.0)
            num += tl.dot(a.to(vb.dtype), vb, input_precision=PREC)
        return num, den

    @triton.jit
    def _fwd(Q, K, V, FQ, FK, SST, ZST, VST, CNT, OUT, LSE, DEN, CA, CB, LOGS, SHIFT, FIRST, KPM,
             SWA_O, LA_O, WQ, BW,
             sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
             sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, so_b, so_h, so_t,
             T, H, G, NC, window, scale_log2, eps, B,
             D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, CS: tl.constexpr, P: tl.constexpr, HAS_SWA: tl.constexpr,
             HAS_LA: tl.constexpr, SHARED: tl.constexpr, HAS_KPM: tl.constexpr,
             PREC: tl.constexpr, SAVE: tl.constexpr, SS: tl.constexpr,
             MAP_Q: tl.constexpr = False, SOFTMAX_Q: tl.constexpr = True,
             HOLD_FQ: tl.constexpr = False, TMA: tl.constexpr = False,
             PARK: tl.constexpr = False):
        """One program: BM query rows, BQ = BM / P positions t0 .. t0 + BQ - 1 of P query heads
        that share a kv head (P divides the group; ``KernelConfig.pack_heads``). The P heads
        read the same keys, values and LA state: one load and one product serves them all, and
        the block's key range (window and the LA keys after its state) spans BQ positions,
        not BM. MAP_Q (``KernelConfig.map_q_forward``, no backward to follow): fq is not read
        but computed from q, the q map's weight WQ (H, D, F / 2, q's dtype) and bias BW (H,
        F / 2) with the map's kernel's products and activations (softmax or exp:
        SOFTMAX_Q), and held in registers: phi_q is never written. HOLD_FQ
        (``KernelConfig.hold_fq``): fq's rows are loaded once, as two halves held in registers
        for the state's product and every key block's (the path MAP_Q's halves take), instead
        of a slice at a time, again for each key block. TMA (``KernelConfig.fwd_tma``): k, v
        and fk read through tensor descriptors (B: the batch, their bounds). PARK
        (``KernelConfig.park_la``): the LA branch's output is stored (into LA_O with SAVE, else
        into OUT, in their dtype) before the window's pass and read back for the mixer, so
        that its (BM, D) fp32 tile is not held in registers through the window's loop."""
        LN2: tl.constexpr = 0.6931471805599453
        BQ: tl.constexpr = BM // P
        pid_m = tl.program_id(0)
        pid_g = tl.program_id(1)
        b, hk, t0, h_r, offs_m = _packed_rows(pid_m, pid_g, H, G, BM, P)
        Hkv = H // G
        bh_r = b * H + h_r
        offs_d = tl.arange(0, D)
        rows = offs_m < T
        k_base = K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h
        v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
        first = tl.load(FIRST + b)
        shift_r = tl.load(SHIFT + bh_r)
        if TMA:  # (built outside the loops: the pipeliner cannot predicate their creation)
            kd = tl.make_tensor_descriptor(K, shape=[B, Hkv, T, D], strides=[sk_b, sk_h, sk_t, 1],
                                           block_shape=[1, 1, BN, D])
            vd = tl.make_tensor_descriptor(V, shape=[B, Hkv, T, D], strides=[sv_b, sv_h, sv_t, 1],
                                           block_shape=[1, 1, BN, D])
            if HAS_LA:  # (fk a placeholder otherwise)
                FCK: tl.constexpr = F // 2 if (MAP_Q or HOLD_FQ) else FC
                fkd = tl.make_tensor_descriptor(FK, shape=[B, Hkv, T, F],
                                                strides=[sfk_b, sfk_h, sfk_t, 1],
                                                block_shape=[1, 1, BN, FCK])
            else:
                fkd = FK
        else:
            kd = K
            vd = V
            fkd = FK

        # ---- linear attention over keys i <= t - shift (first: its registers are free again
        # before the window's accumulator is live)
        num = tl.zeros([BM, D], dtype=tl.float32)
        den = tl.zeros([BM], dtype=tl.float32)
        if HAS_LA:
            fq_rows = b.to(tl.int64) * sfq_b + h_r.to(tl.int64) * sfq_h \
                + offs_m.to(tl.int64) * sfq_t
            if MAP_Q:
                a1, a2 = _mapped_q(Q, WQ, BW, b, (pid_g % (H // P)) * P, t0, T,
                                   sq_b, sq_h, sq_t, D, F // 2, BQ, P, SOFTMAX_Q, PREC)
            elif HOLD_FQ:
                a1, a2 = _held_fq(FQ, fq_rows, rows, F // 2)
            else:
                a1 = 0
                a2 = 0
            num, den = _la_num(FQ, fkd, vd, SST, ZST, VST, CNT, KPM, b, hk, Hkv, t0, offs_m,
                               fq_rows, shift_r, T, NC, eps, sfk_b, sfk_h, sfk_t, sv_b, sv_h,
                               sv_t, a1, a2, D, F, FC, BM, BQ, BN, CS, HAS_KPM, PREC, SS,
                               MAP_Q or HOLD_FQ, TMA)
        has_far = (offs_m - shift_r) >= first
        r = tl.where(has_far, 1.0 / tl.maximum(den, eps), 0.0)
        la = num * r[:, None]
        o_rows = b.to(tl.int64) * so_b + h_r.to(tl.int64) * so_h + offs_m.to(tl.int64) * so_t
        t_rows = bh_r.to(tl.int64) * T + offs_m
        if PARK:  # (LA_O holds it anyway with SAVE; OUT is overwritten by the mixer's output)
            if SAVE:
                park = LA_O + t_rows[:, None] * D + offs_d[None, :]
            else:
                park = OUT + o_rows[:, None] + offs_d[None, :]
            tl.store(park, la.to(park.dtype.element_ty), mask=rows[:, None])

        # ---- windowed softmax
        m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, D], dtype=tl.float32)
        if HAS_SWA:
            q_rows = b.to(tl.int64) * sq_b + h_r.to(tl.int64) * sq_h + offs_m.to(tl.int64) * sq_t
            q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=rows[:, None], other=0.0)
            lo = tl.maximum(t0 - window + 1, 0)
            lo = (lo // BN) * BN
            hi = tl.minimum(t0 + BQ, T)
            for start in range(lo, hi, BN):
                offs_n = start + tl.arange(0, BN)
                kin = offs_n < T
                if TMA:
                    kb = kd.load([b, hk, start, 0]).reshape(BN, D)
                else:
                    kb = tl.load(k_base + offs_n[:, None] * sk_t + offs_d[None, :],
                                 mask=kin[:, None], other=0.0)
                s = tl.dot(q, tl.trans(kb), input_precision=PREC) * scale_log2
                ok = (offs_n[None, :] <= offs_m[:, None]) & \
                     (offs_n[None, :] > offs_m[:, None] - window) & kin[None, :]
                if HAS_KPM:
                    real = tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0
                    ok = ok & real[None, :]
                s = tl.where(ok, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if TMA:
                    vb = vd.load([b, hk, start, 0]).reshape(BN, D)
                else:
                    vb = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :],
                                 mask=kin[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PREC)
                m_i = m_new
        has_win = l_i > 0
        swa = acc / tl.where(has_win, l_i, 1.0)[:, None]
        lse2 = tl.where(has_win, m_i + tl.log2(tl.where(has_win, l_i, 1.0)), float("-inf"))

        # ---- mixer
        if PARK:  # (every thread's stores visible to the program's threads before the loads)
            tl.debug_barrier()
            la = tl.load(park, mask=rows[:, None], other=0.0).to(tl.float32)
        if SHARED:
            logs = tl.load(LOGS + bh_r)
            x = logs + lse2 * LN2 - tl.log(tl.maximum(den, eps))
            alpha_t = 1.0 / (1.0 + tl.exp(-x))
            alpha_t = tl.where(has_far, alpha_t, 1.0)
            alpha_t = tl.where(has_win, alpha_t, 0.0)
            out = alpha_t[:, None] * swa + (1.0 - alpha_t)[:, None] * la
        else:
            ca = tl.load(CA + bh_r)
            cb = tl.load(CB + bh_r)
            out = ca[:, None] * swa + cb[:, None] * la
        tl.store(OUT + o_rows[:, None] + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=rows[:, None])
        tl.store(LSE + t_rows, lse2, mask=rows)
        tl.store(DEN + t_rows, den, mask=rows)
        if SAVE:  # both branches, for the backward's per-query factors
            s_rows = t_rows[:, None] * D + offs_d[None, :]
            if HAS_SWA:
                tl.store(SWA_O + s_rows, swa.to(SWA_O.dtype.element_ty), mask=rows[:, None])
            if HAS_LA and not PARK:  # (PARK: stored there already)
                tl.store(LA_O + s_rows, la.to(LA_O.dtype.element_ty), mask=rows[:, None])

    @triton.jit
    def _dq_part(Q, K, V, FQ, FK, DO, SST, ZST, VST, CNT, LSE, DEN, CA, CB, LOGS, SHIFT, FIRST,
                 KPM, SWA_O, LA_O,
                 DQ, DELTA, WS, GF, DDEN, PA, PB, DNUM,
                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                 sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sdo_b, sdo_h, sdo_t,
                 sdq_b, sdq_h, sdq_t, ssv_b, ssv_h, ssv_t,
                 T, H, G, NC, NMB, window, scale, scale_log2, eps,
                 D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, CS: tl.constexpr, P: tl.constexpr, HAS_SWA: tl.constexpr,
                 HAS_LA: tl.constexpr, SHARED: tl.constexpr, HAS_KPM: tl.constexpr,
                 PREC: tl.constexpr, NEED_DQ: tl.constexpr, FROM_SAVED: tl.constexpr,
                 STORE_DNUM: tl.constexpr, SS: tl.constexpr,
                 pid_m, pid_g):
        """dq of one query block (when NEED_DQ), and the per-query factors the other kernels
        need: DELTA (the softmax row term, incl. the shared-norm lse gradient), WS (SWA
        weight), GF (dnum = GF dO), DDEN (gradient of the LA denominator), with STORE_DNUM
        dnum itself ((B H, T, D), the input dtype: the reverse states' matrix operand); PA,
        PB: this block's partial mixer gradients (d c_A, d c_B; or d log s and 0 with
        SHARED). SWA_t . dO_t and LA_t . dO_t come from recomputing both branches (first
        pass), or with FROM_SAVED from the branches' outputs the forward stored (SWA_O, LA_O,
        (B, H, T, D) at strides ssv_*: the forward's own buffers, or the call's output where
        that is its one branch, ``hybrid_kernel``'s ``output_is_branch``). Rows: BM / P
        positions of P query heads of one kv head (``_packed_rows``, block ``pid_m`` of head
        group ``pid_g``), as the forward's.
        Returns (dO, GF, DDEN) of the block's rows, for ``_bwd_q``'s dfq part."""
        LN2: tl.constexpr = 0.6931471805599453
        BQ: tl.constexpr = BM // P
        b, hk, t0, h_r, offs_m = _packed_rows(pid_m, pid_g, H, G, BM, P)
        Hkv = H // G
        bh_r = b * H + h_r
        offs_d = tl.arange(0, D)
        rows = offs_m < T
        k_base = K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h
        v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
        t_rows = bh_r.to(tl.int64) * T + offs_m  # each row in the (B H, T) buffers
        do_rows = b.to(tl.int64) * sdo_b + h_r.to(tl.int64) * sdo_h + offs_m.to(tl.int64) * sdo_t
        s_rows = b.to(tl.int64) * ssv_b + h_r.to(tl.int64) * ssv_h + offs_m.to(tl.int64) * ssv_t
        first = tl.load(FIRST + b)
        shift_r = tl.load(SHIFT + bh_r)
        do = tl.load(DO + do_rows[:, None] + offs_d[None, :], mask=rows[:, None], other=0.0)
        lse2 = tl.load(LSE + t_rows, mask=rows, other=float("-inf"))
        has_win = lse2 > float("-inf")
        lse_safe = tl.where(has_win, lse2, 0.0)
        den = tl.load(DEN + t_rows, mask=rows, other=0.0)
        has_far = ((offs_m - shift_r) >= first) & rows
        r = tl.where(has_far, 1.0 / tl.maximum(den, eps), 0.0)
        lo = tl.maximum(t0 - window + 1, 0)
        lo = (lo // BN) * BN
        hi = tl.minimum(t0 + BQ, T)

        # ---- first pass: LA_t . dO_t, then SWA_t . dO_t
        dot_la = tl.zeros([BM], dtype=tl.float32)
        if HAS_LA:
            if FROM_SAVED:
                dot_la = _saved_dot(LA_O, DO, s_rows, do_rows, rows, D, BM)
            else:
                fq_rows = b.to(tl.int64) * sfq_b + h_r.to(tl.int64) * sfq_h \
                    + offs_m.to(tl.int64) * sfq_t
                num, _ = _la_num(FQ, FK, V, SST, ZST, VST, CNT, KPM, b, hk, Hkv, t0, offs_m,
                                 fq_rows, shift_r, T, NC, eps, sfk_b, sfk_h, sfk_t, sv_b, sv_h,
                                 sv_t, 0, 0, D, F, FC, BM, BQ, BN, CS, HAS_KPM, PREC, SS, False)
                dot_la = tl.sum(num * do.to(tl.float32), axis=1) * r
        dot_swa = tl.zeros([BM], dtype=tl.float32)
        if HAS_SWA and FROM_SAVED:
            dot_swa = _saved_dot(SWA_O, DO, s_rows, do_rows, rows, D, BM)
        q_rows = b.to(tl.int64) * sq_b + h_r.to(tl.int64) * sq_h + offs_m.to(tl.int64) * sq_t
        if HAS_SWA and not FROM_SAVED:
            q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=rows[:, None], other=0.0)
            for start in range(lo, hi, BN):
                offs_n = start + tl.arange(0, BN)
                kin = offs_n < T
                kb = tl.load(k_base + offs_n[:, None] * sk_t + offs_d[None, :], mask=kin[:, None],
                             other=0.0)
                vb = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=kin[:, None],
                             other=0.0)
                s = tl.dot(q, tl.trans(kb), input_precision=PREC) * scale_log2
                ok = (offs_n[None, :] <= offs_m[:, None]) & \
                     (offs_n[None, :] > offs_m[:, None] - window) & kin[None, :]
                if HAS_KPM:
                    real = tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0
                    ok = ok & real[None, :]
                p = tl.where(ok, tl.exp2(s - lse_safe[:, None]), 0.0)
                dpv = tl.dot(do, tl.trans(vb), input_precision=PREC)
                dot_swa += tl.sum(p * dpv, axis=1)

        # ---- the mixer's per-query factors
        if SHARED:
            logs = tl.load(LOGS + bh_r)
            x = logs + lse2 * LN2 - tl.log(tl.maximum(den, eps))
            alpha_t = 1.0 / (1.0 + tl.exp(-x))
            alpha_t = tl.where(has_far, alpha_t, 1.0)
            alpha_t = tl.where(has_win, alpha_t, 0.0)
            live = has_far & has_win
            dx = tl.where(live, (dot_swa - dot_la) * alpha_t * (1.0 - alpha_t), 0.0)
            ws = alpha_t
            delta = alpha_t * dot_swa - dx
            gf = (1.0 - alpha_t) * r
            dden = tl.where(den >= eps, -gf * dot_la - dx * r, 0.0)
            _head_sums(tl.where(rows, dx, 0.0), PA, b, H, pid_m, NMB, pid_g, BM, P)
            _head_sums(tl.zeros([BM], dtype=tl.float32), PB, b, H, pid_m, NMB, pid_g, BM, P)
        else:
            ca = tl.load(CA + bh_r)
            cb = tl.load(CB + bh_r)
            ws = ca
            delta = ca * dot_swa
            gf = cb * r
            dden = tl.where(den >= eps, -gf * dot_la, 0.0)
            _head_sums(tl.where(rows, dot_swa, 0.0), PA, b, H, pid_m, NMB, pid_g, BM, P)
            _head_sums(tl.where(rows, dot_la, 0.0), PB, b, H, pid_m, NMB, pid_g, BM, P)
        tl.store(DELTA + t_rows, delta, mask=rows)
        tl.store(WS + t_rows, ws, mask=rows)
        tl.store(GF + t_rows, gf, mask=rows)
        tl.store(DDEN + t_rows, dden, mask=rows)
        if STORE_DNUM:  # 32 channels at a time (dO re-read from cache), as _saved_dot
            DC: tl.constexpr = 32 if D > 32 else D
            for c in tl.static_range(D // DC):
                offs_c = c * DC + tl.arange(0, DC)
                doc = tl.load(DO + do_rows[:, None] + offs_c[None, :], mask=rows[:, None],
                              other=0.0)
                tl.store(DNUM + t_rows[:, None] * D + offs_c[None, :],
                         (doc.to(tl.float32) * gf[:, None]).to(DNUM.dtype.element_ty),
                         mask=rows[:, None])

        # ---- second pass: dq (not when q takes no gradient: stage 1's teacher q)
        if HAS_SWA and NEED_DQ:
            if FROM_SAVED:  # (loaded only now: the saved branches' tiles are dead by here)
                q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=rows[:, None],
                            other=0.0)
            dq = tl.zeros([BM, D], dtype=tl.float32)
            for start in range(lo, hi, BN):
                offs_n = start + tl.arange(0, BN)
                kin = offs_n < T
                kb = tl.load(k_base + offs_n[:, None] * sk_t + offs_d[None, :], mask=kin[:, None],
                             other=0.0)
                vb = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=kin[:, None],
                             other=0.0)
                s = tl.dot(q, tl.trans(kb), input_precision=PREC) * scale_log2
                ok = (offs_n[None, :] <= offs_m[:, None]) & \
                     (offs_n[None, :] > offs_m[:, None] - window) & kin[None, :]
                if HAS_KPM:
                    real = tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0
                    ok = ok & real[None, :]
                p = tl.where(ok, tl.exp2(s - lse_safe[:, None]), 0.0)
                dpv = tl.dot(do, tl.trans(vb), input_precision=PREC)
                ds = p * (ws[:, None] * dpv - delta[:, None])
                dq += tl.dot(ds.to(kb.dtype), kb, input_precision=PREC)
            dq_rows = b.to(tl.int64) * sdq_b + h_r.to(tl.int64) * sdq_h \
                + offs_m.to(tl.int64) * sdq_t
            tl.store(DQ + dq_rows[:, None] + offs_d[None, :],
                     (dq * scale).to(DQ.dtype.element_ty), mask=rows[:, None])
        return do, gf, dden

    @triton.jit
    def _bwd_dq(Q, K, V, FQ, FK, DO, SST, ZST, VST, CNT, LSE, DEN, CA, CB, LOGS, SHIFT, FIRST,
                KPM, SWA_O, LA_O,
                DQ, DELTA, WS, GF, DDEN, PA, PB, DNUM,
                sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sdo_b, sdo_h, sdo_t,
                sdq_b, sdq_h, sdq_t, ssv_b, ssv_h, ssv_t,
                T, H, G, NC, NMB, window, scale, scale_log2, eps,
                D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, CS: tl.constexpr, P: tl.constexpr, HAS_SWA: tl.constexpr,
                HAS_LA: tl.constexpr, SHARED: tl.constexpr, HAS_KPM: tl.constexpr,
                PREC: tl.constexpr, NEED_DQ: tl.constexpr, FROM_SAVED: tl.constexpr,
                STORE_DNUM: tl.constexpr, SS: tl.constexpr):
        """``_dq_part`` of one query block (its docstring)."""
        _dq_part(Q, K, V, FQ, FK, DO, SST, ZST, VST, CNT, LSE, DEN, CA, CB, LOGS, SHIFT, FIRST,
                 KPM, SWA_O, LA_O, DQ, DELTA, WS, GF, DDEN, PA, PB, DNUM, sq_b, sq_h, sq_t, sk_b,
                 sk_h, sk_t, sv_b, sv_h, sv_t, sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sdo_b,
                 sdo_h, sdo_t, sdq_b, sdq_h, sdq_t, ssv_b, ssv_h, ssv_t, T, H, G, NC, NMB, window,
                 scale, scale_log2, eps, D, F, FC, BM, BN, CS, P, HAS_SWA, HAS_LA, SHARED,
                 HAS_KPM, PREC, NEED_DQ,
                 FROM_SAVED, STORE_DNUM, SS, tl.program_id(0), tl.program_id(1))

    @triton.jit
    def _dfq_part(FK, V, DO, SST, ZST, GF, DDEN, SHIFT, KPM, DFQ, FQ, DU,
                  sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                  sfq_b, sfq_h, sfq_t, sdu_b, sdu_h, sdu_t,
                  T, H, G, NC, do, gf, dden, pid_m, pid_g, pid_f,
                  D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, CS: tl.constexpr, P: tl.constexpr, HAS_KPM: tl.constexpr,
                  PREC: tl.constexpr, MAP_DU: tl.constexpr, SOFTMAX: tl.constexpr,
                  LOAD_ROWS: tl.constexpr):
        """dfq[:, c FC : (c + 1) FC] of one query block (program axis 2 is c; rows: BM / P
        positions of P query heads of one kv head, ``_packed_rows``):
        dfq_t = S^T dnum_t + dden_t z + sum_{intra i} (dnum_t . v_i + dden_t) fk_i,
        dnum_t = GF_t dO_t; in two halves of FC / 2 features (the Hedgehog map's two halves
        when FC = F).

        MAP_DU (FC = F; fq = phi(x) of a Hedgehog map, ``triton_phi``): instead of dfq, the
        map's du = a1 (dfq1 - <dfq1, a1>) - a2 (dfq2 - <dfq2, a2>) (SOFTMAX; exp:
        dfq1 a1 - dfq2 a2), a1 / a2 = fq's halves as stored, dfq in fp32 (never rounded):
        written to DU ((B, H, T, F/2) strides sdu_*), dfq not written. The map's backward
        then only multiplies du by its weight (``triton_phi._phi_bwd``'s DU_GIVEN).

        LOAD_ROWS: the block rows' dO (BM, D), GF and DDEN (BM) read here from DO, GF, DDEN
        (``_bwd_dfq``: where the kernel read them before it was split into parts, so that it
        compiles as it did); else ``do``, ``gf``, ``dden`` as ``_bwd_q``'s dq part holds
        them."""
        BQ: tl.constexpr = BM // P
        FC2: tl.constexpr = FC // 2
        b, hk, t0, h_r, offs_m = _packed_rows(pid_m, pid_g, H, G, BM, P)
        Hkv = H // G
        bh_r = b * H + h_r
        offs_d = tl.arange(0, D)
        offs_f = pid_f * FC + tl.arange(0, FC2)  # the first half; the second at + FC2
        rows = offs_m < T
        t_rows = bh_r.to(tl.int64) * T + offs_m
        shift_r = tl.load(SHIFT + bh_r)
        if LOAD_ROWS:
            do_rows = b.to(tl.int64) * sdo_b + h_r.to(tl.int64) * sdo_h \
                + offs_m.to(tl.int64) * sdo_t
            do = tl.load(DO + do_rows[:, None] + offs_d[None, :], mask=rows[:, None], other=0.0)
            gf = tl.load(GF + t_rows, mask=rows, other=0.0)
            dden = tl.load(DDEN + t_rows, mask=rows, other=0.0)
        jst = tl.minimum(tl.maximum(t0 - tl.max(shift_r, axis=0) + 1, 0) // CS, NC - 1)
        st = SST + (b * Hkv + hk).to(tl.int64) * NC * F * D + jst.to(tl.int64) * F * D
        z_base = ZST + (b * Hkv + hk).to(tl.int64) * NC * F + jst * F
        z1 = tl.load(z_base + offs_f)
        z2 = tl.load(z_base + FC2 + offs_f)
        S1 = tl.load(st + offs_f[None, :] * D + offs_d[:, None])  # (D, FC / 2)
        S2 = tl.load(st + (FC2 + offs_f)[None, :] * D + offs_d[:, None])
        # gf applied in fp32 to the products' rows (rounding gf * dO first cost accuracy)
        dfq1 = tl.dot(do, S1, input_precision=PREC) * gf[:, None] + dden[:, None] * z1[None, :]
        dfq2 = tl.dot(do, S2, input_precision=PREC) * gf[:, None] + dden[:, None] * z2[None, :]
        fk_base = FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
        v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
        hi = tl.minimum(t0 + BQ - tl.min(shift_r, axis=0), T)
        for start in range(jst * CS, hi, BN):
            offs_n = start + tl.arange(0, BN)
            kin = offs_n < T
            fk_rows = fk_base + offs_n[:, None] * sfk_t
            fk1 = tl.load(fk_rows + offs_f[None, :], mask=kin[:, None], other=0.0)
            fk2 = tl.load(fk_rows + (FC2 + offs_f)[None, :], mask=kin[:, None], other=0.0)
            vb = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=kin[:, None],
                         other=0.0)
            ok = (offs_n[None, :] <= offs_m[:, None] - shift_r[:, None]) & kin[None, :]
            if HAS_KPM:
                real = tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0
                ok = ok & real[None, :]
            da = tl.dot(do, tl.trans(vb), input_precision=PREC) * gf[:, None] + dden[:, None]
            da = tl.where(ok, da, 0.0).to(fk1.dtype)
            dfq1 += tl.dot(da, fk1, input_precision=PREC)
            dfq2 += tl.dot(da, fk2, input_precision=PREC)
        if MAP_DU:
            fq_rows = b.to(tl.int64) * sfq_b + h_r.to(tl.int64) * sfq_h \
                + offs_m.to(tl.int64) * sfq_t
            a1 = tl.load(FQ + fq_rows[:, None] + offs_f[None, :], mask=rows[:, None],
                         other=0.0).to(tl.float32)
            if SOFTMAX:
                du = a1 * (dfq1 - tl.sum(dfq1 * a1, axis=1)[:, None])
            else:
                du = dfq1 * a1
            a2 = tl.load(FQ + fq_rows[:, None] + (FC2 + offs_f)[None, :], mask=rows[:, None],
                         other=0.0).to(tl.float32)
            if SOFTMAX:
                du -= a2 * (dfq2 - tl.sum(dfq2 * a2, axis=1)[:, None])
            else:
                du -= dfq2 * a2
            du_rows = b.to(tl.int64) * sdu_b + h_r.to(tl.int64) * sdu_h \
                + offs_m.to(tl.int64) * sdu_t
            tl.store(DU + du_rows[:, None] + offs_f[None, :], du.to(DU.dtype.element_ty),
                     mask=rows[:, None])
        else:
            dfq_rows = DFQ + t_rows[:, None] * F
            tl.store(dfq_rows + offs_f[None, :], dfq1.to(DFQ.dtype.element_ty),
                     mask=rows[:, None])
            tl.store(dfq_rows + (FC2 + offs_f)[None, :], dfq2.to(DFQ.dtype.element_ty),
                     mask=rows[:, None])

    @triton.jit
    def _bwd_dfq(FK, V, DO, SST, ZST, GF, DDEN, SHIFT, KPM, DFQ, FQ, DU,
                 sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                 sfq_b, sfq_h, sfq_t, sdu_b, sdu_h, sdu_t,
                 T, H, G, NC,
                 D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, CS: tl.constexpr, P: tl.constexpr, HAS_KPM: tl.constexpr,
                 PREC: tl.constexpr, MAP_DU: tl.constexpr = False,
                 SOFTMAX: tl.constexpr = True):
        """``_dfq_part`` of one query block and feature slice (program axis 2), its rows' dO,
        GF and DDEN read from memory (the dq pass wrote GF and DDEN)."""
        _dfq_part(FK, V, DO, SST, ZST, GF, DDEN, SHIFT, KPM, DFQ, FQ, DU, sfk_b, sfk_h, sfk_t,
                  sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t, sfq_b, sfq_h, sfq_t, sdu_b, sdu_h,
                  sdu_t, T, H, G, NC, 0.0, 0.0, 0.0, tl.program_id(0), tl.program_id(1),
                  tl.program_id(2), D, F, FC, BM, BN, CS, P, HAS_KPM, PREC, MAP_DU, SOFTMAX,
                  True)

    @triton.jit
    def _bwd_q(Q, K, V, FQ, FK, DO, SST, ZST, VST, CNT, LSE, DEN, CA, CB, LOGS, SHIFT, FIRST,
               KPM, SWA_O, LA_O,
               DQ, DELTA, WS, GF, DDEN, PA, PB, DNUM, DFQ, DU,
               sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
               sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sdo_b, sdo_h, sdo_t,
               sdq_b, sdq_h, sdq_t, ssv_b, ssv_h, ssv_t, sdu_b, sdu_h, sdu_t,
               T, H, G, NC, NMB, window, scale, scale_log2, eps,
               D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, CS: tl.constexpr, P: tl.constexpr, HAS_SWA: tl.constexpr,
               HAS_LA: tl.constexpr, SHARED: tl.constexpr, HAS_KPM: tl.constexpr,
               PREC: tl.constexpr, NEED_DQ: tl.constexpr, FROM_SAVED: tl.constexpr,
               STORE_DNUM: tl.constexpr, SS: tl.constexpr, MAP_DU: tl.constexpr,
               SOFTMAX: tl.constexpr):
        """The query side of the backward in one program per query block
        (``KernelConfig.fuse_q_side``): ``_dq_part`` (dq, the per-query factors, dnum), then
        ``_dfq_part`` over all F features (dfq, or the map's du) from the dO, GF and DDEN the
        first part holds: one launch and one read of dO fewer than ``_bwd_dq`` then
        ``_bwd_dfq``, the same arithmetic in the same order (bit for bit the same results).
        HAS_LA only (without LA there is no dfq)."""
        pid_m = tl.program_id(0)
        pid_g = tl.program_id(1)
        do, gf, dden = _dq_part(
            Q, K, V, FQ, FK, DO, SST, ZST, VST, CNT, LSE, DEN, CA, CB, LOGS, SHIFT, FIRST, KPM,
            SWA_O, LA_O, DQ, DELTA, WS, GF, DDEN, PA, PB, DNUM, sq_b, sq_h, sq_t, sk_b, sk_h,
            sk_t, sv_b, sv_h, sv_t, sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sdo_b, sdo_h,
            sdo_t, sdq_b, sdq_h, sdq_t, ssv_b, ssv_h, ssv_t, T, H, G, NC, NMB, window, scale,
            scale_log2, eps, D, F, FC, BM, BN, CS, P, HAS_SWA, HAS_LA, SHARED, HAS_KPM, PREC,
            NEED_DQ, FROM_SAVED,
            STORE_DNUM, SS, pid_m, pid_g)
        _dfq_part(FK, V, DO, SST, ZST, GF, DDEN, SHIFT, KPM, DFQ, FQ, DU, sfk_b, sfk_h, sfk_t,
                  sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t, sfq_b, sfq_h, sfq_t, sdu_b, sdu_h,
                  sdu_t, T, H, G, NC, do, gf, dden, pid_m, pid_g, 0, D, F, F, BM, BN, CS, P,
                  HAS_KPM, PREC, MAP_DU, SOFTMAX, False)

    @triton.jit
    def _state_rev(FQ, DNUM, DDEN, SHIFT, RST, UST, WST,
                   sfq_b, sfq_h, sfq_t,
                   T, H, G, NC,
                   F: tl.constexpr, D: tl.constexpr, CS: tl.constexpr, BF: tl.constexpr,
                   BD: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
                   RS: tl.constexpr = 0, SM: tl.constexpr = 0):
        """Reverse states, summed over the G query heads of a kv head: entry j holds
        R = sum_{t - shift_h >= (j+1) CS} fq_t dnum_t^T (F x D), u = sum DDEN_t fq_t and
        w = sum dnum_t (the kernel floor's share of dv); dnum_t = GF_t dO_t as ``_bwd_dq``
        stored it ((B, H, T, D)). fq and dnum read through ``_tile``. RS 0: a loop over the
        chunks and in it one over the heads (neither pipelined: ptxas shows the same shared
        memory at any stage count); RS > 0: one loop over the (chunk, head) pairs, which the
        compiler pipelines over RS stages (``KernelConfig.state_rev_stages``): the same sums in
        the same order. SM (``KernelConfig.state_sums_mma``; RS 0, 16-bit fq and dnum): u and
        w as products on the tensor cores instead of sums across the tile's rows
        (``_rev_add_mma``)."""
        pid_bh = tl.program_id(0)  # b * Hkv + hk
        pid_f = tl.program_id(1)
        pid_d = tl.program_id(2)
        Hkv = H // G
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        B = tl.num_programs(0) // Hkv
        offs_f = pid_f * BF + tl.arange(0, BF)
        offs_d = pid_d * BD + tl.arange(0, BD)
        offs_c = tl.arange(0, CS)
        fq_src = _tiles_of(FQ, sfq_b, sfq_h, sfq_t, B, H, T, F, CS, BF, TMA)
        dn_src = _tiles_of(DNUM, H * T * D, T * D, D, B, H, T, D, CS, BD, TMA)
        st_base = RST + pid_bh.to(tl.int64) * NC * F * D
        u_base = UST + pid_bh.to(tl.int64) * NC * F
        w_base = WST + pid_bh.to(tl.int64) * NC * D
        R = tl.zeros([BF, BD], dtype=tl.float32)
        u = tl.zeros([BF], dtype=tl.float32)
        w = tl.zeros([BD], dtype=tl.float32)
        if SM:
            c16 = tl.arange(0, 16)
            u16 = tl.zeros([BF, 16], dtype=tl.float32)
            w16 = tl.zeros([BD, 16], dtype=tl.float32)
            for jj in range(0, NC):
                j = NC - 1 - jj
                u = _first_cols(u16, c16, 2)
                w = _first_cols(w16, c16, 1)
                _store_state(st_base, u_base, w_base, j, R, u, w, offs_f, offs_d, pid_f, pid_d,
                             F, D)
                for g in range(0, G):
                    R, u16, w16 = _rev_add_mma(fq_src, dn_src, DDEN, SHIFT, R, u16, w16, b,
                                               hk * G + g, j, pid_f, pid_d, offs_c, sfq_b,
                                               sfq_h, sfq_t, T, H, F, D, CS, BF, BD, PREC, TMA)
        elif RS == 0:
            for jj in range(0, NC):
                j = NC - 1 - jj
                _store_state(st_base, u_base, w_base, j, R, u, w, offs_f, offs_d, pid_f, pid_d,
                           F, D)
                for g in range(0, G):
                    R, u, w = _rev_add(fq_src, dn_src, DDEN, SHIFT, R, u, w, b, hk * G + g, j,
                                       pid_f, pid_d, offs_c, sfq_b, sfq_h, sfq_t, T, H,
                                       F, D, CS, BF, BD, PREC, TMA)
        else:
            for it in tl.range(0, NC * G, num_stages=RS):
                j = NC - 1 - it // G
                g = it % G
                if g == 0:
                    _store_state(st_base, u_base, w_base, j, R, u, w, offs_f, offs_d, pid_f,
                               pid_d, F, D)
                R, u, w = _rev_add(fq_src, dn_src, DDEN, SHIFT, R, u, w, b, hk * G + g, j,
                                   pid_f, pid_d, offs_c, sfq_b, sfq_h, sfq_t, T, H,
                                   F, D, CS, BF, BD, PREC, TMA)

    @triton.jit
    def _sums_mma(x, c16, CS: tl.constexpr, PREC: tl.constexpr):
        """The sums over the CS rows of x (CS, N) as a product on the tensor cores: column 0
        of the returned (N, 16) fp32 (x^T [1, 0 ..]; the products exact, summed in fp32)."""
        ones = tl.where(c16[None, :] == 0, 1.0, 0.0) + tl.zeros([CS, 16], tl.float32)
        return tl.dot(tl.trans(x), ones.to(x.dtype), input_precision=PREC)

    @triton.jit
    def _wsums_mma(x, wt, c16, PREC: tl.constexpr):
        """sum_t wt_t x_t over the rows of x (CS, N), wt (CS,) fp32, on the tensor cores: the
        sum of columns 0 and 1 of the returned (N, 16) fp32, x^T [hi, lo, 0 ..] where wt =
        hi + lo, each rounded to x's 16-bit type (wt exact to ~2^-16 of itself; the products
        and sums in fp32)."""
        hi = wt.to(x.dtype).to(tl.float32)
        lo = (wt - hi).to(x.dtype).to(tl.float32)
        cols = tl.where(c16[None, :] == 0, hi[:, None],
                        tl.where(c16[None, :] == 1, lo[:, None], 0.0))
        return tl.dot(tl.trans(x), cols.to(x.dtype), input_precision=PREC)

    @triton.jit
    def _first_cols(acc16, c16, N: tl.constexpr):
        """The sum of the first N columns of an (R, 16) tile (``_sums_mma``: 1,
        ``_wsums_mma``: 2)."""
        return tl.sum(tl.where(c16[None, :] < N, acc16, 0.0), axis=1)

    @triton.jit
    def _rev_add_mma(fq_src, dn_src, DDEN, SHIFT, R, u16, w16, b, h, j, pid_f, pid_d, offs_c,
                     sfq_b, sfq_h, sfq_t, T, H, F: tl.constexpr, D: tl.constexpr,
                     CS: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                     TMA: tl.constexpr):
        """``_rev_add`` with u and w on the tensor cores: u16 (BF, 16) (``_wsums_mma``: u the
        sum of its first two columns) and w16 (BD, 16) (``_sums_mma``: w its first)."""
        bh = b * H + h
        t0 = j * CS + tl.load(SHIFT + bh)
        fq = _tile(fq_src, b, h, t0, pid_f * BF, sfq_b, sfq_h, sfq_t, T, CS, BF, TMA)
        dn = _tile(dn_src, b, h, t0, pid_d * BD, H * T * D, T * D, D, T, CS, BD, TMA)
        R += tl.dot(tl.trans(fq), dn, input_precision=PREC)
        c16 = tl.arange(0, 16)
        if pid_d == 0:
            offs_t = t0 + offs_c
            dd = tl.load(DDEN + bh.to(tl.int64) * T + offs_t, mask=offs_t < T, other=0.0)
            u16 += _wsums_mma(fq, dd, c16, PREC)
        if pid_f == 0:
            w16 += _sums_mma(dn, c16, CS, PREC)
        return R, u16, w16

    @triton.jit
    def _store_state(st_base, u_base, w_base, j, R, u, w, offs_f, offs_d, pid_f, pid_d,
                     F: tl.constexpr, D: tl.constexpr):
        """Entry j of a walked state kernel (``_state_fwd``: S, z, the value sum over the chunks
        before j; ``_state_rev``: R, u, w over those after it): the (F, D) tile, the F-vector
        from the programs of the first D tile, the D-vector from those of the first F tile."""
        tl.store(st_base + j * F * D + offs_f[:, None] * D + offs_d[None, :],
                 R.to(st_base.dtype.element_ty))
        if pid_d == 0:
            tl.store(u_base + j * F + offs_f, u)
        if pid_f == 0:
            tl.store(w_base + j * D + offs_d, w)

    @triton.jit
    def _rev_add(fq_src, dn_src, DDEN, SHIFT, R, u, w, b, h, j, pid_f, pid_d, offs_c,
                 sfq_b, sfq_h, sfq_t, T, H, F: tl.constexpr, D: tl.constexpr,
                 CS: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                 TMA: tl.constexpr):
        """``_state_rev``'s sums plus chunk j of query head h."""
        bh = b * H + h
        t0 = j * CS + tl.load(SHIFT + bh)
        fq = _tile(fq_src, b, h, t0, pid_f * BF, sfq_b, sfq_h, sfq_t, T, CS, BF, TMA)
        dn = _tile(dn_src, b, h, t0, pid_d * BD, H * T * D, T * D, D, T, CS, BD, TMA)
        R += tl.dot(tl.trans(fq), dn, input_precision=PREC)
        if pid_d == 0:
            offs_t = t0 + offs_c
            dd = tl.load(DDEN + bh.to(tl.int64) * T + offs_t, mask=offs_t < T, other=0.0)
            u += tl.sum(fq.to(tl.float32) * dd[:, None], axis=0)
        if pid_f == 0:
            w += tl.sum(dn.to(tl.float32), axis=0)
        return R, u, w

    @triton.jit
    def _la_key_head(FQ, DO, SHIFT, b, h, H, T, jb, sfq_b, sfq_h, sdo_b, sdo_h,
                     CS: tl.constexpr):
        """Query head h of sequence b in a key block's LA gradients: (its rows' offset in the
        per-query vectors, its shift, its fq and dO bases, q_hi: its queries from the
        block's first reverse state ``jb`` on are in that state)."""
        row_base = (b * H + h).to(tl.int64) * T
        shift = tl.load(SHIFT + b * H + h)
        fq_base = FQ + b.to(tl.int64) * sfq_b + h.to(tl.int64) * sfq_h
        do_base = DO + b.to(tl.int64) * sdo_b + h.to(tl.int64) * sdo_h
        q_hi = tl.minimum(jb * CS + shift, T)
        return row_base, shift, fq_base, do_base, q_hi

    @triton.jit
    def _la_key_tile(fq_base, do_base, GF, DDEN, row_base, start, shift, q_hi, offs_n, kreal,
                     offs_f, offs_d, sfq_t, sdo_t, T, BM: tl.constexpr):
        """One query tile (start .. start + BM - 1, one head) of a key block's LA gradients:
        (fq's columns ``offs_f``, dO, GF and DDEN of its rows, the (key, query) pairs that
        count: the query at least ``shift`` past the key and before q_hi - the reverse state
        holds the later ones, so a query tile taller than the key tile must not count them
        twice - and both real)."""
        offs_m = start + tl.arange(0, BM)
        qin = offs_m < T
        fqb = tl.load(fq_base + offs_m[:, None] * sfq_t + offs_f[None, :], mask=qin[:, None],
                      other=0.0)
        dob = tl.load(do_base + offs_m[:, None] * sdo_t + offs_d[None, :], mask=qin[:, None],
                      other=0.0)
        gf = tl.load(GF + row_base + offs_m, mask=qin, other=0.0)
        dd = tl.load(DDEN + row_base + offs_m, mask=qin, other=0.0)
        ok = (offs_m[None, :] - shift >= offs_n[:, None]) & qin[None, :] & \
            (offs_m[None, :] < q_hi) & kreal[:, None]
        return fqb, dob, gf, dd, ok

    @triton.jit
    def _dkv_swa_part(Q, K, V, DO, LSE, DELTA, WS, KPM, DK,
                      sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                      sdk_b, sdk_h, sdk_t,
                      T, H, G, window, scale, scale_log2, pid_n, pid_bh,
                      D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      HAS_KPM: tl.constexpr, PREC: tl.constexpr):
        """dk (stored) and the window's part of dv (returned, fp32, zero on padded keys) for
        key block ``pid_n`` of kv head ``pid_bh`` = b Hkv + hk (summed over its G query
        heads)."""
        Hkv = H // G
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        i0, offs_n, kin, kreal = key_block(KPM, b, T, pid_n, BN, HAS_KPM)
        offs_d = tl.arange(0, D)
        kb = tl.load(K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h + offs_n[:, None] * sk_t
                     + offs_d[None, :], mask=kin[:, None], other=0.0)
        vb = tl.load(V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h + offs_n[:, None] * sv_t
                     + offs_d[None, :], mask=kin[:, None], other=0.0)
        dk = tl.zeros([BN, D], dtype=tl.float32)
        dv = tl.zeros([BN, D], dtype=tl.float32)
        q_hi = tl.minimum(i0 + BN - 1 + window, T)
        for g in range(0, G):
            h = hk * G + g
            row_base = (b * H + h).to(tl.int64) * T
            q_base = Q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
            do_base = DO + b.to(tl.int64) * sdo_b + h.to(tl.int64) * sdo_h
            for start in range(i0, q_hi, BM):
                offs_m = start + tl.arange(0, BM)
                qin = offs_m < T
                qb = tl.load(q_base + offs_m[:, None] * sq_t + offs_d[None, :], mask=qin[:, None],
                             other=0.0)
                dob = tl.load(do_base + offs_m[:, None] * sdo_t + offs_d[None, :],
                              mask=qin[:, None], other=0.0)
                lse2 = tl.load(LSE + row_base + offs_m, mask=qin, other=float("-inf"))
                lse_safe = tl.where(lse2 > float("-inf"), lse2, 0.0)
                delta = tl.load(DELTA + row_base + offs_m, mask=qin, other=0.0)
                ws = tl.load(WS + row_base + offs_m, mask=qin, other=0.0)
                sT = tl.dot(kb, tl.trans(qb), input_precision=PREC) * scale_log2  # (BN, BM)
                ok = (offs_m[None, :] >= offs_n[:, None]) & \
                     (offs_m[None, :] - window < offs_n[:, None]) & qin[None, :] & \
                     kreal[:, None]
                pT = tl.where(ok, tl.exp2(sT - lse_safe[None, :]), 0.0)
                # dSWA_t = ws_t dO_t: the weight is applied in fp32 around the products
                # (rounding ws * dO to bf16 first cost ~1e-2 in dk)
                dv += tl.dot((pT * ws[None, :]).to(qb.dtype), dob, input_precision=PREC)
                dpT = tl.dot(vb, tl.trans(dob), input_precision=PREC) * ws[None, :]
                dsT = pT * (dpT - delta[None, :])
                dk += tl.dot(dsT.to(qb.dtype), qb, input_precision=PREC)
        tl.store(DK + b.to(tl.int64) * sdk_b + hk.to(tl.int64) * sdk_h + offs_n[:, None] * sdk_t
                 + offs_d[None, :],
                 tl.where(kreal[:, None], dk * scale, 0.0).to(DK.dtype.element_ty),
                 mask=kin[:, None])
        return tl.where(kreal[:, None], dv, 0.0)

    @triton.jit
    def _bwd_dkv_swa(Q, K, V, DO, LSE, DELTA, WS, KPM, DK, DV,
                     sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                     sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t,
                     T, H, G, window, scale, scale_log2,
                     D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     HAS_KPM: tl.constexpr, PREC: tl.constexpr):
        """dk and the window's part of dv for one key block of one kv head (summed over its G
        query heads; ``_dkv_swa_part``). DV is the final dv (no LA) or an fp32 buffer the LA
        kernel adds to."""
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)  # b * Hkv + hk
        dv = _dkv_swa_part(Q, K, V, DO, LSE, DELTA, WS, KPM, DK, sq_b, sq_h, sq_t, sk_b, sk_h,
                           sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t, sdk_b, sdk_h, sdk_t, T,
                           H, G, window, scale, scale_log2, pid_n, pid_bh, D, BM, BN, HAS_KPM,
                           PREC)
        Hkv = H // G
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        tl.store(DV + b.to(tl.int64) * sdv_b + hk.to(tl.int64) * sdv_h + offs_n[:, None] * sdv_t
                 + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=(offs_n < T)[:, None])

    @triton.jit
    def _dkv_la_part(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DVS, DV, DFK,
                     sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t,
                     sdo_b, sdo_h, sdo_t, sdv_b, sdv_h, sdv_t,
                     T, H, G, NC, eps, pid_n, pid_bh, pid_f, dv_swa,
                     D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, CS: tl.constexpr, ADD_DVS: tl.constexpr,
                     HAS_KPM: tl.constexpr, PREC: tl.constexpr, PART: tl.constexpr,
                     ADD_SWA: tl.constexpr):
        """Linear attention's part of the key-side gradients for one key block of one kv head
        (summed over its G query heads): programs with axis-2 index c < F / FC write
        dfk[:, c FC : (c + 1) FC]; the one with c = F / FC writes dv (plus the window's part,
        DVS, when ADD_DVS). Keys see the reverse state past the block and the queries between
        the block and that state. PART 0: both kinds of program in one grid; 1: the dfk
        programs only, 2: the dv program only (where ``KernelConfig.dv_block_n`` differs from
        ``dkv_block_n``: two launches, each kernel compiled for its own part and tile).
        ADD_SWA: the dv program adds ``dv_swa`` (the window's part of dv, fp32, which
        ``_bwd_kv``'s dv programs computed first) where ADD_DVS would read it from DVS."""
        Hkv = H // G
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        i0, offs_n, kin, kreal = key_block(KPM, b, T, pid_n, BN, HAS_KPM)
        offs_d = tl.arange(0, D)
        fk_base = FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
        vb = tl.load(V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h + offs_n[:, None] * sv_t
                     + offs_d[None, :], mask=kin[:, None], other=0.0)
        jb = tl.minimum(tl.cdiv(i0 + BN - 1, CS), NC)  # first reverse state past the block
        st = RST + pid_bh.to(tl.int64) * NC * F * D + (jb - 1).to(tl.int64) * F * D
        out_base = pid_bh.to(tl.int64) * T
        if PART == 0:
            dfk_program = pid_f * FC < F
        else:
            dfk_program = PART == 1
        if dfk_program:  # ---- dfk, one FC-wide slice
            offs_f = pid_f * FC + tl.arange(0, FC)
            Rt = tl.load(st + offs_f[None, :] * D + offs_d[:, None])  # (D, FC)
            u = tl.load(UST + pid_bh.to(tl.int64) * NC * F + (jb - 1) * F + offs_f)
            dfk = tl.dot(vb, Rt, input_precision=PREC) + u[None, :]
            for g in range(0, G):
                row_base, shift, fq_base, do_base, q_hi = _la_key_head(
                    FQ, DO, SHIFT, b, hk * G + g, H, T, jb, sfq_b, sfq_h, sdo_b, sdo_h, CS)
                for start in range(i0 + shift, q_hi, BM):
                    fqb, dob, gf, dd, ok = _la_key_tile(
                        fq_base, do_base, GF, DDEN, row_base, start, shift, q_hi, offs_n,
                        kreal, offs_f, offs_d, sfq_t, sdo_t, T, BM)
                    daT = tl.dot(vb, tl.trans(dob), input_precision=PREC) * gf[None, :] + \
                        dd[None, :]
                    daT = tl.where(ok, daT, 0.0)
                    dfk += tl.dot(daT.to(fqb.dtype), fqb, input_precision=PREC)
            tl.store(DFK + (out_base + offs_n[:, None]) * F + offs_f[None, :],
                     tl.where(kreal[:, None], dfk, 0.0).to(DFK.dtype.element_ty),
                     mask=kin[:, None])
        else:  # ---- dv (the floor: eps times every later dnum_t, from the state and below)
            w = tl.load(WST + pid_bh.to(tl.int64) * NC * D + (jb - 1) * D + offs_d)
            dv = tl.zeros([BN, D], dtype=tl.float32) + eps * w[None, :]
            for c in tl.static_range(F // FC):
                offs_f = c * FC + tl.arange(0, FC)
                fkb = tl.load(fk_base + offs_n[:, None] * sfk_t + offs_f[None, :],
                              mask=kin[:, None], other=0.0)
                R = tl.load(st + offs_f[:, None] * D + offs_d[None, :])  # (FC, D)
                dv += tl.dot(fkb, R, input_precision=PREC)
            for g in range(0, G):
                row_base, shift, fq_base, do_base, q_hi = _la_key_head(
                    FQ, DO, SHIFT, b, hk * G + g, H, T, jb, sfq_b, sfq_h, sdo_b, sdo_h, CS)
                for start in range(i0 + shift, q_hi, BM):
                    offs_m = start + tl.arange(0, BM)
                    qin = offs_m < T
                    aT = tl.zeros([BN, BM], dtype=tl.float32)
                    for c in tl.static_range(F // FC):
                        offs_f = c * FC + tl.arange(0, FC)
                        fkb = tl.load(fk_base + offs_n[:, None] * sfk_t + offs_f[None, :],
                                      mask=kin[:, None], other=0.0)
                        fqb = tl.load(fq_base + offs_m[:, None] * sfq_t + offs_f[None, :],
                                      mask=qin[:, None], other=0.0)
                        aT += tl.dot(fkb, tl.trans(fqb), input_precision=PREC)
                    dob = tl.load(do_base + offs_m[:, None] * sdo_t + offs_d[None, :],
                                  mask=qin[:, None], other=0.0)
                    gf = tl.load(GF + row_base + offs_m, mask=qin, other=0.0)
                    ok = (offs_m[None, :] - shift >= offs_n[:, None]) & qin[None, :] & \
                        (offs_m[None, :] < q_hi) & kreal[:, None]  # (q_hi: as for dfk)
                    # dnum_t = gf_t dO_t, the factor applied in fp32 (as for SWA)
                    aT = tl.where(ok, (aT + eps) * gf[None, :], 0.0)
                    dv += tl.dot(aT.to(dob.dtype), dob, input_precision=PREC)
            dv_rows = b.to(tl.int64) * sdv_b + hk.to(tl.int64) * sdv_h + offs_n[:, None] * sdv_t
            if ADD_DVS:  # (DVS laid out as DV)
                dv += tl.load(DVS + dv_rows + offs_d[None, :], mask=kin[:, None], other=0.0)
            if ADD_SWA:  # (the same values as DVS would hold)
                dv += dv_swa
            tl.store(DV + dv_rows + offs_d[None, :],
                     tl.where(kreal[:, None], dv, 0.0).to(DV.dtype.element_ty),
                     mask=kin[:, None])

    @triton.jit
    def _dkv_la_both(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DV, DFK,
                     sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t,
                     sdo_b, sdo_h, sdo_t, sdv_b, sdv_h, sdv_t,
                     T, H, G, NC, eps, pid_n, pid_bh, dv_swa,
                     D: tl.constexpr, F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     CS: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr):
        """``_dkv_la_part``'s dfk program (over all F features) and its dv program in one
        (``KernelConfig.kv_order`` 2): each LA query tile's fq and dO are loaded once for both
        products, dfk += (v dO^T gf + dden) fq and dv += ((fk fq^T + eps) gf) dO. dv starts
        from ``dv_swa`` (the window's share, which the dv program adds last: another order of
        the same sums, and 32 registers fewer held through the loop)."""
        Hkv = H // G
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        i0, offs_n, kin, kreal = key_block(KPM, b, T, pid_n, BN, HAS_KPM)
        offs_d = tl.arange(0, D)
        offs_f = tl.arange(0, F)
        vb = tl.load(V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h + offs_n[:, None] * sv_t
                     + offs_d[None, :], mask=kin[:, None], other=0.0)
        fkb = tl.load(FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
                      + offs_n[:, None] * sfk_t + offs_f[None, :], mask=kin[:, None], other=0.0)
        jb = tl.minimum(tl.cdiv(i0 + BN - 1, CS), NC)  # first reverse state past the block
        st = RST + pid_bh.to(tl.int64) * NC * F * D + (jb - 1).to(tl.int64) * F * D
        R = tl.load(st + offs_f[:, None] * D + offs_d[None, :])  # (F, D)
        u = tl.load(UST + pid_bh.to(tl.int64) * NC * F + (jb - 1) * F + offs_f)
        dfk = tl.dot(vb, tl.trans(R), input_precision=PREC) + u[None, :]
        w = tl.load(WST + pid_bh.to(tl.int64) * NC * D + (jb - 1) * D + offs_d)
        dv = dv_swa + eps * w[None, :]
        dv += tl.dot(fkb, R, input_precision=PREC)
        for g in range(0, G):
            row_base, shift, fq_base, do_base, q_hi = _la_key_head(
                FQ, DO, SHIFT, b, hk * G + g, H, T, jb, sfq_b, sfq_h, sdo_b, sdo_h, CS)
            for start in range(i0 + shift, q_hi, BM):
                fqb, dob, gf, dd, ok = _la_key_tile(
                    fq_base, do_base, GF, DDEN, row_base, start, shift, q_hi, offs_n, kreal,
                    offs_f, offs_d, sfq_t, sdo_t, T, BM)
                daT = tl.dot(vb, tl.trans(dob), input_precision=PREC) * gf[None, :] + \
                    dd[None, :]
                daT = tl.where(ok, daT, 0.0)
                dfk += tl.dot(daT.to(fqb.dtype), fqb, input_precision=PREC)
                aT = tl.dot(fkb, tl.trans(fqb), input_precision=PREC)
                aT = tl.where(ok, (aT + eps) * gf[None, :], 0.0)
                dv += tl.dot(aT.to(dob.dtype), dob, input_precision=PREC)
        tl.store(DFK + (pid_bh.to(tl.int64) * T + offs_n[:, None]) * F + offs_f[None, :],
                 tl.where(kreal[:, None], dfk, 0.0).to(DFK.dtype.element_ty),
                 mask=kin[:, None])
        tl.store(DV + b.to(tl.int64) * sdv_b + hk.to(tl.int64) * sdv_h + offs_n[:, None] * sdv_t
                 + offs_d[None, :], tl.where(kreal[:, None], dv, 0.0).to(DV.dtype.element_ty),
                 mask=kin[:, None])

    @triton.jit
    def _bwd_dkv_la(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DVS, DV, DFK,
                    sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t,
                    sdo_b, sdo_h, sdo_t, sdv_b, sdv_h, sdv_t,
                    T, H, G, NC, eps,
                    D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, CS: tl.constexpr, ADD_DVS: tl.constexpr,
                    HAS_KPM: tl.constexpr, PREC: tl.constexpr, PART: tl.constexpr):
        """``_dkv_la_part`` of one key block, kv head and program kind (its docstring)."""
        _dkv_la_part(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DVS, DV, DFK, sfq_b,
                     sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                     sdv_b, sdv_h, sdv_t, T, H, G, NC, eps, tl.program_id(0), tl.program_id(1),
                     tl.program_id(2), 0.0, D, F, FC, BM, BN, CS, ADD_DVS, HAS_KPM, PREC, PART,
                     False)

    @triton.jit
    def _bwd_kv(Q, K, FQ, FK, V, DO, LSE, DELTA, WS, GF, DDEN, RST, UST, WST, SHIFT, KPM, DK,
                DV, DFK,
                sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t,
                sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t, sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t,
                T, H, G, NC, window, scale, scale_log2, eps,
                D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, CS: tl.constexpr, HAS_KPM: tl.constexpr,
                PREC: tl.constexpr, ORDER: tl.constexpr = 0):
        """The key side of the backward in one grid (``KernelConfig.fuse_kv_side``):
        ``_bwd_dkv_la``'s grid of one key block's dfk programs and its dv program, the dv
        program first doing ``_bwd_dkv_swa``'s work (dk, and the window's dv in registers,
        added where the two-kernel path reads it back from an fp32 buffer): one launch and
        that buffer fewer, the same results bit for bit. ORDER (``KernelConfig.kv_order``):
        0, the grid's third axis holds the dfk programs first, the dv program last; 1, the
        dv program first (the heavier kind scheduled first); 2, one program a key block doing
        both (``_dkv_la_both``; F // FC must be 1)."""
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)  # b * Hkv + hk
        pid_f = tl.program_id(2)
        if ORDER == 1:  # dv program at 0, the dfk slices after it
            pid_f = (pid_f + F // FC) % (F // FC + 1)
        if ORDER == 2:
            dv_swa = _dkv_swa_part(Q, K, V, DO, LSE, DELTA, WS, KPM, DK, sq_b, sq_h, sq_t,
                                   sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                                   sdk_b, sdk_h, sdk_t, T, H, G, window, scale, scale_log2,
                                   pid_n, pid_bh, D, BM, BN, HAS_KPM, PREC)
            _dkv_la_both(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DV, DFK,
                         sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, sdo_b,
                         sdo_h, sdo_t, sdv_b, sdv_h, sdv_t, T, H, G, NC, eps, pid_n, pid_bh,
                         dv_swa, D, F, BM, BN, CS, HAS_KPM, PREC)
        elif pid_f * FC < F:  # a dfk program (the part's PART 1: dfk only, 2: dv only)
            _dkv_la_part(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DV, DV, DFK,
                         sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, sdo_b,
                         sdo_h, sdo_t, sdv_b, sdv_h, sdv_t, T, H, G, NC, eps, pid_n, pid_bh,
                         pid_f, 0.0, D, F, FC, BM, BN, CS, False, HAS_KPM, PREC, 1, False)
        else:  # the dv program: the window's dk and dv, then LA's dv plus the window's
            dv_swa = _dkv_swa_part(Q, K, V, DO, LSE, DELTA, WS, KPM, DK, sq_b, sq_h, sq_t,
                                   sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                                   sdk_b, sdk_h, sdk_t, T, H, G, window, scale, scale_log2,
                                   pid_n, pid_bh, D, BM, BN, HAS_KPM, PREC)
            _dkv_la_part(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DV, DV, DFK,
                         sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, sdo_b,
                         sdo_h, sdo_t, sdv_b, sdv_h, sdv_t, T, H, G, NC, eps, pid_n, pid_bh,
                         pid_f, dv_swa, D, F, FC, BM, BN, CS, False, HAS_KPM, PREC, 2, True)


# ============================================================================= launchers
LOG2E = 1.4426950408889634


def _ptr(x, dummy):
    """A tensor for a pointer argument the kernel does not read (its flag is off)."""
    return dummy if x is None else x


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    s = x.stride()  # (one call: three stride(i) calls cost ~1 us more, ~30 a layer call)
    return s[0], s[1], s[2]


@functools.lru_cache(maxsize=256)
def _filled(shape: tuple, value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A constant tensor made once per (shape, value, dtype, device): a fixed g's (B, H) mixer
    weights and shifts, an unpadded batch's first keys (each was a fill launch and a few
    microseconds of host time per call). Only read (the kernels, the backward's saved inputs);
    made outside inference mode, so that a cache filled during evaluation can be saved for a
    later training call's backward."""
    with torch.inference_mode(False):
        return torch.full(shape, value, dtype=dtype, device=device)


@functools.lru_cache(maxsize=16)  # (B T int32 each: 4 MB at 8 x 128k)
def _key_counts(B: int, T: int, device: torch.device) -> torch.Tensor:
    """cnt[b, i] = i (B, T + 1) int32: an unpadded batch's real keys before position i
    (``_filled``'s terms)."""
    with torch.inference_mode(False):
        return torch.arange(T + 1, device=device, dtype=torch.int32).expand(B, T + 1).contiguous()


def _dfq_buffers(B: int, H: int, T: int, F: int, fq: torch.Tensor, du_slot):
    """(dfq, du) for the dfq pass: the map's du (``DuSlot.new_du``) where it takes one, else
    dfq (B, H, T, F) in fq's dtype; the other None."""
    if du_slot is not None:
        return None, du_slot.new_du()
    return torch.empty(B, H, T, F, device=fq.device, dtype=fq.dtype), None


def _like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An output or gradient of ``x``'s shape laid out as ``x`` (its strides where ``x`` is
    dense): q, k, v come as (B, H, T, D) views of the model's (B, T, H, D) projections, and
    an output or gradient in that memory needs no copy in the model's transpose-reshape nor in
    autograd's gradient accumulation (which copies a gradient into its variable's strides)."""
    return torch.empty_like(x, dtype=dtype)


def _prec(dtype: torch.dtype) -> str:
    return "tf32x3" if dtype == torch.float32 else "tf32"  # fp32: 3 tf32 products, ~fp32 accuracy


def _state_tile(cfg: KernelConfig, heads: int, F: int, D: int) -> tuple[int, int]:
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


#: measured on one H200 (Llama-3-8B heads, bf16, 8,192 tokens a call). The kernel's fwd + bwd,
#: split against walked, in one run (2026-12-02, seventh session, attention_speed.py --tune,
#: configs "split-states" / "walk-states"): 8 x 1k (8 chunks) 3.50 against 3.28 ms (walks
#: faster; the sixth session's profiles agreed, 0.63 against 0.56 ms for the states alone),
#: 4 x 2k (16 chunks) 3.27 against 3.78 (split 13% faster), 2 x 4k (32 chunks) 3.38 against
#: 3.82 (11%); at 1 x 64k (512 chunks) the split took the layer from 38.6 to 30.1 ms (two
#: calls). Repeated configs in that sweep differed by 3.5-4.4%, so the 8-chunk difference (6%)
#: is under twice the noise, the 16- and 32-chunk ones about three times it. So split past 8
#: chunks; 9-15 chunks were not measured (benchmarks/results/h200_2026-12-02c/README.md)
SPLIT_STATES_MIN_CHUNKS = 8


def use_split_states(cfg: KernelConfig, NC: int) -> bool:
    """Whether the LA states of a sequence of ``NC`` chunks are built split
    (``KernelConfig.split_states``; ``None``: more than ``SPLIT_STATES_MIN_CHUNKS`` chunks)."""
    if cfg.split_states is None:
        return NC > SPLIT_STATES_MIN_CHUNKS
    return cfg.split_states


def _use_tma(cfg: KernelConfig, *tensors) -> bool:
    """TMA reads for these tensors (``KernelConfig.tma``, ``triton_common.tma_ok``)."""
    return cfg.tma is not False and tma_ok(*tensors)


def _split_states(x, y, S, xs, ys, NC, cfg: KernelConfig, *, reverse: bool, kpm_i8=None,
                  shift=None, dden=None):
    """``KernelConfig.split_states``: every chunk's share (``_state_local``) into fp32
    scratch, then their exclusive running sums (``_state_scan``) into S, xs, ys."""
    B, Hkv, F, D = S.shape[0], S.shape[1], S.shape[-2], S.shape[-1]
    G = x.shape[1] // Hkv
    f32 = dict(device=S.device, dtype=torch.float32)
    L = torch.empty(S.shape, **f32)
    xl, yl = torch.empty(xs.shape, **f32), torch.empty(ys.shape, **f32)
    BF, BD = (cfg.split_tile, cfg.split_tile) if cfg.split_tile else (cfg.state_f, cfg.state_d)
    BF, BD = min(BF, F), min(BD, D)
    tma = _use_tma(cfg, x, y)
    if not tma:  # pointer tensors in the loop (ptxas, sm_90a: a 128 x 128 tile spills 312 B)
        BF, BD = min(BF, 64), min(BD, 64)
    dummy = xl
    # the vector sums on the tensor cores, but not in the forward share with a padding mask:
    # compiled (triton 3.6, sm_90a, through descriptors) it faults with an illegal memory
    # access on an H200 (session 18, call 4: every padded forward case of B 1-2, T 300 / 384,
    # and none without padding nor in the reverse share; the interpreter gives the right
    # values), so that case keeps the row reductions
    sm = _sums_mma_on(cfg, x) and (reverse or kpm_i8 is None)
    fast(_state_local)[(NC, (F // BF) * (D // BD), B * Hkv)](
        x, y, _ptr(kpm_i8, dummy), _ptr(shift, dummy), _ptr(dden, dummy),
        L, xl, yl, *_strides(x), *_strides(y), x.shape[2], Hkv, G, NC,
        F=F, D=D, CS=cfg.state_chunk, BF=BF, BD=BD, REVERSE=reverse,
        HAS_KPM=kpm_i8 is not None, PREC=_prec(x.dtype), TMA=tma, SM=sm,
        num_warps=cfg.state_warps)
    CALLS["state_sums_mma"] += sm
    for share, total in ((L, S), (xl, xs), (yl, ys)):
        _scan_chunks(share, total, NC, reverse)
    CALLS["split_states"] += 1


#: ``_state_scan``'s chunks per step and elements per program
SCAN_STEP, SCAN_BLOCK = 8, 512


def _scan_chunks(share: torch.Tensor, total: torch.Tensor, NC: int, reverse: bool) -> None:
    """``total`` (B, Hkv, NC, ...) = the exclusive running sums of ``share`` (same shape,
    fp32) over the chunk axis (``_state_scan``)."""
    rows = share.shape[0] * share.shape[1]
    N = share[0, 0, 0].numel()
    blk = min(SCAN_BLOCK, next_pow2(N))
    fast(_state_scan)[(rows, cdiv(N, blk))](
        share, total, NC, N, BLK=blk, U=SCAN_STEP, REVERSE=reverse, num_warps=4)


def _la_states(fk, v, kpm_i8, cfg: KernelConfig):
    """Forward LA states (S, z) at every ``state_chunk`` positions."""
    B, Hkv, T, F = fk.shape
    D = v.shape[-1]
    CS = cfg.state_chunk
    NC = cdiv(T, CS)
    S = torch.empty(B, Hkv, NC, F, D, device=fk.device, dtype=fk.dtype)
    z = torch.empty(B, Hkv, NC, F, device=fk.device, dtype=torch.float32)
    vs = torch.empty(B, Hkv, NC, D, device=fk.device, dtype=torch.float32)
    if use_split_states(cfg, NC):
        _split_states(fk, v, S, z, vs, NC, cfg, reverse=False, kpm_i8=kpm_i8)
        return S, z, vs, NC
    BF, BD = _state_tile(cfg, B * Hkv, F, D)
    grid = (B * Hkv, F // BF, D // BD)
    sm = _sums_mma_on(cfg, fk)
    fast(_state_fwd)[grid](
        fk, v, _ptr(kpm_i8, z), S, z, vs, *_strides(fk), *_strides(v), T, Hkv, NC,
        F=F, D=D, CS=CS, BF=BF, BD=BD, HAS_KPM=kpm_i8 is not None, PREC=_prec(fk.dtype),
        SM=sm, num_warps=cfg.state_warps, num_stages=STATE_FWD_STAGES[sm])
    CALLS["state_sums_mma"] += sm
    return S, z, vs, NC


#: ``_state_fwd``'s pipeline stages without / with ``state_sums_mma``: with the sums' products
#: the kernel needs more shared memory (ptxas, sm_90a, D 128, F 256, 128 x 128 tiles: 160 KB
#: at 3 stages without them, 228 KB with, past the 227 KB a program may have; 164 KB at 2)
STATE_FWD_STAGES = {False: 3, True: 2}


def _la_states_rev(fq, dnum, dden, shift, Hkv: int, NC: int, cfg: KernelConfig):
    """The backward's reverse LA states (R, u, w) at every ``state_chunk`` positions, summed
    over each kv head's query heads (``_state_rev``; split: ``_split_states``)."""
    B, H, T, F = fq.shape
    D = dnum.shape[-1]
    f32 = dict(device=fq.device, dtype=torch.float32)
    R = torch.empty(B, Hkv, NC, F, D, device=fq.device, dtype=fq.dtype)
    U = torch.empty(B, Hkv, NC, F, **f32)
    W = torch.empty(B, Hkv, NC, D, **f32)
    if use_split_states(cfg, NC):
        _split_states(fq, dnum, R, U, W, NC, cfg, reverse=True, shift=shift, dden=dden)
        return R, U, W
    BF, BD = _state_tile(cfg, B * Hkv, F, D)
    tma = _use_tma(cfg, fq, dnum)
    # (the pipelined loop through pointer tensors spills: ptxas at D 128 bf16, 92 B)
    rs = cfg.state_rev_stages if tma else 0
    sm = _sums_mma_on(cfg, fq) and rs == 0
    fast(_state_rev)[(B * Hkv, F // BF, D // BD)](
        fq, dnum, dden, shift, R, U, W, *_strides(fq), T, H, H // Hkv, NC,
        F=F, D=D, CS=cfg.state_chunk, BF=BF, BD=BD, PREC=_prec(fq.dtype), TMA=tma, RS=rs,
        SM=sm, num_warps=cfg.state_warps)
    CALLS["state_sums_mma"] += sm
    return R, U, W


def _sums_mma_on(cfg: KernelConfig, x: torch.Tensor) -> bool:
    """Whether the LA state kernels take their vector sums on the tensor cores
    (``KernelConfig.state_sums_mma``: 16-bit inputs only)."""
    return cfg.state_sums_mma and x.dtype != torch.float32


def pack_of(cfg: KernelConfig, G: int, rows: int | None = None,
            heads: int | None = None) -> int:
    """Query heads one program takes for groups of G: the largest power of two that divides
    G, is at most ``heads`` (default ``KernelConfig.pack_heads``) and leaves at least 16 of
    the program's ``rows`` (default the forward's ``block_m``) to each head."""
    rows = cfg.block_m if rows is None else rows
    heads = cfg.pack_heads if heads is None else heads
    p = 1
    while 2 * p <= heads and G % (2 * p) == 0 and rows // (2 * p) >= 16:
        p *= 2
    return p


def dq_pack_of(cfg: KernelConfig, G: int) -> int:
    """Query heads a program of the query-side backward (dq, dfq) takes for groups of G: as
    ``pack_of`` on their ``dq_block_m`` rows, at most ``dq_pack_heads`` (None: ``pack_heads``)."""
    heads = cfg.pack_heads if cfg.dq_pack_heads is None else cfg.dq_pack_heads
    return pack_of(cfg, G, rows=_dq_block_m(cfg), heads=heads)


def _fc(cfg: KernelConfig, F: int) -> int:
    return min(cfg.f_chunk, F)


def _dq_block_m(cfg: KernelConfig) -> int:
    """The query tile of the query-side backward kernels (``KernelConfig.dq_block_m``)."""
    return cfg.dq_block_m or cfg.bwd_block_m


def _dkv_block_n(cfg: KernelConfig) -> int:
    """The key tile of the key-side backward kernels (``KernelConfig.dkv_block_n``)."""
    return cfg.dkv_block_n or cfg.bwd_block_n


def _dv_block_n(cfg: KernelConfig) -> int:
    """The key tile of ``_bwd_dkv_la``'s dv programs (``KernelConfig.dv_block_n``)."""
    return cfg.dv_block_n or cfg.bwd_block_n


def _grad_fc(cfg: KernelConfig, F: int) -> int:
    """The feature slice of a ``_bwd_dfq`` / ``_bwd_dkv_la`` program (``grad_f_chunk``)."""
    return min(cfg.grad_f_chunk or cfg.f_chunk, F)


def maps_q_in_forward(cfg: KernelConfig, q: torch.Tensor, G: int, has_la: bool) -> bool:
    """Whether ``_fwd`` computes phi_q itself (``KernelConfig.map_q_forward``) for q (B, H, T,
    D) in groups of G: the LA branch runs and each of a program's heads has at least 16 rows
    (``_mapped_q``'s products; P in 1, 2, 4)."""
    P = pack_of(cfg, G)
    return cfg.map_q_forward and has_la and P in (1, 2, 4) and cfg.block_m // P >= 16


def _forward(q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, *, window, scale, eps,
             has_swa, has_la, shared, cfg: KernelConfig, save: bool = False, map_q=None,
             branch_is_output: bool = False):
    """(out, lse, den, swa_o, la_o, states): the branches' outputs (B, H, T, D) and the LA
    states ``(S, z, u, state_chunk)`` only with ``save`` (else ``None``), for the backward.
    ``branch_is_output`` (one branch at weight 1: ``hybrid_kernel``'s ``output_is_branch``):
    with ``save`` that branch is ``out`` itself, not stored a second time.
    ``map_q`` (the q map's weight in q's dtype, its bias, whether softmax), with fq None: the
    q map runs in ``_fwd`` where ``maps_q_in_forward`` (no backward may follow: phi_q is not
    kept), else first, as its own kernel (``triton_phi.map_forward``)."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    mapped = fq is None and maps_q_in_forward(cfg, q, H // Hkv, has_la)
    held = cfg.hold_fq and has_la and not mapped
    if fq is None and not mapped:
        fq = triton_phi.map_forward(q, *map_q)[0]
    F = 2 * map_q[0].shape[-1] if mapped else fq.shape[-1]
    dummy = torch.empty(1, device=q.device, dtype=q.dtype)
    if has_la:
        S, z, vs, NC = _la_states(fk, v, kpm_i8, cfg)
    else:
        S, z, NC = dummy, torch.empty(1, device=q.device), 1
        vs = z
    o = _like(q)
    lse = torch.empty(B * H, T, device=q.device, dtype=torch.float32)
    den = torch.empty(B * H, T, device=q.device, dtype=torch.float32)
    store = save and not branch_is_output  # (the kernel stores the branches: contiguous)
    swa_o = torch.empty(B, H, T, D, device=q.device, dtype=q.dtype) if store and has_swa else None
    la_o = torch.empty(B, H, T, D, device=q.device, dtype=q.dtype) if store and has_la else None
    P = pack_of(cfg, H // Hkv)
    CALLS["packed_forward"] += P > 1
    grid = (cdiv(T, cfg.block_m // P), B * H // P)
    wq, bw = (map_q[0], map_q[1]) if mapped else (dummy, dummy)
    CALLS["q_map_in_forward"] += mapped
    CALLS["held_fq_forward"] += held
    fq_ = q if mapped else fq  # (read only where the q map does not run in the kernel)
    tma = cfg.fwd_tma and tma_ok(k, v, *((fk,) if has_la else ()))
    CALLS["forward_tma"] += tma
    park = cfg.park_la and has_la and has_swa  # (one branch: nothing held across the other)
    CALLS["parked_forward"] += park
    fast(_fwd)[grid](
        q, k, v, fq_, fk, S, z, vs, cnt, o, lse, den, ca, cb, logs, shift, first,
        _ptr(kpm_i8, lse), _ptr(swa_o, o), _ptr(la_o, o), wq, bw,
        *_strides(q), *_strides(k), *_strides(v), *_strides(fq_), *_strides(fk),
        *_strides(o), T, H, H // Hkv, NC, window, scale * LOG2E, eps, B,
        D=D, F=F, FC=_fc(cfg, F), BM=cfg.block_m, BN=cfg.block_n, CS=cfg.state_chunk, P=P,
        HAS_SWA=has_swa, HAS_LA=has_la, SHARED=shared, HAS_KPM=kpm_i8 is not None,
        PREC=_prec(q.dtype), SAVE=store, SS=cfg.state_product_stages, MAP_Q=mapped,
        SOFTMAX_Q=bool(map_q[2]) if mapped else True, HOLD_FQ=held, TMA=tma,
        PARK=park, num_warps=cfg.warps, **_fwd_launch_options(cfg, not (mapped or held)))
    states = (S, z, vs, cfg.state_chunk) if save and has_la else None
    if save and branch_is_output:  # (its values, bit for bit: the other branch adds 0 x 0)
        swa_o, la_o = (o if has_swa else None), (o if has_la else None)
    return o, lse, den, swa_o, la_o, states


def _fwd_launch_options(cfg: KernelConfig, capped: bool = True) -> dict:
    """``_fwd``'s launch options: its stages, and its register cap where one is set and
    ``capped`` (not for the q map in ``_fwd``, where ptxas at ``PARKED_FORWARD``'s cap reads
    300-1300 B of spill, nor for held fq rows, which hold the same halves: not read capped;
    a cached dict: the layer launches it every call)."""
    stages = cfg.stages if cfg.fwd_stages is None else cfg.fwd_stages
    return _launch_options(stages, cfg.fwd_maxnreg if capped else None)


@functools.lru_cache(maxsize=16)
def _launch_options(stages: int, maxnreg: int | None) -> dict:
    return {"num_stages": stages, **({} if maxnreg is None else {"maxnreg": maxnreg})}


def _backward(do, q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, lse, den, *, window,
              scale, eps, has_swa, has_la, shared, cfg: KernelConfig,
              need: tuple[bool, bool, bool] = (True, True, True), swa_o=None, la_o=None,
              states=None, du_slot=None):
    """The gradients; ``need`` says which of dq, dk, dv autograd asks for: the passes that
    only serve the others are skipped (stage 1 trains the feature maps on the teacher's
    detached q, k, v: no dq pass, no window dk / dv kernel, no dv programs) and those come
    back ``None``. ``swa_o`` / ``la_o``: the branches' outputs the forward saved
    (``KernelConfig.save_branches``), read instead of recomputing the branches for the
    per-query factors. ``states``: the forward's LA states ``(S, z, u, state_chunk)``, used
    when this config's state chunk is theirs (a retry with other tiles builds its own).
    ``du_slot``: fq is a Hedgehog map's output carrying a ``triton_phi.DuSlot``: where one
    dfq program takes all F features, it computes the map's du instead of dfq (``_bwd_dfq``'s
    or ``_bwd_q``'s MAP_DU), leaves it in the slot and returns the slot's marker as dfq."""
    need_dq, need_dk, need_dv = need
    from_saved = (swa_o is not None or not has_swa) and (la_o is not None or not has_la)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    F = fq.shape[-1]
    FC, GFC = _fc(cfg, F), _grad_fc(cfg, F)
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    dummy = torch.empty(1, device=dev, dtype=q.dtype)
    kpm = _ptr(kpm_i8, lse)
    has_kpm = kpm_i8 is not None
    prec = _prec(q.dtype)
    if has_la and states is not None and states[3] == cfg.state_chunk:
        S, z, vs = states[:3]
        NC = S.shape[2]
        CALLS["states_from_forward"] += 1
    elif has_la:
        S, z, vs, NC = _la_states(fk, v, kpm_i8, cfg)
    else:
        S, z, NC = dummy, torch.empty(1, **f32), 1
        vs = z
    BM, BN = cfg.bwd_block_m, cfg.bwd_block_n
    BMQ = _dq_block_m(cfg)  # the query tile of the query-side kernels (dq, dfq)
    PQ = dq_pack_of(cfg, G)  # query heads a program of theirs takes
    NMB = cdiv(T, BMQ // PQ)  # query blocks a head
    dq = _like(q) if has_swa and need_dq else None
    delta, ws, gf, dden = (torch.empty(B * H, T, **f32) for _ in range(4))
    pa, pb = torch.empty(B * H, NMB, **f32), torch.empty(B * H, NMB, **f32)
    # dnum = GF dO, the reverse states' matrix operand (rounded once to the input dtype, as
    # the GF-scaled fq they multiplied before 2026-12-03 was)
    dnum = torch.empty(B, H, T, D, device=dev, dtype=q.dtype) if has_la else None
    map_du = has_la and du_slot is not None and GFC == F
    dfq = du = None
    q_args = (q, k, v, fq, fk, do, S, z, vs, cnt, lse, den, ca, cb, logs, shift, first, kpm,
              _ptr(swa_o, dummy), _ptr(la_o, dummy), _ptr(dq, dummy), delta, ws, gf, dden, pa,
              pb, _ptr(dnum, dummy))
    saved = swa_o if swa_o is not None else la_o  # (one layout: see ``_forward``)
    q_strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(fq), *_strides(fk),
                 *_strides(do), *_strides(q if dq is None else dq),
                 *(_strides(saved) if saved is not None else (0, 0, 0)))
    q_scalars = (T, H, G, NC, NMB, window, scale, scale * LOG2E, eps)
    q_meta = dict(D=D, F=F, FC=FC, BM=BMQ, BN=BN, CS=cfg.state_chunk, P=PQ, HAS_SWA=has_swa,
                  HAS_LA=has_la, SHARED=shared, HAS_KPM=has_kpm, PREC=prec,
                  NEED_DQ=dq is not None, FROM_SAVED=from_saved, STORE_DNUM=dnum is not None,
                  SS=cfg.state_product_stages, num_warps=cfg.bwd_warps, num_stages=cfg.stages)
    fuse_q = has_la and cfg.fuse_q_side and GFC == F and not use_split_states(cfg, NC)
    if fuse_q:  # dq, the factors, dnum and dfq (or du) in one kernel (``_bwd_q``)
        dfq, du = _dfq_buffers(B, H, T, F, fq, du_slot if map_du else None)
        fast(_bwd_q)[(NMB, B * H // PQ)](
            *q_args, _ptr(dfq, dummy), _ptr(du, dummy), *q_strides,
            *(_strides(du) if map_du else (0, 0, 0)), *q_scalars, **q_meta, MAP_DU=map_du,
            SOFTMAX=du_slot.softmax if map_du else True)
        CALLS["fuse_q_side"] += 1
    else:
        fast(_bwd_dq)[(NMB, B * H // PQ)](*q_args, *q_strides, *q_scalars, **q_meta)
    q_args = None  # (it holds S, z, vs: they must go where the names below go)
    CALLS["dq_pass"] += dq is not None
    CALLS["factors_from_saved"] += from_saved
    CALLS["packed_dq"] += PQ > 1
    R = U = W = None
    if fuse_q:  # (its dfq pass is done: the states go with the last references to them)
        S = z = vs = None
    if has_la:  # the reverse states first: dnum is freed before dfq is allocated (unless
        # fuse_q allocated it above)
        R, U, W = _la_states_rev(fq, dnum, dden, shift, Hkv, NC, cfg)
        dnum = None  # (read by the reverse states only)
    if has_la and not fuse_q:
        dfq, du = _dfq_buffers(B, H, T, F, fq, du_slot if map_du else None)
        fast(_bwd_dfq)[(NMB, B * H // PQ, F // GFC)](
            fk, v, do, S, z, gf, dden, shift, kpm, _ptr(dfq, dummy), fq, _ptr(du, dummy),
            *_strides(fk), *_strides(v), *_strides(do), *_strides(fq),
            *(_strides(du) if map_du else (0, 0, 0)), T, H, G, NC,
            D=D, F=F, FC=GFC, BM=BMQ, BN=BN, CS=cfg.state_chunk, P=PQ, HAS_KPM=has_kpm,
            PREC=prec, MAP_DU=map_du, SOFTMAX=du_slot.softmax if map_du else True,
            num_warps=cfg.bwd_warps, num_stages=cfg.stages)
    del S, z, vs
    dk = dv = dvs = dfk = None
    BNK = _dkv_block_n(cfg)  # the key tile of the window kernel and of the dfk programs
    NNB = cdiv(T, BNK)
    # the window kernel writes dk and its dv together: when only one of them is asked for, the
    # other is computed into scratch (no stage takes this path: stage 1 needs neither, stage 2
    # both)
    if need_dk or (need_dv and has_swa):
        dk = _like(k)
    if need_dv and (has_la or has_swa):
        dv = _like(v)
    BNV = _dv_block_n(cfg)
    fuse_kv = cfg.fuse_kv_side and has_swa and has_la and dk is not None and dv is not None \
        and BNK == BNV
    if fuse_kv:  # dk, dfk and dv from one grid (``_bwd_kv``)
        dfk = torch.empty(B, Hkv, T, F, device=dev, dtype=fk.dtype)
        order = cfg.kv_order if cfg.kv_order != 2 or GFC == F else 0
        fast(_bwd_kv)[(NNB, B * Hkv, 1 if order == 2 else F // GFC + 1)](
            q, k, fq, fk, v, do, lse, delta, ws, gf, dden, R, U, W, shift, kpm, dk, dv, dfk,
            *_strides(q), *_strides(k), *_strides(fq), *_strides(fk), *_strides(v),
            *_strides(do), *_strides(dk), *_strides(dv), T, H, G, NC, window, scale,
            scale * LOG2E, eps, D=D, F=F, FC=GFC, BM=BM, BN=BNK, CS=cfg.state_chunk,
            HAS_KPM=has_kpm, PREC=prec, ORDER=order, num_warps=cfg.bwd_warps,
            num_stages=cfg.stages)
        CALLS["fuse_kv_side"] += 1
        if order:
            CALLS[f"kv_order_{order}"] += 1
        CALLS["dkv_swa"] += 1
        CALLS["dv_la"] += 1
    elif has_swa and dk is not None:  # the window's dk and dv come from one kernel
        # (the fp32 share laid out as dv: the LA kernel reads it with dv's strides)
        dvs = _like(v, torch.float32) if has_la or dv is None else dv
        if dv is not None and dvs.stride() != dv.stride():
            raise AssertionError(f"dv scratch strides {dvs.stride()} differ from dv's "
                                 f"{dv.stride()}")
        fast(_bwd_dkv_swa)[(NNB, B * Hkv)](
            q, k, v, do, lse, delta, ws, kpm, dk, dvs,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk),
            *_strides(dvs), T, H, G, window, scale, scale * LOG2E,
            D=D, BM=BM, BN=BNK, HAS_KPM=has_kpm, PREC=prec, num_warps=cfg.bwd_warps,
            num_stages=cfg.stages)
        CALLS["dkv_swa"] += 1
        dvs = dvs if dv is not None and has_la else None  # only dv's share is kept
    elif dk is not None:
        dk.zero_()
    if has_la and not fuse_kv:
        dfk = torch.empty(B, Hkv, T, F, device=dev, dtype=fk.dtype)
        args = (fq, fk, v, do, gf, dden, R, U, W, shift, kpm, _ptr(dvs, dfk), _ptr(dv, dfk), dfk,
                *_strides(fq), *_strides(fk), *_strides(v), *_strides(do),
                *_strides(dfk if dv is None else dv), T, H, G, NC, eps)
        meta = dict(D=D, F=F, FC=GFC, BM=BM, CS=cfg.state_chunk, ADD_DVS=dvs is not None,
                    HAS_KPM=has_kpm, PREC=prec, num_warps=cfg.bwd_warps, num_stages=cfg.stages)
        if BNK == BNV:  # one grid; the last program of each key block: dv
            fast(_bwd_dkv_la)[(NNB, B * Hkv, F // GFC + (dv is not None))](
                *args, BN=BNK, PART=0, **meta)
        else:  # the dfk programs at their key tile, the dv programs at theirs
            fast(_bwd_dkv_la)[(NNB, B * Hkv, F // GFC)](*args, BN=BNK, PART=1, **meta)
            CALLS["dkv_apart"] += 1
            if dv is not None:
                fast(_bwd_dkv_la)[(cdiv(T, BNV), B * Hkv, 1)](
                    *args, BN=BNV, PART=2, **meta)
        CALLS["dv_la"] += dv is not None
    if du is not None:  # (last: a config that failed above leaves nothing in the slot)
        dfq = du_slot.put(du, fq)
        CALLS["map_du"] += 1
    return dq, dk if need_dk else None, dv, dfq, dfk, pa, pb


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
RETRIES: list[str] = []


@functools.lru_cache(maxsize=64)
def _retry_chain(cfg: KernelConfig) -> tuple[KernelConfig, ...]:
    """The configs ``_with_retry`` tries before ``SAFE_CONFIG`` (built once per config: host
    time per call): ``cfg``; its tiles without the fused backward kernels (``fuse_q_side``,
    ``fuse_kv_side``: the separate kernels, each smaller); then also without
    ``save_branches``. A config with ``map_q_forward`` or ``hold_fq`` first tries itself
    without them (the forward's largest variants: 112 KB of shared memory at the 8B's tiles;
    the sums grouped otherwise, within rounding)."""
    chain = [cfg]
    if cfg.map_q_forward or cfg.hold_fq:
        chain.append(dataclasses.replace(cfg, map_q_forward=False, hold_fq=False))
    if cfg.fuse_q_side or cfg.fuse_kv_side:
        chain.append(dataclasses.replace(cfg, fuse_q_side=False, fuse_kv_side=False))
    if cfg.save_branches:
        chain.append(dataclasses.replace(chain[-1], save_branches=False))
    return tuple(c for c in chain if c != SAFE_CONFIG)


def _with_retry(phase: str, key: tuple, cfg: KernelConfig, fn):
    """``fn(cfg)``; where ``cfg``'s kernels do not compile here (once per problem key; logged
    once, recorded in ``RETRIES``), the same tiles without the fused backward kernels, then
    without ``save_branches`` (each where it was on), then ``SAFE_CONFIG``. Every config
    computes the same function: a forward retried without saved branches leaves its backward
    to recompute them."""
    chain = _retry_chain(cfg)
    errs = errors()
    # (the sets are tested only where not empty: a config's hash is ~40 fields, twice a call)
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
            RETRIES.append(f"{phase} {key}: {type(e).__name__}: {str(e)[:300]}")
            warn_once(__name__, f"fused hybrid {phase}: tiles {c} do not compile here "
                      f"({type(e).__name__}: {str(e)[:200]}); using {nxt}")
    try:
        return fn(SAFE_CONFIG)
    except errs as e:
        _SAFE_FAILED[(phase, key)] = e
        raise


class FoldedMaps(NamedTuple):
    """The layer's two Hedgehog maps as ``hybrid_kernel(maps=...)`` runs them inside its own
    autograd Function (``fold_maps``): each map's weight (H, D, F/2) and bias (H, F/2), the
    parameters themselves, and whether its activation is the softmax (else exp)."""
    wq: torch.Tensor
    bq: torch.Tensor
    wk: torch.Tensor
    bk: torch.Tensor
    softmax_q: bool
    softmax_k: bool


#: _HybridFn's inputs before the folded maps' (their gradients' positions in its backward)
_N_KERNEL_INPUTS = 22


class _Forward(NamedTuple):
    """What ``_function_forward`` gives: the output, the features (the folded maps' outputs
    where they ran), the maps' weights and biases as their kernels read them (``None`` without
    folded maps), and what the backward reads (``_forward``'s lse, den, branches, states)."""
    o: torch.Tensor
    fq: torch.Tensor
    fk: torch.Tensor
    casts: tuple | None
    lse: torch.Tensor
    den: torch.Tensor
    swa_o: torch.Tensor | None
    la_o: torch.Tensor | None
    states: tuple | None


def _map_pair(q, k, wq, bq, wk, bk, maps_softmax) -> tuple:
    """(fq, fk, the maps' weights and biases as their kernels read them): both folded maps in
    one launch (``triton_phi.map_forward_pair``)."""
    (fq, wqc, bqc), (fk, wkc, bkc) = triton_phi.map_forward_pair(
        q, wq, bq, maps_softmax[0], k, wk, bk, maps_softmax[1])
    triton_phi.CALLS["forward"] += 2
    return fq, fk, (wqc, bqc, wkc, bkc)


def _function_forward(q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, window, scale,
                      eps, has_swa, has_la, shared, cfg, save, wq=None, bq=None, wk=None,
                      bk=None, maps_softmax=None, *, autograd: bool = True,
                      branch_is_output: bool = False, premapped=None) -> _Forward:
    """The forward of ``_HybridFn``'s function (its arguments, less the du slot): with the maps
    folded in (``maps_softmax`` given), fq = phi_q(q) and fk = phi_k(k) first, both maps in one
    launch (``_map_pair``; ``premapped``: its result, launched already by ``hybrid_kernel``
    for a forward without autograd); then the kernels (``_forward``, through the tile retry
    chain). ``hybrid_kernel`` calls it
    directly where no gradient will be asked for (evaluation, prefill; ``autograd`` False): the
    same launches, without the autograd Function's host work, except that where
    ``maps_q_in_forward`` the k map runs alone and ``_fwd`` computes phi_q itself
    (``KernelConfig.map_q_forward``; fq is then ``None``)."""
    casts = None
    map_q = None
    if not autograd and cfg.forward_state_chunk not in (None, cfg.state_chunk):
        cfg = _no_grad_config(cfg)
        CALLS["forward_state_chunk"] += 1
    if premapped is not None:
        fq, fk, casts = premapped
    elif maps_softmax is not None and not autograd and maps_q_in_forward(
            cfg, q, q.shape[1] // k.shape[1], has_la):  # (the k map alone)
        fk, wkc, bkc = triton_phi.map_forward(k, wk, bk, maps_softmax[1])
        map_q = (*triton_phi.kernel_weights(wq, bq, q.dtype), maps_softmax[0])
        casts = (*map_q[:2], wkc, bkc)
        triton_phi.CALLS["forward"] += 1
    elif maps_softmax is not None:  # (both maps in one launch)
        fq, fk, casts = _map_pair(q, k, wq, bq, wk, bk, maps_softmax)
    # the state path is part of the problem: a split build that fails to compile at long T
    # must not send short calls (which walk) down the retry chain
    F = fk.shape[-1]
    key = (q.dtype, q.shape[-1], F, has_swa, has_la, shared, kpm_i8 is not None,
           save, use_split_states(cfg, cdiv(q.shape[2], cfg.state_chunk)), map_q is not None)
    o, lse, den, swa_o, la_o, states = _with_retry("forward", key, cfg, lambda c: _forward(
        q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, window=window, scale=scale,
        eps=eps, has_swa=has_swa, has_la=has_la, shared=shared, cfg=c,
        save=save and c.save_branches, map_q=map_q,
        branch_is_output=branch_is_output))  # (the retry's SAFE_CONFIG saves nothing
    # and runs the q map as its own kernel)
    return _Forward(o, fq, fk, casts, lse, den, swa_o, la_o, states)


@functools.lru_cache(maxsize=64)  # (one per config: host time per call)
def _no_grad_config(cfg: KernelConfig) -> KernelConfig:
    """``cfg`` for a forward no backward follows: its states every ``forward_state_chunk``
    positions."""
    return dataclasses.replace(cfg, state_chunk=cfg.forward_state_chunk,
                               forward_state_chunk=None)


class _HybridFn(torch.autograd.Function):
    """The kernels' function of (q, k, v, fq, fk, the mixer's ca / cb / logs); with the maps
    folded in (``wq, bq, wk, bk, maps_softmax`` given, fq and fk ``None``), of (q, k, v, the
    maps' weights and biases, the mixer's): the forward computes fq = phi_q(q), fk = phi_k(k)
    with the maps' kernels in one launch (``triton_phi.map_forward_pair``), the backward hands
    the maps' backward (``triton_phi.map_backward_pair``) the kernel's du for the q map and dfk
    for the k map, with the attention's dq and dk to add in the maps' kernels. One autograd
    node for the three; the same kernels, with the same arguments, as the maps' own Functions
    would launch (the gradients are bit for bit the same: tests/triton_interpreter_check.py
    ``fold_case``)."""

    @staticmethod
    def forward(ctx, q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, window, scale,
                eps, has_swa, has_la, shared, cfg, save, du_slot, branch_is_output, wq=None,
                bq=None, wk=None, bk=None, maps_softmax=None):
        r = _function_forward(q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, window,
                              scale, eps, has_swa, has_la, shared, cfg, save, wq, bq, wk, bk,
                              maps_softmax, branch_is_output=branch_is_output)
        ctx.maps = None if r.casts is None else (
            maps_softmax, (wq.dtype, bq.dtype), (wk.dtype, bk.dtype))
        # (all through save_for_backward, the branches and states too: held on ctx instead,
        # the backward could drop them before the folded maps' backward allocates, but
        # non-reentrant activation checkpointing, which the stages use, discards and recomputes
        # only saved tensors: every layer's branches would stay alive through the forward)
        ctx.saved_branches = (r.swa_o is not None, r.la_o is not None)
        # the branch saved is the output (``output_is_branch``): never released by the
        # backward (whoever holds the output, e.g. an output gate's lerp, still reads it)
        ctx.branch_is_output = r.o is r.swa_o or r.o is r.la_o
        ctx.states_chunk = None if r.states is None else r.states[3]
        ctx.save_for_backward(q, k, v, r.fq, r.fk, ca, cb, logs, shift, first, cnt, r.lse,
                              r.den, *(x for x in (r.swa_o, r.la_o) if x is not None),
                              *(() if r.states is None else r.states[:3]),
                              *(() if kpm_i8 is None else (kpm_i8,)),
                              *(() if r.casts is None else r.casts))
        ctx.args = dict(window=window, scale=scale, eps=eps, has_swa=has_swa, has_la=has_la,
                        shared=shared, cfg=cfg)
        ctx.has_kpm = kpm_i8 is not None
        ctx.du_slot = du_slot
        return r.o

    @staticmethod
    def backward(ctx, do):
        q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, lse, den, *rest = ctx.saved_tensors
        swa_o = rest.pop(0) if ctx.saved_branches[0] else None
        la_o = rest.pop(0) if ctx.saved_branches[1] else None
        states = None
        if ctx.states_chunk is not None:
            states = (rest.pop(0), rest.pop(0), rest.pop(0), ctx.states_chunk)
        kpm_i8 = rest.pop(0) if ctx.has_kpm else None
        folded = ctx.maps is not None
        # a second backward through the graph (retain_graph) after the first released them
        # (``_release_saved``): the kernels recompute both branches' factors and the states
        if swa_o is not None and _released(swa_o) or la_o is not None and _released(la_o):
            swa_o = la_o = None
            CALLS["saved_recomputed"] += 1
        if states is not None and _released(states[0]):
            states = None
        a = ctx.args
        do = do if do.stride(-1) == 1 else do.contiguous()
        if do.dtype != q.dtype:
            do = do.to(q.dtype)
        need = tuple(ctx.needs_input_grad[:3])  # dq, dk, dv
        key = (q.dtype, q.shape[-1], fq.shape[-1], a["has_swa"], a["has_la"], a["shared"],
               kpm_i8 is not None, swa_o is not None or la_o is not None, need,
               use_split_states(a["cfg"], cdiv(q.shape[2], a["cfg"].state_chunk)))
        args = {n: x for n, x in a.items() if n != "cfg"}
        if folded:  # (the q map's du straight from the kernel: no other consumer of fq)
            du_slot = DuSlot(q, fq.shape[-1] // 2, ctx.maps[0][0]) if any(
                _map_needs(ctx, 0)) else None
        else:
            du_slot = ctx.du_slot if ctx.needs_input_grad[3] else None
        if du_slot is not None:
            du_slot.clear()  # (nothing stale from a backward whose map's never ran)
            if not folded and du_slot.observed():  # (fq's own gradient asked for: dfq)
                du_slot = None
        try:
            dq, dk, dv, dfq, dfk, pa, pb = _with_retry("backward", key, a["cfg"], lambda c: (
                _backward(do, q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, lse,
                          den, cfg=c, need=need, swa_o=swa_o, la_o=la_o, states=states,
                          du_slot=du_slot, **args)))
        except errors() as e:  # a Triton resource / compile failure: say so, stay right
            record_fallback(FALLBACK_ERRORS, __name__, "hybrid backward", e, "this call's "
                            "gradients come from the PyTorch reference", phase="backward")
            return _reference_backward(ctx, do, q, k, v, fq, fk, ca, cb, logs, shift, first,
                                       kpm_i8, a, rest if folded else None)
        if dfq is None and folded:  # (no LA: the maps' backward takes zeros; autograd, None)
            dfq, dfk = torch.zeros_like(fq), torch.zeros_like(fk)
        if folded:  # (the kernels have read the saved branches and states: their memory back
            # before the maps' backward allocates)
            _release_saved(*(() if ctx.branch_is_output else (swa_o, la_o)),
                           *(() if states is None else states[:3]))
            dq, dk, map_grads = _folded_maps_backward(ctx, q, k, fq, fk, dq, dk, dfq, dfk,
                                                      du_slot, rest)
        elif dq is None and need[0]:  # no window (la_only): q has no other path
            dq = torch.zeros_like(q)
        # the mixer's gradients from the per-block partial sums, only those autograd asks for
        # (a fixed g takes none: two reductions fewer per call)
        want_ca, want_cb, want_logs = ctx.needs_input_grad[5:8]
        if a["shared"]:
            dca, dcb, dlogs = None, None, pa.sum(-1) if want_logs else None
        else:
            dca = pa.sum(-1) if want_ca else None
            dcb = pb.sum(-1) if want_cb else None
            dlogs = None
        if folded:
            return (dq, dk, dv, None, None, dca, dcb, dlogs) + (None,) * 14 + map_grads
        return (dq, dk, dv, dfq, dfk, dca, dcb, dlogs) + (None,) * 14


def _release_saved(*tensors) -> None:
    """Empty the storage of the forward's saved branches and LA states (``_HybridFn``'s own
    allocations, read by the backward's kernels by now) in place, as FSDP frees a parameter:
    a saved tensor lives until its node's backward returns, and with the maps folded in, the
    maps' backward runs inside that node (at 1 x 64k on the 8B's heads it had peaked 0.59 GiB
    above the call before the fold, session 21). They stay saved tensors - activation
    checkpointing discards and recomputes only those - and a second backward through the
    graph (``retain_graph``) finds them empty (``_released``) and recomputes what they held.
    On a GPU the caching allocator takes the blocks back in stream order (the kernels that
    read them were launched on this stream before)."""
    held = [x for x in tensors if x is not None]
    for x in held:
        x.untyped_storage().resize_(0)
    CALLS["saved_released"] += bool(held)


def _released(x: torch.Tensor) -> bool:
    """Whether ``_release_saved`` emptied ``x``'s storage (a non-empty tensor with none)."""
    return x.numel() > 0 and x.untyped_storage().nbytes() == 0


def _folded_maps_backward(ctx, q, k, fq, fk, dq, dk, dfq, dfk, du_slot, saved):
    """(dq, dk, the gradients of wq, bq, wk, bk and ``maps_softmax``) of ``_HybridFn`` with the
    maps folded in: each map's backward (``triton_phi.map_backward``) from the kernel's du
    (q; or its dfq, where the config's dfq programs take a feature slice: no du) and dfk (k),
    adding the attention's dq / dk in its kernel."""
    wqc, bqc, wkc, bkc = saved
    # (in the inputs' dtype; the fp32 master weights where the map pair's kernel rounded
    # them itself, ``triton_phi.WEIGHTS_IN_KERNEL``)
    wqc, wkc = cast(wqc, q.dtype), cast(wkc, k.dtype)
    softmax, q_dtypes, k_dtypes = ctx.maps
    q_side = k_side = None
    if any(_map_needs(ctx, 0)):
        du, only = du_slot.take(dfq) if du_slot is not None else (None, False)
        q_side = dict(x=q, wc=wqc, bc=bqc, y=fq, dy=dfq, dx_in=dq, softmax=softmax[0],
                      dtypes=q_dtypes, du=du, du_only=only, need=_map_needs(ctx, 0),
                      dx_into_input=True)
    if any(_map_needs(ctx, 1)):  # (dq, dk: the kernels' own buffers, written over)
        k_side = dict(x=k, wc=wkc, bc=bkc, y=fk, dy=dfk, dx_in=dk, softmax=softmax[1],
                      dtypes=k_dtypes, need=_map_needs(ctx, 1), dx_into_input=True)
    got_q, got_k = triton_phi.map_backward_pair(q_side, k_side)  # (one launch where both run)
    dwq = dbq = dwk = dbk = None
    if got_q is not None:
        dq, dwq, dbq = got_q
    if got_k is not None:
        dk, dwk, dbk = got_k
    CALLS["maps_folded_backward"] += 1
    return dq, dk, (dwq, dbq, dwk, dbk, None)


def _map_needs(ctx, i: int) -> tuple[bool, bool, bool]:
    """Which of (x, weight, bias) of the folded map i (0: q, 1: k) autograd asks gradients
    of."""
    need = ctx.needs_input_grad
    w = _N_KERNEL_INPUTS + 2 * i
    return need[i], need[w], need[w + 1]


def _reference_backward(ctx, do, q, k, v, fq, fk, ca, cb, logs, shift, first, kpm_i8, a,
                        folded=None):
    """The gradients from ``kernel_reference`` (fp32); ``folded``: the maps' weights and
    biases as the kernels read them (``_HybridFn`` with the maps folded in): the maps run
    in it too (``triton_phi.reference_features``), and their gradients come back."""
    kpm = None if kpm_i8 is None else kpm_i8.bool()
    with torch.enable_grad():
        if folded is None:
            ins = [t.detach().requires_grad_() for t in (q, k, v, fq, fk, ca, cb, logs)]
            feats = ins[3:5]
        else:
            ins = [t.detach().requires_grad_() for t in (q, k, v, ca, cb, logs)]
            # (the weights as the kernels read them, in the inputs' dtype: where the pair's
            # kernel rounded the fp32 master weights itself, ``triton_phi.WEIGHTS_IN_KERNEL``,
            # ``folded`` holds the masters, rounded here as ``_folded_maps_backward`` does)
            wq, bq, wk, bk = folded
            ins += [t.detach().float().requires_grad_()
                    for t in (cast(wq, q.dtype), bq, cast(wk, k.dtype), bk)]
            wq, bq, wk, bk = ins[6:]
            act = ["softmax" if s else "exp" for s in ctx.maps[0]]
            feats = [triton_phi.reference_features(ins[0], wq, bq, act[0]),
                     triton_phi.reference_features(ins[1], wk, bk, act[1])]
        mix = ins[5:8] if folded is None else ins[3:6]
        out = kernel_reference(*ins[:3], *feats, *mix, shift.view(q.shape[0], q.shape[1]),
                               window=a["window"], scale=a["scale"], eps=a["eps"],
                               key_padding_mask=kpm, has_swa=a["has_swa"], has_la=a["has_la"],
                               shared=a["shared"])
        grads = torch.autograd.grad(out, ins, do.float(), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g.to(t.dtype) for g, t in zip(grads, ins)]
    if folded is None:
        dq, dk, dv, dfq, dfk, dca, dcb, dlogs = grads
        map_grads = ()
    else:
        dq, dk, dv, dca, dcb, dlogs = grads[:6]
        dfq = dfk = None
        dtypes = (*ctx.maps[1], *ctx.maps[2])  # (the parameters' own)
        map_grads = tuple(g.to(t) for g, t in zip(grads[6:], dtypes)) + (None,)
    if a["shared"]:
        dca = dcb = None
    else:
        dlogs = None
    return (dq, dk, dv, dfq, dfk, dca, dcb, dlogs) + (None,) * 14 + map_grads


# ============================================================================= entry points
def hybrid_kernel(q, k, v, fq, fk, ca, cb, logs, shift, *, window: int, scale: float, eps: float,
                  key_padding_mask: torch.Tensor | None = None, has_swa: bool = True,
                  has_la: bool = True, shared: bool = False,
                  config: KernelConfig | None = None,
                  maps: FoldedMaps | None = None,
                  output_is_branch: bool = False) -> torch.Tensor:
    """The kernels' own function (see the module docstring), differentiable in q, k, v, fq,
    fk, ca, cb (not ``shared``) and logs (``shared``).

    q (B, H, T, D), k, v (B, Hkv, T, D), fq (B, H, T, F), fk (B, Hkv, T, F), one dtype;
    ca, cb, logs (B, H) fp32; shift (B, H) int; key_padding_mask (B, T) bool or None.
    ``maps`` (``fold_maps``), with fq and fk ``None``: fq = phi_q(q) and fk = phi_k(k) are
    computed inside this call's autograd Function, which is then differentiable in the maps'
    weights and biases too (the layer's path: one autograd node instead of three).
    ``output_is_branch``: the caller promises the call has one branch (``has_swa`` or
    ``has_la``) at weight 1 for every head (ca 1 without LA, cb 1 without SWA; an output
    gate's branch calls, ``_gated``): the output is then that branch bit for bit, and the
    backward reads it as the saved branch instead of a second copy the forward would store
    (``save_branches``; ~0.5 GiB a branch at 1 x 64k on the 8B's heads).
    No checks beyond shapes: ``fused_hybrid`` decides what may come here.
    """
    B, H, T, D = q.shape
    if maps is not None and (fq is not None or fk is not None):
        raise ValueError("hybrid_kernel takes the features (fq, fk) or the maps, not both")
    F = fq.shape[-1] if maps is None else 2 * maps.wq.shape[-1]
    cfg = config or default_config(D, F, q.dtype)
    blocks = (cfg.block_n, cfg.bwd_block_n, _dkv_block_n(cfg), _dv_block_n(cfg))
    if any(cfg.state_chunk % n for n in blocks):
        raise ValueError(f"state_chunk {cfg.state_chunk} must be a multiple of the key blocks "
                         f"(block_n, bwd_block_n, dkv_block_n, dv_block_n: {blocks})")
    for name, n in (("state_chunk", cfg.state_chunk),
                    ("forward_state_chunk", cfg.forward_state_chunk)):
        if n is not None and (n <= 0 or n & (n - 1)):  # (the state kernels' tl.arange)
            raise ValueError(f"{name} {n} must be a power of two (the state kernels take a "
                             f"chunk's positions as one tile): e.g. 64 or 128")
    if cfg.fwd_maxnreg is not None and not 24 <= cfg.fwd_maxnreg <= 255:
        raise ValueError(f"fwd_maxnreg {cfg.fwd_maxnreg}: a register cap from 24 to 255 a "
                         "thread (e.g. 128 or 168), or None for none")
    if cfg.fwd_stages is not None and cfg.fwd_stages < 1:
        raise ValueError(f"fwd_stages {cfg.fwd_stages}: at least 1 pipeline stage, or None for "
                         f"the config's stages ({cfg.stages})")
    if output_is_branch and has_swa == has_la:
        raise ValueError("output_is_branch needs a call with one branch (has_swa or has_la, "
                         f"not both nor neither): has_swa={has_swa}, has_la={has_la}")
    if cfg.forward_state_chunk is not None and cfg.forward_state_chunk % cfg.block_n:
        raise ValueError(f"forward_state_chunk {cfg.forward_state_chunk} must be a multiple of "
                         f"the forward's key block (block_n {cfg.block_n})")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if maps is None:
        fq, fk = (x if x.stride(-1) == 1 else x.contiguous() for x in (fq, fk))
    ins = (q, k, v, ca, cb, logs) + ((fq, fk) if maps is None else tuple(maps[:4]))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in ins)
    premapped = None
    if maps is not None and not grad and not maps_q_in_forward(cfg, q, H // k.shape[1], has_la):
        # evaluation, prefill: the maps' launch first, before the rest of the call's
        # preparation (an isolated call's GPU waits for its first launch, and its event time
        # reads that latency: CPU proxy 62 to 54 us, host_overhead.py). Not under grad: there
        # the host runs ahead of the GPU, and launching outside the Function would need a
        # no_grad context for the weights' casts (+7 us a call on the proxy)
        premapped = _map_pair(q, k, *maps[:4], maps[4:])
    dev = q.device
    if key_padding_mask is None:
        kpm_i8 = None
        first = _filled((B,), 0, torch.int32, dev)
        cnt = _key_counts(B, T, dev)
    else:
        kpm = key_padding_mask.bool()
        kpm_i8 = kpm.to(torch.int8).contiguous()
        # index of the first real key of each row (T where there is none)
        idx = torch.where(kpm, torch.arange(T, device=dev)[None, :], T)
        first = idx.min(dim=1).values.to(torch.int32)
        # cnt[b, i]: real keys before position i (the kernel floor counts visible real keys)
        cnt = torch.nn.functional.pad(kpm.int().cumsum(1), (1, 0)).to(torch.int32).contiguous()
    ca, cb, logs = (cast(x, torch.float32).reshape(B * H).contiguous() for x in (ca, cb, logs))
    shift = cast(shift.to(dev), torch.int32).reshape(B * H).contiguous()
    folded = () if maps is None else (*maps[:4], maps[4:])
    if maps is not None:
        CALLS["maps_folded"] += 1
    args = (q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, int(window), float(scale),
            float(eps), bool(has_swa), bool(has_la), bool(shared), cfg)
    if not grad:  # (evaluation, prefill: no autograd node, nothing stored for a backward)
        out = _function_forward(*args, False, *folded, autograd=False, premapped=premapped).o
        CALLS["forward_without_autograd"] += 1
        return out
    # fq as a Hedgehog map's output, unchanged: the map's du from the dfq pass (``DuSlot``;
    # the first kernel given it only)
    du_slot = getattr(fq, DU_SLOT_ATTR, None) if has_la and maps is None else None
    if du_slot is not None and not du_slot.claim():
        du_slot = None
    # store the branches for the backward (``KernelConfig.save_branches``)
    return _HybridFn.apply(*args, cfg.save_branches, du_slot, bool(output_is_branch), *folded)


def fold_maps(maps, q: torch.Tensor, k: torch.Tensor) -> tuple[FoldedMaps | None, str | None]:
    """``(FoldedMaps, None)`` where the two feature-map modules ``maps = (phi_q, phi_k)`` can
    run inside the hybrid kernel's Function on these q (B, H, T, D) and k (B, Hkv, T, D): each
    map's function is the fused map's (``HedgehogFeatureMap.kernel_form``: no floor, softmax or
    exp) and its kernel takes x (``triton_phi.unsupported_reason``: bf16, power-of-two dims, one
    map per head of x), both with the same feature dim; else ``(None, why)``."""
    from . import backends  # (imports this module lazily)

    if not backends.triton_switched_on():  # (the modules' own fused path: HEDGECATS_TRITON=0)
        return None, "the fused feature maps are off (HEDGECATS_TRITON=0)"
    forms = []
    for m, x, name in zip(maps, (q, k), ("phi_q", "phi_k")):
        form = getattr(m, "kernel_form", lambda: None)()
        if form is None:
            return None, (f"{name} ({m.extra_repr() if hasattr(m, 'extra_repr') else m}) is not "
                          f"the fused map's function (softmax or exp, no floor)")
        reason = triton_phi.unsupported_reason(x, *form)
        if reason is not None:
            return None, f"{name}: {reason}"
        forms.append(form)
    (wq, bq, aq), (wk, bk, ak) = forms
    if wq.shape[-1] != wk.shape[-1]:
        return None, f"the maps' feature dims differ ({2 * wq.shape[-1]}, {2 * wk.shape[-1]})"
    return FoldedMaps(wq, bq, wk, bk, aq == "softmax", ak == "softmax"), None


def kernel_reference(q, k, v, fq, fk, ca, cb, logs, shift, *, window: int, scale: float,
                     eps: float, key_padding_mask=None, has_swa: bool = True, has_la: bool = True,
                     shared: bool = False) -> torch.Tensor:
    """``hybrid_kernel``'s function in plain PyTorch (fp32), built from ``ops.reference``:
    the interpreter tests' oracle and the backward's fallback. Returns (B, H, T, D) fp32."""
    B, H, T, D = q.shape
    swa, lse = ref.softmax_attention_blocked(q, k, v, scale=scale, window=window,
                                             key_padding_mask=key_padding_mask)
    shift = shift.reshape(B, H).to(q.device)
    la = torch.zeros(B, H, T, D, device=q.device)
    den = torch.zeros(B, H, T, device=q.device)
    has = torch.zeros(B, H, T, dtype=torch.bool, device=q.device)
    if has_la:
        for s in sorted({int(x) for x in shift.flatten().tolist()}):
            o_s, d_s, h_s = ref.linear_attention_chunked(fq, fk, v, shift=s, eps=eps,
                                                         key_padding_mask=key_padding_mask)
            sel = (shift == s)[..., None]  # (B, H, 1)
            la = torch.where(sel[..., None], o_s, la)
            den = torch.where(sel, d_s, den)
            has = torch.where(sel, h_s, has)
    if shared:
        alpha = torch.sigmoid(logs.reshape(B, H, 1).float() + lse - torch.log(den.clamp_min(eps)))
        alpha = torch.where(has, alpha, torch.ones_like(alpha))
        alpha = torch.where(torch.isfinite(lse), alpha, torch.zeros_like(alpha))[..., None]
        return alpha * swa + (1 - alpha) * la
    ca, cb = ca.reshape(B, H, 1, 1).float(), cb.reshape(B, H, 1, 1).float()
    out = torch.zeros_like(swa)
    if has_swa:
        out = out + ca * swa
    if has_la:
        out = out + cb * la
    return out


def unsupported_reason(q, k, v, fq, fk, key_padding_mask=None, *,
                       maps: FoldedMaps | None = None) -> str | None:
    """Why the fused kernels cannot take these tensors (``None``: they can); ``maps`` in
    place of fq and fk: the features the folded maps will compute (``fold_maps``: q's and k's
    dtype, k's heads)."""
    if not available():
        return "triton is not installed or there is no CUDA device"
    if not (q.is_cuda or interpret()):
        return "the fused kernels run on CUDA tensors"
    if maps is None and (fq is None or fk is None):
        return "no feature maps"
    dtypes = {x.dtype for x in ((q, k, v) if maps is not None else (q, k, v, fq, fk))}
    if len(dtypes) != 1:
        return f"mixed dtypes {sorted(str(d) for d in dtypes)}"
    dtype = q.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {dtype} (the fused kernels take bf16 and fp32)"
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    F = fq.shape[-1] if maps is None else 2 * maps.wq.shape[-1]
    if Tq != Tk:
        return "fewer queries than keys (KV-cache decoding)"
    if v.shape[-1] != D or (maps is None and (fk.shape[1] != Hkv or fk.shape[2] != Tk or
                                              fk.shape[-1] != F)):
        return "shapes of fq/fk/v do not match q/k"
    if H % Hkv:
        return f"{H} query heads are not a multiple of {Hkv} kv heads"

    def pow2(n):
        return n & (n - 1) == 0

    if not (pow2(D) and 16 <= D <= 128):
        return f"head dim {D} (the fused kernels take powers of two in [16, 128])"
    if not (pow2(F) and 16 <= F <= 256):
        return f"feature dim {F} (the fused kernels take powers of two in [16, 256])"
    if B * H > GRID_AXIS_MAX:
        return (f"batch x heads = {B * H} (the kernels' second grid axis holds at most "
                f"{GRID_AXIS_MAX})")
    if Tq == 0:
        return "empty sequence"
    return None


def _per_head(x, B: int, H: int, what: str):
    """A float, or a tensor broadcastable to (B, H, T, D) that is constant over T and D, as a
    (B, H) fp32 tensor (differentiable); ``None`` when it varies over T or D."""
    if not torch.is_tensor(x):
        return None, float(x)
    t = x
    while t.dim() < 4:
        t = t[None]
    if t.dim() != 4 or t.shape[2] != 1 or t.shape[3] != 1:
        return None, None
    return t.float().expand(B, H, 1, 1).reshape(B, H), None


def fused_hybrid(q, k, v, fq, fk, *, window: int, mode: str, g, shared_norm: bool, overlap: bool,
                 rescale: bool, la_span: str, swa_drop, key_padding_mask, scale: float,
                 eps: float, config: KernelConfig | None = None,
                 maps=None) -> torch.Tensor | None:
    """``ops.hybrid.hybrid_attention`` for the modes the kernels cover (same arguments, checked
    by the caller), or ``None`` (reason logged once) for the caller's piece-by-piece path.
    ``maps`` ((phi_q, phi_k) modules) with fq and fk ``None``: the maps folded into the
    kernel's Function (``fold_maps``); ``None`` also where they cannot be (logged once): the
    caller then runs the maps itself and calls again with fq and fk. A call that runs no LA
    (``swa_only`` without SSD) takes neither features nor maps (``_no_features``); a g per
    position or channel (an output gate) takes a kernel call per branch (``_gated``)."""

    def no(reason: str):
        warn_once(__name__, f"fused Triton hybrid not used: {reason}; running the "
                  "piece-by-piece path")
        return None

    if mode not in ("hybrid", "swa_only", "la_only"):
        return None  # sinks / softmax / none need no LA: the pieces are the right tool
    folded = None
    if mode == "swa_only" and swa_drop is None:  # (no LA: neither the features nor the maps)
        fq, fk = _no_features(q, k)
        maps = None
    if fq is None and fk is None and maps is not None:
        if not available() or not (q.is_cuda or interpret()):
            return None  # (the second call, with the maps' outputs, says why)
        folded, why = fold_maps(maps, q, k)
        if folded is None:
            warn_once(__name__, f"feature maps not folded into the fused hybrid's autograd "
                      f"Function: {why}; they run as their own modules (same values)")
            return None
    reason = unsupported_reason(q, k, v, fq, fk, key_padding_mask, maps=folded)
    if reason is not None:
        return no(reason)
    B, H, T, D = q.shape
    dev = q.device
    shift0 = 0 if overlap else window
    shift_la_only = 0 if la_span == "all" else shift0
    drop = None
    if swa_drop is not None:
        sd = swa_drop
        while sd.dim() < 4:
            sd = sd[None]
        if sd.shape[2] != 1 or sd.shape[3] != 1:
            return no(f"swa_drop of shape {tuple(swa_drop.shape)} (needs one value per (b, h))")
        drop = sd.bool().expand(B, H, 1, 1).reshape(B, H)
        if mode == "la_only":
            drop = None  # la_only ignores it (as the reference does)
    f32 = torch.float32
    zeros = _filled((B, H), 0.0, f32, dev)
    if shared_norm:
        if mode != "hybrid" or drop is not None:
            return no(f"shared_norm in mode {mode!r}" + (" with swa_drop" if drop is not None
                                                           else ""))
        s_t, s_f = _per_head(g, B, H, "shared-norm factor")
        if s_t is None and s_f is None:
            return no("a shared-norm factor that varies over positions or channels")
        s = s_t if s_t is not None else _filled((B, H), s_f, f32, dev)
        logs = torch.log(s.clamp_min(1e-30))
        shift = _filled((B, H), shift0, torch.int32, dev)
        out = _launch(q, k, v, fq, fk, zeros, zeros, logs, shift, window, scale, eps,
                      key_padding_mask, True, True, True, config, folded)
        return out
    g_t, g_f = _per_head(g, B, H, "g")
    if g_t is None and g_f is None:  # an output gate: each branch its own call, mixed here
        try:
            fits = torch.broadcast_shapes(g.shape, q.shape) == q.shape
        except RuntimeError:
            fits = False
        if not fits:
            return no(f"a mixer g of shape {tuple(g.shape)} (not broadcastable to q's "
                      f"{tuple(q.shape)})")
        return _gated(q, k, v, fq, fk, g, mode=mode, rescale=rescale, drop=drop,
                      shift0=shift0, shift_la_only=shift_la_only, window=window, scale=scale,
                      eps=eps, kpm=key_padding_mask, config=config, maps=folded)
    gg = g_t if g_t is not None else _filled((B, H), g_f, f32, dev)
    one = _filled((B, H), 1.0, f32, dev)
    if mode == "hybrid":
        cb = 1 - gg if g_t is not None else _filled((B, H), 1.0 - g_f, f32, dev)
        ca, shift = gg, _filled((B, H), shift0, torch.int32, dev)
        has_swa = has_la = True
    elif mode == "swa_only":
        ca, cb = (one if rescale else gg), zeros
        shift = _filled((B, H), shift0, torch.int32, dev)
        has_swa, has_la = True, False
    else:  # la_only
        ca, cb = zeros, (one if rescale else 1 - gg)
        shift = _filled((B, H), shift_la_only, torch.int32, dev)
        has_swa, has_la = False, True
    if drop is not None:  # SSD: a dropped (b, h) is la_only with the same switches
        w_la_only = one if rescale else 1 - gg
        ca = torch.where(drop, zeros, ca)
        cb = torch.where(drop, w_la_only, cb)
        shift = torch.where(drop, torch.full_like(shift, shift_la_only), shift)
        has_swa = has_la = True
    return _launch(q, k, v, fq, fk, ca, cb, zeros, shift, window, scale, eps, key_padding_mask,
                   has_swa, has_la, False, config, folded)


def _no_features(q, k):
    """Stand-ins for fq and fk in a call that runs no LA (``has_la=False``: the kernels read
    neither): (B, H, T, D) and (B, Hkv, T, D) views of one cached row, nothing allocated, no
    feature map run (the LA's F does not enter such a call's tiles: ``default_config``)."""
    (B, H, T, D), Hkv = q.shape, k.shape[1]
    row = _filled((1, 1, 1, D), 0.0, q.dtype, q.device)
    return row.expand(B, H, T, D), row.expand(B, Hkv, T, D)


#: ``_gated``'s branch calls at weight 1 (the SWA call without SSD, the LA call of ``hybrid``
#: and ``la_only``) save their output as their branch (``hybrid_kernel``'s
#: ``output_is_branch``): each branch is held once, by the gate's mix (its lerp saves both),
#: instead of also as the kernel's own saved copy (~1 GiB less at 1 x 64k on the 8B's heads,
#: where the gated call peaked 1.5 GiB above the fixed mixer's, session 21), and the forward
#: stores neither. A switch for the A/B (bit for bit either way)
GATED_OUTPUT_IS_BRANCH = True


def _gated(q, k, v, fq, fk, g, *, mode, rescale, drop, shift0, shift_la_only, window, scale,
           eps, kpm, config, maps):
    """``fused_hybrid`` for a g that varies over positions or channels (an output-gate mixer:
    ``w_swa = g``, ``w_la = 1 - g`` per element, which the kernels' per-head weights cannot
    carry): ``w_swa * SWA + w_la * LA`` with each branch from its own kernel call at weight 1
    (SWA: ``has_la=False``, no features; LA: ``has_swa=False``, the maps folded into it where
    they are), mixed here in PyTorch, which also gives g's gradient. SSD (``drop``, per (b, h)):
    a dropped head's SWA call weight is 0 and its LA call sees ``la_only``'s keys
    (``shift_la_only``), weighted as ``la_only`` weighs them. ``None`` where a kernel call
    declines (the caller's pieces then compute the whole call)."""
    B, H = q.shape[:2]
    f32, dev = torch.float32, q.device
    zeros, one = _filled((B, H), 0.0, f32, dev), _filled((B, H), 1.0, f32, dev)
    swa = la = None
    if mode in ("hybrid", "swa_only"):
        ca = one if drop is None else torch.where(drop, zeros, one)
        swa = _launch(q, k, v, *_no_features(q, k), ca, zeros, zeros,
                      _filled((B, H), shift0, torch.int32, dev), window, scale, eps, kpm,
                      True, False, False, config,
                      output_is_branch=GATED_OUTPUT_IS_BRANCH and drop is None)
        if swa is None:
            return None
    if mode != "swa_only" or drop is not None:
        if mode == "la_only":
            cb, shift = one, _filled((B, H), shift_la_only, torch.int32, dev)
        else:  # (a kept head's LA in the hybrid, none in swa_only; a dropped head's la_only)
            cb = one if mode == "hybrid" else torch.where(drop, one, zeros)
            shift = _filled((B, H), shift0, torch.int32, dev)
            if drop is not None:
                shift = torch.where(drop, torch.full_like(shift, shift_la_only), shift)
        la = _launch(q, k, v, fq, fk, zeros, cb, zeros, shift, window, scale, eps, kpm,
                     False, True, False, config, maps,
                     output_is_branch=GATED_OUTPUT_IS_BRANCH and mode != "swa_only")
        # (cb is 1 for every head in hybrid and la_only; in swa_only only a dropped head's)
        if la is None:
            return None
    CALLS["gated"] += 1
    # (one op where it can be: each rounds once. A dropped head's SWA and a kept head's LA in
    # swa_only are 0, so the same formulas hold for every head)
    if mode == "la_only":
        return la if rescale else la * (1 - g)
    if la is None:  # swa_only, no drops
        return swa if rescale else swa * g
    if rescale and mode == "swa_only":
        return swa + la
    if rescale and drop is not None:  # (a dropped head's LA at weight 1, as la_only's rescale)
        g = torch.where(drop[:, :, None, None], 0.0, g)
    # w_swa SWA + w_la LA = LA + g (SWA - LA); a g in another dtype than the branches' (an fp32
    # g on a bf16 call) mixes in fp32, SWA - LA not rounded first
    if g.dtype == la.dtype:
        return torch.lerp(la, swa, g)
    return torch.lerp(la.float(), swa.float(), g.float())


def _launch(q, k, v, fq, fk, ca, cb, logs, shift, window, scale, eps, kpm, has_swa, has_la,
            shared, config, maps=None, output_is_branch=False):
    try:
        out = hybrid_kernel(q, k, v, fq, fk, ca, cb, logs, shift, window=window, scale=scale,
                            eps=eps, key_padding_mask=kpm, has_swa=has_swa, has_la=has_la,
                            shared=shared, config=config, maps=maps,
                            output_is_branch=output_is_branch)
        CALLS["forward"] += 1
        return out
    except errors() as e:  # never a crash inside Triton: the caller's path instead
        record_fallback(FALLBACK_ERRORS, __name__, "hybrid forward", e,
                        "running the piece-by-piece path", phase="forward")
        return None
