"""One table from exceptions to what the user sees and the exit code.

Commands raise typed exceptions (``ardiff_cli.runtime.errors`` plus the two
rollout outcomes below) and never call ``sys.exit`` themselves.
:func:`handle_errors` turns each into ``Error: what happened`` and ``hint: how
to fix it`` on stderr and the exit code. Tracebacks appear only with
``--verbose``; an exception that is not in the table is a bug, so its
traceback is always shown.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import typer

from ardiff_cli.output import Output
from ardiff_cli.runtime.errors import ArdiffError, CapacityError, CheckpointError, ConfigError, ObservationError

EXIT_OK = 0
EXIT_BUG = 1
EXIT_USAGE = 2  # bad usage or invalid input (config, files)
EXIT_CAPACITY = 3  # one session of the configured model does not fit in memory
EXIT_PARTIAL = 4  # some episodes failed while others completed
EXIT_SIGINT = 130  # 128 + SIGINT
EXIT_SIGTERM = 143  # 128 + SIGTERM

EXIT_CODES_HELP = (
    "Exit codes: 0 success; 2 bad usage or invalid input (config, files); 3 the model does not fit in memory "
    "(one session); 4 some episodes failed while others completed; 130 interrupted (143 on SIGTERM)."
)


class EpisodesFailed(ArdiffError):
    """Some episodes failed while others completed (exit 4). Outputs of the others are complete."""

    exit_code = EXIT_PARTIAL


class Interrupted(ArdiffError):
    """SIGINT or SIGTERM arrived; the current write finished and outputs are consistent (exit 130/143)."""

    def __init__(self, signum: int, *, hint: str | None = None) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}", hint=hint)
        self.signum = signum
        self.exit_code = 128 + signum


@dataclass(frozen=True)
class ErrorRule:
    """How one exception class reaches the user."""

    exc_type: type[BaseException]
    exit_code: int | None  # None: the exception's own ``exit_code`` attribute
    label: str  # JSON "kind" of the error object
    hint: str | None = None  # used when the exception carries no hint of its own


# First match wins: subclasses before their bases.
ERROR_TABLE: tuple[ErrorRule, ...] = (
    ErrorRule(Interrupted, None, "interrupted", "run the same command with --resume to continue"),
    ErrorRule(EpisodesFailed, EXIT_PARTIAL, "episodes_failed", "fix the files named above and rerun with --resume"),
    ErrorRule(CapacityError, EXIT_CAPACITY, "capacity_error",
              "use a smaller dtype or window, a larger --memory-budget, or a device with more memory"),
    ErrorRule(ObservationError, EXIT_USAGE, "observation_error", "see the episode format: ardiff rollout --help"),
    ErrorRule(CheckpointError, EXIT_USAGE, "checkpoint_error"),
    ErrorRule(ConfigError, EXIT_USAGE, "config_error"),
    ErrorRule(ArdiffError, None, "error"),
)


def rule_for(exc: BaseException) -> ErrorRule | None:
    for rule in ERROR_TABLE:
        if isinstance(exc, rule.exc_type):
            return rule
    return None


def exit_code_for(exc: BaseException) -> int:
    rule = rule_for(exc)
    if rule is None:
        return EXIT_SIGINT if isinstance(exc, KeyboardInterrupt) else EXIT_BUG
    return rule.exit_code if rule.exit_code is not None else int(getattr(exc, "exit_code", EXIT_BUG))


def report(out: Output, exc: BaseException) -> int:
    """Tell the user about ``exc``; return the exit code."""
    code = exit_code_for(exc)
    rule = rule_for(exc)
    if rule is not None:
        hint = getattr(exc, "hint", None) or rule.hint
        if out.verbose:
            out.traceback(exc)
        out.error(str(exc), hint, exit_code=code, kind=rule.label)
    elif isinstance(exc, KeyboardInterrupt):
        out.error("interrupted", None, exit_code=code, kind="interrupted")
    else:
        out.traceback(exc)
        out.error(f"unexpected {type(exc).__name__}: {exc}",
                  "this is a bug in ardiff; please report it with the traceback above", exit_code=code, kind="bug")
    return code


@contextlib.contextmanager
def handle_errors(out: Output) -> Iterator[None]:
    """Wrap a command body: typed errors become messages and exit codes."""
    try:
        yield
    except (typer.Exit, typer.Abort, typer.BadParameter):
        raise
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the table decides; unknown ones are shown
        raise typer.Exit(report(out, exc)) from None
