"""The host side of a call (scripts/host_overhead.py): the API's eager calls skip PyTorch's
custom-op dispatcher but not what it is there for, and the Hopper path builds a shape's launch
plan, its per-KV-tile tables and the device's properties once."""
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dash_plugin
from dash_plugin.kernels import hopper, hopper_backend
from dash_plugin.schedules import plan as launch_plans

from tests.script_modules import load_script


def _script():
    return load_script("host_overhead")


def _inputs(seqlen=16, head_dim=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, seqlen, 2, head_dim, generator=g).to(dtype).requires_grad_() for _ in range(3)]


class _SeenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


def test_modes_and_the_profiler_still_see_the_ops():
    """Plain eager calls run the ops' bodies directly; a dispatch mode or the profiler makes the
    call go through torch.ops.dash, so they see dash::fwd and dash::bwd, with the same bits."""
    q, k, v = _inputs()
    out = dash_plugin.flash_attention(q, k, v, causal=True)
    plain = torch.autograd.grad(out.sum(), (q, k, v))
    with _SeenOps() as mode:
        seen_out = dash_plugin.flash_attention(q, k, v, causal=True)
        seen = torch.autograd.grad(seen_out.sum(), (q, k, v))
    assert {"dash.fwd.default", "dash.bwd.default"} <= mode.ops
    assert torch.equal(out, seen_out) and all(torch.equal(a, b) for a, b in zip(plain, seen))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.autograd.grad(dash_plugin.flash_attention(q, k, v, causal=True).sum(), (q, k, v))
    names = {e.key for e in prof.key_averages()}
    assert {"dash::fwd", "dash::bwd"} <= names


def test_hopper_path_builds_plan_tables_and_device_props_once_per_shape():
    """Through the API with the Hopper kernels stubbed (as the script runs it): the second call of
    a shape reuses its plan, tables and device properties; another shape builds its own."""
    host_overhead = _script()
    tables_built = []
    real_tables_of = hopper.tables_of

    def tables_of(seq):
        tables_built.append(seq)
        return real_tables_of(seq)

    props_asked = []
    hopper_backend._device_props.cache_clear()
    try:
        with host_overhead.stubbed("hopper"), mock.patch.object(hopper, "tables_of", tables_of), \
                mock.patch.object(torch.cuda, "get_device_properties",
                                  lambda device=None: props_asked.append(device) or mock.Mock(multi_processor_count=132)):
            misses = []
            for seqlen in (1216, 1216, 1344):   # lengths no other test uses: the plan cache is process-wide
                q, k, v = _inputs(seqlen, 64, torch.bfloat16)   # a Hopper head dim
                out = dash_plugin.flash_attention(q, k, v, causal=True, schedule="descending")
                assert dash_plugin.last_resolved().concrete_backend == "hopper"
                torch.autograd.backward(out, torch.zeros_like(out))
                assert q.grad.shape == q.shape
                misses.append(launch_plans._plan_cached.cache_info().misses)
    finally:
        hopper_backend._device_props.cache_clear()   # forget the stand-in's 132 SMs
    assert misses[1] == misses[0] and misses[2] == misses[1] + 1
    assert [seq.geometry.seqlen_q for seq in tables_built] == [1216, 1344]
    assert len(props_asked) == 1


def test_host_overhead_script_runs(capsys):
    _script().main(["--shape", "1,256,2,64", "--calls", "20", "--warmup", "2", "--profile-calls", "3",
                    "--top", "3"])
    text = capsys.readouterr().out
    for backend in ("hopper", "triton"):
        assert f"backend=auto -> {backend}" in text
    assert text.count("us per call") == 8 and "cProfile of 3 fwd+bwd calls" in text


def test_plain_eager_calls_skip_the_op_layer_and_watched_calls_do_not():
    """The op layer (its argument checks, then the body) runs only when something besides eager
    PyTorch watches the call; plain calls go straight to the body, with the same bits."""
    from dash_plugin import checks
    q, k, v = _inputs()
    real = checks.check_op_args
    with mock.patch.object(checks, "check_op_args", side_effect=real) as op_checks:
        out = dash_plugin.flash_attention(q, k, v, causal=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert op_checks.call_count == 0
        with _SeenOps():
            again = dash_plugin.flash_attention(q, k, v, causal=True)
            grads_again = torch.autograd.grad(again.sum(), (q, k, v))
        assert op_checks.call_count == 2   # dash::fwd and dash::bwd
    assert torch.equal(out, again) and all(torch.equal(a, b) for a, b in zip(grads, grads_again))


def test_the_backward_gets_no_zero_filled_lse_gradient(monkeypatch):
    """lse takes no gradient, so autograd must not allocate and zero one per backward for it:
    the API's backward sees dlse=None; the op's own autograd (same context setup) gives the same
    gradients."""
    from dash_plugin import ops
    seen, real = [], ops._backward

    def spy(ctx, dout, dlse):
        seen.append(dlse)
        return real(ctx, dout, dlse)
    monkeypatch.setattr(ops, "_backward", spy)
    q, k, v = _inputs()
    grads = torch.autograd.grad(dash_plugin.flash_attention(q, k, v, causal=True).sum(), (q, k, v))
    out, lse = torch.ops.dash.fwd(q, k, v, None, None, 16, 16, 0.25, True, -1, 0, 0.0, 0.0, 0, "ascending", True)
    op_grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert seen == [None]
    assert all(torch.equal(a, b) for a, b in zip(grads, op_grads))


def test_gpu_host_cost_wraps_and_restores_what_it_times():
    """scripts/gpu_host_cost.py --breakdown times our backward's parts by wrapping module
    attributes and compiled-kernel entries; the wrappers add up host time per name and every
    original is back afterwards (the script runs on the GPU; this checks its bookkeeping)."""
    import types
    timed = load_script("gpu_host_cost")._Timed()
    module, table = types.SimpleNamespace(f=lambda x: x + 1), {"kernel": lambda: 5}
    real_f, real_kernel = module.f, table["kernel"]
    timed.wrap(module, "f", "f")
    timed.wrap(table, "kernel", "kernel", as_item=True)
    assert module.f(1) == 2 and module.f(2) == 3 and table["kernel"]() == 5
    assert timed.calls == {"f": 2, "kernel": 1} and all(us >= 0 for us in timed.us.values())
    timed.undo()
    assert module.f is real_f and table["kernel"] is real_kernel


def test_a_packed_call_reads_its_offsets_from_the_device_once():
    """Reading cu_seqlens on the host waits for the GPU to drain its queue. The API's check, the
    Hopper path's plan and the backward all need the lengths: one read per offsets tensor, kept
    on it; an in-place change makes the next reader read again."""
    from dash_plugin.kernels.varlen import seqlens_of
    host_overhead = _script()
    reads = []
    real_tolist = torch.Tensor.tolist

    def tolist(self):
        if self is cu:
            reads.append(self.numel())
        return real_tolist(self)

    cu = torch.tensor([0, 300, 300, 1000], dtype=torch.int32)
    q, k, v = (torch.empty(1000, 2, 64, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    with host_overhead.stubbed("hopper"), mock.patch.object(torch.Tensor, "tolist", tolist):
        out = dash_plugin.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        assert dash_plugin.last_resolved().concrete_backend == "hopper"
        torch.autograd.backward(out, torch.zeros_like(out))
        assert reads == [4]
        assert seqlens_of(cu, 1000) == [300, 0, 700] and reads == [4]
        cu[1] = 200   # in place: read again, and the new lengths are the ones returned
        assert seqlens_of(cu, 1000) == [200, 100, 700] and reads == [4, 4]
