"""The capacity planner: how many sessions fit, as a pure function of the spec.

No torch import and no allocation, so ``ardiff inspect-capacity`` answers in
well under a second for any config, including geometries that would never fit
on the machine running it.

Memory model (bytes; ``bpp`` = bytes per page, all layers, K and V)::

    fixed       = (1 null + in-flight + scratch) pages * bpp + gather workspace
                  (in-flight: one block per local branch slot, as a CFG pipeline may run both
                  branches' commit passes before committing either; scratch: one block + registers
                  per slot for paged kernels, none for torch, which stages it in the workspace)
    per_session = local_branches * (sink + window) * pages_per_frame * bpp
                + sum over logical branches and named caches of cross-attention K/V
                + model-owned state declared by the pipeline
    required(c) = fixed + c * per_session
    budget      = max(floor(available * gpu_memory_fraction), required(1))
                  (the fraction as written, 0.7 not the float's 0.6999...: fraction_as_written)
    capacity    = largest c <= session_capacity with required(c) <= budget
"""

from __future__ import annotations

import decimal
import os
import string
from dataclasses import dataclass, field, replace

from ardiff_cli.runtime.capability import ARDiffusionKVCacheSpec, is_number, read_number
from ardiff_cli.runtime.errors import CapacityError, ConfigError, quoted
from ardiff_cli.runtime.kv.layout import KVLayout, as_int

# The most sessions a plan takes: every session holds pages, and a block table indexes pages with int32 (vLLM's
# kernels), so no pool holds more. Also keeps a plan's figures within a float (10**400 sessions overflowed them).
MAX_SESSIONS = 2**31 - 1
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_name(dtype: object) -> str:
    """Canonical name of a dtype given as a string, a ``torch.dtype``, a numpy dtype or numpy scalar type."""
    # numpy's scalar types (np.float16) print as "<class 'numpy.float16'>"; its dtypes print as their names
    numpy_type = isinstance(dtype, type) and dtype.__module__ == "numpy"
    name = dtype.__name__ if numpy_type else str(dtype).removeprefix("torch.")
    aliases = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    name = aliases.get(name, name)
    if name not in DTYPE_SIZES:
        raise ConfigError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(DTYPE_SIZES)}",
                          hint="pass a torch.dtype or its name, such as torch.bfloat16 or 'bfloat16'")
    return name


# what a model computes and keeps its KV cache in (the planner also sizes float8 KV, which attention does not run in)
MODEL_DTYPES = ("float32", "bfloat16", "float16")


def model_dtype_name(value: object) -> str | None:
    """float32, bfloat16 or float16 from any spelling ``dtype_name`` reads (fp32, float, bf16, fp16, half,
    'torch.float16', a torch.dtype), in any case; None when ``value`` is not one. ``runtime.dtype``, ``--dtype`` and
    the KV pools all read dtypes through this."""
    try:
        name = dtype_name(value.strip().lower() if isinstance(value, str) else value)
    except ConfigError:
        return None
    return name if name in MODEL_DTYPES else None


def format_bytes(num_bytes: float) -> str:
    """Human units, binary: '1.50 GiB', up to EiB (each one ``parse_bytes`` reads back). Past 1024 EiB, which only an
    absurd budget gives (``--available 1e30``), three significant digits: '8.67e+11 EiB', not 18 digits of TiB."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(value) < 1024 or unit == "EiB":
            break
        value /= 1024
    if unit == "B":
        return f"{value:.0f} B"
    return f"{value:.2f} {unit}" if abs(value) < 1024 else f"{value:.3g} {unit}"


def as_fraction(value: object) -> float | None:
    """``value`` as a Python float when it is a real number of any kind (int, float, numpy's float32, int64, ...)
    in (0, 1], not a bool; else None (nan, inf and 10**400 included)."""
    if not is_number(value):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if 0 < number <= 1 else None


def fraction_as_written(fraction: float) -> str:
    """``fraction`` in the fewest digits that read back as it: 0.7, 0.1236, 0.1229999996 (``:g`` wrote 0.123), as
    written in the config or on the command line, and as the budget takes it (``budget_of``)."""
    text = f"{fraction:g}"
    return text if float(text) == fraction else repr(fraction)


def budget_of(available_bytes: int, fraction: float) -> int:
    """The whole bytes of ``available_bytes`` x ``fraction``, exactly, the fraction read as written: 0.7 of 11714560
    bytes is 8200192, where the float product (0.7 is 0.69999999999999995559 as a float) floored to 8200191, so
    49 sessions of causal-world-tiny, which need exactly that, were "over budget" at gpu_memory_fraction 0.7."""
    numerator, denominator = decimal.Decimal(fraction_as_written(fraction)).as_integer_ratio()
    return available_bytes * numerator // denominator


# Units parse_bytes reads (in any case; one space before one is allowed): powers of 1024 with or without the 'i', and
# of 1000 with a 'B'. No bare 'E' for EiB: '1e' is far more likely a cut-off exponent than an exbibyte.
BYTE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
              "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
              "p": 1024**5, "pb": 1000**5, "pib": 1024**5, "eb": 1000**6, "eib": 1024**6}
BYTE_SIZE_HINT = ("use a whole number of bytes, or a number and a unit such as 512MiB, 2GiB, 1.5G: KiB .. EiB and "
                  "K, M, G, T, P are powers of 1024, KB .. EB powers of 1000; the number in ASCII digits, with a point "
                  "or an exponent (1e9) but no '_' nor spaces around it")


def split_unit_hint(argument: str) -> str:
    """The hint for an argument that is a byte unit alone (`--memory-budget 2 GiB`: the shell split the size in two,
    and the unit was taken for CONFIG, an EPISODE or an extra argument); '' for any other."""
    if not argument or argument.lower() not in BYTE_UNITS:
        return ""
    return (f"{argument!r} looks like the unit of a byte size given apart from its number: write the size as one "
            "argument (2GB, or quoted: '2 GB')")


# The most a byte size may be: 16EiB, all that a 64-bit address space holds (no device or disk has more). 1e30 was
# taken and shown as '8.67e+11 EiB' of memory, which no machine has: a typo (1e30 for 1e10) planned on.
MAX_BYTE_SIZE = 1 << 64
MAX_BYTE_SIZE_TEXT = "16EiB, all that a 64-bit address space holds"


def parse_bytes(text: str | int, *, zero_ok: bool = False) -> int:
    """'512MiB', '2 GiB', '1.5G', '1000000' (any integer, numpy's too) -> bytes; 0 ('0', '0B') only if ``zero_ok``.
    Text is read as typed (``read_number``, as every number option is), then a unit after one space or none: not
    '1_000', nor with spaces around it, which ``int()`` took. With a unit, the fraction of a byte is dropped."""
    value = as_int(text)
    if value is None and not isinstance(text, (str, float)):  # str() of a YAML alias bomb would not end
        raise ConfigError(f"cannot read a {type(text).__name__} as a byte size", hint=BYTE_SIZE_HINT)
    elif value is None:
        value = _read_size(str(text), _typed(text))
    if value > MAX_BYTE_SIZE:  # str(): a YAML or Python int of 4,300 digits
        what = _typed(text) if isinstance(text, str) else f"a {value.bit_length()}-bit integer"
        raise ConfigError(f"cannot read {what} as a byte size: too large (at most {MAX_BYTE_SIZE_TEXT})",
                          hint=BYTE_SIZE_HINT)
    if value < 0 or value == 0 and not zero_ok:  # the hint says what to write, as every other byte size error's
        raise ConfigError(f"a byte size must be {'>= 0' if zero_ok else 'positive'}, got {_typed(text)}",
                          hint=f"use a byte size of {'0' if zero_ok else '1 byte'} or more, such as 512MiB or 2GiB")
    return value


def _read_size(text: str, typed: str) -> int:
    """The bytes of a byte size given as text (``parse_bytes``), exactly: a number, a space or none, a unit. -1 for a
    negative one, which ``parse_bytes`` refuses with its range."""
    amount = read_number(text)  # a number alone, whose letters are no unit: 'inf', 'nan'
    unit = "" if amount is not None else text[len(text.rstrip(string.ascii_letters)):]
    number = text[:len(text) - len(unit)]
    if unit:
        if number.endswith(" ") and number != " ":  # ' GiB': a space around it, before no number
            number = number[:-1]
        amount = read_number(number)
    why = (": it is empty" if not text
           else ": a space or line break around or in it: write one space at most, between the number and its unit"
           if any(c.isspace() for c in number)
           else f": no number before {quoted(unit)}" if not number
           else f": unknown unit {quoted(unit)}" if unit.lower() not in BYTE_UNITS
           else f": {quoted(number)} is not a plain number" if amount is None
           else ": not a finite number" if not amount.is_finite()
           else "")
    if why:
        raise ConfigError(f"cannot read {typed} as a byte size{why}", hint=BYTE_SIZE_HINT)
    if amount < 0:
        return -1
    if amount > MAX_BYTE_SIZE:  # before the product: '1e999999999GiB' is past any exponent a Decimal computes in
        raise ConfigError(f"cannot read {typed} as a byte size: too large (at most {MAX_BYTE_SIZE_TEXT})",
                          hint=BYTE_SIZE_HINT)
    scale = BYTE_UNITS[unit.lower()]
    if scale == 1 and amount != amount.to_integral_value():  # '1.5' bytes; 1.3GiB is 1395864371.2, its 0.2 noise
        raise ConfigError(f"a byte size {'in B' if unit else 'without a unit'} is a whole number of bytes, got {typed}",
                          hint="use a whole number of bytes or a unit: 1.5GiB, 512MiB")
    # exactly: as many digits as the number has and the scale's 19, and any exponent ('1e-400GiB')
    with decimal.localcontext(prec=len(amount.as_tuple().digits) + 20, Emin=decimal.MIN_EMIN, Emax=decimal.MAX_EMAX):
        exact = amount * scale
    if 0 < exact < 1:  # as 0 bytes it was refused as not positive, or, as --swap-space, turned swapping off
        raise ConfigError(f"cannot read {typed} as a byte size: less than one byte", hint=BYTE_SIZE_HINT)
    return int(exact)


def _typed(text: object) -> str:
    """A byte size as given, for a message: text as ``errors.quoted`` writes it (a byte the locale could not decode
    is ``\\xNN``, as in every other line, not repr's ``\\udcNN``); a number as ``repr``."""
    return quoted(text) if isinstance(text, str) else repr(text)


def checked_bytes(value: object, name: str, *, zero_ok: bool = False) -> int:
    """An argument that is a byte size (``parse_bytes``: an integer, or text such as '2GiB'), as an int; a
    ``ConfigError`` naming the argument otherwise."""
    try:
        return parse_bytes(value, zero_ok=zero_ok)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}", hint=exc.hint or BYTE_SIZE_HINT) from None


def total_host_memory() -> int:
    """Physical memory of the host (bytes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_host_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return total_host_memory()


@dataclass(frozen=True)
class CapacityPlan:
    """Everything the runner preallocates, and why. Byte counts are exact."""

    dtype: str  # KV dtype name
    dtype_size: int  # bytes per element
    page_size: int  # tokens per page (the paging unit)
    pages_per_frame: int  # pages per latent frame (the eviction unit)
    bytes_per_token: int  # self-attention K+V of one token, all layers, one branch
    bytes_per_page: int
    num_local_branches: int  # self-attention storage slots per session
    managed_pages_per_session: int  # resident pages of one session at rest, all slots
    self_attention_bytes_per_branch: int  # sink + window of one local slot
    inflight_pages: int  # pages a commit pass holds before eviction (worker-wide)
    scratch_pages: int  # scratch pages (worker-wide, all slots; 0 on torch: the workspace stages the block)
    scratch_bytes: int
    workspace_bytes: int  # gather buffer of the torch attention path
    fixed_bytes: int  # null page + in-flight + scratch + workspace
    cross_attention_bytes: dict[str, int]  # per named cache, per logical branch
    cross_attention_bytes_per_session: int  # all named caches x all logical branches
    model_owned_bytes_per_session: int
    bytes_per_session: int  # self-attention pages + cross-attention + model-owned
    available_bytes: int  # memory actually available (free device memory, host memory or a budget)
    gpu_memory_fraction: float
    budget_bytes: int  # max(available * fraction, required for one session)
    session_capacity_limit: int  # the upper bound asked for (pipeline spec or override)
    session_capacity: int  # sessions kept resident
    num_managed_pages: int  # allocatable pages
    total_pages: int  # pages per layer pool: null + managed + scratch
    attention_backend: str = "torch"  # the backend planned for
    branch_names: tuple[str, ...] = field(default=())
    cross_attention_names: tuple[str, ...] = field(default=())

    def required_bytes(self, num_sessions: int) -> int:
        return self.fixed_bytes + num_sessions * self.bytes_per_session

    @property
    def required_bytes_one_session(self) -> int:
        return self.required_bytes(1)

    @property
    def planned_bytes(self) -> int:
        """Bytes held with ``session_capacity`` sessions resident."""
        return self.required_bytes(self.session_capacity)

    @property
    def pool_bytes(self) -> int:
        """Bytes the runner allocates up front: all pages plus the workspace."""
        return self.total_pages * self.bytes_per_page + self.workspace_bytes

    @property
    def bound_limits(self) -> bool:
        """Whether the session capacity asked for (``session_capacity_limit``), not the budget, limits the plan: the
        budget holds more sessions, so a smaller one leaves the KV pool as it is until it holds fewer."""
        return self.session_capacity < (self.budget_bytes - self.fixed_bytes) // self.bytes_per_session

    @property
    def sessions_per_gib(self) -> float:
        return (1 << 30) / self.bytes_per_session

    def fraction_needed(self, num_sessions: int) -> float:
        """The ``gpu_memory_fraction`` at which ``num_sessions`` sessions would fit."""
        return self.required_bytes(num_sessions) / self.available_bytes

    def to_dict(self) -> dict:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["branch_names"] = list(self.branch_names)
        data["cross_attention_names"] = list(self.cross_attention_names)
        data["required_bytes_one_session"] = self.required_bytes_one_session
        data["planned_bytes"] = self.planned_bytes
        data["pool_bytes"] = self.pool_bytes
        return data


def one_session_parts(layout: KVLayout, dtype_size: int) -> dict[str, int]:
    """The bytes of one session's plan by part (``fixed`` is the worker's, shared by all sessions)."""
    spec = layout.spec
    bpp = layout.bytes_per_page(dtype_size)
    cross = sum(layout.cross_bytes(cache.name, dtype_size) for cache in spec.cross_attention)
    return {"self-attention (sink + window)": layout.pages_per_session * bpp,
            "cross-attention caches": len(spec.kv_branches) * cross,
            "fixed (null page, in-flight block, workspace)":
                (1 + layout.inflight_pages + layout.scratch_pages) * bpp + layout.workspace_bytes(dtype_size),
            "model-owned": spec.model_owned_state_bytes_per_session}


def plan_capacity(
    spec: ARDiffusionKVCacheSpec,
    dtype: object,
    available_bytes: int,
    gpu_memory_fraction: float = 0.9,
    *,
    session_capacity: int | None = None,
    page_size: int | None = None,
    attention_backend: str = "torch",
) -> CapacityPlan:
    """Plan pools for ``spec`` in ``available_bytes``; raise ``CapacityError`` if one session does not fit.

    ``gpu_memory_fraction`` is a soft expansion budget: one session is always
    admitted when it fits the memory actually available. ``session_capacity``
    overrides the spec's upper bound. ``attention_backend`` ("torch" or
    "vllm") decides whether scratch is pool pages (vllm) or part of the
    gather workspace (torch).
    """
    if not isinstance(spec, ARDiffusionKVCacheSpec):
        raise TypeError(f"spec must be an ARDiffusionKVCacheSpec, got {type(spec).__name__}")
    fraction = as_fraction(gpu_memory_fraction)  # numpy's numbers too, stored as a float (the plan goes to JSON)
    if fraction is None:
        raise ConfigError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction!r}",
                          hint="pass the share of the available memory the pools may take, such as 0.9")
    available_bytes = checked_bytes(available_bytes, "available_bytes")
    given = spec.session_capacity if session_capacity is None else session_capacity
    limit = as_int(given)
    if limit is None or not 1 <= limit <= MAX_SESSIONS:
        if session_capacity is None:  # the spec's own bound: it takes any positive one (a pipeline's "no limit")
            raise ConfigError(f"the pipeline's KV spec declares session_capacity={given!r}, more than a plan takes (up "
                              f"to {MAX_SESSIONS}: block tables index pages with int32)",
                              hint=f"set runtime.session_capacity (--session-capacity) to at most {MAX_SESSIONS}, or "
                                   "have the pipeline declare at most that (as many sessions as fit the memory are "
                                   "kept)")
        raise ConfigError(f"session_capacity must be a positive integer up to {MAX_SESSIONS}, got {given!r}",
                          hint="pass a whole number of sessions, or None for the spec's own bound")
    name = dtype_name(dtype)
    size = DTYPE_SIZES[name]
    if attention_backend not in ("torch", "vllm"):
        raise ConfigError(f"attention_backend must be 'torch' or 'vllm' for planning, got {attention_backend!r}",
                          hint="plan for the backend a load resolves 'auto' to: select_attention_backend() says which")
    layout = KVLayout.from_spec(spec, page_size=page_size, attention_backend=attention_backend)
    bpp = layout.bytes_per_page(size)
    cross = {cache.name: layout.cross_bytes(cache.name, size) for cache in spec.cross_attention}
    parts = one_session_parts(layout, size)
    fixed = parts["fixed (null page, in-flight block, workspace)"]
    required_one = sum(parts.values())
    per_session = required_one - fixed
    if required_one > available_bytes:
        # Where the bytes go, and whether the window is worth shrinking: only when a window of one block and no
        # sink (with the workspace that gathers it) would fit. A text context of 1e8 tokens was told to shrink it.
        smallest = replace(spec, sink_frames=0, window_frames=min(spec.window_frames, spec.frames_per_block))
        smallest_layout = KVLayout.from_spec(smallest, page_size=page_size, attention_backend=attention_backend)
        window_helps = sum(one_session_parts(smallest_layout, size).values()) <= available_bytes
        shown_parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in parts.items() if n)
        raise CapacityError(
            f"one session needs {format_bytes(required_one)} ({required_one} bytes) of KV cache but only "
            f"{format_bytes(available_bytes)} ({available_bytes} bytes) is available: {shown_parts}",
            hint=f"use a smaller {'window, model' if window_helps else 'model'} or dtype, a larger --memory-budget, "
                 "or a device with more memory",
            window_helps=window_helps,
        )
    budget = max(budget_of(available_bytes, fraction), required_one)
    capacity = max(1, min(limit, (budget - fixed) // per_session))
    return CapacityPlan(
        dtype=name,
        dtype_size=size,
        page_size=layout.page_size,
        pages_per_frame=layout.pages_per_frame,
        bytes_per_token=layout.bytes_per_token(size),
        bytes_per_page=bpp,
        num_local_branches=spec.num_local_kv_branches,
        managed_pages_per_session=layout.pages_per_session,
        self_attention_bytes_per_branch=layout.retained_frames * layout.pages_per_frame * bpp,
        inflight_pages=layout.inflight_pages,
        scratch_pages=layout.scratch_pages,
        scratch_bytes=layout.scratch_pages * bpp,
        workspace_bytes=layout.workspace_bytes(size),
        fixed_bytes=fixed,
        cross_attention_bytes=cross,
        cross_attention_bytes_per_session=parts["cross-attention caches"],
        model_owned_bytes_per_session=spec.model_owned_state_bytes_per_session,
        bytes_per_session=per_session,
        available_bytes=available_bytes,
        gpu_memory_fraction=fraction,
        budget_bytes=budget,
        session_capacity_limit=limit,
        session_capacity=capacity,
        num_managed_pages=layout.managed_pages(capacity),
        total_pages=layout.total_pages(capacity),
        attention_backend=attention_backend,
        branch_names=spec.branch_names,
        cross_attention_names=tuple(cross),
    )
