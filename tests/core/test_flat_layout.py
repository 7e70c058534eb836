"""FlatLayout: balanced contiguous slices, and pieces/owners that agree with them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distamp.core.flat_layout import FlatLayout, Piece


def test_slices_are_contiguous_balanced_and_may_cut_parameters():
    layout = FlatLayout([6, 4], world_size=3)
    assert layout.bounds == (0, 3, 6, 10)
    assert layout.pieces(*layout.range_of(0)) == [Piece(0, 0, 3, 0)]
    assert layout.pieces(*layout.range_of(1)) == [Piece(0, 3, 6, 3)]
    assert layout.pieces(*layout.range_of(2)) == [Piece(1, 0, 4, 6)]
    assert layout.owners(0) == [(0, Piece(0, 0, 3, 0)), (1, Piece(0, 3, 6, 3))]


def test_more_ranks_than_elements_leaves_some_slices_empty():
    layout = FlatLayout([2], world_size=4)
    assert [layout.pieces(*layout.range_of(r)) for r in range(4)] == [[], [Piece(0, 0, 1, 0)], [], [Piece(0, 1, 2, 1)]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size=0 must be >= 1"):
        FlatLayout([3], 0)
    with pytest.raises(ValueError, match=r"rank=2 is outside \[0, 2\)"):
        FlatLayout([3], 2).range_of(2)


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(0, 50), max_size=8), world=st.integers(1, 9))
def test_every_element_has_exactly_one_owner(numels, world):
    layout = FlatLayout(numels, world)
    sizes = [hi - lo for lo, hi in (layout.range_of(r) for r in range(world))]
    assert sum(sizes) == sum(numels)
    assert max(sizes) - min(sizes) <= 1
    covered = []
    for rank in range(world):
        for piece in layout.pieces(*layout.range_of(rank)):
            assert piece.length > 0
            assert piece.offset == layout.offsets[piece.param] + piece.start
            covered.extend(range(piece.offset, piece.offset + piece.length))
            assert (rank, piece) in layout.owners(piece.param)
    assert covered == list(range(sum(numels)))
    for param in range(len(numels)):
        assert sum(p.length for _, p in layout.owners(param)) == numels[param]
