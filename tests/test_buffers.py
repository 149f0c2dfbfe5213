"""kernels/buffers.py: the kernels' outputs and workspaces skip PyTorch's NaN fill under the
deterministic flag, and only there; everything else about the tensors is torch.empty's."""
import pytest
import torch

from dash_plugin.kernels import buffers


@pytest.fixture
def flag():
    """Sets torch's deterministic flag and fill switch for one test, then restores both."""
    was = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory

    def set_(on, fill=True):
        torch.use_deterministic_algorithms(on)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    yield set_
    torch.use_deterministic_algorithms(was[0])
    torch.utils.deterministic.fill_uninitialized_memory = was[1]


@pytest.fixture
def filled_allocations(monkeypatch):
    """Numbers of elements of each torch.empty / torch.empty_like call (the calls PyTorch fills)."""
    seen = []
    empty, empty_like = torch.empty, torch.empty_like

    def spy_empty(*shape, **kw):
        t = empty(*shape, **kw)
        seen.append(t.numel())
        return t

    def spy_empty_like(t, **kw):
        seen.append(t.numel())
        return empty_like(t, **kw)
    monkeypatch.setattr(torch, "empty", spy_empty)
    monkeypatch.setattr(torch, "empty_like", spy_empty_like)
    return seen


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.int32))
@pytest.mark.parametrize("on, fill", ((True, True), (True, False), (False, True)))
def test_tensors_are_torch_empty_s(flag, dtype, on, fill):
    flag(on, fill)
    a = buffers.empty((3, 5, 7), dtype, "cpu")
    b = buffers.empty_like(a)
    for t in (a, b):
        assert (t.shape, t.stride(), t.dtype, t.device) == ((3, 5, 7), (35, 7, 1), dtype, torch.device("cpu"))
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == 105 * dtype.itemsize
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    a.fill_(1)
    b.fill_(2)
    assert a.sum().item() == 105 and b.sum().item() == 210   # separate, writable memory
    assert buffers.empty((0, 4), dtype, "cpu").shape == (0, 4)


def test_under_the_flag_nothing_nonempty_goes_through_the_filled_path(flag, filled_allocations):
    flag(True)
    t = buffers.empty((64, 64), torch.float32, "cpu")
    buffers.empty_like(t)
    assert filled_allocations and not any(filled_allocations)   # only torch.empty(0) to hold the storage


@pytest.mark.parametrize("on, fill, skip", ((False, True, True), (True, False, True), (True, True, False)))
def test_torch_empty_where_there_is_no_fill_to_skip_or_skipping_is_off(flag, filled_allocations, monkeypatch, on,
                                                                       fill, skip):
    monkeypatch.setattr(buffers, "SKIP_FILL", skip)
    flag(on, fill)
    t = buffers.empty((64, 64), torch.float32, "cpu")
    assert filled_allocations == [4096]
    if on and fill:   # PyTorch's fill, as for any tensor
        assert torch.isnan(t).all()


def test_a_strided_tensor_keeps_torch_empty_like(flag, filled_allocations):
    flag(True)
    t = torch.ones(4, 6)[:, ::2]
    got = buffers.empty_like(t)
    assert filled_allocations[-1] == 12 and got.shape == (4, 3) and torch.isnan(got).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ("triton", "hopper"))
@pytest.mark.parametrize("varlen", (False, True), ids=("dense", "packed"))
@pytest.mark.parametrize("schedule", ("auto", "descending"))   # Triton's auto is split: no dQ accumulator
def test_kernels_under_the_flag_give_the_bits_without_it_and_free_their_buffers(flag, monkeypatch, backend, varlen,
                                                                                 schedule):
    """Forward and backward through the public API give one set of bits with the flag off, with
    the flag and its fill on, and with our buffers NaN-filled too (`SKIP_FILL` off): the kernels
    read nothing they did not write. The storages made here go back to the caching allocator like
    any tensor's."""
    import dash_plugin
    from tests.gpu_oracle import hopper_ready
    if backend == "hopper" and not hopper_ready():
        pytest.skip("needs an sm90 GPU and the hopper extra")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 1000, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    kw = dict(causal=True, deterministic=True, backend=backend, schedule=schedule)
    if varlen:
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        cu = torch.tensor([0, 300, 2000], device="cuda", dtype=torch.int32)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1700, max_seqlen_k=1700)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def call():
        out = dash_plugin.flash_attention(q, k, v, **kw)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        assert dash_plugin.last_resolved().concrete_backend == backend
        return [t.clone() for t in (out, *grads)]
    runs = []
    for on, skip in ((False, True), (True, True), (True, False), (False, True), (True, True)):
        flag(on)
        monkeypatch.setattr(buffers, "SKIP_FILL", skip)
        runs.append(call())
    # A storage made here and never freed would hold one call's buffers (the fp32 dQ accumulator
    # alone is 8 MB) after each call.
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == held, "memory held after calls under the flag"
    for name, *same in zip(("out", "dq", "dk", "dv"), *runs):
        assert all(torch.equal(same[0], t) for t in same[1:]), \
            f"{name}: different bits (flag off, on, on with NaN-filled buffers)"
