"""The fused hybrid kernels' configuration: the tiles and options of a call
(``KernelConfig``), the defaults per head dim and dtype (``default_config``), the tiles derived
from a config, and the configs tried in turn where one does not compile here (``SAFE_CONFIG``,
``_with_retry``)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..triton_common import errors, warn_once

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

