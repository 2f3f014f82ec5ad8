"""The planner against what was measured: meshtrain's steps on one H100 and published large runs
(plan/reference.py). No device is needed: it prints prediction, reference and error per row."""

from bench.reference import H100_STEPS, LLAMA3_405B, MEGATRON_2021, h100_step, plan_published


def main(args=None) -> None:
    print("| H100 step | peak MiB measured / planned | tokens/s measured / planned |")
    print("|---|---|---|")
    for row in H100_STEPS:
        got = h100_step(row)
        kind = "compile" if row.compiled else "eager"
        print(
            f"| {row.model} seq {row.seq_len} x {row.micro_batch} {kind} | {row.peak_mib:,.0f} / "
            f"{got['peak_mib']:,.0f} ({got['peak_mib'] / row.peak_mib - 1:+.1%}) | {row.tokens_per_s / 1e3:.1f}k / "
            f"{got['tokens_per_s'] / 1e3:.1f}k ({got['tokens_per_s'] / row.tokens_per_s - 1:+.1%}) |"
        )
    print()
    print("| published run | GPUs | layout the planner picks | TFLOP/s per GPU published / planned |")
    print("|---|---|---|---|")
    for run in MEGATRON_2021 + LLAMA3_405B:
        got = plan_published(run)
        planned = got["tflops_per_gpu"]
        print(
            f"| {run.name} ({run.source}) | {run.gpus} x {run.gpu} | {got['layout'].describe()} | "
            f"{run.tflops_per_gpu:.0f} / {planned:.0f} ({planned / run.tflops_per_gpu - 1:+.1%}) |"
        )


if __name__ == "__main__":
    main()
