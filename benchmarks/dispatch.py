"""What a GPU pays, counted on any machine: every operation PyTorch dispatches, sorted into kernel launches, views
(metadata only) and operations that wait for the device.

On a GPU each eager operation costs some 5-10 us of host time whatever its size, so a record made of many small
operations is bound by their count, not by arithmetic. The count is exact and does not depend on the machine's load,
so the suite can hold budgets on it (``tests/test_launch_budget.py``) and ``benchmarks/launches.py`` tables it.

A benchmark's tool, not part of ipa_probe (which reads no other package's private names): it needs two that torch
offers no public route to, ``TorchDispatchMode`` (importable only from ``torch.utils._python_dispatch``) and, for
``compiled=True``, inductor's ``cpp.enable_kernel_profile`` (public only as ``torch.compile(options=...)`` on a compile
call the counter does not own, or as an environment variable read when inductor is first imported).

Example:
    >>> with DispatchCount() as count:
    ...     pipe(**call)
    >>> count.launches, count.views, count.syncs
"""

from __future__ import annotations

import collections
import contextlib
import inspect

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # its only import route (see above)

__all__ = ["DispatchCount", "SYNC_OPS"]

_aten = torch.ops.aten

#: Operations that read a device value on the host (a GPU stalls until the queue drains).
SYNC_OPS = frozenset(
    {
        _aten._local_scalar_dense,
        _aten.nonzero,
        _aten.masked_select,
        _aten.is_nonzero,
        _aten.equal,
        _aten._unique2,
        _aten.unique_dim,
        _aten.unique_consecutive,
        _aten.repeat_interleave,
    }
)

#: Operations that allocate or alias memory without launching a kernel (besides the schema's views).
_NO_LAUNCH = frozenset(
    {
        _aten.empty,
        _aten.empty_strided,
        _aten.empty_like,
        _aten._unsafe_view,
        _aten.detach,
        _aten.alias,
        _aten.lift_fresh,
        _aten.set_,
        _aten.resize_,
        _aten.sym_size,
        _aten.sym_stride,
        _aten.sym_numel,
        _aten.sym_storage_offset,
    }
)


def is_view(func) -> bool:
    """An operation that only makes new metadata over the same memory (``view``, ``select``, ``expand``, ...)."""
    return bool(getattr(func, "is_view", False)) or func.overloadpacket in _NO_LAUNCH


class DispatchCount(TorchDispatchMode):
    """Counts the operations dispatched inside the ``with`` block.

    Attributes:
        launches: operations that launch a kernel on the device (every operation that is not a view).
        views: operations that only make metadata (views, empty allocations).
        syncs: operations that wait for the device (``item``, ``nonzero``, boolean indexing, ...), also counted in
            ``launches``.
        by_op: launches per ``aten`` operation name.
        by_site: launches per ``module:function`` of the innermost ``ipa_probe`` frame that issued them
            (``by_site=True`` only: walking the stack costs host time), ``"model"`` for the rest.

    With ``compiled=True`` the block's ``torch.compile``'d code is counted as it runs: Dynamo traces no frame while a
    dispatch mode is active (code compiled with ``torch.compile`` runs eagerly inside a plain count, which then counts
    eager's operations), so this count lets it compile and run its artifacts; the operations they still dispatch are
    counted as above and each fused kernel they run adds one launch (``by_op["fused"]``, read from the profiler: on a
    CPU inductor's C++ kernels, profiled when they are generated inside such a block).
    """

    def __init__(self, by_site: bool = False, compiled: bool = False):
        super().__init__()
        self.launches = self.views = self.syncs = 0
        self.by_op: collections.Counter = collections.Counter()
        self.by_site: collections.Counter = collections.Counter()
        self._by_site = by_site
        self._compiled = compiled
        self._profile: contextlib.ExitStack | None = None

    def ignore_compile_internals(self) -> bool:  # Dynamo asks the modes on the stack whether it may compile
        return self._compiled

    def __enter__(self):
        if self._compiled:
            from torch._inductor import config  # the kernel profile: no public route here (see above)
            from torch.profiler import ProfilerActivity, profile

            self._profile = contextlib.ExitStack()
            self._profile.enter_context(config.patch({"cpp.enable_kernel_profile": True}))
            self._profiler = self._profile.enter_context(profile(activities=[ProfilerActivity.CPU]))
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._profile is not None:
            self._profile.close()
            fused = sum(event.count for event in self._profiler.key_averages() if "cpp_fused" in event.key)
            self.by_op["fused"] += fused
            self.launches += fused
            self._profile = None
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_view(func):
            self.views += 1
        else:
            self.launches += 1
            self.by_op[func.overloadpacket.__name__] += 1
            self.syncs += func.overloadpacket in SYNC_OPS or _boolean_index(func, args)
            if self._by_site:
                self.by_site[_site()] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return self.launches + self.views


def _boolean_index(func, args: tuple) -> bool:
    """``x[mask]`` or ``x[mask] = v``: the kernel finds the mask's true entries, whose count the host must read."""
    if func.overloadpacket not in (_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _site() -> str:
    frame = inspect.currentframe()  # its own frames (module ``dispatch``) skipped below
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("ipa_probe."):
            return f"{name.removeprefix('ipa_probe.')}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "model"
