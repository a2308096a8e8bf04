"""Timestamps of a model's last call: ``getPerfCounters`` and the latency
getters (API reference 11.4).

Each call records host timestamps (``time.perf_counter()``, seconds; the
reference point is undefined, differences are meaningful):

* ``input``: when the call starts moving its inputs to the device;
* ``input_complete``: when the inputs are on the device (one transfer per
  input tensor covers all iterations of the call, so every iteration of an
  input has the same two values);
* ``output``: when a device iteration's outputs are available (its last
  micro-batch step has returned);
* ``output_complete``: when the outputs are back on the host.

``getPerfCounters()`` returns ``{"input": [[...], ...], "input_complete":
..., "output": ..., "output_complete": ...}``: one list per input (or
output) tensor, holding one value per device iteration of the call. On a
CUDA device kernels run asynchronously: ``output`` is when the iteration's
work was queued, ``output_complete`` follows the synchronising copy to the
host; with CUDA graphs (``setBackend(..., cuda_graphs=True)``) the whole
call is one replay and every iteration's ``output`` is the call's end.

The latencies are (minimum, maximum, average) over the iterations, in
seconds: host-to-device ``input_complete`` of the last input minus ``input``
of the first; compute ``output`` minus the last ``input_complete``;
device-to-host ``output_complete`` of the last output minus ``output`` of
the first; round trip ``output_complete`` minus ``input``.
"""
import time
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import Error

Latency = Tuple[float, float, float]


class CallTimer:
    """Records the timestamps of one call."""

    def __init__(self, num_inputs: int, device_iterations: int,
                 steps_per_iteration: int) -> None:
        self._num_inputs = num_inputs
        self._iterations = device_iterations
        self._steps = steps_per_iteration
        self._start = time.perf_counter()
        self._inputs_done = self._start
        self._outputs: List[Optional[float]] = [None] * device_iterations
        self._loop_end: Optional[float] = None
        self._end = self._start
        self._num_outputs = 0

    def inputs_transferred(self) -> None:
        self._inputs_done = time.perf_counter()

    def collector(self, base) -> "TimedCollector":
        return TimedCollector(base, self)

    def step_done(self, iteration: int) -> None:
        self._outputs[iteration // self._steps] = time.perf_counter()

    def outputs_transferred(self, num_outputs: int) -> None:
        self._end = time.perf_counter()
        self._num_outputs = num_outputs

    def loop_done(self) -> None:
        self._loop_end = time.perf_counter()

    def _output_stamps(self) -> List[float]:
        """Each iteration's output time; without per-step stamps (a CUDA
        graph replay) the end of the loop, else of the call."""
        loop_end = self._end if self._loop_end is None else self._loop_end
        return [loop_end if stamp is None else stamp
                for stamp in self._outputs]

    def counters(self) -> Dict[str, List[List[float]]]:
        outputs = self._output_stamps()
        return {
            "input": [[self._start] * self._iterations
                      for _ in range(self._num_inputs)],
            "input_complete": [[self._inputs_done] * self._iterations
                               for _ in range(self._num_inputs)],
            "output": [list(outputs) for _ in range(self._num_outputs)],
            "output_complete": [[self._end] * self._iterations
                                for _ in range(self._num_outputs)],
        }

    def latencies(self) -> Dict[str, Latency]:
        outputs = self._output_stamps()
        return {
            "host_ipu": _summary([self._inputs_done - self._start]
                                 * self._iterations),
            "compute": _summary([t - self._inputs_done for t in outputs]),
            "ipu_host": _summary([self._end - t for t in outputs]),
            "round_trip": _summary([self._end - self._start]
                                   * self._iterations),
        }


def _summary(values: List[float]) -> Latency:
    return (min(values), max(values), sum(values) / len(values))


class TimedCollector:
    """Passes outputs on to ``base`` and stamps each iteration's end."""

    def __init__(self, base, timer: CallTimer) -> None:
        self._base = base
        self._timer = timer

    def wants(self, iteration: int) -> bool:
        """Every step is timed, so every step's outputs come here."""
        return True

    def add(self, iteration: int, replica: int,
            outputs: List[torch.Tensor]) -> None:
        self._base.add(iteration, replica, outputs)
        self._timer.step_done(iteration)

    def result(self) -> List[torch.Tensor]:
        self._timer.loop_done()
        return self._base.result()


def require_timer(timer: Optional[CallTimer], what: str) -> CallTimer:
    if timer is None:
        raise Error(f"{what}: the model has not run yet; call it first")
    return timer
