"""The GPUs' dense peaks from their vendors' data sheets: one table for MFU (hardware.py) and for
the planner's catalog (plan/hardware.py). Plain values: the planner reads them without torch."""

from __future__ import annotations

# Dense peak TFLOP/s per GPU from the vendors' data sheets: (bf16, fp32 without TF32, fp8 with fp32
# accumulation as torch._scaled_mm runs it; 0: no FP8 units, compute capability below 8.9). Sparse
# figures are twice these. Matched by substring of torch.cuda.get_device_name(), most specific first.
GPU_PEAK_TFLOPS: list[tuple[str, float, float, float]] = [
    ("GB200", 2500.0, 80.0, 5000.0),
    ("B200", 2250.0, 80.0, 4500.0),
    ("H200", 989.5, 66.9, 1979.0),
    ("GH200", 989.5, 66.9, 1979.0),
    ("H100 PCIe", 756.5, 51.2, 1513.0),
    ("H100 NVL", 835.0, 60.0, 1670.5),
    ("H100", 989.5, 66.9, 1979.0),
    ("H800", 989.5, 66.9, 1979.0),
    ("A100", 312.0, 19.5, 0.0),
    ("A800", 312.0, 19.5, 0.0),
    ("L40S", 362.1, 91.6, 733.0),
    ("L40", 181.0, 90.5, 362.0),
    ("L4", 121.0, 30.3, 242.5),
    ("A10G", 70.0, 31.2, 0.0),
    ("A10", 125.0, 31.2, 0.0),
    ("RTX 4090", 165.2, 82.6, 330.3),  # GeForce: fp32 accumulation at half the fp16-accumulate rate
    ("V100", 125.0, 15.7, 0.0),  # no bf16: fp16 tensor-core peak
    ("MI300X", 1307.4, 163.4, 2614.9),
    ("MI250X", 383.0, 47.9, 0.0),
]
