"""Keeping the user's module (the host copy) and the models' device copies in
step (docs/semantics.md, "Weights between host and device").

Wrapping a module attaches a ``ModuleSync`` to it and swaps its class, and
the classes of all its sub-modules, for subclasses whose calls and parameter
and buffer accessors first bring trained weights back from the training
model's device, once per training call: a call of the module is current even
when its ``forward`` reaches sub-modules through closures or stored
references rather than attribute reads, and so is a sub-module the program
holds itself (``net`` after ``trainingModel(WithLoss(net))``) when it reads
its weights or calls it. The subclasses compare and hash equal to the
classes they hook (``type(layer) == nn.Linear`` holds). Pickling and
deep-copying the module give a plain instance of the original class.

Writes to the host copy that the module sees make it the newer copy: its
``load_state_dict``, assigning a parameter, buffer or sub-module
attribute, and ``register_buffer`` / ``register_parameter``, first bring
trained weights back (so that what the write leaves alone is current and is
not overwritten later), then count a new version that every model of the
module loads before its next call; ``load_state_dict`` does so for the
models of every wrapped module holding one of the sub-modules it writes.
Assigning a parameter or sub-module, or registering a new name, also
changes the module's structure, which a compiled model cannot follow
(``structure``).

Models of different modules may share sub-modules (a GAN's generator loss
and discriminator loss both hold the generator and the discriminator).
``SharedTensors`` keeps a record of every compiled model's parameters and
buffers and of the training calls: before a call, a model that shares a
tensor with another model trained since its last call gets the newer
weights, through the host (``stale_sources``). A training model that is
destroyed takes its record away after its last download, so the models of
the modules sharing its sub-modules count that download as a host write
(``written_for_sharing_modules``).
"""
import contextlib
import copyreg
import functools
import itertools
import weakref
from typing import Iterable, Iterator, List, Optional

import torch
from torch.nn.utils import parametrize

from ..errors import Error
from .logger import warn_once

_SYNC_ATTRIBUTE = "_poptorch_sync"
# Each hooked module's list of the ModuleSyncs of the wrapped modules it
# belongs to (a sub-module may belong to several: a GAN's losses).
_SYNCS_ATTRIBUTE = "_poptorch_syncs"
_suspended = [0]


@contextlib.contextmanager
def host_reads_suspended() -> Iterator[None]:
    """Reads of the module during capture must not trigger copies."""
    _suspended[0] += 1
    try:
        yield
    finally:
        _suspended[0] -= 1


class ModuleSync:
    """Shared state of all models wrapping one user module.

    The module keeps its training model alive until ``destroy()``: trained
    weights reach the host on the next read even if the program dropped its
    reference to the training model.
    """

    def __init__(self) -> None:
        self.trainer = None
        self.executors = 0
        self.version = 0
        self.structure = 0
        self.device_newer = False
        #: The inference model whose calls wrote buffers the host has not
        #: seen (``inference_wrote_buffers``), or None.
        self.unseen_buffer_writes = None

    def register(self, executor, training: bool, module_name: str) -> None:
        if training:
            current = self.trainer
            if current is not None and current is not executor:
                raise Error(
                    f"This {module_name} module is already wrapped in a "
                    "training model: one module can be trained by one "
                    "training model at a time. Call destroy() on the first "
                    "training model before wrapping the module again.")
            self.trainer = executor
        self.executors += 1

    def unregister(self, executor) -> None:
        if self.trainer is executor:
            self.bring_host_up_to_date()
            self.trainer = None
        self.executors -= 1

    def trained_on_device(self) -> None:
        """A training call changed the device weights."""
        self.device_newer = True
        self.version += 1

    def host_written(self, structural: bool) -> None:
        """The program wrote to the host copy (after it was brought up to
        date): models load it before their next call."""
        self.version += 1
        if structural:
            self.structure += 1

    def before_upload(self) -> None:
        """Before a model copies the host's weights to its device: weights
        trained on the device reach the host first, so that the upload
        does not replace them with the host's older copy; host tensors
        written in place while they were older are an error (the trainer's
        ``refuse_host_edits_of_stale_weights``)."""
        if self.device_newer and self.trainer is not None:
            self.trainer.refuse_host_edits_of_stale_weights()
        self.bring_host_up_to_date()

    def inference_wrote_buffers(self, executor) -> None:
        """An inference call of ``executor`` wrote buffers on its device
        (BatchNorm statistics in training mode, a counter written in
        forward): as in PopTorch, they stay there until its
        ``copyWeightsToHost()``; the host's next read says so, once."""
        self.unseen_buffer_writes = executor

    def buffers_seen(self, executor) -> None:
        """``executor``'s buffers were copied to the host."""
        if self.unseen_buffer_writes is executor:
            self.unseen_buffer_writes = None

    def bring_host_up_to_date(self) -> bool:
        """Copy trained weights to the host if they are newer there."""
        if self.unseen_buffer_writes is not None and not _suspended[0]:
            writer = self.unseen_buffer_writes
            warn_once(
                f"An inference model of this "
                f"{type(writer.model).__name__} wrote buffers on its device "
                "(BatchNorm running statistics in training mode, buffers "
                "written in forward), which the host copy read now does "
                "not have: as in PopTorch, an inference model copies its "
                "weights and buffers back only when told to. Call "
                "copyWeightsToHost() on the inference model to read them "
                "(or to start another model from them).")
        if not self.device_newer or _suspended[0]:
            return False
        self.device_newer = False
        trainer = self.trainer
        if trainer is not None:
            trainer.copyWeightsToHost()
        return True


_training_calls = itertools.count(1)
_records: "weakref.WeakSet" = weakref.WeakSet()


class SharedTensors:
    """One compiled model's host parameters and buffers (by identity), the
    training call that last changed them on its device, and the training
    calls it has seen. The model keeps its record while it is compiled;
    the records of all compiled models are known here (weakly)."""

    def __init__(self, model, tensors: Iterable[torch.Tensor]) -> None:
        self.tensors = frozenset(id(t) for t in tensors)
        self.trained_at = 0
        self.synced_at = 0
        self._model = weakref.ref(model)
        _records.add(self)

    def trained(self) -> None:
        """A training call of this model changed its device weights."""
        self.trained_at = self.synced_at = next(_training_calls)

    def stale_sources(self) -> List[object]:
        """The other models that trained tensors of this model since its
        last call or load; marks them seen."""
        sources = [other._model() for other in list(_records)
                   if other is not self
                   and other.trained_at > self.synced_at
                   and other.tensors & self.tensors]
        self.synced_at = next(_training_calls)
        return [source for source in sources if source is not None]


def attach(module: torch.nn.Module) -> ModuleSync:
    """The module's ``ModuleSync``, installing the read hooks on the module
    and its sub-modules on first use."""
    sync = module.__dict__.get(_SYNC_ATTRIBUTE)
    if sync is None:
        sync = ModuleSync()
        _hook(module, [sync])
        module.__dict__[_SYNC_ATTRIBUTE] = sync
    return sync


def detach(module: torch.nn.Module) -> None:
    """Remove the hooks once no model wraps the module any more (those of
    sub-modules that another wrapped module holds stay)."""
    sync = module.__dict__.get(_SYNC_ATTRIBUTE)
    if sync is None or sync.executors != 0:
        return
    del module.__dict__[_SYNC_ATTRIBUTE]
    for sub in _hookable(module):
        syncs = sub.__dict__.get(_SYNCS_ATTRIBUTE, [])
        if sync in syncs:
            syncs.remove(sync)
        if not syncs:
            sub.__dict__.pop(_SYNCS_ATTRIBUTE, None)
            if "_poptorch_original_class" in type(sub).__dict__:
                sub.__class__ = type(sub)._poptorch_original_class


def _hook(module: torch.nn.Module, syncs: List[ModuleSync]) -> None:
    """The module and its sub-modules belong to ``syncs`` too, and their
    reads and writes are hooked."""
    for sub in _hookable(module):
        known = sub.__dict__.setdefault(_SYNCS_ATTRIBUTE, [])
        known.extend(sync for sync in syncs if sync not in known)
        if not hasattr(type(sub), "_poptorch_original_class"):
            sub.__class__ = _hooked_class(type(sub))


def _hookable(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The module and its sub-modules, once each, without TorchScript
    modules (whose class cannot change) and parametrized modules (whose
    class ``torch.nn.utils.parametrize`` swaps and edits itself)."""
    with host_reads_suspended():
        return [sub for sub in module.modules()
                if not isinstance(sub, torch.jit.ScriptModule)
                and not parametrize.is_parametrized(sub)]


def written_for_sharing_modules(module: torch.nn.Module,
                                own: ModuleSync) -> None:
    """The host copy of ``module``'s tensors was written by ``own``'s
    training model as it stopped keeping a record of them (its last
    download, in ``destroy()``): the models of other wrapped modules that
    share sub-modules with it load the host copy before their next call."""
    for sync in _syncs_within(module):
        if sync is not own:
            sync.host_written(structural=False)


def sync_of(module: torch.nn.Module) -> Optional[ModuleSync]:
    return module.__dict__.get(_SYNC_ATTRIBUTE)


_hooked_classes = {}


def _hooked_class(original: type) -> type:
    """The subclass of ``original`` whose reads and writes are hooked. It
    equals ``original`` and hashes as it does, so that code testing a
    module's class with ``type(module) == cls`` or ``type(module) in {...}``
    (torch.ao's ``freeze_bn_stats``, an initialisation applied by type)
    still recognises it; ``type(module) is cls`` cannot."""
    hooked = _hooked_classes.get(original)
    if hooked is None:
        namespace = {name: _reading(getattr(original, name))
                     for name in _READ_METHODS}
        namespace.update(
            load_state_dict=_writing(original.load_state_dict),
            register_buffer=_writing(original.register_buffer, "_buffers"),
            register_parameter=_writing(original.register_parameter,
                                        "_parameters"))
        namespace.update(
            __getattr__=_getattr, __setattr__=_setattr,
            __reduce_ex__=_reduce_ex,
            __module__=original.__module__, __qualname__=original.__qualname__,
            _poptorch_original_class=original)
        hooked = _equal_to_original(type(original))(
            original.__name__, (original,), namespace)
        _hooked_classes[original] = hooked
    return hooked


_class_kinds = {}


def _equal_to_original(metaclass: type) -> type:
    """A metaclass deriving from ``metaclass`` whose classes compare and hash
    as the class they hook."""
    kind = _class_kinds.get(metaclass)
    if kind is None:
        kind = type(f"Hooked{metaclass.__name__}", (metaclass,), {
            "__eq__": _same_class, "__ne__": _other_class,
            "__hash__": _class_hash})
        _class_kinds[metaclass] = kind
    return kind


def _unhooked(cls: type) -> type:
    return cls.__dict__.get("_poptorch_original_class", cls)


def _same_class(cls: type, other: object) -> bool:
    return isinstance(other, type) and _unhooked(cls) is _unhooked(other)


def _other_class(cls: type, other: object) -> bool:
    return not _same_class(cls, other)


def _class_hash(cls: type) -> int:
    return type.__hash__(_unhooked(cls))


_READ_METHODS = ("__call__", "parameters", "named_parameters", "buffers",
                 "named_buffers", "state_dict", "modules", "named_modules",
                 "children", "named_children", "_apply")


def _before_read(module: torch.nn.Module) -> None:
    for sync in module.__dict__.get(_SYNCS_ATTRIBUTE, ()):
        sync.bring_host_up_to_date()


def _syncs_within(module: torch.nn.Module) -> List[ModuleSync]:
    """The syncs of ``module`` and of its sub-modules, once each: a
    ``load_state_dict`` writes sub-modules that other wrapped modules may
    share (a GAN's generator)."""
    syncs = {}
    for sub in _hookable(module):
        for sync in sub.__dict__.get(_SYNCS_ATTRIBUTE, ()):
            syncs.setdefault(id(sync), sync)
    return list(syncs.values())


def _reading(method):
    @functools.wraps(method)
    def hooked(self, *args, **kwargs):
        _before_read(self)
        return method(self, *args, **kwargs)

    return hooked


def _writing(method, table: Optional[str] = None):
    """``method``, a write to the host copy (``load_state_dict``); with
    ``table``, ``register_buffer`` / ``register_parameter`` into that table
    of the module, which also changes the structure when the name is new
    (re-pruning registers a new mask under the old name). The hooked method
    has ``method``'s signature, which torch inspects (assigning a
    non-persistent buffer checks that ``register_buffer`` takes
    ``persistent``)."""
    @functools.wraps(method)
    def hooked(self, *args, **kwargs):
        if _suspended[0]:
            return method(self, *args, **kwargs)
        if table is None:
            return _load_into(self, method, args, kwargs)
        _before_read(self)
        name = args[0] if args else kwargs.get("name")
        new = name not in self.__dict__[table]
        result = method(self, *args, **kwargs)
        _after_write(self, structural=new)
        return result

    return hooked


def _load_into(module: torch.nn.Module, method, args, kwargs):
    """``load_state_dict``: every model of the module or of a module
    sharing one of its sub-modules brings its trained weights back first
    and loads the host copy before its next call."""
    syncs = _syncs_within(module)
    for sync in syncs:
        sync.bring_host_up_to_date()
    result = method(module, *args, **kwargs)
    for sync in syncs:
        sync.host_written(structural=False)
    return result


def _after_write(module: torch.nn.Module, structural: bool) -> None:
    for sync in module.__dict__.get(_SYNCS_ATTRIBUTE, ()):
        sync.host_written(structural)


def _setattr(self, name: str, value) -> None:
    """Assigning a parameter, buffer or sub-module is a write to the host
    copy; a new sub-module joins the models' hooks."""
    original = type(self)._poptorch_original_class.__setattr__
    if _suspended[0] or not _holds_weights(self, name, value):
        original(self, name, value)
        return
    _before_read(self)
    original(self, name, value)
    if isinstance(value, torch.nn.Module):
        _hook(value, self.__dict__.get(_SYNCS_ATTRIBUTE, []))
    _after_write(self, structural=name not in self._buffers)


def _holds_weights(module: torch.nn.Module, name: str, value) -> bool:
    """Whether ``module.name = value`` sets or replaces a parameter, buffer
    or sub-module."""
    return (isinstance(value, (torch.nn.Module, torch.nn.Parameter))
            or name in module._parameters or name in module._buffers
            or name in module._modules)


def _getattr(self, name: str):
    """Read a parameter, buffer or sub-module, or a derived weight that the
    download sets again (``derived_weights``), after bringing trained
    weights to the host."""
    _before_read(self)
    if name in self.__dict__:
        return self.__dict__[name]
    return type(self)._poptorch_original_class.__getattr__(self, name)


def _reduce_ex(self, protocol):
    """Pickle and deep-copy as a plain instance of the original class."""
    _before_read(self)
    state = {key: value for key, value in self.__dict__.items()
             if key not in (_SYNC_ATTRIBUTE, _SYNCS_ATTRIBUTE)}
    return (copyreg._reconstructor,
            (type(self)._poptorch_original_class, object, None), state)
