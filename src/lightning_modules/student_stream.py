"""Stage 1's per-layer student work on a CUDA side stream, beside the teacher forward.

Stage 1 computes each layer's student (feature maps, hybrid or LA output, loss, backward) inside
the teacher's forward, from the layer's q, k, v. The student's kernels are latency-bound (a few
percent of the GPU's peak each, docs/performance.md) while the teacher's GEMMs are compute-bound,
and layer i's student needs nothing of layer i + 1's teacher: on a second stream the two can run
at once. ``StudentStream.layer(*inputs)`` is the context one layer's student runs in; ``join()``
makes the current stream wait for all of it (before the loss is read or the optimiser steps).

What it guarantees:
- the side stream starts each layer after everything the current stream has queued (the
  layer's inputs, the last optimiser step's parameter update);
- the inputs, allocated on the current stream, are not reused by it until the side stream is
  done with them (``record_stream``); parameters the student reads must not be freed under it
  either (``AttentionTransfer`` keeps them out of FSDP2's sharding when the option is on);
- the side stream is at most ``max_lag`` layers behind: the current stream's next work waits
  for the layer ``max_lag`` back, which bounds the inputs held for it;
- the same kernels run on the same inputs in the same order per layer, so the results should
  not depend on it: ``tests/test_stage1_overlap_gpu.py`` checks that bitwise on a GPU (passed
  on an H200, 2026-12-02, benchmarks/results/h200_2026-12-02c).

Off the GPU it runs the layers in order, as without it, and says so once.
"""

from __future__ import annotations

import collections
import contextlib
import logging

import torch

log = logging.getLogger(__name__)
_WARNED: set[str] = set()


class StudentStream:
    """A side stream for stage 1's student work (see the module docstring)."""

    def __init__(self, device: torch.device | str, max_lag: int = 4) -> None:
        if max_lag < 1:
            raise ValueError(f"max_lag={max_lag!r} must be >= 1 (layers the student may trail)")
        device = torch.device(device)
        self.max_lag = max_lag
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._done: collections.deque = collections.deque()
        #: layers whose launch made the current stream wait for a student max_lag back
        self.throttled = 0
        if self.stream is None and "cpu" not in _WARNED:
            _WARNED.add("cpu")
            log.warning("overlap_student needs a CUDA device (here: %s): the students run in "
                        "order on the one stream, with the same results", device)

    @contextlib.contextmanager
    def layer(self, *inputs: torch.Tensor | None):
        """The context of one layer's student work (forward and backward)."""
        if self.stream is None:
            yield
            return
        main = torch.cuda.current_stream(self.stream.device)
        if len(self._done) >= self.max_lag:
            main.wait_event(self._done.popleft())
            self.throttled += 1
        self.stream.wait_stream(main)
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield
        done = torch.cuda.Event()
        done.record(self.stream)
        self._done.append(done)

    def join(self) -> None:
        """The current stream waits for every student queued so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self._done.clear()
