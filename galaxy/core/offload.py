"""A layer's saved activations held on the host: what a transformer layer saves for backward is copied to
(pinned) host memory during its forward and brought back ahead of its backward.

``HostCopies`` is one layer call's store. Its ``pack`` / ``unpack`` are the layer's
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves inside the call (a compiled layer's
too: the hooks apply to the compiled autograd function's saved tensors) is copied to the host and the device
tensor dropped, unless it is a parameter or a view of one (frozen base weights, NF4 buffers), which the
layer holds anyway. On CUDA the copies run on a side stream, each after the compute stream has made its
tensor (the caching allocator is told the side stream reads it, so its memory is reused only after the copy);
the forward goes on meanwhile. A checkpointed region inside the layer (``recompute``) holds its inputs itself,
not through autograd: it hands them to the same store (``offloading``), so ``full`` recompute with offload
keeps only the layer's input, on the host, as unsloth's offloaded gradient checkpointing does.

Backward: each offloading layer's output passes ``_LayerEnd``, an identity whose backward runs as the layer's
backward starts; it brings this layer's tensors back (if they are not yet) and starts bringing back the previous
layer's, found through the layer's input, which the previous layer's ``_LayerEnd`` made, so the copy overlaps
this layer's backward. A layer that does not offload passes the link on, so prefetching skips it. A tensor
brought back is dropped from the store once every saved reference to it has been unpacked (an unpack after that,
``retain_graph``, brings it back again). On a CPU the host copy is a plain copy and bringing back another one:
the same code path, no streams.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn as nn

# The store of the layer call running now, for checkpointed regions inside it: torch's non-reentrant checkpoint
# holds a region's inputs in its closure, out of reach of autograd's saved-tensor hooks. Set only for the
# duration of one layer's forward (like autocast's state), never read by compiled code.
_CURRENT: contextvars.ContextVar[Optional["HostCopies"]] = contextvars.ContextVar("galaxy_host_copies", default=None)


def offloading() -> Optional["HostCopies"]:
    """The store of the offloading layer whose forward is running, if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def not_offloading():
    """Inside a checkpointed region no store: what the region saves is the checkpoint's (not kept in forward,
    rebuilt in backward), its own inner regions' inputs too, the same in its forward and its recompute."""
    token = _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


@dataclass
class OffloadTraffic:
    """What a store moved: bytes copied to the host, brought back (of them, before the layer's own backward
    started: prefetched), and per copy the (original, host) storage pointers and a weak reference to the
    original storage (tests check the packed tensors are the copies and the originals are freed)."""

    to_host_bytes: int = 0
    to_device_bytes: int = 0
    prefetched_bytes: int = 0
    copies: list = field(default_factory=list)


class _Range:
    """Bytes ``[lo, lo + nbytes)`` of a saved tensor's storage: their host copy, their device copy while brought
    back, and how many saved references into them have not been unpacked yet."""

    __slots__ = ("lo", "nbytes", "host", "device_copy", "ready", "pending")

    def __init__(self, lo: int, nbytes: int, host: torch.Tensor):
        self.lo, self.nbytes, self.host = lo, nbytes, host
        self.device_copy, self.ready, self.pending = None, None, 0


class _Saved(NamedTuple):
    """A packed tensor: its bytes' range and how it views them."""

    range: _Range
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements from the range's start


def _bytes_of(storage: torch.UntypedStorage, lo: int, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, lo, (nbytes,), (1,))


def _view(buffer: torch.Tensor, saved: _Saved) -> torch.Tensor:
    return torch.empty(0, dtype=saved.dtype, device=buffer.device).set_(buffer.untyped_storage(), saved.offset,
                                                                        saved.size, saved.stride)


class HostCopies:
    """One layer call's saved tensors on the host (see the module docstring). ``module``: the layer, whose
    parameters and buffers are never copied; ``previous``: the store of the layer before (prefetched when this
    one's backward starts); ``traffic``: counts what was moved.

    A storage is copied once for all its saved views (q, k, v and their transposes share one): the whole
    storage where the first view spans at least half of it, else that view's span (an MLP chunk's input,
    a slice of the whole input)."""

    def __init__(self, module: nn.Module, device: torch.device, previous: Optional["HostCopies"] = None,
                 traffic: Optional[OffloadTraffic] = None):
        self.module, self.device = module, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.previous = previous
        self.traffic = traffic
        self.stored: list[_Range] = []
        # the ranges copied so far by storage pointer, with a weak reference to the storage that tells a live
        # one from a later one at the same address
        self._by_storage: dict[int, tuple[weakref.ref, list[_Range]]] = {}
        self._weights: Optional[set[int]] = None
        self._stream = None
        self.started_backward = False

    @property
    def stream(self) -> "torch.cuda.Stream":
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _is_weight(self, t: torch.Tensor) -> bool:
        if self._weights is None:
            held = (*self.module.parameters(), *self.module.buffers())
            self._weights = {w.untyped_storage().data_ptr() for w in held}
        return isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in self._weights

    # -- saved-tensor hooks

    def pack(self, t: torch.Tensor):
        """Autograd's pack hook: the tensor itself where it stays (a weight, an empty tensor, one already off
        the device), else a handle to its host copy, started now."""
        if t.device != self.device or t.numel() == 0 or self._is_weight(t):
            return t
        storage, size = t.untyped_storage(), t.element_size()
        lo = t.storage_offset() * size
        hi = lo + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * size
        ref, ranges = self._by_storage.get(storage.data_ptr(), (None, []))
        if ref is None or ref() is not storage:
            ranges = []
            self._by_storage[storage.data_ptr()] = (weakref.ref(storage), ranges)
        held = next((r for r in ranges if r.lo <= lo and hi <= r.lo + r.nbytes and (lo - r.lo) % size == 0), None)
        if held is None:
            start, end = (0, storage.nbytes()) if 2 * (hi - lo) >= storage.nbytes() else (lo, hi)
            held = _Range(start, end - start, self._to_host(storage, start, end - start))
            ranges.append(held)
            self.stored.append(held)
        held.pending += 1
        return _Saved(held, t.dtype, tuple(t.shape), tuple(t.stride()), (lo - held.lo) // size)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        held = packed.range
        if held.device_copy is None:
            self._bring_back(held)
        t = _view(held.device_copy, packed)
        if held.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(held.ready)
            held.ready = None
        held.pending -= 1
        if held.pending <= 0:  # every saved reference has it: the store lets it go after this use
            held.device_copy = None
        return t

    # -- copies

    def _to_host(self, storage: torch.UntypedStorage, lo: int, nbytes: int) -> torch.Tensor:
        source = _bytes_of(storage, lo, nbytes)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(source, non_blocking=True)
            source.record_stream(self.stream)  # its memory is reused only once the copy has read it
        else:
            host.copy_(source)
        if self.traffic is not None:
            self.traffic.to_host_bytes += nbytes
            self.traffic.copies.append((storage.data_ptr(), host.untyped_storage().data_ptr(), weakref.ref(storage)))
        return host

    def _bring_back(self, held: _Range) -> None:
        """Start copying ``held`` to the device (allocated on the compute stream, which waits for ``ready``)."""
        held.device_copy = torch.empty(held.nbytes, dtype=torch.uint8, device=self.device)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                held.device_copy.copy_(held.host, non_blocking=True)
                held.ready = torch.cuda.Event()
                held.ready.record(self.stream)
        else:
            held.device_copy.copy_(held.host)
        if self.traffic is not None:
            self.traffic.to_device_bytes += held.nbytes
            self.traffic.prefetched_bytes += 0 if self.started_backward else held.nbytes

    def bring_back(self) -> None:
        """Start bringing back every tensor of this layer not on the device yet."""
        for held in self.stored:
            if held.device_copy is None and held.pending > 0:
                self._bring_back(held)

    def backward_starts(self) -> None:
        """This layer's backward begins: its own tensors come back (now, where not prefetched) and the nearest
        earlier offloading layer's start coming back behind this backward's compute."""
        self.started_backward = True
        self.bring_back()
        earlier = self.previous
        while earlier is not None and not earlier.stored:
            earlier = earlier.previous
        if earlier is not None:
            earlier.bring_back()

    # -- the layer call

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _LayerEnd(torch.autograd.Function):
    """Identity on a layer's output; its backward, the first of the layer's, starts the host copies coming
    back. ``ctx.host_copies`` is how the next layer finds this one's store (through its input's ``grad_fn``)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, copies: HostCopies) -> torch.Tensor:
        ctx.host_copies = copies
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.host_copies.backward_starts()
        return grad, None


def previous_store(h) -> Optional[HostCopies]:
    """The store of the layer that made ``h`` (its ``_LayerEnd``), if that layer offloaded or passed a link on."""
    return getattr(getattr(h, "grad_fn", None), "host_copies", None)


class Offloaded:
    """Context of one offloading layer call: its saved tensors go to ``copies`` (and so do its checkpointed
    regions' inputs, ``offloading``)."""

    def __init__(self, copies: HostCopies):
        self.copies = copies
        self._hooks = copies.hooks()
        self._token = None

    def __enter__(self) -> HostCopies:
        self._hooks.__enter__()
        self._token = _CURRENT.set(self.copies)
        return self.copies

    def __exit__(self, *exc):
        _CURRENT.reset(self._token)
        self._hooks.__exit__(*exc)
        return False


def end_layer(out, copies: HostCopies):
    """``out`` through ``_LayerEnd`` (a tensor that needs a gradient; anything else as it is)."""
    if isinstance(out, torch.Tensor) and out.requires_grad:
        return _LayerEnd.apply(out, copies)
    return out
