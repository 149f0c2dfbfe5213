"""Gantt chart of a simulated schedule: one row per SM, compute blocks (colour = query head),
reduction blocks (dark), waits are the white gaps between them."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .simulate import SimResult  # noqa: E402


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
    cmap = plt.get_cmap("tab20")
    heads = sorted({b.head for b in result.blocks})
    # one broken_barh call per SM and kind: fast even for 100k blocks
    per_sm: dict[int, tuple[list, list, list]] = {}
    for blk in result.blocks:
        spans_c, colors_c, spans_r = per_sm.setdefault(blk.sm, ([], [], []))
        if blk.kind == "c":
            spans_c.append((blk.start, blk.end - blk.start))
            colors_c.append(cmap(blk.head % 20))
            if label_tiles and blk.end > blk.start:
                ax.text((blk.start + blk.end) / 2, blk.sm, f"{blk.kv}:{blk.q}", ha="center",
                        va="center", fontsize=6)
        else:
            spans_r.append((blk.start, blk.end - blk.start))
    edge = 0.3 if label_tiles else 0.0
    for sm, (spans_c, colors_c, spans_r) in per_sm.items():
        ax.broken_barh(spans_c, (sm - 0.4, 0.8), facecolors=colors_c, edgecolor="black",
                       linewidth=edge)
        ax.broken_barh(spans_r, (sm - 0.4, 0.8), facecolors="#333333", edgecolor="black",
                       linewidth=edge)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(0, xmax if xmax is not None else max(result.makespan, 1e-9) * 1.01)
    ax.set_ylabel("SM (worker slot)")
    ax.set_xlabel("time (compute c, reduction r)")
    ax.axvline(result.makespan, color="red", linestyle="--", linewidth=1)
    ax.set_title(f"{title}  makespan {result.makespan:g}, bubbles "
                 f"{100 * result.bubble_fraction:.1f}%, waiting {result.wait:g}")
    handles = [Patch(color=cmap(h % 20), label=f"compute, head {h}") for h in heads[:8]]
    handles.append(Patch(color="#333333", label="ordered dQ add (reduction)"))
    handles.append(Patch(facecolor="white", edgecolor="black", label="gap = waiting / idle"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    if label_tiles:
        ax.text(1.0, -0.08, "labels: kv:q", transform=ax.transAxes, fontsize=7, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
