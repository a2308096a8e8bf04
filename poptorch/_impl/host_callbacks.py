"""The host functions of ``poptorch.CPU`` ops (API reference, "CPU ops
are only supported in inference graphs").

On an IPU the graph paused at a CPU op and the host ran its Python
function on the op's real tensors, every time the op ran. Here, while an
inference pass is captured, a call of a ``CPU`` op becomes one
``poptorch::host_callback`` operation of the graph: each step of each call
runs the function on the host with real tensors (so it may read values,
use NumPy, count or log), then hands its results back to the device.

The graph needs the shapes and dtypes of the results when it is captured,
so the function also runs while the model is compiled (as PopTorch's trace
ran it): on shape-only tensors when it is written with PyTorch operations,
else on zeros of its inputs' shapes. A call whose results differ from
those shapes or dtypes is an error naming the op. Where gradients flow
through the op (a training model, which PopTorch did not allow), the
function is traced inline like the rest of the model.

The operation names its function by a key that is only valid in the
process that captured it: a cached or exported executable with CPU ops
runs only in that process (other processes compile their own).
"""
import itertools
import json
import uuid
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch._subclasses.fake_tensor import is_fake

from ..errors import Error
from .replica_stacking import per_replica_rule

_PROCESS = uuid.uuid4().hex[:12]
_keys = itertools.count()


class _HostFunction:
    """One captured call site of a CPU op: the function with the call's
    non-tensor arguments, rebuilt around the tensors it is given."""

    def __init__(self, name: str, function: Callable, spec, leaves) -> None:
        self.name = name
        self._function = function
        self._spec = spec
        self._leaves = leaves

    def __call__(self, tensors: List[Tensor]) -> Tuple[List[Tensor], Any]:
        """The function's tensor results and the structure they are in."""
        values = iter(tensors)
        leaves = [next(values) if isinstance(leaf, Tensor) else leaf
                  for leaf in self._leaves]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        results, structure = pytree.tree_flatten(
            self._function(*args, **kwargs))
        if not all(isinstance(result, Tensor) for result in results):
            raise Error(f"poptorch.CPU op {self.name!r}: the function must "
                        "return tensors (a tensor, or a tuple or list of "
                        "them)")
        return results, structure


_registered: Dict[str, _HostFunction] = {}


def capturing(args, kwargs) -> bool:
    """Whether a CPU op called with these arguments is being captured
    into a graph (its tensors only describe shapes)."""
    return any(is_fake(leaf) for leaf in pytree.tree_leaves((args, kwargs))
               if isinstance(leaf, Tensor))


def needs_gradients(args, kwargs) -> bool:
    """Whether gradients flow through a call with these arguments."""
    return torch.is_grad_enabled() and any(
        leaf.requires_grad for leaf in pytree.tree_leaves((args, kwargs))
        if isinstance(leaf, Tensor))


def call_on_host(name: str, function: Callable, args, kwargs):
    """The captured call of ``function``: one host callback operation,
    whose results come back in the structure ``function`` returns."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    host_function = _HostFunction(name, function, spec, leaves)
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
    described, structure = _results_described(host_function, tensors)
    key = f"{_PROCESS}:{next(_keys)}:{name}"
    _registered[key] = host_function
    results = host_callback(key, json.dumps(described), tensors)
    return pytree.tree_unflatten(results, structure)


def _results_described(host_function: _HostFunction,
                       tensors: List[Tensor]) -> Tuple[List, Any]:
    """([shape, dtype name] of each result, their structure), learnt by
    running the function on shape-only tensors, else on zeros."""
    try:
        with disable_proxy_modes_tracing(), torch._C.DisableTorchFunction():
            results, structure = host_function(tensors)
    except Error:
        raise
    except Exception:  # pylint: disable=broad-except
        # It reads values (.item(), .numpy()): run it on real zeros.
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            zeros = [torch.zeros(t.shape, dtype=t.dtype) for t in tensors]
            results, structure = host_function(zeros)
    return ([[list(r.shape), str(r.dtype).split(".")[-1]] for r in results],
            structure)


@torch.library.custom_op("poptorch::host_callback", mutates_args=())
def host_callback(key: str, described: str,
                  tensors: List[Tensor]) -> List[Tensor]:
    """Run the host function registered under ``key`` on ``tensors`` (on
    the CPU) and return its results on their device, checked against the
    shapes and dtypes ``described`` at capture."""
    host_function = _registered.get(key)
    if host_function is None:
        raise Error(f"poptorch.CPU op {key.split(':', 2)[-1]!r}: its host "
                    "function belongs to the process that compiled the "
                    "model; an executable with CPU ops runs only there")
    results, _ = host_function([t.cpu() for t in tensors])
    expected = _expected(described)
    got = [(tuple(r.shape), r.dtype) for r in results]
    if got != expected:
        raise Error(f"poptorch.CPU op {host_function.name!r} returned "
                    f"{_describe(got)}, but the model was compiled for "
                    f"{_describe(expected)}: a CPU op's results must keep "
                    "their shapes and dtypes")
    device = tensors[0].device if tensors else torch.device("cpu")
    return [r.to(device).clone(memory_format=torch.contiguous_format)
            for r in results]


@host_callback.register_fake
def _host_callback_fake(key, described, tensors):
    device = tensors[0].device if tensors else torch.device("cpu")
    return [torch.empty(shape, dtype=dtype, device=device)
            for shape, dtype in _expected(described)]


host_callback.register_vmap(per_replica_rule(host_callback))


def _expected(described: str) -> List[Tuple[Tuple[int, ...], torch.dtype]]:
    return [(tuple(shape), getattr(torch, dtype))
            for shape, dtype in json.loads(described)]


def _describe(results) -> str:
    return ", ".join(f"{list(shape)} {str(dtype).split('.')[-1]}"
                     for shape, dtype in results) or "nothing"
