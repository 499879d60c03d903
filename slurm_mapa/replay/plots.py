"""PNG box plots like the paper's figures 13 and 18 (matplotlib is optional: the ``plot`` extra)."""

from __future__ import annotations

from typing import Sequence

from .simulate import RunResult


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _stats(dist, label: str) -> dict | None:
    f = dist.five()
    if not f["n"]:
        return None
    return {"label": label, "whislo": f["min"], "q1": f["p25"], "med": f["median"], "q3": f["p75"], "whishi": f["max"], "fliers": []}


def boxplot_png(path: str, groups: Sequence[tuple[str, Sequence[RunResult]]], *, what: str = "sensitive", title: str = "") -> None:
    """One panel per group (a topology), one box per policy; whiskers are min and max, as the paper draws them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.8), squeeze=False)
    for ax, (name, results) in zip(axes[0], groups):
        stats = []
        for r in results:
            dist = {"sensitive": r.eff_sensitive, "insensitive": r.eff_insensitive, "runtime": r.runtime_sensitive}[what]
            s = _stats(dist, r.policy)
            if s:
                stats.append(s)
        if stats:
            ax.bxp(stats, showfliers=False)
        ax.set_title(name)
        ax.set_ylabel("run time (s)" if what == "runtime" else "effective bandwidth (GB/s)")
        ax.tick_params(axis="x", labelrotation=35)
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def series_png(path: str, results: Sequence[RunResult], title: str = "") -> None:
    """Preserved bandwidth and fragmentation over time, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for r in results:
        pts = r.series.points
        if not pts:
            continue
        t0 = pts[0][0]
        top.plot([p[0] - t0 for p in pts], [p[1] for p in pts], label=r.policy, lw=0.8)
        bottom.plot([p[0] - t0 for p in pts], [p[2] for p in pts], label=r.policy, lw=0.8)
    top.set_ylabel("preserved BW (GB/s)")
    bottom.set_ylabel("fragmentation")
    bottom.set_xlabel("time (s)")
    top.legend(fontsize=7, ncol=3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
