"""The sequence protocol the column-backed tables share (header, stats, findings)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gradaudit.results.column_view import ColumnView


class Squares(ColumnView[int]):
    """Items built on demand; records which runs were asked for."""

    __slots__ = ("asked", "size")
    item_noun = "square"

    def __init__(self, size: int) -> None:
        self.size = size
        self.asked: list[range] = []

    def __len__(self) -> int:
        return self.size

    def _take(self, indices: range) -> Iterator[int]:
        self.asked.append(indices)
        return (i * i for i in indices)


def test_indexing_slicing_and_iteration_match_a_tuple() -> None:
    view, plain = Squares(7), tuple(i * i for i in range(7))
    for index in range(-7, 7):
        assert view[index] == plain[index]
    for cut in (slice(None), slice(2, 5), slice(5, 2), slice(None, None, -2), slice(1, None, 3)):
        assert view[cut] == plain[cut]
    assert list(view) == list(plain)
    assert view == plain
    assert view == list(plain)
    assert view != plain[:-1]
    assert view != "abc"
    assert view.index(16) == 4
    assert 36 in view


def test_one_item_builds_one_item() -> None:
    view = Squares(1000)
    assert view[-1] == 999 * 999
    assert view.asked == [range(999, 1000)]


@pytest.mark.parametrize("index", [7, -8])
def test_out_of_range_names_the_item(index: int) -> None:
    with pytest.raises(IndexError, match="square index out of range"):
        Squares(7)[index]


def test_unhashable_like_a_list() -> None:
    with pytest.raises(TypeError):
        hash(Squares(1))
