"""Decode steps replayed from a CUDA graph: the per-token cost without Python and launch overhead.

Eager decoding of an 8B model is bound by kernel launches (reading 16 GB of weights once takes
~3.3 ms at 4.8 TB/s; issue 13 quotes 82 ms for an eager softmax step on an H200, an earlier
session's measurement), so a speed comparison made eagerly compares launch
overhead with launch overhead. ``GraphedDecoder`` captures one decode step -- the model's forward
of one token per sequence, cache update included -- once, and replays it:

    cache = HybridCache(model)                         # or transformers' StaticCache(config, L)
    model(prompt_ids, cache=cache)                     # prefill, eager (past_key_values= < 5.24)
    step = GraphedDecoder(model, cache)                # warm-up steps + capture
    logits = step(next_ids, positions)                 # (B, 1) each -> (B, 1, V), one replay

A step can be captured when its work has fixed shapes, updates the cache in place and never
reads a value back to the host: the ``HybridCache`` step path (``models.cache``: ring slot and
counters on the device) and transformers' ``StaticCache`` are such caches; a ``DynamicCache``
(grows by concatenation) or a partially converted model (its softmax layers keep growing
caches) is not, and is refused. Warm-up steps and the capture run the Python once: the
warm-up steps are real decode steps (they advance the cache), the capture is undone on the host.
No attention mask is passed (batches without padding), so none has to be rebuilt per step.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import StaticCache

from .cache import CACHE_KWARG, HybridCache, HybridLayerCache

__all__ = ["CACHE_KWARG", "GraphedDecoder"]


def _batch(cache) -> int:
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.dim() == 4:
            return keys.shape[0]
    raise ValueError("the cache is empty: prefill it (one eager forward) before capturing a "
                     "decode step")


class GraphedDecoder:
    """One decode step of ``model`` with ``cache`` (B sequences), captured in a CUDA graph.

    Args:
        model: a transformers causal LM on CUDA (a converted model, or any model with a
            ``StaticCache``), in eval mode.
        cache: a prefilled ``HybridCache`` whose every layer is converted, or a ``StaticCache``.
        warmup: eager steps before the capture: token 0 at the next position of every
            sequence; they advance the cache like any step.

    ``decoder(ids, positions)``: ids and positions (B, 1) long -> logits (B, 1, V), a view of
    the graph's output buffer (overwritten by the next call).
    """

    def __init__(self, model: nn.Module, cache, *, warmup: int = 2) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedDecoder captures CUDA graphs: it needs a CUDA device")
        if isinstance(cache, HybridCache):
            if cache.full_layers:
                raise ValueError(f"layers {cache.full_layers} are not converted: their full "
                                 f"caches grow every step, which a CUDA graph cannot replay")
            if any(layer.seen == 0 for layer in cache.layers):
                raise ValueError("the HybridCache is empty: prefill it first (the first call "
                                 "is a prefill, not a decode step)")
        elif not isinstance(cache, StaticCache):
            raise TypeError(f"{type(cache).__name__} cannot be replayed from a CUDA graph: use a "
                            f"HybridCache (converted models) or transformers' StaticCache")
        self.model, self.cache = model, cache
        device = next(model.parameters()).device
        B = _batch(cache)
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):  # cuBLAS handles, allocator, lazy state: outside the capture
                self.positions.fill_(int(cache.get_seq_length()))  # token 0 at the next position
                self._forward()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.logits = self._forward()
        # the capture ran the Python once (host counters moved) but no kernel: follow the device
        self._sync_host_counters()

    def _forward(self) -> torch.Tensor:
        return self.model(input_ids=self.ids, position_ids=self.positions,
                          **{CACHE_KWARG: self.cache}, use_cache=True).logits

    def _sync_host_counters(self) -> None:
        """A HybridCache's host count ``seen`` := its device counter ``pos`` (a StaticCache
        counts on the device only)."""
        if isinstance(self.cache, HybridCache):
            for layer in self.cache.layers:
                if isinstance(layer, HybridLayerCache):
                    layer.seen = int(layer.pos)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.graph.replay()
        if isinstance(self.cache, HybridCache):  # the device counters moved: follow on the host
            for layer in self.cache.layers:
                layer.seen += 1
        return self.logits
