"""Measured memory, to hold the planner's predictions against: the bytes autograd keeps for backward,
and the peak of live tensor bytes over a step (CPU has no allocator statistics)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the memory: a DTensor's local shard, an async collective's result."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


class SavedActivations:
    """Bytes of the distinct storages autograd saves for backward inside this context, without the
    model's parameters and buffers, plus the inputs that activation checkpointing holds for its
    recomputation (non-reentrant checkpointing hides what it saves from outer hooks). DTensors count
    their local shard."""

    def __init__(self, model: nn.Module):
        self._exclude = {_local(t).untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self._model = model
        self.storages: dict[int, int] = {}

    def _count(self, t: torch.Tensor) -> None:
        local = _local(t)
        if local.is_meta or isinstance(local, FakeTensor):  # DTensor's sharding propagation runs on fakes
            return
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self._exclude:
            self.storages.setdefault(key, storage.nbytes())

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        def pack(t):
            self._count(t)
            return t

        def checkpoint_inputs(module, args):
            for a in tree_flatten(args)[0]:
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    self._count(a)

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        for name, module in self._model.named_modules():
            if name.endswith("_checkpoint_wrapped_module"):
                handle = module.register_forward_pre_hook(checkpoint_inputs)
                self._stack.callback(handle.remove)
        return self

    def __exit__(self, *exc):
        self._stack.close()


class PeakLiveBytes(TorchDispatchMode):
    """The largest sum of live tensor storages seen after any operator: `existing` tensors (the
    parameters) plus every storage an operator creates, tracked by weak reference so that a freed
    one stops counting at the next operator (an in-place update of an existing one counts once)."""

    def __init__(self, existing: list[torch.Tensor] = ()):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        for t in existing:
            self._track(t)
        self.peak = self.live_bytes

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in self._live:
            self._live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())

    @property
    def live_bytes(self) -> int:
        return sum(n for _, n in self._live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(t)
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        self.peak = max(self.peak, self.live_bytes)
        return out
