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
import warnings
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import typer

from ardiff_cli.entry import interrupted_message, signal_of
from ardiff_cli.output import Output, stdout_error
from ardiff_cli.runtime.capacity import CapacityPlan
from ardiff_cli.runtime.kv.allocator import KVCacheExhaustedError
from ardiff_cli.runtime.errors import (
    SESSION_NOTES,
    ArdiffError,
    ArdiffWarning,
    CapacityError,
    CheckpointError,
    ConfigError,
    ObservationError,
    PipelineError,
    ResumeCommand,
    StopRequested,
    WriteHint,
    file_size_hint,
    file_too_large,
    is_out_of_memory,
    out_of_memory_message,
    process_limit,
    too_many_open_files,
    unmappable_library,
)

EXIT_BUG = 1
EXIT_USAGE = 2  # bad usage or invalid input (config, files)
EXIT_CAPACITY = 3  # one session of the configured model does not fit in memory
EXIT_PARTIAL = 4  # some episodes failed while others completed
EXIT_SIGINT = 130  # 128 + SIGINT
EXIT_SIGPIPE = 141  # 128 + SIGPIPE: stdout's reader went away (a command that stops at a safe point)


def write_hint(resume: ResumeCommand | str = "ardiff rollout --resume --out OUT") -> WriteHint:
    """A step's outputs or the run's own files that could not be written (one hint for both: they had two wordings).
    ``resume``: the run's own resume command (``ResumeCommand``) to paste; ``OUT`` only where no run is known."""
    return WriteHint("check free space and permissions of the output folder", f"continue with: {resume}")


WRITE_HINT = write_hint()

# What each exit code means, as the help says it; the codes of the other signals are said with 130's
_EXIT_CODE_MEANINGS = {
    0: "success",
    EXIT_BUG: "an unexpected error (in the pipeline, ardiff or writing outputs)",
    EXIT_USAGE: "bad usage or invalid input (config, files)",
    EXIT_CAPACITY: "out of memory (the model or its sessions do not fit)",
    EXIT_PARTIAL: "some episodes failed while others completed",
}
_SIGNAL_EXIT_MEANINGS = {143: "on SIGTERM", 129: "on SIGHUP", EXIT_SIGPIPE: "when the reader of stdout went away"}
# Every code a command may return; the codes of a signal are 128 + its number. Each command's help lists those it can
# return (4 only where episodes run; 141 only where a reader of stdout that went away stops the command)
EVERY_EXIT_CODE = frozenset({*_EXIT_CODE_MEANINGS, EXIT_SIGINT, *_SIGNAL_EXIT_MEANINGS})


def exit_codes_help(codes: Collection[int] = EVERY_EXIT_CODE) -> str:
    """The help's paragraph of exit codes, of ``codes`` (those one command can return; 130 is in every one's)."""
    assert EXIT_SIGINT in codes and set(codes) <= EVERY_EXIT_CODE, f"exit codes {sorted(codes)} cannot be explained"
    signals = ", ".join(f"{code} {meaning}" for code, meaning in _SIGNAL_EXIT_MEANINGS.items() if code in codes)
    return ("Exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in _EXIT_CODE_MEANINGS.items()
                                       if code in codes)
            + f"; {EXIT_SIGINT} interrupted ({signals}).")


class EpisodesFailed(ArdiffError):
    """Some episodes failed while others completed (exit 4). Outputs of the others are complete.

    With ``exit_code`` it also reports a run in which every episode failed (the code of their errors).
    """

    exit_code = EXIT_PARTIAL

    def __init__(self, message: str, *, exit_code: int = EXIT_PARTIAL) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StepFailed(ArdiffError):
    """A step failed in the model or while writing its outputs; the episode's session was released.

    ``phase`` says where: ``load`` (reading the step file), ``replay`` (rerunning
    the earlier step ``replayed`` to rebuild an evicted session), ``forward`` (the
    model) or ``write`` (its output file). The cause is chained (``__cause__``), and its notes are this error's.
    ``budget`` (what set the memory budget) and ``plan`` (the run's ``CapacityPlan``)
    word the hint of memory running out (``lighter_resume_hint``). ``resume``: the run's resume command; of a step
    that ran out of memory, ``self.resume`` is the one to paste after it (``lighter_resume``), which the run's closing
    hint gives too; else None.
    """

    PHASES = {
        "load": "while reading {path}",
        "replay": "while replaying its earlier step {replayed} to rebuild the session",
        "forward": "in the model's forward",
        "write": "while writing its outputs",
    }

    def __init__(self, episode: str, step: int, phase: str, cause: BaseException, *, path: str = "",
                 replayed: int | None = None, budget: str | None = None, plan: CapacityPlan | None = None,
                 resume: ResumeCommand | None = None) -> None:
        detail = (str(cause) if isinstance(cause, ArdiffError)
                  else out_of_memory_message(cause) or f"{type(cause).__name__}: {cause}")
        where = self.PHASES[phase].format(path=path, replayed=replayed)
        super().__init__(f"episode {episode!r} failed at step {step} {where}: {detail}",
                         hint=_step_hint(phase, cause, budget, plan, resume))
        self.episode = episode  # the episode (= session id)
        self.step = step  # the step being run when it failed (in phase replay, the one whose session was rebuilt)
        self.replayed = replayed  # in phase replay: the earlier step being replayed
        self.phase = phase  # load, replay, forward or write
        self.cause = cause
        # ardiff's own errors say their code; another's exit_code attribute (click's Exit: 0) is not ardiff's to take
        self.exit_code = (EXIT_CAPACITY if is_out_of_memory(cause)
                          else cause.exit_code if isinstance(cause, ArdiffError) else EXIT_BUG)
        self.resume = _memory_resume(phase, cause, plan, resume)
        carry_notes(self, cause)  # what else went wrong (a close hook that failed too): its Error line's note: lines


def pages_short(exc: BaseException | None) -> bool:
    """Whether ``exc`` is the KV page pool running short of pages the capacity plan reserved (a
    ``KVCacheExhaustedError`` from pages alone), not memory running out as a cache was copied (one caused by torch's
    ``OutOfMemoryError``)."""
    while isinstance(exc, KVCacheExhaustedError):
        exc = exc.__cause__
        if exc is None:
            return True
    return False


# A page shortage in a rollout's warmup (``pages_short``): the warmup session had the pool to itself, so the plan (or
# the pipeline's KV spec) undercounts a session's pages; no memory option or dtype is the fix, and once run.json is
# written only --resume goes on, the warmup skipped
WARMUP_PAGES_HINT = ("the KV page pool, sized by the capacity plan, ran short in the pipeline's warmup requests: the "
                     "pipeline's KV spec or ardiff's plan undercounts their pages (report it, with the --verbose "
                     "traceback), which no memory option or dtype changes; go on without the warmup (a step that runs "
                     "short then fails its own episode, and the others go on)")


def lighter_resume_hint(budget: str | None, plan: CapacityPlan | None = None, aside: str = "") -> str:
    """What to change when memory ran out once a run was written (``run.json``): only ``--resume`` goes on, and it
    keeps the run's dtype and config, so the KV pools (allocated at load) are what a resume can make smaller, where
    they can be. ``budget``: what set the memory budget (``budget_change``'s ``source``; None: the free memory);
    ``plan``: the run's ``CapacityPlan`` (None: not known, as when its pools failed to allocate)."""
    keeps = "--resume keeps the run's dtype and config, so a smaller dtype or model is a new run (another --out)"
    return _lighter_pool_hint(budget, plan, aside, resume=True, then=keeps)


def lighter_run_hint(budget: str | None, plan: CapacityPlan | None, dtype: str) -> str:
    """What to change when memory ran out in a command that keeps nothing (``ardiff warmup``): run it again with a
    smaller KV pool, where one can be, or with a smaller ``dtype`` (from float32) or model."""
    return _lighter_pool_hint(budget, plan, "", resume=False, then=f"or use {_smaller(dtype)}")


def weights_run_hint(dtype: str) -> str:
    """What to change when memory ran out as ``ardiff warmup`` or a new run (not ``--resume``) loaded the model's
    weights in ``dtype``: its KV pools, planned after them, are not there to make smaller."""
    return (f"the model, in {dtype}, needs more memory than is free now (its KV pools come after its weights): free "
            f"some (another process using it?) and run again, or use {_smaller(dtype)}")


def while_importing(exc: BaseException) -> bool:
    """Whether memory ran out as torch or a pipeline's module imported (``running_out_of_memory_names``): before the
    model's weights and its KV pools, so no smaller dtype, model, budget or session capacity helps there."""
    return str(getattr(exc, "ardiff_while", "")).startswith("importing ")


def import_hint(then: str = "run again") -> str:
    """What to do when memory ran out as torch or a pipeline's module imported (``while_importing``)."""
    return f"free some memory (another process using it?) and {then}: it ran out before the model began to load"


def lighter_resume(resume: ResumeCommand, plan: CapacityPlan | None) -> str | None:
    """``resume`` carrying what the hint of memory running out asks for, to paste: one session fewer than ``plan``
    keeps (``--session-capacity``, in place of one given), which shrinks the KV pool whatever limits it now; as it is
    where the pool holds one session (free memory is the change there). None: the plan is not known."""
    if plan is None:
        return None
    return resume.command(plan.session_capacity - 1 if plan.session_capacity > 1 else None)


PASTE = "; to paste: "


def to_paste(hint: str, command: ResumeCommand | str | None) -> str:
    """``hint``, ending with the ``command`` that does what it says (none: ``hint`` as it is). What is added to the
    hint later (``out_of_memory_hint``) goes before the command, which stays whole at the end."""
    return hint if command is None else f"{hint}{PASTE}{command}"


def continue_with(resume: ResumeCommand | None) -> str:
    """How a hint says to go on with the run: its resume command to paste (``ResumeCommand``), where it is known."""
    return "continue with --resume" if resume is None else f"continue with: {resume}"


def _memory_resume(phase: str, cause: BaseException, plan: CapacityPlan | None,
                   resume: ResumeCommand | None) -> str | None:
    """The resume to paste after a step that ran out of memory (``lighter_resume``); None for any other failure."""
    if resume is None or phase == "write" or too_many_open_files(cause) or pages_short(cause):
        return None
    return lighter_resume(resume, plan) if is_out_of_memory(cause) else None


def _smaller(dtype: str) -> str:
    """A smaller dtype (bfloat16, from float32: float16 and bfloat16 take as much) or model than ``dtype``'s."""
    return "--dtype bfloat16 or a smaller model" if dtype == "float32" else "a smaller model"


def _lighter_pool_hint(budget: str | None, plan: CapacityPlan | None, aside: str, *, resume: bool, then: str) -> str:
    """The KV pool changes that leave the model's activations more memory, by ``plan``'s facts: the sessions it holds,
    and whether the session capacity, not the budget, limits them; to go on with ``--resume`` (``resume``) or by
    running the command again. ``then``: what else can help, after them."""
    go_on, join = ("continue with --resume", "and") if resume else ("run again", "with")
    if plan is not None and plan.session_capacity == 1:  # no lower --session-capacity; a smaller budget holds one
        return (f"the KV pool holds one session, the least a plan keeps, and it does not fit with the model's "
                f"activations{aside}: free memory on the device (another process using it?) and {go_on}; {then}")
    if plan is not None and plan.bound_limits:  # a smaller budget holds as many sessions: the pool stays
        return (f"{go_on} {join} a --session-capacity below {plan.session_capacity} (it, not the budget, limits the "
                f"KV pool): a smaller KV pool leaves more memory to the model's activations{aside}; {then}")
    pool = ("--gpu-memory-fraction (the share of the free memory the KV pools take)" if budget is None
            else budget_change(budget, "smaller", resume=resume))
    return (f"{go_on} {join} a lower --session-capacity or {pool}: a smaller KV pool leaves more memory to the model's "
            f"activations{aside}; {then}")


def _step_hint(phase: str, cause: BaseException, budget: str | None, plan: CapacityPlan | None = None,
               resume: ResumeCommand | None = None) -> str:
    """``budget``: what set the KV memory budget (``budget_change``'s ``source``; None: the free memory); ``plan``:
    the run's ``CapacityPlan`` (None: not known); ``resume``: the run's resume command (None: not known)."""
    if too_many_open_files(cause):  # the environment's limit, in any phase: not the disk's, the file's or the model's
        return open_files_hint(continue_with(resume))
    if phase == "write":
        return WRITE_HINT if resume is None else write_hint(resume)
    if pages_short(cause):
        return ("the KV page pool, sized by the capacity plan for every resident session, ran short: the pipeline's "
                "KV spec or ardiff's plan undercounts this step's pages (report it, with the --verbose traceback); the "
                f"other sessions were untouched; {continue_with(resume)}")
    if is_out_of_memory(cause):
        return to_paste(out_of_memory_hint(lighter_resume_hint(budget, plan, " (the other sessions were untouched)")),
                        _memory_resume(phase, cause, plan, resume))
    if isinstance(cause, ArdiffError) and cause.hint:
        return cause.hint
    return ("the episode's session was released; the traceback is in results.jsonl (and printed with --verbose); "
            f"fix the pipeline, then {continue_with(resume)}")


class OutputError(ArdiffError):
    """The run's own files (results.jsonl, run.json, summary.json) or standard output could not be written: the
    command stops (exit 1)."""

    exit_code = EXIT_BUG


class Interrupted(StopRequested):
    """SIGINT, SIGTERM or SIGHUP arrived (or stdout's reader went away: SIGPIPE); the current write finished and
    outputs are consistent (exit 128 + the signal number: 130, 143, 129, 141)."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}")
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
    ErrorRule(EpisodesFailed, None, "episodes_failed", "fix what is named above and rerun with --resume"),
    ErrorRule(StepFailed, None, "step_failed"),
    ErrorRule(OutputError, None, "output_error", WRITE_HINT),
    ErrorRule(CapacityError, EXIT_CAPACITY, "capacity_error",
              "use a smaller dtype or window, a larger --memory-budget, or a device with more memory"),
    ErrorRule(ObservationError, EXIT_USAGE, "observation_error", "see the episode format: ardiff rollout --help"),
    ErrorRule(CheckpointError, EXIT_USAGE, "checkpoint_error"),
    ErrorRule(ConfigError, EXIT_USAGE, "config_error"),
    ErrorRule(PipelineError, None, "pipeline_error"),
    ErrorRule(ArdiffError, None, "error"),
    # Not ardiff's own: the KV page pool (KVCacheExhaustedError), host memory, torch's OutOfMemoryError, or its
    # CPU allocator's RuntimeError (is_out_of_memory).
    ErrorRule(MemoryError, EXIT_CAPACITY, "out_of_memory",
              "lower --memory-budget, --session-capacity or --gpu-memory-fraction, or use --dtype bfloat16 or a "
              "smaller model"),
)
_OUT_OF_MEMORY = ERROR_TABLE[-1]
# Not in the table, which goes by class: an OSError EMFILE or ENFILE, or an error saying so (too_many_open_files)
_TOO_MANY_OPEN_FILES = ErrorRule(OSError, EXIT_BUG, "too_many_open_files")


def out_of_memory_hint(hint: str) -> str:
    """``hint``, and under an address-space limit (``ulimit -v``), which memory it was that ran out: before the
    command to paste that the hint ends with (``to_paste``), which stays its end."""
    limit = process_limit("AS")
    if limit is None:
        return hint
    hint, paste, command = hint.partition(PASTE)
    return f"{hint}; or raise this process's address-space limit (now ulimit -v {limit // 1024}){paste}{command}"


def budget_change(source: str, size: str, *, resume: bool = False) -> str:
    """A ``size`` ("larger" or "smaller") memory budget, as every hint that names one words it: by what set the
    budget now, ``source`` as ``commands._common.budget_source`` gives it (``--memory-budget``,
    ``runtime.memory_budget``) or a resumed run's ``OUT/run.json``, and the option that changes it. For a
    ``resume`` (one hinted at, or this one), the option alone: a resume refuses the config edited since the run."""
    if source == "--memory-budget":
        return f"a {size} --memory-budget"
    if source == "runtime.memory_budget" and resume:
        return f"a {size} --memory-budget (the config's runtime.memory_budget set it)"
    if source == "runtime.memory_budget":
        return f"a {size} budget (the config's runtime.memory_budget set it; --memory-budget replaces it)"
    return (f"a {size} --memory-budget (the memory_budget recorded in {source} set it; one given replaces it for that "
            "resume only)")


def open_files_hint(then: str = "run again") -> str:
    """What to do when the limit on open files was reached: it was called the pipeline's failure, to be reported."""
    limit = process_limit("NOFILE")
    now = "" if limit is None else f" (now ulimit -n {limit})"
    return (f"this process reached its limit on open files{now}, or the system its own: raise it (ulimit -n 1024, "
            f"say) and {then}")


def rule_for(exc: BaseException) -> ErrorRule | None:
    if isinstance(exc, StepFailed) and too_many_open_files(exc.cause):  # as the limit reached anywhere else
        return _TOO_MANY_OPEN_FILES
    for rule in ERROR_TABLE:
        if isinstance(exc, rule.exc_type):
            return rule
    if is_out_of_memory(exc):
        return _OUT_OF_MEMORY
    return _TOO_MANY_OPEN_FILES if too_many_open_files(exc) else None


def exit_code_for(exc: BaseException) -> int:
    rule = rule_for(exc)
    if rule is None:
        return 128 + signal_of(exc) if isinstance(exc, KeyboardInterrupt) else EXIT_BUG
    return rule.exit_code if rule.exit_code is not None else int(getattr(exc, "exit_code", EXIT_BUG))


def report(out: Output, exc: BaseException) -> int:
    """Tell the user about ``exc``; return the exit code."""
    code = exit_code_for(exc)
    rule = rule_for(exc)
    if rule is not None:
        hint = getattr(exc, "hint", None) or rule.hint
        # a bare MemoryError() (Python's own allocator) has no message: its name says what happened
        message = str(exc) or type(exc).__name__
        library = unmappable_library(exc)
        if library is not None:  # no room left to load torch: no session to lower, the limit is the cause
            message = f"cannot load a library: {library}"
            hint = (f"this process's address-space limit (now ulimit -v {process_limit('AS') // 1024}) leaves no "
                    "room to load torch: raise it, or run with ulimit -v unlimited")
        elif rule is _OUT_OF_MEMORY:
            message = out_of_memory_message(exc) or message
            if not getattr(exc, "hint", None) and while_importing(exc):  # the table's options cannot help there
                hint = import_hint()
            hint = out_of_memory_hint(hint)
        elif rule is _TOO_MANY_OPEN_FILES and not getattr(exc, "hint", None):  # a step's, a run's: to --resume
            hint = open_files_hint()
        elif hint and file_too_large(exc):
            hint = file_size_hint(hint)
        if out.verbose:
            out.traceback(exc)
            for line in getattr(exc, "details", ()):  # what the message left out (a checkpoint's every key)
                out.debug(line)
        out.error(message, hint, exit_code=code, kind=rule.label, notes=reported_notes(exc))
    elif isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or SIGTERM or SIGHUP before a command took them (entry.Stopped)
        out.error(interrupted_message(signal_of(exc)), None, exit_code=code, kind="interrupted")
    else:
        out.traceback(exc)
        out.error(f"unexpected {type(exc).__name__}: {exc}",
                  "this is a bug in ardiff; please report it with the traceback above", exit_code=code, kind="bug",
                  notes=reported_notes(exc))
    return code


def carry_notes(error: BaseException, cause: BaseException) -> None:
    """Give ``error``, raised in place of ``cause``, the notes of ``cause`` (``reported_notes``), after its own: the
    Error line and the JSON a user reads are ``error``'s, and only the traceback (``--verbose``) showed those of
    ``cause``."""
    for note in reported_notes(cause):
        error.add_note(note)


def reported_notes(exc: BaseException) -> list[str]:
    """The notes of ``exc`` a user is shown: all but the runtime's on what became of the request's session
    (``SESSION_NOTES``: released, or as it was). A command's request has no next one in that session: a failed step's
    hint says what comes next for its episode, which does not go on, and a stop's notice that the episode replays on
    --resume (they said its next request starts afresh)."""
    return [note for note in notes_of(exc) if not note.endswith(SESSION_NOTES)]


def notes_of(exc: BaseException) -> list[str]:
    """The notes of ``exc`` (PEP 678's ``__notes__``, ``add_note``): what else went wrong as it was raised (a close
    hook that failed as the warmup then released its session), which the traceback alone showed. Each a string, as
    Python's traceback prints them: ``__notes__`` is a plain attribute that code may have set to anything."""
    notes = getattr(exc, "__notes__", None)
    if notes is None:
        return []
    if isinstance(notes, (list, tuple)):
        return [note if isinstance(note, str) else repr(note) for note in notes]
    return [repr(notes)]


@contextlib.contextmanager
def handle_errors(out: Output) -> Iterator[None]:
    """Wrap a command body: typed errors become messages and exit codes, and warnings (the runtime's
    ``ArdiffWarning`` and those Python's filters show: a pipeline's, torch's) become ``warning:`` lines of the output
    sink. A command stopped by a signal kept its signal handlers, which only record one now, through the report
    (``signals.give_back``)."""
    try:
        with _reporting(out):
            yield
    finally:
        from ardiff_cli import signals

        if signals.give_back_after_command:
            signals.give_back()


@contextlib.contextmanager
def _reporting(out: Output) -> Iterator[None]:
    with warnings.catch_warnings():  # restores showwarning (and the filters) on the way out
        # The runtime's warnings are lines of this output, whatever PYTHONWARNINGS or -W say: `error` raised them
        # where they were issued, an eviction's included, and failed the episode as "in the model's forward".
        warnings.filterwarnings("default", category=ArdiffWarning)
        python_showwarning = warnings.showwarning

        # Every other warning that Python's filters let through (the user's -W and PYTHONWARNINGS decide, once per
        # place by default), from any thread: a pipeline's, torch's. A line of this output too, as Python's first
        # line writes it (where, and its category), so that a result's `warnings` lists it: on stderr only, a
        # script reading `--format json` never saw it.
        def showwarning(message, category, filename, lineno, file=None, line=None):
            if file is not None:  # written to a stream of the caller's choosing
                python_showwarning(message, category, filename, lineno, file, line)
            elif issubclass(category, ArdiffWarning):
                out.warning(str(message))
            else:
                out.warning(f"{filename}:{lineno}: {category.__name__}: {message}", held=True)

        warnings.showwarning = showwarning
        # A pipeline's print() was a line of `--format json`'s stdout. The error's report runs under the stand-in too:
        # a pipeline's thread still printing wrote to the real stdout meanwhile, before the error's JSON object.
        with out.chatter_to_stderr():
            try:
                yield
                lost = out.stdout_lost
                if lost is not None and not isinstance(lost, BrokenPipeError):  # `> file` on a full disk
                    raise stdout_error(lost)
            except (typer.Exit, typer.Abort, typer.BadParameter):
                raise
            except SystemExit as exc:  # ardiff's commands never exit so: code they call (a pipeline's) did
                error = PipelineError(f"the command was ended by SystemExit({exc.code!r}) from the code it ran: a "
                                      "pipeline (or a library it calls) called sys.exit() or exit()",
                                      hint="code that ardiff runs raises an exception to fail; --verbose prints "
                                      "where")
                error.__cause__ = exc  # --verbose: the traceback shows where it was called
                raise typer.Exit(report(out, error)) from None
            except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the table decides; unknown ones shown
                lost = out.stdout_lost
                if lost is not None and not isinstance(lost, BrokenPipeError) and exc.__cause__ is not lost:
                    out.warning(f"{stdout_error(lost)} either")  # the exit code is the other error's
                raise typer.Exit(report(out, exc)) from None
