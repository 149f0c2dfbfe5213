"""Fingerprints of a training step: exact scalars and cheap, exact digests of tensors; and the reading and
writing of the run files that hold them (JSON with errors that name the file and line, the final weights).

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
from pathlib import Path

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements per reduction: bounds the int64 temporaries on large tensors
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (a well-mixed odd multiplier)


def tensor_digest(t: torch.Tensor) -> str:
    """A 16-hex-digit digest of the tensor's dtype, shape and exact bits."""
    t = t.detach()
    if hasattr(t, "full_tensor"):  # DTensor (FSDP2): the whole tensor, gathered (a collective: every rank calls),
        t = t.full_tensor()       # so that a difference in any rank's shard shows at its step
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


class GradOrder:
    """The order in which one backward produces the parameters' gradients, from a hook on each parameter
    that fires when its gradient has been accumulated; `finish` removes the hooks. Where not every
    parameter reported (FSDP2's sharded parameters get their gradients from its reduce-scatter, not
    from autograd), `finish` returns [] and the order is not claimed."""

    def __init__(self, named_params):
        self.names, self.order, self.handles = [], [], []
        for name, p in named_params:
            if p.requires_grad:
                self.names.append(name)
                self.handles.append(p.register_post_accumulate_grad_hook(
                    lambda _, name=name: self.order.append(name)))

    def finish(self) -> list[str]:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        seen = list(dict.fromkeys(self.order))   # the first accumulation of each (gradient accumulation)
        return seen if len(seen) == len(self.names) else []


def write_jsonl(fh, record: dict) -> None:
    """One JSON record per line, flushed at once so a watcher (dash-repro run's progress bar) sees it."""
    fh.write(json.dumps(record, sort_keys=False) + "\n")
    fh.flush()


class RunFileError(ValueError):
    """A file of a run directory is missing, unreadable or not in the expected format. The message names
    the file (and the line, where there is one) and what was expected."""


def read_json(path):
    """The JSON value in `path`; RunFileError naming the file, line and column if it is missing or malformed."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RunFileError(f"{path}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunFileError(f"{path}: cannot be read ({e.__class__.__name__}: {e})") from None


def read_jsonl(path, check=None) -> list:
    """The JSON value of every non-blank line. `check(value)` may return what is wrong with a value (else
    None). RunFileError naming the file and the line for a line that is not JSON or fails the check."""
    path = Path(path)
    records = []
    try:
        with open(path) as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line.rstrip())  # without the newline: errors point into the line
                except json.JSONDecodeError as e:
                    raise RunFileError(f"{path} line {lineno}: not valid JSON (column {e.colno}: {e.msg})") from None
                problem = check(value) if check else None
                if problem:
                    raise RunFileError(f"{path} line {lineno}: {problem}")
                records.append(value)
    except (OSError, UnicodeDecodeError) as e:
        raise RunFileError(f"{path}: cannot be read ({e.__class__.__name__}: {e})") from None
    return records


def file_sha256(path) -> str:
    """The sha256 of a file, read in pieces (weight files can be larger than the free memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


WEIGHTS_FILE, FINAL_FILE = "model.safetensors", "final.json"


def clear_final(out) -> None:
    """Remove the final.json and weight file of an earlier run in OUT: a run directory being rewritten must not
    look finished (with the old weights) if this run is stopped before it writes its own."""
    for name in (FINAL_FILE, WEIGHTS_FILE):
        (Path(out) / name).unlink(missing_ok=True)


def _unshared(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors on the CPU, each with memory of its own: safetensors refuses tensors that share memory, as tied
    weights do (a model's lm_head.weight and embed_tokens.weight in one state dict). A copy is made only of
    a tensor whose memory an earlier one uses."""
    tensors, seen = {}, set()
    for k, v in state_dict.items():
        v = v.detach().contiguous().cpu()
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen:
            v = v.clone()
        seen.add(ptr)
        tensors[k] = v
    return tensors


def write_final(out, state_dict: dict[str, torch.Tensor], save_weights: bool = True,
                last_step: int | None = None) -> None:
    """The end of a run: OUT/model.safetensors and OUT/final.json (the file's sha256 and a digest per tensor).

    final.json is written last: a run directory without it did not finish. With save_weights=False no weight
    file is written and final.json says so ("weights_file": null); `dash-repro compare` then compares the
    recorded digests only, and says so in its verdict. `last_step` (the step the run ended at) lets compare
    see a record lost at the end of steps.jsonl, where no gap shows it."""
    from safetensors.torch import save_file

    out = Path(out)
    final = {"tensors": {k: tensor_digest(v) for k, v in state_dict.items()}}
    if last_step is not None:
        final["last_step"] = last_step
    if save_weights:
        path = out / WEIGHTS_FILE
        save_file(_unshared(state_dict), path)
        final.update(weights_file=WEIGHTS_FILE, weights_sha256=file_sha256(path))
    else:
        final.update(weights_file=None, weights_sha256=None)
    (out / FINAL_FILE).write_text(json.dumps(final, indent=1))


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
