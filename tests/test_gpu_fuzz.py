"""Random calls through the public API on each GPU backend against the float64 oracle (marker
`gpu`). The fixed-fixture tests choose their shapes; these draw them: lengths from 1 up (odd ones,
queries != keys), head dims, GQA ratios, masks, windows, softcap, dropout, packed batches with
empty sequences, non-contiguous inputs, fp16 and bf16, any schedule. The cases come from a fixed
seed, so every run draws the same ones (a failure names its case and repeats).

Each call's out and gradients must be within twice plain math's error against the oracle
(tests/gpu_oracle.py), and a second call must give the same bits. A backend may refuse a call it
does not cover (a ValueError that names the backend); the test then asserts the refusal is one the
backend documents, and at least half of a backend's cases must run."""
import random

import pytest
import torch

import dash_plugin
from tests.gpu_oracle import HOPPER_SKIP, oracle_of_call, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCHEDULES = ("auto", "ascending", "spt", "descending", "shift", "arrival", "split")
HEAD_DIMS = {"triton": (16, 32, 40, 64, 80, 96, 128, 160, 256), "hopper": (40, 64, 80, 128)}
CASES = {"triton": 48, "hopper": 12, "hopper-shapes": 24}   # Hopper kernels compile per feature set (tens of seconds each)
# Groups of cases run on another backend: "hopper-shapes" draws shapes only (lengths, batch, packing,
# mask, layout) on one feature set, so its calls share a few compiled kernels and the Hopper backend
# sees many more shapes than its compile time allows "hopper" to draw.
RUNS_ON = {"hopper-shapes": "hopper"}
# What the Hopper backend's `supports` names when it leaves a call to Triton (kernels/hopper_backend.py)
HOPPER_REFUSALS = ("an empty sequence", "softcap with dropout", "schedule='shift' with varlen",
                   "schedule='arrival' with varlen", "does not implement schedule='split'")


def draw_case(backend: str, index: int) -> dict:
    if backend == "hopper-shapes":
        case = draw_case("hopper", 1000 + index)
        case.update(window=(-1, -1), softcap=0.0, dropout_p=0.0, dtype=torch.bfloat16, head_dim=128, group=1,
                    hkv=2, schedule="descending", batch=max(case["batch"], 2))
        if case["packed"] and len(case["lens_q"]) < 2:   # at least two sequences, as the dense batch
            case["lens_q"], case["lens_k"] = case["lens_q"] * 2, case["lens_k"] * 2
        return case
    rng = random.Random(f"{backend}-{index}")
    packed = rng.random() < 0.4
    causal = rng.random() < 0.5
    window = (-1, -1)
    if rng.random() < 0.3:
        window = (rng.choice((0, 1, 31, 64, 200)), 0 if causal else rng.choice((-1, 0, 17, 128)))
    n_seq = rng.randint(1, 3)
    lens_q = [rng.choice((0, 1, 2, 63, 64, 65, 127, 129, 300, 511, 700)) if packed else 0 for _ in range(n_seq)]
    if packed and not any(lens_q):
        lens_q[0] = 129
    same = rng.random() < 0.6
    lens_k = list(lens_q) if same else [rng.choice((1, 17, 128, 255, 640)) for _ in range(n_seq)]
    sq = rng.choice((1, 2, 64, 65, 127, 200, 333, 512, 700))
    sk = sq if same else rng.choice((1, 17, 128, 255, 640))
    group = rng.choice((1, 2, 4))
    return dict(packed=packed, causal=causal, window=window, batch=n_seq, lens_q=lens_q, lens_k=lens_k, sq=sq,
                sk=sk, hkv=rng.choice((1, 2)), group=group, head_dim=rng.choice(HEAD_DIMS[backend]),
                softcap=rng.choice((0.0, 0.0, 15.0, 40.0)), dropout_p=rng.choice((0.0, 0.0, 0.1, 0.3)),
                dtype=rng.choice((torch.bfloat16, torch.float16)), transposed=rng.random() < 0.3,
                schedule=rng.choice(SCHEDULES), seed=rng.randrange(1 << 30))


def build(case):
    g = torch.Generator(device="cuda").manual_seed(case["seed"])
    hq, hkv, d = case["hkv"] * case["group"], case["hkv"], case["head_dim"]

    def draw(*shape):
        if case["transposed"]:   # the same values through a non-contiguous view (heads before tokens)
            t = torch.randn(*shape[:-3], shape[-2], shape[-3], shape[-1], device="cuda", generator=g)
            return t.to(case["dtype"]).transpose(-3, -2)
        return torch.randn(*shape, device="cuda", generator=g).to(case["dtype"])

    if case["packed"]:
        tq, tk = sum(case["lens_q"]), sum(case["lens_k"])
        q, k, v, do = draw(tq, hq, d), draw(tk, hkv, d), draw(tk, hkv, d), draw(tq, hq, d)
        cu = [torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device="cuda", dtype=torch.int32)
              for lens in (case["lens_q"], case["lens_k"])]
        extra = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
    else:
        b = case["batch"]
        q, k, v, do = draw(b, case["sq"], hq, d), draw(b, case["sk"], hkv, d), draw(b, case["sk"], hkv, d), \
            draw(b, case["sq"], hq, d)
        extra = {}
    return q, k, v, do, extra


def describe(case):
    shape = f"packed {case['lens_q']}x{case['lens_k']}" if case["packed"] else \
        f"{case['batch']}x{case['sq']}x{case['sk']}"
    return (f"{shape} hkv={case['hkv']} group={case['group']} d={case['head_dim']} causal={case['causal']} "
            f"window={case['window']} softcap={case['softcap']} p={case['dropout_p']} {case['dtype']} "
            f"transposed={case['transposed']} schedule={case['schedule']}")


def run(case, backend, q, k, v, do, extra):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = dash_plugin.flash_attention(*leaves, causal=case["causal"], window=case["window"], softcap=case["softcap"],
                                      dropout_p=case["dropout_p"], dropout_seed=case["seed"], backend=backend,
                                      schedule=case["schedule"], **extra)
    ran = dash_plugin.last_resolved()
    grads = torch.autograd.grad(out, leaves, do) if out.numel() else [torch.zeros_like(t) for t in leaves]
    return ran, [out.detach(), *grads]


# dq and dk flow through delta = rowsum(dO * O) with O rounded to the inputs' dtype, as in every
# FlashAttention backward. Where dq is small against its terms (rows of one or two keys: exactly 0
# for one key, where plain math's autograd gives an exact 0), that rounding dominates, so their
# bar has a floor of four bf16 rounding steps; a missing tile or a wrong mask is far above it.
DELTA_FLOOR = 2 ** -6


def within(name, got, want, bar, floor=0.0, unit=1.0):
    """Relative error within max(2 x plain math's, floor). Where the oracle is exactly 0 (every
    row of one key), what is left is the rounding of delta, one residual of about `unit` x 2**-8
    per term summed, of random sign: its rms must stay within floor x `unit` (the terms' count
    folded in by the caller), or be exactly 0 without a floor."""
    assert torch.isfinite(got).all(), f"{name}: NaN/inf"
    if want.norm() == 0:
        size = got.float().pow(2).mean().sqrt().item() if got.numel() else 0.0
        assert size <= floor * unit, f"{name}: the oracle is 0, got rms {size:.2e} (allowed {floor * unit:.2e})"
        return
    err, limit = rel(got.reshape(want.shape), want), max(2 * bar, floor)
    assert err <= limit, f"{name}: error {err:.2e} > {limit:.2e} (plain math {bar:.2e})"


@pytest.mark.parametrize("group, index", [pytest.param(b, i, id=f"{b}-{i}", marks=HOPPER_SKIP if b != "triton" else ())
                                         for b in CASES for i in range(CASES[b])])
def test_random_call_matches_the_oracle_and_repeats_its_bits(group, index):
    case = draw_case(group, index)
    backend = RUNS_ON.get(group, group)
    q, k, v, do, extra = build(case)
    try:
        ran, got = run(case, backend, q, k, v, do, extra)
    except ValueError as exc:
        message = str(exc)
        assert f"backend={backend!r}" in message, f"{describe(case)}: {message}"
        if backend == "hopper":
            assert any(r in message for r in HOPPER_REFUSALS), f"{describe(case)}: {message}"
        pytest.skip(f"refused, as documented: {message}")
    assert ran.concrete_backend == backend, describe(case)
    _, again = run(case, backend, q, k, v, do, extra)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), f"{describe(case)}: a second call gave other bits"
    left, right = case["window"]
    oracle = oracle_of_call(q, k, v, do, causal=case["causal"], window_left=left, window_right=right,
                            softcap=case["softcap"], dropout_p=case["dropout_p"], seed=case["seed"], **extra)
    # a dq entry sums a term per key of its row, a dk entry one per query (and query head) of its key
    term = (do.float().pow(2).mean() * v.float().pow(2).mean() * k.float().pow(2).mean()).sqrt().item()
    seq_q, seq_k = (max(case["lens_q"]), max(case["lens_k"])) if case["packed"] else (case["sq"], case["sk"])
    units = {"dq": term * seq_k ** 0.5, "dk": term * (seq_q * case["group"]) ** 0.5}
    for name, x, want, bar in zip(("out", "dq", "dk", "dv"), got, [oracle.out, *oracle.grads],
                                  [oracle.out_bar, *oracle.grad_bars]):
        floor = DELTA_FLOOR if name in units else 0.0
        within(f"{describe(case)}: {name}", x, want, bar, floor, units.get(name, 1.0))


@pytest.mark.parametrize("group", [pytest.param(b, marks=HOPPER_SKIP if b != "triton" else ()) for b in CASES])
def test_most_random_calls_run(group):
    """The refusals above must not hollow the test out: at least half of a group's cases run."""
    from dash_plugin import dispatch
    backend, ran = RUNS_ON.get(group, group), 0
    for index in range(CASES[group]):
        case = draw_case(group, index)
        q, k, _, _, extra = build(case)
        lengths = (max(case["lens_q"]), max(case["lens_k"])) if case["packed"] else (case["sq"], case["sk"])
        try:
            dispatch.resolve(backend, case["schedule"], q, k, max_seqlen_q=lengths[0], max_seqlen_k=lengths[1],
                             causal=case["causal"], window_left=case["window"][0], window_right=case["window"][1],
                             softcap=case["softcap"], dropout_p=case["dropout_p"], **extra)
            ran += 1
        except ValueError:
            pass
    assert ran >= CASES[group] // 2, f"{group}: {ran} of {CASES[group]} cases run"
