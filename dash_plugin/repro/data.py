"""A byte-level language-modelling dataset built from text present on every machine: the Python standard
library's own source files. Nothing is downloaded; the same Python version gives the same bytes."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 256  # one token per byte value


def stdlib_corpus(num_bytes: int, root: str | None = None) -> bytes:
    """The first `num_bytes` of the concatenated .py files under the standard library, in sorted path order.

    Third-party packages (site-packages, dist-packages) are skipped: they differ between machines with the
    same Python. Files are joined by a newline. Raises if the library holds fewer bytes than asked for.
    """
    if not isinstance(num_bytes, int) or num_bytes <= 0:
        raise ValueError(f"num_bytes={num_bytes!r} is not allowed; pass a positive int")
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p.relative_to(base).as_posix() for p in base.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(base).parts))
    chunks, total = [], 0
    for rel in files:
        try:
            data = (base / rel).read_bytes() + b"\n"
        except OSError:  # unreadable file: skip it the same way on every run
            continue
        chunks.append(data)
        total += len(data)
        if total >= num_bytes:
            return b"".join(chunks)[:num_bytes]
    raise ValueError(f"num_bytes={num_bytes} is more than the {total} bytes of .py files under {base}")


class ByteBlocks(Dataset):
    """Fixed-length blocks of a byte string, split into train and validation by position.

    Block i covers bytes [i*seq_len, (i+1)*seq_len). Every `val_every`-th block (i % val_every == 0) is
    validation, the rest training: a pure function of the position, so the split never depends on an RNG.
    Items are dicts with `input_ids` and `labels` (equal; Hugging Face causal LMs shift labels themselves).
    """

    def __init__(self, data: bytes, seq_len: int, split: str = "train", val_every: int = 20):
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} is not allowed; use 'train' or 'val'")
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len={seq_len!r} is not allowed; pass an int >= 2")
        if not isinstance(val_every, int) or val_every < 2:
            raise ValueError(f"val_every={val_every!r} is not allowed; pass an int >= 2")
        n_blocks = len(data) // seq_len
        if n_blocks < val_every:
            raise ValueError(f"{len(data)} bytes give {n_blocks} blocks of seq_len={seq_len}; "
                             f"need at least val_every={val_every}")
        tokens = torch.frombuffer(bytearray(data[: n_blocks * seq_len]), dtype=torch.uint8)
        blocks = tokens.view(n_blocks, seq_len)
        is_val = torch.arange(n_blocks) % val_every == 0
        self.blocks = blocks[is_val if split == "val" else ~is_val].clone()
        self.sha256 = hashlib.sha256(data).hexdigest()  # logged, so runs on different corpora are told apart

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[i].long()
        return {"input_ids": ids, "labels": ids.clone()}
