"""PNG figures from the result files: throughput against model size, memory per rank against ZeRO
stage and world size, scaling efficiency per layout."""

from __future__ import annotations

import json

from bench.common import RESULTS
from meshtrain.job.model import model_args


def _load(name: str) -> list[dict] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text())["rows"] if path.is_file() else None


def main(_=None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from bench.throughput import VARIANTS
    from meshtrain.config import load_config
    from meshtrain.model import Llama, num_params

    written = []
    if rows := _load("throughput"):
        dtypes = sorted({r["dtype"] for r in rows})
        fig, axes = plt.subplots(1, len(dtypes), figsize=(5 * len(dtypes), 4), squeeze=False)
        for ax, dtype in zip(axes[0], dtypes):
            mine = [r for r in rows if r["dtype"] == dtype]
            sizes = []
            for r in mine:
                with torch.device("meta"):
                    model = Llama(model_args(load_config(overrides={"model.preset": r["preset"]})))
                sizes.append(num_params(model) / 1e6)
            for i, name in enumerate(VARIANTS):  # one colour per variant in every panel
                if f"{name}_tokens_per_s" in mine[0]:
                    ax.plot(sizes, [r[f"{name}_tokens_per_s"] for r in mine], marker="o", label=name, color=f"C{i}")
            ax.set(
                xscale="log",
                yscale="log",
                xlabel="parameters (M)",
                ylabel="training tokens/s",
                title=f"{dtype}, {mine[0]['device']}, batch {mine[0]['batch']} x {mine[0]['seq_len']}",
            )
            ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "throughput.png", dpi=110)
        written.append("throughput.png")
    if rows := _load("memory"):
        worlds = sorted({r["world"] for r in rows})
        fig, ax = plt.subplots(figsize=(8, 4))
        labels, bottoms = [], []
        for w in worlds:
            for r in (r for r in rows if r["world"] == w):
                labels.append(f"N={w}\nZeRO-{r['zero']}")
                bottoms.append(r)
        x = range(len(labels))
        base = [0.0] * len(labels)
        for key in ("params", "grads", "optimizer"):
            values = [r[key] / 2**20 for r in bottoms]
            ax.bar(x, values, bottom=base, label=key)
            base = [b + v for b, v in zip(base, values)]
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set(ylabel="MiB per rank (model states)", title="memory per rank vs ZeRO stage and world size")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "memory.png", dpi=110)
        written.append("memory.png")
    if rows := _load("scaling"):
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar([r["layout"] for r in rows], [100 * r["efficiency"] for r in rows])
        ax.axhline(85, color="gray", linestyle="--", label="target 85%")
        ax.set(ylabel="% of single-process tokens/s", title="scaling: processes x 1 thread vs 1 process")
        ax.tick_params(axis="x", labelsize=8, labelrotation=20)
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "scaling.png", dpi=110)
        written.append("scaling.png")
    print("plots: " + ", ".join(written), flush=True)
    return written
