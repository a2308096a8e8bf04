"""Timing shared by the benchmarks."""
import statistics
import time
from typing import Callable, List, Sequence


def interleaved_medians(passes: Sequence[Callable[[], None]],
                        repeats: int) -> List[float]:
    """Median wall time of each pass, run alternately after one warm-up
    each, so that machine noise affects them alike."""
    for one_pass in passes:
        one_pass()
    times: List[List[float]] = [[] for _ in passes]
    for _ in range(repeats):
        for one_pass, record in zip(passes, times):
            start = time.perf_counter()
            one_pass()
            record.append(time.perf_counter() - start)
    return [statistics.median(record) for record in times]
