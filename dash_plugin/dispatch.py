"""One attention call, from a resolved switch to a kernel: which backend runs it, and the launch
plan its backward runs. The torch ops (ops.py) call these, and so do tests and scripts that want
a given backend without the autograd layer. The API resolves `auto` schedules and the config
sources before (config.py, api.py); docs/DESIGN.md, "The flow of a call".
"""
from functools import lru_cache

import torch

from dash_plugin.kernels import backends
from dash_plugin.schedules import auto
from dash_plugin.schedules import plan as launch_plans
from dash_plugin.schedules import registry
from dash_plugin.schedules.builders import MAX_GROUP


def request(q, k, schedule: str | None = None, *, cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None,
            causal=False, window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0, **_unused):
    """(registry entry or None, backends.Request) of a call with the keywords of the kernel-level
    functions (docs/INTERNALS.md)."""
    spec = None if schedule is None else registry.get(schedule)
    varlen = cu_seqlens_q is not None
    # Under torch.compile the Request is built once, at trace time; Dynamo would trace through the
    # cache (and warn that it ignores it).
    build = backends.Request if torch.compiler.is_compiling() else _request
    return spec, build(
        q.device, q.dtype, q.shape[-1], schedule, None if spec is None else spec.kernel_mode, varlen,
        max_seqlen_q if varlen else q.shape[1], max_seqlen_k if varlen else k.shape[1], bool(causal),
        window_left, 0 if causal else window_right, softcap > 0, dropout_p > 0)


# A call builds the same Request three times (backend choice, forward, backward) and building
# one (a frozen dataclass of 13 fields) costs more than looking it up. Keyed by every field and
# its type; Requests are immutable, so calls may share one.
@lru_cache(maxsize=256, typed=True)
def _request(*fields) -> backends.Request:
    return backends.Request(*fields)


def choose_backend(name: str, q, k, schedule: str | None = None, **kw):
    """The backend that runs a call (inputs q, k, the concrete `schedule`, the keywords of the
    kernel-level functions): `name`, or for "auto" the first backend of the committed rule that
    implements the schedule and supports the call (kernels/backends.py)."""
    spec, req = request(q, k, schedule, **kw)
    return backends.choose(name, req, None if spec is None else spec.backends)


def resolve(backend: str, schedule: str, q, k, *, head_dim=None, **kw):
    """(backend, concrete schedule, why backends earlier in the auto order were passed over) of
    a call. An explicit schedule runs on the backend `choose_backend` gives. `auto` is resolved
    per candidate backend (the named one, or the committed order), because each backend's
    kernels make a different order the fastest: the first candidate that runs the schedule its
    own rule picks wins."""
    if schedule != registry.AUTO:
        spec, req = request(q, k, schedule, **kw)
        chosen, passed_over = backends.choose_explained(backend, req, spec.backends)
        return chosen, schedule, passed_over
    passed_over = []
    for name in backends.candidates(backend, q.device.type):
        concrete = _held_at_once(name, q.device, table_pick(name, q, **kw), bool(kw.get("causal", False)))
        spec, req = request(q, k, concrete, **kw)
        if backend != backends.AUTO:   # named: it runs its own choice or says why not
            return backends.choose_explained(name, req, spec.backends)[0], concrete, ()
        why = backends.why_not(name, req, spec.backends)
        if why is None:
            return backends.get(name), concrete, tuple(passed_over)
        passed_over.append(f"{name}: {why}")
    raise ValueError(f"backend='auto': no backend runs this call ({'; '.join(passed_over)})")


def table_pick(backend_name: str, q, **kw) -> str:
    """The order backend `backend_name`'s `auto` table names for a call (keywords as `resolve`)."""
    return auto.choose_schedule(
        causal=bool(kw.get("causal", False)), head_dim=q.shape[-1], seqlen_q=kw["max_seqlen_q"],
        seqlen_k=kw["max_seqlen_k"], window_left=kw.get("window_left", -1),
        window_right=kw.get("window_right", -1), varlen=kw.get("cu_seqlens_q") is not None, backend=backend_name)


def auto_trade_note(backend_name: str, concrete: str, q, **kw) -> str:
    """Why `auto` ran `concrete` instead of its table's pick ("" where it ran the pick): for
    last_resolved().describe(), asked only there."""
    pick = table_pick(backend_name, q, **kw)
    if pick == concrete:
        return ""
    held = backends.get(backend_name).device_props(q.device).resident_programs
    return (f"{concrete} instead of the table's {pick}, whose cyclic groups need up to {MAX_GROUP} "
            f"programs at once where this device holds {held} (under MPS, the process's share)")


def _held_at_once(backend_name: str, device, schedule: str, causal: bool) -> str:
    """`auto`'s pick, or an order without cyclic waits where the device holds fewer programs at
    once than the largest cyclic group: under MPS CUDA reports the SMs the process's active-thread
    percentage leaves, which may be fewer than 64. There a named cyclic order is refused by its
    plan where its group is larger (a group that cannot be co-resident would wait for ever);
    `auto` takes `descending` (causal) or `ascending` instead, without asking whether this call's
    groups would fit, so that it never meets that refusal."""
    if (schedule not in registry.MAY_WAIT_CYCLICALLY or device.type != "cuda"
            or _holds_groups(backend_name, str(device))):
        return schedule
    return "descending" if causal else "ascending"


@torch.compiler.assume_constant_result   # a constant of torch.compile's graph (device_props is cached)
def _holds_groups(backend_name: str, device: str) -> bool:
    backend = backends.get(backend_name)
    if not hasattr(backend, "device_props"):   # a backend that does not import: why_not passes it over
        return True
    props = backend.device_props(torch.device(device))
    return not props.concurrent or props.resident_programs >= MAX_GROUP


def attention_forward(q, k, v, *, schedule: str | None = None, backend: str = "auto", **kw):
    """(out, lse) on the chosen backend; keywords of docs/INTERNALS.md, "Kernel-level functions"."""
    return choose_backend(backend, q, k, schedule, **kw).forward(q, k, v, **kw)


def attention_backward(dout, q, k, v, out, lse, *, schedule: str = "ascending", deterministic: bool = True,
                       backend: str = "auto", **kw):
    """(dq, dk, dv): the launch plan of `schedule` for this call's shape and the chosen backend's
    tiles and device, run by that backend."""
    registry.check_call(schedule, deterministic, where="")
    chosen, plan = backward_plan(q, k, schedule=schedule, backend=backend, **kw)
    return chosen.backward(plan, dout, q, k, v, out, lse, **kw)


def plan_variants(q, k, *, schedule: str, backend: str = "auto", **kw) -> tuple[str, ...]:
    """The orders a backward's launch plan holds (sorted; a fallback is named as such, e.g.
    "descending (fallback: not a causal mask)"); () for unordered schedules and backends without plans."""
    if schedule not in registry.names() or not registry.get(schedule).ordered:
        return ()
    _, plan = backward_plan(q, k, schedule=schedule, backend=backend, **kw)
    return () if plan.schedule is None else tuple(sorted(set(plan.schedule.variants)))


def backward_plan(q, k, *, schedule: str, backend: str = "auto", **kw):
    """(backend, launch plan) of a backward: what `attention_backward` runs. Its schedule may hold
    a fallback order where the named one does not apply (`plan.schedule.variants` says which,
    e.g. "descending (fallback: not a causal mask)" for `arrival` on a full mask)."""
    spec, req = request(q, k, schedule, **kw)
    chosen = backends.choose(backend, req, spec.backends)
    shape = launch_plans.AttentionShape.of(
        q, k, cu_seqlens_q=kw.get("cu_seqlens_q"), cu_seqlens_k=kw.get("cu_seqlens_k"),
        causal=kw.get("causal", False), window_left=kw.get("window_left", -1),
        window_right=kw.get("window_right", -1))
    plan = launch_plans.launch_plan(shape, schedule, tiles=chosen.tiles(req), device=chosen.device_props(q.device))
    return chosen, plan
