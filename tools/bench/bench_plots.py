"""`infermesh bench`'s plots, as PNG files: the latency CDFs of every load level,
and throughput and latency against load."""

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402

_TITLES = {"ttft": "time to first token", "tpot": "time per output token", "itl": "inter-token latency",
           "e2el": "end-to-end latency"}  # fmt: skip


def plot_latency_cdfs(report: dict[str, Any], path: Path) -> None:
    """One panel per latency, one curve per load level."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, title) in zip(axes.flat, _TITLES.items()):
        for level in report["levels"]:
            values = np.sort(np.array(level["samples_ms"][name]))
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=level["label"])
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(f"{report['config']['model']} at {report['config']['base_url']}: latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_throughput_vs_load(report: dict[str, Any], path: Path) -> None:
    """Output tokens/s and requests/s, then median and tail latencies, against the load levels."""
    levels = report["levels"]
    closed = all(level["level"]["concurrency"] is not None for level in levels)
    x = [level["load"] for level in levels]
    xlabel = "concurrency (closed loop)" if closed else "request rate, /s (open loop)"
    top = f"p{report['config']['percentiles'][-1]:g}"
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    figures = [level["figures"] for level in levels]
    ax_tput.plot(x, [f["output_throughput"] for f in figures], "o-", label="output tok/s")
    ax_tput.plot(x, [f["total_token_throughput"] for f in figures], "s--", label="total tok/s")
    ax_tput.set_ylabel("tokens/s")
    ax_req = ax_tput.twinx()
    ax_req.plot(x, [f["request_throughput"] for f in figures], "^:", color="tab:red", label="req/s")
    ax_req.set_ylabel("requests/s")
    ax_tput.set_xlabel(xlabel)
    ax_tput.set_title("throughput")
    ax_tput.grid(alpha=0.3)
    lines = ax_tput.get_legend_handles_labels()
    more = ax_req.get_legend_handles_labels()
    ax_tput.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8)
    for name in ("ttft", "tpot", "e2el"):
        line, = ax_lat.plot(x, [f[f"median_{name}_ms"] for f in figures], "o-", label=f"{name.upper()} median")
        ax_lat.plot(x, [f[f"{top}_{name}_ms"] for f in figures], "x--", color=line.get_color(), label=f"{name.upper()} {top}")
    ax_lat.set_xlabel(xlabel)
    ax_lat.set_ylabel("ms")
    if all(f[f"median_{n}_ms"] > 0 for f in figures for n in ("ttft", "tpot", "e2el")):
        ax_lat.set_yscale("log")  # TTFT and E2EL can be orders of magnitude above TPOT
    ax_lat.set_title("latency")
    ax_lat.grid(alpha=0.3)
    ax_lat.legend(fontsize=8)
    fig.suptitle(f"{report['config']['model']} at {report['config']['base_url']}: against load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
