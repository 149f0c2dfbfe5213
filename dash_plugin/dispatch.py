"""One attention call, from a resolved switch to a kernel: which backend runs it, and the launch
plan its backward runs. The torch ops (ops.py) call these, and so do tests and scripts that want
a given backend without the autograd layer. The API resolves `auto` schedules and the config
sources before (config.py, api.py); docs/DESIGN.md, "The flow of a call".
"""
from dash_plugin.kernels import backends
from dash_plugin.schedules import plan as launch_plans
from dash_plugin.schedules import registry


def request(q, k, schedule: str | None = None, *, cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None,
            causal=False, window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0, **_unused):
    """(registry entry or None, backends.Request) of a call with the keywords of the kernel-level
    functions (docs/INTERNALS.md)."""
    spec = None if schedule is None else registry.get(schedule)
    varlen = cu_seqlens_q is not None
    return spec, backends.Request(
        q.device, q.dtype, q.shape[-1], schedule, None if spec is None else spec.kernel_mode, varlen,
        seqlen_q=max_seqlen_q if varlen else q.shape[1], seqlen_k=max_seqlen_k if varlen else k.shape[1],
        causal=bool(causal), window_left=window_left, window_right=0 if causal else window_right,
        softcap=softcap > 0, dropout=dropout_p > 0)


def choose_backend(name: str, q, k, schedule: str | None = None, **kw):
    """The backend that runs a call (inputs q, k, the concrete `schedule`, the keywords of the
    kernel-level functions): `name`, or for "auto" the first backend of the committed rule that
    implements the schedule and supports the call (kernels/backends.py)."""
    spec, req = request(q, k, schedule, **kw)
    return backends.choose(name, req, None if spec is None else spec.backends)


def attention_forward(q, k, v, *, schedule: str | None = None, backend: str = "auto", **kw):
    """(out, lse) on the chosen backend; keywords of docs/INTERNALS.md, "Kernel-level functions"."""
    return choose_backend(backend, q, k, schedule, **kw).forward(q, k, v, **kw)


def attention_backward(dout, q, k, v, out, lse, *, schedule: str = "ascending", deterministic: bool = True,
                       backend: str = "auto", **kw):
    """(dq, dk, dv): the launch plan of `schedule` for this call's shape and the chosen backend's
    tiles and device, run by that backend."""
    registry.check_call(schedule, deterministic, where="")
    spec, req = request(q, k, schedule, **kw)
    chosen = backends.choose(backend, req, spec.backends)
    shape = launch_plans.AttentionShape.of(
        q, k, cu_seqlens_q=kw.get("cu_seqlens_q"), cu_seqlens_k=kw.get("cu_seqlens_k"),
        causal=kw.get("causal", False), window_left=kw.get("window_left", -1),
        window_right=kw.get("window_right", -1))
    plan = launch_plans.launch_plan(shape, schedule, tiles=chosen.tiles(req), device=chosen.device_props(q.device))
    return chosen.backward(plan, dout, q, k, v, out, lse, **kw)
