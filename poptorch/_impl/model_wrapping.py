"""The model wrapping functions of API reference 11.4."""
from typing import Optional, Union

import torch

from .._version import __version__
from .executor import PoplarExecutor
from .optimizers.plan import default_optimizer


def _options_or_default(options):
    from ..options import Options
    return Options() if options is None else options


def _user_module(model: Union[torch.nn.Module, PoplarExecutor]
                 ) -> torch.nn.Module:
    """The module to wrap: ``model``, or the module a wrapped model
    wraps (PopTorch's guide creates a validation model from a loaded
    training model this way)."""
    return model.model if isinstance(model, PoplarExecutor) else model


def trainingModel(model: Union[torch.nn.Module, PoplarExecutor],
                  options=None,
                  optimizer: Optional[torch.optim.Optimizer] = None
                  ) -> PoplarExecutor:
    """Wrap ``model`` for training: each call runs forward, the backward pass
    from the loss computed in ``forward`` and the optimizer update, for every
    micro-batch of the call. Without an optimizer, SGD with lr 0.01 is used
    (over one param group, empty for a model without parameters, which
    trains nothing). A wrapped model given as ``model`` stands for the
    module it wraps.
    """
    model = _user_module(model)
    if optimizer is None:
        optimizer = default_optimizer([{"params": list(model.parameters())}])
    return PoplarExecutor(model, _options_or_default(options), training=True,
                          poptorch_version=__version__, optimizer=optimizer,
                          user_model=model)


def inferenceModel(model: Union[torch.nn.Module, PoplarExecutor],
                   options=None) -> PoplarExecutor:
    """Wrap ``model`` for inference: each call runs the forward pass for
    every micro-batch of the call, in the modes (``training`` flags) of
    PopTorch's shallow copy of the module: the module's own flag as it was
    when wrapped, its sub-modules' as they are when the model compiles
    (``docs/semantics.md``).

    A wrapped model given as ``model`` stands for the module it wraps: the
    new model shares its weights, and takes the modes the module has at
    its first call, so that the guide's validation model,
    ``poptorch.inferenceModel(training_model)`` followed by
    ``validation_model.model.eval()``, runs in evaluation mode."""
    module = _user_module(model)
    return PoplarExecutor(module, _options_or_default(options),
                          training=False, poptorch_version=__version__,
                          user_model=module,
                          modes_at_first_call=module is not model)
