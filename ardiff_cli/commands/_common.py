"""What several commands share: reading the config with command-line overrides, the hint for a plan that does not
fit, the stop between warmup requests. Torch-free."""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ardiff_cli.errors_cli import budget_change
from ardiff_cli.options import DEFAULT_CONFIG
from ardiff_cli.runtime.errors import ConfigError, ResumeCommand, as_typed, joined, quoted, shell_word


def load_engine_config(config: str | None, *, pipeline: str | None = None, command: str = "rollout",
                       episodes: Sequence[Path] = (), given: str = "", asked: ResumeCommand | None = None,
                       plan_only: bool = False, **overrides: Any):
    """The validated ``EngineConfig`` of CONFIG (a path or built-in name) with runtime ``overrides`` applied.

    ``pipeline`` is ``--pipeline`` (a registered name or MODULE:CLASS). ``None``
    overrides keep the config's value; enum options are passed by value. ``command``: the one whose usage a hint
    shows (rollout's folder is its episodes, given without CONFIG before them); ``episodes``: rollout's other
    arguments, where a config given after the folder is (the hint then puts it first); ``given``: its options, as
    :func:`options_given` writes them, which that hint keeps; ``asked``: rollout's options a resume takes, which the
    resume a run's folder given as CONFIG is hinted keeps (``run_output``'s); ``plan_only``: as
    ``load_config``'s (a checkpoint not found here is noted, not refused).
    """
    from ardiff_cli.runtime.config import builtin_configs, load_config, path_kind

    if config == "":  # Path("") is the current folder
        raise ConfigError("CONFIG is an empty string; the first argument is a config file or a built-in config name",
                          hint=f"omit it for the default ({DEFAULT_CONFIG}), or check the variable that should hold it")
    # a folder named like a built-in config (`-o dreamzero-tiny`) is never a config: the built-in is meant, but by a
    # rollout given no episode folder, which may mean that folder's episodes
    if config is not None and path_kind(Path(config), "CONFIG") == "folder" and not (
            (command != "rollout" or episodes) and config in builtin_configs()):
        hint = (f"pass the config first: ardiff rollout {_config_among([Path(config), *episodes])}{given}"
                if command == "rollout"
                else f"pass a config file or a built-in config name, e.g. ardiff {command} {DEFAULT_CONFIG}")
        if command == "rollout":  # `ardiff rollout runs/eval1`: the run to finish, which as an EPISODE is refused
            from ardiff_cli.io.episode import run_output

            if (found := run_output(Path(config), episodes=episodes, asked=asked)) is not None:
                which = ("its run" if found.what == "an ardiff run folder" else
                         "its one run" if isinstance(found.again, ResumeCommand) else "one of its runs")
                # only the .lock, which a resume refuses: the run is started again
                again = found.restart if found.why is not None else found.finish(which)
                hint = f"it is {found.what} (what a rollout wrote); {again}"
        raise ConfigError(
            f"CONFIG {quoted(config)} is a folder; the first argument is a config file or a built-in config name",
            hint=hint)
    if config is not None and (what := _episode_file(Path(config))) is not None:  # it read "unknown key 'prompt'"
        folder = Path(config).parent
        raise ConfigError(
            f"CONFIG {quoted(config)} is {what} of the episode {as_typed(folder)}, not a config: the first argument "
            "is a config file or a built-in config name",
            hint=(f"pass the config first, then the episode's folder: ardiff rollout "
                  f"{_config_among([folder, *episodes])}{given}" if command == "rollout"
                  else f"pass a config, e.g. ardiff {command} {DEFAULT_CONFIG}"))
    suffix = Path(config).suffix.lower() if config is not None else ""
    pickled = suffix in (".pt", ".pth", ".ckpt", ".bin")  # torch.save's checkpoints
    if suffix in (".safetensors", ".npz") or pickled:  # binary: it read "not UTF-8 text (byte 0: ...)"
        raise ConfigError(
            f"CONFIG {quoted(config)} is a {suffix} file, not a config: the first argument is a config file or a "
            "built-in config name",
            hint=(f"pass the config first: ardiff rollout {DEFAULT_CONFIG} {shell_word(Path(config).parent)}"
                  f"{given}; "
                  if command == "rollout" and not pickled
                  else f"pass a config, e.g. ardiff {command} {DEFAULT_CONFIG}; ")
            + "a checkpoint goes in the config's `checkpoint:` field"
            + (", converted to .safetensors (ardiff never unpickles a file)" if pickled else ""),
        )
    values = {k: getattr(v, "value", v) for k, v in overrides.items()}
    return load_config(config if config is not None else DEFAULT_CONFIG, pipeline=pipeline,
                       plan_only=plan_only).with_runtime(**values)


def refuse_what_this_machine_lacks(cfg: Any, *, device: str | None, attention_backend: str | None) -> None:
    """What the config's runtime asks for that this machine lacks, refused before the model loads, as the load would:
    a CUDA device (none, or an index past those visible), and an attention backend ``vllm`` that cannot run here
    (not installed, or not on this device, dtype or head size). A ``ConfigError`` naming what asked for it: the
    config's ``runtime.device`` or ``runtime.attention_backend`` where the option (``device``, ``attention_backend``:
    the options' values) did not give it. Said as for the option, it left a config written on another machine
    unnamed."""
    runtime = cfg.runtime
    if not runtime.device.startswith("cuda") and runtime.attention_backend != "vllm":
        return
    from ardiff_cli.runtime.errors import running_out_of_memory_names

    with running_out_of_memory_names("importing torch"):  # the command's first import of torch
        from ardiff_cli.runtime.engine import resolve_device

    with config_field_named(cfg, "device", device):
        resolved = resolve_device(runtime.device)
    if runtime.attention_backend == "vllm":
        from ardiff_cli.runtime.kv.layout import KVLayout

        refuse_a_backend_not_here(cfg, resolved.type, attention_backend, KVLayout.from_spec(cfg.kv_cache_spec()))


def refuse_a_backend_not_here(cfg: Any, device_type: str, given: str | None, layout: Any) -> str:
    """An attention backend ``vllm`` that cannot run on ``device_type``, refused as the load's selection would (its
    ``ConfigError``, with the config's ``runtime.attention_backend`` named where ``given``, the option's value, is
    None); else the backend expected there, ``"torch"`` or ``"vllm"``. Looked up, not imported (``expected_backend``,
    with ``layout``, the config's ``KVLayout``), before vLLM is asked."""
    from ardiff_cli.runtime.kv.backends import expected_backend, select_attention_backend

    runtime = cfg.runtime
    backend, _ = expected_backend(runtime.attention_backend, device_type, layout, runtime.dtype)
    if backend != "error":
        return backend
    with config_field_named(cfg, "attention_backend", given):
        select_attention_backend(runtime.attention_backend, device_type, dtype=runtime.dtype, layout=layout)
    raise AssertionError(f"expected_backend said 'error' on {device_type} but selection succeeded: the two disagree")


@contextlib.contextmanager
def config_field_named(cfg: Any, field: str, given: str | None) -> Iterator[None]:
    """A ``ConfigError`` raised inside about the value of ``runtime.FIELD``, as ``CONFIG: field 'runtime.FIELD': ...``
    where the option (``given``, its value) did not set it; its hint, which ends with the option to use, then says
    that the option overrides the config's. One given is left as it is: the option named it."""
    try:
        yield
    except ConfigError as exc:
        if given is not None:
            raise
        raise ConfigError(f"{as_typed(cfg.source)}: field 'runtime.{field}': {exc}",
                          hint=f"{exc.hint}, which overrides the config's; or change runtime.{field} in "
                               f"{as_typed(cfg.source)}") from None


def budget_source(given: object, cfg: Any) -> str | None:
    """What set ``cfg``'s memory budget, for a hint (``budget_change`` words it): ``--memory-budget`` (``given``, the
    option's value), the config's ``runtime.memory_budget``, or None (no budget: the device's free memory)."""
    if given is not None:
        return "--memory-budget"
    return "runtime.memory_budget" if cfg.runtime.memory_budget is not None else None


def does_not_fit_hint(cfg: Any, source: str, *, window_helps: bool) -> str:
    """What the user of this command can change when one session does not fit (inspect-capacity's plan, warmup's
    load with a memory budget): the memory planned with (by the option that set it: ``--memory-budget`` is not read
    when ``--available`` is given), ``--dtype`` when a smaller one exists, and the config's window fields where its
    model has them and a smaller window could fit."""
    if source == "--available":
        fixes = ["a larger --available (the memory of a device the config is meant for)"]
    elif source in ("--memory-budget", "runtime.memory_budget"):
        fixes = [budget_change(source, "larger")]
    else:
        fixes = ["--available BYTES (the free memory of a device larger than this one)"]
    if cfg.runtime.dtype == "float32":
        fixes.append("--dtype bfloat16 (half the bytes)")
    fields = [f"model.{name}" for name in ("window_frames", "sink_frames")
              if window_helps and type(getattr(cfg.model, name, None)) is int and getattr(cfg.model, name) > 0]
    fixes.append(f"a smaller {joined(fields, 'or')} in the config" if fields else "a smaller model in the config")
    return f"plan with {joined(fixes, 'or')}"


def beyond_device_hint(source: str, *, resume: bool = False) -> str:
    """The hint of a memory budget whose plan needs more than the device has in all (``BudgetBeyondDeviceError``),
    naming what set the budget: ``source`` as ``budget_source`` gives it, or a resumed run's ``OUT/run.json``."""
    leave = "" if resume else ", or leave the budget out to plan with the free memory"
    return (f"plan with {budget_change(source, 'smaller', resume=resume)} or --session-capacity{leave}; "
            "`ardiff inspect-capacity` plans for any amount")


def _episode_file(path: Path) -> str | None:
    """What file of an episode ``path`` is (``the episode.yaml``, ``a step file``), else None: an episode.yaml beside
    a step file or END (a config a user named episode.yaml is none), or a step file named step_... or beside an
    episode.yaml or END (a checkpoint's model-00001-of-00002.safetensors is none); not a run's output step, in its
    episodes/ folder."""
    from ardiff_cli.io.episode import END_MARKER, METADATA_FILE, episode_entries, is_run_output, is_step_file

    if not os.path.isfile(path) or is_run_output(path.parent.parent.parent):  # a run's output step: RUN/episodes/EP/
        return None
    if path.name == METADATA_FILE:
        if any(name != METADATA_FILE for name in episode_entries(path.parent)):
            return f"the {METADATA_FILE} (its prompt and metadata)"
        return None
    beside = any(os.path.exists(path.parent / name) for name in (METADATA_FILE, END_MARKER))
    if is_step_file(path) and (path.name.lower().startswith("step") or beside):
        return "a step file (one step's observations)"
    return None


def _config_among(arguments: Sequence[Path]) -> str:
    """Rollout's arguments as a shell would take them, the config first: the YAML file among them (given after the
    episodes), else the default's name; then the others, in their order."""
    from ardiff_cli.runtime.config import path_kind

    yaml = [a for a in arguments if a.suffix.lower() in (".yaml", ".yml") and path_kind(a, "argument") == "file"]
    config = str(yaml[0]) if yaml else DEFAULT_CONFIG
    # a folder named like the default config is written ./NAME: "ardiff rollout dreamzero-tiny" repeated the command
    others = [f"./{a}" if str(a) == config and not yaml else str(a) for a in arguments if not yaml or a != yaml[0]]
    return " ".join(map(shell_word, [config, *others]))


def options_given(ctx: Any) -> str:
    """The options of the command line ``ctx`` (a ``typer.Context``) runs, with their values and in their order, each
    word as the shell takes it and after a space; its CONFIG and EPISODE words left out ('' for a command not run by
    ardiff's ``main``, whose command line ``ctx.obj`` is: run in process, sys.argv is another program's). A hint that
    gives the command again, the config put first, keeps them: it left out `-o runs/eval1 --follow`, and pasted, the
    run went to ./ardiff-runs/<time> and did not follow."""
    args = ctx.obj
    if not isinstance(args, list) or ctx.info_name not in args:
        return ""
    takes_value = {name for param in ctx.command.params
                   if param.param_type_name == "option" and not getattr(param, "is_flag", False) for name in param.opts}
    kept: list[str] = []
    value_next = False
    for word in args[args.index(ctx.info_name) + 1:]:
        if word == "--" and not value_next:  # the rest are arguments
            break
        if value_next or (word.startswith("-") and word != "-"):
            # a value written as typed ('~/runs' quoted is the home folder's, as ardiff reads it), else one shell word
            kept.append(shell_word(word) if value_next and word[:1] not in "-~" else shlex.quote(word))
            # `--out DIR`, `-o DIR`, `-qo DIR` (short options run together: the first taking a value takes the rest
            # of the word, or the next word where it is last); not `--out=DIR`, `-oDIR`
            short = [i for i, c in enumerate(word) if i and f"-{c}" in takes_value][:1]
            value_next = not value_next and (word in takes_value if word.startswith("--") else short == [len(word) - 1])
    return "".join(f" {word}" for word in kept)


def check_working_folder() -> None:
    """A current folder that was deleted (the shell still in it) is an error before anything runs: a relative path
    in it was a FileNotFoundError traceback as a bug in ardiff, the default --out was named as the user's --out, and
    loading the model ended the process with exit 2 and only "Intel oneMKL FATAL ERROR: Cannot load
    libtorch_cpu.so" (torch's import there)."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise ConfigError("the current folder no longer exists (it was deleted while this shell was in it)",
                          hint="cd to a folder that exists, then run the command again") from None


def refuse_contradictions(*, quiet: bool = False, verbose: bool = False, **given: Any) -> None:
    """Options that contradict each other are a usage error (exit 2) naming both, never a silent choice."""
    if quiet and verbose:
        raise ConfigError("--quiet and --verbose contradict each other (silence progress, or show debug lines)",
                          hint="pass one of them")
    if given.get("idle_timeout") is not None and not given.get("follow"):
        raise ConfigError("--idle-timeout has no effect without --follow (episodes end when their files run out)",
                          hint="add --follow to watch the folders, or drop --idle-timeout")


def config_label(config: str | None) -> str:
    return config if config is not None else DEFAULT_CONFIG


def image_size(model_config: Any) -> tuple[int, int]:
    """The model's frame size (height, width), for demo episodes; 64x64 when the config has none."""
    height, width = getattr(model_config, "height", None), getattr(model_config, "width", None)
    if isinstance(height, int) and isinstance(width, int):
        return height, width
    return 64, 64


def stop_between_requests(signals: Any) -> Callable[[Any], None]:
    """A runtime subscriber that raises, at the end of each request, a stop deferred to a safe point (``signals``'
    ``defer``: stdout's reader gone): the runner lets a stop raised by a subscriber through once the event is out.
    ``warmup`` and ``rollout``'s warmup stop so at the end of the request in flight."""
    def subscriber(event: Any) -> None:
        if event.kind == "request_finished":
            signals.check_signal()

    return subscriber
