"""The R replicas of one process: how they run (``replicas.py``: one
vectorised computation, or one after another), weights grouped over
replicas (``grouping.py``), and the operations that the vectorised path
runs per replica without vmap's batching rules (``batch_norm.py``,
``attention.py``; ``../replica_stacking.py`` puts their arguments'
replica dimension first)."""
