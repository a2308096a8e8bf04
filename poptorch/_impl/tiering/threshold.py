"""When an ``auto`` model tiers up (docs/compiled_execution.md, "Tiered
compilation"): after how many seconds of calls its steps are compiled by
Inductor in the background.

The background compilation costs the training loop what the loop loses
with one intra-op thread fewer: the process lends that thread to the
worker (``tier_up.py``). How much that is depends on the model: on two
cores the benchmark's MLP runs as fast on one thread as on two, while its
transformer and CNN lose a quarter to a third of their speed. So the
model measures it on its own calls: from its second call on, calls
alternate between all threads and one fewer until each side has
``PROBE_CALLS`` calls and the probe has lasted ``PROBE_SECONDS``. With
``loss`` the fraction by which the calls on one thread fewer were slower
(median against median), the model tiers up once it has spent

    max(MINIMUM_SECONDS, loss * EXPECTED_COMPILE_SECONDS)

seconds in calls. This is the ski-rental rule: a run waits until it has
paid in calls about what the compilation would cost it. A loop that loses
nothing compiles right after the probe; one that would lose a third of its
speed for the compilation's half minute waits about ten seconds, so that
short runs do not pay for a compilation they cannot repay.

The probe needs a thread to lend: a process with fewer intra-op threads
than cores (or a single one) lends none, and waits ``FALLBACK_SECONDS``.
``POPTORCH_TIER_UP_AFTER`` (seconds of calls, ``inf`` for never) replaces
the rule with a fixed threshold and no probe.
"""
import math
import os
import statistics
from typing import List, Optional

from ...errors import Error
from ..intra_op_threads import give_back_one, lend_one, own_threads
from ..logger import logger

TIER_UP_VARIABLE = "POPTORCH_TIER_UP_AFTER"
#: The shortest time in calls before a tier-up.
MINIMUM_SECONDS = 2.0
#: The probe's shortest length, in seconds of calls.
PROBE_SECONDS = 1.0
#: The background compilation's typical duration on one core (30-60 s
#: for the models of ``benchmarks/tiered_compilation.py``).
EXPECTED_COMPILE_SECONDS = 30.0
#: The threshold where no thread is lent (nothing to measure).
FALLBACK_SECONDS = 10.0
#: Calls on each side of the probe.
PROBE_CALLS = 3
#: The largest loss used, so that one slow outlier cannot postpone the
#: tier-up for minutes.
_LARGEST_LOSS = 2.0


class TierUpThreshold:
    """The seconds of calls after which a model tiers up: fixed, or
    decided by the probe of its first calls."""

    def __init__(self) -> None:
        self.seconds: Optional[float] = fixed_tier_up_seconds()
        self._probing = self.seconds is None and lends_a_thread()
        if self.seconds is None and not self._probing:
            self.seconds = FALLBACK_SECONDS
        self._calls = 0
        self._all: List[float] = []
        self._fewer: List[float] = []
        self._fewer_now = False

    def before_call(self) -> None:
        """During the probe, run every other call on one intra-op thread
        fewer."""
        if not self._probing or self._calls == 0:
            return
        self._fewer_now = (len(self._fewer) <= len(self._all)
                           and lend_one())

    def after_call(self, seconds: float, completed: bool) -> None:
        """A call of ``seconds`` ended: give back the thread it ran without
        and, if it ``completed``, record it; end the probe when it has
        enough calls."""
        fewer, self._fewer_now = self._fewer_now, False
        if fewer:
            give_back_one()
        self._calls += 1
        if not self._probing or self._calls == 1 or not completed:
            return
        (self._fewer if fewer else self._all).append(seconds)
        if (min(len(self._fewer), len(self._all)) >= PROBE_CALLS
                and sum(self._fewer) + sum(self._all) >= PROBE_SECONDS):
            self._end_probe()

    def reached(self, seconds_in_calls: float) -> bool:
        """Whether a model that has spent ``seconds_in_calls`` in calls
        tiers up now."""
        return self.seconds is not None and seconds_in_calls >= self.seconds

    def _end_probe(self) -> None:
        self._probing = False
        loss = statistics.median(self._fewer) / statistics.median(self._all)
        loss = min(max(loss - 1.0, 0.0), _LARGEST_LOSS)
        self.seconds = max(MINIMUM_SECONDS, loss * EXPECTED_COMPILE_SECONDS)
        logger.debug("Calls on one thread fewer were %.0f%% slower: the "
                     "model tiers up after %.1f s of calls", 100 * loss,
                     self.seconds)


def lends_a_thread() -> bool:
    """Whether the process gives its background compilation one of its
    intra-op threads: it has several, and as many as the cores."""
    threads = own_threads()
    return threads > 1 and threads >= (os.cpu_count() or 1)


def fixed_tier_up_seconds() -> Optional[float]:
    """``POPTORCH_TIER_UP_AFTER`` (seconds of calls, ``inf`` for never),
    else None (the probe decides)."""
    text = os.environ.get(TIER_UP_VARIABLE)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise Error(f"{TIER_UP_VARIABLE} must be a number of seconds >= 0 "
                    f"(or inf), got {text!r}")
    return value
