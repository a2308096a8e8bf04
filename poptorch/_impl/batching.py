"""How one call's combined batch is cut into micro-batches (docs/semantics.md).

Dimension 0 of every tensor argument holds D x G x R' micro-batches laid out
as [D, G, R', S] (D = device iterations, G = gradient accumulation, R' =
replicas that receive different data, S = micro-batch size); a 0-d tensor is
passed whole to every step. Cutting is done with views, never copies.
"""
import dataclasses
from typing import List, Tuple

import torch

from ..enums import CommGroupType
from ..errors import Error


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    device_iterations: int
    gradient_accumulation: int
    replicas: int
    input_group_size: int = 1
    input_group_type: CommGroupType = CommGroupType.Consecutive

    @staticmethod
    def from_options(options, training: bool = True) -> "BatchLayout":
        """The layout of ``options`` (a ``poptorch.Options``): a model's
        calls, or a DataLoader's combined batches (``training``: with the
        options' gradient accumulation; an inference model has none)."""
        return BatchLayout(
            device_iterations=options.device_iterations,
            gradient_accumulation=(options.Training.gradient_accumulation
                                   if training else 1),
            replicas=options.replication_factor,
            input_group_size=options.input_group_size,
            input_group_type=options.input_group_type)

    @property
    def data_replicas(self) -> int:
        """Number of distinct slices of data per micro-batch step."""
        return self.replicas // self.input_group_size

    @property
    def micro_batches(self) -> int:
        return (self.device_iterations * self.gradient_accumulation *
                self.data_replicas)

    def data_index(self, replica: int) -> int:
        """Which data slice replica ``replica`` reads."""
        if self.input_group_type == CommGroupType.Orthogonal:
            return replica % self.data_replicas
        return replica // self.input_group_size

    def check(self, name: str, tensor: torch.Tensor) -> None:
        """Raise ``poptorch.Error`` unless ``tensor`` can be cut per call."""
        if tensor.numel() == 0:
            raise Error(f"Argument '{name}' has shape {tuple(tensor.shape)}: "
                        "zero-sized tensors cannot be passed to a poptorch "
                        "model")
        if tensor.dim() == 0:
            return
        rows = tensor.shape[0]
        if rows % self.micro_batches:
            factors = self._factors()
            raise Error(
                f"Argument '{name}' has {rows} rows in dimension 0, which is "
                f"not a multiple of "
                f"{' x '.join(option for option, _ in factors)} = "
                f"{self.micro_batches}. Dimension 0 of each input holds one "
                f"micro-batch per {', '.join(unit for _, unit in factors)}.")

    def _factors(self) -> List[Tuple[str, str]]:
        """(option and value, what it counts) for each factor of the rows
        per call; gradient accumulation only where it multiplies them."""
        replicas = f"replicationFactor ({self.replicas})"
        if self.input_group_size != 1:
            replicas += (f" / inputReplicaGrouping size "
                         f"({self.input_group_size})")
        factors = [(f"deviceIterations ({self.device_iterations})",
                    "device iteration")]
        if self.gradient_accumulation != 1:
            factors.append((f"Training.gradientAccumulation "
                            f"({self.gradient_accumulation})",
                            "gradient accumulation step"))
        factors.append((replicas, "replica"))
        return factors

    def split(self, tensor: torch.Tensor) -> torch.Tensor:
        """A [D, G, R', S, ...] view of ``tensor`` (0-d tensors unchanged)."""
        if tensor.dim() == 0:
            return tensor
        return tensor.unflatten(0, (self.device_iterations,
                                    self.gradient_accumulation,
                                    self.data_replicas, -1))


def micro_batch(split_inputs: List[torch.Tensor], iteration: int, step: int,
                data_index: int) -> List[torch.Tensor]:
    """The inputs of one micro-batch, as views of the split inputs."""
    return [t if t.dim() == 0 else t[iteration, step, data_index]
            for t in split_inputs]
