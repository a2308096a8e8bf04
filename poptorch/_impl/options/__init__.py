"""The machinery behind ``poptorch.Options`` (``poptorch/options.py``
is the API): the effect of each option here (``effects.py``), argument
checks (``validation.py``), option groups (``groups.py``) and options
files and ``POPTORCH_DEFAULT_OPTIONS`` (``config_file.py``)."""
