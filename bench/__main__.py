"""python -m bench [--presets tiny,small] [--dtypes fp32,bf16] [--steps N] [--rounds R]"""

from bench.throughput import main

main()
