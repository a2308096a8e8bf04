"""The model wrapping functions of API reference 11.4."""
from typing import Optional

import torch

from .._version import __version__
from .executor import PoplarExecutor
from .optimizers.plan import default_optimizer


def _options_or_default(options):
    from ..options import Options
    return Options() if options is None else options


def trainingModel(model: torch.nn.Module, options=None,
                  optimizer: Optional[torch.optim.Optimizer] = None
                  ) -> PoplarExecutor:
    """Wrap ``model`` for training: each call runs forward, the backward pass
    from the loss computed in ``forward`` and the optimizer update, for every
    micro-batch of the call. Without an optimizer, SGD with lr 0.01 is used
    (over one param group, empty for a model without parameters, which
    trains nothing).
    """
    if optimizer is None:
        optimizer = default_optimizer([{"params": list(model.parameters())}])
    return PoplarExecutor(model, _options_or_default(options), training=True,
                          poptorch_version=__version__, optimizer=optimizer,
                          user_model=model)


def inferenceModel(model: torch.nn.Module, options=None) -> PoplarExecutor:
    """Wrap ``model`` for inference: each call runs the forward pass for
    every micro-batch of the call."""
    return PoplarExecutor(model, _options_or_default(options), training=False,
                          poptorch_version=__version__, user_model=model)
