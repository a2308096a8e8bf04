"""Grouped weights: ``parameter.replicaGrouping(comm_group_type, shards,
variable_retrieval_mode)`` (API reference, ``replicaGrouping``).

Called on a weight of a wrapped model before it is compiled, it gives each
group of replicas its own value of that weight. With R replicas and groups
of ``shards`` replicas (``CommGroupType``):

* ``Consecutive``: replica r is in group r // shards;
* ``Orthogonal``: replica r is in group r % (R / shards);
* ``NoGrouping``: every replica is its own group (``shards`` is ignored);
* ``All``: one group of all replicas, which is the same as not grouping.

The host parameter holds the values along a new leading dimension, and
``forward`` sees one value (the shape without that dimension):

* ``VariableRetrievalMode.OnePerGroup``: dimension 0 has one row per group;
* ``VariableRetrievalMode.AllReplicas``: dimension 0 has one row per
  replica, and the rows of the replicas of one group must be equal.

Setting the host tensor and calling ``copyWeightsToDevice()`` (or the first
call) sets every group's value. In training the gradient of a group's value
is reduced over the replicas of the group only: with
``ReductionType.Mean`` it is the mean over the group's replicas and the
accumulated micro-batches, as if each group trained its own copy of the
weight on its replicas' data; ``ReductionType.Sum`` adds them.
"""
import dataclasses
import weakref
from typing import Dict, List, Optional

import torch

from ...enums import CommGroupType, ReductionType, VariableRetrievalMode
from ...errors import Error
from ..optimizers.lamb import LAMBRule

_ATTRIBUTE = "_poptorch_replica_grouping"

# id(parameter) -> how many compiled models captured it (its grouping is
# then fixed); an entry goes when its parameter is garbage collected.
_compiled_parameters: Dict[int, int] = {}


@dataclasses.dataclass(frozen=True)
class ReplicaGrouping:
    """The grouping of one weight, as set by ``replicaGrouping``."""
    comm_group_type: CommGroupType
    shards: int
    retrieval: VariableRetrievalMode

    @property
    def group_size(self) -> int:
        if self.comm_group_type == CommGroupType.NoGrouping:
            return 1
        return self.shards

    def group_count(self, replicas: int) -> int:
        return replicas // self.group_size

    def host_rows(self, replicas: int) -> int:
        """Size of the host parameter's leading dimension."""
        if self.retrieval == VariableRetrievalMode.AllReplicas:
            return replicas
        return self.group_count(replicas)

    def describe(self) -> str:
        return (f"replicaGrouping({_name(self.comm_group_type)}, "
                f"{self.shards}, {_name(self.retrieval)})")

    def check(self, name: str, replicas: int, shape: torch.Size) -> None:
        """Raise ``poptorch.Error`` unless the grouping fits ``replicas``
        and the host parameter's ``shape``."""
        if replicas % self.group_size:
            raise Error(
                f"{self.describe()} on '{name}': shards ({self.shards}) must "
                f"divide replicationFactor ({replicas}); allowed values are "
                f"{_divisors(replicas)}")
        rows = self.host_rows(replicas)
        if len(shape) == 0 or shape[0] != rows:
            what = ("one row per replica" if self.retrieval ==
                    VariableRetrievalMode.AllReplicas else "one row per group")
            raise Error(
                f"'{name}' has shape {tuple(shape)}, but with "
                f"{self.describe()} and replicationFactor {replicas} its "
                f"dimension 0 must hold {what} ({rows})")

    def check_rows(self, name: str, tensor: torch.Tensor,
                   replicas: int) -> None:
        """With ``AllReplicas``, the rows of one group must be equal."""
        if self.retrieval != VariableRetrievalMode.AllReplicas:
            return
        rows = self.to_replicas(self.to_groups(tensor, replicas), replicas)
        if not torch.equal(rows, tensor):
            raise Error(
                f"'{name}' uses {self.describe()}: the rows of the replicas "
                "of one group must hold the same value (each group has one "
                "value of the weight)")

    # --- rows <-> replicas, as differentiable tensor operations ----------
    def _replica_grid(self, replicas: int):
        """Replica r sits at (r // columns, r % columns) of a grid whose
        ``inner`` dimension runs within a group: ((count, size), 1) for
        Consecutive groups, ((size, count), 0) for Orthogonal ones."""
        size, count = self.group_size, self.group_count(replicas)
        if self.comm_group_type == CommGroupType.Orthogonal:
            return (size, count), 0
        return (count, size), 1

    def to_replicas(self, groups: torch.Tensor, replicas: int) -> torch.Tensor:
        """One row per group -> one row per replica."""
        if self.group_size == 1:
            return groups
        grid, inner = self._replica_grid(replicas)
        expanded = groups.unsqueeze(inner).expand(*grid, *groups.shape[1:])
        return expanded.reshape(replicas, *groups.shape[1:])

    def to_groups(self, tensor: torch.Tensor, replicas: int,
                  reduce: bool = False) -> torch.Tensor:
        """One row per replica -> one row per group: the group's sum when
        ``reduce``, else the value of the group's first replica."""
        if self.group_size == 1:
            return tensor
        grid, inner = self._replica_grid(replicas)
        view = tensor.unflatten(0, grid)
        return view.sum(inner) if reduce else view.select(inner, 0)


class _ReplicaValues(torch.autograd.Function):
    """Device rows of a grouped weight -> one value per replica. The
    backward pass reduces the replicas' gradients within each group (and
    scales them by ``scale``)."""

    @staticmethod
    def forward(ctx, rows, grouping: ReplicaGrouping, replicas: int,
                scale: float):
        ctx.grouping, ctx.replicas, ctx.scale = grouping, replicas, scale
        if grouping.retrieval == VariableRetrievalMode.AllReplicas:
            return rows.clone()
        return grouping.to_replicas(rows, replicas).clone()

    @staticmethod
    def backward(ctx, grad):
        grouping, replicas = ctx.grouping, ctx.replicas
        reduced = grouping.to_groups(grad, replicas, reduce=True)
        if grouping.retrieval == VariableRetrievalMode.AllReplicas:
            reduced = grouping.to_replicas(reduced, replicas)
        if ctx.scale != 1.0:
            reduced = reduced * ctx.scale
        return reduced, None, None, None


@dataclasses.dataclass(frozen=True)
class GroupedWeights:
    """The grouped weights of one compiled model, by parameter index."""
    replicas: int
    groupings: Dict[int, ReplicaGrouping]
    names: Dict[int, str]

    def __bool__(self) -> bool:
        return bool(self.groupings)

    def replica_params(self, params: List[torch.Tensor]
                       ) -> List[torch.Tensor]:
        """One replica's view of ``params``: grouped weights without their
        leading dimension (the first row), the shape ``forward`` sees."""
        return [tensor[0] if index in self.groupings else tensor
                for index, tensor in enumerate(params)]

    def per_replica(self, index: int, tensor: torch.Tensor,
                    reduction: Optional[ReductionType]) -> torch.Tensor:
        """The [R, ...] values the replicas use; gradients flow back to the
        device rows reduced within groups. With ``ReductionType.Mean`` they
        are scaled by the number of groups, so that the step's division by
        G x R becomes a division by G x (replicas of the group)."""
        grouping = self.groupings[index]
        scale = (float(grouping.group_count(self.replicas))
                 if reduction == ReductionType.Mean else 1.0)
        return _ReplicaValues.apply(tensor, grouping, self.replicas, scale)

    def check_update(self, training, settings) -> None:
        """Raise ``poptorch.Error`` for updates that combine a grouped
        weight's values across groups: gradient clipping by the global norm
        and LAMB's per-tensor norms are computed per replica on an IPU."""
        clipping = (settings.attributes.max_grad_norm is not None or
                    "max_grad_norm" in settings.attributes.variable)
        if clipping:
            raise Error("replicaGrouping: gradient clipping (max_grad_norm) "
                        "is not supported with grouped weights: each "
                        "replica would clip with its own norm")
        for group in training.groups:
            grouped = [self.names[training.trainable[p]]
                       for p in group.positions
                       if training.trainable[p] in self.groupings]
            if grouped and isinstance(group.rule, LAMBRule):
                raise Error(
                    "replicaGrouping: LAMB is not supported with grouped "
                    f"weights ({', '.join(grouped)}): its per-weight norms "
                    "would mix the groups' values")

    def check_rows(self, params: List[torch.Tensor]) -> None:
        for index, grouping in self.groupings.items():
            grouping.check_rows(self.names[index], params[index],
                                self.replicas)


def collect(module: torch.nn.Module, param_names: List[str],
            replicas: int) -> GroupedWeights:
    """The groupings set on ``module``'s parameters, checked against
    ``replicas``; raises ``poptorch.Error`` for a grouping that does not
    fit. ``CommGroupType.All`` has no effect."""
    params = dict(module.named_parameters())
    groupings, names = {}, {}
    for index, name in enumerate(param_names):
        grouping = getattr(params[name], _ATTRIBUTE, None)
        if grouping is None or grouping.comm_group_type == CommGroupType.All:
            continue
        grouping.check(name, replicas, params[name].shape)
        groupings[index], names[index] = grouping, name
    return GroupedWeights(replicas, groupings, names)


def mark_compiled(module: torch.nn.Module, compiled: bool) -> None:
    """Record that a model wrapping ``module`` was compiled (or released):
    the grouping of a parameter of a compiled model can no longer change."""
    for parameter in module.parameters():
        key = id(parameter)
        count = _compiled_parameters.get(key, 0) + (1 if compiled else -1)
        if count <= 0:
            _compiled_parameters.pop(key, None)
            continue
        if key not in _compiled_parameters:
            weakref.finalize(parameter, _compiled_parameters.pop, key, None)
        _compiled_parameters[key] = count


def _name(member) -> str:
    return f"{type(member).__name__}.{member.name}"


def _divisors(number: int) -> List[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def replicaGrouping(self: torch.Tensor, comm_group_type: CommGroupType,
                    shards: int,
                    variable_retrieval_mode: VariableRetrievalMode) -> None:
    """Give each group of replicas its own value of this weight.

    Call it on a weight of a wrapped model before the model is compiled.
    ``comm_group_type`` arranges the replicas into groups of ``shards``
    replicas; ``variable_retrieval_mode`` says whether the host tensor holds
    one value per group (``OnePerGroup``) or per replica (``AllReplicas``)
    along its dimension 0.
    """
    if not isinstance(comm_group_type, CommGroupType):
        raise Error("replicaGrouping comm_group_type must be a "
                    f"poptorch.CommGroupType, got {comm_group_type!r}")
    if not isinstance(variable_retrieval_mode, VariableRetrievalMode):
        raise Error("replicaGrouping variable_retrieval_mode must be a "
                    "poptorch.VariableRetrievalMode, got "
                    f"{variable_retrieval_mode!r}")
    needs_shards = comm_group_type in (CommGroupType.Consecutive,
                                       CommGroupType.Orthogonal)
    minimum = 1 if needs_shards else 0
    if not isinstance(shards, int) or isinstance(shards, bool) \
            or shards < minimum:
        raise Error(f"replicaGrouping shards must be an int >= {minimum} "
                    f"with {_name(comm_group_type)}, got {shards!r}")
    if id(self) in _compiled_parameters:
        raise Error("replicaGrouping: this weight belongs to a model that is "
                    "already compiled; call replicaGrouping after wrapping "
                    "and before the first call (or destroy() the model "
                    "first)")
    setattr(self, _ATTRIBUTE,
            ReplicaGrouping(comm_group_type, shards, variable_retrieval_mode))


torch.nn.Parameter.replicaGrouping = replicaGrouping
