"""Models whose blocks form several stages (``docs/model_parallel.md``):
the execution strategies (``strategies.py``), their check against the
blocks met during capture (``model_parallel.py``), the forward graph cut
into stages (``partition.py``, ``stages.py``) and the schedules that run
them (``staged_execution.py``: ``pipeline.py`` for pipelined training,
``sequential_stages.py`` for the others)."""
