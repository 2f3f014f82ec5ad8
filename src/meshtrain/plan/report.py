"""What `meshtrain plan` prints: a rich table of the best layouts, the memory breakdown of the
first, and why the rest were dropped; or the same as JSON."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from meshtrain.plan.search import GIB, Estimate


def render(title: str, estimates: list[Estimate], refused: dict[str, int], top: int, console: Console) -> None:
    table = Table(title=title, title_justify="left")
    for column in ("#", "layout", "GiB/GPU", "fits", "tokens/s/GPU", "TFLOP/s/GPU", "MFU", "step s"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for i, e in enumerate(estimates[:top], 1):
        s = e.speed
        table.add_row(
            str(i),
            e.layout.describe(),
            f"{e.memory['total'] / GIB:.1f}",
            "yes" if e.fits else "[red]no",
            f"{s['tokens_per_s_per_gpu']:,.0f}",
            f"{s['tflops_per_gpu']:.3g}",
            f"{s['mfu']:.1%}",
            f"{s['step_time_s']:.3g}",
        )
    console.print(table)
    if not estimates:
        console.print("no layout is possible: " + "; ".join(refused))
        return
    best = estimates[0]
    breakdown = Table(title="memory of #1, busiest rank", title_justify="left")
    breakdown.add_column("item")
    breakdown.add_column("GiB", justify="right")
    for key, value in best.memory.items():
        breakdown.add_row(key, f"{value / GIB:.2f}")
    if best.layout.cpu_offload:
        breakdown.add_row("host memory per node (offloaded states)", f"{best.host_per_node / GIB:.2f}")
    times = Table(title="step time of #1", title_justify="left")
    times.add_column("part")
    times.add_column("s", justify="right")
    for key, value in best.speed["seconds"].items():
        times.add_row(key.replace("_", " "), f"{value:.4g}")
    console.print(breakdown)
    console.print(times)
    fitting = sum(e.fits for e in estimates)
    console.print(
        f"{len(estimates)} layouts estimated, {fitting} fit"
        + (
            f"; smallest that does not: {next(e for e in estimates if not e.fits).why_not}"
            if fitting < len(estimates)
            else ""
        )
    )
    for reason, count in sorted(refused.items(), key=lambda kv: -kv[1])[:5]:
        console.print(f"  {count} not possible: {reason}")
