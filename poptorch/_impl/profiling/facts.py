"""Facts about a captured step (a ``torch.fx.GraphModule`` traced by
``make_fx`` in fake mode) for the profiling report.

* ``operators``: how many nodes call each operator (``"aten.addmm.default"``),
  placeholders, outputs and ``getitem`` left out.
* ``flops``: the floating-point operations of one run of the graph, as
  ``torch.utils.flop_counter.FlopCounterMode`` counts them (matrix products,
  convolutions, attention; elementwise operations count 0), the graph run
  on its placeholders' fake values in their own fake mode, so no real data
  is read or written. None when counting fails (the reason is logged once
  at DEBUG).
* ``saved_activation_bytes``: the activations a training step keeps from
  its forward pass for its backward pass. Forward nodes are the nodes
  before the first backward node (``node.meta["custom"]["poptorch_pass"]
  == "backward"``), placeholders left out. Every forward tensor read by a
  backward node counts once by the storage it lives in: a view (``t``,
  ``view``, ...) counts as the tensor it views, and a view of an input
  (a parameter's transpose) counts nothing, as inputs are not activations.
  0 for a step without a backward pass (inference).
"""
import dataclasses
import operator
from typing import Any, Dict, Iterable, List, Optional, Set

import torch
from torch._guards import detect_fake_mode
from torch.utils.flop_counter import FlopCounterMode

from ..logger import logger

#: ``node.meta["custom"][PASS_KEY] == BACKWARD`` marks the operations of
#: the backward pass in a captured training step (``training_step.py``
#: labels them).
PASS_KEY = "poptorch_pass"
BACKWARD = "backward"
_logged_reasons: Set[str] = set()


@dataclasses.dataclass
class StepFacts:
    """What the report says about one captured step."""
    operators: Dict[str, int]
    flops: Optional[int]
    saved_activation_bytes: int


def step_facts(graph: torch.fx.GraphModule) -> StepFacts:
    """The operator counts, FLOPs and saved activations of ``graph``."""
    return StepFacts(operators=operator_counts(graph),
                     flops=count_flops(graph),
                     saved_activation_bytes=saved_activation_bytes(graph))


def operator_counts(graph: torch.fx.GraphModule) -> Dict[str, int]:
    """Nodes per operator name, most frequent first."""
    counts: Dict[str, int] = {}
    for node in graph.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") \
                and node.target is not operator.getitem:
            name = _operator_name(node)
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def count_flops(graph: torch.fx.GraphModule) -> Optional[int]:
    """FLOPs of one run of ``graph`` on fake values; None when unknown."""
    values = [node.meta.get("val") for node in _placeholders(graph)]
    fake_mode = detect_fake_mode(values)
    if fake_mode is None:
        _log_once("no fake values on the graph's inputs")
        return None
    try:
        with fake_mode:
            inputs = [_fresh(value) for value in values]
            with FlopCounterMode(display=False) as counter:
                graph(*inputs)
    except Exception as error:  # pylint: disable=broad-except
        _log_once(f"{type(error).__name__}: {error}")
        return None
    return int(counter.get_total_flops())


def saved_activation_bytes(graph: torch.fx.GraphModule) -> int:
    """Bytes of the forward tensors that the backward pass reads."""
    forward = _forward_nodes(graph)
    saved: Dict[torch.fx.Node, int] = {}
    for node in forward:
        if any(is_backward(user) for user in node.users):
            for storage in _storages(node, forward):
                saved[storage] = _tensor_bytes(storage.meta.get("val"))
    return sum(saved.values())


def _operator_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__qualname__", None) or str(target)


def _placeholders(graph: torch.fx.GraphModule) -> List[torch.fx.Node]:
    return [node for node in graph.graph.nodes if node.op == "placeholder"]


def _fresh(value: Any) -> Any:
    """A new fake tensor like ``value`` (in-place operations of the graph
    must not touch the graph's own metadata values); others as they are."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(),
                                   dtype=value.dtype, device=value.device)
    return value


def is_backward(node: torch.fx.Node) -> bool:
    """Whether a captured training step's ``node`` belongs to its backward
    pass (``PASS_KEY``)."""
    return (node.meta.get("custom") or {}).get(PASS_KEY) == BACKWARD


def _forward_nodes(graph: torch.fx.GraphModule) -> Set[torch.fx.Node]:
    """Non-placeholder nodes before the first backward node; none when the
    graph has no backward node."""
    forward: Set[torch.fx.Node] = set()
    for node in graph.graph.nodes:
        if is_backward(node):
            return forward
        if node.op != "placeholder":
            forward.add(node)
    return set()


def _storages(node: torch.fx.Node, forward: Set[torch.fx.Node]
              ) -> Iterable[torch.fx.Node]:
    """The forward nodes whose outputs hold ``node``'s tensors: ``node``
    itself, the base of a view, the items of a tuple; none for a view of
    an input."""
    while _is_view(node):
        node = node.args[0]
    if node not in forward:
        return []
    value = node.meta.get("val")
    if isinstance(value, (list, tuple)):
        return [user for user in node.users
                if user.target is operator.getitem]
    return [node]


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) and target.is_view
            and bool(node.args) and isinstance(node.args[0], torch.fx.Node))


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


def _log_once(reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.debug("Profiling: the FLOPs of a step are unknown (%s)",
                     reason)
