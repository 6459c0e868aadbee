"""The live display: a pure function ``render(snapshot)`` of a frozen :class:`Snapshot`.

The runtime never imports Rich. The CLI's :class:`~ardiff_cli.monitor.RunMonitor`
subscribes to runtime events and keeps the snapshot; ``Live(get_renderable=...)``
calls ``render(monitor.snapshot())`` a few times a second. The README's quick start shows a frame:
the title, the capacity and sessions panels, the events, the progress line.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ardiff_cli.output import as_text, visible
from ardiff_cli.runtime.capacity import format_bytes
from ardiff_cli.runtime.errors import plural


@dataclass(frozen=True, slots=True)
class SessionRow:
    session_id: str  # in a rollout, its episode's name
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
    phase: str = "loading"  # loading | warmup | running | following | stopping | done | interrupted | failed
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
    swap_kept: bool = False  # a stopped run's end: ``swapped`` counts the snapshots kept for --resume
    elapsed_s: float = 0.0
    attention: str = ""  # the attention backend that runs ("torch" or "vllm"); "" before the plan
    noun: str = "step"  # what steps_done counts, singular (plural() adds the s): a rollout's step, warmup's request
    counting_s: float | None = None  # seconds of the phase that does the counted work (the rate and ETA are of it,
    # not of the model's load or the warmup before it); None: elapsed_s


class _Name:
    """A session or episode name in a cell too narrow for it, cut in the middle (``pick_cu…de_0042``): names of a
    run's episodes often share a long prefix and differ at the end, and a name cut at its end made all of them
    look the same (``pick_cube_2025-06…`` for every episode)."""

    def __init__(self, name: str) -> None:
        self.name = visible(name)

    def __rich_measure__(self, console, options):
        from rich.cells import cell_len
        from rich.measure import Measurement

        width = cell_len(self.name)
        return Measurement(min(width, 5), width)

    def __rich_console__(self, console, options):
        from rich.text import Text

        yield Text(middle_cut(self.name, options.max_width), no_wrap=True, overflow="crop")


def middle_cut(name: str, width: int) -> str:
    """``name`` in at most ``width`` terminal cells: its start, ``…`` and its end (the longer part)."""
    import unicodedata

    from rich.cells import cell_len, set_cell_size

    if cell_len(name) <= width:
        return name
    if width <= 1:
        return "…"[:width]
    keep = width - 1
    head = set_cell_size(name, keep // 2).rstrip()  # a wide character that did not fit is padded: drop the pad
    tail_cells = keep - cell_len(head)
    start = len(name)
    while start > 0 and cell_len(name[start - 1:]) <= tail_cells:
        start -= 1
    while start < len(name) and unicodedata.combining(name[start]):  # never a mark without its letter
        start += 1
    return f"{head}…{name[start:]}"


# The sessions panel's most rows: the least recently used (the next to be evicted), then how many more. A row per
# resident session (hundreds with a small model) pushed the events and the progress line off the screen, and drawing
# them 4 times a second took more than the CPU time there is (1,000 rows: 0.4 s per frame).
SESSION_ROWS = 16

EVENT_STYLES = {"admitted": "green", "evicted": "yellow", "dropped": "yellow", "restored": "green", "reset": "magenta",
                "closed": "blue", "failed": "red", "hook_failed": "red", "swap_failed": "red", "warmup": "cyan",
                "episode": "cyan"}


def _capacity_rows(s: Snapshot) -> list[tuple[str, object]]:
    """The capacity panel's rows (label, value), one terminal line each."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    rows: list[tuple[str, object]] = [("device", f"{s.device} · {s.dtype}")]
    if s.budget_bytes is not None:
        budget = format_bytes(s.budget_bytes)
        rows.append(("budget", _Fit(f"{budget} of {format_bytes(s.available_bytes)}", budget)
                     if s.available_bytes else budget))
    if s.page_size is not None:
        tokens = f"{s.page_size} tokens"
        rows.append(("page", _Fit(f"{tokens} · {format_bytes(s.bytes_per_page)}", tokens)
                     if s.bytes_per_page else tokens))
    bar = Table.grid(padding=(0, 1))
    bar.add_column(width=12)
    bar.add_column(no_wrap=True, overflow="ellipsis")
    pages = f"{s.pages_used}/{s.pages_total}"
    bar.add_row(ProgressBar(total=max(1, s.pages_total), completed=s.pages_used, width=12),
                _Fit(f"{pages}, {s.pages_total - s.pages_used} free", pages))
    rows.append(("pages", bar))
    rows.append(("sessions", f"{len(s.sessions)}/{s.session_capacity} resident"))
    if s.swap_budget_bytes:
        out = f"{s.swapped} {'kept' if s.swap_kept else 'out'}"
        used, space = format_bytes(s.swapped_bytes), format_bytes(s.swap_budget_bytes)
        rows.append(("swap", _Fit(f"{out}, {used} of {space}", f"{out}, {used}/{space}", f"{out}, {used}", out)))
    if s.attention:
        rows.append(("attention", s.attention))
    return rows


class _Fit:
    """The first of ``variants`` (each shorter than the one before) that fits the width it gets: a value too long
    for a narrow panel loses whole parts from its end ("1 out, 160.58 KiB" at 40 columns), never half a unit
    ("1 out, 160.58 KiB of 19.61")."""

    def __init__(self, *variants: str) -> None:
        self.variants = variants

    def __rich_measure__(self, console, options):
        from rich.cells import cell_len
        from rich.measure import Measurement

        return Measurement(cell_len(self.variants[-1]), cell_len(self.variants[0]))

    def __rich_console__(self, console, options):
        from rich.cells import cell_len
        from rich.text import Text

        fits = [v for v in self.variants if cell_len(v) <= options.max_width]
        yield Text(fits[0] if fits else self.variants[-1], no_wrap=True, overflow="ellipsis")


def _capacity_panel(rows: list[tuple[str, object]]):
    from rich.panel import Panel
    from rich.table import Table

    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True, min_width=max(len(label) for label, _ in rows))
    grid.add_column()  # a _Fit never wraps; the column may narrow to a value's shortest form (Table collapses it)
    for label, value in rows:
        grid.add_row(label, _Fit(value) if isinstance(value, str) else value)
    return Panel(grid, title="capacity", title_align="left", border_style="cyan")


def _short(branch: str, branches: Iterable[str] = ()) -> str:
    """A CFG branch's name in the pages column: whole up to four letters ("main"), else its first three ("pos"), or
    as many more as tell it from the session's other ``branches`` ("cond_text" and "cond_image": "cond_t", "cond_i";
    both were "con", with three or more branches of one pipeline)."""
    if len(branch) <= 4:
        return branch
    others = [other for other in branches if other != branch]
    size = 3
    while size < len(branch) and any(other[:size] == branch[:size] for other in others):
        size += 1
    return branch[:size]


class _SessionsTable:
    """The sessions table with the columns that fit the width: the session and its steps always, then its pages,
    its last latency and its cross-attention bytes while they fit (at 40 columns, six columns cut to "ses…",
    "d…_2" and "pos:1 n…" were all unreadable)."""

    GAP = 2  # cells between two columns

    def __init__(self, s: Snapshot, num_rows: int) -> None:
        rows = []
        for row in s.sessions[:num_rows]:
            steps = f"{row.steps_done}/{row.steps_total}" if row.steps_total is not None else str(row.steps_done)
            latency = f"{row.last_latency_s * 1000:.0f} ms" if row.last_latency_s is not None else "-"
            rows.append({"session": row.session_id, f"{s.noun}s": steps,
                         "pages": " ".join(f"{_short(branch, row.pages_per_branch)}:{n}"
                                           for branch, n in row.pages_per_branch.items()),
                         "last": latency, "x-attn": format_bytes(row.cross_attention_bytes)})
        self.noun, self.rows = f"{s.noun}s", rows

    def columns(self, width: int) -> dict[str, int]:
        """The columns shown in ``width`` cells, in the order they are kept, and the cells each may take: the
        others their widest cell, the session what is left (a longer name is cut in its middle)."""
        from rich.cells import cell_len

        names = ["session", self.noun, "pages", "last", "x-attn"]
        widths = {name: max([cell_len(name), *(cell_len(row[name]) for row in self.rows)]) for name in names}
        session = min(widths["session"], 12)  # dropping a column makes room for a name this long
        while len(names) > 2 and session + sum(widths[n] + self.GAP for n in names[1:]) > width:
            names.pop()
        rest = sum(widths[n] + self.GAP for n in names[1:])
        return {"session": max(1, min(widths["session"], width - rest)), **{n: widths[n] for n in names[1:]}}

    def __rich_console__(self, console, options):
        from rich.table import Table

        shown = self.columns(options.max_width)
        table = Table(expand=True, box=None, pad_edge=False, header_style="bold", padding=(0, self.GAP // 2))
        for name, cells in shown.items():
            left = name in ("session", "pages")
            table.add_column(name, justify="left" if left else "right", no_wrap=True, overflow="ellipsis",
                             min_width=None if name == "session" else cells, max_width=cells)
        for row in self.rows:
            table.add_row(*(_Name(row[name]) if name == "session" else row[name] for name in shown))
        if not self.rows:
            table.add_row("[dim]none[/dim]", *[""] * (len(shown) - 1))
        yield table


def _sessions_panel(s: Snapshot, num_rows: int = SESSION_ROWS):
    """The ``num_rows`` least recently used sessions, then how many more."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    body = _SessionsTable(s, num_rows)
    if len(s.sessions) > num_rows:  # under the table, not in its narrow first column: "… and 24 m…" at 40 columns
        body = Group(body, Text(f"… and {len(s.sessions) - num_rows} more", style="dim", no_wrap=True,
                                overflow="ellipsis"))
    return Panel(body, title="sessions (least recently used first)", title_align="left", border_style="cyan")


def _sessions_height(s: Snapshot, num_rows: int) -> int:
    """Lines of ``_sessions_panel(s, num_rows)``: borders, header, rows (every cell is one line), the count."""
    shown = min(num_rows, len(s.sessions))
    return 3 + max(1, shown) + (len(s.sessions) > shown)


class _EventsTable:
    """Events, one per line: time, kind, session, detail. The session takes up to ``NAME_CELLS`` and the detail what
    is left; where that would be under ``MIN_DETAIL`` cells the detail goes and the session takes it all (at 40
    columns Rich cropped the rows at the border: the ends of the names, which tell episodes apart, went first)."""

    GAP = 2  # cells between two columns
    NAME_CELLS = 20
    MIN_DETAIL = 6

    def __init__(self, events: tuple[EventRow, ...]) -> None:
        self.events = events

    def __rich_console__(self, console, options):
        from rich.cells import cell_len
        from rich.table import Table
        from rich.text import Text

        if not self.events:
            yield Text("no events yet", style="dim", no_wrap=True, overflow="ellipsis")
            return
        times = [f"+{event.at_s:.3f}s" for event in self.events]
        fixed = [max([8, *map(cell_len, times)]), max([8, *(cell_len(e.kind) for e in self.events)])]
        left = options.max_width - sum(fixed) - 2 * self.GAP  # for the session and the detail
        name = min(self.NAME_CELLS, max([6, *(cell_len(visible(e.session_id)) for e in self.events)]))
        detail = left - name - self.GAP >= self.MIN_DETAIL
        table = Table.grid(padding=(0, self.GAP), expand=True)  # a grid collapses the two paddings into one gap
        table.add_column(justify="right", style="dim", no_wrap=True, width=fixed[0])
        table.add_column(no_wrap=True, width=fixed[1])
        table.add_column(no_wrap=True, width=name if detail else max(1, left))
        if detail:
            table.add_column(overflow="ellipsis", no_wrap=True, ratio=1)  # the detail takes what is left
        for at, event in zip(times, self.events):
            style = EVENT_STYLES.get(event.kind, "")
            kind = f"[{style}]{event.kind}[/{style}]" if style else event.kind
            table.add_row(at, kind, _Name(event.session_id), *([as_text(event.detail)] if detail else []))
        yield table


def _events_panel(s: Snapshot, num_rows: int):
    """The newest ``num_rows`` events, oldest first."""
    from rich.panel import Panel

    events = s.events[max(0, len(s.events) - num_rows):]
    return Panel(_EventsTable(events), title="events", title_align="left", border_style="cyan")


# Columns the status line leaves free at its end. The terminal echoes a typed Ctrl-C as "^C" where the cursor is,
# at the end of the live display's last line: on a line that filled the width the echo wrapped onto a new line,
# and the next frame, moving up as many lines as it drew, left the display's first line behind on the screen (a
# second title line after every Ctrl-C). Two echoes fit.
ECHO_ROOM = 4


class _Room:
    """``text`` wrapped to the width less ``ECHO_ROOM`` columns."""

    def __init__(self, text) -> None:
        self.text = text

    def __rich_console__(self, console, options):
        yield from console.render(self.text, options.update_width(max(1, options.max_width - ECHO_ROOM)))


def _progress_line(s: Snapshot):
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    span = s.elapsed_s if s.counting_s is None else s.counting_s
    rate = s.steps_done / span if span > 0 else 0.0
    if s.steps_total is None:
        count, eta = plural(s.steps_done, s.noun), ""
    else:
        count = f"{s.steps_done}/{plural(s.steps_total, s.noun)}"
        remaining = max(0, s.steps_total - s.steps_done)
        # only while the counted work runs: a stopping, stopped or failed run has no time left to show
        running = s.phase in ("running", "warmup")
        eta = f" · ETA {_clock(remaining / rate)}" if running and rate > 0 and remaining else ""
    text = f"{count} · {rate:.1f} {s.noun}s/s{eta} · {plural(s.evictions, 'eviction')}"
    if s.restores:
        text += f" · {s.restores} restored"
    if s.steps_replayed:
        text += f" · {s.steps_replayed} replayed"
    if s.steps_failed:
        text += f" · [red]{s.steps_failed} failed[/red]"
    text += f" · {_clock(s.elapsed_s)} [dim]{s.phase}[/dim]"
    total = s.steps_total if s.steps_total else None
    bar = Table.grid(expand=True)
    bar.add_column()
    bar.add_row(ProgressBar(total=total, completed=s.steps_done, pulse=total is None))
    return Group(bar, _Room(Text.from_markup(text)))


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


SIDE_BY_SIDE_WIDTH = 110  # capacity and sessions side by side from this width, else one above the other


class _SideBySide:
    """Two renderables side by side when the console is wide enough, else one above the other."""

    def __init__(self, left, right) -> None:
        self.left, self.right = left, right

    def __rich_console__(self, console, options):
        from rich.table import Table

        if options.max_width < SIDE_BY_SIDE_WIDTH:
            yield self.left
            yield self.right
            return
        grid = Table.grid(expand=True)
        grid.add_column(ratio=2)
        grid.add_column(ratio=3)
        grid.add_row(self.left, self.right)
        yield grid


class _Screen:
    """The layout of one snapshot, fitted to the terminal's height.

    The live display cuts what is taller than the terminal from the bottom: on a 24-line terminal with 8 resident
    sessions that was the events and the progress line, and on 10 lines everything but the title and the
    capacity panel. The title and the progress line always show; what room is left goes, in this order, to the
    newest event, the capacity panel, up to 3 events, the sessions (the least recently used first), then the
    other events. A terminal too short even for the title and the progress line is left to the live display."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.s = snapshot

    def __rich_console__(self, console, options):
        from rich.text import Text

        s = self.s
        title, progress = Text(visible(s.title), style="bold"), _progress_line(s)
        capacity = _capacity_rows(s)
        side = options.max_width >= SIDE_BY_SIDE_WIDTH
        room = options.size.height - sum(len(console.render_lines(part, options, pad=False))
                                         for part in (title, progress))
        shown = _fit(s, room, capacity_height=2 + len(capacity), side=side)
        yield title
        show_capacity, num_sessions, num_events = shown
        if show_capacity and num_sessions:
            yield _SideBySide(_capacity_panel(capacity), _sessions_panel(s, num_sessions))
        elif show_capacity:
            yield _capacity_panel(capacity)
        elif num_sessions:
            yield _sessions_panel(s, num_sessions)
        if num_events:
            yield _events_panel(s, num_events)
        yield progress


def _fit(s: Snapshot, room: int, *, capacity_height: int, side: bool) -> tuple[bool, int, int]:
    """(show the capacity panel, session rows (0: no sessions panel), event rows (0: no events panel)) that fit in
    ``room`` lines: everything if it fits, else as much as fits, in the order ``_Screen`` says."""
    num_events = max(1, len(s.events))  # the panel says "no events yet" when there are none

    def height(capacity: bool, sessions: int, events: int) -> int:
        top = [capacity_height] if capacity else []
        if sessions:
            top.append(_sessions_height(s, sessions))
        above = (max(top) if side and len(top) == 2 else sum(top))
        return above + (2 + events if events else 0)

    shown = [True, SESSION_ROWS, num_events]
    if height(*shown) <= room:
        return tuple(shown)
    shown = [False, 0, 0]
    steps = [(2, 1), (0, True), *((2, n) for n in range(2, min(3, num_events) + 1)),
             *((1, n) for n in range(1, min(SESSION_ROWS, max(1, len(s.sessions))) + 1)),
             *((2, n) for n in range(4, num_events + 1))]
    for index, value in steps:
        tried = list(shown)
        tried[index] = value
        if height(*tried) <= room:
            shown = tried
    return tuple(shown)


def render(snapshot: Snapshot):
    """The whole live layout for ``snapshot``: capacity and sessions (side by side when wide), events, progress,
    as much of it as the terminal's height holds (``_Screen``)."""
    return _Screen(snapshot)
