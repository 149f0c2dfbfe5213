"""`build_schedule`: a registered schedule built for a batch of sequences, cached per shape.

Every sequence gets its own tiles, visits and ranks from the schedule's builder (registry.py);
GQA and the number of heads do not change the schedule (every query head of a KV head repeats
the same visits).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from . import registry
from .builders import SequenceSchedule
from .geometry import make_geometry


@dataclass(frozen=True)
class Schedule:
    spec: registry.ScheduleSpec
    sequences: tuple[SequenceSchedule, ...]
    block_m: int
    block_n: int
    causal: bool
    window_left: int
    window_right: int
    group_size: int | None  # as requested (None: default rule)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ordered(self) -> bool:
        return self.spec.ordered

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(s.variant for s in self.sequences)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def normalize_args(schedule, seqlens_q, seqlens_k, block_m, block_n, causal, window_left,
                   window_right, group_size):
    """Validate arguments; return them in `build_cached`'s order, with the registry entry for the
    name, lists as tuples, windows as -1 / >= 0 and causal as "plain causal mask"."""
    spec = registry.get(schedule)
    if isinstance(seqlens_q, int) or isinstance(seqlens_k, int):
        raise TypeError("seqlens_q and seqlens_k must be lists of ints (one per sequence); "
                        f"got {seqlens_q!r}, {seqlens_k!r}")
    sq = tuple(_check_int(f"seqlens_q[{b}]", s, 0) for b, s in enumerate(seqlens_q))
    sk = tuple(_check_int(f"seqlens_k[{b}]", s, 0) for b, s in enumerate(seqlens_k))
    if len(sq) == 0 or len(sq) != len(sk):
        raise ValueError("seqlens_q and seqlens_k must be non-empty and of equal length; got "
                         f"{len(sq)} and {len(sk)}")
    _check_int("block_m", block_m, 1)
    _check_int("block_n", block_n, 1)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    _check_int("window_left", window_left, -(1 << 62))
    _check_int("window_right", window_right, -(1 << 62))
    wl = -1 if window_left < 0 else window_left
    wr = -1 if window_right < 0 else window_right
    if causal:
        if wr > 0:
            raise ValueError(f"causal=True needs window_right 0 or -1 (it means window_right=0); "
                             f"got window_right={window_right}")
        wr = 0
    if group_size is not None:
        _check_int("group_size", group_size, 1)
    return spec, sq, sk, block_m, block_n, wr == 0 and wl < 0, wl, wr, group_size


@lru_cache(maxsize=256)
def build_cached(spec, seqlens_q, seqlens_k, block_m, block_n, causal, window_left, window_right,
                 group_size) -> Schedule:
    """`build_schedule` on normalized arguments. Keyed by the registry entry itself, so a schedule
    registered again under the same name never meets the other one's cached builds."""
    seqs = []
    built: dict[tuple[int, int], SequenceSchedule] = {}
    for sq, sk in zip(seqlens_q, seqlens_k):
        if (sq, sk) not in built:  # varlen batches often repeat lengths
            geo = make_geometry(sq, sk, block_m, block_n, window_left, window_right)
            built[(sq, sk)] = spec.build(geo, group_size)
        seqs.append(built[(sq, sk)])
    return Schedule(spec, tuple(seqs), block_m, block_n, causal, window_left, window_right, group_size)


def build_schedule(schedule: str, *, seqlens_q, seqlens_k, block_m: int, block_n: int,
                   causal: bool = False, window_left: int = -1, window_right: int = -1,
                   group_size: int | None = None) -> Schedule:
    """Build (cached per shape) the registered schedule `schedule` for a batch of sequences.
    Dense batches pass one length pair."""
    return build_cached(*normalize_args(schedule, seqlens_q, seqlens_k, block_m, block_n, causal,
                                        window_left, window_right, group_size))
