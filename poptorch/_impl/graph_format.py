"""Captured FX graphs as JSON, without pickle.

A captured graph holds placeholders, calls of registered PyTorch operators
(``aten::convolution.default``, ``poptorch::ipu_print_tensor``...) and
``operator.getitem``, constant tensors (``get_attr``) and one output node.
Each node becomes a JSON object; argument values are JSON numbers, strings,
booleans, null and lists, or tagged objects for the rest::

    {"node": "convolution"}      another node's value
    {"tuple": [...]}             a tuple
    {"float": "inf"}             a non-finite float ("inf", "-inf", "nan")
    {"dtype": "float32"}         torch.float32 (also "device", "layout",
                                 "memory_format", "complex": [re, im])

Loading resolves operator names among the operators registered in this
process and never runs code from the file; an unknown operator or value
raises ``poptorch.Error``. Constant tensors are returned separately, for a
weights-only tensor file.
"""
import hashlib
import json
import math
import operator
from typing import Any, Dict, List, Tuple

import torch

from ..errors import Error

FORMAT_VERSION = 1

_GETITEM = "operator.getitem"
_LAYOUTS = {str(layout).split(".")[-1]: layout
            for layout in (torch.strided, torch.sparse_coo, torch.sparse_csr,
                           torch._mkldnn)}
_MEMORY_FORMATS = {str(fmt).split(".")[-1]: fmt
                   for fmt in (torch.contiguous_format, torch.channels_last,
                               torch.channels_last_3d,
                               torch.preserve_format)}


class GraphFormatError(Error):
    """A graph cannot be written or read in the JSON graph format."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def _encode(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if isinstance(value, list):
        return [_encode(item, where) for item in value]
    if isinstance(value, tuple):
        return {"tuple": [_encode(item, where) for item in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": _dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).split(".")[-1]}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).split(".")[-1]}
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    raise GraphFormatError(
        f"{where}: a value of type {type(value).__name__} ({value!r}) "
        "cannot be written in the graph format")


def _decode(value: Any, nodes: Dict[str, torch.fx.Node], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(item, nodes, where) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise GraphFormatError(f"{where}: malformed value {value!r}")
    (tag, content), = value.items()
    try:
        return _DECODERS[tag](content, nodes, where)
    except KeyError as error:
        raise GraphFormatError(f"{where}: unknown {tag} {content!r}") \
            from error


def _decode_float(content, nodes, where) -> float:
    if content not in ("inf", "-inf", "nan"):
        raise KeyError(content)
    return float(content)


_DECODERS = {
    "node": lambda content, nodes, where: nodes[content],
    "tuple": lambda content, nodes, where: tuple(
        _decode(item, nodes, where) for item in content),
    "float": _decode_float,
    "dtype": lambda content, nodes, where: _checked_dtype(content),
    "device": lambda content, nodes, where: torch.device(content),
    "layout": lambda content, nodes, where: _LAYOUTS[content],
    "memory_format": lambda content, nodes, where: _MEMORY_FORMATS[content],
    "complex": lambda content, nodes, where: complex(*content),
}


def _checked_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise KeyError(name)
    return dtype


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    if target is operator.getitem:
        return _GETITEM
    if isinstance(target, torch._ops.OpOverload):
        return target.name() if "." in target.name() else \
            f"{target.name()}.default"
    raise GraphFormatError(
        f"node {node.name}: the operation {target!r} cannot be written in "
        "the graph format (only registered PyTorch operators can)")


def _resolve_target(name: str, where: str):
    if name == _GETITEM:
        return operator.getitem
    namespace, separator, qualified = name.partition("::")
    packet_name, _, overload = qualified.partition(".")
    if not separator or not packet_name:
        raise GraphFormatError(f"{where}: malformed operator name {name!r}")
    try:
        packet = getattr(getattr(torch.ops, namespace), packet_name)
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError) as error:
        raise GraphFormatError(
            f"{where}: the operator {name} is not registered in this "
            "process (a different torch version, or a custom operator whose "
            "library is not loaded)") from error


def _custom_meta(node: torch.fx.Node) -> Dict[str, Any]:
    """The JSON-compatible annotations of a node (blocks, name scopes)."""
    custom = node.meta.get("custom") or {}
    return {key: value for key, value in custom.items()
            if isinstance(value, (str, int, float, bool, type(None)))}


def is_tensor_node(node: torch.fx.Node) -> bool:
    """Whether the node's value is one tensor (not a tuple or a number), in
    a captured graph or one read back from JSON."""
    return (isinstance(node.meta.get("val"), torch.Tensor)
            or node.meta.get("poptorch_is_tensor", False))


def serialize_graph(graph_module: torch.fx.GraphModule
                    ) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """(the JSON document, the constant tensors by attribute name)."""
    nodes, constants = [], {}
    for node in graph_module.graph.nodes:
        where = f"node {node.name}"
        entry = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            entry["target"] = _target_name(node)
        elif node.op == "get_attr":
            value = getattr(graph_module, node.target)
            if not isinstance(value, torch.Tensor):
                raise GraphFormatError(
                    f"{where}: the graph refers to a sub-module or object "
                    f"{node.target!r}; only constant tensors can be written")
            constants[node.target] = value.detach()
            entry["target"] = node.target
        elif node.op in ("placeholder", "output"):
            entry["target"] = node.target
        else:
            raise GraphFormatError(f"{where}: nodes of kind {node.op!r} "
                                   "cannot be written in the graph format")
        entry["args"] = _encode(list(node.args), where)
        entry["kwargs"] = {key: _encode(value, where)
                           for key, value in node.kwargs.items()}
        entry["tensor"] = is_tensor_node(node)
        custom = _custom_meta(node)
        if custom:
            entry["custom"] = custom
        nodes.append(entry)
    return {"format_version": FORMAT_VERSION, "nodes": nodes}, constants


def deserialize_graph(document: Dict[str, Any],
                      constants: Dict[str, torch.Tensor]
                      ) -> torch.fx.GraphModule:
    """The graph module ``serialize_graph`` described."""
    version = document.get("format_version") \
        if isinstance(document, dict) else None
    if version != FORMAT_VERSION:
        raise GraphFormatError(
            f"the graph was written in graph format version {version!r}; "
            f"this version reads {FORMAT_VERSION}")
    graph = torch.fx.Graph()
    nodes: Dict[str, torch.fx.Node] = {}
    try:
        for entry in document["nodes"]:
            nodes[entry["name"]] = _add_node(graph, entry, nodes, constants)
    except (KeyError, TypeError, ValueError) as error:
        raise GraphFormatError(f"the graph document is malformed: "
                               f"{type(error).__name__}: {error}") from error
    return torch.fx.GraphModule(dict(constants), graph)


def _add_node(graph: torch.fx.Graph, entry: Dict[str, Any],
              nodes: Dict[str, torch.fx.Node],
              constants: Dict[str, torch.Tensor]) -> torch.fx.Node:
    where = f"node {entry['name']}"
    op = entry["op"]
    args = tuple(_decode(entry["args"], nodes, where))
    kwargs = {key: _decode(value, nodes, where)
              for key, value in entry["kwargs"].items()}
    if op == "get_attr" and entry["target"] not in constants:
        raise GraphFormatError(f"{where}: the constant tensor "
                               f"{entry['target']!r} is missing")
    if op == "call_function":
        target = _resolve_target(entry["target"], where)
    elif op in ("placeholder", "get_attr", "output"):
        target = entry["target"]
    else:
        raise GraphFormatError(f"{where}: unknown node kind {op!r}")
    node = graph.create_node(op, target, args, kwargs, name=entry["name"])
    node.meta["poptorch_is_tensor"] = bool(entry.get("tensor"))
    if entry.get("custom"):
        node.meta["custom"] = dict(entry["custom"])
    return node


def graph_fingerprint(graph_module: torch.fx.GraphModule) -> str:
    """A digest of what the graph computes: its operations and arguments and
    its constant tensors' values (annotations left out)."""
    document, constants = serialize_graph(graph_module)
    for entry in document["nodes"]:
        entry.pop("custom", None)
    digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode())
    for name in sorted(constants):
        tensor = constants[name].cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes()
                      if tensor.numel() else b"")
    return digest.hexdigest()


def tensor_metadata(tensors: List[torch.Tensor]) -> List[List[Any]]:
    """Shape, stride, dtype and device type of each tensor, as JSON."""
    return [[list(t.shape), list(t.stride()), _dtype_name(t.dtype),
             t.device.type] for t in tensors]
