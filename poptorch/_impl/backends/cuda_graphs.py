"""A whole call's device loop replayed as one CUDA graph
(``Options.setBackend(..., cuda_graphs=True)`` on a CUDA device).

A call of D device iterations launches D x G x R steps, each of many small
kernels; on a GPU the launches, not the arithmetic, often bound small
models. The first call of a given layout records the loop once as a CUDA
graph; each later call copies its inputs into the graph's input buffers and
replays it: one launch for the whole call.

The model's state (parameters, buffers, optimizer state, hyper-parameters)
lives in static tensors that the graph reads and overwrites with the new
values at its end. Tensors that the executor replaced between calls (new
weights from ``copyWeightsToDevice``, new hyper-parameters from
``setOptimizer``) are copied into the static tensors before the replay.
Recording runs the loop once on copies of the state (warm-up, results
dropped, random generator state restored) and once under capture; neither
changes the model's state or its random numbers.

Only CUDA devices get here (``cuda_graph_reason`` says why a model does not
use it); the plain loop runs everywhere else.
"""
from typing import Callable, List, Optional

import torch

StateReader = Callable[[], List[torch.Tensor]]
StateWriter = Callable[[List[torch.Tensor]], None]
LoopBody = Callable[[List[torch.Tensor]], List[torch.Tensor]]


def cuda_graph_reason(device: torch.device, requested: bool,
                      writes_inputs: bool, anchors: bool,
                      state_off_device: bool,
                      all_reduces: bool,
                      finite_checks: bool = False) -> Optional[str]:
    """Why calls cannot replay as a CUDA graph, or None when they can."""
    if not requested:
        return "not requested (setBackend(..., cuda_graphs=True))"
    if device.type != "cuda":
        return f"the model runs on {device.type}, not on a CUDA device"
    if all_reduces:
        return ("each step all-reduces the gradients with the other "
                "processes, waited for on the host")
    if writes_inputs:
        return "forward writes to its input tensors"
    if anchors:
        return "anchored tensors are read back after each call"
    if state_off_device:
        return "the optimizer state is kept off the device"
    if finite_checks:
        return ("floating-point exceptions are enabled: the device loop "
                "keeps each step's flags")
    return None


class CudaGraphCall:
    """Records ``body`` as a CUDA graph on its first use and replays it.

    ``body(inputs)`` runs one call's loop on the state that ``read_state``
    returns and leaves the new state for ``read_state`` to return; it
    returns the call's output tensors. ``write_state`` makes the executor
    hold the given tensors as its state.
    """

    def __init__(self, body: LoopBody, read_state: StateReader,
                 write_state: StateWriter) -> None:
        self._body = body
        self._read_state = read_state
        self._write_state = write_state
        self._graph: Optional["torch.cuda.CUDAGraph"] = None
        self._static_state: List[torch.Tensor] = []
        self._static_inputs: List[torch.Tensor] = []
        self._static_outputs: List[torch.Tensor] = []

    def __call__(self, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
        with torch.cuda.device(_device(self._read_state(), inputs)):
            if self._graph is None:
                self._record(inputs)
            self._load_state()
            for static, given in zip(self._static_inputs, inputs):
                static.copy_(given, non_blocking=True)
            self._graph.replay()
            self._write_state(list(self._static_state))
            return [t.clone() for t in self._static_outputs]

    def _load_state(self) -> None:
        current = self._read_state()
        for static, value in zip(self._static_state, current):
            if value is not static:
                static.copy_(value)

    def _record(self, inputs: List[torch.Tensor]) -> None:
        state = self._read_state()
        self._static_state = [t.clone() for t in state]
        self._static_inputs = [t.clone() for t in inputs]
        self._warm_up(inputs)
        graph = torch.cuda.CUDAGraph()
        self._write_state(list(self._static_state))
        rng = torch.cuda.get_rng_state()
        # Thread-local: another thread's CUDA calls during the capture (a
        # DataLoader's pinning thread) must not invalidate it.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = self._body(self._static_inputs)
            new_state = self._read_state()
            for static, value in zip(self._static_state, new_state):
                if value is not static:
                    static.copy_(value)
        torch.cuda.set_rng_state(rng)
        self._static_outputs = list(outputs)
        self._write_state(list(self._static_state))
        self._graph = graph

    def _warm_up(self, inputs: List[torch.Tensor]) -> None:
        """Run the loop once on copies, on a side stream, so that lazy
        initialisation (cuBLAS handles, workspaces) happens outside the
        capture."""
        rng = torch.cuda.get_rng_state()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._write_state([t.clone() for t in self._static_state])
            self._body([t.clone() for t in inputs])
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.set_rng_state(rng)


def _device(state: List[torch.Tensor],
            inputs: List[torch.Tensor]) -> torch.device:
    """The CUDA device of the model: recording, the random generator state
    and replay all act on it, whatever the current device is."""
    return next(t.device for t in state + inputs if t.is_cuda)
