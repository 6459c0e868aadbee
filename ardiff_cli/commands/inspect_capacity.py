"""``ardiff inspect-capacity``: the capacity plan of a config, without torch, weights or allocation."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ardiff_cli.commands._common import (
    budget_source,
    check_working_folder,
    config_field_named,
    config_label,
    does_not_fit_hint,
    load_engine_config,
    refuse_a_backend_not_here,
    refuse_contradictions,
)
from ardiff_cli.errors_cli import EVERY_EXIT_CODE, EXIT_PARTIAL, EXIT_SIGPIPE, exit_codes_help, handle_errors
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
    check_available,
    parse_session_count,
)
from ardiff_cli.output import Format, Output
from ardiff_cli.runtime.errors import CapacityError, ConfigError, plural

DEFAULT_SESSION_COUNTS = (1, 2, 4, 8, 16)

HELP = (
    "Print the KV capacity plan of a config: bytes per page and per token, the per-session breakdown "
    "(self-attention per branch, each cross-attention cache, model-owned state), the fixed memory (null page, "
    "scratch, in-flight block, workspace), how many sessions fit, sessions per GiB and the memory fraction N "
    "sessions would need.\n\n"
    "Nothing is loaded or allocated (no weights, no torch), so it answers at once for any geometry, including "
    "ones that would never fit on this machine."
)
# No episodes (never 4), and a reader of stdout that went away (`| head`) wanted no more: exit 0, not 141 (it never
# stops at a safe point as rollout and warmup do)
EXIT_CODES = EVERY_EXIT_CODE - {EXIT_PARTIAL, EXIT_SIGPIPE}
EPILOG = f"""Examples:

  ardiff inspect-capacity

  ardiff inspect-capacity dreamzero-tiny --available 2GiB --dtype bfloat16

  ardiff inspect-capacity my_config.yaml --available 80GiB --gpu-memory-fraction 0.8 --sessions 32

  ardiff inspect-capacity --format json | jq .plan.session_capacity

{exit_codes_help(EXIT_CODES)}"""


def inspect_capacity(
    config: ConfigArg = None,
    available: Annotated[Optional[str], typer.Option(
        "--available", metavar="BYTES|auto", callback=check_available,
        help="Memory to plan with, e.g. 80GiB; auto: free memory of the GPU the plan is for (nvidia-smi, "
             "CUDA_VISIBLE_DEVICES applied) or available host memory. "
             "\\[default: --memory-budget or the config's, else auto]", show_default=False)] = None,
    sessions: Annotated[Optional[list[int]], typer.Option(
        "--sessions", min=1, metavar="N", parser=parse_session_count,
        help="Show the memory fraction N sessions would need (repeatable). \\[default: 1 2 4 8 16 and the "
             "capacity]", show_default=False)] = None,
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
    """Print the capacity plan (help text: ``HELP``)."""
    out = Output.create(format, quiet=quiet, verbose=verbose and not quiet)  # both: refused
    with handle_errors(out):
        check_working_folder()
        from ardiff_cli.runtime.capacity import parse_bytes, plan_capacity
        from ardiff_cli.runtime.kv.backends import describe_backend
        from ardiff_cli.runtime.kv.layout import KVLayout

        refuse_contradictions(quiet=quiet, verbose=verbose)
        cfg = load_engine_config(config, pipeline=pipeline, command="inspect-capacity", plan_only=True, device=device,
                                 dtype=dtype, memory_budget=memory_budget, session_capacity=session_capacity,
                                 gpu_memory_fraction=gpu_memory_fraction, attention_backend=attention_backend)
        if cfg.checkpoint_missing:  # a cluster's config planned from a laptop: the plan reads no weights
            out.warning(f"{cfg.source}: field 'checkpoint': {cfg.checkpoint_missing}: planned all the same (a plan "
                        "reads no weights); warmup and rollout refuse it on this machine")
        runtime = cfg.runtime
        with config_field_named(cfg, "device", device):  # as the load's refusal: the config that asked for it
            target = resolve_plan_device(runtime.device)
        spec = cfg.kv_cache_spec()
        layout = KVLayout.from_spec(spec)
        # an explicit vllm that cannot run there: the load's own ConfigError (exit 2), naming the config's field.
        # The backend decides where the uncommitted block lives (torch: the workspace; vllm: scratch pages),
        # so the plan takes the one expected on the device loading would resolve to.
        backend = refuse_a_backend_not_here(cfg, target.kind, attention_backend, layout)
        if available is not None and available != "auto":
            available_bytes, source = parse_bytes(available), "--available"
        elif available is None and runtime.memory_budget is not None:  # say which set it: both read "memory budget"
            available_bytes = runtime.memory_budget
            source = budget_source(memory_budget, cfg)
        else:
            with config_field_named(cfg, "device", device):  # a GPU that cannot be measured here, so too
                available_bytes, source = detect_available(target)
        # auto on a machine that can only load on the CPU (a CPU build of torch, every GPU hidden): what it uses
        # there; "torch on CUDA, torch on CPU" spoke of a CUDA this torch cannot run
        shown_device = target.name if target.cpu_only else runtime.device
        attention = describe_backend(runtime.attention_backend, shown_device, layout, runtime.dtype)
        attention["plan_backend"] = backend  # the one planned for (on plan_device)
        try:
            plan = plan_capacity(spec, runtime.dtype, available_bytes, runtime.gpu_memory_fraction,
                                 session_capacity=runtime.session_capacity, attention_backend=backend)
        except CapacityError as exc:
            exc.hint = does_not_fit_hint(cfg, source, window_helps=exc.window_helps)
            raise
        counts = sorted(set(sessions or DEFAULT_SESSION_COUNTS) | {plan.session_capacity})
        data = capacity_report(plan, spec, counts)
        # the spec's bound is the model's session_capacity where it has one (dreamzero-14b's model: section sets 8)
        data["session_limit_source"] = (
            "--session-capacity" if session_capacity is not None
            else "runtime.session_capacity" if runtime.session_capacity is not None
            else "model.session_capacity" if getattr(cfg.model, "session_capacity", None) == spec.session_capacity
            else "pipeline")
        data["attention"] = attention
        data = {"kind": "capacity_plan", "config": config_label(config), "pipeline": cfg.pipeline_name,
                "device": runtime.device, "plan_device": target.name, "plan_device_reason": target.reason,
                "available_source": source, **data, "warnings": list(out.warnings)}
        # the kernels whose block rows apply where the model runs: a CPU has no FlashAttention, CUDA no vLLM CPU kernel
        kinds = {"cpu": ("cpu",), "cuda": ("flash",)}.get(shown_device.partition(":")[0], ("flash", "cpu"))
        out.result(data, lambda plain: render_capacity(data, plan, plain, kernels=kinds))


# ------------------------------------------------------------------------------- device, without torch
@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One GPU as nvidia-smi reports it."""

    free_bytes: int  # free memory now (before model weights are loaded)
    num_gpus: int  # GPUs in the machine, in nvidia-smi's (PCI bus) numbering


@dataclass(frozen=True, slots=True)
class PlanDevice:
    """The device loading would resolve ``runtime.device`` to, found without torch."""

    name: str  # "cpu" or "cuda:N", N counting the visible GPUs only (as torch does)
    gpu_id: str | None  # that GPU as nvidia-smi -i takes it: a physical index or a UUID; None on CPU
    reason: str  # why this device (shown with the plan)
    memory: GpuMemory | None = None  # nvidia-smi's answer, when resolving already asked it
    cpu_only: bool = False  # auto, where loading cannot use a GPU: a CPU build of torch, or every GPU hidden

    @property
    def kind(self) -> str:
        return self.name.partition(":")[0]


def visible_cuda_devices() -> list[str] | None:
    """The GPUs CUDA_VISIBLE_DEVICES leaves visible, in order, as nvidia-smi ids; None when unset (all).

    CUDA reads the list up to the first entry that names no device, so "" and "-1" hide
    every GPU (loading falls back to CPU) and "0,-1,1" leaves GPU 0 only. Entries are
    indices or GPU UUIDs; cuda:N is the N-th entry.
    """
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    ids: list[str] = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        ids.append(entry)
    return ids


CUDA_LIBRARIES = ("libtorch_cuda.so", "torch_cuda.dll", "libtorch_hip.so")  # in torch/lib of a GPU build
CPU_LIBRARIES = ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll")  # in torch/lib of every build


def torch_cuda_build() -> tuple[bool, Path] | None:
    """Whether the installed torch is a GPU build (its CUDA or ROCm library is in ``torch/lib``) and that folder,
    found without importing torch; None when no torch is found, or its ``torch/lib`` holds no CPU library either
    (a build that keeps its libraries elsewhere: nothing says which it is)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if any((lib / name).exists() for name in CUDA_LIBRARIES):
        return True, lib
    if any((lib / name).exists() for name in CPU_LIBRARIES):
        return False, lib
    return None


def resolve_plan_device(device: str) -> PlanDevice:
    """``auto`` -> cuda:0 when a GPU is visible (CUDA_VISIBLE_DEVICES), nvidia-smi can read it and the installed
    torch is not a CPU build, else cpu; ``cuda[:N]`` -> the N-th visible GPU (an index past them is a ``ConfigError``,
    as at load)."""
    if device == "cpu":
        return PlanDevice("cpu", None, "requested")
    visible = visible_cuda_devices()
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device == "auto":
        if visible == []:
            return PlanDevice("cpu", None, f"auto: CUDA_VISIBLE_DEVICES={raw!r} hides every GPU", cpu_only=True)
        build = torch_cuda_build()
        if build is not None and not build[0]:
            return PlanDevice("cpu", None, f"auto: the installed torch ({build[1].parent}) is a CPU build, so "
                                           "loading runs on the CPU", cpu_only=True)
        gpu_id = visible[0] if visible else "0"
        memory = query_gpu(gpu_id)
        if isinstance(memory, str):
            return PlanDevice("cpu", None, f"auto: no GPU ({memory})")
        return PlanDevice("cuda:0", gpu_id, f"auto: a GPU is visible (nvidia-smi GPU {gpu_id}{_mask(raw)})", memory)
    index = int(device.partition(":")[2] or 0)  # bare cuda: the current device, 0 unless code changed it
    if visible is not None and index >= len(visible):
        shown = (f"{plural(len(visible), 'GPU')} visible (cuda:0 .. cuda:{len(visible) - 1})" if visible
                 else "no GPU visible")
        others = "cuda, cpu or auto" if visible else "cpu or auto"  # bare cuda: the first visible GPU
        raise ConfigError(f"device {device!r} requested but CUDA_VISIBLE_DEVICES={raw!r} leaves {shown}",
                          hint=f"check CUDA_VISIBLE_DEVICES, or use --device {others}")
    gpu_id = visible[index] if visible is not None else str(index)
    return PlanDevice(f"cuda:{index}", gpu_id, f"requested (nvidia-smi GPU {gpu_id}{_mask(raw)})")


def _mask(raw: str | None) -> str:
    return "" if raw is None else f", CUDA_VISIBLE_DEVICES={raw!r}"


def detect_available(target: PlanDevice) -> tuple[int, str]:
    """Free memory of ``target`` without torch: nvidia-smi for a GPU, /proc/meminfo for the host."""
    from ardiff_cli.runtime.capacity import available_host_memory

    if target.gpu_id is None:
        return available_host_memory(), "available host memory"
    memory = target.memory if target.memory is not None else query_gpu(target.gpu_id)
    if isinstance(memory, str):
        raise ConfigError(f"cannot measure free memory of {target.name} (nvidia-smi GPU {target.gpu_id}): {memory}",
                          hint="pass --available BYTES (e.g. --available 80GiB) to plan for that GPU, or use "
                               "--device cpu")
    source = f"free memory of nvidia-smi GPU {target.gpu_id} (before model weights)"
    if memory.num_gpus > 1 and target.gpu_id.isdigit() and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        source += "; assumes CUDA_DEVICE_ORDER=PCI_BUS_ID"  # CUDA's default order is fastest first
    return memory.free_bytes, source


def query_gpu(gpu_id: str) -> GpuMemory | str:
    """Free memory of GPU ``gpu_id`` (an index or UUID, as ``nvidia-smi -i`` takes it), or why it is unknown."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi is not available"
    try:
        result = subprocess.run([exe, "--query-gpu=memory.free,count", "--format=csv,noheader,nounits", "-i", gpu_id],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi failed: {exc}"
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        said = (result.stderr.strip() or result.stdout.strip()).splitlines()
        return f"nvidia-smi -i {gpu_id} exited {result.returncode}" + (f": {said[0]}" if said else "")
    try:
        free_mib, num_gpus = (int(field) for field in lines[0].split(","))
    except ValueError:
        return f"nvidia-smi printed {lines[0]!r}, expected 'FREE_MIB, COUNT'"
    return GpuMemory(free_mib * 1024 * 1024, num_gpus)


def capacity_report(plan: Any, spec: Any, counts: list[int]) -> dict[str, Any]:
    """Exact figures for JSON (and for the human table)."""
    fits = max(0, (plan.budget_bytes - plan.fixed_bytes) // plan.bytes_per_session)
    return {
        "plan": plan.to_dict(),
        "per_session": {
            "self_attention_per_branch": {
                branch.name: plan.self_attention_bytes_per_branch for branch in spec.kv_branches},
            "self_attention_slots": plan.num_local_branches,
            "cross_attention_per_branch": dict(plan.cross_attention_bytes),
            "cross_attention_total": plan.cross_attention_bytes_per_session,
            "model_owned": plan.model_owned_bytes_per_session,
            "total": plan.bytes_per_session,
        },
        "fixed": {"null_page": plan.bytes_per_page, "scratch": plan.scratch_bytes,
                  "inflight": plan.inflight_pages * plan.bytes_per_page, "workspace": plan.workspace_bytes,
                  "total": plan.fixed_bytes},
        "sessions_fit": fits,
        "sessions_per_gib": plan.sessions_per_gib,
        "fraction_needed": {str(n): plan.fraction_needed(n) for n in counts},
        "verdict": {str(n): session_verdict(plan, n) for n in counts},
    }


def session_verdict(plan: Any, num_sessions: int) -> str:
    """Whether ``num_sessions`` sessions fit: ``fits`` (within the budget), ``over_budget`` (within the memory
    available, past gpu_memory_fraction), ``does_not_fit`` (more than the memory available) or
    ``over_session_limit`` (more than the session limit keeps resident, whatever the memory: the rest are evicted).
    Against the budget, not the fraction: the budget is never less than one session, so one session whose fraction
    is above gpu_memory_fraction (but within what is available) is admitted, as the plan says."""
    if num_sessions > plan.session_capacity_limit:
        return "over_session_limit"
    required = plan.required_bytes(num_sessions)
    return ("fits" if required <= plan.budget_bytes
            else "over_budget" if required <= plan.available_bytes else "does_not_fit")


# what set the session limit (``session_limit_source``), as the table says it
LIMIT_SOURCES = {"--session-capacity": "--session-capacity",
                 "runtime.session_capacity": "the config's runtime.session_capacity",
                 "model.session_capacity": "model.session_capacity (the pipeline's KV spec)",
                 "pipeline": "the pipeline's KV spec"}


def _three_digits(value: float) -> str:
    """Three significant digits in plain notation ('5.38e+03' read as a typo: 5,380; '1.05e+03%': 1,050%), but for
    figures only an absurd --available or --sessions gives, where a row of zeros or digits would say less."""
    rounded = float(f"{value:.3g}")
    if not 1e-4 <= rounded < 1e6:
        return f"{value:.3g}"
    text = f"{rounded:,.{max(0, 2 - math.floor(math.log10(rounded)))}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text  # as .3g writes it: 5, not 5.00


def _share(plan: Any, num_sessions: int, verdict: str) -> str:
    """The share of the available memory ``num_sessions`` sessions need, in three digits, with '>' or '<' before them
    where the figure, read as that share of the available memory, would contradict the verdict beside it. '>' where
    the row is past a bound (``over_budget``: the budget; ``does_not_fit``: the memory available) and the figure is
    within it, or within the fraction as the budget row writes it: 90.01% at --gpu-memory-fraction 0.9 is '>90', not
    '90' beside 'over budget', and 100.0003% is '>100'. '<' where the row fits and the figure is past the budget and
    that fraction: 12.35999% at 0.1236 is '<12.4', not '12.4' beside 'fits'. Either sign is always true, in exact
    arithmetic: the bytes needed are a whole number past the bound (so past the figure too), or within the budget
    (so short of a figure past it)."""
    from decimal import Decimal  # here, not at the top: `ardiff --help` imports this module
    from fractions import Fraction

    from ardiff_cli.runtime.capacity import fraction_as_written

    shown = _three_digits(plan.fraction_needed(num_sessions) * 100)
    figure = Fraction(Decimal(shown.replace(",", ""))) * plan.available_bytes / 100  # '1,050' or '1.05e+03', as shown
    bound = {"over_budget": plan.budget_bytes, "does_not_fit": plan.available_bytes}.get(verdict)
    if bound is not None and math.floor(figure) <= bound:
        return f">{shown}"
    fraction = Fraction(Decimal(fraction_as_written(plan.gpu_memory_fraction)))
    if verdict == "fits" and figure > max(plan.budget_bytes, fraction * plan.available_bytes):
        return f"<{shown}"
    return shown


def _count(value: int) -> str:
    """A whole count with thousands separators; past a billion, which only an absurd --available or --sessions gives
    (1e30 bytes: 4507211538461538692125700 sessions of dreamzero-tiny fit), three significant digits: 4.51e+24."""
    return f"{value:,}" if value < 10**9 else f"{value:.3g}"


def render_capacity(data: dict[str, Any], plan: Any, plain: bool, *, kernels: tuple[str, ...] = ("flash", "cpu")):
    """The table: ``kernels`` names the kernels whose block rows are shown (``flash``, ``cpu``)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from ardiff_cli.output import as_text, visible
    from ardiff_cli.runtime.capacity import format_bytes as fb, fraction_as_written

    per = data["per_session"]
    table = Table(box=None if plain else box.SIMPLE_HEAD, show_header=True, header_style="bold", pad_edge=False)
    table.add_column("item", overflow="fold")
    table.add_column("size", justify="right")
    table.add_column("detail", overflow="fold")  # a narrow terminal breaks a long word (a pip hint), never cuts it

    def add_row(*cells: str) -> None:  # cells quote paths, CUDA_VISIBLE_DEVICES, nvidia-smi's words, branch names
        table.add_row(*map(as_text, cells))

    add_row("device", data["plan_device"], data["plan_device_reason"])
    add_row("available", fb(plan.available_bytes), data["available_source"])
    add_row("budget", fb(plan.budget_bytes),
            f"available x gpu_memory_fraction {fraction_as_written(plan.gpu_memory_fraction)} (never less than one "
            "session)")
    add_row("page", fb(plan.bytes_per_page),
            f"{plan.page_size} tokens, {plural(plan.pages_per_frame, 'page')} per frame, {plan.dtype}")
    add_row("token", fb(plan.bytes_per_token), "self-attention K+V, all layers, one branch")
    att = data["attention"]
    expected = att["expected_backend"]  # "torch", or "vllm on CUDA, torch on CPU" for --device auto
    reason = att["reason"] if expected == att["plan_backend"] else f"{expected} ({att['reason']})"
    add_row("attention", att["plan_backend"], f"--attention-backend {att['setting']}: {reason}")
    for kernel, label in (("flash", "FlashAttention (CUDA)"), ("cpu", "vLLM CPU kernel")):
        if kernel not in kernels:
            continue
        tail, blocks = att[f"{kernel}_tail_tokens"], att[f"{kernel}_blocks_per_page"]
        shape = (f"{plural(blocks, 'block')} per page" + (f" + {tail}-token tail" if tail else "") if blocks
                 else f"a page is smaller than one block: all {tail} of its tokens are tail")
        add_row(f"  {kernel} block", f"{att[f'{kernel}_block_size']} tokens", f"{label}: {shape}")
    add_row("per session", fb(plan.bytes_per_session),
            f"{plural(plan.managed_pages_per_session, 'page')} at rest")
    for branch, size in per["self_attention_per_branch"].items():
        add_row(f"  self-attn {branch}", fb(size), "sink + window frames")
    if plan.num_local_branches != len(per["self_attention_per_branch"]):
        add_row("", "", f"branches share {plural(plan.num_local_branches, 'storage slot')}")
    for name, size in per["cross_attention_per_branch"].items():
        branches = len(per["self_attention_per_branch"])
        add_row(f"  cross-attn {name}", fb(size * branches), f"{fb(size)} per branch x {branches}")
    add_row("  model-owned", fb(per["model_owned"]), "declared by the pipeline")
    fixed = data["fixed"]
    scratch = (f"scratch pages {fb(fixed['scratch'])}" if plan.scratch_pages
               else "scratch in the workspace (torch)")
    slots = plan.num_local_branches  # a commit pass's block per storage slot (CFG branches may both run first)
    inflight = f"in-flight block {fb(fixed['inflight'])}" if slots == 1 else \
        f"in-flight blocks {fb(fixed['inflight'])} ({fb(fixed['inflight'] // slots)} per branch slot x {slots})"
    add_row("fixed", fb(fixed["total"]), f"null page {fb(fixed['null_page'])}, {scratch}, {inflight}, "
            f"workspace {fb(fixed['workspace'])}")
    add_row("sessions", _count(plan.session_capacity),
            f"{_count(data['sessions_fit'])} fit the budget, limit {_count(plan.session_capacity_limit)}; "
            f"{_count(plan.num_managed_pages)} pages, {fb(plan.planned_bytes)} planned")
    add_row("per GiB", _three_digits(plan.sessions_per_gib), "sessions per GiB of memory")
    for n, fraction in data["fraction_needed"].items():
        verdict = data["verdict"][n]
        verdict = (f"does not fit: more than the session limit of {_count(plan.session_capacity_limit)}, set by "
                   f"{LIMIT_SOURCES[data['session_limit_source']]}" if verdict == "over_session_limit"
                   else verdict.replace("_", " "))
        add_row(f"{_count(int(n))} session{'s' if n != '1' else ''}", f"{_share(plan, int(n), data['verdict'][n])}%",
                f"of available memory ({verdict})")
    title = visible(f"capacity plan: {data['config']} (pipeline {data['pipeline']}, {plan.dtype})")
    return Group(Text(title, style="" if plain else "bold"), table)
