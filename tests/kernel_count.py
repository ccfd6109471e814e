"""Count the kernels code launches: the aten ops that do work (seen by a TorchDispatchMode)
and every Triton launch (seen at the launcher all of them go through, compiled or under
TRITON_INTERPRET). Views, bare allocations and metadata changes launch nothing and are not
counted (an op that may return a view counts when it copied); neither are the aten ops the interpreter
itself runs inside a Triton launch (its copies in and out).

`region` names what the kernels are counted for (a model's layer, "step"), so one run can
say how many each part of a decode step takes.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Allocations and changes of a tensor's metadata alone.
_NO_KERNEL = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
              torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
              torch.ops.aten.new_empty_strided.default, torch.ops.aten.lift_fresh.default,
              torch.ops.aten.detach_.default}


def _aliases(out: Any, args: tuple) -> bool:
    """Whether an op that may return a view (`to`, `reshape`...) did: else it copied."""
    first = out[0] if isinstance(out, (tuple, list)) else out
    source = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
    return (not isinstance(first, torch.Tensor) or source is None
            or first.untyped_storage().data_ptr() == source.untyped_storage().data_ptr())


class KernelCounter(TorchDispatchMode):
    """Use as `with KernelCounter() as counter:`; `counter.kernels` is (region, kernel name)
    per launch, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[tuple[str, str]] = []
        self.region = "step"
        self._in_triton = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self._in_triton and func not in _NO_KERNEL and not (
                func.is_view and _aliases(out, args)):
            self.kernels.append((self.region, str(func.overloadpacket).removeprefix("aten.")))
        return out

    def by_region(self) -> Counter[str]:
        return Counter(region for region, _ in self.kernels)

    def names(self, region: str) -> list[str]:
        return [name for kernel_region, name in self.kernels if kernel_region == region]

    @contextlib.contextmanager
    def in_region(self, region: str) -> Iterator[None]:
        outer, self.region = self.region, region
        try:
            yield
        finally:
            self.region = outer

    def __enter__(self) -> "KernelCounter":
        self._launchers = contextlib.ExitStack()
        self._launchers.enter_context(_counted_triton_launches(self))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._launchers.close()


@contextlib.contextmanager
def _counted_triton_launches(counter: KernelCounter) -> Iterator[None]:
    """Wrap `run` (what `kernel[grid](...)` calls) of triton's JIT and interpreter kernels."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def counted(original: Any) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            counter.kernels.append((counter.region, self.fn.__name__))
            counter._in_triton += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                counter._in_triton -= 1
        return run

    for cls, original in originals.items():
        cls.run = counted(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


def count_by_layer(model: torch.nn.Module, counter: KernelCounter) -> contextlib.ExitStack:
    """Count what each of `model.layers` launches in its own region, "layer 0", "layer 1"...;
    close the returned stack to stop."""
    stack = contextlib.ExitStack()
    for index, layer in enumerate(model.layers):
        regions: list[contextlib.AbstractContextManager] = []

        def enter(module: Any, args: Any, index: int = index,
                  regions: list = regions) -> None:
            regions.append(counter.in_region(f"layer {index}"))
            regions[-1].__enter__()

        def leave(module: Any, args: Any, output: Any, regions: list = regions) -> None:
            regions.pop().__exit__(None, None, None)

        stack.callback(layer.register_forward_pre_hook(enter).remove)
        stack.callback(layer.register_forward_hook(leave).remove)
    return stack
