"""A failed call never leaves a half-trained model.

The rule: a call of a wrapped model either completes, or it is rolled back
whole. When anything stops a call's device loop (an exception raised by a
step, such as a kernel's bounds check, out of memory or a custom op; a
floating-point exception, ``floating_point_checks.py``; Ctrl-C), the model's
device state is put back as it was before the call: weights, buffers (every
replica's), optimizer state (including the loss scale and step counters of
automatic loss scaling) and the random generator's state. The host copy,
``optimizer.state_dict()`` and the next call all see that state. An
exception reaches the caller as its own type, with a note naming where in
the loop it was raised (``explain``).

How the pre-call state survives the call (``CallSnapshot``): the device loop
replaces state tensors by new ones, so keeping the old list entries is
enough, except for tensors that a step overwrites in place: the parameters
and optimizer state that the graph backend's update step reuses
(``backends/in_place.py``), and every state tensor of a call replayed as a
CUDA graph. Those are copied before the call: the memory of one more copy
of them, and one copy per call.

Ctrl-C (``interrupts_between_steps``): during a call, SIGINT is held until
the loop reaches its next step, which raises ``KeyboardInterrupt`` (and the
call is rolled back); an interrupt after the last step lets the call
complete and is raised when it returns. Inputs that ``forward`` writes in
place may keep the writes of the steps before the failure.
"""
import contextlib
import signal
import threading
from typing import Iterator, List, Optional, Sequence, Tuple

from .device_state import DeviceState
from .exception_notes import add_note
from .rng import ModelRng


class CallProgress:
    """Where a call's device loop is: the position of the step running
    (device iteration, micro-batch, replica), and whether an interrupt
    waits for the next step."""

    def __init__(self, interrupted: List[bool]) -> None:
        self._interrupted = interrupted
        self.position: Optional[Tuple[int, int, int]] = None
        self.interrupted = False

    def step(self, iteration: int, micro_batch: int, replica: int) -> None:
        """A step begins at this position, unless Ctrl-C was pressed since
        the last step: then raise ``KeyboardInterrupt`` instead."""
        self.position = (iteration, micro_batch, replica)
        if self._interrupted[0]:
            self.interrupted = True
            raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_between_steps() -> Iterator[CallProgress]:
    """Hold SIGINT for the duration of a call (see the module docstring).
    Only the main thread receives signals, and a handler the program
    installed itself stays in charge."""
    interrupted = [False]
    if (threading.current_thread() is not threading.main_thread() or
            signal.getsignal(signal.SIGINT) is not
            signal.default_int_handler):
        yield CallProgress(interrupted)
        return

    def hold(signum, frame) -> None:
        interrupted[0] = True

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield CallProgress(interrupted)
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted[0]:
        raise KeyboardInterrupt


class CallSnapshot:
    """The device state a call starts from, to restore if it fails."""

    def __init__(self, state: DeviceState, rng: ModelRng,
                 overwritten_params: Sequence[int],
                 optimizer_overwritten: bool) -> None:
        overwritten = set(overwritten_params)
        self._params = [t.clone() if index in overwritten else t
                        for index, t in enumerate(state.params)]
        self._buffers = [list(buffers) for buffers in state.buffers]
        self._optimizer = ([t.clone() for t in state.optimizer]
                           if optimizer_overwritten
                           else list(state.optimizer))
        self._rng_state = rng.state

    @staticmethod
    def of_everything(state: DeviceState, rng: ModelRng) -> "CallSnapshot":
        """A snapshot copying every state tensor (calls replayed as CUDA
        graphs overwrite them all)."""
        snapshot = CallSnapshot(state, rng, range(len(state.params)), True)
        snapshot._buffers = [[t.clone() for t in buffers]
                             for buffers in state.buffers]
        return snapshot

    def restore(self, state: DeviceState, rng: ModelRng) -> None:
        state.params[:] = self._params
        for buffers, saved in zip(state.buffers, self._buffers):
            buffers[:] = saved
        state.optimizer = list(self._optimizer)
        rng.state = self._rng_state


def explain(error: BaseException, progress: CallProgress, layout,
            staged: bool, replica_known: bool) -> None:
    """Add a note to ``error`` saying where in the call it was raised and
    that the call was rolled back. ``staged``: a multi-stage model, whose
    steps are optimizer steps (all their micro-batches through the
    stages); ``replica_known``: each step runs one replica (not all of them
    as one computation)."""
    where = "before the call's first step"
    if progress.position is not None:
        iteration, micro_batch, replica = progress.position
        where = ("before the step of" if progress.interrupted else "in")
        where += f" device iteration {iteration} of {layout.device_iterations}"
        if staged:
            where += " (an optimizer step through the model's stages)"
        elif layout.gradient_accumulation > 1:
            where += (f", micro-batch {micro_batch} of "
                      f"{layout.gradient_accumulation}")
        if layout.replicas > 1 and replica_known:
            where += f", replica {replica} of {layout.replicas}"
    add_note(error, f"poptorch: raised {where} of the model's call; the "
                    "call was rolled back: the model's weights, buffers, "
                    "optimizer state and random generator state are as "
                    "they were before the call.")
