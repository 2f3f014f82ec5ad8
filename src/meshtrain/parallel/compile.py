"""torch.compile of the model: one graph for the whole model where the layout allows, one graph per
transformer block (torchtitan's choice) where the blocks must stay separate units.

- Whole model (one process, or tensor parallel only): `Llama.trunk`, everything but the attention
  mask's construction, is one forward and one backward graph per step, so the host launches a
  handful of compiled kernels instead of walking dozens of modules, hooks and autograd nodes (the
  host time that bounds small models on a GPU). FlexAttention's block mask (document masking on
  CUDA) is built eagerly in `Llama.forward`, once per step, and handed to the graph: built inside
  it, the trainer's compiled step failed on an H100 (torch 2.11: a CUDA "operation not supported on
  global/shared address space" error in inductor's autotuning). Elsewhere the dense mask is built
  inside the graph (eagerly, its choice of kernel would read the documents on the host).
- Per block (data parallel, FSDP, pipeline stages, each also with TP): blocks are identical, so one
  graph is compiled and reused; each block's gradients are ready as soon as its backward graph ran,
  which keeps DDP's bucketed all-reduce and FSDP's per-block reduce-scatter overlapping the rest of
  backward (a whole-model backward graph would hand every gradient over at its very end). FSDP needs
  it: its hooks are marked not to be traced, so a model with FSDP blocks is not one graph.

Measured on one H200 (torch 2.11, `small` bf16, 8 x 1,024 tokens, bench/README.md): with document
masking on (the default) the model had been compiled per block on CUDA, 8 forward and 8 backward
graph calls a step, and the host-bound step took 20 ms where the HF model under torch.compile took
16; with the trunk compiled whole, 15.0 against 15.1.

CUDA graphs (training.cuda_graphs, inductor's `triton.cudagraphs`, what mode="reduce-overhead" sets)
record the whole-model graph's forward and backward once and replay each as one launch. On the same
H200 (torch 2.11, same script, medians of 5 interleaved rounds of 10 steps): 24.8 ms a step compiled,
9.6 with CUDA graphs; hf+compile 26.2, and 11.6 under "reduce-overhead". Parameters are static
inputs (updated in place by AdamW); the batch is copied into the graph's input buffers. A gradient the
backward graph returns lives in the graph's pool until the next replay, so with several
micro-batches they are accumulated in buffers of their own (train/step.py: clear_gradients).

Under TP the first block's input is the embedding's output after an async redistribution (an
AsyncCollectiveTensor). In torch 2.13 a compiled function waits on such an input outside its
autograd node, so the block's input gradient never reaches the embedding: under FSDP its gradient
stayed zero, under TP alone backward failed in the redistribution. `_wait_collectives`, an eager
pre-hook on each compiled block, waits first, inside autograd.

`exact_casts` (`emulate_precision_casts`) keeps every bf16 rounding that eager mode does: without it
inductor fuses away a cast to bf16 and back, and GEMMs in fp32 arithmetic on bf16 storage
(parallel/precision.py) would multiply unrounded values, giving other numbers than the eager step.
It is asked for only there: elsewhere it keeps intermediates of fused elementwise kernels in bf16
that inductor would keep in fp32 (more exact, not less), and costs time: the compiled block of
`small` in bf16 took 74 ms with it and 68 ms without (2-core Xeon with AMX, forward + backward of
8 x 256 tokens)."""

from __future__ import annotations

import torch
from torch import nn

EXACT_CASTS = {"emulate_precision_casts": True}


class _WaitCollective(torch.autograd.Function):
    """The plain tensor of an AsyncCollectiveTensor; its gradient passes through to that tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        done = x.trigger_wait()
        return done.view_as(done)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _wait_collectives(module: nn.Module, args: tuple) -> tuple:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tuple(_WaitCollective.apply(a) if isinstance(a, AsyncCollectiveTensor) else a for a in args)


def apply_compile(
    model: nn.Module, whole_model: bool = False, exact_casts: bool = False, cuda_graphs: bool = False
) -> None:
    """Compile in place (the model's `trunk`, or each block with `Module.compile`), which keeps
    parameter names unchanged. `cuda_graphs` (whole model only): the trunk's forward and backward
    graphs are recorded as CUDA graphs and replayed (training.cuda_graphs)."""
    options = {**(EXACT_CASTS if exact_casts else {}), **({"triton.cudagraphs": True} if cuda_graphs else {})}
    if whole_model:
        model.trunk = torch.compile(model.trunk, fullgraph=True, options=options or None)
        return
    assert not cuda_graphs, "CUDA graphs need the whole-model graph (job/refusals.py: layout_refusal)"
    for block in model.layers.values():
        # A hook of a compiled module is traced unless disabled (wrapped here, not at import: the
        # decorator loads torch._dynamo, a second per process that a run without compile never uses).
        block.register_forward_pre_hook(torch.compiler.disable(_wait_collectives), prepend=True)
        block.compile(fullgraph=True, options=options or None)
