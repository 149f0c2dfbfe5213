"""Fingerprints of a training step: exact scalars and cheap, exact digests of tensors.

`tensor_digest` hashes the bits of a tensor on the device that holds it, without copying it to the host:
the tensor's bit patterns, read as integers, are summed with two sets of odd position weights in wrapping
64-bit integer arithmetic. Integer addition is associative, so the sums do not depend on how the device
splits the reduction: the digest of a tensor is the same on the CPU and on any GPU. Changing any one
element changes both sums (an odd weight times a nonzero difference below 2**64 is nonzero mod 2**64).
"""

from __future__ import annotations

import hashlib
import json
import re

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements per reduction: bounds the int64 temporaries on large tensors
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (a well-mixed odd multiplier)


def tensor_digest(t: torch.Tensor) -> str:
    """A 16-hex-digit digest of the tensor's dtype, shape and exact bits."""
    t = t.detach()
    if hasattr(t, "to_local"):  # DTensor (FSDP2): digest of this rank's shard
        t = t.to_local()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    flat = t.contiguous().view(-1)
    bits = flat.view(_INT_VIEW[flat.element_size()]) if flat.numel() else flat.to(torch.int64)
    s1 = torch.zeros((), dtype=torch.int64, device=flat.device)
    s2 = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        v = bits[start:start + _CHUNK].to(torch.int64)
        idx = torch.arange(start, start + v.numel(), dtype=torch.int64, device=v.device)
        s1 += (v * (2 * idx + 1)).sum()
        s2 += (v * ((idx * _GOLDEN) | 1)).sum()
    h = hashlib.blake2b(f"{t.dtype}|{tuple(t.shape)}|{int(s1)}|{int(s2)}".encode(), digest_size=8)
    return h.hexdigest()


def exact(x) -> str | None:
    """A float (or 0-d tensor) as an exact hex string (float.hex; fp32/bf16 values are exact in a double)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        x = x.detach().float().item()
    return float(x).hex()


def from_exact(s: str | None) -> float | None:
    return None if s is None else float.fromhex(s)


_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def layer_of(name: str) -> str:
    """'layer 3' for a tensor inside decoder layer 3, else the module's short name (embed, lm_head, norm)."""
    m = _LAYER.search(name)
    if m:
        return f"layer {m.group(1)}"
    if "embed" in name:
        return "embeddings"
    if "lm_head" in name:
        return "lm_head"
    return name.rsplit(".", 2)[-2] if "." in name else name


def param_digests(named_params) -> dict[str, str]:
    return {name: tensor_digest(p) for name, p in named_params}


def grad_digests(named_params) -> dict[str, str]:
    return {name: tensor_digest(p.grad) for name, p in named_params if p.grad is not None}


def write_jsonl(fh, record: dict) -> None:
    """One JSON record per line, flushed at once so a watcher (dash-repro run's progress bar) sees it."""
    fh.write(json.dumps(record, sort_keys=False) + "\n")
    fh.flush()


def read_jsonl(path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


# Dense bf16 peak of the GPUs we expect, in FLOP/s (vendor data sheets, SXM parts, no sparsity).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12, "L40S": 362e12}


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where unknown (the CPU): MFU is then not reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return None


def train_flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 per weight plus attention scores and values (12 * L * d * S),
    the PaLM-paper convention, with no discount for the causal mask."""
    return 6.0 * n_params + 12.0 * n_layers * hidden * seq_len
