"""The random number generator of a compiled model.

Each model keeps its own generator state for its device: random operations in
the captured graph (dropout, ``torch.rand``...) draw from it, never from the
host program's generator, and ``Options.randomSeed(N)`` makes them
reproducible. Without a seed the state is derived from the host generator's
state when the model is compiled, so ``torch.manual_seed`` still makes a
program reproducible; the host generator does not advance, so what the
program draws after (a DataLoader's shuffle, its own noise) is what it
draws without poptorch. Two models compiled with nothing drawn on the host
between them therefore start from the same state.
"""
import contextlib
from typing import Iterator, List, Optional

import torch

from ..errors import Error


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _seed_from_host() -> int:
    """A seed drawn from a copy of the host generator."""
    copy = torch.Generator()
    copy.set_state(torch.get_rng_state())
    return int(torch.randint(0, 2**62, (), generator=copy).item())


class ModelRng:
    """Generator state of one model on one device."""

    def __init__(self, device: torch.device, seed: Optional[int]) -> None:
        self.device = device
        if seed is None:
            seed = _seed_from_host()
        self.seed = seed
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.state = generator.get_state()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this model's state current for the duration of a call."""
        saved = _get_state(self.device)
        _set_state(self.device, self.state)
        try:
            yield
        finally:
            self.state = _get_state(self.device)
            _set_state(self.device, saved)

    def as_list(self) -> List[int]:
        return [self.seed] + self.state.tolist()

    def load_list(self, values: List[int]) -> None:
        """Take the seed and state of ``as_list``; ``poptorch.Error``,
        before anything changes, for anything else."""
        expected = 1 + self.state.numel()
        if not isinstance(values, (list, tuple)) or len(values) != expected \
                or not all(isinstance(v, int) and not isinstance(v, bool)
                           for v in values) \
                or not all(0 <= v < 256 for v in values[1:]):
            raise Error(
                f"rng_state must be a list of {expected} integers, as "
                "model.rng_state returns it (the seed, then the generator's "
                f"state bytes, 0 to 255); got {_described(values)}")
        self.seed = values[0]
        self.state = torch.tensor(values[1:], dtype=torch.uint8)


def _described(values) -> str:
    if isinstance(values, (list, tuple)):
        return f"a {type(values).__name__} of {len(values)} items"
    return f"{type(values).__name__} {values!r:.40}"
