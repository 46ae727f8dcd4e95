"""Index maps described by strided boxes (``geoopt_quotient.sharpness.boxmap``)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geoopt_quotient.sharpness.boxmap import BoxMap, arithmetic_runs, box_map, joined
from geoopt_quotient.sharpness.sharded import _chunks, _MapParts


def greedy_runs(values: np.ndarray, keys=None):
    """The reference: one run at a time, as long as the steps stay equal and positive."""
    n, runs, start = len(values), [], 0
    while start < n:
        end = start
        if start + 1 < n:
            step = values[start + 1] - values[start]
            same = keys is None or keys[start + 1] == keys[start]
            if (step > 0).all() and same:
                end = start + 1
                while (
                    end + 1 < n
                    and (values[end + 1] - values[end] == step).all()
                    and (keys is None or keys[end + 1] == keys[end])
                ):
                    end += 1
        runs.append((start, end - start + 1))
        start = end + 1
    return runs


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-2, 3), st.integers(-1, 2)), max_size=40),
    st.integers(1, 2),
    st.one_of(st.none(), st.lists(st.integers(0, 1), min_size=40, max_size=40)),
)
def test_runs_are_the_greedy_split(steps, sides, keys):
    values = np.cumsum(np.array(steps, dtype=np.int64).reshape(-1, 2)[:, :sides], 0)
    keys = None if keys is None else np.array(keys[: len(values)])
    starts, lengths, run_steps = arithmetic_runs(values, keys)
    assert list(zip(starts.tolist(), lengths.tolist())) == greedy_runs(values, keys)
    for start, length, step in zip(starts, lengths, run_steps):
        expected = values[start] + np.arange(length)[:, None] * step
        assert np.array_equal(values[start : start + length], expected)


@st.composite
def strided_maps(draw):
    """Entries of a few parameters, each seen through a permutation of its dimensions
    and sliced, concatenated in a drawn order; the other side a contiguous buffer."""
    pieces, offset = [], 0
    for _ in range(draw(st.integers(1, 4))):
        shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
        param = torch.arange(offset, offset + int(np.prod(shape))).view(shape)
        offset += param.numel() + draw(st.integers(0, 3))
        view = param.permute(draw(st.permutations(range(len(shape)))))
        cut = tuple(slice(draw(st.integers(0, n - 1)), None) for n in view.shape)
        pieces.append(view[cut].reshape(-1))
    order = draw(st.permutations(range(len(pieces))))
    return torch.cat([pieces[i] for i in order])


@settings(max_examples=200, deadline=None)
@given(strided_maps(), st.integers(0, 7))
def test_boxes_give_the_map_and_copy_both_ways(model, shift):
    ball = torch.arange(model.numel()) * 2 + shift  # every other entry of a buffer
    boxes = box_map(model, ball)
    assert torch.equal(boxes.positions(), torch.stack([model, ball], 1))
    source = torch.randn(int(model.max()) + 1, dtype=torch.float64)
    out = torch.zeros(2 * model.numel() + shift, dtype=torch.float64)
    boxes.copy(source, out)
    assert torch.equal(out[ball], source[model])
    back = torch.zeros_like(source)
    boxes.copy(out, back, reverse=True)
    assert torch.equal(back[model], source[model])


def test_heads_transposed_over_layers_are_one_box():
    """Query rows of 3 heads of 4 rows, of 2 layers of 6 inputs apart by 80 entries,
    transposed per head in the ball: one box, a few integers for 144 entries."""
    layers = [torch.arange(80 * i, 80 * i + 72).view(12, 6) for i in range(2)]
    model = torch.cat([w.view(3, 4, 6).transpose(1, 2).reshape(-1) for w in layers])
    boxes = box_map(model, torch.arange(model.numel()) + 5)
    assert boxes.boxes == 1
    assert boxes.shapes == ((2, 3, 6, 4),)
    assert boxes.strides == (((80, 24, 1, 6), (72, 24, 4, 1)),)


def _transfer(source, target):
    """The map ``source[k] -> target[k]`` as the sharded exchange builds it (one chunk)."""
    parts = _MapParts()
    parts.add(source, target)
    return parts.finish(torch.device("cpu"))


def test_an_irregular_map_is_copied_by_index():
    """The negative: a random permutation has no boxes worth copying one by one."""
    generator = torch.Generator().manual_seed(0)
    model = torch.randperm(4096, generator=generator)
    ball = torch.arange(4096)
    assert box_map(model, ball).boxes > 1000
    transfer = _transfer(model, ball)
    assert transfer.index is not None and transfer.boxes.boxes == 0
    source, out = torch.randn(4096), torch.zeros(4096)
    transfer.copy(source, out)
    assert torch.equal(out, source[model])
    regular = _transfer(torch.arange(100, 4196), ball)
    assert regular.index is None and regular.nbytes() < 64


def test_ranges_are_one_box_each():
    ranges = [(10, 0, 3), (0, 5, 4), (20, 3, 0)]
    boxes = BoxMap.of_ranges(ranges)
    expected = torch.tensor([[10, 0], [11, 1], [12, 2], [0, 5], [1, 6], [2, 7], [3, 8]])
    assert boxes.boxes == 3 and torch.equal(boxes.positions(), expected)
    assert BoxMap.of_ranges([]).boxes == 0


@settings(max_examples=100, deadline=None)
@given(strided_maps(), st.lists(st.integers(1, 30), min_size=1, max_size=5), st.data())
def test_maps_joined_from_chunks_are_the_whole_map_shifted(model, cuts, data):
    """Cut into chunks, each chunk's boxes and the chunks joined with shifts per side:
    the whole map, moved; a regular map cut into chunks of one length joins into one box
    (and the last chunk's, if shorter)."""
    ball = torch.arange(model.numel()) * 3 + 1
    edges = sorted({0, model.numel(), *(c % model.numel() for c in cuts)})
    pieces = [(model[a:b], ball[a:b]) for a, b in pairwise(edges)]
    shifts = [tuple(data.draw(st.integers(0, 50)) for _ in range(2)) for _ in pieces]
    maps = [box_map(m, b) for m, b in pieces]
    expected = torch.cat(
        [torch.stack([m + s0, b + s1], 1) for (m, b), (s0, s1) in zip(pieces, shifts)]
    )
    assert torch.equal(joined(maps, shifts).positions(), expected)
    regular = torch.arange(5, 5 + 4 * model.numel(), 4)
    length = data.draw(st.integers(1, 10))  # chunks of whole blocks: alike but the last
    edges = [*range(0, model.numel(), length), model.numel()]
    cut = [box_map(regular[a:b], ball[a:b]) for a, b in pairwise(edges)]
    assert joined(cut, [(0, 0)] * len(cut)).boxes <= 2


def test_map_parts_of_peers_are_moved_to_their_sections():
    """Three peers' parts in one: each peer's positions moved by its shift, the boxes'
    and the irregular index's alike."""
    parts = []
    for peer in range(3):
        part = _MapParts()
        part.add(torch.arange(10 * peer, 10 * peer + 4), torch.arange(4))
        parts.append(part)
    irregular = torch.randperm(200, generator=torch.Generator().manual_seed(0))
    parts[1].add(irregular, torch.arange(4, 204))  # an index part
    shifts = [(0, 0), (7, 4), (3, 208)]  # the second peer's source also moved
    transfer = _MapParts.of(parts, shifts).finish(torch.device("cpu"))
    assert transfer.index is not None
    source = torch.randn(300)
    out = torch.zeros(212)
    transfer.copy(source, out)
    expected = torch.cat([source[0:4], source[17:21], source[irregular + 7], source[23:27]])
    assert torch.equal(out, expected)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=4),
    st.integers(0, 2),
    st.integers(1, 70),
)
def test_chunks_cover_the_point_in_order_with_whole_blocks(shape, block_dims, limit):
    block_dims = min(block_dims, len(shape))
    numbered = torch.arange(int(np.prod(shape))).view(shape)
    seen = []
    block = int(np.prod(shape[len(shape) - block_dims :]))
    for lo, size in _chunks(shape, block_dims, limit):
        assert list(size[len(shape) - block_dims :]) == shape[len(shape) - block_dims :]
        assert int(np.prod(size)) <= max(limit, block) or 0 in shape
        seen.append(numbered[tuple(slice(a, a + n) for a, n in zip(lo, size))].reshape(-1))
    assert torch.equal(torch.cat(seen) if seen else numbered.reshape(-1)[:0], numbered.reshape(-1))
