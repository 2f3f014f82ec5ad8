"""Training throughput per precision on the machine at hand: throughput.py's rows (meshtrain's step
and the HF loops, interleaved rounds in one process, the ratio per round) for fp32, bf16, fp16 and
FP8, then what they say about the machine. Whether fp16 or bf16 pays off is decided from the
tokens/s measured here, never from CPU flags: a flag says an instruction exists, not that the
kernels a step runs use it or beat fp32 with it.

The rows are timed one after another, minutes apart, so the ratios between dtypes (the best
variant of each row) carry the machine's drift between rows (20-30% on a shared VM): fp16 counts
as faster or slower than fp32 only beyond that.
"""

from __future__ import annotations

from bench import throughput
from bench.common import device, markdown, write_results

DRIFT = 1.3  # what two rows minutes apart can differ by on a shared VM without any real difference


def best(rows: list[dict], preset: str, dtype: str) -> tuple[float, str] | None:
    """The fastest variant of a row, meshtrain's or HF's: what the dtype gives on this machine."""
    for r in rows:
        if (r["preset"], r["dtype"]) == (preset, dtype):
            timed = [(r[f"{n}_tokens_per_s"], n) for n in throughput.VARIANTS if f"{n}_tokens_per_s" in r]
            return max(timed, default=None)
    return None


def fp16_verdict(fp16: float, fp32: float) -> str:
    r = fp16 / fp32
    if r >= DRIFT:
        return f"fp16 trains {r:.2f}x as fast as fp32: this machine has fp16 units that beat fp32"
    if r <= 1 / DRIFT:
        return f"fp16 trains at {r:.2f}x fp32's speed: its fp16 kernels are slower than fp32 here (no fp16 units used)"
    return f"fp16 trains at {r:.2f}x fp32's speed: no fp16 speed-up here (fp16 work runs at fp32's rate)"


def summary(rows: list[dict], dtypes: list[str]) -> str:
    """Per preset: the best tokens/s of each dtype, fp16 and FP8 against fp32 and bf16, and the
    verdicts; the fp16 loss scales at the end show that no timed step was skipped for an overflow."""
    cpu = device().type == "cpu"
    lines = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        got = {d: best(rows, preset, d) for d in dtypes}
        notes = []
        if "fp16" in got and got.get("fp32"):
            fp16_row = next(r for r in rows if (r["preset"], r["dtype"]) == (preset, "fp16"))
            notes.append(fp16_verdict(got["fp16"][0], got["fp32"][0]) if got["fp16"] else fp16_row["skipped"])
            if got["fp16"] and got.get("bf16"):
                notes[-1] += f"; {got['fp16'][0] / got['bf16'][0]:.2f}x bf16's"
            scales = {k.removesuffix("_loss_scale"): v for k, v in fp16_row.items() if k.endswith("_loss_scale")}
            if scales:
                notes.append(
                    "fp16 loss scale after the timed steps: " + ", ".join(f"{n} {v:,.0f}" for n, v in scales.items())
                )
        for d in dtypes:
            if d in throughput.FP8 and got[d] and got.get("bf16"):
                how = "emulated on a CPU: FP8's numbers, not its speed" if cpu else "on FP8 units"
                notes.append(f"{d} trains at {got[d][0] / got['bf16'][0]:.2f}x bf16's speed ({how})")
        cells = [f"{got[d][0]:,.0f} ({got[d][1]})" if got[d] else "-" for d in dtypes]
        lines.append([preset, *cells, "; ".join(notes)])
    return markdown(["preset", *[f"{d} best tok/s (variant)" for d in dtypes], "what it shows"], lines)


def main(a) -> list[dict]:
    dtypes = a.precision_dtypes.split(",")
    rows = [
        throughput.run(preset, dtype, a.batch, a.seq_len, a.steps, a.rounds)
        for preset in a.precision_presets.split(",")
        for dtype in dtypes
    ]
    write_results("precision", rows, throughput.table(rows) + "\n\n" + summary(rows, dtypes))
    return rows
