"""core/heap.py: start-up's garbage is collected before the freeze (a cycle dropped at start-up is
not kept for ever), the survivors leave the collector's generations, and cycles made afterwards
are still collected."""

from __future__ import annotations

import gc
import weakref

from backboard.core.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self


def test_freeze_collects_first_and_later_cycles_still_die():
    gc.unfreeze()
    try:
        dropped, kept = _Node(), _Node()
        gone = weakref.ref(dropped)
        del dropped
        freeze_startup_heap()
        assert gone() is None                                # collected, not frozen
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # out of the collector's sight
        later = _Node()
        later_ref = weakref.ref(later)
        del later
        gc.collect()
        assert later_ref() is None
    finally:
        gc.unfreeze()
