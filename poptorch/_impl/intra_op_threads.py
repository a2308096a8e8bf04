"""The process's intra-op threads (``torch.set_num_threads``) and those
lent for a while: an ``auto`` model lends one to its background
compilation's worker, and its probe runs calls on one fewer
(``tiering/``). What is made for the threads the process runs with (the
CPU kernels Inductor generates, and the executable cache keys that name
them) counts the lent ones too, so that it does not depend on when it was
made."""
import torch


class _Lent:
    threads = 0


def own_threads() -> int:
    """The intra-op threads, with those lent."""
    return torch.get_num_threads() + _Lent.threads


def lend_one() -> bool:
    """Run on one intra-op thread fewer, if more than one is left; whether
    one was lent."""
    threads = torch.get_num_threads()
    if threads < 2:
        return False
    torch.set_num_threads(threads - 1)
    _Lent.threads += 1
    return True


def give_back_one() -> None:
    """Run on one more intra-op thread (one that ``lend_one`` lent)."""
    _Lent.threads -= 1
    torch.set_num_threads(torch.get_num_threads() + 1)
