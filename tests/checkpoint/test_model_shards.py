"""Stage-3 model entries in checkpoints of the per-rank format before DCP: the rows each rank wrote, put back
whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distamp.checkpoint import model_shards


def _saved(world: int) -> tuple[dict, dict]:
    """``(index, parts)`` as ``world`` stage-3 ranks would have written nn.Linear(3, 5) (seed 0)."""
    torch.manual_seed(0)
    whole = nn.Linear(3, 5).state_dict()
    index, parts = {}, {r: {} for r in range(world)}
    for name, value in whole.items():
        chunks = list(value.chunk(world))
        rows, start = [], 0
        for r in range(world):
            chunk = chunks[r] if r < len(chunks) else value[:0]
            rows.append([start, start + len(chunk)])
            parts[r][name] = chunk.clone()
            start += len(chunk)
        index[name] = {"shape": list(value.shape), "rows": rows}
    return index, parts


def test_an_unsharded_model_gets_whole_entries_from_every_part():
    index, parts = _saved(4)  # 5 rows over 4 ranks: 2, 2, 1, 0
    assert index["weight"]["rows"] == [[0, 2], [2, 4], [4, 5], [5, 5]]
    model = nn.Linear(3, 5)
    assert model_shards.parts_needed(index, model) == [0, 1, 2]  # rank 3 holds no rows
    torch.manual_seed(0)
    expected = nn.Linear(3, 5).state_dict()
    loaded = model_shards.assemble(index, parts, model)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_missing_rows_entries_and_other_shapes_are_refused_with_the_fix():
    index, parts = _saved(2)
    with pytest.raises(ValueError, match=r"do not hold rows \[3, 5\) of model entry 'weight'"):
        model_shards.assemble(index, {0: parts[0]}, nn.Linear(3, 5))
    with pytest.raises(ValueError, match=r"entry 'weight' has shape \[5, 3\], this model's \[4, 3\]; build the model"):
        model_shards.parts_needed(index, nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r"has entries \['bias'\] that this model lacks"):
        model_shards.parts_needed(index, nn.Linear(3, 5, bias=False))
