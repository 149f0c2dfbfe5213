"""Kernel backends: the auto rule, explicit choices and their errors, the `backend` field of the
config switch, and the ops carrying it (kernels/backends.py, dash_plugin/config.py)."""
import os

import pytest
import torch

import dash_plugin
from dash_plugin import dispatch, ops
from dash_plugin.config import resolve_config
from dash_plugin.kernels import backends
from dash_plugin.kernels.backends import Request

BUILTIN = ("reference", "triton")


def req(device="cuda", dtype=torch.bfloat16, head_dim=128, schedule="split", mode="split"):
    return Request(torch.device(device), dtype, head_dim, schedule, mode)


@pytest.fixture(autouse=True)
def clean_config():
    dash_plugin.reset_config()
    yield
    dash_plugin.reset_config()


def test_auto_rule(monkeypatch):
    """Committed per device type: Hopper, then Triton for CUDA half precision, the reference for
    the rest. (No sm90 GPU here, or made so: the Hopper backend says so and auto passes it over.)"""
    from dash_plugin.kernels import hopper_backend
    monkeypatch.setattr(hopper_backend, "_is_sm90", lambda device: False)
    assert backends.choose("auto", req(), BUILTIN).name == "triton"
    assert backends.choose("auto", req(dtype=torch.float16, schedule="shift", mode="ordered"), BUILTIN).name == "triton"
    assert backends.choose("auto", req(dtype=torch.float32), BUILTIN).name == "reference"
    assert backends.choose("auto", req(device="cpu", dtype=torch.float32), BUILTIN).name == "reference"
    assert backends.choose("auto", req(), ("reference",)).name == "reference"   # a schedule only it implements
    assert backends.AUTO_ORDER["cuda"] == ("hopper", "triton", "reference")
    assert backends.AUTO_DEFAULT == ("reference",)
    chosen, passed_over = backends.choose_explained("auto", req(), BUILTIN + ("hopper",))
    assert chosen.name == "triton" and passed_over == ("hopper: needs an sm90 (Hopper) GPU",)


def test_explicit_backends_run_or_say_why_not():
    assert backends.choose("reference", req(), BUILTIN).name == "reference"
    with pytest.raises(ValueError, match="backend='triton' does not implement schedule='split'; backends that "
                                         "do: reference"):
        backends.choose("triton", req(), ("reference",))
    with pytest.raises(ValueError, match="backend='triton' cannot run this call: dtype torch.float32 on cuda"):
        backends.choose("triton", req(dtype=torch.float32), BUILTIN)
    with pytest.raises(ValueError, match="head_dim=512"):
        backends.choose("triton", req(head_dim=512), BUILTIN)
    with pytest.raises(ValueError, match="backend='cudnn'; allowed: auto, reference, triton, hopper"):
        backends.choose("cudnn", req(), BUILTIN)
    with pytest.raises(ValueError, match="no backend runs this call"):
        backends.choose("auto", req(), ())


def test_a_backend_that_does_not_import_is_unavailable(monkeypatch):
    def load_hopper():
        from dash_plugin.kernels import no_such_module  # noqa: F401
    monkeypatch.setitem(backends._LOADERS, "hopper", load_hopper)
    monkeypatch.setattr(backends, "_loaded", {})
    with pytest.warns(UserWarning, match="hopper backend is unavailable"):
        why = backends.get("hopper").supports(req())
    assert "does not import" in why
    monkeypatch.setitem(backends.AUTO_ORDER, "cuda", ("hopper", "triton", "reference"))
    assert backends.choose("auto", req(), ("hopper", "triton", "reference")).name == "triton"


def test_every_backend_offers_the_interface():
    for name in backends.names():
        b = backends.get(name)
        assert b.name == name
        for method in ("supports", "tiles", "device_props", "forward", "backward"):
            assert callable(getattr(b, method))
    assert backends.get("reference").tiles(req()) is None
    if os.environ.get("TRITON_INTERPRET") == "1":
        tiles = backends.get("triton").tiles(req(device="cpu", dtype=torch.float32, schedule="shift",
                                                 mode="ordered"))
        assert (tiles.block_m, tiles.block_n) == (16, 32)


def test_backend_field_of_the_config_switch(monkeypatch):
    c = resolve_config()
    assert (c.backend, c.backend_source) == ("auto", "default")
    monkeypatch.setenv("DASH_BACKEND", "reference")
    assert (resolve_config().backend, resolve_config().backend_source) == ("reference", "env DASH_BACKEND")
    model = {"dash_attention": {"backend": "triton"}}
    assert resolve_config(model_config=model).backend_source == "model config dash_attention"
    dash_plugin.configure(backend="reference")
    with dash_plugin.dash_config(backend="triton"):
        assert resolve_config(model_config=model).backend_source == "dash_config() context"
        assert resolve_config(backend="reference").backend_source == "call argument"
    assert resolve_config().backend_source == "configure()"
    monkeypatch.setenv("DASH_BACKEND", "fastest")
    dash_plugin.reset_config()
    with pytest.raises(ValueError, match=r"backend='fastest' \(from env DASH_BACKEND\) is not a backend; allowed: "
                                         "auto, reference, triton"):
        resolve_config()


def _call(**kw):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 40, 2, 32, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 40, 1, 32, generator=g, requires_grad=True) for _ in range(2))
    out = dash_plugin.flash_attention(q, k, v, causal=True, **kw)
    return [out] + list(torch.autograd.grad(out.square().sum(), (q, k, v)))


def test_the_api_names_the_backend_that_ran():
    default = _call(schedule="descending")
    assert dash_plugin.last_resolved().describe() == (
        "schedule=descending (from call argument), deterministic=True (from default), "
        "backend=auto -> reference (from default)")
    explicit = _call(schedule="descending", backend="reference")
    assert dash_plugin.last_resolved().describe().endswith("backend=reference (from call argument)")
    assert all(torch.equal(a, b) for a, b in zip(default, explicit))
    assert ops.kernel_path(torch.zeros(1)) == "reference"
    x = torch.zeros(1, 8, 1, 32, dtype=torch.bfloat16)
    assert dispatch.choose_backend("auto", x, x, "shift", causal=True).name == "reference"
    _spec, request = dispatch.request(x[0], x[0], "shift", cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32),
                                      max_seqlen_q=8, max_seqlen_k=8, causal=True, window_right=-1, softcap=2.0)
    assert request == Request(torch.device("cpu"), torch.bfloat16, 32, "shift", "ordered", True, 8, 8, True, -1, 0,
                              softcap=True, dropout=False)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter runs without CUDA")
def test_the_triton_backend_through_the_api_in_the_interpreter(monkeypatch):
    triton = backends.get("triton")
    ran = []
    for name in ("forward", "backward"):   # the record says Triton was chosen; these say it ran
        method = getattr(triton, name)
        monkeypatch.setattr(triton, name, lambda *a, _m=method, _n=name, **kw: ran.append(_n) or _m(*a, **kw))
    ref = _call(schedule="spt")
    assert ran == []
    tri = _call(schedule="spt", backend="triton")
    assert dash_plugin.last_resolved().concrete_backend == "triton"
    assert ran == ["forward", "backward"], ran
    for a, b in zip(tri, ref):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
    with pytest.raises(ValueError, match="backend='triton' cannot run this call: dtype torch.bfloat16 on cpu"):
        dash_plugin.flash_attention(*(torch.zeros(1, 8, 1, 32, dtype=torch.bfloat16) for _ in range(3)),
                                    backend="triton")


def test_the_ops_carry_the_backend():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 12, 2, 32, generator=g) for _ in range(3))
    args = (q, k, v, None, None, 12, 12, 0.2, True, -1, 0, 0.0, 0.0, 0, "ascending", True)
    out, lse = torch.ops.dash.fwd(*args)                 # backend defaults to auto
    out_ref, lse_ref = torch.ops.dash.fwd(*args, "reference")
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    with pytest.raises(ValueError, match="backend='bogus'"):
        torch.ops.dash.fwd(*args, "bogus")
    grads = torch.ops.dash.bwd(torch.ones_like(out), q, k, v, out, lse, None, None, *args[5:], "reference")
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    with pytest.raises(ValueError, match="backend='bogus'"):   # the backward reads its backend argument too
        torch.ops.dash.bwd(torch.ones_like(out), q, k, v, out, lse, None, None, *args[5:], "bogus")


def test_backends_load_inside_a_compiled_region(monkeypatch):
    """The API names the backend of each call, so the first call may come inside torch.compile:
    loading a backend there must not break the graph (fullgraph=True)."""
    monkeypatch.setattr(backends, "_loaded", {})
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 16, 2, 32, generator=g) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: dash_plugin.flash_attention(q, k, v, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v), dash_plugin.flash_attention(q, k, v, causal=True))


class _StandInHopper:
    """Runs what the real Hopper backend runs, on any device: dense causal/full calls of the
    KV-stationary schedules; says no to varlen, as the real one does."""
    name = "hopper"

    def supports(self, r):
        if r.kernel_mode not in (None, "ordered", "atomic"):
            return f"kernel mode {r.kernel_mode!r} runs on the Triton backend"
        return "varlen runs on the Triton backend" if r.varlen else True


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors reach Triton in its interpreter only")
def test_auto_schedule_is_resolved_per_backend_and_names_what_it_passed_over(monkeypatch):
    """schedule=auto and backend=auto: each candidate backend's own table picks the order, the
    first backend that runs it wins, and the reasons of the ones passed over are kept."""
    monkeypatch.setitem(backends._loaded, "hopper", _StandInHopper())
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ("hopper", "triton", "reference"))
    q = torch.zeros(1, 4096, 2, 128, dtype=torch.float16)
    kw = dict(max_seqlen_q=4096, max_seqlen_k=4096, causal=True, window_left=-1, window_right=0)
    chosen, schedule, passed_over = dispatch.resolve("auto", "auto", q, q, **kw)
    assert (chosen.name, schedule, passed_over) == ("hopper", "arrival", ())   # auto_table_hopper.py
    chosen, schedule, _ = dispatch.resolve("auto", "auto", q, q, **dict(kw, causal=False, window_right=-1))
    assert (chosen.name, schedule) == ("hopper", "shift")
    long = torch.zeros(1, 8192, 2, 128, dtype=torch.float16)
    chosen, schedule, _ = dispatch.resolve("auto", "auto", long, long, **dict(kw, causal=False, window_right=-1,
                                                                          max_seqlen_q=8192, max_seqlen_k=8192))
    assert (chosen.name, schedule) == ("hopper", "ascending")
    flat = torch.zeros(4096, 2, 128, dtype=torch.float16)
    cu = torch.tensor([0, 1000, 4096], dtype=torch.int32)
    chosen, schedule, passed_over = dispatch.resolve("auto", "auto", flat, flat, cu_seqlens_q=cu, **kw)
    # varlen: the Hopper table says arrival, the backend says no; Triton's own table decides
    assert chosen.name == "triton" and schedule == "split"
    assert passed_over == ("hopper: varlen runs on the Triton backend",)
    # an explicit schedule only Triton implements skips the Hopper backend with the registry's reason
    chosen, schedule, passed_over = dispatch.resolve("auto", "split", q, q, **kw)
    assert (chosen.name, schedule) == ("triton", "split")
    assert passed_over == ("hopper: does not implement schedule='split'",)
    # a named backend runs its own choice or says why not
    with pytest.raises(ValueError, match="backend='hopper' cannot run this call: varlen"):
        dispatch.resolve("hopper", "auto", flat, flat, cu_seqlens_q=cu, **kw)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter runs without CUDA")
def test_describe_says_when_the_named_order_falls_back():
    """schedule='arrival' on a full mask runs its plan's fallback, descending: the record says so (and
    says nothing where arrival runs, or where the schedule has no plan)."""
    q = torch.randn(1, 64, 1, 32)
    dash_plugin.flash_attention(q, q, q, causal=False, schedule="arrival", backend="triton")
    got = dash_plugin.last_resolved()
    assert got.plan_fallback == "descending (fallback: not a causal mask)"
    assert "[its launch plan runs descending (fallback: not a causal mask)]" in got.describe()
    dash_plugin.flash_attention(q, q, q, causal=True, schedule="arrival", backend="triton")
    assert dash_plugin.last_resolved().plan_fallback == ""
    dash_plugin.flash_attention(q, q, q, causal=False, schedule="arrival", backend="reference")
    assert dash_plugin.last_resolved().plan_fallback == ""    # the reference sums in its own order: no plan
