"""The shared-memory ring buffer of an ``AsynchronousDataAccessor``.

The buffer has ``buffer_size`` slots. A slot holds one batch: one tensor in
shared memory (torch's ``share_memory_``) per tensor leaf of the batch.
The worker process owns the slots: ``SlotWriter`` copies each batch it loads
into a free slot and describes it in a small ``SlotMessage`` (which slot, how
many rows each tensor uses, the non-tensor leaves). The first time a slot is
used, or when a batch does not fit the slot's tensors (another structure,
dtype or trailing shape, or more rows), the writer allocates new shared
tensors for it and sends them once with the message; torch passes them to
the consumer as file descriptors, so the data itself never goes through the
pipe.

``SlotReader`` (in the consumer) turns a message into the batch the user
sees: views of the slot's shared tensors, no copy. A slot is handed back to
the worker when the next batch is requested, and the worker then overwrites
it: a batch that must outlive the next step has to be cloned.

Shared memory comes from torch's default ``file_descriptor`` sharing
strategy: the segments are unlinked from ``/dev/shm`` as soon as they are
created and disappear with the last process that maps them, so nothing is
left behind even when a process is killed.
"""
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten


class SlotLayout(NamedTuple):
    """How a slot's shared tensors map onto the leaves of a batch."""
    spec: TreeSpec
    tensor_positions: Tuple[int, ...]
    tensors: Tuple[torch.Tensor, ...]

    def to_message(self) -> "LayoutMessage":
        """The layout in a form that pickles without the ``TreeSpec``."""
        skeleton = tree_unflatten([0] * self.spec.num_leaves, self.spec)
        return LayoutMessage(skeleton, self.tensor_positions, self.tensors)


class LayoutMessage(NamedTuple):
    """A ``SlotLayout`` whose structure is a skeleton: the batch with every
    leaf replaced by 0 (flattening it gives back the ``TreeSpec``)."""
    skeleton: Any
    tensor_positions: Tuple[int, ...]
    tensors: Tuple[torch.Tensor, ...]

    def to_layout(self) -> SlotLayout:
        """The ``SlotLayout`` this message describes."""
        _, spec = tree_flatten(self.skeleton)
        return SlotLayout(spec, self.tensor_positions, self.tensors)


class SlotMessage(NamedTuple):
    """What the consumer needs to rebuild the batch written into a slot."""
    slot: int
    rows: Tuple[Optional[int], ...]
    other_leaves: Dict[int, Any]
    new_layout: Optional[LayoutMessage]


class SlotWriter:
    """Worker side: copies batches into the shared tensors of the slots."""

    def __init__(self, num_slots: int) -> None:
        self._layouts: List[Optional[SlotLayout]] = [None] * num_slots

    def write(self, slot: int, batch: Any) -> SlotMessage:
        """Copy ``batch`` into ``slot`` and describe it for the consumer."""
        leaves, spec = tree_flatten(batch)
        positions = tuple(index for index, leaf in enumerate(leaves)
                          if isinstance(leaf, torch.Tensor))
        tensors = [leaves[index] for index in positions]
        new_layout = None
        layout = self._layouts[slot]
        if layout is None or not _fits(layout, spec, positions, tensors):
            layout = SlotLayout(spec, positions,
                                tuple(_shared_like(t) for t in tensors))
            self._layouts[slot] = layout
            new_layout = layout.to_message()
        with torch.no_grad():
            for destination, source in zip(layout.tensors, tensors):
                _rows_of(destination, source).copy_(source)
        others = {index: leaf for index, leaf in enumerate(leaves)
                  if index not in positions}
        rows = tuple(t.shape[0] if t.dim() else None for t in tensors)
        return SlotMessage(slot, rows, others, new_layout)


class SlotReader:
    """Consumer side: rebuilds batches as views of the slots' tensors."""

    def __init__(self, num_slots: int) -> None:
        self._layouts: List[Optional[SlotLayout]] = [None] * num_slots

    def note_layout(self, message: SlotMessage) -> None:
        """Record the slot layout a message brings, if any. Needed even
        for a batch that is discarded: later messages rely on it."""
        if message.new_layout is not None:
            self._layouts[message.slot] = message.new_layout.to_layout()

    def read(self, message: SlotMessage) -> Any:
        """The batch described by ``message``, sharing the slot's memory."""
        self.note_layout(message)
        layout = self._layouts[message.slot]
        leaves: List[Any] = [None] * layout.spec.num_leaves
        for position, tensor, rows in zip(layout.tensor_positions,
                                          layout.tensors, message.rows):
            leaves[position] = (tensor.detach() if rows is None else
                                tensor.narrow(0, 0, rows))
        for position, leaf in message.other_leaves.items():
            leaves[position] = leaf
        return tree_unflatten(leaves, layout.spec)


def _fits(layout: SlotLayout, spec: TreeSpec, positions: Tuple[int, ...],
          tensors: List[torch.Tensor]) -> bool:
    if layout.spec != spec or layout.tensor_positions != positions:
        return False
    return all(_tensor_fits(slot, tensor)
               for slot, tensor in zip(layout.tensors, tensors))


def _tensor_fits(slot: torch.Tensor, tensor: torch.Tensor) -> bool:
    if slot.dtype != tensor.dtype or slot.dim() != tensor.dim():
        return False
    if tensor.dim() == 0:
        return True
    return (slot.shape[1:] == tensor.shape[1:]
            and tensor.shape[0] <= slot.shape[0])


def _shared_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()


def _rows_of(slot: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    return slot if tensor.dim() == 0 else slot.narrow(0, 0, tensor.shape[0])
