"""Captured graphs and compiled models as files: the JSON graph format
(``graph_format``), the exported-file format behind ``compileAndExport`` /
``save`` / ``loadExecutable`` / ``poptorch.load`` (``export``)."""
