"""Model partitioning annotations: ``Block``, ``BeginBlock``,
``BlockFunction``, ``removeBlocks`` (API reference 11.5) and ``NameScope``
(11.3).

The annotations label the operations of the model; they do not change what
the model computes. Inside a block, every operation traced by the capture
(``make_fx`` under ``torch.fx.traceback.preserve_node_meta``) carries
``node.meta["custom"]`` with:

* ``"poptorch_block"``: the block's ``user_id`` (an automatic id ``"0"``,
  ``"1"``, ... for blocks given none, in order of appearance),
* ``"poptorch_ipu"``: the ``ipu_id`` the annotation gave (or ``None``),
* ``"poptorch_block_entry"``: a number that grows each time a block begins,
  which ``propagate_block_annotations`` uses to extend blocks forward.

Inside a ``NameScope`` the operations carry ``"poptorch_name_scope"``, the
names of the enclosing scopes joined with ``"/"``.

A block lasts until the next block begins, as in the guide: "all layers from
``layer_n`` onwards (inclusive)" belong to the block ``BeginBlock`` put on
``layer_n``. Operations that run after a block's scope has closed are given
to that block by ``propagate_block_annotations``. A ``Block`` or
``BlockFunction`` scope is closed: a different block beginning inside it
raises ``poptorch.Error`` during capture. A ``BeginBlock`` module may
contain other blocks: its sub-modules "will be part of this block until a
sub-module is modified to be in another block".

``Block.start`` begins a block with no scope, at that point of ``forward``:
the operations traced after it carry the block's keys until the enclosing
scope (a module's ``forward``, a block or a name scope) closes, and
``propagate_block_annotations`` extends the block from there until the next
block begins. ``torch.ops.poptorch.begin_ipu_block`` (``ops.py``) begins a
block the same way.

Outside a capture the annotations are harmless context managers: the model
runs on the host exactly as without them, and no rule is checked;
``Block.start`` does nothing there.

The executor wraps each capture in ``begin_capture()`` /
``end_capture()``; the latter returns the blocks met, in order of first
appearance, as ``BlockRecord`` objects for the execution strategy to place.
"""
import dataclasses
import functools
import weakref
from typing import Callable, Dict, Iterable, List, Optional, TypeVar, Union

import torch
import torch.fx.traceback as fx_traceback

from ..errors import Error

BLOCK_KEY = "poptorch_block"
IPU_KEY = "poptorch_ipu"
ENTRY_KEY = "poptorch_block_entry"
NAME_SCOPE_KEY = "poptorch_name_scope"

_BEGIN_BLOCK_ATTR = "_poptorch_begin_block"
_CLOSED_KINDS = ("Block", "BlockFunction")

Function = TypeVar("Function", bound=Callable)


@dataclasses.dataclass(frozen=True)
class BlockRecord:
    """A block met during a capture: its id, the IPU its annotations gave
    (``None`` when none did) and its rank in order of first appearance."""
    user_id: str
    ipu_id: Optional[int]
    order: int


def _check_user_id(kind: str, user_id) -> Optional[str]:
    """The block id as a string: PopTorch also takes an integer id, which
    stands for its decimal string (``Stage("1")`` names ``user_id=1``)."""
    if user_id is None or isinstance(user_id, str):
        return user_id
    if isinstance(user_id, int) and not isinstance(user_id, bool):
        return str(user_id)
    raise Error(f"{kind}: user_id must be a string (an f-string is fine), "
                f"an integer or None, not {type(user_id).__name__} "
                f"{user_id!r}")


def _check_ipu_id(kind: str, ipu_id) -> Optional[int]:
    """The IPU index as an int; a string of digits is accepted because the
    guide allows ids written as (formatted) strings."""
    if ipu_id is None:
        return None
    if isinstance(ipu_id, str) and ipu_id.isdigit():
        return int(ipu_id)
    if isinstance(ipu_id, int) and not isinstance(ipu_id, bool) \
            and ipu_id >= 0:
        return ipu_id
    raise Error(f"{kind}: ipu_id must be a non-negative integer or None, "
                f"not {ipu_id!r}")


class _BlockScope:
    """What one annotation (a Block, a BeginBlock mark, a BlockFunction)
    says: its kind, user_id and ipu_id."""

    def __init__(self, kind: str, user_id: Optional[str],
                 ipu_id: Optional[int]) -> None:
        self.kind = kind
        self.user_id = user_id
        self.ipu_id = ipu_id

    def describe(self) -> str:
        return f"{self.kind}(user_id={self.user_id!r}, ipu_id={self.ipu_id})"


@dataclasses.dataclass
class _OpenBlock:
    scope: _BlockScope
    user_id: str
    owner: object
    annotation: object


class _Recorder:
    """Block and name-scope state of the process: the open scopes, the
    automatic ids and, during a capture, the blocks met."""

    def __init__(self) -> None:
        self.capturing = False
        self.records: Dict[str, BlockRecord] = {}
        self.open_blocks: List[_OpenBlock] = []
        self.name_scopes: List[tuple] = []
        self.next_entry = 0
        self.restart_auto_ids()

    def restart_auto_ids(self) -> None:
        self.next_auto_id = 0
        self.auto_ids: "weakref.WeakKeyDictionary[_BlockScope, str]" = \
            weakref.WeakKeyDictionary()

    def reset(self, capturing: bool) -> None:
        """Start or stop a capture; the scopes open now stay open."""
        self.capturing = capturing
        self.records = {}
        self.next_entry = 0
        self.restart_auto_ids()

    def user_id_of(self, scope: _BlockScope) -> str:
        """The scope's user_id, or its automatic id: one per annotation
        object until the numbering restarts."""
        if scope.user_id is not None:
            return scope.user_id
        if scope not in self.auto_ids:
            self.auto_ids[scope] = str(self.next_auto_id)
            self.next_auto_id += 1
        return self.auto_ids[scope]

    def check_nesting(self, scope: _BlockScope, user_id: str) -> None:
        """Refuse a block beginning inside a closed scope of another id."""
        closed = [outer for outer in self.open_blocks
                  if outer.scope.kind in _CLOSED_KINDS]
        if closed and closed[-1].user_id != user_id:
            outer = closed[-1]
            raise Error(
                f"{scope.kind} '{user_id}' begins inside {outer.scope.kind} "
                f"'{outer.user_id}': a Block or BlockFunction scope cannot "
                "contain another block. Close the outer scope first, or mark "
                "sub-modules with BeginBlock (a BeginBlock block lasts until "
                "the next block begins).")

    def record(self, user_id: str, ipu_id: Optional[int]) -> None:
        """Remember the block; blocks with the same id are one block, so
        their IPUs must agree."""
        known = self.records.get(user_id)
        if known is None:
            self.records[user_id] = BlockRecord(user_id, ipu_id,
                                                len(self.records))
            return
        if ipu_id is None or known.ipu_id == ipu_id:
            return
        if known.ipu_id is not None:
            raise Error(
                f"Block '{user_id}' is placed on IPU {known.ipu_id} and again "
                f"on IPU {ipu_id}: blocks with the same user_id are a single "
                "block and must use the same ipu_id")
        self.records[user_id] = dataclasses.replace(known, ipu_id=ipu_id)


_recorder = _Recorder()


def begin_capture() -> None:
    """Start recording blocks for a capture: automatic ids restart at "0"."""
    _recorder.reset(capturing=True)


def end_capture() -> List[BlockRecord]:
    """Stop recording; the blocks met, in order of first appearance."""
    records = sorted(_recorder.records.values(), key=lambda r: r.order)
    _recorder.reset(capturing=False)
    return records


def _begin(scope: _BlockScope) -> Dict[str, object]:
    """Begin the block ``scope`` describes (checked and recorded during a
    capture); the annotation keys of its operations."""
    user_id = _recorder.user_id_of(scope)
    if _recorder.capturing:
        _recorder.check_nesting(scope, user_id)
        _recorder.record(user_id, scope.ipu_id)
    keys = {BLOCK_KEY: user_id, IPU_KEY: scope.ipu_id,
            ENTRY_KEY: _recorder.next_entry}
    _recorder.next_entry += 1
    return keys


def _enter_block(scope: _BlockScope, owner: object) -> None:
    keys = _begin(scope)
    annotation = fx_traceback.annotate(keys)
    annotation.__enter__()
    _recorder.open_blocks.append(_OpenBlock(scope, keys[BLOCK_KEY], owner,
                                            annotation))


def start_block(scope: _BlockScope) -> None:
    """During a capture, begin the block ``scope`` describes at this point:
    the operations traced next carry its keys until the enclosing
    annotation scope closes (which restores the keys it began with); the
    capture's ``preserve_node_meta`` drops them at its end. Outside a
    capture, nothing."""
    if not _recorder.capturing:
        return
    keys = _begin(scope)
    meta = fx_traceback.current_meta
    meta["custom"] = {**meta.get("custom", {}), **keys}


def start_ipu_block(stage_id: int, ipu_id: int) -> None:
    """``Block.start`` for PopTorch's ``begin_ipu_block`` op: the block
    named ``str(stage_id)``, on IPU ``ipu_id`` (on none when negative)."""
    kind = "begin_ipu_block"
    ipu = None if ipu_id < 0 else _check_ipu_id(kind, ipu_id)
    start_block(_BlockScope(kind, _check_user_id(kind, stage_id), ipu))


def _exit_block(owner: object) -> None:
    """Close the innermost block if ``owner`` opened it (a failed entry
    opened nothing)."""
    if _recorder.open_blocks and _recorder.open_blocks[-1].owner is owner:
        _recorder.open_blocks.pop().annotation.__exit__(None, None, None)


class Block:
    """A context manager defining a block of the model.

    >>> with poptorch.Block("Encoder", ipu_id=0):
    ...     x = self.layer(x)

    ``user_id`` names the block (blocks with the same id are one block; ids
    are used to build stages and phases); ``ipu_id`` is the IPU it runs on
    unless a ``Stage`` says otherwise. A block given no ``user_id`` gets an
    automatic id, "0", "1", ..., in order of appearance.
    """

    def __init__(self, user_id: Union[str, int, None] = None,
                 ipu_id: Optional[int] = None) -> None:
        self._scope = _BlockScope("Block", _check_user_id("Block", user_id),
                                  _check_ipu_id("Block", ipu_id))

    @staticmethod
    def useAutoId() -> None:
        """Restart automatic block ids: the following blocks with no
        ``user_id`` are named "0", "1", ... in order of appearance. Call it
        at the beginning of ``forward()``."""
        _recorder.restart_auto_ids()

    @staticmethod
    def start(user_id: Union[str, int, None] = None,
              ipu_id: Optional[int] = None) -> None:
        """Begin a block at this point of ``forward``, without a context
        manager: the operations that follow belong to it until the next
        block begins, as the layers after a ``BeginBlock`` module do.

        >>> poptorch.Block.start("Decoder", ipu_id=1)
        >>> x = self.decoder(x)

        ``user_id`` and ``ipu_id`` mean what they mean for ``Block`` (no
        ``user_id``: the next automatic id). Called inside a ``Block`` or
        ``BlockFunction`` scope of another id, it is an error, as a nested
        ``Block`` is. Outside a captured model it does nothing."""
        start_block(_BlockScope("Block.start",
                                _check_user_id("Block.start", user_id),
                                _check_ipu_id("Block.start", ipu_id)))

    def __enter__(self) -> "Block":
        _enter_block(self._scope, owner=self)
        return self

    def __exit__(self, *exc_info) -> None:
        _exit_block(owner=self)

    def __repr__(self) -> str:
        return self._scope.describe()


def _begin_block_pre_hook(module: torch.nn.Module, args) -> None:
    _enter_block(getattr(module, _BEGIN_BLOCK_ATTR).scope, owner=module)


def _begin_block_post_hook(module: torch.nn.Module, args, output) -> None:
    _exit_block(owner=module)


def _extra_repr_with_block(module: torch.nn.Module) -> str:
    own = type(module).extra_repr(module)
    mark = getattr(module, _BEGIN_BLOCK_ATTR).scope.describe()
    return f"{mark}, {own}" if own else mark


class _CalledFunction(torch.nn.Module):
    """A function given to ``BeginBlock``, as a module that can carry the
    block's mark: calling it calls the function."""

    def __init__(self, function: Callable) -> None:
        super().__init__()
        self.function = function

    def forward(self, *args, **kwargs):
        return self.function(*args, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.function, "__name__", repr(self.function))


class _BeginBlockMark:
    """What BeginBlock attaches to a module: its scope and hook handles."""

    def __init__(self, scope: _BlockScope, handles: list) -> None:
        self.scope = scope
        self.handles = handles


def BeginBlock(layer_to_call: Union[torch.nn.Module, Callable],
               user_id: Union[str, int, None] = None,
               ipu_id: Optional[int] = None) -> torch.nn.Module:
    """Define a block by marking an existing module, and return the module.

    The module and its sub-modules are part of the block, and so is what
    runs after it, until another block begins. Marking a module again
    replaces its mark. The module stays picklable and deep-copyable, its
    ``repr`` shows the mark, and ``removeBlocks`` takes the mark away.

    As in PopTorch, ``layer_to_call`` may also be a function: the result is
    then a new module calling it, which begins the block each time it is
    called.
    """
    if not isinstance(layer_to_call, torch.nn.Module):
        if not callable(layer_to_call):
            raise Error("BeginBlock: layer_to_call must be a "
                        "torch.nn.Module or a function, not "
                        f"{type(layer_to_call).__name__}")
        layer_to_call = _CalledFunction(layer_to_call)
    scope = _BlockScope("BeginBlock", _check_user_id("BeginBlock", user_id),
                        _check_ipu_id("BeginBlock", ipu_id))
    mark = getattr(layer_to_call, _BEGIN_BLOCK_ATTR, None)
    if mark is not None:
        mark.scope = scope
        return layer_to_call
    handles = [
        layer_to_call.register_forward_pre_hook(_begin_block_pre_hook,
                                                prepend=True),
        layer_to_call.register_forward_hook(_begin_block_post_hook,
                                            always_call=True),
    ]
    setattr(layer_to_call, _BEGIN_BLOCK_ATTR, _BeginBlockMark(scope, handles))
    layer_to_call.extra_repr = functools.partial(_extra_repr_with_block,
                                                 layer_to_call)
    return layer_to_call


def removeBlocks(module: torch.nn.Module) -> None:
    """Recursively remove the BeginBlock marks of ``module`` and of its
    sub-modules."""
    if not isinstance(module, torch.nn.Module):
        raise Error("removeBlocks: module must be a torch.nn.Module, not "
                    f"{type(module).__name__}")
    for sub in module.modules():
        mark = sub.__dict__.pop(_BEGIN_BLOCK_ATTR, None)
        if mark is None:
            continue
        for handle in mark.handles:
            handle.remove()
        sub.__dict__.pop("extra_repr", None)


def BlockFunction(user_id: Union[str, int, None] = None,
                  ipu_id: Optional[int] = None
                  ) -> Callable[[Function], Function]:
    """A decorator running a function (or method) inside a block.

    >>> @poptorch.BlockFunction("Decoder", ipu_id=1)
    ... def decoder(self, encoder_output):
    ...     return self.decoder_b1(encoder_output)

    Everything the function calls is part of the block.
    """
    user_id = _check_user_id("BlockFunction", user_id)
    ipu_id = _check_ipu_id("BlockFunction", ipu_id)

    def decorator(function: Function) -> Function:
        if not callable(function):
            raise Error("BlockFunction decorates functions, not "
                        f"{type(function).__name__}")
        scope = _BlockScope("BlockFunction", user_id, ipu_id)

        @functools.wraps(function)
        def in_block(*args, **kwargs):
            _enter_block(scope, owner=scope)
            try:
                return function(*args, **kwargs)
            finally:
                _exit_block(owner=scope)

        return in_block

    return decorator


class NameScope:
    """Prefix the names of the operations created inside with ``name``.

    >>> with poptorch.NameScope("CustomString"):
    ...     y = self.bmm(a, b)

    Nested scopes are joined with "/": the operations inside carry
    ``node.meta["custom"]["poptorch_name_scope"] == "outer/inner"``.
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise Error(f"NameScope: name must be a non-empty string, not "
                        f"{name!r}")
        self._name = name

    def __enter__(self) -> "NameScope":
        push_name_scope(self._name)
        return self

    def __exit__(self, *exc_info) -> None:
        if _recorder.name_scopes:
            pop_name_scope()


def push_name_scope(name: str) -> None:
    """Open the name scope ``name`` inside the open ones (what entering a
    ``NameScope`` does)."""
    names = [open_name for open_name, _ in _recorder.name_scopes] + [name]
    annotation = fx_traceback.annotate({NAME_SCOPE_KEY: "/".join(names)})
    annotation.__enter__()
    _recorder.name_scopes.append((name, annotation))


def pop_name_scope() -> None:
    """Close the innermost open name scope."""
    if not _recorder.name_scopes:
        raise Error("pop_name_scope: no name scope is open; each "
                    "pop_name_scope must follow a push_name_scope")
    _recorder.name_scopes.pop()[1].__exit__(None, None, None)


#: The block of the operations that run before the first block begins.
BEFORE_FIRST_BLOCK = "<layers before the first block>"


def with_layers_before(records: List[BlockRecord],
                       nodes: Iterable[torch.fx.Node]) -> List[BlockRecord]:
    """``records``, preceded by a block for the operations traced before
    the first block began when there are any: the guide places "all layers
    before ``layer_n``" on IPU ``m - 1`` when ``BeginBlock(layer_n,
    ipu_id=m)`` is the first block. No such block when the first block has
    no ``ipu_id`` or is on IPU 0 (the operations then join the first stage
    that uses them)."""
    if not records:
        return records
    first = min(records, key=lambda record: record.order)
    if first.ipu_id is None or first.ipu_id < 1:
        return records
    operation = next((node for node in nodes if node.op in
                      ("call_function", "call_method", "call_module")), None)
    if operation is None or \
            (operation.meta.get("custom") or {}).get(BLOCK_KEY) is not None:
        return records
    return [BlockRecord(BEFORE_FIRST_BLOCK, first.ipu_id - 1,
                        first.order - 1)] + list(records)


def propagate_block_annotations(nodes: Iterable[torch.fx.Node]) -> None:
    """Give each operation node the block that was the last to begin before
    it, so that a block lasts until the next one begins.

    ``nodes`` are the forward operations in the order they were traced.
    Nodes traced inside a block scope that an inner block has since
    superseded, and nodes traced outside any scope after a block began, get
    that block's keys; nodes before the first block are left alone.
    """
    current: Optional[dict] = None
    for node in nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        custom = node.meta.get("custom") or {}
        entry = custom.get(ENTRY_KEY)
        if entry is not None and (current is None
                                  or entry >= current[ENTRY_KEY]):
            current = {key: custom[key]
                       for key in (BLOCK_KEY, IPU_KEY, ENTRY_KEY)}
        elif current is not None:
            node.meta["custom"] = {**custom, **current}
