# MPS limit read from the environment (no MPS daemon here, so CUDA ignores it: the plan is what changes)
import os
os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = "40"
import torch
import dash_plugin
from dash_plugin.schedules.plan import ResidencyError
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(1, 4096, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
           for _ in range(3))
out = dash_plugin.flash_attention(q, k, v, causal=True)
out.sum().backward()
print("auto:", dash_plugin.last_resolved().describe())
try:
    out = dash_plugin.flash_attention(q, k, v, causal=True, schedule="arrival")
    out.sum().backward()
    print("arrival: ran (NOT refused)")
except ResidencyError as e:
    print("arrival refused:", e)
