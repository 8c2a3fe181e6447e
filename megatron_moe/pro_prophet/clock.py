"""The measured time of the MoE layers in one iteration: what `calibration` fits the model to.

`LayerClock(layers, device)` times each MoE layer's forward (module forward pre-hook and hook) and
backward (from a gradient hook on the layer's output, when backward reaches the layer, to one on
its input, when its backward, Pro-Prophet's Agg wait included, is over); only forwards under
autograd. On CUDA the stamps are timing events on the current stream (no host synchronization
until `take`), elsewhere `clock()` (default `time.perf_counter`). `remove` takes the hooks off.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Union

import torch

from megatron_moe.distributed import streams

Stamp = Union[float, streams.Marker]


class LayerClock:
    """Forward + backward seconds of `layers` (torch modules returning (y, ...) or y) per iteration."""

    def __init__(self, layers: list, device: torch.device, clock: Callable[[], float] = time.perf_counter):
        self.device, self.clock = device, clock
        self.cuda = device.type == "cuda"
        self.spans: list[list[Optional[Stamp]]] = []  # [fwd start, fwd end, bwd start, bwd end]
        self._open: Optional[list[Optional[Stamp]]] = None
        self.handles = []
        for layer in layers:
            self.handles.append(layer.register_forward_pre_hook(self._pre))
            self.handles.append(layer.register_forward_hook(self._post))

    def _now(self) -> Stamp:
        if self.cuda:
            return streams.record_event(streams.current_stream(self.device), timing=True)
        return self.clock()

    def _set(self, span: list, i: int) -> None:
        span[i] = self._now()

    def _pre(self, module, args) -> None:
        if not torch.is_grad_enabled():
            return
        span: list[Optional[Stamp]] = [self._now(), None, None, None]
        self.spans.append(span)
        self._open = span
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(lambda g: self._set(span, 3))  # the gradient of the input: backward over

    def _post(self, module, args, output) -> None:
        span, self._open = self._open, None
        if span is None:
            return
        span[1] = self._now()
        y = output[0] if isinstance(output, tuple) else output
        if isinstance(y, torch.Tensor) and y.requires_grad:
            y.register_hook(lambda g: self._set(span, 2))  # the gradient of the output: backward starts

    def _seconds(self, a: Stamp, b: Stamp) -> float:
        if isinstance(a, streams.Marker) and isinstance(b, streams.Marker):
            if a.cuda is None or b.cuda is None:
                return 0.0
            b.synchronize()
            return float(a.cuda.elapsed_time(b.cuda)) / 1e3
        return float(b) - float(a)  # type: ignore[arg-type]

    def take(self) -> float:
        """Seconds of every timed forward and backward since the last `take` (then forgets them);
        a backward that did not happen (or not yet) counts 0."""
        total = 0.0
        for f0, f1, b0, b1 in self.spans:
            if f0 is not None and f1 is not None:
                total += self._seconds(f0, f1)
            if b0 is not None and b1 is not None:
                total += self._seconds(b0, b1)
        self.spans = []
        return total

    def remove(self) -> None:
        """Take the module hooks off (the tensor hooks die with their tensors)."""
        for h in self.handles:
            h.remove()
        self.handles = []
