"""What holds while a model is traced with fake tensors (``capture.trace``).

* torch's fake tensors log an operation that fails on its inputs, with
  torch's traceback, before raising; the failure reaches the user as a
  ``poptorch.Error`` naming their source line (``compile_errors.py``), so
  that log is filtered out.
* ``torch.distributions`` checks its parameters and samples by default with
  Python conditions on tensor values (``if not valid.all(): raise``), which
  a graph of tensors without values cannot hold. Its default validation is
  off while tracing, as ``Distribution.set_default_validate_args(False)``
  sets it; a distribution created with ``validate_args=True`` still
  validates and fails with a hint (``compile_errors.py``).
"""
import contextlib
import logging
from typing import Iterator

from torch.distributions import Distribution

_FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"


class _MetaFailureFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(
            "failed while attempting to run meta")


@contextlib.contextmanager
def fake_tracing() -> Iterator[None]:
    """The context of one trace with fake tensors."""
    fake_tensor_log = logging.getLogger(_FAKE_TENSOR_LOG)
    meta_failures = _MetaFailureFilter()
    fake_tensor_log.addFilter(meta_failures)
    validate = Distribution._validate_args
    Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        Distribution.set_default_validate_args(validate)
        fake_tensor_log.removeFilter(meta_failures)
