"""Start-up checks: every process must compile the same model with the
same options.

Each process writes a description of what it compiles (``opts.toDict()``
without ``Distributed.processId``, the parameters' and buffers' names,
shapes and dtypes, the micro-batch's shapes and dtypes, a training
model's optimizer settings) to the rendezvous
store, waits for all the others' and compares. Every process computes the
same comparison, so a mismatch raises the same ``poptorch.Error`` on every
process, naming each difference and the processes' values.
"""
import json
from typing import Any, Dict, List

import torch

from ...errors import Error
from .process_group import ProcessGroup

_MAX_LISTED = 10


def describe(options, names: Dict[str, List[str]],
             tensors: Dict[str, List[torch.Tensor]],
             optimizer=None) -> Dict[str, Any]:
    """The description of one compiled model: the options, per kind
    ("parameter", "buffer", "input"), name -> [shape, dtype], and the
    optimizer's plan (``optimizers/plan.py``), if any: each group's rule,
    constants, parameters and hyper-parameter values, loss scaling and
    clipping (processes updating with different ones would drift apart
    silently)."""
    settings = options.toDict()
    settings["Distributed"] = {
        key: value for key, value in settings["Distributed"].items()
        if key != "processId"}
    model = {}
    for kind, values in tensors.items():
        for name, tensor in zip(names[kind], values):
            model[f"{kind} {name}"] = [list(tensor.shape), str(tensor.dtype)]
    description = {"options": settings, "model": model}
    if optimizer is not None:
        description["optimizer"] = _optimizer_description(optimizer)
    return description


def _optimizer_description(plan) -> Dict[str, Any]:
    groups = {f"group {index}": {"rule": type(group.rule).__name__,
                                 "constants": repr(group.rule.constants),
                                 "parameters": list(group.indices),
                                 **group.hyper}
              for index, group in enumerate(plan.groups)}
    return {**groups, "loss_scaling": plan.loss_scaling,
            "max_grad_norm": plan.max_grad_norm,
            "accumulation dtype": repr(plan.accum_dtype)}


def _flatten(value: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(value, dict):
        flat = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}" if prefix else key))
        return flat
    return {prefix: value}


def differences(descriptions: List[Dict[str, Any]]) -> List[str]:
    """What differs between the processes' descriptions (index = process),
    one line per differing entry."""
    flat = [_flatten(d) for d in descriptions]
    keys = sorted(set().union(*flat))
    lines = []
    for key in keys:
        values = [f.get(key, "(absent)") for f in flat]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"{json.dumps(v)} on process {rank}"
                              for rank, v in enumerate(values))
            lines.append(f"{key}: {shown}")
    return lines


def check_same_everywhere(group: ProcessGroup, key: str,
                          description: Dict[str, Any]) -> None:
    """Exchange ``description`` through the store and raise
    ``poptorch.Error`` on every process if they differ."""
    store = group.store
    store.set(f"check/{key}/{group.rank}", json.dumps(description,
                                                      sort_keys=True))
    names = [f"check/{key}/{rank}" for rank in range(group.size)]
    sequence = group.monitor.start()
    group.monitor.wait_until(lambda: store.check(names),
                             "the start-up consistency check", sequence)
    found = differences([json.loads(store.get(name)) for name in names])
    if found:
        listed = found[:_MAX_LISTED]
        more = len(found) - len(listed)
        raise Error(
            "Distributed run: the processes compile different models or "
            "options, so they cannot train one model together:\n  " +
            "\n  ".join(listed) + (f"\n  ... and {more} more" if more else ""))
