"""kernels/buffers.py: the kernels' outputs and workspaces skip PyTorch's NaN fill under the
deterministic flag, and only there; their shape, strides, dtype and device are those of
torch.empty / torch.empty_like in every setting."""
import pytest
import torch

from dash_plugin.kernels import buffers
from tests.gpu_oracle import HOPPER_SKIP

SETTINGS = ((True, True), (True, False), (False, True))   # (torch flag, its fill)


@pytest.fixture
def flag():
    """Sets torch's deterministic flag and fill switch for one test, then restores them."""
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.utils.deterministic.fill_uninitialized_memory)

    def set_(on, fill=True):
        torch.use_deterministic_algorithms(on)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    yield set_
    torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    torch.utils.deterministic.fill_uninitialized_memory = was[2]


def layout(t):
    return t.shape, t.stride(), t.dtype, t.device, t.storage_offset()


# A contiguous tensor may have any stride on a dimension of size 1 (the Triton backward reads
# delta with lse's strides, and lse may be such a slice).
LIKE = {
    "plain": lambda dtype: torch.zeros(3, 5, 7, dtype=dtype),
    "size-1 slice": lambda dtype: torch.zeros(1, 4, 64, dtype=dtype)[:, 1:2],
    "expanded size-1": lambda dtype: torch.zeros(2, 1, 8, dtype=dtype).as_strided((2, 1, 8), (8, 99, 1)),
    "empty": lambda dtype: torch.zeros(0, 4, dtype=dtype),
    "0-d": lambda dtype: torch.zeros((), dtype=dtype),
    "strided": lambda dtype: torch.zeros(4, 6, dtype=dtype)[:, ::2],
}


@pytest.mark.parametrize("like", list(LIKE))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.int32))
@pytest.mark.parametrize("on, fill", SETTINGS)
def test_layout_is_torch_empty_s(flag, dtype, on, fill, like):
    flag(on, fill)
    t = LIKE[like](dtype)
    got = buffers.empty_like(t)
    assert layout(got) == layout(torch.empty_like(t))
    assert layout(buffers.empty(t.shape, dtype, "cpu")) == layout(torch.empty(t.shape, dtype=dtype))
    other = buffers.empty_like(t)
    if t.numel():
        assert got.untyped_storage().data_ptr() != other.untyped_storage().data_ptr()
    got.fill_(1)
    other.fill_(2)
    assert got.sum().item() == t.numel() and other.sum().item() == 2 * t.numel()   # separate, writable


def test_under_the_flag_the_memory_is_not_filled(flag):
    """64 MiB come from a fresh mapping (zero pages): NaN everywhere means the fill ran."""
    flag(True)
    n = 1 << 24
    for t in (buffers.empty((n,), torch.float32, "cpu"), buffers.empty_like(torch.zeros(n))):
        assert not torch.isnan(t).all()
    strided = buffers.empty_like(torch.zeros(2 * n)[::2])   # not contiguous: torch.empty_like, fill included
    assert torch.isnan(strided).all()


@pytest.mark.parametrize("on, fill, skip", ((False, True, True), (True, False, True), (True, True, False)))
def test_pytorchs_fill_where_there_is_nothing_to_skip_or_skipping_is_off(flag, monkeypatch, on, fill, skip):
    monkeypatch.setattr(buffers, "SKIP_FILL", skip)
    flag(on, fill)
    got = buffers.empty((1 << 24,), torch.float32, "cpu"), buffers.empty_like(torch.zeros(1 << 24))
    for t in got:
        assert torch.isnan(t).all() == (on and fill)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ("triton", pytest.param("hopper", marks=HOPPER_SKIP)))
@pytest.mark.parametrize("varlen", (False, True), ids=("dense", "packed"))
@pytest.mark.parametrize("schedule", ("auto", "descending"))   # Triton's auto is split: no dQ accumulator
@pytest.mark.parametrize("case", ("gqa4-causal-d128", "mha-window-sq-gt-sk-d64", "mha-full-dropout-d96"))
def test_kernels_under_the_flag_give_the_bits_without_it_and_free_their_buffers(flag, monkeypatch, backend, varlen,
                                                                                 schedule, case):
    """Forward and backward through the public API give one set of bits with the flag off, with
    the flag and its fill on, and with our buffers NaN-filled too (`SKIP_FILL` off): the kernels
    read nothing they did not write. The cases: GQA (Hopper's dK/dV through zeroed fp32
    accumulators), MHA (written directly), a window with more queries than keys (rows and Q tiles
    no key reaches, so the dQ accumulator is zeroed rather than stored first), hdim 96 with
    dropout. The storages made here go back to the caching allocator like any tensor's."""
    import dash_plugin
    heads, d, (sq, sk), mask = {
        "gqa4-causal-d128": ((8, 2), 128, (1000, 1000), dict(causal=True)),
        "mha-window-sq-gt-sk-d64": ((8, 8), 64, (1300, 700), dict(causal=True, window=(256, 0))),
        "mha-full-dropout-d96": ((4, 4), 96, (1000, 1000), dict(dropout_p=0.1, dropout_seed=3)),
    }[case]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, sq, heads[0], d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, sk, heads[1], d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    kw = dict(mask, deterministic=True, backend=backend, schedule=schedule)
    if varlen:
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        cu_q, cu_k = (torch.tensor([0, n // 3, 2 * n], device="cuda", dtype=torch.int32) for n in (sq, sk))
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=2 * sq - sq // 3, max_seqlen_k=2 * sk - sk // 3)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def call():
        out = dash_plugin.flash_attention(q, k, v, **kw)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        assert dash_plugin.last_resolved().concrete_backend == backend, dash_plugin.last_resolved().describe()
        return [t.clone() for t in (out, *grads)]
    runs = []
    for on, skip in ((False, True), (True, True), (True, False), (False, True), (True, True)):
        flag(on)
        monkeypatch.setattr(buffers, "SKIP_FILL", skip)
        runs.append(call())
    assert all(torch.isfinite(t).all() for t in runs[0])
    # A storage made here and never freed would hold one call's buffers (the fp32 dQ accumulator
    # alone is 2-8 MB) after each call.
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == held, "memory held after calls under the flag"
    for name, *same in zip(("out", "dq", "dk", "dv"), *runs):
        assert all(torch.equal(same[0], t) for t in same[1:]), \
            f"{name}: different bits (flag off, on, on with NaN-filled buffers)"
