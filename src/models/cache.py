"""Constant-memory KV cache for converted models (issue 13): a transformers ``Cache``.

A converted layer needs of the past only what its branches read:

    SWA          the last ``w`` keys and values (the window), kept in a ring buffer: the key at
                 position ``p`` sits in slot ``p % w``; RoPE is applied before caching, so a
                 softmax over the window is a function of the set of keys, not of their order
    LA           S = sum_i phi_k(k_i) v_i^T, z = sum_i phi_k(k_i), vsum = sum_i v_i (the kernel
                 floor's term) and the number of real keys, per KV head, in fp32, over every key
                 older than the window: a key enters the
                 state as it leaves the window (what the non-overlapping design needs; with
                 ``overlap=True`` or ``la_span="all"`` LA also reads the window's keys)
    sinks_only   the first ``n_sinks`` real keys of each sequence (behind left padding they
                 start later)

so its memory is ``B * Hkv * (2 w D + F D + F + D + 2 (n_sinks + 1) D)`` numbers whatever the
context length. Every mode but ``softmax`` runs from it, and the cache keeps all three parts up
to date in every mode, so the mode may change between calls. ``softmax`` reads every key: a
``HybridCache`` refuses it (generation then uses transformers' full ``DynamicCache``, and says
so). Layers left unconverted (``HybridConfig.layers``) are softmax layers: their slot in the
cache is a full ``DynamicLayer``, whose memory does grow.

How the pieces meet. A converted ``self_attn`` has a forward pre-hook (``convert_to_hybrid``)
that binds the layer's cache slot to the module when the call carries a ``HybridCache``; the
slot's ``update`` then hands the new keys through unchanged, and the ``"hedgecats"`` attention
function calls ``cached_attention``, which computes the layer's output from the slot and the new
tokens and then moves the slot forward. Three paths, one set of formulas (``ops.hybrid``'s
modes and mixing, ``ops.reference``'s kernels, fed the cached state through ``_CacheOps``):

    prefill   (empty cache, T tokens)   the ordinary forward of the T tokens (the chunked GPU
                                        kernels where they run), then the state: one sum over the
                                        keys that left the window, the window, the sinks
    chunk     (T > 1 tokens after some) window keys in order ++ the new keys, LA with the state
                                        as its start (``linear_attention_chunked(state=...)``)
    step      (1 token after some)      the key leaving the window enters the state, the new key
                                        takes its slot, then SWA over the ring and LA from the
                                        state: fixed shapes, no host synchronisation, in place, so
                                        a decode step can be captured in a CUDA graph
                                        (``models.decode``). On CUDA it runs as two Triton kernels
                                        (``ops.triton_decode``; ``_step`` composed of the pieces
                                        is its reference and the path for the calls they do not
                                        cover, e.g. ``overlap``)

Token-by-token decoding and one prefill end in the same state up to fp32 summation order, and
cached logits equal a full forward of the whole sequence (tests/test_cache.py).
"""

from __future__ import annotations

import inspect
import logging
import weakref

import torch
from torch import nn
from transformers import LlamaModel
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from .masks import key_padding_mask
from .ops.hybrid import backends
from .ops.hybrid import reference as ref
from .ops.hybrid.attention import hybrid_attention
from .structure import decoder_layers, unwrap

log = logging.getLogger(__name__)

__all__ = ["CACHE_KWARG", "HybridCache", "HybridLayerCache", "cached_attention",
           "generated_cache", "layer_state_bytes", "unsupported_reason"]

#: the keyword under which a cache reaches a transformers model (renamed in transformers 5.24)
CACHE_KWARG = ("cache" if "cache" in inspect.signature(LlamaModel.forward).parameters
               else "past_key_values")


def unsupported_reason(attn: nn.Module) -> str | None:
    """Why a converted ``self_attn`` cannot run from a ``HybridCache``, or ``None``: a terraced
    window (its keys leave the window a block at a time, and ``terraced_end`` moves its blocks
    with the sequence's length), or key feature maps per query head under GQA (the state is
    kept per key/value head). Such models generate with transformers' full cache."""
    rt = attn.hedgecats
    if getattr(rt, "window_shape", "sliding") != "sliding":
        return f"its {rt.window_shape!r} window"
    kv_heads = getattr(attn.phi_k, "input_heads", attn.phi_k.num_heads)
    if attn.phi_k.num_heads != kv_heads:
        return (f"its key feature maps per query head ({attn.phi_k.num_heads} maps, "
                f"{kv_heads} key/value heads)")
    return None


def layer_state_bytes(batch: int, kv_heads: int, head_dim: int, feature_dim: int, window: int,
                      n_sinks: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one converted layer's cache holds for ``batch`` sequences, at any context length."""
    el = torch.empty((), dtype=dtype).element_size()
    kv = 2 * window * head_dim * el + 2 * (n_sinks + 1) * head_dim * el  # ring + sinks (+1 spare)
    state = (feature_dim * head_dim + feature_dim + head_dim) * 4  # S, z and vsum in fp32
    flags = window + (n_sinks + 1) + 2 * 8  # real flags; two counters per sequence
    return batch * (kv_heads * (kv + state) + flags) + 8  # + the position counter


class HybridLayerCache(CacheLayerMixin):
    """One converted layer's constant-size cache (see the module docstring).

    Tensors (created at the first call, on the keys' device; ``B`` batch, ``Hkv`` KV heads):
        keys, values   (B, Hkv, w, D)        ring buffer of the window, keys' dtype
        real           (B, w) bool           slot holds a real (unpadded) key of the window
        S              (B, Hkv, F, D) fp32   LA state over every key older than the window
        z              (B, Hkv, F) fp32
        vsum           (B, Hkv, D) fp32      sum of those keys' values (the LA kernel floor's
                                             numerator term, ``ops.reference.LA_EPS``)
        n_state        (B,) long             real keys in S, z, vsum
        sink_keys/_values (B, Hkv, n_sinks + 1, D)  the first n_sinks real keys; the last slot
                                             is scratch for the keys that are not sinks
        sink_real      (B, n_sinks + 1) bool
        n_real         (B,) long             real keys seen
        pos            () long               tokens seen (padding included), on the device
    ``seen`` is the same count on the host (masks and position ids are built from it).
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False  # transformers builds one mask for all layers; ours covers every key

    def __init__(self, layer_idx: int, window: int, n_sinks: int, feature_dim: int,
                 owner: nn.Module) -> None:
        super().__init__()
        self.layer_idx, self.window, self.n_sinks, self.feature_dim = (
            layer_idx, window, n_sinks, feature_dim)
        self._owner = weakref.ref(owner)
        self.seen = 0
        self.bound = False

    def __repr__(self) -> str:
        return (f"HybridLayerCache(layer={self.layer_idx}, window={self.window}, "
                f"n_sinks={self.n_sinks}, seen={self.seen})")

    # ------------------------------------------------------------------ transformers' layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, Hkv, _, D = key_states.shape
        Dv = value_states.shape[-1]
        dev, dt, w, ns, F = (key_states.device, key_states.dtype, self.window, self.n_sinks,
                             self.feature_dim)
        self.keys = torch.zeros(B, Hkv, w, D, dtype=dt, device=dev)
        self.values = torch.zeros(B, Hkv, w, Dv, dtype=value_states.dtype, device=dev)
        self.real = torch.zeros(B, w, dtype=torch.bool, device=dev)
        self.S = torch.zeros(B, Hkv, F, Dv, dtype=torch.float32, device=dev)
        self.z = torch.zeros(B, Hkv, F, dtype=torch.float32, device=dev)
        self.vsum = torch.zeros(B, Hkv, Dv, dtype=torch.float32, device=dev)
        self.n_state = torch.zeros(B, dtype=torch.long, device=dev)
        self.sink_keys = torch.zeros(B, Hkv, ns + 1, D, dtype=dt, device=dev)
        self.sink_values = torch.zeros(B, Hkv, ns + 1, Dv, dtype=value_states.dtype, device=dev)
        self.sink_real = torch.zeros(B, ns + 1, dtype=torch.bool, device=dev)
        self.n_real = torch.zeros(B, dtype=torch.long, device=dev)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.device = dev
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hands the new keys to the attention function unchanged: ``cached_attention`` reads
        and advances this slot. Refuses a layer that the cache was not bound to."""
        if not self.bound:
            raise RuntimeError(
                f"HybridCache layer {self.layer_idx} was updated by a layer that is not the "
                f"hedgecats hybrid layer it was made for: a HybridCache was handed to another "
                f"model (make one per model: HybridCache(model))")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        want = (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3])
        got = (key_states.shape[0], key_states.shape[1], key_states.shape[3])
        if want != got:
            raise ValueError(f"HybridCache layer {self.layer_idx} holds (batch, kv heads, head "
                             f"dim) = {want}, the call brings {got}: a cache serves one batch "
                             f"of sequences of one model (reset() it or make a new one)")
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # the same sizes as a full layer: the mask covers every position, the attention
        # function reads the columns of the new keys (the last ``query_length``)
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # constant and small: nothing to gain
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        for t in self._tensors():
            t.zero_()
        self.seen = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "a HybridCache cannot be cropped: keys that left the window are summed into the "
            "linear-attention state and cannot be taken out again (assisted / speculative "
            "decoding needs a croppable cache)")

    def _batch_tensors(self) -> list[str]:
        return ["keys", "values", "real", "S", "z", "vsum", "n_state", "sink_keys", "sink_values",
                "sink_real", "n_real"]

    def _tensors(self) -> list[torch.Tensor]:
        if not self.is_initialized:
            return []
        return [getattr(self, n) for n in self._batch_tensors()] + [self.pos]

    def _map_batch(self, fn) -> None:
        if self.is_initialized:
            for n in self._batch_tensors():
                setattr(self, n, fn(getattr(self, n)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    # ------------------------------------------------------------------ state updates
    def absorb(self, fk: torch.Tensor, v: torch.Tensor, real: torch.Tensor) -> None:
        """Add keys leaving the window to the LA state: fk (B, Hkv, n, F), v (B, Hkv, n, D),
        real (B, n) bool (padding adds nothing)."""
        keep = real[:, None, :, None].to(torch.float32)  # (B, 1, n, 1)
        fk = fk.float() * keep
        self.S += torch.einsum("bhnf,bhnd->bhfd", fk, v.float())
        self.z += fk.sum(dim=2)
        self.vsum += (v.float() * keep).sum(dim=2)
        self.n_state += real.sum(dim=1)

    def write_window(self, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor,
                     slots: torch.Tensor) -> None:
        """Put keys (B, Hkv, n, D) with flags (B, n) into ring slots (n,) long, in place."""
        self.keys.index_copy_(2, slots, k.to(self.keys.dtype))
        self.values.index_copy_(2, slots, v.to(self.values.dtype))
        self.real.index_copy_(1, slots, real)

    def window_in_order(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cached window, oldest key first: keys, values (B, Hkv, L, D), real (B, L), with
        ``L = min(seen, w)``."""
        L = min(self.seen, self.window)
        slots = torch.arange(self.seen - L, self.seen, device=self.keys.device) % self.window
        return (self.keys.index_select(2, slots), self.values.index_select(2, slots),
                self.real.index_select(1, slots))

    def new_sinks(self, real: torch.Tensor, n_sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For new keys with flags real (B, T): which of them are among the first ``n_sinks``
        real keys of their sequence (B, T) bool, and the store slot of each (B, T) long (the
        scratch slot ``self.n_sinks`` for the others)."""
        rank = self.n_real[:, None] + real.long().cumsum(dim=1)  # 1-based rank among real keys
        is_sink = real & (rank <= n_sinks)
        slot = torch.where(is_sink, rank - 1, torch.full_like(rank, self.n_sinks))
        return is_sink, slot

    def store_sinks(self, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor) -> None:
        """Keep the new keys (B, Hkv, T, D) that are among the first n_sinks real ones."""
        is_sink, slot = self.new_sinks(real, self.n_sinks)
        idx = slot[:, None, :, None]
        self.sink_keys.scatter_(2, idx.expand(*k.shape[:3], self.sink_keys.shape[-1]),
                                k.to(self.sink_keys.dtype))
        self.sink_values.scatter_(2, idx.expand(*v.shape[:3], self.sink_values.shape[-1]),
                                  v.to(self.sink_values.dtype))
        self.sink_real.scatter_(1, slot, is_sink)
        self.sink_real[:, self.n_sinks] = False  # the scratch slot never holds a sink
        self.n_real += real.sum(dim=1)


class HybridCache(Cache):
    """The constant-memory cache of a converted model: a ``HybridLayerCache`` per converted
    layer, a full ``DynamicLayer`` per layer left as softmax.

    Made for one model (``HybridCache(model)``; a peft model is unwrapped) from its layers'
    current windows and ``n_sinks``; it refuses another model, a layer whose window changed, a
    larger ``n_sinks`` and the ``softmax`` mode, each with an error that says so. Pass it to
    ``model(...)`` / ``model.generate(...)`` as ``past_key_values`` (transformers >= 5.24 also
    accepts ``cache``); ``generate`` makes one by default for converted models.
    """

    def __init__(self, model: nn.Module) -> None:
        inner = unwrap(model)
        layers = []
        self.full_layers = []
        for i, layer in enumerate(decoder_layers(inner)):
            attn = layer.self_attn
            rt = getattr(attn, "hedgecats", None)
            if rt is None:
                layers.append(DynamicLayer())
                self.full_layers.append(i)
            else:
                why = unsupported_reason(attn)
                if why is not None:
                    raise ValueError(f"layer {i} cannot use a HybridCache because of {why}: "
                                     f"generate with transformers' DynamicCache (model.generate "
                                     f"does so by itself for such models)")
                layers.append(HybridLayerCache(i, rt.window, rt.n_sinks, attn.phi_k.feature_dim,
                                               attn))
        if len(self.full_layers) == len(layers):
            raise ValueError("the model has no converted layer: a HybridCache is for models made "
                             "with convert_to_hybrid (use transformers' DynamicCache otherwise)")
        if self.full_layers:
            log.info("HybridCache: layers %s are softmax layers and keep every key (their memory "
                     "grows with the context)", self.full_layers)
        super().__init__(layers=layers)

    def bind(self, layer_idx: int, module: nn.Module) -> HybridLayerCache:
        """Check that ``module`` (a converted ``self_attn``) may use slot ``layer_idx``, mark the
        slot for its next ``update``, and return it. Called by the layer's forward pre-hook."""
        slot = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if not isinstance(slot, HybridLayerCache) or slot._owner() is not module:
            raise ValueError(
                f"this HybridCache was not made for this model (layer {layer_idx} is not the "
                f"layer it was made for): make one per model with HybridCache(model)")
        rt = module.hedgecats
        impl = getattr(module.config, "_attn_implementation", None)
        if impl != "hedgecats":
            raise ValueError(f"layer {layer_idx} runs attention implementation {impl!r}; a "
                             f"HybridCache needs the 'hedgecats' one that convert_to_hybrid sets")
        if rt.mode == "softmax":
            raise ValueError(
                f"layer {layer_idx} is in mode 'softmax', which reads every earlier key; a "
                f"HybridCache keeps only the last {slot.window} and the linear-attention state. "
                f"Generate with transformers' DynamicCache (model.generate does so by itself in "
                f"softmax mode) or choose another mode")
        if rt.window != slot.window:
            raise ValueError(f"layer {layer_idx} now runs window {rt.window}, this HybridCache "
                             f"was made for window {slot.window}: make a new HybridCache(model) "
                             f"after changing windows")
        if rt.n_sinks > slot.n_sinks:
            raise ValueError(f"layer {layer_idx} now keeps n_sinks={rt.n_sinks}, this "
                             f"HybridCache stores {slot.n_sinks}: make a new HybridCache(model)")
        if rt.observer is not None:
            raise ValueError(f"layer {layer_idx} has an observer (attention transfer, branch "
                             f"usage), which reads whole sequences: run it without a HybridCache")
        slot.bound = True
        return slot

    def state_bytes(self) -> int:
        """Bytes held now, every layer (a full layer's grows with the context)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, HybridLayerCache):
                total += sum(t.numel() * t.element_size() for t in layer._tensors())
            elif getattr(layer, "is_initialized", False) and layer.keys is not None:
                total += layer.keys.numel() * layer.keys.element_size() * 2
        return total


def generated_cache(output):
    """The cache a ``generate(..., return_dict_in_generate=True)`` output holds: ``cache`` from
    transformers 5.24, ``past_key_values`` before (reading the old name on 5.24 warns)."""
    cache = output.get("cache")
    return output.get("past_key_values") if cache is None else cache


# ----------------------------------------------------------------------------- the computation
class _CacheOps:
    """``backends.Ops``' four pieces for a call that continues a cached sequence: LA starts from
    the cached state, ``sinks_only`` reads the stored sinks ++ the new keys; SWA is the base
    backend's (which takes the blocked PyTorch path whenever queries are fewer than keys)."""

    def __init__(self, base, layer: HybridLayerCache, k_new, v_new, real_new):
        self.base, self.layer, self.name = base, layer, f"cache+{base.name}"
        self.k_new, self.v_new, self.real_new = k_new, v_new, real_new

    def swa(self, q, k, v, *, scale, window, need_lse, key_padding_mask):
        return self.base.swa(q, k, v, scale=scale, window=window, need_lse=need_lse,
                             key_padding_mask=key_padding_mask)

    def linear(self, fq, fk, v, *, shift, eps, need_den, key_padding_mask):
        c = self.layer
        return ref.linear_attention_chunked(fq, fk, v, shift=shift, eps=eps,
                                            key_padding_mask=key_padding_mask,
                                            state=(c.S, c.z, c.n_state, c.vsum))

    def sinks(self, q, k, v, *, scale, n_sinks, key_padding_mask):
        """Softmax over the stored sinks and the new keys that are sinks, causal among the new
        ones: the stored keys come first (all older), the new keys after, in order."""
        c = self.layer
        is_sink, _ = c.new_sinks(self.real_new, n_sinks)  # (B, T)
        keys = torch.cat([c.sink_keys[:, :, :n_sinks], self.k_new.to(c.sink_keys.dtype)], dim=2)
        vals = torch.cat([c.sink_values[:, :, :n_sinks], self.v_new.to(c.sink_values.dtype)], 2)
        mask = torch.cat([c.sink_real[:, :n_sinks], is_sink], dim=1)
        T = self.k_new.shape[2]
        limit = None
        if T > 1:  # read the new keys only up to the last one that is a sink (host sync)
            cols = is_sink.any(0).nonzero()
            limit = n_sinks + (int(cols.max()) + 1 if len(cols) else 0)
        return ref.softmax_attention_blocked(q, keys, vals, scale=scale, n_sinks=limit,
                                             key_padding_mask=mask)

    def softmax(self, q, k, v, *, scale, key_padding_mask):
        raise RuntimeError("mode 'softmax' reads every key; a HybridCache does not keep them")


def _new_key_flags(attention_mask: torch.Tensor | None, B: int, T: int,
                   device) -> torch.Tensor:
    """(B, T) bool: which new keys are real. transformers' 4D mask covers every position (see
    ``HybridLayerCache.get_mask_sizes``); the new keys are its last T columns, and a real key
    is visible at least to itself. No host synchronisation."""
    if attention_mask is None or attention_mask.dim() != 4:
        return torch.ones(B, T, dtype=torch.bool, device=device)
    m = attention_mask[..., -T:]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    return m.any(dim=-2)[:, 0]


def cached_attention(layer: HybridLayerCache, module: nn.Module, query: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor, attention_mask, g, scale,
                     swa_drop: torch.Tensor | None = None) -> torch.Tensor:
    """One converted layer's attention for T new tokens continuing the cached sequence, and the
    cache moved past them.

    Args:
        layer: the layer's bound ``HybridLayerCache``.
        module: the converted ``self_attn`` (``phi_q``, ``phi_k``, ``mixer``, ``hedgecats``).
        query: (B, H, T, D), key / value: (B, Hkv, T, D) of the new tokens, RoPE applied.
        attention_mask: transformers' mask (4D over every position) or None.
        g: the mixer's output for the new tokens.  scale: score scale.
        swa_drop: the SSD mask, as ``hybrid_attention`` takes it (training only).

    Returns:
        (B, H, T, D) in query's dtype, as ``ops.hybrid.hybrid_attention`` would give for these
        queries over the whole sequence.
    """
    rt = module.hedgecats
    layer.bound = False
    B, T = query.shape[0], query.shape[2]
    real = (_new_key_flags(attention_mask, B, T, query.device)  # (B, T)
            if T > 1 or layer.seen == 0 or attention_mask is not None else None)
    needs_la = rt.mode in ("hybrid", "swa_only", "la_only")
    common = dict(window=rt.window, mode=rt.mode, g=g, shared_norm=module.mixer.shared_norm,
                  overlap=rt.overlap, rescale=rt.rescale, la_span=rt.la_span,
                  n_sinks=rt.n_sinks, swa_drop=swa_drop, scale=scale, eps=rt.eps,
                  backend=rt.backend)
    if layer.seen == 0:  # prefill: the layer's call without a cache (the same output, bit for
        # bit: the maps go in as modules, as there), then the state
        kpm = key_padding_mask(attention_mask, T)  # (reduced once for every layer)
        out = hybrid_attention(query, key, value, None, None, maps=(module.phi_q, module.phi_k),
                               key_padding_mask=kpm, **common)
        _commit(layer, module, key, value, real, n_old=0, new=(key, value, real))
        return out
    fq = module.phi_q(query) if needs_la else None
    if T == 1:
        out = _fused_step(layer, module, query, key, value, real, fq, common)
        if out is None:
            out = _step(layer, module, query, key, value, real, fq, common)
    else:
        wk, wv, wreal = layer.window_in_order()
        k_loc, v_loc = torch.cat([wk, key.to(wk.dtype)], 2), torch.cat([wv, value.to(wv.dtype)], 2)
        r_loc = torch.cat([wreal, real], dim=1)
        fk = module.phi_k(k_loc) if needs_la else None
        ops = _CacheOps(backends.select(rt.backend, query, r_loc), layer, key, value, real)
        out = hybrid_attention(query, k_loc, v_loc, fq, fk, key_padding_mask=r_loc, ops=ops,
                               **common)
        _commit(layer, module, k_loc, v_loc, r_loc, n_old=wk.shape[2], new=(key, value, real))
    return out


def _commit(layer: HybridLayerCache, module, k_loc, v_loc, r_loc, *, n_old: int, new) -> None:
    """After a prefill or chunk over local keys (the ``n_old`` cached window keys, in order, then
    the new ones): keys that fall out of the window enter the state, the last ``w`` keys become
    the window, new sinks are stored, the counters advance."""
    L, w = k_loc.shape[2], layer.window
    n_out = max(0, L - w)
    if n_out:
        layer.absorb(module.phi_k(k_loc[:, :, :n_out]), v_loc[:, :, :n_out], r_loc[:, :n_out])
    first = layer.seen - n_old  # position of k_loc[:, :, 0]
    slots = torch.arange(first + n_out, first + L, device=k_loc.device) % w
    layer.write_window(k_loc[:, :, n_out:], v_loc[:, :, n_out:], r_loc[:, n_out:], slots)
    k_new, v_new, real = new
    layer.store_sinks(k_new, v_new, real)
    T = k_new.shape[2]
    layer.seen += T
    layer.pos += T


def _fused_step(layer: HybridLayerCache, module, query, key, value, real, fq,
                common) -> torch.Tensor | None:
    """``_step`` in two Triton kernels (``ops.triton_decode``) where they cover the call (Triton
    present, on CUDA or its interpreter) and ``HEDGECATS_TRITON`` is not ``0``, else ``None``
    (on CUDA the reason logged once). The key leaving the
    window gets its feature map here (the layer's own ``phi_k``, whatever its kind). ``real``:
    (B, 1) flags of the new keys, or ``None`` when the call has no mask (all real)."""
    if not backends.triton_switched_on() or not layer.is_initialized:
        return None
    from .ops.decode import dispatch as triton_decode

    rt = module.hedgecats
    g = common["g"]
    why = triton_decode.unsupported_reason(
        layer, query, key, fq, mode=rt.mode, shared_norm=common["shared_norm"],
        overlap=rt.overlap, la_span=rt.la_span, swa_drop=common["swa_drop"], g=g)
    if why is not None:
        if query.is_cuda:
            triton_decode.note_fallback(why)
        return None
    slot = (layer.pos % layer.window).reshape(1)
    fk_old = module.phi_k(layer.keys.index_select(2, slot))  # (B, Hkv, 1, F)
    scale = query.shape[-1] ** -0.5 if common["scale"] is None else common["scale"]
    out = triton_decode.decode_step(
        layer, query, key, value, fq, fk_old, None if real is None else real[:, 0],
        mode=rt.mode, g=g, shared_norm=bool(common["shared_norm"]), rescale=rt.rescale,
        scale=scale, eps=common["eps"])
    if out is not None:
        layer.seen += 1  # the device counters moved in the kernels
    return out


def _step(layer: HybridLayerCache, module, query, key, value, real, fq, common) -> torch.Tensor:
    """One new token (T = 1), in place and without host synchronisation: the key in slot
    ``pos % w`` (position ``pos - w``) leaves the window into the state, the new key takes the
    slot, the new token attends to the ring (SWA) and the state (LA). Queries read the ring as a
    set: with ``shift = w`` the reference LA sees none of the ring's keys, with ``shift = 0`` all
    of them, exactly the keys outside / inside the window of this query."""
    rt = module.hedgecats
    if real is None:
        real = torch.ones(query.shape[0], 1, dtype=torch.bool, device=query.device)
    slot = (layer.pos % layer.window).reshape(1)
    old_k, old_v = layer.keys.index_select(2, slot), layer.values.index_select(2, slot)
    layer.absorb(module.phi_k(old_k), old_v, layer.real.index_select(1, slot))
    layer.write_window(key, value, real, slot)
    ring_k, ring_v = layer.keys, layer.values
    fk = module.phi_k(ring_k) if fq is not None else None
    ops = _CacheOps(backends.select(rt.backend, query, layer.real), layer, key, value, real)
    out = hybrid_attention(query, ring_k, ring_v, fq, fk, key_padding_mask=layer.real, ops=ops,
                           **common)
    layer.store_sinks(key, value, real)
    layer.seen += 1
    layer.pos += 1
    return out
