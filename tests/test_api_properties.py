"""Property-based: random shapes, strides, masks and config values through the public API.

Each example draws a valid call and, half of the time, injects one fault. A valid call must
equal the reference bit for bit (the CPU path runs it); a faulty one must raise a TypeError or
ValueError that names what is allowed. Never a crash of another kind, a hang, or a silent result.
"""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dash_plugin
from dash_plugin.kernels import reference

FAULTS = {
    "head_dim_zero": lambda c: c.update(d=0),
    "head_dim_large": lambda c: c.update(d=257),
    "heads_not_multiple": lambda c: c.update(hq=c["hkv"] * 2 + 1) if c["hkv"] > 1 else c.update(hq=3, hkv=2),
    "negative_softcap": lambda c: c["kw"].update(softcap=-1.0),
    "nan_softcap": lambda c: c["kw"].update(softcap=float("nan")),
    "infinite_scale": lambda c: c["kw"].update(softmax_scale=float("inf")),
    "seed_beyond_int64": lambda c: c["kw"].update(dropout_seed=2 ** 63),
    "dropout_one": lambda c: c["kw"].update(dropout_p=1.0),
    "window_below_minus_one": lambda c: c["kw"].update(window=(-2, 3)),
    "causal_with_right_window": lambda c: c["kw"].update(causal=True, window=(3, 4)),
    "unknown_schedule": lambda c: c["kw"].update(schedule="fastest"),
    "atomic_but_deterministic": lambda c: c["kw"].update(schedule="atomic", deterministic=True),
    "batch_mismatch": lambda c: c.update(bk=c["b"] + 1),
    "dtype_mix": lambda c: c.update(k_dtype=torch.float64),
}


@st.composite
def calls(draw):
    hkv = draw(st.integers(1, 3))
    causal = draw(st.booleans())
    c = dict(b=draw(st.integers(1, 3)), sq=draw(st.integers(1, 40)), sk=draw(st.integers(1, 40)), hkv=hkv,
             hq=hkv * draw(st.integers(1, 3)), d=draw(st.sampled_from([1, 8, 16, 32, 40, 64, 96])),
             transpose=draw(st.booleans()), special=draw(st.sampled_from(["none", "none", "nan", "inf"])))
    sched = draw(st.sampled_from([None] + list(dash_plugin.SCHEDULES)))
    c["kw"] = dict(causal=causal, window=(draw(st.integers(-1, 12)), 0 if causal else draw(st.integers(-1, 12))),
                   softcap=draw(st.sampled_from([0.0, 2.5])), dropout_p=draw(st.sampled_from([0.0, 0.4])),
                   dropout_seed=draw(st.integers(0, 2 ** 40)), schedule=sched,
                   deterministic=False if sched == "atomic" else draw(st.sampled_from([None, True, False])))
    fault = draw(st.sampled_from([None] * len(FAULTS) + sorted(FAULTS)))
    if fault:
        FAULTS[fault](c)
    c["fault"] = fault
    return c


def _make(b, s, h, d, transpose, gen, dtype=torch.float32):
    if transpose:  # (B, H, S, D) memory seen as (B, S, H, D): non-contiguous, last dim still unit-stride
        return torch.randn(b, h, s, d, generator=gen, dtype=dtype).transpose(1, 2)
    return torch.randn(b, s, h, d, generator=gen, dtype=dtype)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_random_calls_match_reference_or_raise_clear_errors(c):
    gen = torch.Generator().manual_seed(c["sq"] * 1000 + c["sk"])
    q = _make(c["b"], c["sq"], c["hq"], c["d"], c["transpose"], gen)
    k = _make(c.get("bk", c["b"]), c["sk"], c["hkv"], c["d"], c["transpose"], gen, c.get("k_dtype", torch.float32))
    v = _make(c.get("bk", c["b"]), c["sk"], c["hkv"], c["d"], False, gen, c.get("k_dtype", torch.float32))
    if c["special"] != "none" and c["d"] > 0:
        q[0, 0, 0, 0] = float(c["special"])
    kw = c["kw"]
    if c["fault"]:
        try:
            dash_plugin.flash_attention(q, k, v, **kw)
        except (TypeError, ValueError) as err:
            assert any(w in str(err) for w in ("allowed", "must", "expected", "not deterministic")), str(err)
            return
        raise AssertionError(f"fault {c['fault']} was accepted")
    out, lse = dash_plugin.flash_attention(q, k, v, return_lse=True, **kw)
    left, right = kw["window"]
    want_out, want_lse = reference.attention_forward(
        q, k, v, softmax_scale=c["d"] ** -0.5, causal=kw["causal"], window_left=left, window_right=right,
        softcap=kw["softcap"], dropout_p=kw["dropout_p"], seed=kw["dropout_seed"] if kw["dropout_p"] > 0 else 0)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0, equal_nan=True)
