"""The page allocator: counts and ownership after every operation, loud misuse, a stateful model check."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ardiff_cli.runtime.kv.allocator import NULL_PAGE_ID, KVCacheExhaustedError, PageAllocator


def check(allocator: PageAllocator, owned: set[int]) -> None:
    """Counts and per-page ownership agree with the reference set ``owned``."""
    assert allocator.num_used == len(owned)
    assert allocator.num_free == allocator.num_allocatable - len(owned)
    assert allocator.num_free + allocator.num_used == allocator.num_pages - 1
    assert not allocator.is_owned(NULL_PAGE_ID)
    for page_id in range(allocator.num_pages):
        assert allocator.is_owned(page_id) == (page_id in owned), f"page {page_id}"


@pytest.mark.parametrize("num_pages", [0, -3, True, 2.0, "8", None])
def test_bad_size(num_pages):
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(num_pages)


def test_only_null_page():
    allocator = PageAllocator(1)
    assert (allocator.num_allocatable, allocator.num_free, allocator.num_used) == (0, 0, 0)
    assert allocator.allocate(0) == []
    with pytest.raises(KVCacheExhaustedError):
        allocator.allocate(1)


def test_allocate_free_step_by_step():
    allocator = PageAllocator(6)  # ids 1..5 allocatable
    owned: set[int] = set()
    check(allocator, owned)

    first = allocator.allocate(2)
    assert len(first) == 2 and NULL_PAGE_ID not in first
    owned |= set(first)
    check(allocator, owned)

    second = allocator.allocate(3)
    assert not set(second) & set(first)
    owned |= set(second)
    check(allocator, owned)
    assert owned == {1, 2, 3, 4, 5}

    allocator.free([second[1]])
    owned.discard(second[1])
    check(allocator, owned)

    allocator.free(first[::-1])  # any order is accepted
    owned -= set(first)
    check(allocator, owned)

    again = allocator.allocate(3)
    assert set(again) == {second[1], *first}  # exactly the freed pages come back, never the null page
    owned |= set(again)
    check(allocator, owned)

    allocator.free(list(owned))
    owned.clear()
    check(allocator, owned)


def test_freed_pages_are_reused_first():
    allocator = PageAllocator(10)
    pages = allocator.allocate(4)
    allocator.free([pages[2]])
    assert allocator.allocate(1) == [pages[2]]


def test_never_hands_out_null_page():
    allocator = PageAllocator(9)
    pages = allocator.allocate(8)
    assert sorted(pages) == list(range(1, 9))
    check(allocator, set(pages))


def test_exhaustion_message_has_numbers_and_changes_nothing():
    allocator = PageAllocator(5)
    owned = set(allocator.allocate(3))
    with pytest.raises(KVCacheExhaustedError) as excinfo:
        allocator.allocate(2)
    message = str(excinfo.value)
    assert "2 pages requested" in message and "1 free" in message and "of 4" in message
    assert isinstance(excinfo.value, MemoryError)
    check(allocator, owned)


def test_negative_allocate():
    allocator = PageAllocator(5)
    with pytest.raises(ValueError, match="-1"):
        allocator.allocate(-1)
    check(allocator, set())


def test_double_free():
    allocator = PageAllocator(5)
    pages = allocator.allocate(2)
    allocator.free([pages[0]])
    with pytest.raises(ValueError, match=f"page {pages[0]}"):
        allocator.free([pages[0]])
    check(allocator, {pages[1]})


def test_reclaim_takes_back_the_pages_an_interrupted_operation_left_with_nobody():
    """A stop half way through ``allocate`` (pages popped, not all marked) or ``free`` (marked free, not yet listed)
    leaves pages neither free nor owned by anyone the caller knows: ``reclaim`` makes the pages still held the owned
    ones and lists every other page as free again, keeping the free pages' order."""
    allocator = PageAllocator(8)
    held = set(allocator.allocate(3))  # 1, 2, 3
    lost = allocator.allocate(2)  # 4, 5: handed to a forward that a Ctrl-C then dropped
    allocator._free.pop()  # 6: popped by an allocate the Ctrl-C cut short, never marked owned
    free_before = list(allocator._free)
    assert allocator.reclaim(held) == 3
    check(allocator, held)
    assert allocator._free[:len(free_before)] == free_before and sorted(allocator._free) == [4, 5, 6, 7]
    assert allocator.reclaim(held) == 0  # nothing lost: nothing changes
    check(allocator, held)
    assert sorted(allocator.allocate(4)) == [4, 5, 6, 7] and lost == [4, 5]


def test_duplicate_in_one_free_is_atomic():
    allocator = PageAllocator(5)
    pages = allocator.allocate(2)
    with pytest.raises(ValueError, match=f"page {pages[1]}"):
        allocator.free([pages[0], pages[1], pages[1]])
    check(allocator, set(pages))  # nothing freed


@pytest.mark.parametrize("page_id", [3, 4])
def test_free_never_handed_out_in_range(page_id):
    allocator = PageAllocator(5)
    pages = allocator.allocate(2)
    assert page_id not in pages
    with pytest.raises(ValueError, match=f"page {page_id}"):
        allocator.free([pages[0], page_id])
    check(allocator, set(pages))  # the valid page was not freed either


@pytest.mark.parametrize("page_id", [5, 99, -1])
def test_free_out_of_range(page_id):
    allocator = PageAllocator(5)
    pages = allocator.allocate(1)
    with pytest.raises(ValueError, match="never handed out"):
        allocator.free([page_id])
    check(allocator, set(pages))


def test_free_null_page():
    allocator = PageAllocator(5)
    pages = allocator.allocate(4)
    with pytest.raises(ValueError, match="null page"):
        allocator.free([NULL_PAGE_ID])
    with pytest.raises(ValueError, match="null page"):
        allocator.free([pages[0], NULL_PAGE_ID])
    check(allocator, set(pages))


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free against a reference set of owned page ids."""

    NUM_PAGES = 17

    def __init__(self):
        super().__init__()
        self.allocator = PageAllocator(self.NUM_PAGES)
        self.owned: set[int] = set()

    @rule(count=st.integers(0, 6))
    def allocate(self, count):
        free_before = self.allocator.num_free
        if count > free_before:
            with pytest.raises(KVCacheExhaustedError):
                self.allocator.allocate(count)
            return
        pages = self.allocator.allocate(count)
        assert len(pages) == len(set(pages)) == count
        assert NULL_PAGE_ID not in pages
        assert not set(pages) & self.owned, "handed out a page that is already owned"
        assert all(0 < p < self.NUM_PAGES for p in pages)
        self.owned |= set(pages)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free_some(self, data):
        pages = data.draw(st.lists(st.sampled_from(sorted(self.owned)), min_size=1, max_size=5, unique=True))
        self.allocator.free(pages)
        self.owned -= set(pages)

    @rule(page_id=st.integers(-2, NUM_PAGES + 2))
    def free_invalid(self, page_id):
        if page_id in self.owned:
            return
        with pytest.raises(ValueError):
            self.allocator.free([page_id])

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free_mixed_batch_is_atomic(self, data):
        good = data.draw(st.sampled_from(sorted(self.owned)))
        bad = data.draw(st.sampled_from([NULL_PAGE_ID, good]))  # the null page or a duplicate
        with pytest.raises(ValueError):
            self.allocator.free([good, bad])

    @invariant()
    def counts_and_ownership(self):
        check(self.allocator, self.owned)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
