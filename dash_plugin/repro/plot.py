"""Loss curves of two runs overlaid, and their difference (B - A), as a PNG."""

from __future__ import annotations

import math
from pathlib import Path

from dash_plugin.repro.compare import (check_aligned, first_difference, load_steps, refuse_one_run_twice,
                                       shared_fields)
from dash_plugin.repro.fingerprint import RunFileError, from_exact


def output_path(out) -> Path:
    """The file the plot is written to. matplotlib takes the format from the suffix and adds '.png' where there
    is none: add it here, so that the path returned (and printed) is the file written."""
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"{out} is a directory: pass the file to write, e.g. {out / 'loss.png'}")
    return out if out.suffix else out.with_name(out.name + ".png")


def plot_runs(run_a, run_b, out_png, *, labels=("run A", "run B"), title=None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    out_png = output_path(out_png)
    refuse_one_run_twice(run_a, run_b, "plot")
    # Only the steps are needed: an unfinished run (still training, or stopped) can be plotted.
    a, b = load_steps(run_a), load_steps(run_b)
    if not a or not b:
        raise RunFileError(f"nothing to plot: {run_a} has {len(a)} steps, {run_b} has {len(b)}")
    check_aligned(run_a, a, run_b, b)
    # A Trainer with logging_steps > 1 logs a loss every n-th step (null elsewhere): each curve has the steps
    # with a loss, the difference the steps where compare compares the losses.
    both = [(ra, rb) for ra, rb, fields in zip(a, b, shared_fields(a, b)) if "loss" in fields]
    if not both:
        raise RunFileError(f"nothing to plot: no step of {run_a} and {run_b} has a loss logged by both runs over "
                           f"the same steps (a Trainer logs the mean loss of the steps since its last log, every "
                           f"logging_steps steps)")
    (sa, la), (sb, lb) = _losses(a), _losses(b)
    steps = [ra["step"] for ra, _ in both]
    diff = [from_exact(rb["loss"]) - from_exact(ra["loss"]) for ra, rb in both]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    top.plot(sa, la, label=labels[0], lw=2.5, alpha=0.6)
    top.plot(sb, lb, label=labels[1], lw=1.2, ls="--")
    top.set_ylabel("training loss")
    top.legend()
    top.set_title(title or "loss of two runs")
    bottom.plot(steps, diff, color="C3", marker=".", lw=1)
    bottom.axhline(0.0, color="k", lw=0.5)
    bottom.set_ylabel("loss B - A")
    bottom.set_xlabel("step")
    # Counted as compare counts: by the exact values as written (two NaN losses are equal, as in compare).
    n_diff = sum(ra["loss"] != rb["loss"] for ra, rb in both)
    peak = max((abs(d) for d in diff if math.isfinite(d)), default=0.0)
    summary = f"loss differs at {n_diff} of {len(both)} steps; max |difference| {peak:.3g}"
    first = first_difference(a, b, order=[])  # the model order of the names is not needed for the step
    if first is not None:
        # The fingerprints (weights, gradients) usually differ before the rounded loss does.
        for ax in (top, bottom):
            ax.axvline(first.step, color="C3", ls=":", lw=1)
        top.text(first.step, top.get_ylim()[1], f" first bit difference: step {first.step}", color="C3", va="top",
                 fontsize=8)
        summary += f"; first bit difference (weights/grads/loss) at step {first.step}"
    bottom.set_title(summary, fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def _losses(steps: list[dict]) -> tuple[list[int], list[float]]:
    """The steps that carry a loss, and their losses."""
    logged = [r for r in steps if r["loss"] is not None]
    return [r["step"] for r in logged], [from_exact(r["loss"]) for r in logged]
