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
* Parts of the model compiled with ``torch.compile`` run as they were
  written (dynamo's ``error_on_nested_fx_trace`` off: a compiled function
  met while tracing is inlined); the capture traces them into the model's
  graph, which the backend compiles whole.
"""
import contextlib
import logging
import warnings
from typing import Iterator

import torch._dynamo
from torch.distributions import Distribution

_FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"
_COMPILED_PART_HOOKS = "Using `torch.compile\\(module\\)` when there are global hooks"


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
        with torch._dynamo.config.patch(error_on_nested_fx_trace=False), \
                warnings.catch_warnings():
            # Automatic casting's global module hooks fire twice for a
            # compiled part, which torch warns of; its scopes stay balanced.
            warnings.filterwarnings("ignore", message=_COMPILED_PART_HOOKS)
            yield
    finally:
        Distribution.set_default_validate_args(validate)
        fake_tensor_log.removeFilter(meta_failures)
