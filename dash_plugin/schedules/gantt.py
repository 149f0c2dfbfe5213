"""Gantt chart of a simulated schedule: one row per SM, compute blocks (colour = query head),
reduction blocks (dark), waits are the white gaps between them."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .simulate import SimResult  # noqa: E402

COLOURS = plt.get_cmap("tab20").colors   # a head's colour: COLOURS[head % 20]
REDUCTION = "#333333"


def head_legend(heads) -> list[tuple[int, str]]:
    """(colour index, label) for each colour the heads use: heads 20 apart share a colour, and
    then one label names them all."""
    by_colour: dict[int, list[int]] = {}
    for h in sorted(heads):
        by_colour.setdefault(h % len(COLOURS), []).append(h)
    return [(c, f"compute, head {hs[0]}" if len(hs) == 1 else "compute, heads " + ", ".join(map(str, hs)))
            for c, hs in sorted(by_colour.items())]


def _bars(spans: list, edge: float, facecolors) -> PolyCollection:
    """One collection of rectangles (start, end, row): one matplotlib object for any number of blocks."""
    s = np.asarray(spans, dtype=float).reshape(-1, 3)
    x0, x1, y0, y1 = s[:, 0], s[:, 1], s[:, 2] - 0.4, s[:, 2] + 0.4
    verts = np.stack([np.stack([x0, y0], 1), np.stack([x0, y1], 1), np.stack([x1, y1], 1),
                      np.stack([x1, y0], 1)], 1)
    return PolyCollection(verts, facecolors=facecolors, edgecolors="black", linewidths=edge)


def draw_gantt(result: SimResult, path: str, *, title: str = "", label_tiles: bool | None = None,
               xmax: float | None = None) -> None:
    """Write `result` (simulated with record=True) as a PNG to `path`. `xmax` lets several
    charts share one time axis so their lengths compare at a glance."""
    if not result.blocks and result.makespan > 0:
        raise ValueError("draw_gantt needs a SimResult from simulate(..., record=True)")
    n = result.num_sms
    if label_tiles is None:
        label_tiles = n <= 16 and len(result.blocks) <= 400
    height = max(2.5, min(14.0, 0.32 * n + 1.5))
    fig, ax = plt.subplots(figsize=(12, height))
    compute, colours, reduction = [], [], []
    for blk in result.blocks:
        if blk.kind == "c":
            compute.append((blk.start, blk.end, blk.sm))
            colours.append(COLOURS[blk.head % len(COLOURS)])
            if label_tiles and blk.end > blk.start:
                ax.text((blk.start + blk.end) / 2, blk.sm, f"{blk.kv}:{blk.q}", ha="center",
                        va="center", fontsize=6)
        else:
            reduction.append((blk.start, blk.end, blk.sm))
    edge = 0.3 if label_tiles else 0.0
    ax.add_collection(_bars(compute, edge, colours or "white"))
    ax.add_collection(_bars(reduction, edge, REDUCTION))
    ax.set_ylim(n - 0.5, -0.5)
    right = xmax if xmax is not None else result.makespan * 1.01
    ax.set_xlim(0, right if right > 0 else 1.0)   # nothing to draw (makespan 0): still a valid axis
    ax.set_ylabel("SM (worker slot)")
    ax.set_xlabel("time (compute c, reduction r)")
    ax.axvline(result.makespan, color="red", linestyle="--", linewidth=1)
    ax.set_title(f"{title}  makespan {result.makespan:g}, bubbles "
                 f"{100 * result.bubble_fraction:.1f}%, waiting {result.wait:g}")
    heads = {b.head for b in result.blocks if b.kind == "c"}
    handles = [Patch(color=COLOURS[c], label=label) for c, label in head_legend(heads)]
    handles.append(Patch(color=REDUCTION, label="ordered dQ add (reduction)"))
    handles.append(Patch(facecolor="white", edgecolor="black", label="gap = waiting / idle"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    if label_tiles:
        ax.text(1.0, -0.08, "labels: kv:q", transform=ax.transAxes, fontsize=7, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
