"""PopRun's own command-line options that ``poprun`` accepts beside its
layout options, so that PopRun command lines run unchanged.

Options about IPU-POD partitions (V-IPU), MPI and NUMA placement have no
equivalent here: they are taken off the command line before it is parsed
and each is reported once as having no effect. Options that take a value
accept ``--name value`` and ``--name=value``; yes/no options accept
``--name`` and ``--name=value`` and never take the next word (it may be the
program). Scanning stops at the program: the first word that is neither an
option nor an option's value.

Options with an effect here are parsed with the others (``run.py``):
``--only-output-from-instance``, ``--executable-cache-path``,
``--print-topology`` and ``-v`` / ``--verbose``.
"""
from typing import Iterable, List, Tuple

#: PopRun options without effect here: name -> whether it takes a value.
WITHOUT_EFFECT = {
    "--vipu-server-host": True,
    "--vipu-server-port": True,
    "--vipu-server-timeout": True,
    "--vipu-partition": True,
    "--vipu-cluster": True,
    "--mpi-global-args": True,
    "--mpi-local-args": True,
    "--num-ilds": True,
    "--process-placement": True,
    "--reset-partition": False,
    "--update-partition": False,
    "--remove-partition": False,
    "--numa-aware": False,
    "--offline-mode": False,
}


def split_ignored(argv: Iterable[str], takes_value: Iterable[str]
                  ) -> Tuple[List[str], List[str], List[str]]:
    """(poprun's options, the program and its arguments, the names of the
    options of ``WITHOUT_EFFECT`` found and taken off). ``takes_value``:
    poprun's own options that take a value, needed to find where the
    program starts."""
    own_values = set(takes_value)
    options: List[str] = []
    ignored: List[str] = []
    words = list(argv)
    index = 0
    while index < len(words):
        word = words[index]
        name = word.split("=", 1)[0]
        if not word.startswith("-") or word == "--":
            return options, words[index:], ignored
        if name in WITHOUT_EFFECT:
            ignored.append(name)
            consumes = WITHOUT_EFFECT[name] and "=" not in word
            index += 2 if consumes else 1
            continue
        options.append(word)
        if name in own_values and "=" not in word and \
                index + 1 < len(words):
            options.append(words[index + 1])
            index += 1
        index += 1
    return options, [], ignored
