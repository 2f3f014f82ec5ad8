"""`meshtrain plan`: per-GPU memory and step time of any layout on any cluster, and the best one.

shapes.py    the model's parameter table and FLOPs (Llama as trained; classic GPT)
hardware.py  accelerators and networks (data sheets, overridable; the CPU measured)
layout.py    the knobs of a layout and of the job
memory.py    model states (exact), activations (per saved tensor), in-flight micro-batches, buffers
speed.py     matmuls, memory-bound work, TP/PP/DP communication, bubble, optimizer
search.py    enumerate, check with the trainer's own rules, estimate, rank
measure.py   measured saved activations and peak bytes, to hold the model to
"""

from meshtrain.plan.hardware import CATALOG, KINDS, device
from meshtrain.plan.layout import Layout, Workload, to_config
from meshtrain.plan.memory import activation_bytes, estimate_memory, model_state_bytes
from meshtrain.plan.search import Estimate, evaluate, search
from meshtrain.plan.shapes import Shape
from meshtrain.plan.speed import step_time

__all__ = [
    "CATALOG",
    "KINDS",
    "Estimate",
    "Layout",
    "Shape",
    "Workload",
    "activation_bytes",
    "device",
    "estimate_memory",
    "evaluate",
    "model_state_bytes",
    "search",
    "step_time",
    "to_config",
]
