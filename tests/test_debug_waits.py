"""DASH_DEBUG_WAITS on the CPU, under the Triton interpreter: a wait that can never be satisfied
raises StuckWaitError naming the dQ tile and the rank, instead of spinning forever.

The interpreter runs programs one by one, so only acyclic schedules can run their waits here
(ascending, descending, spt: each waits on earlier-launched programs only). The injected wait is
the last contributor of a dQ tile with its rank raised by 1000 (tests/hardening_helpers.py). The GPU
version is in tests/test_gpu_hardening.py.
"""
import os

import pytest
import torch

from tests.hardening_helpers import (bitwise_equal, check_stuck_message, dense_inputs, inject_stuck_wait,
                                     varlen_inputs)

pytest.importorskip("triton")

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA, before triton is imported.
if os.environ.get("TRITON_INTERPRET") != "1":
    if torch.cuda.is_available():
        pytest.skip("GPU machine: tests/test_gpu_hardening.py tests the debug waits compiled",
                    allow_module_level=True)
    raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does it)")

from dash_plugin import dispatch  # noqa: E402
from dash_plugin.kernels import attn_fwd, reference  # noqa: E402
from dash_plugin.kernels.backends import StuckWaitError  # noqa: E402
from dash_plugin.schedules import plan as launch_plans  # noqa: E402


def triton_backward(*args, **kw):
    return dispatch.attention_backward(*args, backend="triton", **kw)

POLLS = "50"


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


# (schedule, layout): dense 1 x 64 x 1 head, or varlen lengths [20, 48, 5] (the wait is broken in
# sequence 1, the one with most steps, so the message must name that sequence).
CASES = [("ascending", "dense"), ("descending", "dense"), ("ascending", "varlen")]


def _problem(layout):
    # fp32 (bf16 tl.dot is wrong in the interpreter); tiles here: dQ 16 rows, KV 32 rows
    if layout == "dense":
        q, k, v, do = dense_inputs((1, 64, 64, 1, 1, 32), torch.float32, "cpu", seed=3)
        kw = {}
    else:
        q, k, v, do, kw = varlen_inputs([20, 48, 5], 1, 1, 32, torch.float32, "cpu", seed=3)
    kw.update(softmax_scale=32 ** -0.5, causal=True)
    return q, k, v, do, kw


@pytest.mark.parametrize("schedule, layout", CASES, ids=[f"{s}-{l}" for s, l in CASES])
def test_stuck_wait_raises_with_tile_and_rank(monkeypatch, schedule, layout):
    assert issubclass(StuckWaitError, RuntimeError)
    q, k, v, do, kw = _problem(layout)
    out, lse = attn_fwd.attention_forward(q, k, v, **kw)
    plain = triton_backward(do, q, k, v, out, lse, schedule=schedule, **kw)

    real = launch_plans.launch_plan
    injected = inject_stuck_wait(monkeypatch, POLLS)
    with pytest.raises(StuckWaitError) as err:
        triton_backward(do, q, k, v, out, lse, schedule=schedule, **kw)
    message = str(err.value)
    print(f"[stuck] {schedule}: injected {injected}; raised: {message}")
    assert injected["contributors"] >= 2, "the broken wait must follow other adds to the same tile"
    check_stuck_message(message, injected, sequence=injected["row"] if layout == "varlen" else None)
    if layout == "varlen":
        assert injected["row"] == 1

    # Without the injection the debug waits are satisfied, and the bits are those of a plain call.
    monkeypatch.setattr(launch_plans, "launch_plan", real)
    again = triton_backward(do, q, k, v, out, lse, schedule=schedule, **kw)
    assert all(bitwise_equal(a, b) for a, b in zip(plain, again)), "debug waits changed the result"
    d64 = [t.double() for t in (q, k, v, do)]
    o64, lse64 = reference.attention_forward(*d64[:3], **kw)
    g64 = reference.attention_backward(d64[3], *d64[:3], o64, lse64, **kw)
    for name, a, b in zip(("dq", "dk", "dv"), again, g64):
        assert _rel(a, b) < 1e-5, name
