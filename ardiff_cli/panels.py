"""The live display: a pure function ``render(snapshot)`` of a frozen :class:`Snapshot`.

The runtime never imports Rich. The CLI's :class:`~ardiff_cli.monitor.RunMonitor`
subscribes to runtime events and keeps the snapshot; ``Live(get_renderable=...)``
calls ``render(monitor.snapshot())`` a few times a second::

    ╭─ capacity ──────────────────────────╮╭─ sessions (LRU first) ──────────────────────────╮
    │ device   cpu · float32              ││ session  episode  steps  pages  cross  latency  │
    │ budget   1.20 MiB                   ││ demo_1   demo_1   4/5    ...                    │
    │ pages    ━━━━━━━━━━━━━━━━━━  18/36  │╰─────────────────────────────────────────────────╯
    │ sessions 2/2                        │
    ╰─────────────────────────────────────╯
    ╭─ events ─────────────────────────────────────────────────────────────────────────────╮
    │ +0.412s  evicted   demo_0  lru_eviction (by demo_2)                                  │
    ╰──────────────────────────────────────────────────────────────────────────────────────╯
    ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━  12/18 steps · 9.1 steps/s · ETA 0:00:01
"""

from __future__ import annotations

from dataclasses import dataclass

from ardiff_cli.output import visible
from ardiff_cli.runtime.capacity import format_bytes


@dataclass(frozen=True, slots=True)
class SessionRow:
    session_id: str
    episode: str
    steps_done: int
    steps_total: int | None  # None while the episode may still grow (--follow)
    pages_per_branch: dict[str, int]
    cross_attention_bytes: int
    last_latency_s: float | None


@dataclass(frozen=True, slots=True)
class EventRow:
    at_s: float  # seconds since the run started
    kind: str  # "admitted", "evicted", "reset", "closed", "failed", "warmup", ...
    session_id: str
    detail: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the live display shows, at one instant."""

    title: str
    phase: str = "loading"  # loading | warmup | running | following | stopping | done
    device: str = "?"
    dtype: str = "?"
    budget_bytes: int | None = None
    available_bytes: int | None = None
    page_size: int | None = None  # tokens per page
    bytes_per_page: int | None = None
    pages_used: int = 0
    pages_total: int = 0  # allocatable pages
    session_capacity: int = 0
    sessions: tuple[SessionRow, ...] = ()  # resident sessions, least recently used first
    events: tuple[EventRow, ...] = ()  # the most recent events, oldest first
    steps_done: int = 0  # steps finished in this run
    steps_total: int | None = None  # None when unknown (following)
    steps_failed: int = 0
    steps_replayed: int = 0
    evictions: int = 0
    restores: int = 0  # swapped-out sessions restored (no replay needed)
    swapped: int = 0  # sessions swapped out to disk now
    swapped_bytes: int = 0  # bytes of their snapshot files
    swap_budget_bytes: int = 0  # the swap space (0: swapping is off)
    elapsed_s: float = 0.0
    attention: str = ""  # the attention backend that runs ("torch" or "vllm"); "" before the plan
    noun: str = "steps"  # what steps_done counts: a rollout's steps, warmup's requests
    counting_s: float | None = None  # seconds of the phase that does the counted work (the rate and ETA are of it,
    # not of the model's load or the warmup before it); None: elapsed_s


def _text(value: str):
    """User-derived text (episode names, paths, error messages): never Rich markup, no control characters."""
    from rich.text import Text

    return Text(visible(value))


# The sessions panel's most rows: the least recently used (the next to be evicted), then how many more. A row per
# resident session (hundreds with a small model) pushed the events and the progress line off the screen, and drawing
# them 4 times a second took more than the CPU time there is (1,000 rows: 0.4 s per frame).
SESSION_ROWS = 16

EVENT_STYLES = {"admitted": "green", "evicted": "yellow", "restored": "green", "reset": "magenta", "closed": "blue",
                "failed": "red", "hook_failed": "red", "swap_failed": "red", "warmup": "cyan", "episode": "cyan"}


def _capacity_panel(s: Snapshot):
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True, min_width=8)
    grid.add_column(overflow="ellipsis", no_wrap=True)
    grid.add_row("device", f"{s.device} · {s.dtype}")
    if s.budget_bytes is not None:
        available = f" of {format_bytes(s.available_bytes)}" if s.available_bytes else ""
        grid.add_row("budget", f"{format_bytes(s.budget_bytes)}{available}")
    if s.page_size is not None:
        size = f" · {format_bytes(s.bytes_per_page)}" if s.bytes_per_page else ""
        grid.add_row("page", f"{s.page_size} tokens{size}")
    bar = Table.grid(padding=(0, 1))
    bar.add_column(width=12)
    bar.add_column(no_wrap=True, overflow="ellipsis")
    bar.add_row(ProgressBar(total=max(1, s.pages_total), completed=s.pages_used, width=12),
                f"{s.pages_used}/{s.pages_total}, {s.pages_total - s.pages_used} free")
    grid.add_row("pages", bar)
    grid.add_row("sessions", f"{len(s.sessions)}/{s.session_capacity} resident")
    if s.swap_budget_bytes:
        grid.add_row("swap", f"{s.swapped} out, {format_bytes(s.swapped_bytes)} of {format_bytes(s.swap_budget_bytes)}")
    if s.attention:
        grid.add_row("attention", s.attention)
    return Panel(grid, title="capacity", title_align="left", border_style="cyan")


def _sessions_panel(s: Snapshot):
    from rich.panel import Panel
    from rich.table import Table

    table = Table(expand=True, box=None, pad_edge=False, header_style="bold")
    table.add_column("session", no_wrap=True, overflow="ellipsis", max_width=18)
    table.add_column("episode", no_wrap=True, overflow="ellipsis", max_width=18)
    table.add_column(s.noun, justify="right", no_wrap=True)
    table.add_column("pages", no_wrap=True)
    table.add_column("x-attn", justify="right", no_wrap=True)
    table.add_column("last", justify="right", no_wrap=True)
    for row in s.sessions[:SESSION_ROWS]:
        steps = f"{row.steps_done}/{row.steps_total}" if row.steps_total is not None else str(row.steps_done)
        pages = " ".join(f"{branch[:3]}:{n}" for branch, n in row.pages_per_branch.items())
        latency = f"{row.last_latency_s * 1000:.0f} ms" if row.last_latency_s is not None else "-"
        table.add_row(_text(row.session_id), _text(row.episode), steps, pages, format_bytes(row.cross_attention_bytes),
                      latency)
    if not s.sessions:
        table.add_row("[dim]none[/dim]", "", "", "", "", "")
    elif len(s.sessions) > SESSION_ROWS:
        table.add_row(f"[dim]… and {len(s.sessions) - SESSION_ROWS} more[/dim]", "", "", "", "", "")
    return Panel(table, title="sessions (least recently used first)", title_align="left", border_style="cyan")


def _events_panel(s: Snapshot):
    from rich.panel import Panel
    from rich.table import Table

    table = Table.grid(padding=(0, 2), expand=True)
    table.add_column(justify="right", style="dim", no_wrap=True, min_width=8)
    table.add_column(no_wrap=True, min_width=8)
    table.add_column(no_wrap=True, overflow="ellipsis", min_width=6, max_width=20)
    table.add_column(overflow="ellipsis", no_wrap=True, ratio=1)  # the detail takes what is left
    for event in s.events:
        style = EVENT_STYLES.get(event.kind, "")
        table.add_row(f"+{event.at_s:.3f}s", f"[{style}]{event.kind}[/{style}]" if style else event.kind,
                      _text(event.session_id), _text(event.detail))
    if not s.events:
        table.add_row("", "[dim]no events yet[/dim]", "", "")
    return Panel(table, title="events", title_align="left", border_style="cyan")


def _progress_line(s: Snapshot):
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    span = s.elapsed_s if s.counting_s is None else s.counting_s
    rate = s.steps_done / span if span > 0 else 0.0
    if s.steps_total is None:
        count, eta = f"{s.steps_done} {s.noun}", ""
    else:
        count = f"{s.steps_done}/{s.steps_total} {s.noun}"
        remaining = max(0, s.steps_total - s.steps_done)
        eta = f" · ETA {_clock(remaining / rate)}" if rate > 0 and remaining else ""
    text = f"{count} · {rate:.1f} {s.noun}/s{eta} · {s.evictions} evictions"
    if s.restores:
        text += f" · {s.restores} restored"
    if s.steps_replayed:
        text += f" · {s.steps_replayed} replayed"
    if s.steps_failed:
        text += f" · [red]{s.steps_failed} failed[/red]"
    text += f" · {_clock(s.elapsed_s)} [dim]{s.phase}[/dim]"
    total = s.steps_total if s.steps_total else None
    grid = Table.grid(expand=True)
    grid.add_column()
    grid.add_row(ProgressBar(total=total, completed=s.steps_done, pulse=total is None))
    grid.add_row(Text.from_markup(text))
    return grid


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _SideBySide:
    """Two renderables side by side when the console is wide enough, else one above the other."""

    def __init__(self, left, right, *, min_width: int = 110) -> None:
        self.left, self.right, self.min_width = left, right, min_width

    def __rich_console__(self, console, options):
        from rich.table import Table

        if options.max_width < self.min_width:
            yield self.left
            yield self.right
            return
        grid = Table.grid(expand=True)
        grid.add_column(ratio=2)
        grid.add_column(ratio=3)
        grid.add_row(self.left, self.right)
        yield grid


def render(snapshot: Snapshot):
    """The whole live layout for ``snapshot``: capacity and sessions (side by side when wide), events, progress."""
    from rich.console import Group
    from rich.text import Text

    return Group(Text(visible(snapshot.title), style="bold"),
                 _SideBySide(_capacity_panel(snapshot), _sessions_panel(snapshot)),
                 _events_panel(snapshot), _progress_line(snapshot))
