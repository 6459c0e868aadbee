"""``ardiff warmup``: load a pipeline, run its warmup requests, report their times and the pool."""

from __future__ import annotations

import contextlib
import math
import shlex
import statistics
from collections.abc import Iterator
from typing import Any

from ardiff_cli.commands._common import (
    beyond_device_hint,
    budget_source,
    check_working_folder,
    config_label,
    does_not_fit_hint,
    load_engine_config,
    refuse_contradictions,
    refuse_what_this_machine_lacks,
    stop_between_requests,
)
from ardiff_cli.errors_cli import (
    EXIT_PARTIAL,
    EVERY_EXIT_CODE,
    Interrupted,
    exit_codes_help,
    handle_errors,
    lighter_run_hint,
    pages_short,
    weights_run_hint,
)
from ardiff_cli.options import (
    ConfigArg,
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    HelpOpt,
    AttentionBackendOpt,
    GpuMemoryFractionOpt,
    MemoryBudgetOpt,
    PipelineOpt,
    QuietOpt,
    SessionCapacityOpt,
    VerboseOpt,
)
from ardiff_cli.output import Format, Output, lost_stdout_stop
from ardiff_cli.runtime.errors import (
    KV_POOLS_PHASE,
    WEIGHTS_PHASE,
    ArdiffError,
    BudgetBeyondDeviceError,
    CapacityError,
    is_out_of_memory,
    running_out_of_memory_names,
)

HELP = (
    "Load the pipeline and run its warmup requests (each input shape it will see); print each request's inputs "
    "and time, the first request's time versus the steady state (the median of the requests of a shape seen "
    "before), and confirm that the KV pool was restored."
)
EXIT_CODES = EVERY_EXIT_CODE - {EXIT_PARTIAL}  # no episodes: never 4 (141: stdout's reader gone, lost_stdout_stop)
EPILOG = f"""Examples:

  ardiff warmup

  ardiff warmup causal-world-tiny --device cpu

  ardiff warmup my_config.yaml --dtype bfloat16 --format json

{exit_codes_help(EXIT_CODES)}"""


def warmup(
    config: ConfigArg = None,
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
    """Warm the pipeline up and report (help text: ``HELP``)."""
    out = Output.create(format, quiet=quiet, verbose=verbose and not quiet)  # both: refused
    with handle_errors(out):
        check_working_folder()
        from ardiff_cli.monitor import RunMonitor
        from ardiff_cli.panels import render
        from ardiff_cli.signals import StopSignals

        refuse_contradictions(quiet=quiet, verbose=verbose)
        cfg = load_engine_config(config, pipeline=pipeline, command="warmup", device=device, dtype=dtype,
                                 memory_budget=memory_budget, session_capacity=session_capacity,
                                 gpu_memory_fraction=gpu_memory_fraction, attention_backend=attention_backend)
        monitor = RunMonitor(out, f"ardiff warmup · {config_label(config)}", echo_requests=True, noun="request",
                             counted_phases=("warmup",))
        out.info(f"loading {config_label(config)} (pipeline {cfg.pipeline_name})")
        out.debug(f"config {cfg.source}: {cfg.runtime}")
        with (_run_again_when_stopped(), StopSignals() as signals, out.live(lambda: render(monitor.snapshot())),
              monitor.ending()):
            with running_out_of_memory_names("importing torch"):
                from ardiff_cli.runtime.engine import ARDiffusionEngine

            signals.check()  # a signal that arrived while torch imported
            # as the load would, naming the config's field that asked for it
            refuse_what_this_machine_lacks(cfg, device=device, attention_backend=attention_backend)
            # `ardiff warmup --format json | head -1`: once the reader is gone, stop as a rollout does (exit 141), at
            # the end of a request; a stdout that fails otherwise (a full disk) ends it once the warmup is done
            out.on_stdout_lost = lambda exc: signals.defer(lost_stdout_stop(exc))
            engine = ARDiffusionEngine(cfg)
            engine.subscribe(monitor.on_event)
            engine.subscribe(_RequestCounter(monitor))
            engine.subscribe(stop_between_requests(signals))  # after the line and the count of its request
            plan = None
            try:
                try:
                    plan = engine.load()
                except CapacityError as exc:  # without a budget, the runner's hint names the device's free memory
                    source = budget_source(memory_budget, cfg)
                    if source is not None:
                        exc.hint = does_not_fit_hint(cfg, source, window_helps=exc.window_helps)
                    raise
                except BudgetBeyondDeviceError as exc:  # the runner's hint cannot tell the option from the config
                    exc.hint = beyond_device_hint(budget_source(memory_budget, cfg))
                    raise
                signals.check()
                monitor.refresh(engine.runner)
                monitor.set_phase("warmup")
                report = engine.warmup()
                signals.check()  # not a report of a warmup a stop was raised into
                monitor.refresh(engine.runner)
                monitor.set_phase("done")
                usage = engine.runner.pool_usage()
            except BaseException as exc:  # memory out: in the pools or the requests only what shrinks them, by the
                # plan; in the weights, before the pools, only the model's dtype or size
                if pages_short(exc) and plan is not None:  # not memory: the plan's pages, in a pool of its own
                    exc.hint = _pages_hint(plan, config, memory_budget=memory_budget, pipeline=pipeline,
                                           device=device, dtype=dtype, gpu_memory_fraction=gpu_memory_fraction,
                                           attention_backend=attention_backend)
                if is_out_of_memory(exc) and not isinstance(exc, ArdiffError) and not pages_short(exc):
                    phase = getattr(exc, "ardiff_while", None)
                    with contextlib.suppress(MemoryError):
                        if plan is not None or phase == KV_POOLS_PHASE:
                            exc.hint = lighter_run_hint(budget_source(memory_budget, cfg), plan, cfg.runtime.dtype)
                        elif phase == WEIGHTS_PHASE:  # before the pools: the model's dtype or size, not the pools
                            exc.hint = weights_run_hint(cfg.runtime.dtype)
                raise
            finally:
                # the outcome is decided: a signal from here on is only recorded, as a rollout's (a Ctrl-C as the
                # result printed lost it from stdout and exited 130 after a warmup that was done)
                signals.hold()
                out.on_stdout_lost = None
                engine.close()
        with signals:  # held since ``hold``: after the live display, so the two never interleave
            data = warmup_data(report, usage, config=config_label(config), device=str(engine.device),
                               dtype=cfg.runtime.dtype, pipeline=cfg.pipeline_name)
            if not report.skipped and not report.timings:  # a provider that yields nothing is likely a mistake
                out.warning(f"pipeline {cfg.pipeline_name!r}: ar_diffusion_warmup_requests() yielded no requests: "
                            "nothing was warmed up (the first real requests pay the one-time costs)")
            data["warnings"] = list(out.warnings)  # the runtime's too (handle_errors shows them through out.warning)
            out.result(data, lambda plain: render_warmup(data, plain))


def _pages_hint(plan: Any, config: str | None, **given: Any) -> str:
    """The hint of the KV page pool running short in the warmup requests, which have the pool to themselves: the
    plan (or the pipeline's KV spec) undercounts their pages, which no smaller pool or dtype mends; a pool planned for
    more sessions holds more pages, so twice the sessions (and the budget that holds them, where the budget limits the
    plan) is the warmup to paste. ``given``: the options this warmup was given (None: not given), in the command."""
    from ardiff_cli.errors_cli import to_paste
    from ardiff_cli.runtime.capacity import MAX_BYTE_SIZE, MAX_SESSIONS, budget_of
    from ardiff_cli.runtime.errors import shell_word

    undercount = ("the KV page pool, sized by the capacity plan, ran short in the pipeline's warmup requests, which "
                  "had it to themselves: the pipeline's KV spec or ardiff's plan undercounts their pages (report it, "
                  "with the --verbose traceback), which no smaller pool or dtype mends")
    if plan.session_capacity >= MAX_SESSIONS:
        return undercount
    sessions = min(2 * plan.session_capacity, MAX_SESSIONS)
    change = {"session_capacity": str(sessions)}
    why = f"a pool planned for {sessions} sessions holds more pages: run again with --session-capacity {sessions}"
    needed = plan.required_bytes(sessions)
    if needed > plan.budget_bytes:  # the budget limits the plan: a larger one holds them
        # the sessions beyond the first take gpu_memory_fraction of the budget (plan_capacity): the plan's bytes as
        # the budget planned one session again under 0.3, and the warmup pasted ran short again, with this hint
        mib = math.ceil(needed / plan.gpu_memory_fraction / 2**20)
        while budget_of(mib * 2**20, plan.gpu_memory_fraction) < needed:  # its rounding, as the planner's
            mib += 1
        if mib * 2**20 > MAX_BYTE_SIZE:  # no budget can be given that holds them
            return undercount
        change["memory_budget"] = f"{mib} MiB"
        why += f" and a --memory-budget of {change['memory_budget']} that holds them"
    words = ["ardiff", "warmup", *([] if config is None else [shell_word(config)])]
    for name, value in {**given, **change}.items():
        if value is not None:
            words += [f"--{name.replace('_', '-')}", shlex.quote(str(value))]
    return to_paste(f"{undercount}; {why}", " ".join(words))


@contextlib.contextmanager
def _run_again_when_stopped() -> Iterator[None]:
    """A stopped warmup keeps nothing to continue from: its hint is to run it again, not the rollout's --resume
    (which warmup does not take)."""
    try:
        yield
    except Interrupted as exc:
        exc.hint = exc.hint or "warmup keeps nothing: run the same command again"
        raise


class _RequestCounter:
    """Counts finished warmup requests for the progress line."""

    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor
        self.count = 0

    def __call__(self, event: Any) -> None:
        if event.kind == "request_finished":
            self.count += 1
            self.monitor.set_progress(done=self.count)


def warmup_data(report: Any, usage: Any, **context: Any) -> dict[str, Any]:
    from ardiff_cli.runtime.observation import describe_shape

    # each request's inputs by name: a list of ints for a tensor's shape, null for one that has none (a prompt)
    requests = [{"request_id": rid, "shape": shape, "seconds": seconds}
                for (rid, _, seconds), shape in zip(report.timings, report.input_shapes, strict=True)]
    first = requests[0]["seconds"] if requests else None
    # Steady state: requests whose input shapes were seen before (the first of each shape pays one-time costs).
    seen: set[str] = set()
    repeats = []
    for request in requests:
        key = describe_shape(request["shape"])
        if key in seen:
            repeats.append(request["seconds"])
        seen.add(key)
    steady = statistics.median(repeats) if repeats else None
    return {
        "kind": "warmup", **context, "skipped": report.skipped, "requests": requests, "first_s": first,
        "steady_s": steady, "steady_count": len(repeats), "seconds": report.seconds, "restored": report.restored,
        "pages_free": usage.num_free, "pages_total": usage.num_pages,
    }


def render_warmup(data: dict[str, Any], plain: bool):
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from ardiff_cli.output import as_text, visible
    from ardiff_cli.runtime.errors import plural
    from ardiff_cli.runtime.observation import describe_shape

    title = visible(f"warmup: {data['config']} (pipeline {data['pipeline']}) on {data['device']}, {data['dtype']}")
    if data["skipped"]:
        return Text(f"{title}\nthe pipeline has no warmup provider: nothing to warm up")
    table = Table(box=None if plain else box.SIMPLE_HEAD, header_style="bold", pad_edge=False)
    table.add_column("request")
    table.add_column("inputs", overflow="fold")  # every input shape whole, however narrow the terminal
    table.add_column("time", justify="right")
    for request in data["requests"]:
        # the pipeline's request ids and input names, never markup ('warmup[/]0' was a MarkupError after the warmup)
        table.add_row(as_text(request["request_id"]), as_text(describe_shape(request["shape"])),
                      f"{request['seconds'] * 1000:.1f} ms")
    lines = [title]
    if data["first_s"] is not None:
        line = f"first request {data['first_s'] * 1000:.1f} ms"
        if data["steady_s"]:
            count = data["steady_count"]
            line += (f", steady state {data['steady_s'] * 1000:.1f} ms (median of {plural(count, 'request')} "
                     f"of a shape seen before); the first took {data['first_s'] / data['steady_s']:.1f}x")
        lines.append(line)
    restored = "restored" if data["restored"] else "NOT restored"
    lines.append(f"KV pool {restored}: {data['pages_free']}/{plural(data['pages_total'], 'page')} free")
    return Group(Text(lines[0], style="" if plain else "bold"), table, Text("\n".join(lines[1:])))
