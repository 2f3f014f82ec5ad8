"""`meshtrain plan`'s estimator: per-GPU memory and step time of any layout on any cluster, and the
best one. A pure estimator below the trainer: it reads the model's shape facts (model/shapes.py) and
the trainer's own Layout, and imports nothing of train/ (the dry run, in train/, holds it to what a
built job measures; cli/plan.py is the command).

workload.py  what is trained beside the layout: model, sequence, precision, kernels, LoRA/QLoRA, objective
hardware.py  accelerators and networks (data sheets, overridable; the CPU measured)
states.py    model states per rank (exact), on the GPU or, under CPU offload, in host memory
saved.py     what a block saves for backward, per token, in each precision path
memory.py    model states, activations (per saved tensor), in-flight micro-batches, buffers
speed.py     matmuls (FP8 too), memory-bound work, TP/PP/DP communication, bubble, optimizer, PCIe
checks.py    what is refused before the search: links nothing crosses, precision and peaks, pinned CP, adapters
search.py    enumerate, check with the trainer's own rules, estimate, rank
report.py    the table
failures.py  `--failures`: effective training time of checkpoint-restart and replica groups, replayed
"""

from meshtrain.plan.hardware import CATALOG, KINDS, device
from meshtrain.plan.memory import activation_bytes, estimate_memory
from meshtrain.plan.search import Estimate, evaluate, search
from meshtrain.plan.speed import step_time
from meshtrain.plan.states import host_state_bytes, model_state_bytes, nf4_bytes
from meshtrain.plan.workload import Workload, workload_of, workload_refusal

__all__ = [
    "CATALOG",
    "KINDS",
    "Estimate",
    "Workload",
    "activation_bytes",
    "device",
    "estimate_memory",
    "evaluate",
    "host_state_bytes",
    "model_state_bytes",
    "nf4_bytes",
    "search",
    "step_time",
    "workload_of",
    "workload_refusal",
]
