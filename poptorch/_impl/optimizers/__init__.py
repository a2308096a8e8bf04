"""Optimizer updates as pure functions of tensors, for a traced training step.

* ``rule.py``: the ``UpdateRule`` interface (init_state / update /
  export_state) and shared tensor-list helpers, including ``clip_grad_norm``;
* ``sgd.py``, ``adam.py`` (Adam, AdamW), ``rmsprop.py``, ``lamb.py``: one
  rule per optimizer family;
* ``plan.py``: reads a torch.optim or poptorch.optim optimizer into an
  ``OptimizerPlan`` (groups, rules, hyper-parameter values, loss scaling,
  clipping, accumulation dtype, constant attributes);
* ``poptorch_optimizer.py``: what the poptorch.optim classes share
  (``VariableAttributes``, extra attributes, the host ``step``).

This package imports nothing from ``plan`` at import time, so that
``poptorch.optim`` can use the rules while ``plan`` reads ``poptorch.optim``.
"""
