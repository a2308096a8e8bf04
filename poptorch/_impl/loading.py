"""``poptorch.load`` (API reference 11.4)."""
from typing import Callable, Optional

from .._version import __version__
from . import export


def load(filename: str,
         edit_opts_fn: Optional[Callable[..., None]] = None):
    """Load a PopTorch model from a file previously created using
    ``compileAndExport`` (or ``save``) with ``export_model=True``.

    ``edit_opts_fn(options)`` may change the runtime options before the
    model is restored (for example ``useIpuId`` or
    ``enableExecutableCaching``); options that change compilation keep the
    exported values, and the executable stays the exported one. The file
    holds a pickled model and compiled code: load only files you trust, as
    with ``torch.load``.
    """
    from .compiled_methods import load_exported
    from .executor import PoplarExecutor
    exported = export.read(str(filename), trusted=True)
    contents = exported.model()
    options = export.merge_load_options(contents["options"], edit_opts_fn,
                                        exported.manifest["backend"])
    module = contents["module"]
    executor = PoplarExecutor(module, options, exported.manifest["training"],
                              poptorch_version=__version__,
                              optimizer=contents["optimizer"],
                              user_model=module,
                              training_flags=contents.get("training_flags"))
    load_exported(executor, exported, with_optimizer=True)
    return executor
