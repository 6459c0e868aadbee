"""``ardiff rollout``: stream episodes of observation files through persistent sessions."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ardiff_cli.commands._common import (
    beyond_device_hint,
    budget_source,
    check_working_folder,
    config_label,
    does_not_fit_hint,
    image_size,
    load_engine_config,
    options_given,
    refuse_contradictions,
    refuse_what_this_machine_lacks,
    stop_between_requests,
)
from ardiff_cli.commands.resume_checks import (
    RECORDED,
    build_changes,
    build_changes_warning,
    build_record,
    checkpoint_record,
    config_sha256,
    links_in,
    local_time,
    moved_name,
    recorded_backend_installed,
    recorded_folders_exist,
    recorded_pythonpath_found,
    recorded_setting,
    refuse_changed_checkpoint,
    refuse_other_watch,
    resume_config,
    same_as_recorded,
    same_backend,
    same_config,
    same_device,
    same_pipeline_option,
    watched_folders,
)
from ardiff_cli.entry import raise_dropped_stop, signal_of
from ardiff_cli.errors_cli import (WARMUP_PAGES_HINT, EpisodesFailed, Interrupted, budget_change,
                                  continue_with, exit_code_for, exit_codes_help, handle_errors, import_hint,
                                  lighter_resume, lighter_resume_hint, open_files_hint, pages_short, to_paste,
                                  weights_run_hint, while_importing)
from ardiff_cli.options import (
    ConfigArg,
    DeviceOpt,
    DtypeOpt,
    EpisodesArg,
    FLAG,
    FormatOpt,
    HelpOpt,
    AttentionBackendOpt,
    GpuMemoryFractionOpt,
    MemoryBudgetOpt,
    Order,
    OutOpt,
    PipelineOpt,
    QuietOpt,
    SessionCapacityOpt,
    VerboseOpt,
    check_swap_space,
    read_number,
)
from ardiff_cli.output import Format, Output, lost_stdout_stop, one_line, visible
from ardiff_cli.runtime.errors import (
    DIVERGED_IN_WARMUP,
    KV_POOLS_PHASE,
    WEIGHTS_PHASE,
    ArdiffError,
    BudgetBeyondDeviceError,
    CapacityError,
    ConfigError,
    NonFiniteWeightsError,
    ObservationError,
    PipelineError,
    ResumeCommand,
    WriteHint,
    as_typed,
    first_of,
    is_out_of_memory,
    link_to_nothing,
    link_to_nothing_on,
    not_a_folder,
    plural,
    quoted,
    running_out_of_memory_names,
    shell_word,
    too_many_open_files,
)

# Memory ran out as a resume loaded its model, before the KV pools (sized by the budget and session capacity), or
# one session of it does not fit the free memory a resume without a budget plans with
RESUME_LOAD_HINT = ("the run's model, in its dtype and config (--resume keeps them), needs more memory than is free "
                    "now: free some (another process using it?) and continue with --resume, or start a new run with "
                    "a smaller dtype or model (another --out)")
DEMO_SESSION_CAPACITY = 2  # the demo has 3 episodes: with 2 resident sessions, LRU eviction shows
DEFAULT_IDLE_TIMEOUT = 60.0  # --follow: seconds without a new step file before an episode ends

HELP = (
    "Run episodes of robot observations through the model, each episode one persistent session whose KV cache "
    "survives between steps, and write the actions and predicted latents of every step.\n\n"
    "With no arguments it runs the built-in DreamZero-style demo: three generated episodes and two resident "
    "sessions, so the live panels show admission, LRU eviction and restores from swap within seconds.\n\n"
    "An EPISODE is a folder of step files (step_000000.safetensors, step_000001.safetensors, ... or .npz) holding "
    "the pipeline's observation arrays, with the prompt in the safetensors metadata or in episode.yaml; an END "
    "file marks it complete for --follow. Write one from Python with ardiff_cli.io.write_episode."
)
FAILURES_HELP = (  # one paragraph: the help keeps an epilog's line breaks
    "A step that fails (an invalid file, an error in the model) fails its episode: the error names the episode, the "
    "step and the file, its session is released, and the other episodes go on (exit 4), unless --fail-fast; a disk "
    "that refuses the run's files (full, a quota, read-only) stops the run (exit 1). Nothing already written is "
    "lost: --resume continues after any failure or interruption."
)
EPILOG = f"""Examples (the first runs the demo):

  ardiff rollout

  ardiff rollout dreamzero-tiny data/pick_cube data/push_ball -o runs/eval1 --preview

  ardiff rollout my_config.yaml data/ --order sequential --format json > events.jsonl

  ardiff rollout dreamzero-tiny data/robot_a data/robot_b --follow --idle-timeout 30

  ardiff rollout --resume -o runs/eval1

  ardiff rollout my_config.yaml data/ --pipeline my_lab.models:MyPipeline

{FAILURES_HELP}

Outputs: OUT/results.jsonl (a line per step), OUT/summary.json, OUT/episodes/EPISODE/step_NNNNNN.safetensors and OUT/previews/EPISODE.png (--preview).

{exit_codes_help()}"""


@dataclass(frozen=True)
class _Prepared:
    cfg: Any  # EngineConfig with overrides
    episodes: list  # EpisodeSource
    out_dir: Path
    info: dict[str, Any]  # run.json content
    done: dict[str, dict[int, int | None]]  # resume: steps already written, each with its chunk when it ran
    digests: dict[str, dict[int, str]]  # resume: SHA-256 of each done step's file when it ran (where recorded)
    run: Any  # RunFolder of out_dir, locked against a second process until closed
    options: dict[str, Any]  # order, follow, idle_timeout, preview, swap_space: given, or recorded (--resume)
    recorded_device: str | None = None  # --resume: the device the run started on (checked before the model loads)
    recorded_backend: str | None = None  # --resume: the attention backend it ran (checked after the model loads)
    # what set the KV memory budget, for the hint when one session does not fit it: "--memory-budget" (given now),
    # "runtime.memory_budget" (the config's), or OUT/run.json's path (--resume: the budget it recorded); None: no
    # budget (the device's free memory, which the runtime's hint names)
    budget_source: str | None = None
    # the folders of episodes among the EPISODE arguments: with --follow, an episode folder a robot starts in one
    # joins the run
    watch: list[Path] = field(default_factory=list)
    # --resume: run.json with episodes.jsonl's lines, as under the lock (read once: O(episodes), 0.2 s at 10,000)
    recorded: dict[str, Any] | None = None
    # the run's resume command, which every hint to go on with it gives to paste: its folder, its --pipeline, and the
    # options given to this resume (they apply to it alone: run.json keeps the run's own); set once prepared
    resume: ResumeCommand | None = None


def _parse_idle_timeout(text: str) -> float:
    """``--idle-timeout``: a finite number of seconds, 0 or more. inf (or 1e400, past a float) loaded the model, then
    failed writing run.json (JSON has no infinity): a traceback, exit 1. A follower that never gives up waits a long
    time."""
    number, given = read_number(text), quoted(text, cut=True)
    forever = "to wait for days, give them: 604800 is a week"
    if number is not None and not number.is_finite():
        raise typer.BadParameter(f"expected a finite number of seconds, got {given}"
                                 + (f" ({forever})" if number.is_infinite() and not number.is_signed() else ""))
    if number is None or number < 0:
        raise typer.BadParameter(f"expected a number of seconds, 0 or more, got {given}")
    if math.isinf(float(number)):
        raise typer.BadParameter(f"expected a number of seconds, 0 or more, got {given}: too large to represent (a "
                                 f"float holds up to 1.8e308); {forever}")
    return abs(float(number))  # -0 is 0 (it was "--idle-timeout -0 s"); 1e-400 too, as a float reads it


def rollout(
    ctx: typer.Context,
    config: ConfigArg = None,
    episodes: EpisodesArg = None,
    out: OutOpt = None,
    order: Annotated[Optional[Order], typer.Option(
        "--order", metavar="round-robin|sequential", case_sensitive=False,
        help="round-robin: one step of each episode in turn (robots sharing a model); "
             "sequential: one episode after another. \\[default: round-robin; with --resume, the run's]",
        show_default=False)] = None,
    follow: Annotated[bool, typer.Option(
        "--follow", metavar=FLAG, help="Watch the episode folders for new step files and run each as it arrives, "
                                       "until the episode's END file or --idle-timeout; and a folder of episodes "
                                       "for episode folders started in it later.")] = False,
    idle_timeout: Annotated[Optional[float], typer.Option(
        "--idle-timeout", min=0, metavar="SECONDS", parser=_parse_idle_timeout,
        help=f"With --follow: end an episode after this long without a new step file or one still being "
             f"written, and a folder of episodes this long after its episodes ended without a new one. "
             f"\\[default: {DEFAULT_IDLE_TIMEOUT:g}]", show_default=False)] = None,
    fail_fast: Annotated[bool, typer.Option(
        "--fail-fast", metavar=FLAG,
        help="Stop at the first failed step (an invalid file: exit 2; an error in the model: 1, or 3 out of memory) "
             "instead of going on with the other episodes (exit 4).")] = False,
    resume: Annotated[bool, typer.Option(
        "--resume", metavar=FLAG,
        help="Continue the run in --out: steps with an ok line in its results.jsonl are not run again (a failed step "
             "runs again), and a partly done episode's session is restored from the swap snapshot the stopped run kept "
             "of it, or else rebuilt by replaying its earlier steps. --dtype and --pipeline are refused unless they "
             "match the run's (one started with --pipeline needs it again: run.json never names code to import), as "
             "are CONFIG, EPISODE, --device and --attention-backend; the run's other options apply unless given "
             "again.")] = False,
    preview: Annotated[bool, typer.Option(
        "--preview", metavar=FLAG,
        help="Write a PNG of each episode in OUT/previews: observed (top) versus predicted (bottom) frames.")] = False,
    swap_space: Annotated[Optional[str], typer.Option(
        "--swap-space", metavar="SIZE", callback=check_swap_space,
        help="Disk space (e.g. 2GiB) for snapshots of evicted sessions, in OUT/.swap while the run lasts: an "
             "evicted episode's next step restores its session instead of replaying its earlier steps. 0: always "
             "replay. \\[default: the KV budget, at most half the free space of the disk OUT/.swap is on]",
        show_default=False)] = None,
    warmup: Annotated[bool, typer.Option(
        "--warmup/--no-warmup", metavar=FLAG, show_default=False,
        help="Run the pipeline's warmup requests before the first step. \\[default: --warmup]")] = True,
    help_: HelpOpt = False,
    pipeline: PipelineOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    memory_budget: MemoryBudgetOpt = None,
    session_capacity: SessionCapacityOpt = None,
    gpu_memory_fraction: GpuMemoryFractionOpt = None,
    attention_backend: AttentionBackendOpt = None,
    format: FormatOpt = Format.auto,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Stream episodes through persistent sessions (help text: ``HELP``)."""
    # summary.json's wall_s is the whole run's: reading the config and episodes, importing torch and the pipeline
    # module (seconds, before the model loads) included, as `time` would measure it
    started = time.monotonic()
    output = Output.create(format, quiet=quiet, verbose=verbose and not quiet)  # both: refused
    with handle_errors(output):
        check_working_folder()
        # --resume: whether the run followed is in its run.json (checked again there)
        refuse_contradictions(quiet=quiet, verbose=verbose, follow=follow or resume, idle_timeout=idle_timeout)
        overrides = dict(device=device, dtype=dtype, memory_budget=memory_budget, session_capacity=session_capacity,
                         gpu_memory_fraction=gpu_memory_fraction, attention_backend=attention_backend)
        options = dict(order=order and order.value, follow=follow, idle_timeout=idle_timeout, preview=preview,
                       swap_space=_swap_space(swap_space))
        to_resume = _given_to_resume(overrides, options, swap_space)  # before run.json's fill them in
        given = to_resume if resume else []
        # a resume stopped before _run takes the signals (entry.Stopped: reading run.json from a hung mount, say) gives
        # the resume to paste, as a later stop does: its --pipeline is the run's, or the resume is refused. So do its
        # refusals before it starts: the warmup is still ahead of the run, so given --no-warmup, that resume gives it
        # too (_before_warmup); OUT where no --out was given (refused below, with the resume of the run's folder given).
        # A new run whose CONFIG is a run's folder (`ardiff rollout runs/eval1 --no-warmup`) is hinted that run's
        # resume given them too (load_engine_config)
        capacity = session_capacity if resume else None
        asked = _before_warmup(ResumeCommand("OUT" if out is None else out, pipeline, tuple(to_resume),
                                             session_capacity), warmup)
        again = asked if resume and out is not None else None
        folder = None  # the resume's run folder: its stop gives `again` once run.json was found there
        if resume and out is None:
            _refuse_resume_without_out([config, *(episodes or [])], asked)
        from ardiff_cli.io.run import RunFolder, recorded_resume

        try:
            if again is not None:
                folder = RunFolder(out, asked=again)
            start = None if resume else _start_arguments(config, episodes, pipeline, overrides, options, swap_space,
                                                         warmup=warmup, fail_fast=fail_fast)
            prepared = _prepare(config, episodes, out, resume, overrides, output, pipeline=pipeline, options=options,
                                run=folder, again=again, start=start, typed=options_given(ctx), asked=asked)
            resume_command = ResumeCommand(prepared.out_dir, None, tuple(given), capacity)
            prepared = replace(prepared, resume=recorded_resume(resume_command, prepared.info))
            options = prepared.options
            try:
                _run(prepared, output, order=options["order"], follow=options["follow"],
                     idle_timeout=DEFAULT_IDLE_TIMEOUT if options["idle_timeout"] is None else options["idle_timeout"],
                     fail_fast=fail_fast, preview=options["preview"], warmup=warmup, resume=resume,
                     swap_space=options["swap_space"], started=started)
            finally:
                prepared.run.close()  # releases the folder's lock
        except KeyboardInterrupt as exc:
            if again is None or folder is None or not folder.found_run:  # no resume of nothing: a typo, an empty one
                raise
            stop = Interrupted(signal_of(exc))
            # run.json read: the run's --pipeline and the folders this resume found its module on, as a later stop's
            # resume carries them (run.json's, where it was not looked up yet: never here, see found_again); its warmup
            # is ahead, as for a stop as its model loads: given --no-warmup, `again` gives it too
            stop.hint = continue_with(again if folder.info_read is None else
                                      folder.found_again or recorded_resume(again, folder.info_read))
            raise stop from None


def _refuse_resume_without_out(arguments: list[Any], asked: ResumeCommand) -> None:
    """``--resume`` with no ``--out``: a usage error, whose hint gives the resume to paste where a CONFIG or EPISODE
    argument is a run's folder (`ardiff rollout --resume runs/eval1`), with the options given to this one
    (``asked``: the resume as given, its folder OUT)."""
    from ardiff_cli.io.episode import run_output

    hint = "the run printed it as 'outputs: DIR' (by default ardiff-runs/<start time>)"
    config, episodes = arguments[0], [Path(e) for e in arguments[1:]]
    for argument in arguments:
        # the others given fill in the rollout that starts a run with no run.json again: CONFIG is the first unless
        # that is the run's folder
        found = None if argument is None else run_output(Path(argument), episodes=episodes, asked=asked,
                                                          config=None if argument is config else config)
        if found is not None and found.why is not None:  # only its .lock: a resume of it is refused too
            hint = f"{as_typed(Path(argument))} is {found.what}; {found.restart}"
            break
        if found is not None:
            if isinstance(found.again, ResumeCommand):
                which = ("a run's folder: give it" if found.what == "an ardiff run folder"
                         else f"{found.what}: give its one run")
            else:  # a folder of several run folders: which of them to resume is the user's to say
                which = f"{found.what}: give one of its runs"
            hint = f"{as_typed(Path(argument))} is {which} as --out, not as CONFIG or EPISODE: {found.again}"
            break
    raise ConfigError("--resume needs --out DIR: the folder of the run to continue", hint=hint)


def _given_to_resume(overrides: dict[str, Any], options: dict[str, Any], swap_space: str | None) -> list[str]:
    """The options given to a resume that run.json does not keep (they are that resume's alone), as typed, but for
    --session-capacity (``ResumeCommand.session_capacity``): what the resume its hints give to paste is given again,
    else it went on with the run's own. --device, --dtype and --attention-backend are the run's own either way."""
    values = {"--memory-budget": overrides["memory_budget"], "--gpu-memory-fraction": overrides["gpu_memory_fraction"],
              "--swap-space": swap_space, "--order": options["order"], "--idle-timeout": options["idle_timeout"]}
    given = [word for flag, value in values.items() if value is not None for word in (flag, str(value))]
    return given + [flag for flag in ("--follow", "--preview") if options[flag[2:]]]


def _start_arguments(config: str | None, episodes: list[Path] | None, pipeline: str | None,
                     overrides: dict[str, Any], options: dict[str, Any], swap_space: str | None, *, warmup: bool,
                     fail_fast: bool) -> dict[str, Any]:
    """A new run's arguments as given, for the rollout that starts it again from any folder (the lock file records
    them: a run stopped while its model loads has no run.json): the config and episodes absolute (a built-in config
    by its name), the options that change the run; not --out (the folder it is found in), nor --format. With
    ``"pythonpath"``, the folders a ``--pipeline MODULE:CLASS`` module was found on, where another shell would not
    find it (:func:`_pipeline_path`)."""
    from ardiff_cli.io.run import absolute_path

    words = [] if config is None else [str(absolute_path(config)) if os.path.isfile(config) else config]
    words += [str(absolute_path(e)) for e in episodes or []]  # a link stays a link: --follow follows it
    words += [] if pipeline is None else ["--pipeline", pipeline]
    for key in ("device", "dtype", "session_capacity", "attention_backend"):  # those _given_to_resume leaves out
        if overrides[key] is not None:
            words += [f"--{key.replace('_', '-')}", str(getattr(overrides[key], "value", overrides[key]))]
    words += _given_to_resume(overrides, options, swap_space)
    words += ([] if warmup else ["--no-warmup"]) + (["--fail-fast"] if fail_fast else [])
    path = None if pipeline is None else _pipeline_path(pipeline)
    return {"start": words, **({} if path is None else {"pythonpath": path})}


def _pipeline_path(pipeline: str) -> list[str] | None:
    """The folders (PYTHONPATH's entries) under which a rollout pasted in another shell imports ``--pipeline
    MODULE:CLASS``'s module (its top package) as this one did, where it was found on a folder such a shell does not
    search: the working folder (``python -m ardiff_cli`` puts it first on sys.path) or a PYTHONPATH entry (another
    shell, root's, may not set it; a relative one is read against the working folder). It names each such folder this
    process searches, absolute and in its order, not only the module's: the module may import one of another entry;
    a list, not PYTHONPATH's text: a folder's name may hold ':' (``on_pythonpath`` carries it). None for a registered
    name, a module installed (site-packages, an editable install), or one not found (its import fails, and says so).
    Found without importing it: the run's lock is taken before the pipeline loads."""
    import importlib.util
    import sys

    module, colon, _ = pipeline.partition(":")
    top = module.strip().partition(".")[0]
    if not colon or not top.isidentifier():
        return None
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: no package's __init__ runs
    except (ImportError, ValueError):
        return None
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    found = (places[0] if places else spec.origin) if spec is not None else None  # a package's folder, or the .py
    if not found or not os.path.isabs(found):  # built in, frozen
        return None
    folder = os.path.realpath(os.path.dirname(found))
    if folder == str(Path(__file__).resolve().parents[2]):  # ardiff's own (pipelines.*): found wherever ardiff_cli is
        return None
    from ardiff_cli.io.run import absolute_path

    here = os.getcwd()
    searched = [here] if sys.path and os.path.realpath(sys.path[0] or here) == os.path.realpath(here) else []  # -m
    given = "" if sys.flags.ignore_environment else os.environ.get("PYTHONPATH", "")
    if given:  # an empty entry is the working folder too, as Python reads it (an empty PYTHONPATH is none)
        searched += [str(absolute_path(entry)) for entry in given.split(os.pathsep)]
    shown: dict[str, str] = {}  # each folder once, as first written
    for entry in searched:
        shown.setdefault(os.path.realpath(entry), entry)
    return list(shown.values()) if folder in shown else None


def _prepare(config: str | None, episode_paths: list[Path] | None, out: Path | None, resume: bool,
             overrides: dict[str, Any], output: Output, *, pipeline: str | None = None,
             options: dict[str, Any], run: Any = None, again: ResumeCommand | None = None,
             start: dict[str, Any] | None = None, typed: str = "", asked: ResumeCommand | None = None) -> _Prepared:
    """Config, episodes, output folder and ``options`` (order, follow, idle_timeout, preview, swap_space), from
    the command line or (``--resume``) from run.json: a resumed run goes on in its order, following and drawing
    previews, within the memory, sessions and swap space it started with; ``None`` in ``options`` and
    ``overrides`` means not given. The run's folder is locked when it returns; a resume's before the run.json it
    checks against the command line, and goes on with, is read (no other process can change it meanwhile). ``run``: a
    resume's ``RunFolder(out)``, made by the caller (None: made here); ``again``: the resume as given (its hints');
    ``start``: a new run's arguments, which its lock file records (:func:`_start_arguments`); ``typed``: the options
    of the command line (:func:`options_given`), for a hint that gives it again with the config first; ``asked``: the
    options of the command line a resume keeps, as a resume given them (``load_engine_config``'s)."""
    from ardiff_cli.io.run import RunFolder, recorded_resume

    run = RunFolder(out) if run is None and resume and out is not None else run
    if run is not None:
        # unlocked: a folder that holds no run this ardiff resumes is refused, nothing written there
        recorded = run.resume_info()
        # a folder it cannot lock is to be made writable: a resume's folder is the run's, no other
        run.lock(continue_with(recorded_resume(again or ResumeCommand(run.root), recorded)))
    try:
        return _prepare_run(run, config, episode_paths, out, resume, overrides, output, pipeline=pipeline,
                            options=options, again=again, start=start, typed=typed, asked=asked)
    except BaseException:
        if run is not None:
            run.close()
        raise


def _prepare_run(run: Any, config: str | None, episode_paths: list[Path] | None, out: Path | None, resume: bool,
                 overrides: dict[str, Any], output: Output, *, pipeline: str | None, options: dict[str, Any],
                 again: ResumeCommand | None = None, start: dict[str, Any] | None = None, typed: str = "",
                 asked: ResumeCommand | None = None) -> _Prepared:
    """:func:`_prepare`'s work; ``run``: a resume's run folder, locked."""
    from ardiff_cli.io.demo import ensure_demo_episodes
    from ardiff_cli.io.episode import discover_episodes
    from ardiff_cli.io.run import RUN_FILE, SWAP_DIR, RunFolder, make_default_out_dir, recorded_resume

    info: dict[str, Any] = {}
    run_info: dict[str, Any] | None = None  # a resume's run.json as read, under the lock: what is checked is used
    watch: list[Path] | None = None  # the folders of episodes among the EPISODE arguments (None: not known yet)
    done: dict[str, dict[int, int | None]] = {}
    digests: dict[str, dict[int, str]] = {}
    budget_given = overrides["memory_budget"] is not None  # before --resume fills it in from run.json
    pythonpath = (start or {}).get("pythonpath")  # the folders --pipeline's module was found on (a resume's: below)
    if resume:
        if out is None:
            raise ConfigError("--resume needs --out DIR: the folder of the run to continue",
                              hint="the run printed it as 'outputs: DIR' (by default ardiff-runs/<start time>)")
        info = run.resume_info(again=True)  # under the lock: read again only where it changed since
        run_info = dict(info)  # as read: info takes the options the command does not give again
        # the run's --pipeline and its module's folders: the resume a hint gives to paste is given them
        again = recorded_resume(again or ResumeCommand(run.root), info)
        same_pipeline_option(pipeline, info.get("pipeline_option"))
        recorded_pythonpath_found(pipeline, again, run.root / RUN_FILE)
        # a resume records the folders it found the module on, as a new run does, not the run's: the module may have
        # moved since (a lab's folder renamed, given on PYTHONPATH now), or been installed (none needed): its hints
        # from here on (a config's, a moved folder of episodes', a stop's) carry what works now, where the run's
        # folders, pasted, were refused (`... is gone`)
        pythonpath = None if pipeline is None else _pipeline_path(pipeline)
        again = run.found_again = replace(again, pythonpath=tuple(pythonpath or ()))
        config = resume_config(config, info, again)
        overrides["dtype"] = same_as_recorded(overrides["dtype"], info["dtype"], "--dtype")
        # Options not given again are the run's own, checked as given ones are. The device and attention backend
        # recorded are what the run resolved: a given one that resolves to another is refused once known.
        runtime_keys = ("device", "attention_backend", "memory_budget", "session_capacity", "gpu_memory_fraction")
        given = {**{key: overrides[key] for key in runtime_keys},
                 **options, "follow": options["follow"] or None, "preview": options["preview"] or None}
        for key in RECORDED:
            if given[key] is None:
                info[key] = recorded_setting(info, key, run.root / RUN_FILE)
        for key in runtime_keys:
            if overrides[key] is None:
                overrides[key] = info[key]
        refuse_contradictions(follow=options["follow"] or info.get("follow", False),
                              idle_timeout=options["idle_timeout"])
        if not episode_paths and not info.get("demo"):
            episode_paths = [Path(e["path"]) for e in info["episodes"]]
            watch = watched_folders(info, run.root / RUN_FILE)
            recorded_folders_exist(info, run.root, watch, again)
    elif out is not None:
        existing = RunFolder(out)
        if existing.holds_run():
            existing.refuse_while_locked()  # a run still going: not one to resume now
            raise existing.held_run()  # with its resume to paste
        existing.refuse_a_folder_of_runs()  # a run among them: `--resume -o` the folder would resume it alone
    if not resume:
        _refuse_a_run_inside_a_run(out)
    try:
        cfg = load_engine_config(config, pipeline=pipeline, episodes=episode_paths or (), given=typed, asked=asked,
                                 **overrides)
    except ConfigError as exc:
        # an edit that no longer loads (a key misspelt) is refused as the edit it is, as before the file was parsed
        if resume and (now := config_sha256(Path(config))) is not None:
            from ardiff_cli.runtime.config import ConfigTextError

            same_config(Path(config), now, info)
            if isinstance(exc, ConfigTextError) and info.get("config_sha256") == now:  # the run's own bytes
                from ardiff_cli import __version__

                exc.hint = (f"this is the config the run started with (its SHA-256 is unchanged), which the ardiff "
                            f"that started it ({info.get('ardiff_version', 'unknown')}) read and this one "
                            f"({__version__}) refuses; --resume refuses an edited config, so finish the run with the "
                            "ardiff that started it, or fix the config and start a new run in another --out")
        raise
    if resume:  # the bytes just parsed: a second read to hash them could see an edit made meanwhile
        same_config(Path(config), cfg.sha256, info)
    if resume and not budget_given and info.get("memory_budget") is not None:  # run.json's, reused as if given
        source = str(run.root / RUN_FILE)
    else:
        source = budget_source(overrides["memory_budget"] if budget_given else None, cfg)
    if not resume:  # before --out and the demo files
        _under_signals(lambda: _refuse_what_loading_would(cfg, overrides["device"], overrides["attention_backend"]))
    recorded_device = info.get("device") if resume else None
    recorded_backend = info.get("attention_backend") if resume else None
    output.debug(f"config {cfg.source}: pipeline {cfg.pipeline_name}, {cfg.runtime}")
    schema = cfg.observation_schema()
    demo = not episode_paths
    if demo:
        demo_root = ensure_demo_episodes(cfg.pipeline_name, schema, image_size(cfg.model), model_config=cfg.model,
                                         warn=output.warning)
        output.info(f"no EPISODE given: using the demo episodes in {as_typed(demo_root)}")
        episode_paths = [demo_root]
        if overrides["session_capacity"] is None:
            limit = cfg.runtime.session_capacity or cfg.kv_cache_spec().session_capacity
            cfg = cfg.with_runtime(session_capacity=min(limit, DEMO_SESSION_CAPACITY))
    episodes = discover_episodes(episode_paths, warn=output.warning, config=config_label(config),
                                 follow=bool(options["follow"] or info.get("follow")), asked=asked)
    if not episodes:
        raise ConfigError(f"no episode folders in {', '.join(map(str, episode_paths))}",
                          hint="pass folders of step files (step_000000.safetensors, ...); hidden folders and "
                               "ardiff's own run folders are not taken for episodes")
    if watch is None:  # EPISODE arguments that are folders of episodes
        known = {e.path.resolve() for e in episodes}
        watch = [path.resolve() for path in episode_paths if path.resolve() not in known]
    if not resume:  # the default ./ardiff-runs too: `rollout CFG . --follow` run from inside the robot's episode
        _refuse_an_episode_folder_as_out(None if out is None else Path(out),
                                         [*episode_paths, *(e.path for e in episodes)], [e.path for e in episodes])
    if resume:
        # An episode keeps the name its folder had when the run started, whatever the order of EPISODE now:
        # two folders both named `ep` are `ep` and `ep-2` by the order they were given in.
        # A recorded path is the episode's even where a symlink there leads elsewhere now (its folder moved).
        names = {e["path"]: e["name"] for e in info["episodes"]}
        for episode in episodes:
            episode.name = names.get(str(episode.path), names.get(str(episode.path.resolve()))) or moved_name(
                episode.path, info["episodes"]) or episode.name
        recorded = sorted(e["name"] for e in info["episodes"])
        # an episode folder made since in a watched folder of episodes is not one yet: the run's first poll adds it
        # (one of a recorded name in a folder of episodes the run did not watch is the run's: that folder moved)
        paths, run_names = set(names), set(names.values())
        recorded_watch = info.get("watch") if isinstance(info.get("watch"), list) else []
        watched_then = {Path(folder) for folder in recorded_watch if isinstance(folder, str)}
        episodes = [e for e in episodes if str(e.path) in paths or str(e.path.resolve()) in paths
                    or e.path.resolve().parent not in watch
                    or (e.name in run_names and e.path.resolve().parent not in watched_then)]
        given = sorted(e.name for e in episodes)
        if given != recorded:
            raise ConfigError(f"the episodes differ from those of the run in {out}: expected {recorded}, got {given}",
                              hint="resume with the same EPISODE arguments (or none, to reuse the recorded ones)")
        # a recorded folder of episodes that is now a link to the one given (it moved, a link left at its old path)
        # is that folder: watched and recorded at its recorded path, as an episode's folder is (recorded_folder)
        at = {Path(os.path.realpath(folder)): folder for folder in watched_then}
        watch = [at.get(folder, folder) for folder in watch]
        watched = sorted(map(str, watch))  # else the episodes started meanwhile in a watched folder were not looked for
        if info.get("follow") and watched != sorted(info.get("watch") or []):
            refuse_other_watch(sorted(info.get("watch") or []), watched, info["episodes"], episodes, out)
    from ardiff_cli.io.run import absolute_path, episode_folder_path
    from ardiff_cli.rollout import recorded_folder
    from ardiff_cli.runtime.config import resolve_config

    # What the command line says, else (--resume) what run.json recorded, else the defaults.
    options = {"order": options["order"] or info.get("order") or Order.round_robin.value,
               "follow": bool(options["follow"] or info.get("follow")),
               "idle_timeout": info.get("idle_timeout") if options["idle_timeout"] is None else options["idle_timeout"],
               "preview": bool(options["preview"] or info.get("preview")),
               "swap_space": info.get("swap_space") if options["swap_space"] is None else options["swap_space"]}
    # Absolute, its links kept: a config given as a link reads a relative checkpoint from the link's folder, and
    # --resume loaded the link's target, which read it from another folder (`file not found`, exit 2). Its '..'
    # dropped but after a link: `/x/lab/../fast.yaml` is gone once lab/ is renamed, /x/fast.yaml is not.
    config_file = absolute_path(resolve_config(config_label(config)))
    checkpoint = checkpoint_record(cfg.checkpoint)
    if resume:
        refuse_changed_checkpoint(info.get("checkpoint"), checkpoint)
    # run.json's path of an episode, kept where it still leads to the folder read (a symlink there to where the
    # dataset moved), else where the episode is now: a resume given it there records it there once it starts
    recorded_paths = {e["name"]: e["path"] for e in info["episodes"]} if resume else {}
    info = {
        "config": info.get("config", config_label(config)), "config_path": str(config_file),
        "config_sha256": cfg.sha256, "checkpoint": checkpoint, "pipeline": cfg.pipeline_name,
        "pipeline_option": pipeline,
        # the folders --pipeline's module was imported from, as the lock file records them: the resume hints carry
        **({} if pythonpath is None else {"pythonpath": pythonpath}),
        "episodes": [{"name": e.name, "path": recorded_folder(e, recorded_paths.get(e.name))} for e in episodes],
        "demo": demo,
        "watch": [str(folder) for folder in watch],
        "dtype": cfg.runtime.dtype, "device": cfg.runtime.device, "session_capacity": cfg.runtime.session_capacity,
        "memory_budget": cfg.runtime.memory_budget, "gpu_memory_fraction": cfg.runtime.gpu_memory_fraction,
        "started": info.get("started", time.time()), **options,
    }
    # The run reads each episode where run.json records it, so that an error, a warning and results.jsonl name its
    # files alike, by that absolute path, on the run that started it as on a resume (not as typed on the first only)
    # A folder that is itself a link is recorded and read as that link (episode_folder_path): its target may be
    # outside the watched folder of episodes it is in (live/cam -> .rec/arm_a), and --follow follows the recording
    # moved into place from there, as a resume does (given the link directly, or watching its folder)
    # A run.json an older ardiff wrote records where such a link led, outside the watched folders: the resume reads
    # it through the link in a watched folder that leads there, and records the link from then on
    links = links_in(watch) if resume else {}
    for episode, recorded_episode in zip(episodes, info["episodes"]):
        link = links.get(recorded_episode["path"]) if Path(recorded_episode["path"]).parent not in watch else None
        if link is not None:
            recorded_episode["path"] = episode_folder_path(link)
        episode.path = Path(recorded_episode["path"])
    try:  # now, not after the model has loaded: a file or an unwritable place is a usage error
        if out is None:
            out = make_default_out_dir()
        else:
            Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        given = out is not None
        out = out or exc.filename or "ardiff-runs"
        # without --out, the folder is ardiff's default, in the current folder: not an --out the user gave
        subject = (f"--out {as_typed(out)}" if given else
                   f"the default output folder {Path.cwd() / out} (no --out given)")
        cannot = f"--out {as_typed(out)}: cannot create the output folder" if given else f"cannot create {subject}"
        elsewhere = "" if given else "; or pass --out DIR to write the run elsewhere"
        in_the_way = not_a_folder(Path(out))
        if in_the_way is not None:  # mkdir's "File exists" of a path that exists, said of a folder it is not
            path, what = in_the_way
            raise ConfigError(f"{subject}: {'it' if path == Path(out) else path} is {what}, not a folder",
                              hint="choose a folder, or a path where none exists yet" if given
                              else f"move {path} out of the way{elsewhere}") from None
        dangling = link_to_nothing_on(Path(out))  # mkdir's "File exists" of a path ls shows as nothing but a link
        if dangling is not None:
            raise ConfigError(f"{cannot}: {exc.strerror or exc} ({dangling[0]} is {dangling[1]})",
                              hint="create the folder it links to (a disk not mounted?), or remove the link"
                              + elsewhere) from None
        from ardiff_cli.io.run import folder_of_another
        owned = folder_of_another(Path(out)) if given and isinstance(exc, PermissionError) else None
        raise ConfigError(f"{cannot}: {exc.strerror or exc}",
                          hint=owned or ("choose a folder you can write, or one that does not exist yet" if given else
                                         "pass --out DIR (a folder you can write), or run where you can create "
                                         "ardiff-runs")) from None
    if not resume:  # a resume's is locked already
        run = RunFolder(out)
        run.lock(start=start)  # held until the command ends: a second rollout writing this folder is refused
    try:
        if not resume and run.holds_run():  # a rollout started here since the check above, and ended: refused now,
            raise run.held_run()  # under the lock, not once the model has loaded (RunFolder.start)
        _refuse_another_runs_kept_snapshots(Path(out) / SWAP_DIR, info["started"])
        run.refuse_a_folder_as_summary()
        if resume:
            done, digests = run.resume_state(warn=output.warning, go_on=continue_with(again))
    except BaseException:
        run.close()
        raise
    return _Prepared(cfg=cfg, episodes=episodes, out_dir=Path(out), info=info, done=done, digests=digests,
                     run=run, options=options, recorded_device=recorded_device,
                     recorded_backend=recorded_backend, budget_source=source, watch=watch, recorded=run_info)


def _refuse_what_loading_would(cfg: Any, device: str | None, attention_backend: str | None) -> None:
    """What loading the model would refuse, refused before --out and the demo episodes are made (a resume's run was
    started past these): a CUDA device or a vllm attention backend this machine lacks (``device``,
    ``attention_backend``: the options', else the config's), and a config without ``checkpoint:`` whose built-in
    pipeline has no default checkpoint of its size (a 14B geometry). Both import torch: run it ``_under_signals``."""
    refuse_what_this_machine_lacks(cfg, device=device, attention_backend=attention_backend)
    path = _default_checkpoint(cfg)
    if path is None:
        return
    from pipelines.checkpoint import refuse_too_large_for_default

    try:
        if path.is_file():  # built or placed there: it loads
            return
    except OSError:  # a cache folder this user cannot enter: the load says so
        return
    from ardiff_cli.runtime.engine import pipeline_class_of

    refuse_too_large_for_default(pipeline_class_of(cfg.entry), cfg.model)


def _default_checkpoint(cfg: Any) -> Path | None:
    """The built-in checkpoint the model loads (built or not), or None: the config names one, or the pipeline loads
    its weights its own way. Imports torch."""
    if cfg.checkpoint is not None:
        return None
    with running_out_of_memory_names("importing torch"):  # the run's first: the one run() makes is done then
        from ardiff_cli.runtime.engine import pipeline_class_of
    from pipelines.base import ARPipeline
    from pipelines.checkpoint import default_checkpoint_path

    pipeline_class = pipeline_class_of(cfg.entry)
    if not (isinstance(pipeline_class, type) and issubclass(pipeline_class, ARPipeline)) \
            or getattr(pipeline_class.from_config, "__func__", None) is not ARPipeline.from_config.__func__:
        return None
    return default_checkpoint_path(pipeline_class, cfg.model)


def _same_default_checkpoint(cfg: Any, recorded: dict[str, Any], run_file: Path) -> None:
    """A resume with steps left refuses a built-in checkpoint that is not the one the run's steps so far ran on:
    another ardiff's (a checkpoint format since changed: outputs differ by up to 1e-5), so a resumed run's
    outputs would mix two models'. run.json names the file (``default_checkpoint``); one an older ardiff wrote
    does not, and there the file must have been in the cache before run.json was written (after the model
    loaded)."""
    path = _default_checkpoint(cfg)
    if path is None or recorded.get("checkpoint") is not None:
        return
    name = recorded.get("default_checkpoint")
    again = "finish the run with the ardiff version that started it, or start a new run in another --out"
    if isinstance(name, str):
        if name != path.name:
            raise ConfigError(f"this run ran on the built-in checkpoint {name}, and this ardiff loads {path.name} "
                              "(another checkpoint format, which rounds otherwise): the outputs of the steps left "
                              "would not be those of the weights its steps so far ran on", hint=again)
        return
    try:
        built, written = path.stat().st_mtime_ns, run_file.stat().st_mtime_ns
    except FileNotFoundError:
        built = written = None
    except OSError:  # a cache folder this user cannot enter: the load says so
        return
    if built is not None and built <= written:
        return
    when = "is not in the cache" if built is None else \
        f"was built at {local_time(built / 1e9)}, after this run loaded its model,"
    raise ConfigError(f"the built-in checkpoint {path} {when} and {run_file} "
                      "(an older ardiff's) does not name the one its steps so far ran on: an older ardiff's "
                      "checkpoint format rounds otherwise (outputs differ by up to 1e-5)",
                      hint=f"resume with the ARDIFF_CACHE_DIR the run started with; else {again}"
                           + ("" if built is None else f"; if the run's version built this very file, give it "
                              f"the time of run.json: touch -r {shell_word(run_file)} "
                              f"{shell_word(path)}"))


def _refuse_another_runs_kept_snapshots(swap_dir: Path, started: float) -> None:
    """A run deletes the snapshot files in its swap folder it will not restore, as left by a killed run. Those another
    run kept for its --resume (its kept.json), in a folder both runs' ``.swap`` link to, are refused instead."""
    from ardiff_cli.io.kept import KEPT_FILE, kept_for

    other = kept_for(swap_dir)
    if other is not None and other != started:
        when = local_time(other)
        raise ConfigError(f"{swap_dir / KEPT_FILE}: the swap snapshots there are kept for the --resume of another run "
                          f"(started {when}), and this run would delete them",
                          hint="give this run a .swap of its own, or delete that kept.json to let it discard them")


def _refuse_an_episode_folder_as_out(out: Path | None, inputs: list[Path], episodes: list[Path]) -> None:
    """``--out`` may not be an EPISODE folder or one holding step files: the run's files would be mixed with the
    robot's, and a folder holding a run is no longer taken for an episode (``rollout CFG data/`` skips it). Nor
    may it be a folder of the episodes, given as EPISODE or holding one: ``rollout CFG data/`` would take the
    run's episodes/ folder for an episode. Nor a folder inside one of the ``episodes`` (``-o data/ep1/out``): the
    run went where its episode folder went, and a recorder that renames it to publish the episode (which --follow
    follows) or removes it once ended took the run's folder away mid-run. Inside a folder of episodes is fine: a
    run's folder there is never taken for an episode (``rollout CFG .`` beside its default ./ardiff-runs). ``out``
    None is the default ./ardiff-runs, refused alike: run from inside an episode folder (``cd data/ep1; rollout CFG .
    --follow``), the run's outputs landed in the robot's episode."""
    from ardiff_cli.io.episode import episode_entries, listed
    from ardiff_cli.io.run import RUNS_FOLDER

    target = Path(RUNS_FOLDER if out is None else out).resolve()
    subject = (f"the default output folder {Path.cwd() / RUNS_FOLDER} (no --out given)" if out is None
               else f"--out {as_typed(out)}")
    hint = "choose another --out for the outputs, such as runs/eval1"
    found = episode_entries(target)
    if found:
        message = (f"{subject} is an episode folder (it holds {listed(found)}): the run's files would be "
                   "written among its step files, and a folder holding a run is no longer taken for an episode")
    elif any(path.resolve() == target for path in inputs):
        message = (f"{subject} is also given as EPISODE: the run's files would be written among the "
                   "episodes, and its episodes/ folder taken for one by a later rollout")
    elif inside := next((path for path in inputs if path.resolve().parent == target), None):
        message = (f"{subject} holds the EPISODE {as_typed(inside)}: the run's files would be written "
                   "among the episodes, and its episodes/ folder taken for one by a later rollout")
    elif inside := next((path for path in episodes if path.resolve() in target.parents), None):
        message = (f"{subject} is inside the episode folder {as_typed(inside)}: the run's files would be "
                   "moved or deleted with the robot's (a recorder that renames the folder to publish the episode, or "
                   "removes it once it ended, takes the run's folder away while it writes)")
        if out is None:  # runs/eval1 here is inside the episode too: a folder beside it is not
            beside = shell_word(os.path.relpath(inside.resolve().parent / "runs" / "eval1"))
            hint = f"pass --out DIR outside the episode folder, such as --out {beside}, or run ardiff from elsewhere"
    else:
        return
    raise ConfigError(message, hint=hint)


def _refuse_a_run_inside_a_run(out: Path | None) -> None:
    """A new run's folder may not be inside another run's (``-o runs/eval1/episodes/retry``): its files would be
    mixed with that run's outputs, which a resume of it, or a script reading its episodes/, takes for its own; and
    that run's folder, moved or deleted as a whole, takes this one with it. ``out`` None is the default ./ardiff-runs
    (run from inside a run's folder). A resume goes on where its run is."""
    from ardiff_cli.io.run import EPISODES_DIR, RUNS_FOLDER, RunFolder

    target = Path(RUNS_FOLDER if out is None else out).resolve()
    outer = next((p for p in target.parents if RunFolder(p).is_run_folder()), None)
    if outer is None:
        return
    relative = os.path.relpath(outer)
    shown = outer if relative == "." or relative.startswith("..") else Path(relative)
    where = f" (its {EPISODES_DIR}/ folder)" if (outer / EPISODES_DIR) in (target, *target.parents) else ""
    subject = (f"the default output folder {Path.cwd() / RUNS_FOLDER} (no --out given)" if out is None
               else f"--out {as_typed(out)}")
    beside = shell_word(shown.parent / target.name)
    raise ConfigError(f"{subject} is inside the ardiff run folder {as_typed(shown)}{where}: a new run written inside "
                      "another is mixed with its outputs, and moved or deleted with it",
                      hint=f"choose an --out outside {as_typed(shown)}, such as --out {beside}" if out is not None
                      else f"pass --out DIR outside {as_typed(shown)}, or run ardiff from outside it")


def _under_signals(work: Callable[[], None]) -> None:
    """``work()``, which imports torch, under the rollout's signal handlers, as every import of torch by a rollout
    is: a signal while it imports waits for it to end, then stops the command (Python's default handlers left numpy
    half imported, or a C++ exception uncaught: exit 0, 1 or 134)."""
    from ardiff_cli.signals import StopSignals

    try:
        with StopSignals() as signals:
            work()
            signals.check()
    except Interrupted as stop:
        stop.hint = "nothing was written yet: run the same command again"
        raise


def _swap_space(value: str | None) -> int | None:
    """Bytes of --swap-space (0: off); None: the runtime's default (the KV budget, at most half the free disk)."""
    from ardiff_cli.runtime.capacity import parse_bytes

    return None if value is None else parse_bytes(value, zero_ok=True)


def _run(p: _Prepared, output: Output, *, order: str, follow: bool, idle_timeout: float, fail_fast: bool,
         preview: bool, warmup: bool, resume: bool, started: float, swap_space: int | None = None) -> None:
    """The run itself; ``started`` is the command's start (monotonic), of which summary.json's ``wall_s`` is."""
    from ardiff_cli.io.atomic import atomic_write_json
    from ardiff_cli.io.kept import drop_kept, read_kept
    from ardiff_cli.io.run import RUN_FILE, SWAP_DIR
    from ardiff_cli.monitor import RunMonitor
    from ardiff_cli.panels import render
    from ardiff_cli.rollout import Rollout, RolloutOptions, RolloutStats, log_episode_end
    from ardiff_cli.runtime.swap import remove_snapshot_files
    from ardiff_cli.signals import StopSignals

    run = p.run
    monitor = RunMonitor(output, f"ardiff rollout · {p.info['config']} → {p.out_dir}")
    options = RolloutOptions(order=order, follow=follow, idle_timeout=idle_timeout, fail_fast=fail_fast,
                             preview=preview, watch=tuple(p.watch), budget_source=p.budget_source,
                             resume=p.resume)
    skipped = sum(len(s) for s in p.done.values())
    output.info(f"{'resuming' if resume else 'writing'} {as_typed(p.out_dir)}: {plural(len(p.episodes), 'episode')}, "
                f"order {order}" + (f", {plural(skipped, 'step')} already done" if resume else ""))
    loading = time.monotonic()
    swap_dir = p.out_dir / SWAP_DIR
    # what a stopped run left for this resume; why not, once, when its index is ignored
    kept = read_kept(swap_dir, run=p.info["started"], warn=output.warning) if resume else {}
    # the rest is stale: left by a run killed before it could remove them
    remove_snapshot_files(swap_dir, keep=frozenset(file for file, _ in kept.values()))
    if resume:
        for path in run.remove_stale_temporaries():  # under the lock: left by a process killed mid-write
            output.debug(f"removed {path}, a temporary file of an interrupted write")
        finished = None if follow else _nothing_left(p, order=order, preview=preview,
                                                     wall_s=time.monotonic() - started)
        if finished is not None:  # loading a model (minutes for a large one) would change nothing
            # as it never takes the signals: a stop Python dropped as it began, before run.json and summary.json are
            # written (Output.result raised it after them: exit 143 beside a summary.json that said ok)
            raise_dropped_stop()
            same_device(p.cfg.runtime.device, p.recorded_device, load=False)  # before anything is written
            drop_kept(swap_dir)
            remove_snapshot_files(swap_dir)
            summary, ended = finished
            output.info("nothing left to run: every step of every episode is done (the model was not loaded)")
            _write_run_info(lambda: atomic_write_json(p.out_dir / RUN_FILE, _resumed_info(p.recorded, p)),
                            p.out_dir / RUN_FILE, resume=p.resume)
            for item in ended:  # the objects a loaded resume prints: a script counts its episodes the same way
                log_episode_end(monitor, item.episode.name, item.reason, len(p.done.get(item.episode.name, ())))
            output.result(_write_summary(run, lambda: summary, output, None, p.resume),
                          lambda plain: render_summary(summary, plain))
            return
    engine = driver = plan = summary = None
    adopted: dict[str, int] = {}  # {episode: steps} of the kept snapshots taken back (_adopt_kept)
    warmed_up = False  # past the warmup: a stop from here on is recorded in summary.json, as the README says
    in_warmup = False  # its requests began: a Ctrl-C from here until warmed_up is one on a warmup that ran too long
    changes: dict[str, dict[str, Any]] = {}  # --resume: what differs from the ardiff, torch and threads of run.json
    ran_from = ran_until = None  # monotonic times driver.run() began and ended: the time spent running steps
    error: BaseException | None = None
    stopped = False  # a signal (or stdout's reader gone) stopped the run, and nothing else went wrong

    def resume_now() -> ResumeCommand:
        """The resume to paste as things stand: before the warmup of a run given --no-warmup, one that skips it."""
        return p.resume if warmed_up else _before_warmup(p.resume, warmup)

    try:
        signals = StopSignals(notice=_stop_notice(output, monitor))
        with signals, output.live(lambda: render(monitor.snapshot())), monitor.ending():
            # `ardiff rollout --format json | head`: once the reader is gone, stop as a shell's SIGPIPE would
            # (exit 141), but between steps, where every written file is whole, so --resume can finish the run.
            # `> events.jsonl` on a disk that fills up stops there too, with the write's error (exit 1).
            output.on_stdout_lost = lambda exc: signals.defer(lost_stdout_stop(exc, continue_with(p.resume)))
            try:
                with running_out_of_memory_names("importing torch"):
                    from ardiff_cli.runtime.engine import ARDiffusionEngine

                signals.check()  # a signal that arrived while torch imported
                if resume:  # before the model loads; under the signals, as torch resolves the device
                    same_device(p.cfg.runtime.device, p.recorded_device)
                    recorded_backend_installed(p.cfg.runtime.attention_backend, p.recorded_backend,
                                                p.recorded_device)
                    _same_default_checkpoint(p.cfg, p.recorded, p.out_dir / RUN_FILE)
                engine = ARDiffusionEngine(p.cfg, swap_dir=None if swap_space == 0 else swap_dir,
                                           swap_space=swap_space)
                engine.subscribe(monitor.on_event)
                try:
                    plan = engine.load()
                except CapacityError as exc:  # without a budget, the runner's hint names the device's free memory
                    if p.budget_source is not None:  # a resume keeps the run's dtype and config: only the budget
                        larger = budget_change(p.budget_source, "larger", resume=True)
                        exc.hint = (f"resume with {larger}; the dtype and the config are the run's (--resume keeps "
                                    "them)" if resume else
                                    does_not_fit_hint(p.cfg, p.budget_source, window_helps=exc.window_helps))
                    elif resume:  # the runner's hint says a smaller window, model or dtype: --resume refuses them
                        exc.hint = to_paste(RESUME_LOAD_HINT, resume_now())
                    if not resume and exc.hint:  # the rollout its .lock records is refused the same way: the
                        run.record_refusal(exc.hint)  # folder's hints say what to change in it
                    raise
                except BudgetBeyondDeviceError as exc:  # the runner's hint cannot tell the option from the config
                    exc.hint = beyond_device_hint(p.budget_source, resume=resume)
                    if not resume:
                        run.record_refusal(exc.hint)
                    raise
                except NonFiniteWeightsError as exc:  # a run an ardiff that loaded such weights started
                    if resume and p.cfg.checkpoint is not None:  # its hint says another dtype or checkpoint:
                        # --resume refuses them (the built-in default's, a damaged cache file, says to delete it)
                        dtype = p.cfg.runtime.dtype
                        fix = "--dtype bfloat16 or " if dtype == "float16" else ""
                        exc.hint = (f"--resume keeps the run's dtype ({dtype}) and checkpoint: start a new run in "
                                    f"another --out, with {fix}a checkpoint of finite weights")
                    raise
                monitor.refresh(engine.runner)  # the warmup's session shows, and its pages
                signals.check_signal()  # one that arrived while the pipeline imported: not after warmup
                output.debug(f"loaded on {engine.device} in {time.monotonic() - loading:.2f}s: "
                             f"{plural(plan.session_capacity, 'session')}, {plural(plan.num_managed_pages, 'page')}")
                if resume:
                    recorded = p.recorded
                    same_backend(engine.runner.attention_backend, p.cfg.runtime.attention_backend,
                                  recorded.get("attention_backend"))
                    changes = build_changes(recorded, build_record())
                    if changes:  # not refused: an upgrade may be what the user resumes for
                        output.warning(build_changes_warning(changes, p.out_dir / RUN_FILE))
                    resumed = _resumed_info(recorded, p)
                    _write_run_info(lambda: atomic_write_json(p.out_dir / RUN_FILE, resumed), p.out_dir / RUN_FILE,
                                    resume=resume_now())
                    run.wrote_info(resumed)  # the driver's episode paths, and the journal's, are these
                else:
                    default = _default_checkpoint(p.cfg)  # named: another ardiff's may round otherwise
                    _write_run_info(lambda: run.start({**p.info, "device": str(engine.device),
                                                       "attention_backend": engine.runner.attention_backend,
                                                       "default_checkpoint": default and default.name,
                                                       **build_record()}),
                                    p.out_dir / RUN_FILE, resume=None, results=run.results_path)
                if warmup:
                    monitor.set_phase("warmup")
                    in_warmup = True
                    _warm_up(engine, signals, monitor)
                warmed_up = True
                with signals.critical():  # a stop meanwhile waits: the teardown keeps again those taken back
                    try:
                        adopted = _adopt_kept(engine, kept, p.done, swap_dir, output)
                    except BaseException:  # a bug part-way: the index stays, so those taken back go back to the
                        engine.runner.detach_snapshots()  # names it gives them (else closing the runner deleted them)
                        raise
                    kept = {}
                driver = Rollout(engine, p.cfg.observation_schema(), p.episodes, run, output, monitor,
                                 signals, options, p.done, digests=p.digests, swapped=adopted)
                if resume:  # the last run's word on a run that goes on from here: a script must not take it as final
                    run.summary_path.unlink(missing_ok=True)  # with a driver: this run's own is written at its end
                monitor.set_phase("following" if follow else "running")  # the rate's time, as the summary's
                ran_from = time.monotonic()
                try:
                    stats = driver.run()
                finally:
                    ran_until = time.monotonic()  # the steps' time, for summary.json's rate: not the teardown's
                    monitor.end_counting()  # and the live display's
                monitor.set_phase("done")
                if stats.failed:
                    raise _failed_episodes(stats, p.episodes, p.resume)
            except BaseException as exc:
                error = signals.outcome(exc)
                stopped = isinstance(exc, Interrupted)
                again = resume_now()
                if isinstance(error, Interrupted) and not run.holds_run():  # stopped while loading: no run.json
                    error.hint = "nothing was written yet: run the same command again"
                elif isinstance(error, Interrupted):  # the same command with --resume is refused (CONFIG, EPISODE)
                    # Ctrl-C in the warmup: the user stopped it as too long, and the resume to paste must not run it
                    # again. SIGTERM and SIGHUP (a scheduler's preemption, a closed terminal) say nothing of the
                    # warmup: theirs runs it
                    skip = not warmed_up and in_warmup and error.signum == signal.SIGINT
                    error.hint = continue_with(_without_warmup(p.resume) if skip else again)
                if too_many_open_files(error) and not isinstance(error, ArdiffError) and run.holds_run():
                    error.hint = open_files_hint(continue_with(again))  # the same command is refused now
                if is_out_of_memory(error) and not isinstance(error, ArdiffError) and not pages_short(error):
                    phase = getattr(error, "ardiff_while", None)
                    with contextlib.suppress(MemoryError):
                        # warmup's, a resume's load: the same command with another --dtype is refused now; a resume
                        # holds run.json as it loads: the KV pools come after the weights, and they after torch
                        if run.holds_run() and (plan is not None or phase == KV_POOLS_PHASE):
                            planned = plan or getattr(error, "ardiff_plan", None)  # the pools' that did not fit
                            error.hint = to_paste(lighter_resume_hint(p.budget_source, planned),
                                                  lighter_resume(again, planned))
                        elif run.holds_run() and while_importing(error):  # before any model: free memory alone
                            error.hint = to_paste(import_hint("continue with --resume"), again)
                        elif run.holds_run():
                            error.hint = to_paste(RESUME_LOAD_HINT, again)
                        elif phase == WEIGHTS_PHASE:  # a new run's, before its KV pools: the model's dtype or size
                            error.hint = weights_run_hint(p.cfg.runtime.dtype)
                if isinstance(error, PipelineError) and not warmed_up and run.holds_run() and error.hint:
                    # the pipeline failed its warmup (or a resume's load), run.json written: the same command is
                    # refused now, and the hint said only what to fix
                    if error.hint.startswith(DIVERGED_IN_WARMUP):  # the fix is one --resume refuses
                        error.hint += ("; --resume keeps the run's config, dtype and checkpoint: once fixed, start a "
                                       "new run in another --out")
                    else:
                        error.hint = to_paste(f"{error.hint}; once fixed, continue the run with --resume", again)
                if pages_short(error) and not warmed_up and run.holds_run():  # the warmup's: run.json is written
                    error.hint = to_paste(WARMUP_PAGES_HINT, _without_warmup(p.resume))
                if error is exc:
                    raise
                raise error from exc  # --verbose shows what the stop cut short
            finally:
                # A signal from here on is only recorded: raised in the teardown, it left no summary.json, or one
                # that said ok while the run exited 130
                signals.hold()
                try:
                    # the driver's swapped-out sessions; before it is made (it lists the episodes), those taken back
                    if engine is not None and (driver is not None or adopted) and error is not None and not run.moved():
                        if stopped and driver is not None:
                            _swap_out_resident(engine, driver, output, signals)
                        # for --resume to restore, not replay
                        steps = adopted if driver is None else driver.swapped_steps()
                        kept = _keep_swapped(engine, steps, swap_dir, p.info["started"], output)
                        monitor.keep_snapshots(len(kept), _bytes_of(swap_dir, (file for file, _ in kept.values())))
                    if engine is not None:
                        _close_engine(engine, output, error)
                finally:
                    # however the run ended: but the files a stopped run keeps for --resume, or that a run stopped
                    # before it could adopt them had kept (their index stays for the next resume)
                    remove_snapshot_files(swap_dir, keep=frozenset(file for file, _ in kept.values()))
                    run.close(keep_lock=True)  # the summary is written under the lock; rollout() releases it
                    # a stop as the driver first lists the episode folders (seconds for thousands of them) is past
                    # the warmup too: its summary says no step ran
                    if warmed_up:  # the driver is made past it (no driver yet: no step ran)
                        stats = driver.stats if driver is not None else RolloutStats.before_any_step(
                            p.done, (e.name for e in p.episodes))
                        running_s = 0.0 if ran_from is None else (ran_until or time.monotonic()) - ran_from
                        wall_s = time.monotonic() - started
                        with signals.critical():
                            summary = _write_summary(run, lambda: _summary(run, p, engine, stats, plan, wall_s,
                                                                           running_s, error, len(kept), changes),
                                                     output, error, p.resume)
    finally:
        output.on_stdout_lost = None
        if summary is not None:  # after the live display, so the two never interleave
            gone = run.moved()  # its outputs line would name a folder that holds no run, or another's
            with signals:  # held since the teardown (``hold``): a signal while the result prints is only recorded
                output.result(summary, lambda plain: render_summary(summary, plain, gone=gone))


def _without_warmup(resume: ResumeCommand) -> ResumeCommand:
    """The run's resume to paste that skips the warmup (``--no-warmup`` after the options given): where a run stopped
    or failed in its warmup, or before the warmup of a run given ``--no-warmup``. Never in ``resume.given``, which
    every hint of the resume carries: a resume given ``--no-warmup`` gives its next one the warmup back once past it."""
    return replace(resume, given=(*resume.given, "--no-warmup"))


def _before_warmup(resume: ResumeCommand, warmup: bool) -> ResumeCommand:
    """The resume a refusal, stop or failure gives to paste before the warmup of a resume given
    ``--warmup/--no-warmup`` (``warmup``): from its refusals and a stop as it reads its run folder (before it takes the
    signals) until past its warmup, one given ``--no-warmup`` gives it again, so that the resume pasted does not run
    the warmup this one was given to skip."""
    return resume if warmup else _without_warmup(resume)


def _warm_up(engine: Any, signals: Any, monitor: Any) -> None:
    """The pipeline's warmup requests. A reader of stdout gone meanwhile (their request_finished lines, --format json)
    stops the run at the end of the request in flight, as ``ardiff warmup`` does: it was acted on only after the
    last one, minutes later for a large model. A stdout that fails otherwise (a full disk) stops it before its first
    step, with a summary that records the error (``check_signal`` leaves that to the steps' ``check``).

    Each request shows as ``ardiff warmup`` shows it: a line in plain format, and its session's row of the live
    display read again (its requests and latency). A provider that yields many requests (or never stops) showed
    nothing but "admitted __ardiff_warmup__" and the phase for as long as it ran."""
    def progress(event: Any) -> None:
        if event.kind == "request_finished":
            monitor.refresh(engine.runner)

    monitor.echo_requests = True
    # after the monitor: the request's line is out (or lost), and its row read, before a stop is raised
    unsubscribes = [engine.subscribe(progress), engine.subscribe(stop_between_requests(signals))]
    try:
        engine.warmup()
    finally:
        for unsubscribe in unsubscribes:
            unsubscribe()
        monitor.echo_requests = False


def _adopt_kept(engine: Any, kept: dict[str, tuple[str, int]], done: dict[str, dict[int, int | None]],
                swap_dir: Path, output: Output) -> dict[str, int]:
    """Take back the snapshots a stopped run kept (``io.kept``): {episode: steps its session had consumed}. One of
    fewer steps than the episode has done (a run stopped while rebuilding a session keeps what it rebuilt) is
    restored, then the rest replayed. One of more steps (ok lines went missing from results.jsonl), or of a step that
    is not done (its output went missing: it runs again), or that this run cannot take (no swapping, too large), is
    deleted: its episode replays. Then the index goes (``drop_kept``)."""
    from ardiff_cli.io.kept import drop_kept
    from ardiff_cli.runtime.errors import RequestError

    swapping = engine.runner.swap is not None
    if kept and not swapping:
        output.warning("swapping is off (--swap-space 0): the swap snapshots the stopped run kept of "
                       f"{plural(len(kept), 'episode')} were deleted, and their done steps are replayed instead")
    swapped = {}
    for name, (file, steps) in kept.items():
        num_done, why = len(done.get(name, ())), None
        chunks = set(done.get(name, {}).values())  # the positions in the episode the done steps ran at
        if swapping and steps > num_done:
            why = f"it holds {plural(steps, 'step')}, more than the {num_done} done in results.jsonl"
        elif swapping and None not in chunks and not chunks.issuperset(range(steps)):  # lines without: by count
            missing = min(set(range(steps)) - chunks)
            why = f"it holds {plural(steps, 'step')}, and the one at position {missing} in the episode is not done " \
                  "(its output went missing)"
        elif swapping:
            try:
                if engine.runner.adopt_snapshot(name, file):
                    swapped[name] = steps
                    continue
                why = "it is larger than the whole swap space"
            except (OSError, RequestError) as exc:  # RequestError: its file is gone (deleted by hand, say)
                why = "its file is gone" if not (swap_dir / file).is_file() else f"it cannot be taken back: {exc}"
        try:
            (swap_dir / file).unlink(missing_ok=True)
            fate = "was deleted"
        except OSError:  # a swap folder gone read-only: the file stays, as its index does
            fate = "is left unused"
        if why is not None:
            output.warning(f"episode {name!r}: the swap snapshot the stopped run kept {fate} ({why}); its done "
                           "steps are replayed instead")
    drop_kept(swap_dir)
    if swapped:
        output.debug(f"took back the swap snapshots of {plural(len(swapped), 'episode')} the stopped run had "
                     "swapped out")
    return swapped


def _swap_out_resident(engine: Any, driver: Any, output: Output, signals: Any) -> None:
    """Swap out the sessions resident when a signal stopped the run (or stdout's reader went away), so that
    ``_keep_swapped`` keeps them with the swapped-out ones and --resume restores every partly done episode
    instead of replaying its steps. Only those whose count of consumed steps the runner agrees with: a stop
    between a forward and the rollout's count of it leaves its session to be replayed (and the runner itself
    releases the session whose forward the stop interrupted, and leaves one whose request it cut short). Only
    the swap space left is used. Not after a failure (a bug, a full disk, --fail-fast): the sessions go as before.
    One at a time: a signal meanwhile (``StopSignals.after_stop``: "again to stop at once", several GiB a 14B
    session) stops it after the snapshot being written, and the sessions left replay."""
    if engine.runner.swap is None:  # --swap-space 0: nothing to save them to
        return
    steps = driver.resident_steps()
    ids = [view.session_id for view in engine.runner.sessions() if steps.get(view.session_id) == view.num_requests]
    if ids:  # several GiB a session for a 14B model: say what the wait is, and how to cut it short
        output.info(f"saving {plural(len(ids), 'resident session')} for --resume (another signal skips those not "
                    "saved yet: their episodes replay)")
    # A signal that came before the saving began (SIGHUP delivered twice, to the group and by a shell) skips nothing
    start = len(signals.after_stop)
    swapped: dict[str, int] = {}
    for session_id in ids:
        if len(signals.after_stop) > start:
            # not saved: those left, and any before that did not fit in the swap space or could not be exported
            name = signal.Signals(signals.after_stop[-1]).name
            output.info(f"{name}: stopped saving the resident sessions for --resume: {len(swapped)} saved, "
                        f"{plural(len(ids) - len(swapped), 'session')} not (their episodes replay their done steps)")
            break
        swapped.update(engine.runner.swap_out_sessions([session_id], reason="run_stopped"))
    if ids:
        output.debug(f"swapped out {len(swapped)} of {plural(len(ids), 'resident session')} for --resume to restore "
                     "(the others, if any, did not fit in the swap space left, could not be exported, or a signal "
                     "stopped the saving: they replay)")


def _keep_swapped(engine: Any, steps: dict[str, int], swap_dir: Path, run: float,
                  output: Output) -> dict[str, tuple[str, int]]:
    """Leave the snapshots of the episodes swapped out when the run stopped, with their index, for --resume; {}
    when the index cannot be written (the disk that stopped the run is full, a swap folder gone read-only): a
    warning, the files go, and --resume replays. ``steps``: {episode: steps its session had consumed} of the
    sessions swapped out (the driver's; before it was made, those ``_adopt_kept`` took back)."""
    from ardiff_cli.io.episode import listed
    from ardiff_cli.io.kept import KEPT_FILE, write_kept

    detached = engine.runner.detach_snapshots()
    kept = {name: (file, steps[name]) for name, file in detached.items() if name in steps}
    if kept:
        try:
            write_kept(swap_dir, kept, run=run)
        except OSError as exc:  # the sessions were said swapped out for --resume: say that it replays them instead
            output.warning(f"cannot write {swap_dir / KEPT_FILE} ({exc.strerror or exc}): the swap snapshots of "
                           f"{plural(len(kept), 'episode')} ({listed(list(kept))}) are not kept, so --resume replays "
                           "their done steps instead")
            return {}
    return kept


def _bytes_of(folder: Path, names: Iterable[str]) -> int:
    """The bytes of the files ``names`` in ``folder`` (one gone counts 0)."""
    total = 0
    for name in names:
        with contextlib.suppress(OSError):
            total += (folder / name).stat().st_size
    return total


def _stop_notice(output: Output, monitor: Any) -> Callable[[int], None]:
    """What a first signal during a step shows (on a thread of its own: ``StopSignals``): the run stops once the step
    is done, and how to stop it at once."""
    def notice(signum: int) -> None:
        name = signal.Signals(signum).name
        monitor.set_phase("stopping")
        output.info(f"{name}: finishing the step in flight, then stopping ({'Ctrl-C' if name == 'SIGINT' else name} "
                    "again to stop at once; that step's episode then replays on --resume)")

    return notice


def _nothing_left(p: _Prepared, *, order: str, preview: bool,
                  wall_s: float) -> tuple[dict[str, Any], list[Any]] | None:
    """The summary of a resumed run that has nothing left to run, and its episodes' ends in the order the run gives
    them: every episode's step files are done and it ends whole, as the run would find after loading; ``None``
    when anything is left, or unclear (a folder that cannot be read, a missing or unreadable summary.json to take
    the plan from, a missing preview), so the run goes on as usual and reports it."""
    from ardiff_cli.io.atomic import open_file, parse_json, read_capped
    from ardiff_cli.io.stream import EpisodeEnded, StepScheduler
    from ardiff_cli.rollout import RolloutStats

    try:
        with open_file(p.run.summary_path) as f:
            previous = parse_json(read_capped(f))
        scheduler = StepScheduler(p.episodes, order=order, done=p.done)
        ended = []
        while (item := scheduler.next()) is not None:
            if not isinstance(item, EpisodeEnded) or item.reason == "error":
                return None
            ended.append(item)
    except (OSError, ValueError, ArdiffError):
        return None
    if not isinstance(previous, dict) or not all(isinstance(previous.get(k), dict) for k in ("swap", "capacity_plan")):
        return None
    if preview and not all(p.run.preview_path(e.name).is_file() for e in p.episodes):
        return None
    names = [e.name for e in p.episodes]
    stats = RolloutStats.before_any_step(p.done, names, completed_episodes=names)
    return _summary_of(p.run, p, stats, device=previous.get("device"), plan=previous["capacity_plan"],
                       swap_space=previous["swap"].get("space_bytes", 0), dropped=0, wall_s=wall_s, running_s=0.0,
                       error=None), ended


def _resumed_info(recorded: dict[str, Any], p: _Prepared) -> dict[str, Any]:
    """run.json as a resume that starts writes it: when it was given the episodes (or their folder of episodes) where
    they are now, the paths it reads them from, so that the next ``--resume`` without EPISODE finds them and
    results.jsonl's paths are run.json's; the names, and the steps done (checked against their ``input_sha256``)
    are the run's. Written only once the resume has passed its checks: one refused leaves run.json as it was."""
    paths = {e["name"]: e["path"] for e in p.info["episodes"]}
    episodes = [{**e, "path": paths.get(e["name"], e["path"])} for e in recorded["episodes"]]
    # the config where this resume read it: given again where it is now, or its '..' dropped while the folder before
    # it is there (absolute_path: kept after a link), run.json an ardiff before that wrote (`/x/lab/../fast.yaml`)
    return {**recorded, "episodes": episodes, "watch": p.info["watch"], "resumed_at": time.time(),
            **({"config_path": p.info["config_path"]} if "config_path" in recorded else {})}


def _write_run_info(write: Callable[[], Any], path: Path, *, resume: ResumeCommand | None,
                    results: Path | None = None) -> None:
    """``write`` run.json (and a new run's empty ``results``); a full disk (or a folder gone read-only) is an
    ``OutputError`` naming the file: it was 'an unexpected OSError ... a bug in ardiff', with a traceback.
    ``resume``: a resume's command, which the hint gives to paste (None: a new run, whose command is run again)."""
    from ardiff_cli.errors_cli import OutputError

    try:
        write()
    except OSError as exc:
        if too_many_open_files(exc):  # the process's limit, not the disk's or the folder's
            raise
        if results is not None and exc.filename == str(results):  # run.json was taken back: RunFolder.start
            path = results
        again = continue_with(resume) if resume else "run the same command again (it has no run yet)"
        link = link_to_nothing(path)  # a link named results.jsonl in --out: "No such file or directory" of it misled
        if link:
            raise OutputError(f"cannot write {path}: it is {link}",
                              hint=f"remove that link, or make what it links to, then {again}") from exc
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}",
                          hint=WriteHint("free some space or fix the folder's permissions", again)) from exc


def _write_summary(run: Any, build: Callable[[], dict[str, Any]], output: Output,
                   error: BaseException | None, resume: ResumeCommand) -> dict[str, Any] | None:
    """Write summary.json, as ``build`` makes it from results.jsonl. When that fails too (the disk that stopped the
    run is full, or the open-files limit that stopped it keeps results.jsonl from being read), the run's own error
    stays the one reported: a warning says summary.json is missing, and --resume writes it (None: no summary).
    Its ``warnings`` are this invocation's ``warning:`` lines so far (ardiff's and Python's: a pipeline's, torch's),
    for a script reading ``--format json``, as ``warmup``'s result lists them. ``resume``: the run's, which a hint
    gives to paste."""
    from ardiff_cli.errors_cli import OutputError

    if run.moved():  # writing would re-create the folder, or write into another run's
        message = f"{run.root} was removed or replaced while this run wrote it: summary.json not written"
        if error is None:
            raise OutputError(message, hint="its results.jsonl went with it: run the command again, without --resume")
        output.warning(message)
        return {**build(), "warnings": list(output.warnings)}
    summary = None  # build() failed: nothing to print
    try:
        summary = {**build(), "warnings": list(output.warnings)}
        run.write_summary(summary)
    except OSError as exc:
        if too_many_open_files(exc) and error is None:  # the process's limit, not the disk's or the folder's
            exc.hint = open_files_hint(continue_with(resume))  # it holds run.json: the same command is refused
            raise
        message = f"cannot write {run.summary_path}: {exc.strerror or exc}"
        if error is None:
            raise OutputError(message, hint=WriteHint("free some space or fix the folder's permissions",
                                                      to_paste("--resume writes it", resume))) from exc
        output.warning(f"{message}; --resume writes it")
    return summary


def _failed_episodes(stats: Any, episodes: list[Any], resume: ResumeCommand) -> Exception:
    """Exit 4 when other episodes completed; else 2 when every failure was invalid input, else their code. Every
    episode failed with its folder gone (deleted or renamed while the run read it): 2, saying so, with the way back.
    Every failed one a recording made for another pipeline (``stats.foreign``): the hint is a new run with its
    config, as a resume keeps this run's. ``episodes``: the run's (``EpisodeSource``), those --follow added too."""
    # each one is named on its failed line of results.jsonl and above: 500 names in one line were of no use
    names = first_of(list(stats.failed), MAX_LISTED_EPISODES)
    num_episodes = len(episodes)
    # The run's folder holds the run now, so the same command is refused: the way on is its resume, to paste
    # (a bad file midway, every episode failing so, hinted "see the episode format", of no use at that point)
    # one that ran out of memory: the resume with what its hint asks for (a lower --session-capacity), else pasting it
    # runs into the same error
    again = next((e.resume for e in stats.errors.values() if getattr(e, "resume", None)), resume)
    hint = f"fix what is named above, then continue with: {again}"
    missing = [name for name in stats.failed if name in stats.folders_missing]
    if missing:  # gone since it failed (a recorder's cleanup): a resume refuses a run with an episode folder missing
        one = len(missing) == 1
        hint = (f"fix what is named above; a resume needs the folder{'' if one else 's'} of {', '.join(missing)} "
                f"back at {'its path' if one else 'their paths'} (gone since {'it' if one else 'they'} failed; "
                f"moved: a symlink there to where it is now will do), then continue with: {again}")
    foreign = [e for e in episodes if e.name in stats.foreign]
    all_foreign = not missing and len(foreign) == len(stats.failed)
    new_run, config_note, more_note = _new_run_of(foreign, stats.errors, resume.out) if foreign else ("", "", "")
    one = len(foreign) == 1
    if all_foreign:  # a resume runs them with this run's config again: it fails them the same way
        hint = (f"run {'it' if one else 'them'} with the config {'it was' if one else 'they were'} recorded "
                f"for{config_note}, in another --out (a --resume keeps this run's config){more_note}: {new_run}")
    elif foreign:  # beside other failures, which the resume goes on with: the resume fails these alike
        hint += (f"; {first_of([e.name for e in foreign], MAX_LISTED_EPISODES)} {'was' if one else 'were'} recorded "
                 f"for another pipeline: run {'it' if one else 'them'} with {'its' if one else 'their'} "
                 f"config{config_note}, in another --out{more_note}: {new_run}")
    if stats.completed_episodes:
        partial = EpisodesFailed(f"{len(stats.failed)} of {plural(num_episodes, 'episode')} failed: {names}; "
                                 "the others completed")
        partial.hint = hint
        return partial
    message = f"every episode failed ({names})"
    if all_foreign:
        message += (f": {'its first step file holds' if one else 'their first step files hold'} no array of this run's "
                    "pipeline")
    if missing and all(isinstance(e, ObservationError) for e in stats.errors.values()):
        hint = None  # failed on its input, then deleted (a recorder's cleanup): no run to go on with
    if stats.failed.keys() <= stats.folders_gone:
        one = len(stats.failed) == 1
        message += (f": {'its folder is' if one else 'their folders are'} gone (deleted or renamed while the run read "
                    f"{'it' if one else 'them'})")
        hint = (f"put {'it' if one else 'each'} back at its path (moved: a symlink there to where it is now will do), "
                f"then continue with: {again}")
    errors = list(stats.errors.values())
    if all(isinstance(e, ObservationError) for e in errors):
        return ObservationError(message, hint=hint)
    failed = EpisodesFailed(message, exit_code=max(exit_code_for(e) for e in errors))
    failed.hint = hint  # None: the table's
    return failed


MAX_LISTED_EPISODES = 8  # episode folders a new-run hint lists one by one; past that, whole folders, then the first


def _new_run_of(foreign: list[Any], errors: dict[str, Exception], out: Any) -> tuple[str, str, str]:
    """The command that runs the episodes recorded for another pipeline (``foreign``, each failed with a
    ``ForeignRecording`` in ``errors``) with their own config, and two notes for the hint before it: which config
    (the one built-in config whose schema takes every first step file's arrays is named in the command; none or
    several, CONFIG is, and the note says so), and what the command leaves out.

    Up to ``MAX_LISTED_EPISODES`` episodes are listed one by one. More: a folder of episodes stands for its episodes
    when a rollout given it finds those very episodes there and no other (``discover_episodes``, which the command
    runs); then the first ``MAX_LISTED_EPISODES`` words, and a note naming how many more, and where (their failed
    lines in the results.jsonl of ``out``, the run's folder). A shell glob could match an episode that is not one of
    them, so none is given."""
    from ardiff_cli.io.run import RESULTS_FILE
    from ardiff_cli.io.validate import ForeignRecording
    from ardiff_cli.runtime.config import builtin_schemas
    from ardiff_cli.runtime.observation import takes_layout

    layouts = [getattr(errors.get(e.name), "layout", None) for e in foreign]
    schemas = builtin_schemas() if all(layouts) else {}
    taking = [name for name, schema in schemas.items() if all(takes_layout(schema, lay) for lay in layouts)]
    their = "its" if len(foreign) == 1 else "their"
    config = taking[0] if len(taking) == 1 else "CONFIG"
    if len(taking) == 1:
        config_note = f" ({config}: the one built-in config whose schema takes {their} arrays)"
    elif taking:
        config_note = f" (CONFIG: {' or '.join(taking)}, whose schemas all take {their} arrays)"
    elif any(takes_layout(schema, lay) for schema in schemas.values() for lay in layouts):
        config_note = " (CONFIG: no one built-in config takes them all)"
    else:
        config_note = f" (CONFIG: no built-in config's schema takes {their} arrays)"
    words = [(shell_word(e.path), 1) for e in foreign]  # (word, episodes it runs)
    if len(words) > MAX_LISTED_EPISODES:
        groups: dict[Path, list[Any]] = {}
        for e in foreign:
            groups.setdefault(e.path.parent, []).append(e)
        words = []
        for parent, group in groups.items():
            if len(group) > 1 and _runs_exactly(parent, group):
                words.append((shell_word(parent), len(group)))
            else:
                words += [(shell_word(e.path), 1) for e in group]
    given = words[:MAX_LISTED_EPISODES]
    more_note = ""
    if len(given) < len(words):
        left = sum(n for _, n in words[len(given):])
        more_note = (f"; this runs {plural(sum(n for _, n in given), 'episode')} of {len(foreign)}: the other {left} "
                     f"are on the lines of error_type {ForeignRecording.__name__} in "
                     f"{as_typed(Path(out) / RESULTS_FILE)}")
    return f"ardiff rollout {config} {' '.join(w for w, _ in given)} --out NEW", config_note, more_note


def _runs_exactly(folder: Path, episodes: list[Any]) -> bool:
    """Whether a rollout given ``folder`` runs ``episodes`` and no other: it is a folder of episodes, and those are
    the episodes found in it now."""
    from ardiff_cli.io.episode import discover_episodes

    try:
        found = discover_episodes([folder])
    except (ArdiffError, OSError):  # gone, or one of ardiff's outputs: a rollout refuses it
        return False
    return sorted(e.path.resolve() for e in found) == sorted(e.path.resolve() for e in episodes)


def _close_engine(engine: Any, output: Output, error: BaseException | None) -> None:
    """Release every session the run did not keep, their ``session_closed`` events saying what ended the run
    (``error``, as summary.json's status says it): ``run_stopped`` (interrupted: a signal, stdout's reader gone),
    ``run_failed`` (any other error: --fail-fast, a full disk, a bug), else ``explicit``. A failing close hook is
    a warning here, never the run's error: the KV was released regardless, and an interrupted or failed run must
    keep its own exit code."""
    from ardiff_cli.runtime.errors import ArdiffError

    reason = {"ok": "explicit", "interrupted": "run_stopped"}.get(_run_status(error), "run_failed")
    try:
        engine.close(reason=reason)
    except ArdiffError as exc:
        output.warning(str(exc))


def _summary(run: Any, p: _Prepared, engine: Any, stats: Any, plan: Any, wall_s: float, running_s: float,
             error: BaseException | None, kept: int, changes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    swap = engine.runner.swap  # a loaded engine (past its warmup): its runner (closed by now) is there
    return _summary_of(run, p, stats, device=str(engine.device),  # resolved, as run.json has it
                       plan=None if plan is None else plan.to_dict(),
                       swap_space=0 if swap is None else swap.budget_bytes,
                       dropped=0 if swap is None else swap.num_dropped, wall_s=wall_s, running_s=running_s,
                       error=error, kept=kept, changes=changes)


def _run_status(error: BaseException | None) -> str:
    """How a run ended (``error``: what ended it), as summary.json's status says it: ``ok``, ``interrupted`` (a
    signal, stdout's reader gone), ``partial`` (some episodes failed, the others ran), else ``failed``."""
    from ardiff_cli.errors_cli import EXIT_PARTIAL

    if error is None:
        return "ok"
    if isinstance(error, (Interrupted, KeyboardInterrupt)):
        return "interrupted"
    if isinstance(error, EpisodesFailed) and error.exit_code == EXIT_PARTIAL:
        return "partial"
    return "failed"


def _summary_of(run: Any, p: _Prepared, stats: Any, *, device: str | None, plan: dict[str, Any] | None,
                swap_space: int, dropped: int, wall_s: float, running_s: float, error: BaseException | None,
                kept: int = 0, changes: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """summary.json of a run whose counters are ``stats`` (a ``RolloutStats``); ``wall_s`` is the whole run's time,
    ``running_s`` that of running its steps (the rate's)."""
    from ardiff_cli.io.run import build_summary

    status = _run_status(error)
    summary = build_summary(
        run.iter_records(continue_with(p.resume)), episodes=[e.name for e in p.episodes], failed=stats.failed,
        info={**p.info, "device": device}, plan=plan,
        this_run={"steps": stats.steps, "skipped": stats.skipped, "replayed": stats.replayed,
                  "evictions": stats.evictions, "completed_episodes": stats.completed_episodes,
                  "timed_out": stats.timed_out, "late_steps": stats.late_steps,
                  "rewritten_steps": stats.rewritten_steps,
                  "restored": stats.restored},
        wall_s=wall_s, running_s=running_s, status=status, exit_code=0 if error is None else exit_code_for(error),
        root=run.root)
    summary["swap"] = {"space_bytes": swap_space, "swapped_out": stats.swapped_out, "swap_failed": stats.swap_failed,
                       "restored": stats.restored, "restore_failed": stats.restore_failed, "dropped": dropped,
                       "kept": kept}  # snapshots left in OUT/.swap for --resume to restore
    summary["hook_errors"] = list(stats.hook_errors)  # pipeline reset/close hooks that raised (KV released anyway)
    # a resume's warning that its ardiff, torch or threads are not run.json's, for a script (--format json too)
    summary["resume_changes"] = dict(changes or {})
    return summary


def render_summary(s: dict[str, Any], plain: bool, *, gone: bool = False):
    """The summary's lines; ``gone``: the run's folder was removed or replaced while it wrote it, and the last line
    says so instead of naming it as the place of the outputs (``outputs: DIR``, the folder a hint says to --resume)."""
    from rich.console import Group
    from rich.text import Text

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f} ms"

    episodes, steps, latency = s["episodes"], s["steps"], s["latency_s"]
    # The rate is of the steps' time (running_s), as the live display's; wall_s adds the load, warmup and teardown
    rate = f"{s['steps_per_s']:.1f} steps/s" if s.get("steps_per_s") else "-"
    plan = s.get("capacity_plan") or {}
    # what is there: a full disk may have refused summary.json (a warning said so)
    written = [] if gone else [name for name in ("results.jsonl", "summary.json") if Path(s["out"], name).is_file()] + [
        f"{folder}/" for folder in ("episodes", "previews") if Path(s["out"], folder).is_dir()]
    out = one_line(visible(as_typed(s["out"])))
    lines = [
        f"rollout {s['status']}: {plural(steps['this_run'], 'step')} in {s['running_s']:.1f} s ({rate}); "
        f"episodes {episodes['completed']} completed"
        + (f" ({len(episodes['timed_out'])} ended by --idle-timeout)" if episodes.get("timed_out") else "")
        + f", {episodes['failed']} failed, "
        f"{episodes['incomplete']} incomplete",
        f"time {s['wall_s']:.1f} s in all, {s['running_s']:.1f} s of it running steps",
        f"latency p50 {ms(latency['total']['p50'])}, p90 {ms(latency['total']['p90'])}, "
        f"p99 {ms(latency['total']['p99'])} (forward p50 {ms(latency['forward']['p50'])})",
        f"sessions: capacity {plan.get('session_capacity', '-')}, {plural(s['evictions_this_run'], 'eviction')}, "
        + (f"{steps['restored']} restored from swap, " if steps.get("restored") else "")
        + f"{plural(steps['replayed'], 'step')} replayed to rebuild sessions"
        + (f", {plural(steps['skipped_done'], 'step')} already done" if steps["skipped_done"] else ""),
        # the folder to read or --resume: one line, as Error: lines (a newline in it read as another folder), and
        # ./~ and ./-x (a hint says to give --out from it: ~/x copied named the home folder's x; -x is refused)
        f"{out} no longer holds this run's outputs: it was removed or replaced while the run wrote it" if gone else
        f"outputs: {out}" + (f" ({', '.join(written)})" if written else ""),
    ]
    if plain:
        return Text("\n".join(lines))
    text = Text("\n".join(lines[:-1]))
    text.stylize("bold", 0, len(lines[0]))
    # in a terminal, one line however long, which the terminal wraps (Rich broke it in the folder's name)
    return Group(text, Text(lines[-1], no_wrap=True, overflow="ignore"))
