"""The float64 oracle for tests: attention written as plain math on a materialised mask, with
autograd for the gradients. Deliberately naive (O(seqlen^2)) and independent of the blockwise
reference, so the two check each other."""
import torch

from dash_plugin.kernels.philox import dropout_keep_mask, keep_scale


def math_attention(q, k, v, *, causal=False, softmax_scale=None, window_left=-1, window_right=-1, softcap=0.0,
                   dropout_p=0.0, seed=0, batch_index=0):
    """One sequence: q (S_q, H_q, D), k/v (S_k, H_kv, D); returns out (S_q, H_q, D), lse (H_q, S_q)."""
    sq, hq, d = q.shape
    sk, hkv, _ = k.shape
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    if causal:
        window_right = 0
    kx = k.repeat_interleave(hq // hkv, dim=1)
    vx = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kx) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if window_left >= 0:
        ok &= j >= i - window_left
    if window_right >= 0:
        ok &= j <= i + window_right
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key give 0
    if dropout_p > 0:
        keep = keep_mask(seed, dropout_p, 1, hq, sq, sk, device=q.device, first_batch=batch_index)[0]
        p = p * keep * keep_scale(dropout_p)
    out = torch.einsum("hqk,khd->qhd", p, vx)
    return out, lse.masked_fill(torch.isneginf(lse), float("inf"))


def keep_mask(seed: int, p: float, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device="cpu",
              first_batch: int = 0):
    """(B, H_q, S_q, S_k) bool: kept elements of `batch` sequences with batch (varlen: sequence)
    indices first_batch.., query head h, row i, column j."""
    def idx(n, dim, start=0):
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return torch.arange(start, start + n, device=device).view(shape)
    return dropout_keep_mask(seed, p, idx(batch, 0, first_batch), idx(heads, 1), idx(seqlen_q, 2), idx(seqlen_k, 3))
