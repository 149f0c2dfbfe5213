"""Plain-PyTorch attention, forward and backward: the CPU path and the oracle for the kernels.

It defines the semantics every kernel must match (docs/INTERNALS.md): bottom-right aligned
causal and window masks, softcap, GQA without expanding K/V, varlen, dropout through the
counter-based Philox mask, ``lse = +inf`` for rows that see no key.

It works blockwise over query rows, so memory is O(block x seqlen), never O(seqlen^2), and it
is deterministic by construction: every sum runs in one fixed order on one device. Arithmetic
is fp32 (fp64 for fp64 inputs) with one rounding to the input dtype at the end.
"""
import torch

from .philox import dropout_keep_mask, keep_scale
from .varlen import seqlens_of

BLOCK_Q = 128


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the arithmetic and of the LSE for inputs of ``dtype``: float64 for float64
    (so its gradients are float64-accurate), float32 for everything else (as the kernels)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def visible_mask(rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int,
                 window_left: int, window_right: int) -> torch.Tensor:
    """Which (row, col) pairs attend, for rows/cols given as positions inside one sequence."""
    diag = rows[:, None] + (seqlen_k - seqlen_q)
    ok = torch.ones(len(rows), len(cols), dtype=torch.bool, device=rows.device)
    if window_left >= 0:
        ok &= cols[None, :] >= diag - window_left
    if window_right >= 0:
        ok &= cols[None, :] <= diag + window_right
    return ok


def _sequences(q, k, cu_seqlens_q, cu_seqlens_k):
    """Yield (batch index, q slice, k slice) per sequence: dense batch rows or varlen segments."""
    if cu_seqlens_q is None:
        for b in range(q.shape[0]):
            yield b, slice(None), slice(None)
        return
    lens_q = seqlens_of(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    lens_k = seqlens_of(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(lens_q) != len(lens_k):
        raise ValueError(f"cu_seqlens_q has {len(lens_q) + 1} entries, cu_seqlens_k {len(lens_k) + 1}; "
                         "both must be (batch + 1,)")
    start_q = start_k = 0
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        yield b, slice(start_q, start_q + n_q), slice(start_k, start_k + n_k)
        start_q, start_k = start_q + n_q, start_k + n_k


def _pick(t, b, sl, varlen):
    return t[sl] if varlen else t[b]


class _Block:
    """Scores of one block of query rows of one sequence against all its keys, per head.

    Shapes: q (Hkv, G, R, D), k/v (Hkv, S_k, D); scores and probabilities (Hkv, G, R, S_k).
    """

    def __init__(self, q, k, rows, seqlen_q, seqlen_k, batch_index, p):
        self.softcap = p["softcap"]
        s = torch.einsum("hgrd,hsd->hgrs", q, k) * p["softmax_scale"]
        if self.softcap > 0:
            s = self.softcap * torch.tanh(s / self.softcap)
        self.s = s
        cols = torch.arange(seqlen_k, device=q.device)
        self.visible = visible_mask(rows, cols, seqlen_q, seqlen_k, p["window_left"], p["window_right"])
        self.scale_drop = None
        if p["dropout_p"] > 0:
            hkv, g = q.shape[0], q.shape[1]
            heads = torch.arange(hkv * g, device=q.device).view(hkv, g, 1, 1)
            keep = dropout_keep_mask(p["seed"], p["dropout_p"], batch_index, heads,
                                     rows.view(1, 1, -1, 1), cols.view(1, 1, 1, -1))
            self.scale_drop = keep.to(s.dtype) * keep_scale(p["dropout_p"])

    def probabilities(self, lse):
        """P = exp(s - lse) on visible entries; rows with lse = +inf give exactly 0."""
        p = torch.exp(self.s - lse[..., None])
        return torch.where(self.visible, p, torch.zeros((), dtype=p.dtype))

    def log_sum_exp(self):
        masked = torch.where(self.visible, self.s, torch.full((), float("-inf"), dtype=self.s.dtype))
        lse = torch.logsumexp(masked, dim=-1)
        return torch.where(torch.isneginf(lse), torch.full((), float("inf"), dtype=lse.dtype), lse)

    def dropped(self, probs):
        return probs if self.scale_drop is None else probs * self.scale_drop


class _Problem:
    """What the forward and backward share: parameters, dtypes, head counts, and the sequences."""

    def __init__(self, q, k, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right,
                 softcap, dropout_p, seed):
        self.varlen = cu_seqlens_q is not None
        self.p = dict(softmax_scale=float(softmax_scale), window_left=int(window_left),
                      window_right=0 if causal else int(window_right), softcap=float(softcap),
                      dropout_p=float(dropout_p), seed=int(seed))
        self.ctype = compute_dtype(q.dtype)
        self.hq, self.hkv, self.d = q.shape[-2], k.shape[-2], q.shape[-1]
        self.g = self.hq // self.hkv
        self._cu = (cu_seqlens_q, cu_seqlens_k)
        self._q, self._k = q, k

    def sequences(self, k, v):
        """Per sequence: (b, q-slice, k-slice, k and v as (Hkv, S_k, D) in the compute dtype)."""
        for b, sq_sl, sk_sl in _sequences(self._q, self._k, *self._cu):
            ks = _pick(k, b, sk_sl, self.varlen).to(self.ctype).transpose(0, 1)
            vs = _pick(v, b, sk_sl, self.varlen).to(self.ctype).transpose(0, 1)
            yield b, sq_sl, sk_sl, ks, vs

    def lse_rows(self, lse, b, sq_sl):
        return lse[:, sq_sl] if self.varlen else lse[b]


def attention_forward(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                      softmax_scale, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                      dropout_p=0.0, seed=0, block_q=BLOCK_Q):
    """Returns (out, lse); layouts as in docs/INTERNALS.md."""
    pr = _Problem(q, k, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap,
                  dropout_p, seed)
    hq, hkv, g, d = pr.hq, pr.hkv, pr.g, pr.d
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((hq, q.shape[0]) if pr.varlen else (q.shape[0], hq, q.shape[1]), dtype=pr.ctype,
                      device=q.device)
    for b, sq_sl, _, ks, vs in pr.sequences(k, v):
        qs = _pick(q, b, sq_sl, pr.varlen)
        seqlen_q, seqlen_k = qs.shape[0], ks.shape[1]
        out_s = _pick(out, b, sq_sl, pr.varlen)
        lse_s = pr.lse_rows(lse, b, sq_sl)
        for r0 in range(0, seqlen_q, block_q):
            r1 = min(r0 + block_q, seqlen_q)
            rows = torch.arange(r0, r1, device=q.device)
            qb = qs[r0:r1].to(pr.ctype).permute(1, 0, 2).reshape(hkv, g, r1 - r0, d)
            blk = _Block(qb, ks, rows, seqlen_q, seqlen_k, b, pr.p)
            lse_b = blk.log_sum_exp()
            o = torch.einsum("hgrs,hsd->hgrd", blk.dropped(blk.probabilities(lse_b)), vs)
            out_s[r0:r1] = o.reshape(hq, r1 - r0, d).transpose(0, 1).to(q.dtype)
            lse_s[:, r0:r1] = lse_b.reshape(hq, r1 - r0)
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, softmax_scale, causal=False, window_left=-1, window_right=-1,
                       softcap=0.0, dropout_p=0.0, seed=0, schedule="ascending", deterministic=True,
                       block_q=BLOCK_Q):
    """Returns (dq, dk, dv). ``schedule``/``deterministic`` are accepted for signature parity and ignored:
    the reference sums in one fixed order and is always deterministic."""
    pr = _Problem(q, k, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap,
                  dropout_p, seed)
    hq, hkv, g, d, ctype, p, varlen = pr.hq, pr.hkv, pr.g, pr.d, pr.ctype, pr.p, pr.varlen
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for b, sq_sl, sk_sl, ks, vs in pr.sequences(k, v):
        qs = _pick(q, b, sq_sl, varlen)
        dos = _pick(dout, b, sq_sl, varlen)
        os_ = _pick(out, b, sq_sl, varlen)
        lse_s = pr.lse_rows(lse, b, sq_sl).to(ctype)
        seqlen_q, seqlen_k = qs.shape[0], ks.shape[1]
        dk_acc = torch.zeros_like(ks)
        dv_acc = torch.zeros_like(vs)
        dq_s = _pick(dq, b, sq_sl, varlen)
        for r0 in range(0, seqlen_q, block_q):
            r1 = min(r0 + block_q, seqlen_q)
            n = r1 - r0
            rows = torch.arange(r0, r1, device=q.device)

            def heads_first(t):
                return t[r0:r1].to(ctype).permute(1, 0, 2).reshape(hkv, g, n, d)

            qb, dob, ob = heads_first(qs), heads_first(dos), heads_first(os_)
            blk = _Block(qb, ks, rows, seqlen_q, seqlen_k, b, p)
            probs = blk.probabilities(lse_s[:, r0:r1].reshape(hkv, g, n))
            dv_acc += torch.einsum("hgrs,hgrd->hsd", blk.dropped(probs), dob)
            dp = blk.dropped(torch.einsum("hgrd,hsd->hgrs", dob, vs))
            delta = (dob * ob).sum(-1, keepdim=True)  # rowsum(dO * O) equals rowsum(P * dP), dropout included
            ds = probs * (dp - delta)
            if blk.softcap > 0:
                ds = ds * (1 - (blk.s / blk.softcap) ** 2)  # d/dx of c*tanh(x/c)
            ds = ds * p["softmax_scale"]
            dq_b = torch.einsum("hgrs,hsd->hgrd", ds, ks)
            dk_acc += torch.einsum("hgrs,hgrd->hsd", ds, qb)
            dq_s[r0:r1] = dq_b.reshape(hq, n, d).transpose(0, 1).to(q.dtype)
        _pick(dk, b, sk_sl, varlen)[...] = dk_acc.transpose(0, 1).to(k.dtype)
        _pick(dv, b, sk_sl, varlen)[...] = dv_acc.transpose(0, 1).to(v.dtype)
    return dq, dk, dv
