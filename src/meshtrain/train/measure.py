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

from meshtrain.parallel.activation_checkpoint import observing_op_saves


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the memory: a DTensor's local shard, an async collective's result."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


def _storage_key(t: torch.Tensor) -> int:
    """What identifies a tensor's memory: its storage (views share it), real or fake."""
    return t.untyped_storage()._cdata


def _fsdp_unsharded_storages(model: nn.Module) -> set[int]:
    """The storages FSDP2 all-gathers each module's weights into (freed again after use)."""
    keys = set()
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", []):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                keys.add(_storage_key(_local(unsharded)))
    return keys


class SavedActivations:
    """Bytes of the distinct storages autograd saves for backward inside this context, without the
    model's parameters and buffers, plus the inputs that activation checkpointing holds for its
    recomputation (non-reentrant checkpointing hides what it saves from outer hooks) and what
    op-level checkpointing keeps in its own cache. DTensors count
    their local shard. `fake`: the step runs on FakeTensors (a dry run), which then count; otherwise
    fakes are DTensor's sharding propagation and do not."""

    def __init__(self, model: nn.Module, fake: bool = False):
        self._exclude = {_storage_key(_local(t)) for t in (*model.parameters(), *model.buffers())}
        self._model, self._fake = model, fake
        self.storages: dict[int, int] = {}

    def _count(self, t: torch.Tensor) -> None:
        local = _local(t)
        if local.is_meta or (isinstance(local, FakeTensor) and not self._fake):
            return
        storage = local.untyped_storage()
        key = storage._cdata
        if storage.nbytes() and key not in self._exclude:
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
        self._stack.enter_context(observing_op_saves(self._count))  # what "op" checkpointing keeps
        for name, module in self._model.named_modules():
            if name.endswith("_checkpoint_wrapped_module"):
                handle = module.register_forward_pre_hook(checkpoint_inputs)
                self._stack.callback(handle.remove)
        return self

    def __exit__(self, *exc):
        self._stack.close()
        for key in _fsdp_unsharded_storages(self._model):  # all-gathered weights: freed after use
            self.storages.pop(key, None)


class PeakLiveBytes(TorchDispatchMode):
    """The largest sum of live tensor storages seen after any operator: `existing` tensors (the
    parameters, gradients, optimizer states) plus every storage an operator creates, real or fake.

    Storages are held by weak reference, with their size as of the last look: a freed one stops
    counting, and one resized in place (FSDP frees and re-allocates its all-gathered weights by
    resizing their storage) counts its new size. Looking at every storage after every operator would
    cost O(live) per operator; instead the exact sum is refreshed only when the bytes added since the
    last refresh could have lifted it above the peak."""

    def __init__(self, existing: list[torch.Tensor] = ()):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._added = 0
        for t in existing:
            self._track(t)
        self._exact = self._added
        self._added = 0
        self.peak = self._exact

    def _track(self, t: torch.Tensor) -> None:
        storage = _local(t).untyped_storage()
        size, known = storage.nbytes(), self._live.get(storage._cdata)
        if known is None:
            if size:
                self._live[storage._cdata] = (StorageWeakRef(storage), size)
                self._added += size
        elif size > known[1]:  # grown in place since the last look
            self._live[storage._cdata] = (known[0], size)
            self._added += size - known[1]

    def _refresh(self) -> None:
        live: dict[int, tuple[StorageWeakRef, int]] = {}
        for key, (ref, _) in self._live.items():
            if not ref.expired():
                size = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
                if size:
                    live[key] = (ref, size)
        self._live = live
        self._exact, self._added = sum(n for _, n in live.values()), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(t)
        if self._exact + self._added > self.peak:
            self._refresh()
            self.peak = max(self.peak, self._exact)
        return out
