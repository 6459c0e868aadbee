"""``ardiff inspect-capacity``: the capacity plan of a config, without torch, weights or allocation."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Annotated, Any, Optional

import typer

from ardiff_cli.commands._common import config_label, load_engine_config, refuse_contradictions
from ardiff_cli.errors_cli import EXIT_CODES_HELP, handle_errors
from ardiff_cli.options import (
    ConfigArg,
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    AttentionBackendOpt,
    GpuMemoryFractionOpt,
    MemoryBudgetOpt,
    PipelineOpt,
    QuietOpt,
    SessionCapacityOpt,
    VerboseOpt,
    check_byte_size,
)
from ardiff_cli.output import Format, Output
from ardiff_cli.runtime.errors import ConfigError

DEFAULT_SESSION_COUNTS = (1, 2, 4, 8, 16)

HELP = (
    "Print the KV capacity plan of a config: bytes per page and per token, the per-session breakdown "
    "(self-attention per branch, each cross-attention cache, scratch, model-owned state), how many sessions fit, "
    "sessions per GiB and the memory fraction N sessions would need.\n\n"
    "Nothing is loaded or allocated (no weights, no torch), so it answers at once for any geometry, including "
    "ones that would never fit on this machine."
)
EPILOG = f"""Examples:

  ardiff inspect-capacity

  ardiff inspect-capacity dreamzero-tiny --available 2GiB --dtype bfloat16

  ardiff inspect-capacity my_config.yaml --available 80GiB --gpu-memory-fraction 0.8 --sessions 32

  ardiff inspect-capacity --format json | jq .plan.session_capacity

{EXIT_CODES_HELP}"""


def inspect_capacity(
    config: ConfigArg = None,
    available: Annotated[Optional[str], typer.Option(
        "--available", metavar="BYTES|auto", callback=check_byte_size,
        help="Memory to plan with, e.g. 80GiB; auto: free GPU memory (nvidia-smi) or available host memory. "
             "[default: --memory-budget or the config's, else auto]", show_default=False)] = None,
    sessions: Annotated[Optional[list[int]], typer.Option(
        "--sessions", min=1, metavar="N",
        help="Show the memory fraction N sessions would need (repeatable). [default: 1 2 4 8 16 and the capacity]",
        show_default=False)] = None,
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
        from ardiff_cli.runtime.capacity import parse_bytes, plan_capacity
        from ardiff_cli.runtime.kv.backends import describe_backend
        from ardiff_cli.runtime.kv.layout import KVLayout

        refuse_contradictions(quiet=quiet, verbose=verbose)
        cfg = load_engine_config(config, pipeline=pipeline, device=device, dtype=dtype, memory_budget=memory_budget,
                                 session_capacity=session_capacity, gpu_memory_fraction=gpu_memory_fraction,
                                 attention_backend=attention_backend)
        runtime = cfg.runtime
        if available is not None and available != "auto":
            available_bytes, source = parse_bytes(available), "--available"
        elif available is None and runtime.memory_budget is not None:
            available_bytes, source = runtime.memory_budget, "memory budget"
        else:
            available_bytes, source = detect_available(runtime.device)
        spec = cfg.kv_cache_spec()
        attention = describe_backend(runtime.attention_backend, runtime.device, KVLayout.from_spec(spec),
                                     runtime.dtype)
        # The backend decides where the uncommitted block lives (torch: the workspace; vllm: scratch pages).
        backend = "vllm" if attention["expected_backend"] == "vllm" else "torch"
        plan = plan_capacity(spec, runtime.dtype, available_bytes, runtime.gpu_memory_fraction,
                             session_capacity=runtime.session_capacity, attention_backend=backend)
        counts = sorted(set(sessions or DEFAULT_SESSION_COUNTS) | {plan.session_capacity})
        data = capacity_report(plan, spec, counts)
        data["attention"] = attention
        data = {"kind": "capacity_plan", "config": config_label(config), "pipeline": cfg.pipeline_name,
                "device": runtime.device, "available_source": source, **data}
        out.result(data, lambda plain: render_capacity(data, plan, plain))


def detect_available(device: str) -> tuple[int, str]:
    """Free memory of ``device`` without torch: nvidia-smi for CUDA, /proc/meminfo for the host."""
    from ardiff_cli.runtime.capacity import available_host_memory

    if device != "cpu":
        index = device.partition(":")[2] or os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        free = _nvidia_smi_free(index)
        if free is not None:
            return free, f"free memory of GPU {index} (nvidia-smi; before model weights)"
        if device.startswith("cuda"):
            raise ConfigError(f"cannot measure free memory of {device}: nvidia-smi is not available",
                              hint="pass --available BYTES (e.g. --available 80GiB)")
    return available_host_memory(), "available host memory"


def _nvidia_smi_free(index: str) -> int | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        result = subprocess.run([exe, "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", index],
                                capture_output=True, text=True, timeout=10, check=True)
        return int(result.stdout.strip().splitlines()[0]) * 1024 * 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None




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
        "fixed": {"scratch": plan.scratch_bytes, "inflight": plan.inflight_pages * plan.bytes_per_page,
                  "workspace": plan.workspace_bytes, "total": plan.fixed_bytes},
        "sessions_fit": fits,
        "sessions_per_gib": plan.sessions_per_gib,
        "fraction_needed": {str(n): plan.fraction_needed(n) for n in counts},
    }


def render_capacity(data: dict[str, Any], plan: Any, plain: bool):
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from ardiff_cli.runtime.capacity import format_bytes as fb

    per = data["per_session"]
    table = Table(box=None if plain else box.SIMPLE_HEAD, show_header=True, header_style="bold", pad_edge=False)
    table.add_column("item")
    table.add_column("size", justify="right")
    table.add_column("detail")
    table.add_row("available", fb(plan.available_bytes), data["available_source"])
    table.add_row("budget", fb(plan.budget_bytes), f"available x gpu_memory_fraction {plan.gpu_memory_fraction:g} "
                  "(never less than one session)")
    table.add_row("page", fb(plan.bytes_per_page),
                  f"{plan.page_size} tokens, {plan.pages_per_frame} page(s) per frame, {plan.dtype}")
    table.add_row("token", fb(plan.bytes_per_token), "self-attention K+V, all layers, one branch")
    att = data["attention"]
    table.add_row("attention", att["expected_backend"],
                  escape(f"--attention-backend {att['setting']}: {att['reason']}"))  # '[vllm]' is not markup
    for kernel, label in (("flash", "FlashAttention (CUDA)"), ("cpu", "vLLM CPU kernel")):
        tail = att[f"{kernel}_tail_tokens"]
        table.add_row(f"  {kernel} block", f"{att[f'{kernel}_block_size']} tokens",
                      f"{label}: {att[f'{kernel}_blocks_per_page']} block(s) per page"
                      + (f" + {tail}-token tail" if tail else ""))
    table.add_row("per session", fb(plan.bytes_per_session), f"{plan.managed_pages_per_session} pages at rest")
    for branch, size in per["self_attention_per_branch"].items():
        table.add_row(f"  self-attn {branch}", fb(size), "sink + window frames")
    if plan.num_local_branches != len(per["self_attention_per_branch"]):
        table.add_row("", "", f"branches share {plan.num_local_branches} storage slot(s)")
    for name, size in per["cross_attention_per_branch"].items():
        branches = len(per["self_attention_per_branch"])
        table.add_row(f"  cross-attn {name}", fb(size * branches), f"{fb(size)} per branch x {branches}")
    table.add_row("  model-owned", fb(per["model_owned"]), "declared by the pipeline")
    fixed = data["fixed"]
    scratch = (f"scratch pages {fb(fixed['scratch'])}" if plan.scratch_pages
               else "scratch in the workspace (torch)")
    table.add_row("fixed", fb(fixed["total"]), f"{scratch}, in-flight block "
                  f"{fb(fixed['inflight'])}, workspace {fb(fixed['workspace'])}")
    table.add_row("sessions", str(plan.session_capacity),
                  f"{data['sessions_fit']} fit the budget, limit {plan.session_capacity_limit}; "
                  f"{plan.num_managed_pages} pages, {fb(plan.planned_bytes)} planned")
    table.add_row("per GiB", f"{plan.sessions_per_gib:.3g}", "sessions per GiB of memory")
    for n, fraction in data["fraction_needed"].items():
        verdict = "fits" if fraction <= plan.gpu_memory_fraction else ("over budget" if fraction <= 1 else "does not fit")
        table.add_row(f"{n} session{'s' if n != '1' else ''}", f"{fraction * 100:.3g}%", f"of available memory ({verdict})")
    title = f"capacity plan: {data['config']} (pipeline {data['pipeline']}, {plan.dtype})"
    if plain:
        return Group(Text(title), table)
    return Group(Text(title, style="bold"), table)
