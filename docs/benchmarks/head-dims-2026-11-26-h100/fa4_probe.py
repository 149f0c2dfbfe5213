"""FA4's own sm90 backward at head dims off our table: error against float64 (info only)."""
import torch
from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
for d in (40, 80, 112, 160):
    for causal in (True, False):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(2, 1000, 4, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        out, lse = _flash_attn_fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal, return_lse=True)[:2]
        try:
            dq, dk, dv = _flash_attn_bwd(q, k, v, out, do, lse, softmax_scale=d ** -0.5, causal=causal, deterministic=True)[:3]
        except Exception as e:
            print(d, causal, "FA4 bwd raised", type(e).__name__, str(e)[:200]); continue
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        s = torch.einsum("bshd,bthd->bhst", qd, kd) * d ** -0.5
        if causal:
            s = s.masked_fill(torch.ones(1000, 1000, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        o = torch.einsum("bhst,bthd->bshd", s.softmax(-1), vd)
        o.backward(do.double())
        err = [((a.double() - b.grad).abs().max() / b.grad.abs().max()).item() for a, b in ((dq, qd), (dk, kd), (dv, vd))]
        print(f"FA4 sm90 det bwd hdim{d} {'causal' if causal else 'full'}: max rel err dq/dk/dv = " + " ".join(f"{e:.2e}" for e in err), flush=True)
