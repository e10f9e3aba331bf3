"""freeze_startup_heap: what is alive at the call leaves the collector's view; garbage made before it is collected."""

import gc
import weakref

from common.heap import freeze_startup_heap


class Node:
    def __init__(self):
        self.partner = None


def test_live_objects_are_frozen_and_earlier_garbage_is_collected():
    kept = [Node() for _ in range(3)]
    cycle_a, cycle_b = Node(), Node()
    cycle_a.partner, cycle_b.partner = cycle_b, cycle_a  # unreachable after the dels: only a collection frees it
    gone = weakref.ref(cycle_a)
    del cycle_a, cycle_b
    try:
        freeze_startup_heap("test")
        assert gone() is None  # collected first, not frozen with the live objects
        assert gc.get_freeze_count() > 0
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(node) in tracked for node in kept)  # out of every generation the collector scans
        later = Node()
        assert id(later) in {id(o) for o in gc.get_objects()}  # what is made afterwards is collected as usual
    finally:
        gc.unfreeze()  # the test process goes on with its heap as it was
