"""PNG timelines: per rank, when it computed, when its link was busy, and when it sat blocked
waiting for communication (exposed communication)."""

from __future__ import annotations

from dataclasses import dataclass, field

COLORS = {"compute": "#4C72B0", "link": "#DD8452", "blocked": "#C44E52",
          "forward": "#4C72B0", "backward": "#55A868", "wgrad": "#8172B3", "dp": "#937860", "idle": "#C44E52"}
LABELS = {"compute": "compute", "link": "link busy (transfer)", "blocked": "blocked on communication",
          "forward": "F (forward)", "backward": "B (backward; with W unless split)", "wgrad": "W (weight gradients)",
          "dp": "data-parallel traffic (reduce-scatter, all-gather)", "idle": "idle (no compute)"}


@dataclass
class Panel:
    """One plot: rows of (label, kind, [(start_ms, end_ms), ...]) over ``[0, width_ms]``."""

    title: str
    width_ms: float
    rows: list = field(default_factory=list)


def _require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # optional dependency
        raise RuntimeError(
            "drawing the timeline needs matplotlib: pip install 'megatron-overlap[viz]'"
        ) from exc
    return plt


def clip(intervals, start: float, end: float) -> list[tuple[float, float]]:
    """Intervals (seconds) cut to [start, end] and shifted to milliseconds from ``start``."""
    out = []
    for a, b in intervals:
        a, b = max(a, start), min(b, end)
        if b > a:
            out.append((1e3 * (a - start), 1e3 * (b - start)))
    return out


def subtract(window: tuple[float, float], holes) -> list[tuple[float, float]]:
    """``window`` minus the union of ``holes`` (all in the same time unit)."""
    start, end = window
    pieces, cursor = [], start
    for a, b in sorted(holes):
        if b <= cursor or a >= end:
            continue
        if a > cursor:
            pieces.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < end:
        pieces.append((cursor, end))
    return pieces


def draw(panels: list[Panel], path: str, title: str = "", columns: int = 2) -> str:
    plt = _require_matplotlib()
    rows_per_panel = max(len(p.rows) for p in panels)
    nrows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(
        nrows, columns, figsize=(7 * columns, 0.45 * rows_per_panel * nrows + 1.6), squeeze=False
    )
    for index, panel in enumerate(panels):
        ax = axes[index // columns][index % columns]
        for y, (label, kind, intervals) in enumerate(panel.rows):
            ax.broken_barh(
                [(a, b - a) for a, b in intervals], (y - 0.38, 0.76), facecolors=COLORS[kind]
            )
        ax.set_yticks(range(len(panel.rows)))
        ax.set_yticklabels([label for label, _, _ in panel.rows], fontsize=8)
        ax.set_ylim(len(panel.rows) - 0.5, -0.5)
        ax.set_xlim(0, panel.width_ms)
        ax.set_xlabel("ms", fontsize=8)
        ax.set_title(panel.title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    for index in range(len(panels), nrows * columns):
        axes[index // columns][index % columns].axis("off")
    used = [k for k in COLORS if any(kind == k for panel in panels for _l, kind, _i in panel.rows)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in used]
    fig.legend(handles, [LABELS[k] for k in used], loc="lower center", ncol=min(len(used), 2 if columns == 1 else 4),
               fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    legend_in = 0.25 * ((len(used) + 1) // (2 if columns == 1 else 4) + 1)  # inches the legend's rows take
    fig.tight_layout(rect=(0, min(0.3, legend_in / fig.get_figheight()), 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
