"""``python -m poptorch.profiling DIR``: the summary of the profiling
reports in ``DIR`` (``poptorch/_impl/profiling/summary.py``)."""
import argparse
import sys

from .._impl.profiling import summary


def _arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m poptorch.profiling",
        description="Summarise the profiling reports (*.report.json) in a "
                    "directory, the processes of one model merged.")
    parser.add_argument("directory", help="the profiling directory")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(summary.main(_arguments().directory))
