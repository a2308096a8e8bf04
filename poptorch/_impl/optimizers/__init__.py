"""Optimizer updates as pure functions of tensors, for a traced training step.

* ``rule.py``: the ``UpdateRule`` interface (init_state / update /
  export_state) and shared tensor-list helpers, including ``clip_grad_norm``;
* ``sgd.py``, ``adam.py`` (Adam, AdamW), ``rmsprop.py``, ``lamb.py``: one
  rule per optimizer family;
* ``plan.py``: reads a torch.optim or poptorch.optim optimizer into an
  ``OptimizerPlan`` (groups, rules, hyper-parameter values, loss scaling,
  clipping, accumulation dtype, constant attributes);
* ``poptorch_optimizer.py``: what the poptorch.optim classes share
  (``VariableAttributes``, extra attributes, the host ``step``);
* ``gradient_reduction.py``: the gradient buffer of accumulated micro-batches
  (``accum_type``) and the mean reduction strategies;
* ``global_attributes.py``: loss scaling and clipping in the step, constant
  or runtime inputs; ``loss_scaling.py``: automatic loss scaling;
* ``optimizer_state.py``: a training model's optimizer state and the
  optimizer's ``state_dict()`` / ``load_state_dict()`` reading and writing
  it; ``state_location.py``: optimizer state in host memory between calls.

This package imports nothing from ``plan`` at import time, so that
``poptorch.optim`` can use the rules while ``plan`` reads ``poptorch.optim``.
"""
