"""A profile as a picture: prefill TTFT and tokens/s against prompt length (a curve
per concurrency), decode ITL and tokens/s against batch (a curve per context),
log-log as the planner's interpolation reads them. Without matplotlib, the same as a
text table. Returns the file written."""

from collections import defaultdict
from pathlib import Path

from services.planner.profile import Profile


def _table(profile: Profile) -> str:
    lines = [f"{profile.model} on {profile.device} ({profile.commit})",
             "prefill: input_tokens concurrency ttft_ms tokens_per_s"]
    lines += [f"  {p.input_tokens} {p.concurrency} {p.ttft_ms:.2f} {p.tokens_per_s:.1f}" for p in profile.prefill]
    lines.append("decode: batch context_tokens itl_ms tokens_per_s")
    lines += [f"  {d.batch} {d.context_tokens} {d.itl_ms:.2f} {d.tokens_per_s:.1f}" for d in profile.decode]
    return "\n".join(lines) + "\n"


def plot_profile(profile: Profile, stem: Path) -> Path:
    """stem.png, or stem.txt where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only
        import matplotlib.pyplot as plt
    except ImportError:
        path = stem.with_suffix(".txt")
        path.write_text(_table(profile))
        return path
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    by_conc: dict[int, list] = defaultdict(list)
    for p in profile.prefill:
        by_conc[p.concurrency].append(p)
    for conc, points in sorted(by_conc.items()):
        points.sort(key=lambda p: p.input_tokens)
        x = [p.input_tokens for p in points]
        axes[0, 0].plot(x, [p.ttft_ms for p in points], "o-", label=f"concurrency {conc}")
        axes[0, 1].plot(x, [p.tokens_per_s for p in points], "o-", label=f"concurrency {conc}")
    by_ctx: dict[int, list] = defaultdict(list)
    for d in profile.decode:
        by_ctx[d.context_tokens].append(d)
    for ctx, points in sorted(by_ctx.items()):
        points.sort(key=lambda d: d.batch)
        x = [d.batch for d in points]
        axes[1, 0].plot(x, [d.itl_ms for d in points], "o-", label=f"context {ctx}")
        axes[1, 1].plot(x, [d.tokens_per_s for d in points], "o-", label=f"context {ctx}")
    titles = [("prefill: time to first token", "uncached prompt tokens", "ms"),
              ("prefill: uncached prompt tokens/s", "uncached prompt tokens", "tokens/s"),
              ("decode: inter-token latency", "batch (streams)", "ms"),
              ("decode: output tokens/s", "batch (streams)", "tokens/s")]  # fmt: skip
    for ax, (title, xlabel, ylabel) in zip(axes.flat, titles):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ax.has_data():
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"{profile.model} on {profile.device}")
    fig.tight_layout()
    path = stem.with_suffix(".png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
