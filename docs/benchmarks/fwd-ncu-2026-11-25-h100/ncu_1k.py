"""ours (tail-aligned, persistent) and cuDNN at hdim64 causal 1k, one call each inside a profiler range."""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from dash_plugin.kernels.hopper import fwd_sm90
b, s, h, d = 16, 1024, 32, 64
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
def ours(): return fwd_sm90.attention_forward(q, k, v, softmax_scale=0.125, causal=True)
def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
for _ in range(5): ours(); cudnn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
ours(); cudnn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
