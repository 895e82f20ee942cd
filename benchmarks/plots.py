"""PNG plots of a benchmark run."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any


def _bars(rows: list[dict[str, Any]], metric: str, ylabel: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    configs = sorted({r["config"] for r in rows}, key=[r["config"] for r in rows].index)
    variants = sorted({r["variant"] for r in rows}, key=[r["variant"] for r in rows].index)
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(configs)), 5))
    for i, variant in enumerate(variants):
        values = {
            r["config"]: r[metric] for r in rows if r["variant"] == variant and r.get(metric) is not None
        }
        xs = [c for c in range(len(configs)) if configs[c] in values]
        ax.bar([x + i * width for x in xs], [values[configs[x]] for x in xs], width, label=variant)
    ax.set_xticks(
        [x + 0.4 - width / 2 for x in range(len(configs))], configs, rotation=20, ha="right", fontsize=8
    )
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _step_time_and_memory(rows: list[dict[str, Any]], out: Path, *, prefix: str) -> list[Path]:
    """Bars of step time and of peak memory above the model per variant and configuration, into
    ``{prefix}step_time.png`` and ``{prefix}memory.png``."""
    written = []
    for metric, label, name in (
        ("step_ms", "step time (ms)", "step_time.png"),
        ("peak_mib_above_model", "peak MiB above the model", "memory.png"),
    ):
        _bars(rows, metric, label, out / f"{prefix}{name}")
        written.append(out / f"{prefix}{name}")
    return written


def _sweep(rows: list[dict[str, Any]], axis: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    panels = sorted({r["scenario"] for r in rows})
    fig, axes = plt.subplots(2, len(panels), figsize=(6 * len(panels), 8), squeeze=False)
    for col, scenario in enumerate(panels):
        lines: dict[str, list] = defaultdict(list)
        for r in rows:
            if r["scenario"] == scenario and r.get("step_ms") is not None:
                lines[r["variant"]].append((r[axis], r["step_ms"], r["peak_mib_above_model"]))
        for variant, points in lines.items():
            points.sort()
            axes[0][col].plot([p[0] for p in points], [p[1] for p in points], marker="o", label=variant)
            axes[1][col].plot([p[0] for p in points], [p[2] for p in points], marker="o", label=variant)
        axes[0][col].set_title(f"{scenario}: step time")
        axes[1][col].set_title(f"{scenario}: peak memory above the model")
        axes[0][col].set_ylabel("ms")
        axes[1][col].set_ylabel("MiB")
        for ax in axes[:, col]:
            ax.set_xlabel(axis)
            ax.set_xscale("log", base=2)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(results: list[dict[str, Any]], out: Path) -> list[Path]:
    """Step time and memory per variant for the main configurations, DDP step time, and the two
    sweeps."""
    written = []
    main = [r for r in results if r["suite"] == "main"]
    if main:
        written += _step_time_and_memory(main, out, prefix="")
    ddp = [r for r in results if r["suite"] == "ddp"]
    if ddp:
        _bars(ddp, "step_ms", "DDP step time (ms)", out / "ddp_step_time.png")
        written.append(out / "ddp_step_time.png")
    for suite, axis in (("tokens", "tokens"), ("depth", "depth")):
        rows = [r for r in results if r["suite"] == suite]
        if rows:
            _sweep(rows, axis, out / f"sweep_{suite}.png")
            written.append(out / f"sweep_{suite}.png")
    return written


def write_hf_plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Step time and peak memory above the model per variant of the real-model suite, one group of
    bars per model and scenario."""
    measured = [dict(r, config=f"{r['model']} {r['scenario']}") for r in rows if r.get("step_ms") is not None]
    return _step_time_and_memory(measured, out, prefix="hf_") if measured else []
