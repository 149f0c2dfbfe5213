"""One attention call, from a resolved switch to a kernel: which backend runs it, and the launch
plan its backward runs. The torch ops (ops.py) call these, and so do tests and scripts that want
a given backend without the autograd layer. The API resolves `auto` schedules and the config
sources before (config.py, api.py); docs/DESIGN.md, "The flow of a call".
"""
from dash_plugin.kernels import backends
from dash_plugin.schedules import plan as launch_plans
from dash_plugin.schedules import registry


def _request(q, schedule):
    spec = None if schedule is None else registry.get(schedule)
    return spec, backends.Request.of(q, schedule, None if spec is None else spec.kernel_mode)


def choose_backend(name: str, q, schedule: str | None = None):
    """The backend that runs a call on input `q` with the concrete `schedule` (None: whatever the
    schedule): `name`, or for "auto" the first backend of the committed rule that implements the
    schedule and supports the call (kernels/backends.py)."""
    spec, request = _request(q, schedule)
    return backends.choose(name, request, None if spec is None else spec.backends)


def attention_forward(q, k, v, *, schedule: str | None = None, backend: str = "auto", **kw):
    """(out, lse) on the chosen backend; keywords of docs/INTERNALS.md, "Kernel-level functions"."""
    return choose_backend(backend, q, schedule).forward(q, k, v, **kw)


def attention_backward(dout, q, k, v, out, lse, *, schedule: str = "ascending", deterministic: bool = True,
                       backend: str = "auto", **kw):
    """(dq, dk, dv): the launch plan of `schedule` for this call's shape and the chosen backend's
    tiles and device, run by that backend."""
    registry.check_call(schedule, deterministic, where="")
    spec, request = _request(q, schedule)
    chosen = backends.choose(backend, request, spec.backends)
    shape = launch_plans.AttentionShape.of(
        q, k, cu_seqlens_q=kw.get("cu_seqlens_q"), cu_seqlens_k=kw.get("cu_seqlens_k"),
        causal=kw.get("causal", False), window_left=kw.get("window_left", -1),
        window_right=kw.get("window_right", -1))
    plan = launch_plans.launch_plan(shape, schedule, tiles=chosen.tiles(request),
                                    device=chosen.device_props(q.device))
    return chosen.backward(plan, dout, q, k, v, out, lse, **kw)
