"""The implementations the benchmark compares: ours (one per backward schedule) and the peers.

Each implementation is an ``Impl``: how to build a forward function for one point, which tensor
layout it takes, and the context every call of it runs in (an SDPA backend choice, PyTorch's
deterministic flag). Peers that cannot be imported on this machine are reported as unavailable,
never as failures; a peer that imports but fails at one point gets an error cell from the runner.
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from dash_plugin.schedules import registry

from .protocol import Point

# Ours: auto, then every registered schedule, the deterministic ones first.
DASH_SCHEDULES = (registry.AUTO,) + registry.names(deterministic=True) + registry.names(deterministic=False)
# The schedules the auto rule may choose from: every deterministic one ("auto" itself excluded).
DETERMINISTIC_SCHEDULES = registry.names(deterministic=True)


@dataclass
class Impl:
    name: str
    family: str                      # dash | sdpa | flex | fa4
    description: str
    layout: str                      # "bshd" (flash-attn, ours) or "bhsd" (SDPA, Flex)
    build: Callable[[Point, torch.device], Callable]   # -> fn(q, k, v) returning out
    devices: tuple = ("cuda",)
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    claims_deterministic: Optional[bool] = None   # what the implementation promises (checked separately)
    schedule: Optional[str] = None
    probe: Callable[[], Optional[str]] = lambda: None   # reason it is unavailable, or None
    call_info: Optional[Callable[..., dict]] = None   # (q, k, point) -> facts about the last call, kept in the cell
    tags: dict = field(default_factory=dict)
    # --dropout: (point, device, dropout_p, seed) -> fn(q, k, v) with dropout; None: the
    # implementation has no dropout, and `no_dropout` says so in the reports (never a figure).
    build_dropout: Optional[Callable[[Point, torch.device, float, int], Callable]] = None
    no_dropout: str = "no dropout"

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        if device.type not in self.devices:
            return f"runs on {'/'.join(self.devices)} only"
        try:
            return self.probe()
        except Exception as exc:  # a probe must never stop the run
            return f"probe failed: {type(exc).__name__}: {exc}"

    def from_bshd(self, x: torch.Tensor) -> torch.Tensor:
        """Our canonical (B, S, H, D) tensor to this implementation's layout, contiguous."""
        return x.contiguous() if self.layout == "bshd" else x.transpose(1, 2).contiguous()

    def to_bshd(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.layout == "bshd" else x.transpose(1, 2)

    def describe(self) -> dict:
        return {"name": self.name, "family": self.family, "description": self.description,
                "layout": self.layout, "claims_deterministic": self.claims_deterministic,
                "schedule": self.schedule, "dropout": self.build_dropout is not None}


def first_output(result):
    """Some APIs return (out, lse); the benchmark differentiates the attention output only."""
    return result[0] if isinstance(result, (tuple, list)) else result


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for the duration, restoring the previous state."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


# ---------------------------------------------------------------------------- ours
def _dash_probe() -> Optional[str]:
    import dash_plugin
    if not callable(getattr(dash_plugin, "flash_attention", None)):
        return "dash_plugin.flash_attention is not defined yet"
    return None


def _dash_build(schedule: str, backend: str = "auto"):
    deterministic = schedule == registry.AUTO or registry.get(schedule).deterministic

    def build(point: Point, device: torch.device):
        from dash_plugin import flash_attention

        def fn(q, k, v):
            return first_output(flash_attention(q, k, v, causal=point.causal, schedule=schedule,
                                                deterministic=deterministic, backend=backend))
        return fn
    return build


def _dash_build_dropout(schedule: str, backend: str = "auto"):
    """The same call with dropout: a fixed ``dropout_seed``, so every call draws the same mask
    (and a deterministic schedule gives the same bits on every pass)."""
    deterministic = schedule == registry.AUTO or registry.get(schedule).deterministic

    def build(point: Point, device: torch.device, dropout_p: float, seed: int):
        from dash_plugin import flash_attention

        def fn(q, k, v):
            return first_output(flash_attention(q, k, v, causal=point.causal, schedule=schedule,
                                                deterministic=deterministic, backend=backend,
                                                dropout_p=dropout_p, dropout_seed=seed))
        return fn
    return build


def _dash_call_info(q: torch.Tensor, k: torch.Tensor, point: Point) -> dict:
    """What our last call really ran: the concrete schedule (what ``auto`` chose), the kernel
    backend (Triton, or the plain-PyTorch reference, which would make a GPU figure meaningless), and
    the orders its backward's launch plan holds (`plan_variants`: a named order that does not apply
    to the shape falls back to another, e.g. `arrival` on a full mask runs `descending`)."""
    info = {}
    try:
        from dash_plugin.config import last_resolved
        resolved = last_resolved()
        if resolved is not None:
            info["schedule_resolved"] = resolved.concrete_schedule or resolved.schedule
            info["kernel"] = resolved.concrete_backend or resolved.backend
    except Exception:
        pass
    if info.get("schedule_resolved") and info.get("kernel"):
        from dash_plugin import checks, dispatch
        left, right = checks.check_window((-1, -1), point.causal)
        variants = dispatch.plan_variants(q, k, schedule=info["schedule_resolved"], backend=info["kernel"],
                                          causal=point.causal, window_left=left, window_right=right)
        if variants:
            info["plan_variants"] = list(variants)
    return info


def _hopper_probe() -> Optional[str]:
    from dash_plugin.kernels import hopper
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return "needs an sm90 (Hopper) GPU"
    return None if hopper.available() else "the hopper extra (flash-attn-4, nvidia-cutlass-dsl) is not installed"


# Columns per schedule: `dash-<schedule>` lets `auto` pick the backend; `dash-<backend>-<schedule>`
# names it, so one run compares the backends side by side.
BACKEND_COLUMNS = ("triton", "hopper")


def _dash_impls() -> list[Impl]:
    impls = []
    for backend in (registry.AUTO,) + BACKEND_COLUMNS:
        for schedule in DASH_SCHEDULES:
            if backend != registry.AUTO and schedule != registry.AUTO and backend not in registry.get(schedule).backends:
                continue
            det = schedule == registry.AUTO or registry.get(schedule).deterministic
            what = ("forward + atomic (non-deterministic) backward" if not det
                    else f"forward + deterministic backward, schedule '{schedule}'")
            prefix = "dash" if backend == registry.AUTO else f"dash-{backend}"
            impls.append(Impl(name=f"{prefix}-{schedule}", family="dash",
                              description=f"dash_plugin {what}, backend {backend}",
                              layout="bshd", build=_dash_build(schedule, backend),
                              devices=("cuda", "cpu") if backend == registry.AUTO else ("cuda",),
                              claims_deterministic=det, schedule=schedule,
                              probe=_hopper_probe if backend == "hopper" else _dash_probe,
                              call_info=_dash_call_info, tags={"backend": backend},
                              build_dropout=_dash_build_dropout(schedule, backend)))
    return impls


# ---------------------------------------------------------------------------- SDPA
def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend
    return getattr(SDPBackend, name)


def _sdpa_context(backend: Optional[str], deterministic: bool):
    @contextlib.contextmanager
    def ctx():
        with contextlib.ExitStack() as stack:
            if backend is not None:
                from torch.nn.attention import sdpa_kernel
                stack.enter_context(sdpa_kernel(_sdpa_backend(backend)))
            if deterministic:
                stack.enter_context(deterministic_algorithms())
            yield
    return ctx


def _sdpa_build(point: Point, device: torch.device):
    # enable_gqa only when needed: older backends reject the keyword even when False.
    kwargs = {"enable_gqa": True} if point.group > 1 else {}

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=point.causal, **kwargs)
    return fn


def _sdpa_build_dropout(point: Point, device: torch.device, dropout_p: float, seed: int):
    """SDPA with ``dropout_p``: it draws its mask from torch's generator, seeded here once (a
    fixed start; each call then advances the generator, as in training)."""
    kwargs = {"enable_gqa": True} if point.group > 1 else {}
    torch.manual_seed(seed)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=point.causal, dropout_p=dropout_p, **kwargs)
    return fn


def _sdpa_probe(backend: Optional[str]):
    def probe():
        if backend is not None:
            _sdpa_backend(backend)
        return None
    return probe


def _sdpa_impls() -> list[Impl]:
    specs = [
        # name, backend (None = SDPA's own choice), deterministic flag, devices, claim, description
        ("sdpa-math", "MATH", False, ("cpu", "cuda"), True, "SDPA math backend (plain matmuls)"),
        ("sdpa-flash", "FLASH_ATTENTION", False, ("cuda",), False, "SDPA flash backend (FA2)"),
        ("sdpa-cudnn", "CUDNN_ATTENTION", False, ("cuda",), False, "SDPA cuDNN backend"),
        ("sdpa-efficient", "EFFICIENT_ATTENTION", False, ("cuda",), False, "SDPA memory-efficient backend"),
        ("sdpa-det", None, True, ("cuda",), True,
         "SDPA, backend chosen by SDPA, under torch.use_deterministic_algorithms(True) (what HF users get)"),
        ("sdpa-cudnn-det", "CUDNN_ATTENTION", True, ("cuda",), True,
         "SDPA cuDNN backend under torch.use_deterministic_algorithms(True)"),
        ("sdpa-efficient-det", "EFFICIENT_ATTENTION", True, ("cuda",), True,
         "SDPA memory-efficient backend under torch.use_deterministic_algorithms(True)"),
    ]
    # cuDNN is timed without dropout (the peers with dropout are SDPA's flash, efficient and math backends)
    return [Impl(name=name, family="sdpa", description=desc, layout="bhsd", build=_sdpa_build,
                 devices=devices, context=_sdpa_context(backend, det), claims_deterministic=claim,
                 probe=_sdpa_probe(backend), tags={"backend": backend, "torch_deterministic": det},
                 build_dropout=None if backend == "CUDNN_ATTENTION" else _sdpa_build_dropout,
                 no_dropout="no dropout (SDPA's cuDNN backend is timed without it)")
            for name, backend, det, devices, claim, desc in specs]


# ---------------------------------------------------------------------------- FlexAttention
def _flex_probe() -> Optional[str]:
    from torch.nn.attention import flex_attention  # noqa: F401
    return None


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _raise_recompile_limits(limit: int = 256) -> None:
    """One static compile per shape: the default limit (8) would make later shapes fall back to eager."""
    import torch._dynamo.config as dynamo_config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    _raise_recompile_limits()
    # The protocol times backward with retain_graph=True, which compiled graphs with donated buffers refuse.
    import torch._functorch.config as functorch_config
    functorch_config.donated_buffer = False
    # No max-autotune: the protocol (and torchtitan's deterministic mode) use the default configs.
    return torch.compile(flex_attention, dynamic=False)


def _flex_build(point: Point, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask
    compiled = _compiled_flex()
    block_mask = None
    if point.causal:   # created once per shape, outside the timed region
        block_mask = create_block_mask(_causal_mask, B=None, H=None, Q_LEN=point.seqlen,
                                       KV_LEN=point.seqlen, device=device)
    kwargs = {"enable_gqa": True} if point.group > 1 else {}

    def fn(q, k, v):
        return compiled(q, k, v, block_mask=block_mask, **kwargs)
    return fn


def _flex_impls() -> list[Impl]:
    return [Impl(name="flex", family="flex", layout="bhsd", build=_flex_build, claims_deterministic=True,
                 description="FlexAttention, torch.compile (default configs, no max-autotune)",
                 probe=_flex_probe, no_dropout="no dropout (FlexAttention has none)")]


# ---------------------------------------------------------------------------- FA4
def _fa4_probe() -> Optional[str]:
    try:
        import flash_attn.cute as cute
    except Exception as exc:
        return f"flash_attn.cute does not import ({type(exc).__name__}: {exc})"
    if not callable(getattr(cute, "flash_attn_func", None)):
        return "flash_attn.cute has no flash_attn_func"
    return None


def _fa4_build(deterministic: bool):
    def build(point: Point, device: torch.device):
        from flash_attn.cute import flash_attn_func

        def fn(q, k, v):
            return first_output(flash_attn_func(q, k, v, causal=point.causal, deterministic=deterministic))
        return fn
    return build


def _fa4_impls() -> list[Impl]:
    return [Impl(name=name, family="fa4", layout="bshd", build=_fa4_build(det), claims_deterministic=det,
                 description=f"FA4 (flash_attn.cute), deterministic={det}", probe=_fa4_probe,
                 no_dropout="no dropout (FA4 has none)")
            for name, det in (("fa4", False), ("fa4-det", True))]


# ---------------------------------------------------------------------------- registry
def all_impls() -> list[Impl]:
    """Every implementation, peers first (the first one that succeeds at a point is the accuracy reference)."""
    return _sdpa_impls() + _flex_impls() + _fa4_impls() + _dash_impls()


IMPL_NAMES = tuple(i.name for i in all_impls())
# Not in the default GPU set: the math backend materialises S x S fp32 scores (17 GB at 16k).
NOT_DEFAULT_ON_CUDA = ("sdpa-math",)
TINY_IMPLS = ("sdpa-math",) + tuple(f"dash-{s}" for s in DASH_SCHEDULES)


def select_impls(patterns: Optional[str], device: torch.device, *, tiny: bool = False) -> list[Impl]:
    """The implementations named by a comma list of names or shell patterns ("dash-*,sdpa-cudnn").

    Without patterns: everything that runs on the device (on CUDA without sdpa-math; with --tiny
    only SDPA math and ours). Names that match nothing are an error, so a typo cannot silently
    drop a column.
    """
    impls = all_impls()
    if patterns is None:
        if tiny:
            return [i for i in impls if i.name in TINY_IMPLS]
        return [i for i in impls if device.type in i.devices
                and not (device.type == "cuda" and i.name in NOT_DEFAULT_ON_CUDA)]
    named = [p.strip() for p in patterns.split(",") if p.strip()]
    if not named:   # "" or ",": an empty selection, not one that cannot run here
        raise ValueError(f"--impls {patterns!r} names no implementation; give a comma list of names or "
                         "patterns (see --list), or leave it out for the default set")
    chosen = set()
    for pattern in named:
        hits = {i.name for i in impls if fnmatch.fnmatchcase(i.name, pattern)}
        if not hits:
            raise ValueError(f"--impls: {pattern!r} matches no implementation; allowed: {', '.join(IMPL_NAMES)}")
        chosen |= hits
    # keep the registry order (peers before ours) whatever order the patterns came in
    return [i for i in impls if i.name in chosen]
