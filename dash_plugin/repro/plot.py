"""Loss curves of two runs overlaid, and their difference (B - A), as a PNG."""

from __future__ import annotations

from pathlib import Path

from dash_plugin.repro.compare import first_difference, load_steps
from dash_plugin.repro.fingerprint import RunFileError, from_exact


def plot_runs(run_a, run_b, out_png, *, labels=("run A", "run B"), title=None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    # Only the steps are needed: an unfinished run (still training, or stopped) can be plotted.
    a, b = load_steps(run_a), load_steps(run_b)
    if not a or not b:
        raise RunFileError(f"nothing to plot: {run_a} has {len(a)} steps, {run_b} has {len(b)}")
    sa, la = [r["step"] for r in a], [from_exact(r["loss"]) for r in a]
    sb, lb = [r["step"] for r in b], [from_exact(r["loss"]) for r in b]
    common = min(len(a), len(b))
    diff = [lb[i] - la[i] for i in range(common)]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    top.plot(sa, la, label=labels[0], lw=2.5, alpha=0.6)
    top.plot(sb, lb, label=labels[1], lw=1.2, ls="--")
    top.set_ylabel("training loss")
    top.legend()
    top.set_title(title or "loss of two runs")
    bottom.plot(sa[:common], diff, color="C3", marker=".", lw=1)
    bottom.axhline(0.0, color="k", lw=0.5)
    bottom.set_ylabel("loss B - A")
    bottom.set_xlabel("step")
    n_diff = sum(d != 0.0 for d in diff)
    peak = max((abs(d) for d in diff), default=0.0)
    summary = f"loss differs at {n_diff} of {common} steps; max |difference| {peak:.3g}"
    first = _first_difference(a, b)
    if first is not None:
        # The fingerprints (weights, gradients) usually differ before the rounded loss does.
        for ax in (top, bottom):
            ax.axvline(first, color="C3", ls=":", lw=1)
        top.text(first, top.get_ylim()[1], f" first bit difference: step {first}", color="C3", va="top",
                 fontsize=8)
        summary += f"; first bit difference (weights/grads/loss) at step {first}"
    bottom.set_title(summary, fontsize=8)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def _first_difference(steps_a: list[dict], steps_b: list[dict]) -> int | None:
    """The first step where the fingerprints (weights, gradients, exact loss) differ, if any. The model order
    of the names is not needed for that."""
    try:
        first = first_difference(steps_a, steps_b, order=[])
    except RunFileError:  # misaligned step numbers: a plot does not need the line, draw it without
        return None
    return None if first is None else first.step
