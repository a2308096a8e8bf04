"""PopRun's own command-line options that ``poprun`` accepts beside its
layout options, so that PopRun command lines run unchanged.

Options about IPU-POD partitions (V-IPU), MPI and NUMA placement have no
equivalent here: they are taken off the command line before it is parsed
and each is reported once as having no effect. Options that take a value
accept ``--name value`` and ``--name=value``; yes/no options accept
``--name``, ``--name=value`` and ``--name value`` where the value is one of
``YES_NO_WORDS`` (any other next word may be the program, so it is not
taken). Scanning stops at the program: the first word that is neither an
option nor an option's value.

Options with an effect here are parsed with the others (``run.py``):
``--only-output-from-instance``, ``--executable-cache-path``,
``--print-topology`` and ``-v`` / ``--verbose``.
"""
from typing import Iterable, List, Tuple

#: The values of yes/no options: true, then false.
YES_WORDS = ("yes", "true", "on", "1")
NO_WORDS = ("no", "false", "off", "0")
YES_NO_WORDS = YES_WORDS + NO_WORDS

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


def split_ignored(argv: Iterable[str], takes_value: Iterable[str],
                  switches: Iterable[str]
                  ) -> Tuple[List[str], List[str], List[str]]:
    """(poprun's options, the program and its arguments, the names of the
    options of ``WITHOUT_EFFECT`` found and taken off). ``takes_value`` and
    ``switches``: poprun's own options that take a value and its yes/no
    options, needed to find where the program starts. A yes/no option is
    returned as ``--name=value`` (``--name=yes`` when given alone)."""
    own_values, own_switches = set(takes_value), set(switches)
    options: List[str] = []
    ignored: List[str] = []
    words = list(argv) + [""]
    index = 0
    while index < len(words) - 1:
        word, following = words[index], words[index + 1]
        name = word.split("=", 1)[0]
        if not word.startswith("-") or word == "--":
            return options, words[index:-1], ignored
        with_value = "=" in word
        if name in WITHOUT_EFFECT:
            ignored.append(name)
            consumes = not with_value and (
                WITHOUT_EFFECT[name] or _is_yes_no(following))
        elif name in own_switches:
            consumes = not with_value and _is_yes_no(following)
            options.append(word if with_value else
                           f"{name}={following if consumes else 'yes'}")
        else:
            consumes = name in own_values and not with_value and \
                index + 2 < len(words)
            options += [word, following] if consumes else [word]
        index += 2 if consumes else 1
    return options, [], ignored


def _is_yes_no(word: str) -> bool:
    return word.lower() in YES_NO_WORDS
