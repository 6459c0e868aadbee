"""Benchmarks of the runtime core. Run one with ``python -m benchmarks.<name> [--quick] [--json PATH]``."""

import signal
import sys

EARLY_STOP = "interrupted by SIGINT; no results were written"  # Ctrl-C before exit_on_signals took the signals
# every results file benchmarks.common.write_json wrote, in order: what a stop after the write must name (while the
# table prints: common.exit_on_signals; as the process exits, the signals given back: here, which said "no results
# were written" of a file in place)
WRITTEN: list = []


def _stopped_early(signum: int, frame: object) -> None:
    written = ", ".join(map(str, WRITTEN))
    print(f"interrupted by SIGINT; results were written to {written}" if written else EARLY_STOP, file=sys.stderr)
    sys.exit(130)


# `python -m benchmarks[.bench_<id>]` (Python names the module "-m" while it imports its package): Ctrl-C in the first
# second, as the module imports torch before its cli() took the signals, printed a KeyboardInterrupt traceback. A
# signal the process was started ignoring stays ignored; imported by anything else, the handler is left as it is.
if sys.argv[:1] == ["-m"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _stopped_early)
