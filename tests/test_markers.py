"""The `serial` mark (tests/conftest.py): tests whose body reads the device's free memory get it, the others do
not, so `make test-gpu` can run them alone after its parallel pass. And `slow` tests are put first (for xdist)."""

from __future__ import annotations

import pytest

from tests.conftest import pytest_collection_modifyitems, pytest_itemcollected


class Item:
    """The part of a pytest item the hook uses."""

    def __init__(self, function, *markers):
        self.function, self.markers = function, list(markers)

    def get_closest_marker(self, name):
        return next((m for m in self.markers if m.name == name), None)

    def add_marker(self, marker):
        self.markers.append(marker.mark if hasattr(marker, "mark") else marker)


def reads_free_memory(drv):
    free_before = drv.cuMemGetInfo()[1]
    return free_before


def reads_numba_memory_info(cuda):
    return cuda.current_context().get_memory_info().free


def counts_allocations(calls):
    assert calls == []


@pytest.mark.parametrize(
    "function, serial", [(reads_free_memory, True), (reads_numba_memory_info, True), (counts_allocations, False)]
)
def test_tests_reading_device_memory_are_marked_serial(function, serial):
    item = Item(function)
    pytest_itemcollected(item)
    assert [m.name for m in item.markers] == (["serial"] if serial else [])


def test_a_test_marked_serial_is_marked_once_and_a_doctest_is_left_alone():
    item = Item(reads_free_memory, pytest.mark.serial.mark)
    pytest_itemcollected(item)
    assert len(item.markers) == 1
    pytest_itemcollected(Item(None))


def test_slow_tests_are_put_first_and_the_others_keep_their_order():
    items = [Item(None), Item(None, pytest.mark.slow.mark), Item(None), Item(None, pytest.mark.slow.mark)]
    before = list(items)
    pytest_collection_modifyitems(None, items)
    assert items == [before[1], before[3], before[0], before[2]]
