"""The fused feature map's autograd Functions (``kernels``' forward and backward), and the
``DuSlot`` through which the hybrid kernel's backward hands a map's backward its du."""

from __future__ import annotations

import weakref

import torch

from .kernels import du_heads_first, empty_du, map_backward, map_forward

__all__ = ["DU_SLOT_ATTR", "DuSlot", "MapFn", "MapWithInputFn"]

#: the attribute of a map's output (``dispatch.hedgehog_features(kernel_du=True)``) holding
#: its ``DuSlot``: the hybrid kernel looks for it on its fq
DU_SLOT_ATTR = "_hedgecats_du_slot"


_ZEROS: dict = {}


def _zero(device, dtype) -> torch.Tensor:
    """A zero scalar per (device, dtype), made once (the marker's storage: never written;
    autograd does not accumulate in place into an expanded tensor)."""
    key = (device, dtype)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros((), device=device, dtype=dtype)
    return _ZEROS[key]


class DuSlot:
    """Where the hybrid kernel's backward leaves this map's du (``kernel_du``), so that the
    map's backward starts from du instead of from dphi: the kernel holds dphi_q in fp32 at
    the end of its dfq pass and turns it into du there (the activations it needs are phi
    itself, which the kernel reads anyway), and the (B, H, T, F) dphi_q is neither written nor
    read again.

    Protocol (each side checks the other, so that a consumer that does not know it changes
    nothing but speed):
    - the map's forward attaches the slot to its output y (attribute ``DU_SLOT_ATTR``);
    - the hybrid kernel, given exactly that tensor as fq, computes du (``new_du``: laid out
      as the map's backward wants it), stores it with ``put`` and returns as fq's gradient
      ``marker``, zeros that take no memory (expanded);
    - the map's backward ``take``s du: where its dy is the marker itself (the kernel was y's
      only consumer), it starts from du; where dy is anything else (y had other consumers:
      autograd summed their gradients with the marker's zeros), it adds du to the du of dy
      (du is linear in dy), so every consumer's gradient counts.
    A caller asking autograd for y's gradient directly (``torch.autograd.grad(..., inputs=y)``)
    would get the marker: ask through ``retain_grad`` or a hook, or leave ``kernel_du`` off.
    Any op between y and the kernel (a floor's clamp, a cast, a view) makes another tensor,
    without the attribute: the kernel then returns dfq as usual; so does every kernel but the
    first given y itself (``claim``), and the kernel whose y someone watches (``retain_grad``
    or a hook on y: ``observed``), so that what they see is y's gradient, not the marker."""

    __slots__ = ("shape", "heads_first", "device", "dtype", "softmax", "du", "marker",
                 "claimed", "owner")

    def __init__(self, x: torch.Tensor, FH: int, softmax: bool = True):
        B, H, T, _ = x.shape
        self.shape, self.device, self.dtype = (B, H, T, FH), x.device, x.dtype
        self.heads_first = du_heads_first(x)  # (du's layout for this x: ``kernels.new_du``)
        self.softmax = softmax
        self.du = self.marker = None
        self.claimed = False  # (by the first kernel given y: ``claim``)
        self.owner = None  # (a weak reference to y: ``watch``)

    def watch(self, y: torch.Tensor) -> None:
        """Attach the slot to y (the map's output)."""
        setattr(y, DU_SLOT_ATTR, self)
        self.owner = weakref.ref(y)

    def observed(self) -> bool:
        """Whether someone asked to see y's gradient itself (``retain_grad``, a hook): then
        the kernel must hand back dphi, not the marker (the kernel's backward asks, just
        before it would write du)."""
        y = self.owner() if self.owner is not None else None
        return y is not None and (y.retains_grad or bool(getattr(y, "_backward_hooks", None)))

    def claim(self) -> bool:
        """Whether the calling kernel may hand du back: the first kernel given y only (a
        second one's backward would overwrite the first's du; it returns dfq as usual, which
        reaches the map's backward summed with the marker and is added there)."""
        first, self.claimed = not self.claimed, True
        return first

    def new_du(self) -> torch.Tensor:
        """An empty du (B, H, T, F/2) in the layout the map's backward reads
        (``kernels.new_du``)."""
        return empty_du(self.shape, self.heads_first, self.device, self.dtype)

    def clear(self) -> None:
        self.du = self.marker = None

    def put(self, du: torch.Tensor, fq: torch.Tensor) -> torch.Tensor:
        """Leave du for the map's backward; returns the marker to hand autograd as fq's
        gradient."""
        self.du = du
        self.marker = _zero(fq.device, fq.dtype).expand(fq.shape)
        return self.marker

    def take(self, dy: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """(du or None, whether dy is only the marker); empties the slot."""
        du, marker, self.du, self.marker = self.du, self.marker, None, None
        if du is None:
            return None, False
        only = (marker is not None and dy.shape == marker.shape
                and dy.data_ptr() == marker.data_ptr() and not any(dy.stride()))
        return du, only


def _backward(ctx, dy, dx_in):
    """(dx, dW, db) for ``MapFn`` / ``MapWithInputFn``; ``dx_in``: x's gradient from its
    other consumer (None: none), added in the kernel. du from the hybrid kernel where it
    left one in the map's ``DuSlot``."""
    x, wc, bc, y = ctx.saved_tensors
    softmax, w_dtype, b_dtype, slot = ctx.meta
    du, only_kernel = slot.take(dy) if slot is not None else (None, False)
    return map_backward(x, wc, bc, y, dy, dx_in, softmax=softmax, dtypes=(w_dtype, b_dtype),
                        du=du, du_only=only_kernel, need=ctx.needs_input_grad[:3])


class MapFn(torch.autograd.Function):
    """phi(x) through the kernels; y saved for the backward (its consumer, the LA kernel,
    keeps it anyway)."""

    @staticmethod
    def forward(ctx, x, w, bias, softmax, slot):
        y, wc, bc = map_forward(x, w, bias, softmax)
        ctx.save_for_backward(x, wc, bc, y)
        ctx.meta = (softmax, w.dtype, bias.dtype, slot)
        return y

    @staticmethod
    def backward(ctx, dy):
        return (*_backward(ctx, dy, None), None, None)


class MapWithInputFn(torch.autograd.Function):
    """(phi(x), x): x handed on through the map, so that its other consumer's gradient (the
    attention kernel's dq or dk) comes back here and is added to the map's in the kernel,
    instead of autograd summing the two in a separate pass over x's gradient."""

    @staticmethod
    def forward(ctx, x, w, bias, softmax, slot):
        y, wc, bc = map_forward(x, w, bias, softmax)
        ctx.save_for_backward(x, wc, bc, y)
        ctx.meta = (softmax, w.dtype, bias.dtype, slot)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dx_in):
        return (*_backward(ctx, dy, dx_in), None, None)
