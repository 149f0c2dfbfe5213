"""Kernel backends: the interface each implementation of the attention kernels offers, the registry
of backends, and the `auto` rule that picks one.

Backends are interchangeable consumers of one launch plan (dash_plugin/schedules/plan.py): the
schedule decides the order of every dQ addition, a backend only executes it. Two backends need
not give each other's bits (their tiles differ), but each gives the same bits on every run and
every SM count. Adding a backend: docs/DESIGN.md, "Adding a backend".

This module imports no kernel: a backend's module is imported the first time it is asked for,
so a machine without Triton (or without a Hopper-only library) still runs the others.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Protocol

import torch

AUTO = "auto"


@dataclass(frozen=True)
class Request:
    """What a call asks of a backend: what `supports` decides on and `tiles` picks by."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    schedule: str | None = None     # the concrete schedule (None: any)
    kernel_mode: str | None = None  # its kernel mode in the schedule registry (None: any)
    varlen: bool = False
    seqlen_q: int = 0               # the longest sequence (dense: the sequence length)
    seqlen_k: int = 0
    causal: bool = False
    window_left: int = -1           # -1: unbounded
    window_right: int = -1          # -1: unbounded; 0 with causal
    softcap: bool = False
    dropout: bool = False

    @property
    def device_type(self) -> str:
        return self.device.type


@dataclass(frozen=True)
class DeviceProps:
    """What the launch plan needs to know about the device a backend runs on."""

    resident_programs: int    # programs surely resident at once (the persistent grid's size bound)
    concurrent: bool = True   # programs run at the same time (False: one by one, as in the Triton interpreter)


class StuckWaitError(RuntimeError):
    """An ordered-schedule wait gave up (DASH_DEBUG_WAITS=1): the rank it waited for never came."""


class Backend(Protocol):
    name: str

    def supports(self, request: Request) -> bool | str:
        """True, or why this backend cannot run the request on this machine."""

    def tiles(self, request: Request):
        """Tiles of the backend's KV-stationary backward kernel for the request: an object with
        block_m and block_n, and optionally group_size (the largest group of workers the backend
        keeps co-resident for cyclic waits; absent or None: the schedule's default rule). The
        launch plan's ranks are built for them. None: the backend needs no plan tables."""

    def device_props(self, device: torch.device) -> DeviceProps:
        ...

    def forward(self, q, k, v, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) with the keywords of docs/INTERNALS.md, "Kernel-level functions"."""

    def backward(self, plan, dout, q, k, v, out, lse, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv), running `plan` (same keywords as `forward`)."""


def _reference():
    from . import reference_backend
    return reference_backend.BACKEND


def _triton():
    from . import triton_backend
    return triton_backend.BACKEND


def _hopper():
    from . import hopper_backend
    return hopper_backend.BACKEND


# name -> loader of its BACKEND: plain import statements (not importlib), which torch.compile can
# trace when the first call comes inside a compiled region. A new backend adds a loader here, and
# to AUTO_ORDER if auto may pick it.
_LOADERS = {"reference": _reference, "triton": _triton, "hopper": _hopper}
# The auto rule: per device type, the backends in order of speed; auto takes the first that
# implements the schedule and supports the call. Committed here, never a timing taken at run time.
AUTO_ORDER = {"cuda": ("hopper", "triton", "reference")}
AUTO_DEFAULT = ("reference",)


class _Unavailable:
    """Stands in for a backend whose module does not import on this machine."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason

    def supports(self, request: Request) -> str:
        return self.reason


_loaded: dict[str, object] = {}


def names() -> tuple[str, ...]:
    return tuple(_LOADERS)


def get(name: str):
    """The backend `name` (imported on first use); one whose module fails to import stands in as
    unavailable, with the import error as its reason."""
    if name not in _LOADERS:
        raise ValueError(f"backend={name!r}; allowed: {', '.join((AUTO,) + names())}")
    if name not in _loaded:
        try:
            _loaded[name] = _LOADERS[name]()
        except Exception as exc:  # no triton, or a kernel library not importable on this stack
            warnings.warn(f"dash_plugin: the {name} backend is unavailable ({exc!r})")
            _loaded[name] = _Unavailable(name, f"the {name} backend does not import ({exc!r})")
    return _loaded[name]


def candidates(name: str, device_type: str) -> tuple[str, ...]:
    """The backends a call may run on: `name` itself, or for auto the committed order."""
    return AUTO_ORDER.get(device_type, AUTO_DEFAULT) if name == AUTO else (name,)


def why_not(name: str, request: Request, implemented_by: tuple[str, ...] | None = None) -> str | None:
    """None if backend `name` runs `request`, else why not."""
    if implemented_by is not None and name not in implemented_by:
        return f"does not implement schedule={request.schedule!r}"
    why = get(name).supports(request)
    return None if why is True else why


def choose(name: str, request: Request, implemented_by: tuple[str, ...] | None = None):
    """The backend that runs `request`: `name` itself, or for `auto` the first of AUTO_ORDER for
    the device that implements the schedule (`implemented_by`, from the schedule registry) and
    supports the call. An explicit backend that cannot run the call is an error, never a
    silent substitute."""
    return choose_explained(name, request, implemented_by)[0]


def choose_explained(name: str, request: Request, implemented_by: tuple[str, ...] | None = None):
    """(backend, why each backend before it in the auto order was passed over)."""
    if name != AUTO:
        backend = get(name)
        if implemented_by is not None and name not in implemented_by:
            raise ValueError(f"backend={name!r} does not implement schedule={request.schedule!r}; backends "
                             f"that do: {', '.join(implemented_by)}")
        why = backend.supports(request)
        if why is not True:
            raise ValueError(f"backend={name!r} cannot run this call: {why}")
        return backend, ()
    reasons = []
    for candidate in candidates(name, request.device_type):
        why = why_not(candidate, request, implemented_by)
        if why is None:
            return get(candidate), tuple(reasons)
        reasons.append(f"{candidate}: {why}")
    raise ValueError(f"backend='auto': no backend runs this call ({'; '.join(reasons)})")
