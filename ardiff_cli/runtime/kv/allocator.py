"""The page allocator: which page ids of the pools are free.

Leaf of the KV core: no torch, no sessions. It only hands out integer page
ids and takes them back.
"""

from __future__ import annotations

from collections.abc import Iterable

from ardiff_cli.runtime.errors import plural

NULL_PAGE_ID = 0


class KVCacheExhaustedError(MemoryError):
    """No free page is left for a request that the capacity plan should have covered."""


class PageAllocator:
    """A LIFO free list of page ids with ownership checks.

    Why it exists: page allocation happens on every committed block of every
    session, so allocate and free are O(1) list pops and appends.

    Order: the free list is a stack. Freed pages are reused first, which keeps
    the working set of the pools small and warm in cache. Callers need not
    keep any order themselves: ``free`` accepts pages in any order.

    Page ``NULL_PAGE_ID`` is reserved: never handed out, never freed. Block
    tables pad with it, so a stray read of padding hits a page no session owns.
    """

    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an integer >= 1 (the null page), got {num_pages!r}")
        # Total page ids, null page included; ids are 0 .. num_pages - 1.
        self.num_pages = num_pages
        # Stack of free ids, top at the end; the lowest ids are handed out first.
        self._free: list[int] = list(range(num_pages - 1, NULL_PAGE_ID, -1))
        # owned[i] is True while page i is handed out; O(1) double-free checks.
        self._owned = bytearray(num_pages)

    @property
    def num_allocatable(self) -> int:
        """Pages this allocator can ever hand out (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_allocatable - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Hand out ``count`` page ids; raise ``KVCacheExhaustedError`` when too few are free."""
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of pages, got {count}")
        if count > len(self._free):
            raise KVCacheExhaustedError(
                f"KV page pool exhausted: {plural(count, 'page')} requested, {len(self._free)} free "
                f"of {self.num_allocatable}"
            )
        pages = [self._free.pop() for _ in range(count)]
        for page_id in pages:
            assert not self._owned[page_id], f"page {page_id} on the free list while owned: free list corrupted"
            self._owned[page_id] = 1
        return pages

    def free(self, page_ids: list[int] | tuple[int, ...]) -> None:
        """Take back pages; a page not currently handed out is a ``ValueError`` and nothing is freed."""
        seen: set[int] = set()
        for page_id in page_ids:
            if page_id == NULL_PAGE_ID:
                raise ValueError("the null page is never allocated and cannot be freed")
            if not 0 < page_id < self.num_pages:
                raise ValueError(f"page {page_id} was never handed out by this allocator (ids 1..{self.num_pages - 1})")
            if page_id in seen:
                raise ValueError(f"double free of page {page_id} (listed twice)")
            if not self._owned[page_id]:
                raise ValueError(f"double free of page {page_id}, or a page this allocator never handed out")
            seen.add(page_id)
        for page_id in page_ids:
            self._owned[page_id] = 0
            self._free.append(page_id)
        assert len(self._free) <= self.num_allocatable, "free count exceeds allocatable pages: free list corrupted"

    def reclaim(self, held: Iterable[int]) -> int:
        """Make ``held`` the owned pages and put every other page that is not free back on the free list; how many
        came back. For the pages an operation stopped half way left with no owner (a Ctrl-C inside ``allocate``,
        ``free``, or a commit between them, while a session's forward ran): ``held`` must be every page a live
        owner holds. Free pages keep their order; the ones taken back go on top."""
        owned = bytearray(self.num_pages)
        for page_id in held:
            owned[page_id] = 1
        free = bytearray(self.num_pages)
        for page_id in self._free:
            free[page_id] = 1
        lost = [page_id for page_id in range(self.num_pages - 1, NULL_PAGE_ID, -1) if not owned[page_id]
                and not free[page_id]]
        self._free.extend(lost)
        self._owned = owned
        assert len(self._free) + sum(owned) == self.num_allocatable, "held pages on the free list: free list corrupted"
        return len(lost)

    def is_owned(self, page_id: int) -> bool:
        return bool(self._owned[page_id])
