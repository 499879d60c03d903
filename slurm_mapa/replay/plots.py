"""PNG plots of a replay (matplotlib is optional: the ``plot`` extra).

Each plot answers one question, says it in its title, and names MAPA's own policy (``preserve``)
as such; MAPA is drawn in one strong colour, the other policies in grey tones, so the comparison
reads at a glance. Long labels are wrapped, never clipped.
"""

from __future__ import annotations

import textwrap
from typing import Sequence

from .results import RunResult

MAPA_POLICY = "preserve"
MAPA_COLOUR = "#c0392b"


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def policy_label(policy: str) -> str:
    return f"{policy} (MAPA)" if policy == MAPA_POLICY else policy


def _wrapped(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width)) if text else ""


def _stats(dist, label: str) -> dict | None:
    f = dist.five()
    if not f["n"]:
        return None
    return {"label": label, "whislo": f["min"], "q1": f["p25"], "med": f["median"], "q3": f["p75"], "whishi": f["max"], "fliers": []}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _horizontal() -> dict:
    """bxp's keyword for horizontal boxes: ``orientation`` from Matplotlib 3.10, ``vert`` before
    (deprecated in 3.11); Debian's and PyPI's releases differ."""
    import matplotlib

    major_minor = tuple(int(part) for part in matplotlib.__version__.split(".")[:2] if part.isdigit())
    return {"orientation": "horizontal"} if major_minor >= (3, 10) else {"vert": False}


def boxplot_png(path: str, groups: Sequence[tuple[str, Sequence[RunResult]]], *, what: str = "sensitive", title: str = "") -> None:
    """One panel per group (a workload on a topology), one horizontal box per policy: the box
    spans the middle half of the jobs (25th to 75th percentile), the line in it is the median, the
    whiskers reach the lowest and the highest job, as the paper draws them."""
    plt = _pyplot()
    rows = max((len(results) for _, results in groups), default=1)
    fig, axes = plt.subplots(1, len(groups), figsize=(6.4 * len(groups), 1.2 + 0.42 * rows), squeeze=False)
    for ax, (name, results) in zip(axes[0], groups):
        unit = "run time (s)" if what == "runtime" else f"effective bandwidth (GB/s), judged by {_judges(results)}"
        stats, colours = [], []
        for r in results:
            dist = {"sensitive": r.eff_sensitive, "insensitive": r.eff_insensitive, "runtime": r.runtime_sensitive}[what]
            s = _stats(dist, policy_label(r.policy))
            if s:
                stats.append(s)
                colours.append(MAPA_COLOUR if r.policy == MAPA_POLICY else "#5d6d7e")
        if stats:
            drawn = ax.bxp(stats[::-1], showfliers=False, patch_artist=True, widths=0.6, **_horizontal())
            for box, median, colour in zip(drawn["boxes"], drawn["medians"], colours[::-1]):
                box.set(facecolor="white", edgecolor=colour, linewidth=1.6 if colour == MAPA_COLOUR else 1.0)
                median.set(color=colour, linewidth=2.0)
        ax.set_title(_wrapped(name, 60), fontsize=9)
        ax.set_xlabel(_wrapped(unit + ("; higher is better" if what != "runtime" else "; lower is better"), 60))
        ax.grid(axis="x", alpha=0.3)
    if title:
        fig.suptitle(_wrapped(title, 70 * len(groups)), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _judges(results: Sequence[RunResult]) -> str:
    """The judging model(s) of the runs drawn, for the axis labels."""
    return ", ".join(dict.fromkeys(r.judge for r in results)) or "-"


def by_size_png(path: str, results: Sequence[RunResult], title: str = "") -> None:
    """Which policy gives a sensitive job of k GPUs the fastest set? A table of the median predicted
    effective bandwidth of the sensitive jobs of each size (columns) under each policy (rows), each
    cell shaded by how close it comes to the best policy of its column (darkest = the best)."""
    plt = _pyplot()
    sizes = sorted({k for r in results for k, s in r.by_gpus.items() if k >= 2 and s.eff_sensitive.count})
    rows = [r for r in results if any(k in r.by_gpus and r.by_gpus[k].eff_sensitive.count for k in sizes)]
    medians = [[r.by_gpus[k].eff_sensitive.quantile(0.5) if k in r.by_gpus and r.by_gpus[k].eff_sensitive.count else None
                for k in sizes] for r in rows]
    best = [max((row[j] for row in medians if row[j] is not None), default=None) for j in range(len(sizes))]
    shade = [[(value / best[j]) if value is not None and best[j] else 0.0 for j, value in enumerate(row)] for row in medians]
    fig, ax = plt.subplots(figsize=(1.6 + 1.0 * max(len(sizes), 1), 1.4 + 0.42 * max(len(rows), 1)))
    ax.imshow(shade or [[0.0]], cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    for i, row in enumerate(medians):
        for j, value in enumerate(row):
            text = "-" if value is None else f"{value:.1f}"
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if shade[i][j] > 0.6 else "black",
                    fontweight="bold" if value is not None and value == best[j] else "normal")
    ax.set_xticks(range(len(sizes)), [str(k) for k in sizes])
    ax.set_yticks(range(len(rows)), [policy_label(r.policy) for r in rows])
    for label in ax.get_yticklabels():
        if label.get_text() == policy_label(MAPA_POLICY):
            label.set_color(MAPA_COLOUR)
            label.set_fontweight("bold")
    ax.set_xlabel("GPUs of the job on its node")
    ax.tick_params(length=0)
    ax.set_title(_wrapped((title or "sensitive jobs by size") + f": median effective bandwidth (GB/s), judged by "
                          f"{_judges(results)}; bold = the best policy for that size", 60), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def short_label(label: str, longest: int = 60) -> str:
    """An input's label for a title: a file path by its name, and at most ``longest`` characters."""
    import os

    if os.sep in label and os.path.exists(label):
        label = os.path.basename(label)
    return label if len(label) <= longest else label[:longest - 3] + "..."


def write_plots(directory: str, label: str, results: Sequence[RunResult], time_model: bool = True) -> list[str]:
    """Every plot of one replay into ``directory``; the paths written. The run-time plot only with
    a time model: without one every policy's jobs run as recorded, and it would answer nothing."""
    import os

    os.makedirs(directory, exist_ok=True)
    label = short_label(label)
    files = []
    for what, question in (("sensitive", "How fast are the GPU sets the sensitive jobs got?"),
                           ("insensitive", "How fast are the GPU sets the insensitive jobs got?")):
        path = os.path.join(directory, f"effbw-{what}.png")
        boxplot_png(path, [(label, results)], what=what, title=question)
        files.append(path)
    path = os.path.join(directory, "by-size.png")
    by_size_png(path, results, title=f"Which policy gives a sensitive job of k GPUs the fastest set? {label}")
    files.append(path)
    if time_model and any(r.runtime_sensitive.count for r in results):
        path = os.path.join(directory, "runtime-sensitive.png")
        boxplot_png(path, [(label, results)], what="runtime", title="How long did the sensitive jobs run?")
        files.append(path)
    return files
