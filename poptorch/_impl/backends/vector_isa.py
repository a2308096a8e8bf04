"""Inductor's check of the CPU's vector instruction sets, remembered per
machine in the executable cache.

Before it builds or loads C++ kernels, Inductor checks in each new process
that the C++ compiler can build and load code for every vector instruction
set (AVX2, AVX-512, ...) that the CPU reports: it builds a probe library per
set and loads it in a new Python process, about 1.2 s on a 2-core machine,
a large part of loading an executable from the cache. The outcome depends
only on the machine: the CPU's instruction sets, the compiler and torch.

The executable cache directory keeps it in ``vector_isa.json``. A process
that finds there a record of its own machine, on which every set the CPU
reports passed, tells Inductor so (``config.cpp.vec_isa_ok``, only while
poptorch compiles or loads a step) instead of probing each set again
(measured: 1.17 s -> 0.23 s). Inductor still runs its own checks of
optional extensions (AVX-512 VNNI and BF16, AMX), whose outcome changes
the compiler flags. A process that probed records the outcome when every
set passed; when one failed nothing is recorded, and Inductor keeps
probing.
"""
import contextlib
import json
import os
import platform
import shutil
import sys
from typing import Dict, Iterator, Optional

import torch

from ..logger import logger

RECORD = "vector_isa.json"


def machine() -> Optional[Dict[str, object]]:
    """What the check's outcome depends on (None where Inductor does not
    probe: other than x86-64 Linux)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.cpu_vec_isa import x86_isa_checker
    compiler = shutil.which(get_cpp_compiler()) or get_cpp_compiler()
    status = os.stat(compiler) if os.path.exists(compiler) else None
    return {"torch": torch.__version__, "compiler": compiler,
            "compiler_file": (None if status is None
                              else [status.st_size, status.st_mtime_ns]),
            "cpu": sorted(x86_isa_checker())}


@contextlib.contextmanager
def remembered_check(directory: str) -> Iterator[None]:
    """Inside: Inductor trusts the CPU's instruction sets when
    ``directory`` records that they all passed on this machine. After: the
    outcome of a check this process ran is recorded there."""
    current = machine()
    path = os.path.join(directory, RECORD)
    if current is not None and _read(path) == current:
        from torch._inductor import config
        with config.patch({"cpp.vec_isa_ok": True}):
            yield
        return
    yield
    if current is not None and all_checks_passed(current):
        _write(path, current)


def all_checks_passed(current: Dict[str, object]) -> bool:
    """Whether this process checked the instruction sets and all those the
    CPU reports passed."""
    from torch._inductor import cpu_vec_isa
    if not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return False
    reported = {str(isa) for isa in cpu_vec_isa.supported_vec_isa_list
                if all(flag in current["cpu"] for flag in str(isa).split())}
    passed = {str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()}
    return bool(reported) and passed == reported


def _read(path: str) -> Optional[Dict[str, object]]:
    try:
        with open(path, encoding="utf-8") as stream:
            return json.load(stream)
    except (OSError, ValueError):
        return None


def _write(path: str, record: Dict[str, object]) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(temporary, "w", encoding="utf-8") as stream:
            json.dump(record, stream)
        os.replace(temporary, path)
    except OSError as error:
        logger.debug("Could not record the vector instruction set check in "
                     "%s: %s", path, error)
