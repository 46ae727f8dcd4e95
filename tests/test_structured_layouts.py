"""Structured layouts: groups described by boxes of strided parameter views.

The description must give exactly what the index map gives (the same points, the same
write-backs, the same plans), refuse what it refuses (repeated entries, overlapping
groups), and stay small on a model of 7B width built on the ``meta`` device.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_find_symmetries import CASES, lora_model
from test_find_symmetries import model_for as case_model
from test_modern_llms import FAMILIES
from test_modern_llms import model_for as family_model

from geoopt_quotient import GLQuotient, PlanError, SymmetryGroup, SymmetryPlan, find_symmetries
from geoopt_quotient.manifolds import AdaptiveEuclidean
from geoopt_quotient.symmetry import plan as plan_module
from geoopt_quotient.symmetry import strided, structured
from geoopt_quotient.symmetry.plan import (
    StructuredGroup,
    WholeParameterGroup,
    whole_parameter_group,
)

F64 = torch.float64
pytestmark = [pytest.mark.usefixtures("single_thread")]


def index_map_plan(model, monkeypatch, **options):
    """The plan built with index maps only (the probes switched off)."""
    with monkeypatch.context() as patch:
        patch.setattr(structured, "trace", lambda layout, shapes: None)
        plan = find_symmetries(model, **options)
        bound = plan.bind(model)
        bound._partition, bound._strided  # noqa: B018 - decided with index maps
    return plan, bound


MODELS = [("case", n) for n in CASES] + [("family", n) for n in FAMILIES] + [("lora", "lora")]


def model_named(source: str, name: str) -> torch.nn.Module:
    if source == "lora":
        return lora_model()
    return case_model(name) if source == "case" else family_model(name)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
@pytest.mark.parametrize(("source", "name"), MODELS, ids=[n for _, n in MODELS])
def test_structured_plans_are_the_index_map_plans(source, name, monkeypatch):
    """Every family (kinds="all": MLP pairs too, ReLU ones in T5) and LoRA adapters."""
    model = model_named(source, name)
    options = dict(kinds="all")
    plan = find_symmetries(model, **options)
    bound = plan.bind(model)
    old_plan, old_bound = index_map_plan(model, monkeypatch, **options)
    assert all(isinstance(g, (StructuredGroup, WholeParameterGroup)) for g in bound.groups)
    assert not any(isinstance(g, (StructuredGroup, WholeParameterGroup)) for g in old_plan.groups)
    assert bound.summary() == old_bound.summary()
    assert [g.name for g in bound.groups] == [g.name for g in old_bound.groups]
    for new, old in zip(bound.groups, old_bound.groups):
        assert (new.kind, new.count, new.param_names) == (old.kind, old.count, old.param_names)
        assert new.shape == old.shape
        if not new.is_whole_parameter:
            assert "_index" not in new.__dict__  # nothing asked for it yet
            assert new.index.dtype == old.index.dtype and torch.equal(new.index, old.index)
    params = {n: p.detach() for n, p in model.named_parameters()}
    points = bound.gather(params)
    assert all(torch.equal(a, b) for a, b in zip(points, old_bound.gather(params)))
    g = torch.Generator().manual_seed(0)
    moved = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in points]
    new_out, old_out = bound.scatter(moved, params), old_bound.scatter(moved, params)
    assert all(torch.equal(new_out[n], old_out[n]) for n in params)
    monkeypatch.setattr(strided, "MIN_ENTRIES_PER_PIECE", 0)  # strided copies, however small
    assert bound._strided is not None or old_bound._strided is None
    new_out = bound.scatter(moved, params)
    assert all(torch.equal(new_out[n], old_out[n]) for n in params)
    elements = [
        torch.linalg.matrix_exp(0.1 * torch.randn(*grp.shape[:-2], h, h, generator=g, dtype=F64))
        if type(grp.manifold) is GLQuotient
        else None
        for grp in bound.symmetric_groups
        for h in [grp.shape[-1]]
    ]
    new_act, old_act = bound.act(params, elements), old_bound.act(params, elements)
    assert all(torch.equal(new_act[n], old_act[n]) for n in params)


# --------------------------------------------------- random layouts: probes vs index map


def _divisor(n: int, rng: random.Random) -> int:
    return rng.choice([d for d in range(1, n + 1) if n % d == 0])


def _step(x, rng: random.Random):
    """One random view, index or concatenation of ``x`` (a tensor or a probe) that uses
    each of its entries at most once."""
    dims = list(range(x.dim()))
    dim = rng.choice(dims)
    size = x.shape[dim]
    op = rng.randrange(9)
    if op == 0:
        rng.shuffle(dims)
        return x.permute(*dims)
    if op == 1 and x.dim() >= 2:
        return x.mT
    if op == 2:  # split one dimension in two
        d = _divisor(size, rng)
        return x.reshape(*x.shape[:dim], d, size // d, *x.shape[dim + 1 :])
    if op == 3 and dim + 1 < x.dim():  # merge two neighbours
        return x.reshape(*x.shape[:dim], -1, *x.shape[dim + 2 :])
    if op == 4 and size > 1:  # a slice
        lo = rng.randrange(size)
        hi = rng.randrange(lo + 1, size + 1)
        return x[(slice(None),) * dim + (slice(lo, hi),)]
    if op == 5 and size > 1 and x.dim() > 1:
        return x.select(dim, rng.randrange(size))
    if op == 6:  # some indices, in any order, none twice
        chosen = rng.sample(range(size), rng.randrange(1, size + 1))
        return x[(slice(None),) * dim + (torch.tensor(chosen),)]
    if op == 7 and size > 1:  # two parts swapped
        k = rng.randrange(1, size)
        return torch.cat([x.narrow(dim, k, size - k), x.narrow(dim, 0, k)], dim=dim)
    if op == 8 and size % 2 == 0:  # the two halves stacked
        half = size // 2
        return torch.stack([x.narrow(dim, half, half), x.narrow(dim, 0, half)], dim=dim)
    return x.unsqueeze(dim)


def random_layout(seed: int, steps: int):
    def layout(*tensors):
        rng = random.Random(seed)
        parts = []
        for t in tensors:
            for _ in range(steps):
                t = _step(t, rng)
            parts.append(t.reshape(-1))
        return torch.cat(parts)[None]

    return layout


SHAPES = st.lists(
    st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), min_size=1, max_size=3
)


@settings(max_examples=60, deadline=None)
@given(shapes=SHAPES, seed=st.integers(0, 10**6), steps=st.integers(1, 6))
def test_probes_give_the_index_map_of_random_layouts(shapes, seed, steps):
    layout = random_layout(seed, steps)
    params = {f"p{k}": shape for k, shape in enumerate(shapes)}
    tensors = []
    start = 0
    for shape in shapes:
        numel = torch.Size(shape).numel()
        tensors.append(torch.arange(start, start + numel, dtype=torch.int32).reshape(shape))
        start += numel
    expected = layout(*tensors)
    structure = structured.trace(layout, [torch.Size(s) for s in shapes])
    assert structure is not None and structure.shape == expected.shape
    group = SymmetryGroup.from_layout("random", GLQuotient(1, 1), params, layout)
    assert isinstance(group, StructuredGroup)
    assert torch.equal(group.index, expected)
    # gather and scatter are the index map's, values and gradients
    g = torch.Generator().manual_seed(seed)
    values = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in params.items()}
    flat = torch.cat([v.reshape(-1) for v in values.values()])
    assert torch.equal(group.gather(values), flat[expected.long()])
    point = torch.randn(expected.shape, generator=g, dtype=torch.float64, requires_grad=True)
    out = group.scatter(point, values)
    written = flat.index_put((expected.reshape(-1).long(),), point.detach().reshape(-1))
    assert torch.equal(torch.cat([out[n].reshape(-1) for n in params]), written)
    weights = torch.randn(written.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad(
        (torch.cat([out[n].reshape(-1) for n in params]) * weights).sum(), point
    )
    assert torch.equal(grad.reshape(-1), weights[expected.reshape(-1).long()])
    # its runs are the entries it covers
    for (starts, lengths), (name, shape) in zip(group.runs(), params.items()):
        mask = torch.zeros(torch.Size(shape).numel(), dtype=torch.bool)
        for s, n in zip(starts.tolist(), lengths.tolist()):
            assert not mask[s : s + n].any()
            mask[s : s + n] = True
        k = list(params).index(name)
        offset = sum(torch.Size(s).numel() for s in shapes[:k])
        ours = expected.reshape(-1).long() - offset
        ours = ours[(ours >= 0) & (ours < mask.numel())]
        assert torch.equal(mask.nonzero().reshape(-1), ours.sort().values)


@pytest.mark.parametrize(
    "layout",
    [
        lambda w: torch.cat([w[:, 1:], w[:, :2]], dim=1),  # columns 1 twice
        lambda w: torch.stack([w[0], w[0]]),
        lambda w: torch.cat([w.reshape(-1), w.mT.reshape(-1)[:1]]),
    ],
    ids=["columns", "rows", "transposed"],
)
def test_probes_refuse_a_layout_that_repeats_an_entry(layout):
    assert structured.trace(layout, [torch.Size((3, 4))]) is not None
    with pytest.raises(PlanError, match="twice"):
        SymmetryGroup.from_layout("bad", GLQuotient(1, 1), {"w": (3, 4)}, layout)


def test_layouts_the_probes_cannot_follow_use_the_index_map():
    group = SymmetryGroup.from_layout(
        "flipped", GLQuotient(1, 1), {"w": (3, 4)}, lambda w: w.flip(0)[None]
    )
    assert not isinstance(group, StructuredGroup)
    assert torch.equal(group.index[0], torch.arange(12, dtype=torch.int32).reshape(3, 4).flip(0))


# ------------------------------------------------------------------- 7B width, meta


def meta_llama(layers: int = 4, kv_heads: int = 32):
    config = transformers.LlamaConfig(
        hidden_size=4096,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=kv_heads,
        intermediate_size=11008,
        vocab_size=32000,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("kv_heads", [32, 8], ids=["llama", "gqa"])
def test_bind_at_7b_width_holds_no_index_per_entry(kv_heads):
    """Discovery and bind on a 4-layer meta Llama of 7B width keep a description whose
    size grows with the layers and heads (here at most 40 boxes per layer and kind, and
    one per MLP), and build no index map: each box is a few integers."""
    layers = 4
    model = meta_llama(layers, kv_heads)
    tensors = len(list(model.parameters()))
    for kinds in ("default", "all"):
        bound = find_symmetries(model, kinds=kinds).bind(model)
        blocks = 0
        for group in bound.groups:
            assert isinstance(group, (StructuredGroup, WholeParameterGroup)), group.name
            if isinstance(group, StructuredGroup):
                assert "_index" not in group.__dict__
                blocks += len(group.structure.blocks)
            else:
                assert group.index.is_meta
        assert blocks <= layers * (2 * (32 + 2) + 2) + tensors
        bound.summary()
        assert all("_index" not in g.__dict__ for g in bound.groups)
        # the write-back is a few strided copies per tensor, found without an index map
        layout = bound._strided
        assert layout is not None
        assert max(len(p) for p in layout.pieces) <= 2
        assert "_permutation" not in bound.__dict__


def test_overlapping_groups_are_refused_at_7b_width():
    model = meta_llama(layers=1)
    plan = find_symmetries(model)
    q = "model.layers.0.self_attn.q_proj.weight"
    gain = "model.layers.0.input_layernorm.weight"
    columns = SymmetryGroup.from_layout(
        "gain x q columns",
        GLQuotient(1, 4096),
        {gain: (4096,), q: (4096, 4096)},
        lambda g, w: torch.cat((g[:1, None], w[:, :1]), dim=0),
        kind="norm-gain",
    )
    with pytest.raises(PlanError, match=r"'model.layers.0.self_attn.q_proj.weight' is covered"):
        SymmetryPlan([*plan.groups, columns]).bind(model)
    assert plan_module  # the module under test


@pytest.mark.parametrize(
    ("name", "scope"),
    [("qwen3", "over each head"), ("gemma3", "over each head"), ("olmo2", "over all heads")],
)
def test_qk_norm_families_say_precisely_why_qk_is_adaptive(name, scope):
    notes = [n for n in find_symmetries(family_model(name)).notes if "q_norm, k_norm" in n]
    assert len(notes) == 1
    for needle in (scope, "A = c O", "O = +-1 per rotary plane", "scaled by s and 1/s"):
        assert needle in notes[0], (needle, notes[0])
    assert notes[0].endswith("Q/K left to the adaptive geometry (V/O is handled)")


@st.composite
def view_programs(draw):
    """A random tensor shape and a sequence of view operations on it."""
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    ops = draw(st.lists(st.tuples(st.sampled_from("punsv"), st.integers(0, 10**6)), max_size=8))
    return shape, ops


def _apply(view, op, seed):
    """One view operation on a tensor or a StridedView, chosen from ``seed`` alike."""
    rng = random.Random(seed)
    shape = tuple(view.shape)
    ndim = len(shape)
    if op == "p":
        dims = list(range(ndim))
        rng.shuffle(dims)
        return view.permute(dims)
    if op == "u":
        return view.unsqueeze(rng.randrange(ndim + 1))
    if op in "ns" and not ndim:
        return view
    dim = rng.randrange(ndim) if ndim else 0
    if op == "n":
        start = rng.randrange(shape[dim])
        return view.narrow(dim, start, rng.randrange(1, shape[dim] - start + 1))
    if op == "s":
        return view.select(dim, rng.randrange(shape[dim]))
    sizes = [s for s in shape if s > 1]  # a reshape: merge or split runs of dimensions
    total = 1
    for s in sizes:
        total *= s
    factors = [f for f in range(1, total + 1) if total % f == 0]
    first = rng.choice(factors)
    return view.view(tuple([first, total // first] if rng.random() < 0.5 else [total]))


@settings(max_examples=300, deadline=None)
@given(view_programs())
def test_strided_views_follow_pytorch_views(program):
    """Shape, strides and offset of every view equal a real tensor's, and a view the
    strides cannot give is refused by both."""
    shape, ops = program
    tensor = torch.empty(shape)
    view = structured.StridedView.contiguous(shape)
    for op, seed in ops:
        try:
            expected = _apply(tensor, op, seed)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                _apply(view, op, seed)
            continue
        tensor, view = expected, _apply(view, op, seed)
        assert view.shape == tuple(tensor.shape)
        if tensor.numel():
            assert view.strides == tensor.stride()
        assert view.offset == tensor.storage_offset()


@settings(max_examples=40, deadline=None)
@given(shapes=SHAPES, seed=st.integers(0, 10**6), steps=st.integers(1, 6))
def test_runs_listed_as_integers_or_tensors_agree(shapes, seed, steps):
    """Boxes of a few runs list them as Python integers, others as tensors; every mix of
    the two gives the same sorted, coalesced runs."""
    layout = random_layout(seed, steps)
    structure = structured.trace(layout, [torch.Size(s) for s in shapes])
    assert structure is not None
    found = {}
    for small in (0, 1, 2, structured.SMALL_RUNS):
        original = structured.SMALL_RUNS
        structured.SMALL_RUNS = small
        try:
            found[small] = structure.runs([torch.Size(s) for s in shapes])
        finally:
            structured.SMALL_RUNS = original
    for runs in found.values():
        for (starts, lengths), (expected_starts, expected_lengths) in zip(runs, found[0]):
            assert torch.equal(starts, expected_starts) and torch.equal(lengths, expected_lengths)


# ------------------------------------------------ tiles: one view for a block of every layer


def layered_layout(seed, steps, per_layer: int, order, rows: int, merge: bool, filler):
    """A point stacked over layers of ``per_layer`` parameters each (the layers in
    ``order``): each layer's part is :func:`random_layout` of its parameters cut into
    ``rows`` rows; ``filler``: the last parameter (of a layer part's shape) put in at
    that position among the layers; ``merge``: layers and rows merged in one dimension."""
    inner = random_layout(seed, steps)

    def layout(*tensors):
        parts = [inner(*tensors[k * per_layer : (k + 1) * per_layer]) for k in order]
        parts = [p.reshape(rows, -1) for p in parts]
        if filler is not None:
            parts.insert(filler, tensors[-1])
        point = torch.stack(parts)
        return point.reshape(-1, point.shape[-1]) if merge else point

    return layout


@settings(max_examples=80, deadline=None)
@given(
    shapes=SHAPES,
    seed=st.integers(0, 10**6),
    steps=st.integers(1, 5),
    layers=st.integers(1, 4),
    shuffled=st.booleans(),
    rows=st.sampled_from([1, 2]),
    merge=st.booleans(),
    filler=st.none() | st.integers(1, 3),
    alike=st.booleans(),
    mixed=st.booleans(),
    transposed=st.booleans(),
)
def test_tiles_gather_and_place_as_the_layout_does(
    shapes, seed, steps, layers, shuffled, rows, merge, filler, alike, mixed, transposed
):
    """A point stacked over layers is gathered one view per tile of blocks (a block of
    every layer), in any order of the layers and of the blocks, with a part between
    layers, with parameters of several dtypes or not contiguous; its entries' positions
    in a flat buffer, one view per tile where the layers are laid out alike there (else
    per block), are what the layout gives."""
    rng = random.Random(seed)
    total = random_layout(seed, steps)(*[torch.zeros(s) for s in shapes]).numel()
    if total % rows:
        rows = 1
    if filler is not None and filler >= layers:
        filler = None
    order = list(range(layers))
    if shuffled:
        rng.shuffle(order)
    all_shapes = [torch.Size(s) for _ in range(layers) for s in shapes]
    if filler is not None:
        all_shapes.append(torch.Size((rows, total // rows)))
    layout = layered_layout(seed, steps, len(shapes), order, rows, merge, filler)
    structure = structured.trace(layout, all_shapes)
    # rows that cut a box where the probes cannot follow it leave it to the index map
    if rows > 1:
        assume(structure is not None)
    assert structure is not None
    if not shuffled and not merge and filler is None:  # a block of every layer per tile
        assert len(structure.tiles) * layers == len(structure.blocks)
    tiled = [b for tile, _ in structure.tiles for b in tile]
    assert sorted(map(repr, tiled)) == sorted(map(repr, structure.blocks))
    structure = structured.PointStructure(
        structure.shape, tuple(rng.sample(structure.blocks, len(structure.blocks)))
    )
    g = torch.Generator().manual_seed(seed)
    values = []
    for k, shape in enumerate(all_shapes):
        dtype = torch.float32 if mixed and k == 0 else F64
        if transposed and len(shape) > 1:  # not contiguous
            value = torch.randn(shape[::-1], generator=g, dtype=dtype)
            values.append(value.permute(*reversed(range(len(shape)))))
        else:
            values.append(torch.randn(shape, generator=g, dtype=dtype))
    assert torch.equal(structure.gather(values), layout(*values))
    gaps = [rng.randrange(3) for _ in shapes]  # before each parameter of a layer
    starts, at = [], 0
    for k in range(len(all_shapes)):
        at += gaps[k % len(shapes)] if alike else rng.randrange(3)
        starts.append(at)
        at += all_shapes[k].numel()
    numbered = [
        s + torch.arange(shape.numel()).reshape(shape) for s, shape in zip(starts, all_shapes)
    ]
    assert torch.equal(structure.positions(starts, at, "cpu"), layout(*numbered))


@st.composite
def sub_boxes(draw, shape):
    lo = [draw(st.integers(0, n - 1)) for n in shape]
    return lo, [draw(st.integers(1, n - a)) for a, n in zip(lo, shape)]


@settings(max_examples=60, deadline=None)
@given(shapes=SHAPES, seed=st.integers(0, 10**6), steps=st.integers(1, 6), data=st.data())
def test_a_sub_box_entries_are_the_index_maps(shapes, seed, steps, data):
    """``box_entries`` of any box of the point is the index map's entries there (their
    parameter and place in it), from the blocks alone (the index map is not built), for
    a layout traced into boxes, for one kept as an index map and for a whole parameter."""
    params = {f"p{k}": shape for k, shape in enumerate(shapes)}
    layout = random_layout(seed, steps)
    group = SymmetryGroup.from_layout("random", GLQuotient(1, 1), params, layout)
    assert isinstance(group, StructuredGroup)
    lo, shape = data.draw(sub_boxes(tuple(group.shape)))
    which, within = group.box_entries(lo, shape)
    assert "_index" not in group.__dict__
    starts = torch.tensor([0] + [torch.Size(s).numel() for s in shapes[:-1]]).cumsum(0)
    index = group.index[tuple(slice(a, a + n) for a, n in zip(lo, shape))].long()
    assert which.dtype == within.dtype == torch.long
    assert torch.equal(starts[which] + within, index)
    assert bool((within < torch.tensor([torch.Size(s).numel() for s in shapes])[which]).all())
    plain = SymmetryGroup(
        "plain", GLQuotient(1, 1), group.param_names, group.param_shapes, group.index, "custom", 1
    )
    assert all(torch.equal(a, b) for a, b in zip(plain.box_entries(lo, shape), (which, within)))
    whole = whole_parameter_group("w", shapes[0], AdaptiveEuclidean())
    lo, shape = data.draw(sub_boxes(tuple(shapes[0])))
    full = torch.arange(torch.Size(shapes[0]).numel()).view(shapes[0])
    which, within = whole.box_entries(lo, shape)
    assert not which.any()
    assert torch.equal(within, full[tuple(slice(a, a + n) for a, n in zip(lo, shape))])


def test_blocks_that_miss_part_of_a_box_are_refused():
    structure = structured.PointStructure(
        torch.Size([2, 3]), (structured.Block(0, (0, 0), (1, 3), (3, 1), 0),)
    )
    with pytest.raises(ValueError, match="cover 3 of the box's 6"):
        structure.box_entries([0, 0], [2, 3])
