"""GPU tests of dropout on both kernel backends, Triton and Hopper (marker `gpu`; skipped without
CUDA; the Hopper cases also without an sm90 GPU and the `hopper` extra). Every call goes through
`dash_plugin.flash_attention(..., dropout_p=, dropout_seed=, backend=, schedule=)`, bf16, head dims
64 and 128, MHA and GQA 4:1, causal and full, every deterministic schedule of each backend.

a. The forward's mask, read out exactly: with q = k = 0 every visible key of row i gets P = 1/n_i,
   and with V = identity (S_k = head dim) out[b, i, h, j] = keep(b, h, i, j) * keep_scale(p) / n_i.
   The decisions (out != 0) must equal `dropout_keep_mask` bit for bit, on both backends (so the
   backends draw one mask), and the kept values keep_scale(p) / n_i within bf16 rounding.
b. The backward's mask, read out through dV: same q, k, and dO = identity rows (S_q = head dim),
   so dV[b, j, hkv, i] = keep_scale(p) / n_i * (number of kept (h, i, j) over the KV head's query
   heads): the counts must equal the mask's, for every schedule.
c. out, dq, dk, dv with dropout (p = 0.1, 0.3) against the float64 oracle with the same mask,
   within twice the error of plain bf16 PyTorch math (tests/gpu_oracle.py).
d. The keep rate over 2**20 elements, within 5 sigma of 1 - effective_dropout_p(p) (p = 0.1, 0.5).
e. 1,000 forward + backward passes with dropout bitwise equal to a pass taken before another
   process started loading the GPU, per deterministic schedule and backend; different seeds (also
   seeds that differ only above bit 32) give different masks, each the definition's.
f. The Hopper kernels' mask at every tile shape they run, read out in chunks (forward and backward).
g. Packed (varlen) batches: the mask is keyed by the sequence's index and the positions inside
   it; a and b read out on both backends, the float64 oracle, 1,000 passes under load.
"""
import os

import pytest
import torch

import dash_plugin
from dash_plugin.schedules import registry
from dash_plugin.kernels.philox import effective_dropout_p, keep_scale
from dash_plugin.kernels.reference import visible_mask
from tests.gpu_oracle import HOPPER_SKIP, assert_within_bar, hopper_ready, keep_mask, oracle_and_bf16_math
from tests.hardening_helpers import gpu_load, count_mismatching_passes, cu_seqlens, dense_inputs, hang_guard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BACKENDS = ("triton", "hopper")
SCHEDULES = {b: tuple(s for s in registry.names(deterministic=True) if b in registry.get(s).backends)
             for b in BACKENDS}
N_PASSES = int(os.environ.get("DASH_DETERMINISM_PASSES", "1000"))
SEED = 20240611
DEVICE = "cuda"
HEADS = {"mha": (4, 4), "gqa4": (8, 2)}     # (H_q, H_kv)
# A kept value goes through at most two bf16 roundings (P * keep * scale before the PV / P^T dO
# product, then the result), each within 2**-9 relative; 2**-7 leaves room for the fp32 sums.
BF16_ROUNDING = 2.0 ** -7


def param(backend, *rest):
    return pytest.param(backend, *rest, marks=HOPPER_SKIP) if backend == "hopper" else pytest.param(backend, *rest)


def attention(q, k, v, *, backend, causal, dropout_p, seed, schedule="ascending"):
    """flash_attention on the named backend, checked to have run there."""
    out = dash_plugin.flash_attention(q, k, v, causal=causal, dropout_p=dropout_p, dropout_seed=seed,
                                      schedule=schedule, deterministic=True, backend=backend)
    got = dash_plugin.last_resolved()
    assert (got.concrete_backend, got.concrete_schedule) == (backend, schedule), got.describe()
    return out


def step(q, k, v, do, *, backend, schedule, causal, dropout_p, seed):
    """One forward + backward through the API: (out, dq, dk, dv)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = dash_plugin.flash_attention(*leaves, causal=causal, dropout_p=dropout_p, dropout_seed=seed,
                                      schedule=schedule, deterministic=True, backend=backend)
    return (out.detach(), *torch.autograd.grad(out, leaves, do))


def visible(seqlen_q, seqlen_k, causal):
    """(S_q, S_k) bool: keys each row attends to (causal: bottom-right aligned)."""
    return visible_mask(torch.arange(seqlen_q), torch.arange(seqlen_k), seqlen_q, seqlen_k, -1, 0 if causal else -1)


def identity(batch, seqlen, heads, d, dtype=torch.bfloat16):
    """(B, S, H, D) with x[b, i, h] = e_i (S = D)."""
    return torch.eye(seqlen, d, device=DEVICE, dtype=dtype).view(1, seqlen, 1, d).expand(
        batch, seqlen, heads, d).contiguous()


def forward_readout(backend, *, batch, hq, hkv, seqlen_q, d, causal, p, seed):
    """out of q = k = 0, V = identity (S_k = d), as (B, H_q, S_q, S_k) float64 on the CPU."""
    zeros = lambda s, h: torch.zeros(batch, s, h, d, device=DEVICE, dtype=torch.bfloat16)  # noqa: E731
    out = attention(zeros(seqlen_q, hq), zeros(d, hkv), identity(batch, d, hkv, d), backend=backend, causal=causal,
                    dropout_p=p, seed=seed)
    return out.permute(0, 2, 1, 3).double().cpu()


def check_counts(got, counts, scale_over_n, what):
    """got (float64) = counts * scale_over_n within bf16 rounding, zero exactly where counts are 0."""
    read = torch.round(got / scale_over_n).long()
    bad = read != counts
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} mask decisions differ from "
                           f"dropout_keep_mask; first at {bad.nonzero()[0].tolist()}")
    assert torch.equal(got == 0, counts == 0), f"{what}: dropped or masked elements are not exactly 0"
    kept = counts > 0
    if not kept.any():   # nothing kept or visible (an empty sequence): the zeros above are the check
        return
    want = (counts * scale_over_n)[kept]
    err = ((got[kept] - want).abs() / want).max().item()
    assert err <= BF16_ROUNDING, f"{what}: kept values off by {err:.2e} relative (bf16 rounding: {BF16_ROUNDING:.2e})"


# ---------------------------------------------------------------- a. the forward's mask
FWD_CASES = [param(b, d, h, c, sq) for b in BACKENDS for d in (64, 128) for h in HEADS for c in (False, True)
             for sq in ((d,) if b == "hopper" else (d, 4 * d))]   # Hopper: seqlen_q == seqlen_k only


def check_forward_mask(backend, *, d, hq, hkv, causal, seqlen_q, p, what):
    """The forward's output with q = k = 0 and V = identity is exactly the mask (kept: the keep
    scale over the row's visible keys, dropped: 0)."""
    batch = 2
    got = forward_readout(backend, batch=batch, hq=hq, hkv=hkv, seqlen_q=seqlen_q, d=d, causal=causal, p=p,
                          seed=SEED)
    vis = visible(seqlen_q, d, causal)
    counts = (keep_mask(SEED, p, batch, hq, seqlen_q, d) & vis).long()
    n = vis.sum(-1, keepdim=True).clamp_min(1).double()
    check_counts(got, counts, keep_scale(p) / n, what)


@pytest.mark.parametrize("backend, d, heads, causal, seqlen_q", FWD_CASES)
def test_forward_mask_read_out_exactly(backend, d, heads, causal, seqlen_q):
    hq, hkv = HEADS[heads]
    check_forward_mask(backend, d=d, hq=hq, hkv=hkv, causal=causal, seqlen_q=seqlen_q, p=0.3, what=f"{backend} forward")


@pytest.mark.parametrize("p", [0.004, 0.3, 0.5, 0.504, 0.51, 0.7, 0.99, 0.997])
@pytest.mark.parametrize("causal", [False, True])
@HOPPER_SKIP
def test_hopper_forward_mask_at_thresholds_on_both_sides_of_one_half(causal, p):
    """The Hopper forward compares four draws at once by a formula that differs below and above a
    threshold of 128 (kernels/philox.py:four_draws_kept): the smallest threshold (1), one half
    (128, the last of the lower formula), the first above (129, p = 0.504), the largest (255,
    p = 0.997), and 77, 131, 179 and 253 between them."""
    hq, hkv = HEADS["mha"]
    check_forward_mask("hopper", d=128, hq=hq, hkv=hkv, causal=causal, seqlen_q=128, p=p, what=f"hopper forward p={p}")


# ---------------------------------------------------------------- b. the backward's mask, through dV
BWD_CASES = [param(b, s, d, h, c, sk) for b in BACKENDS for s in SCHEDULES[b] for d in (64, 128) for h in HEADS
             for c in (False, True) for sk in ((d,) if b == "hopper" else (d, 2 * d))]


@pytest.mark.parametrize("backend, schedule, d, heads, causal, seqlen_k", BWD_CASES)
def test_backward_mask_read_out_exactly_through_dv(backend, schedule, d, heads, causal, seqlen_k):
    hq, hkv = HEADS[heads]
    p, batch, seqlen_q = 0.3, 2, d
    g = torch.Generator(device=DEVICE).manual_seed(1)
    q = torch.zeros(batch, seqlen_q, hq, d, device=DEVICE, dtype=torch.bfloat16)
    k = torch.zeros(batch, seqlen_k, hkv, d, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen_k, hkv, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
    do = identity(batch, seqlen_q, hq, d)
    _, _, _, dv = step(q, k, v, do, backend=backend, schedule=schedule, causal=causal, dropout_p=p, seed=SEED)
    assert dash_plugin.last_resolved().concrete_backend == backend
    got = dv.permute(0, 2, 3, 1).double().cpu()             # (B, H_kv, i, j)
    vis = visible(seqlen_q, seqlen_k, causal)
    keep = keep_mask(SEED, p, batch, hq, seqlen_q, seqlen_k) & vis
    counts = keep.view(batch, hkv, hq // hkv, seqlen_q, seqlen_k).sum(2)   # query heads h // group share a KV head
    n = vis.sum(-1, keepdim=True).clamp_min(1).double()
    check_counts(got, counts, keep_scale(p) / n, f"{backend} {schedule} dV")


# ---------------------------------------------------------------- c. against the float64 oracle
SHAPES = {"mha": (2, 1000, 4, 4), "gqa4": (2, 1024, 8, 2)}   # (B, S, H_q, H_kv), as tests/test_gpu_hopper.py


@pytest.fixture(scope="module", params=[(n, d, c, p) for n in SHAPES for d in (64, 128) for c in (True, False)
                                        for p in (0.1, 0.3)],
                ids=lambda x: f"{x[0]}-d{x[1]}-{'causal' if x[2] else 'full'}-p{x[3]}")
def oracle_problem(request):
    name, d, causal, p = request.param
    b, s, hq, hkv = SHAPES[name]
    q, k, v, do = dense_inputs((b, s, s, hq, hkv, d), torch.bfloat16, DEVICE, seed=7)
    oracle = oracle_and_bf16_math(q, k, v, do, causal=causal, dropout_p=p, seed=SEED)
    return dict(q=q, k=k, v=v, do=do, causal=causal, p=p), oracle


@pytest.mark.parametrize("backend, schedule", [param(b, s) for b in BACKENDS for s in SCHEDULES[b]])
def test_matches_float64_oracle_with_the_same_mask(oracle_problem, backend, schedule):
    pr, oracle = oracle_problem
    kw = dict(backend=backend, schedule=schedule, causal=pr["causal"], dropout_p=pr["p"], seed=SEED)
    got = step(pr["q"], pr["k"], pr["v"], pr["do"], **kw)
    assert dash_plugin.last_resolved().concrete_backend == backend
    for name, x, want, bar in zip(("out", "dq", "dk", "dv"), got, [oracle.out, *oracle.grads],
                                  [oracle.out_bar, *oracle.grad_bars]):
        assert_within_bar(name, x, want, bar)


# ---------------------------------------------------------------- d. the keep rate
@pytest.mark.parametrize("backend, p", [param(b, p) for b in BACKENDS for p in (0.1, 0.5)])
def test_keep_rate_over_a_million_elements(backend, p):
    batch, heads, d = 4, 16, 128
    got = forward_readout(backend, batch=batch, hq=heads, hkv=heads, seqlen_q=d, d=d, causal=False, p=p, seed=SEED)
    keep = keep_mask(SEED, p, batch, heads, d, d)
    check_counts(got, keep.long(), torch.tensor(keep_scale(p) / d, dtype=torch.float64), f"{backend} forward")
    n = got.numel()
    assert n >= 2 ** 20
    rate = (got != 0).double().mean().item()
    want = 1 - effective_dropout_p(p)
    sigma = (want * (1 - want) / n) ** 0.5
    print(f"[dropout keep rate] {backend} p={p}: {rate:.6f} over {n} elements, expected {want:.6f} "
          f"({(rate - want) / sigma:+.2f} sigma)")
    assert abs(rate - want) <= 5 * sigma


# ---------------------------------------------------------------- e. bitwise over many passes, seeds
# Head dim 128 everywhere; 64 on the Hopper backend too, whose backward draws part of the mask
# while its products run there (bwd_sm90.ahead_units) and nowhere else.
PASS_CASES = [param(b, s, c, d) for b in BACKENDS for s in SCHEDULES[b] for c in (True, False)
              for d in ((64, 128) if b == "hopper" else (128,))]
PASS_SHAPE = (2, 1024, 1024, 8, 2)   # (B, S_q, S_k, H_q, H_kv) and D: GQA 4:1, eight KV tiles at D = 128
PASS_P = 0.1


@pytest.fixture(scope="module")
def loaded_gpu():
    """Inputs per (mask, head dim), each case's first pass taken before the load starts, and the
    load process."""
    problems = {(c, d): dense_inputs((*PASS_SHAPE, d), torch.bfloat16, DEVICE, seed=2)
                for c in (True, False) for d in (64, 128)}
    unloaded = {}
    for case in PASS_CASES:
        backend, schedule, causal, d = case.values
        if backend == "hopper" and not hopper_ready():
            continue
        try:
            unloaded[case.values] = step(*problems[causal, d], backend=backend, schedule=schedule, causal=causal,
                                         dropout_p=PASS_P, seed=SEED)
        except Exception as exc:  # raised again by that case's test, not by every test of the fixture
            unloaded[case.values] = exc
    torch.cuda.synchronize()
    with gpu_load() as proc:
        yield problems, unloaded, proc


@pytest.mark.parametrize("backend, schedule, causal, d", PASS_CASES)
def test_bitwise_equal_over_many_passes_with_dropout_under_another_process(loaded_gpu, backend, schedule, causal, d):
    problems, unloaded, load = loaded_gpu
    first = unloaded[(backend, schedule, causal, d)]
    if isinstance(first, Exception):
        raise first
    kw = dict(backend=backend, schedule=schedule, causal=causal, dropout_p=PASS_P, seed=SEED)
    with hang_guard(600):
        bad = count_mismatching_passes(lambda: step(*problems[causal, d], **kw), N_PASSES, reference=first)
    assert load.alive(), f"load process died: {load.stderr()}"
    print(f"[dropout load] {backend} {schedule} {'causal' if causal else 'full'} hdim{d}: {N_PASSES} passes of "
          f"out, dq, dk, dv, {bad} mismatching")
    assert bad == 0


@pytest.mark.parametrize("backend", [param(b) for b in BACKENDS])
def test_different_seeds_give_different_masks(backend):
    p, batch, heads, d = 0.3, 2, 4, 128
    seeds = (SEED, SEED + 1, SEED + 2 ** 32)   # the last differs only in the key's high word
    masks = []
    for seed in seeds:
        got = forward_readout(backend, batch=batch, hq=heads, hkv=heads, seqlen_q=d, d=d, causal=False, p=p,
                              seed=seed)
        keep = keep_mask(seed, p, batch, heads, d, d)
        check_counts(got, keep.long(), torch.tensor(keep_scale(p) / d, dtype=torch.float64),
                     f"{backend} forward, seed {seed}")
        masks.append(got != 0)
    expected = 2 * p * (1 - p)   # independent masks differ at this fraction of the elements
    for i in range(len(seeds)):
        for j in range(i):
            differ = (masks[i] != masks[j]).double().mean().item()
            assert differ > expected / 2, f"seeds {seeds[j]} and {seeds[i]}: masks differ at {differ:.3f} only"
    # ... and so do the outputs and the gradients of a random problem
    q, k, v, do = dense_inputs((2, 512, 512, 4, 4, 128), torch.bfloat16, DEVICE, seed=3)
    a, b = (step(q, k, v, do, backend=backend, schedule="ascending", causal=True, dropout_p=p, seed=s)
            for s in seeds[:2])
    assert not any(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------- f. every Hopper tile shape
# The Hopper kernels split each 16-score Philox group between two lanes and pair the groups of a
# thread's column quads; a tile whose quads are odd in number leaves one group unpaired. Each tile
# shape, read out in chunks of head-dim keys (forward) and queries (backward, through dV): hdim 96
# full (144-key forward tiles), hdim 128 full (64-query backward tiles: with dropout it does not run
# FA4's 80, tile_table.DROPOUT_FULL_TILES), hdim 192 (112-key forward
# tiles; 48 keys per warpgroup in the backward), hdim 256 (80-key forward tiles; the backward's
# column pairs), hdim 64 causal, a window, MHA and GQA, lengths that cut tiles.
TILE_CASES = [pytest.param(*case, marks=HOPPER_SKIP) for case in (
    (128, "mha", "causal", 300), (128, "gqa4", "full", 200), (128, "mha", "window", 333),
    (64, "mha", "full", 200), (64, "gqa4", "causal", 300), (96, "mha", "full", 250), (96, "gqa4", "causal", 300),
    (192, "mha", "causal", 300), (192, "gqa4", "full", 200), (256, "gqa4", "full", 200), (256, "mha", "causal", 300))]
WINDOWS = {"causal": (-1, 0), "full": (-1, -1), "window": (150, 30)}


def chunk_identity(batch, seqlen, heads, d, start):
    """(B, S, H, D): row start + t is e_t for t < d (as far as S reaches), every other row 0."""
    x = torch.zeros(batch, seqlen, heads, d, device=DEVICE, dtype=torch.bfloat16)
    n = min(d, seqlen - start)
    x[:, start:start + n] = torch.eye(n, d, device=DEVICE, dtype=torch.bfloat16).view(1, n, 1, d)
    return x


@pytest.mark.parametrize("d, heads, mask, seqlen", TILE_CASES)
def test_hopper_mask_at_every_tile_shape_read_out_in_chunks(d, heads, mask, seqlen):
    """q = k = 0 makes P uniform over a row's visible keys. Forward: V = identity on keys
    [k0, k0 + d) gives out[i, j] = keep(i, k0 + j) * scale / n_i. Backward: dO = identity on
    queries [q0, q0 + d) gives dV[j, i] = sum over the KV head's query heads of
    keep(q0 + i, j) * scale / n_(q0 + i). Both must be the definition's mask exactly."""
    hq, hkv = HEADS[heads]
    p, batch, window = 0.3, 2, WINDOWS[mask]
    zeros = lambda h: torch.zeros(batch, seqlen, h, d, device=DEVICE, dtype=torch.bfloat16)  # noqa: E731
    vis = visible_mask(torch.arange(seqlen), torch.arange(seqlen), seqlen, seqlen, *window)
    keep = keep_mask(SEED, p, batch, hq, seqlen, seqlen) & vis
    scale_over_n = keep_scale(p) / vis.sum(-1, keepdim=True).clamp_min(1).double()
    fwd = torch.zeros(batch, hq, seqlen, seqlen, dtype=torch.float64)
    bwd = torch.zeros(batch, hkv, seqlen, seqlen, dtype=torch.float64)
    g = torch.Generator(device=DEVICE).manual_seed(2)
    for start in range(0, seqlen, d):
        n = min(d, seqlen - start)
        leaves = [t.requires_grad_() for t in (zeros(hq), zeros(hkv),
                                               chunk_identity(batch, seqlen, hkv, d, start))]
        out = dash_plugin.flash_attention(*leaves, window=window, dropout_p=p, dropout_seed=SEED,
                                          schedule="descending", deterministic=True, backend="hopper")
        got = dash_plugin.last_resolved()
        assert (got.concrete_backend, got.concrete_schedule) == ("hopper", "descending"), got.describe()
        fwd[..., start:start + n] = out.detach().permute(0, 2, 1, 3).double().cpu()[..., :n]
        leaves[2] = torch.randn(batch, seqlen, hkv, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
        leaves = [t.detach().requires_grad_() for t in leaves]
        out = dash_plugin.flash_attention(*leaves, window=window, dropout_p=p, dropout_seed=SEED,
                                          schedule="descending", deterministic=True, backend="hopper")
        (dv,) = torch.autograd.grad(out, leaves[2], chunk_identity(batch, seqlen, hq, d, start))
        bwd[:, :, start:start + n] = dv.permute(0, 2, 3, 1).double().cpu()[:, :, :n]
    check_counts(fwd, keep.long(), scale_over_n, f"hdim {d} {heads} {mask} forward")
    counts = keep.view(batch, hkv, hq // hkv, seqlen, seqlen).sum(2)   # query heads h // group share a KV head
    check_counts(bwd, counts, scale_over_n, f"hdim {d} {heads} {mask} backward (dV)")


# ---------------------------------------------------------------- g. packed (varlen) batches
def packed_lengths(d):
    """(queries, keys) per sequence, each side at most d (the read-outs' identity matrices): a full
    square, fewer queries than keys, more queries than keys (rows that see no key under a causal
    mask), an empty sequence and a short one."""
    return ((d, d), (d // 2, d), (d, 50), (0, 0), (37, 37))


def packed_call(q, k, v, lengths, *, backend, schedule, causal, p, seed):
    """flash_attention on a packed batch of `lengths`, checked to have run on `backend`."""
    out = dash_plugin.flash_attention(
        q, k, v, cu_seqlens_q=cu_seqlens([a for a, _ in lengths], DEVICE), cu_seqlens_k=cu_seqlens([b for _, b in lengths], DEVICE),
        max_seqlen_q=max(a for a, _ in lengths), max_seqlen_k=max(b for _, b in lengths), causal=causal,
        dropout_p=p, dropout_seed=seed, schedule=schedule, deterministic=True, backend=backend)
    got = dash_plugin.last_resolved()
    assert (got.concrete_backend, got.concrete_schedule) == (backend, schedule), got.describe()
    return out


def packed_identity(lengths, side, heads, d):
    """(T, H, D): row t of each sequence is e_(its position in the sequence); side 0: queries, 1: keys."""
    return torch.cat([torch.eye(n[side], d, device=DEVICE, dtype=torch.bfloat16) for n in lengths]).view(
        -1, 1, d).expand(-1, heads, d).contiguous()


def sequence_mask(b, sq, sk, hq, causal, p, seed):
    """(H_q, S_q, S_k) kept and visible elements of sequence `b`, and the visible keys per row."""
    vis = visible(sq, sk, causal)
    keep = keep_mask(seed, p, 1, hq, sq, sk, first_batch=b)[0]
    return keep & vis, vis.sum(-1, keepdim=True).clamp_min(1).double()


PACKED_PROBLEMS = [(d, h, c) for d in (64, 128) for h in HEADS for c in (False, True)]


@pytest.mark.parametrize("backend, d, heads, causal", [param(b, *x) for b in BACKENDS for x in PACKED_PROBLEMS])
def test_packed_forward_mask_read_out_exactly(backend, d, heads, causal):
    hq, hkv = HEADS[heads]
    p, lengths = 0.3, packed_lengths(d)
    tq, tk = (sum(n[i] for n in lengths) for i in (0, 1))
    q = torch.zeros(tq, hq, d, device=DEVICE, dtype=torch.bfloat16)
    k = torch.zeros(tk, hkv, d, device=DEVICE, dtype=torch.bfloat16)
    out = packed_call(q, k, packed_identity(lengths, 1, hkv, d), lengths, backend=backend, schedule="ascending",
                      causal=causal, p=p, seed=SEED).double().cpu()
    row = 0
    for b, (sq, sk) in enumerate(lengths):
        keep, n = sequence_mask(b, sq, sk, hq, causal, p, SEED)
        got = out[row:row + sq, :, :sk].permute(1, 0, 2)   # (H_q, S_q, S_k)
        check_counts(got, keep.long(), keep_scale(p) / n, f"{backend} packed forward, sequence {b}")
        assert (out[row:row + sq, :, sk:] == 0).all()
        row += sq


# Hopper: every order it runs on packed batches (not shift); Triton, whose packed dropout is older
# and tested dense above: its default and one ordered schedule, to show it draws the same mask.
PACKED_SCHEDULES = {"hopper": tuple(s for s in SCHEDULES["hopper"] if s != "shift"), "triton": ("split", "descending")}
PACKED_BWD = [param(b, s, *x) for b in BACKENDS for s in PACKED_SCHEDULES[b] for x in PACKED_PROBLEMS]


@pytest.mark.parametrize("backend, schedule, d, heads, causal", PACKED_BWD)
def test_packed_backward_mask_read_out_exactly_through_dv(backend, schedule, d, heads, causal):
    hq, hkv = HEADS[heads]
    p, lengths = 0.3, packed_lengths(d)
    tq, tk = (sum(n[i] for n in lengths) for i in (0, 1))
    g = torch.Generator(device=DEVICE).manual_seed(1)
    leaves = [torch.zeros(tq, hq, d, device=DEVICE, dtype=torch.bfloat16),
              torch.zeros(tk, hkv, d, device=DEVICE, dtype=torch.bfloat16),
              torch.randn(tk, hkv, d, device=DEVICE, dtype=torch.bfloat16, generator=g)]
    leaves = [t.requires_grad_() for t in leaves]
    out = packed_call(*leaves, lengths, backend=backend, schedule=schedule, causal=causal, p=p, seed=SEED)
    dv = torch.autograd.grad(out, leaves, packed_identity(lengths, 0, hq, d))[2].double().cpu()
    col = 0
    for b, (sq, sk) in enumerate(lengths):
        keep, n = sequence_mask(b, sq, sk, hq, causal, p, SEED)
        counts = keep.view(hkv, hq // hkv, sq, sk).sum(1)   # (H_kv, S_q, S_k)
        got = dv[col:col + sk, :, :sq].permute(1, 2, 0)     # (H_kv, i, j)
        check_counts(got, counts, keep_scale(p) / n, f"{backend} {schedule} packed dV, sequence {b}")
        assert (dv[col:col + sk, :, sq:] == 0).all()
        col += sk


PACKED_ORACLE_LENGTHS = ((1000, 1000), (129, 129), (0, 0), (700, 300), (256, 1100))


@pytest.fixture(scope="module", params=[(d, h, c) for d, h in ((64, "mha"), (128, "gqa4")) for c in (True, False)],
                ids=lambda x: f"d{x[0]}-{x[1]}-{'causal' if x[2] else 'full'}")
def packed_oracle_problem(request):
    from tests.gpu_oracle import packed_oracle_and_bf16_math
    d, heads, causal = request.param
    hq, hkv = HEADS[heads]
    g = torch.Generator(device=DEVICE).manual_seed(8)
    tq, tk = (sum(n[i] for n in PACKED_ORACLE_LENGTHS) for i in (0, 1))
    q, k, v, do = (torch.randn(t, h, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
                   for t, h in ((tq, hq), (tk, hkv), (tk, hkv), (tq, hq)))
    cu_q, cu_k = (cu_seqlens([n[i] for n in PACKED_ORACLE_LENGTHS], DEVICE) for i in (0, 1))
    oracle = packed_oracle_and_bf16_math(q, k, v, do, cu_q, cu_k, causal=causal, dropout_p=0.1, seed=SEED)
    return dict(q=q, k=k, v=v, do=do, causal=causal), oracle


@pytest.mark.parametrize("backend, schedule", [param(b, s) for b in BACKENDS for s in PACKED_SCHEDULES[b]])
def test_packed_batch_matches_float64_oracle_with_the_same_mask(packed_oracle_problem, backend, schedule):
    pr, oracle = packed_oracle_problem
    leaves = [pr[n].detach().requires_grad_() for n in ("q", "k", "v")]
    out = packed_call(*leaves, PACKED_ORACLE_LENGTHS, backend=backend, schedule=schedule, causal=pr["causal"],
                      p=0.1, seed=SEED)
    got = (out.detach(), *torch.autograd.grad(out, leaves, pr["do"]))
    for name, x, want, bar in zip(("out", "dq", "dk", "dv"), got, [oracle.out, *oracle.grads],
                                  [oracle.out_bar, *oracle.grad_bars]):
        assert_within_bar(name, x, want, bar)


@pytest.mark.parametrize("schedule", [pytest.param(s, marks=HOPPER_SKIP) for s in ("descending", "arrival", "spt")])
def test_packed_dropout_bitwise_equal_over_many_passes_under_another_process(schedule):
    lengths = ((1000, 1000), (2048, 2048), (333, 333), (0, 0), (700, 1500))
    g = torch.Generator(device=DEVICE).manual_seed(9)
    tq, tk = (sum(n[i] for n in lengths) for i in (0, 1))
    q, k, v, do = (torch.randn(t, h, 128, device=DEVICE, dtype=torch.bfloat16, generator=g)
                   for t, h in ((tq, 8), (tk, 2), (tk, 2), (tq, 8)))

    def one_pass():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = packed_call(*leaves, lengths, backend="hopper", schedule=schedule, causal=True, p=PASS_P, seed=SEED)
        return (out.detach(), *torch.autograd.grad(out, leaves, do))
    first = one_pass()
    torch.cuda.synchronize()
    with gpu_load() as load, hang_guard(600):
        bad = count_mismatching_passes(one_pass, N_PASSES, reference=first)
        assert load.alive(), f"load process died: {load.stderr()}"
    print(f"[dropout load] hopper packed {schedule} causal: {N_PASSES} passes of out, dq, dk, dv, {bad} mismatching")
    assert bad == 0
