"""Data loading: ``poptorch.DataLoader`` and the
``AsynchronousDataAccessor`` that loads batches in a separate process."""
from .async_accessor import AsynchronousDataAccessor
from .dataloader import DataLoader

__all__ = ["AsynchronousDataAccessor", "DataLoader"]
