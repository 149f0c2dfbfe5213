"""The measurement protocol (docs/benchmarks/README.md): which shapes, and how many FLOPs each one does.

Every point has 16k tokens (batch * seqlen = 16384) and model dim 2048, so the number of query
heads is 2048 / hdim (rounded to whole heads where hdim does not divide 2048). FLOPs count the
two matrix products of the forward (QK^T and PV) over the query heads: 4 * B * H * S^2 * D,
halved for causal; the backward counts 2.5 times that (five products instead of two), whatever
an implementation actually computes (Flex recomputes: it is still credited 2.5x, so TFLOP/s
compare wall times on the same work).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

MODEL_DIM = 2048
TOKENS_PER_POINT = 16384
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HDIMS = (64, 128)
MASKS = ("causal", "full")
GQA_RATIO = 4          # the GQA row: 4 query heads per KV head
GQA_HDIM = 128         # ... measured at this head dim
BWD_FLOP_FACTOR = 2.5

# --quick: a few points that finish fast yet show both masks, both head dims and a long sequence.
# hdim64 2k first: it carries a target (shift vs ascending, full), so a time budget cuts it last.
QUICK_POINTS = ((64, 2048), (128, 2048), (128, 8192))

# --tiny (CPU, CI): a miniature of the protocol; fp32 because CPU bf16 matmuls are slow and the
# point is to exercise the pipeline, not to measure.
TINY_SHAPES = ((2, 128), (1, 256))   # (batch, seqlen)
TINY_HEADS = 2
TINY_HDIM = 64


@dataclass(frozen=True)
class Point:
    """One shape of the protocol. Layout-free: implementations build their own tensors."""

    batch: int
    seqlen: int
    heads_q: int
    heads_kv: int
    hdim: int
    causal: bool
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in ("batch", "seqlen", "heads_q", "heads_kv", "hdim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Point.{name} must be a positive int, got {value!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"Point.heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"Point.dtype must be bfloat16, float16 or float32, got {self.dtype!r}")

    @property
    def mask(self) -> str:
        return "causal" if self.causal else "full"

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def row(self) -> str:
        """The table row family: 'hdim128', 'hdim128-gqa4' ..."""
        return f"hdim{self.hdim}" + (f"-gqa{self.group}" if self.group > 1 else "")

    @property
    def key(self) -> str:
        return f"{self.row}-{self.mask}-s{self.seqlen}"

    @property
    def fwd_flops(self) -> float:
        return fwd_flops(self.batch, self.heads_q, self.seqlen, self.hdim, self.causal)

    @property
    def bwd_flops(self) -> float:
        return bwd_flops(self.batch, self.heads_q, self.seqlen, self.hdim, self.causal)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(key=self.key, row=self.row, mask=self.mask, fwd_flops=self.fwd_flops, bwd_flops=self.bwd_flops)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Point":
        return cls(**{k: d[k] for k in ("batch", "seqlen", "heads_q", "heads_kv", "hdim", "causal", "dtype")})


def fwd_flops(batch: int, heads: int, seqlen: int, hdim: int, causal: bool) -> float:
    """4 * B * H * S^2 * D (QK^T and PV, 2 FLOPs per multiply-add), halved for causal."""
    flops = 4.0 * batch * heads * seqlen * seqlen * hdim
    return flops / 2 if causal else flops


def bwd_flops(batch: int, heads: int, seqlen: int, hdim: int, causal: bool) -> float:
    return BWD_FLOP_FACTOR * fwd_flops(batch, heads, seqlen, hdim, causal)


def batch_for(seqlen: int) -> int:
    if seqlen <= 0 or TOKENS_PER_POINT % seqlen:
        raise ValueError(f"seqlen must divide {TOKENS_PER_POINT}, got {seqlen}")
    return TOKENS_PER_POINT // seqlen


def heads_for(hdim: int) -> int:
    """Heads of a point: the model dim's worth, rounded where the head dim does not divide it
    (hdim 80: 26 heads, a model dim of 2080); TFLOP/s count the heads that ran."""
    if hdim <= 0:
        raise ValueError(f"hdim must be positive, got {hdim}")
    return max(1, round(MODEL_DIM / hdim))


def random_inputs(hdim: int, seqlen: int, count: int, device="cuda"):
    """`count` bf16 (batch, seqlen, heads, hdim) tensors of the point's shape, from a generator
    seeded by the point, so every script that times a point sees the same inputs."""
    import torch
    g = torch.Generator(device=device).manual_seed(seqlen + hdim)
    shape = (batch_for(seqlen), seqlen, heads_for(hdim), hdim)
    return tuple(torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g) for _ in range(count))


def protocol_point(hdim: int, seqlen: int, causal: bool, *, gqa: int = 1) -> Point:
    heads = heads_for(hdim)
    if heads % gqa:
        raise ValueError(f"gqa ratio {gqa} must divide the {heads} heads of hdim {hdim}")
    return Point(batch=batch_for(seqlen), seqlen=seqlen, heads_q=heads, heads_kv=heads // gqa,
                 hdim=hdim, causal=causal)


def protocol_points(*, hdims=HDIMS, seqlens=SEQLENS, masks=MASKS, gqa: bool = False) -> list[Point]:
    """The full protocol, ordered row by row (hdim, then mask, then seqlen); the GQA 4:1 row last."""
    for m in masks:
        if m not in MASKS:
            raise ValueError(f"mask must be one of {MASKS}, got {m!r}")
    points = [protocol_point(d, s, m == "causal") for d in hdims for m in masks for s in seqlens]
    if gqa:
        points += [protocol_point(GQA_HDIM, s, m == "causal", gqa=GQA_RATIO) for m in masks for s in seqlens]
    return points


def quick_points(*, masks=MASKS) -> list[Point]:
    return [protocol_point(d, s, m == "causal") for d, s in QUICK_POINTS for m in masks]


def tiny_points(*, masks=MASKS) -> list[Point]:
    return [Point(batch=b, seqlen=s, heads_q=TINY_HEADS, heads_kv=TINY_HEADS, hdim=TINY_HDIM,
                  causal=m == "causal", dtype="float32")
            for m in masks for b, s in TINY_SHAPES]
