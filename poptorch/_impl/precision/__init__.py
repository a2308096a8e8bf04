"""Precision while a model is captured: float16 / float32 casting of
operations that mix them (``half_casting.py``) and automatic mixed
precision (``automatic_casting.py``)."""
