"""How a compiled model's calls run: the engine interface and its two
implementations, one file each (``engine.py``)."""
from .engine import CompileInputs, Engine, TrainingSetup
from .single_graph import SingleGraphEngine
from .staged import StagedEngine
