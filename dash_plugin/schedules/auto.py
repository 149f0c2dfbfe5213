"""`auto`: a fixed rule that picks a deterministic schedule per shape.

The rule is data (auto_table.py, a plain list of rules): the same shape always gives the
same schedule on every machine and run, so `auto` never breaks bit-reproducibility. No timing is
taken at run time (docs/DESIGN.md, "Determinism rules", rule 2).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from . import auto_table, auto_table_hopper, registry

_KEYS = {"mask", "head_dim_min", "head_dim_max", "seqlen_max", "equal_lengths", "varlen", "schedule", "source"}


# Backends with rules of their own, tried before the generic ones (auto_table.py).
_BACKEND_RULES = {"hopper": auto_table_hopper.RULES}


@lru_cache(maxsize=None)
def load_rules(backend: str = "triton") -> tuple[dict, ...]:
    rules = list(_BACKEND_RULES.get(backend, ())) + list(auto_table.RULES)
    for k, rule in enumerate(rules):
        unknown = set(rule) - _KEYS
        if unknown:
            raise ValueError(f"auto_table.py rule {k}: unknown keys {sorted(unknown)}")
        if rule.get("mask") not in ("full", "causal", "window"):
            raise ValueError(f"auto_table.py rule {k}: mask must be full, causal or window")
        allowed = registry.names(deterministic=True)
        if rule.get("schedule") not in allowed:
            raise ValueError(f"auto_table.py rule {k}: schedule must be one of "
                             f"{', '.join(allowed)}, got {rule.get('schedule')!r}")
    if not any(set(r) <= {"mask", "schedule", "source"} for r in rules if r["mask"] == "full") or \
            not any(set(r) <= {"mask", "schedule", "source"} for r in rules if r["mask"] == "causal"):
        raise ValueError("auto_table.py needs a catch-all rule for full and for causal masks")
    return tuple(rules)


def mask_kind(causal: bool, window_left: int, window_right: int) -> str:
    """full, causal (window_right 0, no left window; causal=True implies it) or window."""
    wr = 0 if causal else window_right
    if window_left < 0 and wr < 0:
        return "full"
    if window_left < 0 and wr == 0:
        return "causal"
    return "window"


def choose_schedule(*, causal: bool, head_dim: int, seqlen_q: int, seqlen_k: int,
                    window_left: int = -1, window_right: int = -1, varlen: bool = False,
                    backend: str = "triton") -> str:
    """A concrete deterministic schedule for this shape on `backend` (whose kernels decide which
    order is fastest: the Hopper backend has rules of its own)."""
    for name, v, least in (("head_dim", head_dim, 1), ("seqlen_q", seqlen_q, 0),
                           ("seqlen_k", seqlen_k, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            kind = "positive" if least else "non-negative"
            raise ValueError(f"choose_schedule: {name} must be a {kind} int, got {v!r}")
    if causal and window_right > 0:
        raise ValueError(f"choose_schedule: causal=True needs window_right 0 or -1, got {window_right}")
    kind = mask_kind(causal, window_left, window_right)
    seqlen = max(seqlen_q, seqlen_k)
    # Under torch.compile this runs once, at trace time; Dynamo would trace through the cache (and
    # warn that it ignores it).
    rules = load_rules.__wrapped__(backend) if torch.compiler.is_compiling() else load_rules(backend)
    for rule in rules:
        if rule["mask"] != kind:
            continue
        if rule.get("head_dim_min") is not None and head_dim < rule["head_dim_min"]:
            continue
        if rule.get("head_dim_max") is not None and head_dim > rule["head_dim_max"]:
            continue
        if rule.get("seqlen_max") is not None and seqlen > rule["seqlen_max"]:
            continue
        if "equal_lengths" in rule and rule["equal_lengths"] != (seqlen_q == seqlen_k):
            continue
        if "varlen" in rule and rule["varlen"] != bool(varlen):
            continue
        return rule["schedule"]
    return "descending"  # only reachable for a window mask without a window rule
