"""What makes an Auto-PGD iteration cheap changes no value: fused element-wise groups and
the kept best gradient."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from conftest import FreshTensors, tiny_llama_causal_lm
from hypothesis import given, settings
from hypothesis import strategies as st

import geoopt_quotient as gq
from geoopt_quotient.manifolds import _gl_tangent
from geoopt_quotient.sharpness import apgd, buffers
from geoopt_quotient.sharpness import ball as ball_module
from geoopt_quotient.sharpness import layout as layout_module
from geoopt_quotient.sharpness.apgd import BallGroup, maximize_in_ball

pytestmark = [
    pytest.mark.filterwarnings("ignore::geoopt_quotient.ZeroSharpnessWarning"),
    pytest.mark.usefixtures("single_thread"),
]


def tiny_bert(seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).double().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [
        (
            torch.randint(0, 50, (6, 8), generator=generator),
            torch.randint(0, 3, (6,), generator=generator),
        )
        for _ in range(2)
    ]
    return model, batches


def loss_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(input_ids=batch[0]).logits, batch[1])


def measure(model, batches, name: str, **options):
    common = dict(rho=0.3, iters=12, progress=False) | options
    if name == "adaptive":
        return gq.adaptive_sharpness(model, loss_fn, batches, **common)
    return gq.geodesic_sharpness(model, loss_fn, batches, metric=name, **common)


# ---------------------------------------------------------------- stacked quotients
def unstack(stack, groups, tensor):
    """The members' pieces of a tensor of the stack's shape, in their own shapes."""
    rows = stack.rows
    counts = [
        groups[i].point.numel() // (groups[i].point.shape[-2] * tensor.shape[-1])
        for i in stack.members
    ]
    out = []
    for piece, i in zip(tensor.split(counts), stack.members):
        n, m = groups[i].manifold.n, groups[i].manifold.m
        joined = torch.cat((piece[:, :n], piece[:, rows : rows + m]), dim=1)
        out.append(joined.reshape(groups[i].point.shape))
    return out


def padding(stack, groups, tensor):
    """The entries of a tensor of the stack's shape that belong to no member."""
    marks = torch.ones_like(tensor)
    for piece, i in zip(
        marks.split(
            [
                g.numel() // (g.shape[-2] * g.shape[-1])
                for g in (groups[j].point for j in stack.members)
            ]
        ),
        stack.members,
    ):
        n, m = groups[i].manifold.n, groups[i].manifold.m
        piece[:, :n] = 0
        piece[:, stack.rows : stack.rows + m] = 0
    return tensor[marks.bool()]


def stacked(stack, groups, tensors):
    """``tensors`` (one per member) in the stack's shape, zero in the padding."""
    like = [BallGroup(t, groups[i].manifold) for t, i in zip(tensors, stack.members)]
    everything = list(groups)
    for t, i in zip(like, stack.members):
        everything[i] = t
    return stack.group(everything).point


def test_only_quotient_groups_of_one_geometry_are_stacked():
    def group(n, m, rank=2, batch=(3,), **options):
        manifold = gq.GLQuotient(n, m, **options)
        return BallGroup(manifold.random(*batch, n + m, rank, dtype=torch.float64), manifold)

    groups = [
        group(5, 5),
        group(5, 4, batch=(2, 2)),  # fewer H rows: stacked, padded
        group(3, 5),  # a G of 3 rows padded to 5 would add a quarter: alone
        group(5, 5, rank=3),  # another rank: alone
        group(5, 5, metric="inv"),
        group(5, 5, eps=0.1),
        group(5, 4, batch=(), eps=0.1),  # stacked with the one above
        BallGroup(torch.randn(4, 4), gq.AdaptiveEuclidean()),
        group(5, 5, retraction="first_order"),
        BallGroup(gq.GLQuotient(5, 5).random(2, 10, 2), gq.GLQuotient(5, 5), lambda x, u: x + u),
    ]
    stacks = layout_module.group_stacks(groups, list(range(len(groups))))
    assert [(s.members, s.rows) for s in stacks] == [
        ([0, 1], 5),
        ([2], 0),
        ([3], 0),
        ([4], 0),
        ([5, 6], 5),
        ([7], 0),
        ([8], 0),
        ([9], 0),
    ]
    first = stacks[0].group(groups)
    assert first.point.shape == (3 + 4, 10, 2)
    assert (first.manifold.n, first.manifold.m) == (5, 5)
    back = unstack(stacks[0], groups, first.point)
    assert all(torch.equal(a, groups[i].point) for a, i in zip(back, stacks[0].members))
    assert not padding(stacks[0], groups, first.point).any()
    assert stacks[1].group(groups) is groups[2]
    # a single group with unequal factors is padded on its own where that is cheap
    alone = layout_module.group_stacks([group(8, 7)], [0])
    assert [(s.members, s.rows) for s in alone] == [([0], 8)]


@settings(max_examples=25, deadline=None)
@given(
    metric=st.sampled_from(["inv", "mix"]),
    eps=st.sampled_from([0.0, 0.05]),
    rows=st.lists(st.integers(7, 8), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_stacked_quotients_have_the_joint_geometry_and_keep_the_padding_zero(
    metric, eps, rows, seed
):
    """Metric, Riemannian gradient, retraction and its pullback of the stacked group
    are those of the groups, and the padding rows stay exactly 0."""
    torch.manual_seed(seed)
    n, rank = 8, 3
    manifolds = [gq.GLQuotient(n, m, metric=metric, eps=eps) for m in rows]
    points = [mf.random(2, n + mf.m, rank, dtype=torch.float64) for mf in manifolds]
    groups = [BallGroup(x, mf) for x, mf in zip(points, manifolds)]
    stacks = layout_module.group_stacks(groups, list(range(len(groups))))
    if all(m == n for m in rows):
        assert [s.rows for s in stacks] == ([n] if len(rows) > 1 else [0])
        if len(rows) == 1:
            return
    (stack,) = stacks
    joint_group = stack.group(groups)
    x, joint = joint_group.point, joint_group.manifold
    spaces = [mf.tangent_space(p) for mf, p in zip(manifolds, points)]
    space = joint.tangent_space(x)

    def horizontal():
        return [0.1 * s.proju(torch.randn_like(p)) for s, p in zip(spaces, points)]

    def close(fused, separate):
        pieces = unstack(stack, groups, fused)
        assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(pieces, separate))
        rest = padding(stack, groups, fused)
        assert torch.equal(rest, torch.zeros_like(rest))

    xs = [horizontal() for _ in range(3)]
    fused = [stacked(stack, groups, v) for v in xs]
    joint_gram = sum(s.gram([v[i] for v in xs]) for i, s in enumerate(spaces))
    assert torch.allclose(space.gram(fused), joint_gram, rtol=1e-10, atol=1e-14)
    close(space.proju(fused[0]), [s.proju(v) for s, v in zip(spaces, xs[0])])
    egrads = [torch.randn_like(p) for p in points]
    close(
        space.egrad2rgrad_(stacked(stack, groups, egrads)),
        [s.egrad2rgrad(g) for s, g in zip(spaces, egrads)],
    )
    out = torch.empty_like(x)
    retracted, pullback = space.retr_vjp(fused[0], out)
    close(retracted, [s.retr(v) for s, v in zip(spaces, xs[0])])
    cotangents = [torch.randn_like(p) for p in points]
    separate = []
    for s, v, c in zip(spaces, xs[0], cotangents):
        _, member_pullback = s.retr_vjp(v, torch.empty_like(v))
        separate.append(member_pullback(c.clone()))
    close(pullback(stacked(stack, groups, cotangents)), separate)


def test_berts_query_key_and_value_output_groups_are_one_batch_with_equal_factors():
    model, _ = tiny_bert()
    plan = gq.find_symmetries(model, metric="inv").bind(model)
    base = {name: p.detach() for name, p in model.named_parameters()}
    points = [p.detach() for p in plan.gather(base)]
    groups = ball_module.ball_groups(plan.groups, points, "second_order", True)
    layout = layout_module.BallLayout(plan, base, groups)
    quotients = [g for g in groups if isinstance(g.manifold, gq.GLQuotient)]
    stacked = [g for g in layout.groups if isinstance(g.manifold, gq.GLQuotient)]
    assert len(quotients) == 2 and len(stacked) == 1
    ((point, manifold),) = [(g.point, g.manifold) for g in stacked]
    assert manifold.n == manifold.m == max(max(g.manifold.n, g.manifold.m) for g in quotients)
    assert point.numel() >= sum(g.point.numel() for g in quotients)


def inv_layout(model) -> layout_module.BallLayout:
    """The layout of ``model``'s inv ball on the second-order path."""
    plan = gq.find_symmetries(model, metric="inv").bind(model)
    base = {name: p.detach() for name, p in model.named_parameters()}
    groups = ball_module.ball_groups(
        plan.groups, [p.detach() for p in plan.gather(base)], "second_order", True
    )
    return layout_module.BallLayout(plan, base, groups)


def entry_positions(layout, rest) -> torch.Tensor:
    """The flat buffer position of each entry of the rest's joined points (the padding:
    the trailing gap), as the layout's index maps would hold them."""
    start = dict(zip(rest.flat.names, rest.flat.starts))
    trailing = rest.flat.chunks[-1] if rest.flat.is_gap[-1] else 0
    trash = rest.flat.size - trailing
    stacks = [layout._stack_list[p] for p in rest.groups]
    return torch.cat([s.destination(layout.plan, start, trash, "cpu") for s in stacks])


def scattered(rest, grad: torch.Tensor, out=None):
    """The groups' parts of a flat gradient ``grad`` of ``rest``'s strided blocks, as the
    backward pass's per-parameter copies write them (:class:`_Scatter`, one segment)."""
    if out is None:
        out = [grad.new_empty(shape) for shape in rest.shapes]
    (whole,) = rest.flat.segments(1)
    layout_module._Scatter(rest, [whole], out).write(whole, rest.flat.pieces(grad)[0])
    return out


def test_the_stacked_points_are_written_into_the_flat_buffer_by_strided_blocks():
    """The layout writes the stacked points into the parameters' flat buffer with a few
    strided copies (a block of rows of one parameter, over the layers and heads), with
    no index per entry, the entries and the zero gaps those of the index copy (the
    padding rows of the value-output stack go to no parameter); each parameter's gradient
    is copied into the groups' shapes alike (the parts of the blocks in it), the padding
    zero. The negatives: positions in no regular layout are no
    blocks, and a parameter entry written twice leaves the index copy."""
    model, _ = tiny_bert()
    layout = inv_layout(model)
    (rest,) = layout._rests
    assert rest.blocks is not None and rest.destination is None and rest.source is None
    assert rest.index_bytes() == 0
    blocks, padding = rest.blocks
    assert len(blocks) <= 8 and any(padding)  # weight and bias rows of 2 factors, 2 members
    points = [torch.randn_like(layout.groups[p].point) for p in rest.groups]
    gathered = torch.full((rest.flat.size,), float("nan"), dtype=torch.float64)
    rest.write(points, gathered)
    positions = entry_positions(layout, rest)
    copied = torch.zeros(rest.flat.size, dtype=torch.float64)
    joined = torch.cat([p.reshape(-1) for p in points])
    copied.index_copy_(0, positions, joined)
    trash = rest.flat.size - rest.flat.chunks[-1]  # where the padding goes: a gap
    assert rest.flat.is_gap[-1] and bool((positions == trash).any())
    copied[trash:] = 0
    assert torch.equal(gathered, copied)
    grad = torch.randn(rest.flat.size, dtype=torch.float64)
    torch._foreach_zero_(rest.flat.pieces(grad)[1])
    out = [torch.full_like(p, float("nan")) for p in points]
    segments = rest.flat.segments(2)
    scatter = layout_module._Scatter(rest, segments, out)
    parameters = iter(rest.flat.pieces(grad)[0])  # each its own tensor, as autograd's
    for segment in segments:
        scatter.write(segment, [next(parameters).clone() for _ in segment.shapes])
    read = out
    expected = grad.index_select(0, positions)
    assert torch.equal(torch.cat([r.reshape(-1) for r in read]), expected)
    shuffled = positions.clone()
    shuffled[[0, 1]] = shuffled[[1, 0]]
    shapes = [layout.groups[p].point.shape for p in rest.groups]
    batches = [
        layout._stack_list[p].batch_shapes(layout.plan, layout.groups[p]) for p in rest.groups
    ]
    sizes = [math.prod(s) for s in shapes]
    assert layout_module.strided_blocks(positions.split(sizes), shapes, batches, rest.flat, trash)
    assert not layout_module.strided_blocks(
        shuffled.split(sizes), shapes, batches, rest.flat, trash
    )
    twice = positions.clone()
    twice[1] = twice[0]  # the second entry of the first parameter is no longer written
    destination, source = layout_module.index_maps(twice, rest.flat)
    assert source is None and destination.dtype == torch.int32


def test_grouped_query_heads_are_strided_blocks_split_by_head():
    """Where a factor's run of rows holds several heads of one parameter (a Llama's query
    heads sharing a key/value head), the run's positions are not affine in the row but
    are in (head, row): the layout splits it into equal runs and keeps strided blocks
    (no index maps); the points written and the gradient read back are the index
    copy's and gather's, bit for bit. A run whose rows break at uneven places is no
    block."""
    layout = inv_layout(tiny_llama_causal_lm())
    (rest,) = layout._rests
    assert rest.blocks is not None and rest.destination is None and rest.source is None
    blocks, _ = rest.blocks
    groups = [layout.groups[p] for p in rest.groups]
    assert any(len(b.flat[1]) > groups[b.group].point.dim() for b in blocks)
    points = [torch.randn_like(layout.groups[p].point) for p in rest.groups]
    positions = entry_positions(layout, rest)
    gathered = torch.full((rest.flat.size,), float("nan"), dtype=torch.float64)
    rest.write(points, gathered)
    copied = torch.zeros(rest.flat.size, dtype=torch.float64)
    copied.index_copy_(0, positions, torch.cat([p.reshape(-1) for p in points]))
    for written, reference in zip(rest.flat.pieces(gathered)[0], rest.flat.pieces(copied)[0]):
        assert torch.equal(written, reference)
    grad = torch.randn(rest.flat.size, dtype=torch.float64)
    for gap in rest.flat.pieces(grad)[1]:
        gap.zero_()
    read = scattered(rest, grad, [torch.full_like(p, float("nan")) for p in points])
    expected = grad.index_select(0, positions)
    assert torch.equal(torch.cat([r.reshape(-1) for r in read]), expected)
    uneven = torch.tensor([0, 1, 2, 50, 51, 90])[:, None] + 200 * torch.arange(3)
    assert layout_module._affine_rows(uneven) is None
    even = torch.tensor([0, 1, 2, 50, 51, 52])[:, None] + 200 * torch.arange(3)
    shape, (offset, strides) = layout_module._affine_rows(even)
    assert shape == (2, 3, 3) and offset == 0 and strides == (50, 1, 200)


def test_gradients_read_by_index_maps_are_tensors_of_their_own():
    """The index gather reads each group's gradient into a tensor of its own (not views
    of one, which would share a version counter: writing one in place would invalidate
    what the tangent spaces keep of the others), with the strided blocks' values."""
    import dataclasses

    layout = inv_layout(tiny_llama_causal_lm())
    (rest,) = layout._rests
    destination, source = layout_module.index_maps(entry_positions(layout, rest), rest.flat)
    indexed = dataclasses.replace(rest, destination=destination, source=source, blocks=None)
    grad = torch.randn(rest.flat.size, dtype=torch.float64)
    for gap in rest.flat.pieces(grad)[1]:
        gap.zero_()
    read = indexed.read(grad)
    assert len({r.untyped_storage().data_ptr() for r in read}) == len(read) > 1
    for a, b in zip(read, scattered(rest, grad)):
        assert torch.equal(a, b)


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 4),
    rows=st.integers(1, 5),
    first_row=st.integers(0, 3),
    spare_rows=st.integers(0, 3),
    columns=st.integers(1, 6),
    segments=st.integers(1, 4),
    missing=st.integers(-1, 3),
    seed=st.integers(0, 2**16),
)
def test_gradients_copied_per_parameter_are_the_flat_gradients_entries(
    layers, rows, first_row, spare_rows, columns, segments, missing, seed
):
    """A group stacking rows ``first_row : first_row + rows`` of one parameter per layer
    (its point ``(layers, rows, columns)``, one block over the layers): each parameter's
    gradient copied by the parts of the blocks in it (:func:`parameter_blocks`,
    :class:`_Scatter`, segments written in any order) is the flat gradient's entries at
    the point's positions, bit for bit; a parameter with no gradient gives zeros."""
    height = first_row + rows + spare_rows
    shapes = [torch.Size((height, columns))] * layers
    flat = layout_module.FlatBuffer([f"w{i}" for i in range(layers)], shapes, torch.float64, "cpu")
    positions = torch.stack(
        [
            start + torch.arange(first_row * columns, (first_row + rows) * columns)
            for start in flat.starts
        ]
    )
    point_shape = torch.Size((layers, rows, columns))
    found = layout_module.strided_blocks(
        [positions.reshape(-1)], [point_shape], [[(layers,)]], flat, flat.size, [False]
    )
    assert found is not None
    rest = layout_module._Rest(flat, [0], [point_shape], None, None, found)
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    if missing in range(layers):
        grads[missing] = None
    given_ = [
        torch.zeros(s, dtype=torch.float64) if g is None else g for g, s in zip(grads, shapes)
    ]
    expected = flat.filled(given_).index_select(0, positions.reshape(-1)).view(point_shape)
    out = [torch.full(point_shape, float("nan"), dtype=torch.float64)]
    parts = flat.segments(segments)
    scatter = layout_module._Scatter(rest, parts, out)
    remaining = iter(grads)
    taken = [[next(remaining) for _ in part.shapes] for part in parts]
    for part, part_grads in reversed(list(zip(parts, taken))):
        scatter.write(part, part_grads)
    assert torch.equal(out[0], expected)


def test_several_groups_perturbed_points_are_the_evaluations_own_vectors():
    """Where one flat buffer holds several groups (a Llama's rotary and GL(h) stacks),
    their perturbed points are written where their gradients go next: the tensors of the
    vector the evaluation takes for its gradient (new ones where none is free), read
    once by the write, which allocates nothing as large as a group; the flat buffer
    written is the index copy's, bit for bit."""
    layout = inv_layout(tiny_llama_causal_lm())
    (rest,) = layout._rests
    assert len(rest.groups) == 2 and rest.scatters()  # the rotary and value-output stacks
    assert all(layout.perturbed_buffer(p) is None for p in rest.groups)
    spare = [torch.empty_like(group.point) for group in layout.groups]
    assert layout.fits(spare)
    own = layout.evaluation_vectors(spare)
    assert all(own[p] is spare[p] for p in rest.groups)
    assert all(own[p] is None for p in range(len(layout.groups)) if p not in rest.groups)
    new = layout.evaluation_vectors(None)
    buffers = [new[p] for p in rest.groups]
    for buffer, p in zip(buffers, rest.groups):
        assert buffer.shape == layout.groups[p].point.shape and buffer.is_contiguous()
    smallest = min(b.numel() for b in buffers)
    out = torch.empty(rest.flat.size, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        points = [
            b.copy_(torch.randn(b.shape, dtype=b.dtype, generator=generator)) for b in buffers
        ]
        with FreshTensors() as fresh:
            rest.write(points, out)
        assert max((entries for _, entries, _ in fresh.records), default=0) < smallest
        expected = torch.zeros(rest.flat.size, dtype=torch.float64)
        joined = torch.cat([p.reshape(-1) for p in points])
        expected.index_copy_(0, entry_positions(layout, rest), joined)
        for written, reference in zip(rest.flat.pieces(out)[0], rest.flat.pieces(expected)[0]):
            assert torch.equal(written, reference)


@pytest.mark.parametrize("name", ["adaptive", "inv", "mix"])
def test_flat_layout_changes_the_value_only_by_rounding(name, monkeypatch):
    """The flat buffers against the reference: one ball group per plan group, written
    back into the parameters by the plan."""
    model, batches = tiny_bert()
    flat = measure(model, batches, name)
    monkeypatch.setattr(ball_module, "BallLayout", lambda *args: None)  # no layout
    separate = measure(model, batches, name)
    assert flat.value > 0
    # float64 sums in another order; the iterates' branch decisions are the same
    for a, b in zip(flat.per_batch, separate.per_batch):
        assert math.isclose(a, b, rel_tol=1e-9)
    for a, b in zip(flat.histories, separate.histories):
        assert a == pytest.approx(b, rel=1e-9)


@pytest.mark.parametrize("name", ["inv", "mix"])
def test_a_deeper_rotary_layout_changes_the_value_only_by_rounding(name, monkeypatch):
    """As above on a 3-layer Llama with grouped-query heads: its rotary and value-output
    stacks share one flat buffer, whose blocks span the layers, so each parameter's
    gradient is copied into the groups' shapes by the parts of the blocks in it."""
    model = tiny_llama_causal_lm(layers=3)
    ids = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(1))

    def run():
        return gq.geodesic_sharpness(
            model,
            lambda m, b: m(input_ids=b, labels=b).loss,
            [ids],
            metric=name,
            rho=0.05,
            iters=8,
            progress=False,
        )

    flat = run()
    monkeypatch.setattr(ball_module, "BallLayout", lambda *args: None)  # no layout
    separate = run()
    assert flat.value > 0
    assert math.isclose(flat.value, separate.value, rel_tol=1e-9)
    for a, b in zip(flat.histories, separate.histories):
        assert a == pytest.approx(b, rel=1e-9)


@pytest.mark.parametrize("name", ["adaptive", "inv"])
def test_layout_gradients_mostly_reuse_the_buffers_the_loop_frees(name, monkeypatch):
    """The gradients arrive in a vector the loop has freed where it has one (a new buffer
    of a large model's size is faulted in page by page), not in a new buffer per
    evaluation; and that changes no bit of the result."""
    model, batches = tiny_bert()
    allocations = []
    original = layout_module.FlatBuffer.empty

    def counted(self):
        allocations.append(self.size)
        return original(self)

    monkeypatch.setattr(layout_module.FlatBuffer, "empty", counted)
    reused = measure(model, batches, name, iters=24)
    count = len(allocations)
    monkeypatch.setattr(layout_module.BallLayout, "fits", lambda self, vector: False)
    allocations.clear()
    fresh = measure(model, batches, name, iters=24)
    assert len(allocations) >= 2 * 24  # a new gradient buffer per evaluation and batch
    assert count <= len(allocations) // 2
    assert fresh.per_batch == reused.per_batch
    assert fresh.histories == reused.histories


def test_the_average_case_has_no_flat_layout(monkeypatch):
    model, batches = tiny_bert()
    calls = []
    make = ball_module.BallLayout
    monkeypatch.setattr(ball_module, "BallLayout", lambda *args: calls.append(args) or make(*args))
    gq.adaptive_sharpness(model, loss_fn, batches, rho=0.1, iters=3, kind="average")
    assert not calls
    gq.adaptive_sharpness(model, loss_fn, batches, rho=0.1, iters=3)  # the worst case has
    assert calls


# ---------------------------------------------------------------- the best gradient
def restarting_objective():
    """A concave quadratic with a ridge: Auto-PGD overshoots, halves and restarts."""
    a = torch.tensor([4.0, 1.0, 0.25], dtype=torch.float64)
    target = torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64)
    calls = {"grad": 0}

    def objective(points):
        (x,) = points
        if x.requires_grad:
            calls["grad"] += 1
        return -(a * (x - target) ** 2).sum() + torch.cos(7 * x).sum()

    return objective, calls


@pytest.mark.parametrize("iters", [5, 20, 40])
def test_kept_best_gradient_gives_the_same_iterates_with_fewer_passes(iters):
    point = torch.ones(3, dtype=torch.float64)
    runs = {}
    for keep in (False, True):
        objective, calls = restarting_objective()
        result = maximize_in_ball(
            [(point, gq.AdaptiveEuclidean())],
            objective,
            rho=1.0,
            iters=iters,
            path="straight",
            keep_best_gradient=keep,
        )
        assert result.gradients == calls["grad"]
        runs[keep] = result
    recomputed, kept = runs[False], runs[True]
    assert kept.history == recomputed.history  # bitwise: the same gradient, kept
    assert torch.equal(kept.xi[0], recomputed.xi[0])
    restarts = recomputed.gradients - iters
    assert kept.gradients == iters and kept.evaluations == iters + 1
    assert recomputed.evaluations == iters + 1 + restarts
    if iters >= 20:
        assert restarts > 0  # the case this test is about happened


@pytest.mark.parametrize("keep", [False, True])
def test_a_restart_to_the_previous_iterate_reads_the_gram_matrix_it_has(monkeypatch, keep):
    """Where Auto-PGD goes back to the best iterate and that is the previous one, the
    update's vectors are (best, its gradient, best): their Gram matrix is a block of the
    one computed with that gradient, and the update does not sum it over the entries
    again. Only restarts to an older iterate sum it; the iterates are those of summed
    Gram matrices to float64 rounding."""
    restarts, summed = [], []
    record = buffers.AutoPGDVectors.restart
    monkeypatch.setattr(
        buffers.AutoPGDVectors,
        "restart",
        lambda self: restarts.append(self.xi_prev is self.best_xi) or record(self),
    )
    gram = apgd.TangentBall.gram
    monkeypatch.setattr(apgd.TangentBall, "gram", lambda *a: summed.append(1) or gram(*a))
    point = torch.ones(3, dtype=torch.float64)

    def run():
        objective, _ = restarting_objective()
        group = [(point, gq.AdaptiveEuclidean())]
        options = dict(rho=1.0, iters=40, path="straight", keep_best_gradient=keep)
        return maximize_in_ball(group, objective, **options)

    derived = run()
    assert any(restarts) and len(summed) == restarts.count(False)
    monkeypatch.setattr(apgd.BallPasses, "make_riemannian", _without_best_gram)
    restarts.clear(), summed.clear()
    reference = run()
    assert len(summed) == len(restarts) > 0  # every restart summed its Gram matrix
    assert derived.step_sizes == reference.step_sizes
    eps = torch.finfo(torch.float64).eps
    assert derived.history == pytest.approx(reference.history, rel=64 * eps, abs=64 * eps)
    assert torch.allclose(derived.xi[0], reference.xi[0], rtol=64 * eps, atol=64 * eps)


_make_riemannian = apgd.BallPasses.make_riemannian


def _without_best_gram(passes) -> None:
    """``make_riemannian`` that keeps no Gram block for a restart (the update sums it)."""
    _make_riemannian(passes)
    passes.best_gram = None


def test_best_gradient_kept_by_default_only_for_small_balls(monkeypatch):
    objective, _ = restarting_objective()
    point = torch.ones(3, dtype=torch.float64)
    args = dict(rho=1.0, iters=20, path="straight")
    small = maximize_in_ball([(point, gq.AdaptiveEuclidean())], objective, **args)
    assert small.gradients == 20
    monkeypatch.setattr(apgd, "KEEP_GRADIENT_MAX_BYTES", 8 * 3 - 1)
    large = maximize_in_ball([(point, gq.AdaptiveEuclidean())], objective, **args)
    assert large.gradients > 20 and large.history == small.history


@pytest.mark.parametrize("name", ["adaptive", "mix"])
def test_sharpness_reports_one_backward_pass_per_iteration(name):
    model, batches = tiny_bert()
    result = measure(model, batches, name)
    # one forward more than backward (the clean loss), and for the geodesic measure's
    # second-order path one more where the exact geodesic reaches the maximiser (the loss
    # there: its path gap; NaN and no forward where the geodesic leaves the manifold)
    gaps = result.path_gaps or [math.nan, math.nan]
    forward = [13 + (not math.isnan(gap)) for gap in gaps]
    assert result.backward_passes == [12, 12] and result.forward_passes == forward
    recomputed = measure(model, batches, name, keep_best_gradient=False)
    assert recomputed.per_batch == result.per_batch
    assert all(b >= 12 for b in recomputed.backward_passes)


# ---------------------------------------------------------------- the update in one combination
def random_ball_vector(ball, generator, radius):
    return ball.clip([v * radius for v in ball.random(generator, 1.0)])


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([torch.float64, torch.float32]),
    metric=st.sampled_from(["inv", "mix"]),
    alpha=st.sampled_from([1.0, 0.75, 0.3]),
    step_over_rho=st.floats(0.01, 3.0),
    radii=st.tuples(st.floats(0.0, 1.5), st.floats(0.0, 1.5)),
    seed=st.integers(0, 2**16),
)
def test_update_as_one_combination_is_the_formulas_up_to_rounding(
    dtype, metric, alpha, step_over_rho, radii, seed
):
    """ξ_next = w₁ξ + w₂g + w₃ξ_prev with weights from the Gram matrix equals the step by
    step update (ascent step, clip, momentum, clip) to the dtype's rounding, on a joint
    ball of an element-wise group, with frozen entries, and a GL(h) quotient group."""
    from test_sharpness import formula_update

    generator = torch.Generator().manual_seed(seed)
    gl = gq.GLQuotient(5, 4, metric)
    weights = torch.randn(7, 3, generator=generator, dtype=dtype)
    weights[0, 0] = 0.0  # a frozen entry
    groups = [
        BallGroup(weights, gq.AdaptiveEuclidean()),
        BallGroup(gl.random(2, 9, 2, dtype=dtype), gl),
    ]
    rho = 0.7
    ball, _ = apgd.prepare_ball(groups, rho, "second_order")
    xi = random_ball_vector(ball, generator, radii[0] * rho)
    xi_prev = random_ball_vector(ball, generator, radii[1] * rho)
    rgrads = ball.random(generator, 3.0)  # horizontal, zero where frozen
    step = step_over_rho * rho
    expected = formula_update(ball, xi, xi_prev, rgrads, step, alpha)
    out = [torch.empty_like(v) for v in xi]
    got, grad_norm = apgd.apgd_update(ball, xi, xi_prev, rgrads, step, alpha, out)
    assert got is out
    tol = 64 * torch.finfo(dtype).eps * rho
    for a, b in zip(got, expected):
        assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()) / rho)
    assert float(ball.norm(got)) <= rho * (1 + 64 * torch.finfo(dtype).eps)
    assert math.isclose(float(grad_norm), float(ball.norm(rgrads)), rel_tol=64 * 1e-7)
    # in place into the previous iterate, as the loop does when nothing else holds it
    in_place = [v.clone() for v in xi_prev]
    apgd.apgd_update(ball, xi, in_place, rgrads, step, alpha, in_place)
    assert all(torch.equal(a, b) for a, b in zip(in_place, got))


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(1, 300),
    block=st.sampled_from([7, 64, 1 << 16]),
    into=st.sampled_from(["new", "first", "gradient", "previous"]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_combination_writes_the_perturbed_point_in_the_same_sweep(size, block, into, dtype, seed):
    """With ``shift = (x, buffer)`` the combination also writes ``x + out`` into the
    buffer, bit for bit the separate sum, and ``out`` is what it is without (in any of
    the buffers the loop writes it into, on blocks of any size)."""
    generator = torch.Generator().manual_seed(seed)
    x, a, b, c = (torch.randn(size, generator=generator, dtype=dtype) for _ in range(4))
    weights = tuple(torch.randn(3, generator=generator, dtype=dtype).unbind())

    def combined(shift):
        operands = [t.clone() for t in (a, b, c)]
        out = {"new": torch.empty_like(a), "first": operands[0]}.get(into)
        out = {"gradient": operands[1], "previous": operands[2]}.get(into, out)
        apgd.combine_(out, tuple(operands), weights, shift)
        return out

    old_block, apgd.COMBINE_BLOCK = apgd.COMBINE_BLOCK, block
    try:
        plain = combined(None)
        buffer = torch.full_like(x, float("nan"))
        out = combined((x, buffer))
    finally:
        apgd.COMBINE_BLOCK = old_block
    assert torch.equal(out, plain)
    assert torch.equal(buffer, x + plain)
    terms = (c * weights[2], a * weights[0], b * weights[1])
    scale = float(sum(t.abs() for t in terms).max())
    assert torch.allclose(out, sum(terms), rtol=0, atol=4 * torch.finfo(dtype).eps * scale)


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(1, 700),
    block=st.sampled_from([7, 64, 1 << 16]),
    eps=st.sampled_from([0.0, 0.1]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    capped=st.booleans(),
    part=st.sampled_from([1, 5, 64, 1 << 14]),
    seed=st.integers(0, 2**16),
)
def test_adaptive_gram_is_the_matrix_of_inner_products(size, block, eps, dtype, capped, part, seed):
    """On the CPU's cache-sized blocks (dot products) and on an accelerator's capped ones,
    whose product is batched over parts of the rows (with a shorter last part or none)."""
    from geoopt_quotient.manifolds import _linalg, adaptive

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, generator=generator, dtype=dtype)
    x[::5] = 0.0  # frozen where eps = 0
    manifold = gq.AdaptiveEuclidean(eps=eps)
    space = manifold.tangent_space(x)
    vectors = [space.random(generator) for _ in range(3)]
    old = adaptive.GRAM_BLOCK, adaptive.GRAM_PART, _linalg.CAP_ON_CPU
    adaptive.GRAM_BLOCK, adaptive.GRAM_PART, _linalg.CAP_ON_CPU = block, part, capped
    try:
        gram = space.gram(vectors)
    finally:
        adaptive.GRAM_BLOCK, adaptive.GRAM_PART, _linalg.CAP_ON_CPU = old
    assert gram.dtype == torch.float64 and gram.shape == (3, 3)
    expected = torch.tensor(
        [[float(manifold.inner(x, u, v).sum()) for v in vectors] for u in vectors],
        dtype=torch.float64,
    )
    scale = float(expected.diagonal().max())
    tol = 8 * (size + 8) * torch.finfo(dtype).eps * scale  # sums of size terms
    assert torch.allclose(gram, expected, rtol=0, atol=tol)


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(1, 700),
    block=st.sampled_from([7, 64, 1 << 16]),
    eps=st.sampled_from([0.0, 0.1]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    capped=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_adaptive_gradient_and_gram_in_one_sweep_are_those_of_two(
    size, block, eps, dtype, capped, seed
):
    """The fused sweep writes c^2 * g into g and returns the Gram matrix of (xi, c^2 * g,
    xi_prev): bit for bit egrad2rgrad_ followed by gram, on the CPU's cache-sized blocks
    and on an accelerator's capped ones, and the formulas to rounding."""
    from geoopt_quotient.manifolds import _linalg, adaptive

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, generator=generator, dtype=dtype)
    x[::5] = 0.0  # frozen where eps = 0
    space = gq.AdaptiveEuclidean(eps=eps).tangent_space(x)
    xi, xi_prev = space.random(generator), space.random(generator)
    egrad = torch.randn(size, generator=generator, dtype=dtype) * 3
    fused = egrad.clone()
    old = adaptive.GRAM_BLOCK, _linalg.CAP_ON_CPU
    adaptive.GRAM_BLOCK, _linalg.CAP_ON_CPU = block, capped
    try:
        rgrad, gram = space.egrad2rgrad_gram_((xi, fused, xi_prev), 1)
        separate = space.egrad2rgrad_(egrad.clone())
        expected_gram = space.gram([xi, separate, xi_prev])
    finally:
        adaptive.GRAM_BLOCK, _linalg.CAP_ON_CPU = old
    assert rgrad is fused  # in place
    assert torch.equal(rgrad, separate) and torch.equal(gram, expected_gram)
    c2 = (x.double().abs() + eps) ** 2
    eps_dtype = torch.finfo(dtype).eps
    assert torch.allclose(rgrad.double(), egrad.double() * c2, rtol=2 * eps_dtype, atol=0)
    weight = torch.where(c2 > 0, 1 / c2, torch.zeros_like(c2))
    vectors = [v.double() for v in (xi, rgrad, xi_prev)]
    formula = torch.stack([torch.stack([(weight * u * v).sum() for v in vectors]) for u in vectors])
    scale = float(formula.diagonal().max())
    assert torch.allclose(gram, formula, rtol=0, atol=8 * (size + 8) * eps_dtype * scale)


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(1, 700),
    block=st.sampled_from([7, 64, 1 << 18]),
    eps=st.sampled_from([0.0, 0.1]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    index=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_adaptive_gradient_and_its_gram_column_in_one_sweep(size, block, eps, dtype, index, seed):
    """The column sweep writes c^2 * g into g, bit for bit egrad2rgrad_, and returns the
    column of the Gram matrix of the vectors with that gradient in its place, to
    rounding, without dividing by the scale; frozen entries add nothing."""
    from geoopt_quotient.manifolds import adaptive

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, generator=generator, dtype=dtype)
    x[::5] = 0.0  # frozen where eps = 0
    space = gq.AdaptiveEuclidean(eps=eps).tangent_space(x)
    vectors = [space.random(generator) for _ in range(3)]
    egrad = torch.randn(size, generator=generator, dtype=dtype) * 3
    vectors[index] = egrad.clone()
    old, adaptive.GRAM_BLOCK = adaptive.GRAM_BLOCK, block
    try:
        rgrad, column = space.egrad2rgrad_column_(vectors, index)
        separate = space.egrad2rgrad_(egrad.clone())
    finally:
        adaptive.GRAM_BLOCK = old
    assert rgrad is vectors[index] and torch.equal(rgrad, separate)
    assert column.dtype == torch.float64 and column.shape == (3,)
    c2 = (x.double().abs() + eps) ** 2
    weight = torch.where(c2 > 0, 1 / c2, torch.zeros_like(c2))
    doubles = [v.double() for v in vectors]
    formula = torch.stack([(weight * u * doubles[index]).sum() for u in doubles])
    scale = float(formula.abs().max()) + float(formula[index])
    eps_dtype = torch.finfo(dtype).eps
    assert torch.allclose(column, formula, rtol=0, atol=8 * (size + 8) * eps_dtype * scale)
    if eps == 0 and size > 5:  # a gradient on frozen entries is dropped, not counted
        grown = [v.clone() for v in vectors]
        grown[index] = egrad.clone()
        grown[index][::5] = 1e6
        _, bigger = space.egrad2rgrad_column_(grown, index)
        assert torch.allclose(bigger, column, rtol=0, atol=8 * (size + 8) * eps_dtype * scale)


def test_adaptive_gram_column_declines_what_one_sweep_cannot():
    """Another dtype than the working one, or a strided vector: ``None`` and nothing
    changed; the tangent space then takes the whole matrix's column, the same values."""
    x = torch.randn(40, 30)
    space = gq.AdaptiveEuclidean().tangent_space(x)
    xi, xi_prev = torch.randn(40, 30), torch.randn(40, 30)
    for egrad in (torch.randn(40, 30).bfloat16(), torch.randn(30, 40).t()):
        before = egrad.clone()
        assert space.state.rescaled_column_((xi, egrad, xi_prev), 1) is None
        assert torch.equal(egrad, before)
        rgrad, column = space.egrad2rgrad_column_((xi, egrad, xi_prev), 1)
        rgrad2, gram = space.egrad2rgrad_gram_((xi, before, xi_prev), 1)
        assert torch.equal(rgrad, rgrad2) and torch.equal(column, gram[:, 1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_derived_gram_entries_are_those_summed_and_refreshed_every_few(dtype):
    """Along an Auto-PGD run, every Gram matrix the loop uses equals the one summed over
    the entries to the rounding of its dtype; at most ``MAX_DERIVED_RUN`` in a row have
    derived entries, the first none."""
    torch.manual_seed(0)
    point = torch.randn(50, 40, dtype=dtype)
    a = torch.randn(40, dtype=dtype)
    runs, errors = [], []
    original = apgd.TangentBall.riemannian_gradient_gram_

    def checked(ball, egrads, xi, xi_prev):
        rgrads, gram = original(ball, egrads, xi, xi_prev)
        summed = ball.gram((xi, rgrads, xi_prev))
        errors.append(float((gram - summed).abs().max() / summed.abs().max()))
        runs.append(ball.derived_run)
        return rgrads, gram

    def objective(points):
        return torch.sin(points[0] @ a).sum() + points[0].pow(3).sum()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(apgd.TangentBall, "riemannian_gradient_gram_", checked)
        maximize_in_ball([(point, gq.AdaptiveEuclidean())], objective, rho=1.0, iters=30)
    assert runs[0] == 0 and max(runs) == apgd.MAX_DERIVED_RUN
    assert sum(r > 0 for r in runs) > len(runs) / 2  # derived most of the time
    assert max(errors) <= 50 * torch.finfo(dtype).eps


@pytest.mark.parametrize("init", ["zero", "random"])
def test_the_first_conversion_from_zero_sums_the_gradients_column_alone(init):
    """From the zero first iterate (the default start) the iterates' Gram entries are
    known exactly, all zero: the first Riemannian gradient sums only its own column (no
    metric products of the zero iterates), and the run equals the one that sums the
    whole matrix to float64 rounding; a random start sums the whole matrix."""
    torch.manual_seed(0)
    manifold = gq.GLQuotient(6, 6, "inv")
    points = [torch.randn(40, 30, dtype=torch.float64), manifold.random(3, 12, 2).double()]
    a = torch.randn(30, dtype=torch.float64)

    def objective(perturbed):
        adaptive, quotient = perturbed
        return torch.sin(adaptive @ a).sum() + adaptive.pow(3).sum() + quotient.pow(4).sum()

    groups = [(points[0], gq.AdaptiveEuclidean()), (points[1], manifold)]
    kinds = []
    original = apgd.TangentBall._gram_kind

    def spy(ball, xi, xi_prev):
        kinds.append(original(ball, xi, xi_prev))
        return kinds[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(apgd.TangentBall, "_gram_kind", spy)
        known = maximize_in_ball(groups, objective, rho=0.5, iters=6, init=init)
        first = kinds[0]
        patch.setattr(apgd.TangentBall, "start_at_zero", lambda ball, xi: None)
        summed = maximize_in_ball(groups, objective, rho=0.5, iters=6, init=init)
    assert first == ("column" if init == "zero" else "gram")
    assert known.value == pytest.approx(summed.value, rel=1e-13, abs=0)
    assert known.history == pytest.approx(summed.history, rel=1e-13, abs=1e-15)
    for u, v in zip(known.xi, summed.xi):
        assert torch.allclose(u, v, rtol=0, atol=1e-13 * float(v.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_zero_first_iterate_is_evaluated_without_retraction_and_the_same_values(dtype):
    """At the zero first iterate a path's point is the base point and its differential
    the identity, as the formulas give them exactly: its evaluation copies the point
    and takes the gradient as it is (no retraction or pullback of the quotient groups),
    and the whole call's values are those of the retraction's, bit for bit."""
    model = tiny_llama_causal_lm().to(dtype)
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 32, (2, 6))}

    def loss_fn(m, b):
        return m(**b, labels=b["input_ids"]).loss

    plan = gq.find_symmetries(model, metric="inv")
    calls = []
    original = _gl_tangent.GLTangentSpace.retr_vjp

    def counted(space, u, out):
        calls.append(bool(u.any()))
        return original(space, u, out)

    def measure():
        calls.clear()
        result = gq.geodesic_sharpness(
            model, loss_fn, [batch], metric="inv", symmetries=plan, rho=0.01, iters=3
        )
        return result, list(calls)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_gl_tangent.GLTangentSpace, "retr_vjp", counted)
        known, known_calls = measure()
        patch.setattr(apgd.TangentBall, "is_zero", lambda ball, xi: False)
        retracted, retracted_calls = measure()
    assert all(known_calls) and not all(retracted_calls)  # the zero one retracted before
    assert len(retracted_calls) - len(known_calls) == retracted_calls.count(False) > 0
    assert known.value == retracted.value and known.per_batch == retracted.per_batch


def test_the_zero_first_iterate_is_known_while_unchanged_and_not_kept_alive():
    """The ball knows the zero first iterate until it is written over, and holds it
    weakly: a freed iterate's buffer is not kept alive by it."""
    groups = [BallGroup(torch.randn(4, 3), gq.AdaptiveEuclidean())]
    ball, _ = apgd.prepare_ball(groups, 1.0, "second_order")
    xi = ball.zeros()
    ball.start_at_zero(xi)
    assert ball.is_zero(xi) and not ball.is_zero([t.clone() for t in xi])
    xi[0].add_(1.0)
    assert not ball.is_zero(xi)
    ref = weakref.ref(xi[0])
    ball.iterates = None  # the first Riemannian gradient takes it
    del xi
    assert ref() is None


def test_adaptive_gradient_and_gram_fall_back_to_two_steps_where_one_sweep_cannot():
    """A gradient in another dtype than the working one, or a strided vector: nothing is
    fused (the sweep declines and changes nothing), and the values are those of the two
    steps."""
    x = torch.randn(40, 30)
    manifold = gq.AdaptiveEuclidean()
    space = manifold.tangent_space(x)
    xi, xi_prev = torch.randn(40, 30), torch.randn(40, 30)
    cases = {
        "bfloat16": torch.randn(40, 30).bfloat16(),
        "strided": torch.randn(30, 40).t(),
    }
    for name, egrad in cases.items():
        before = egrad.clone()
        assert space.state.rescaled_gram_((xi, egrad, xi_prev), 1) is None, name
        assert torch.equal(egrad, before), name
        rgrad, gram = space.egrad2rgrad_gram_((xi, egrad, xi_prev), 1)
        expected = space.egrad2rgrad(before)
        assert torch.equal(rgrad, expected), name
        assert torch.equal(gram, space.gram([xi, expected, xi_prev])), name


def test_riemannian_gradient_in_place_has_the_same_values_and_copies_what_it_cannot_own():
    x = torch.randn(40, 30, dtype=torch.float64)
    space = gq.AdaptiveEuclidean().tangent_space(x)
    egrad = torch.randn(40, 30, dtype=torch.float64)
    expected = space.egrad2rgrad(egrad)
    buffer = egrad.clone()
    assert space.egrad2rgrad_(buffer) is buffer and torch.equal(buffer, expected)
    transposed = egrad.t().contiguous().t()  # not contiguous: a new tensor, input unchanged
    before = transposed.clone()
    result = space.egrad2rgrad_(transposed)
    assert result is not transposed and torch.equal(transposed, before)
    assert torch.equal(result, expected)


def shared_gradient_objective(points):
    """Autograd hands the same gradient tensor to both points (the backward of a sum)."""
    return torch.sin(points[0] + points[1]).pow(2).sum()


def test_gradients_autograd_shares_between_points_are_not_overwritten(monkeypatch):
    """The Riemannian gradient is written into the gradient's buffer: where autograd
    gives two leaves one tensor, the second gets a copy, and the iterates are those of
    the out-of-place loop (bit for bit with every Gram matrix summed anew)."""
    from test_sharpness import gram_update, textbook_apgd

    monkeypatch.setattr(apgd, "MAX_DERIVED_RUN", 0)

    torch.manual_seed(0)
    groups = [
        (torch.randn(6, 5, dtype=torch.float64), gq.AdaptiveEuclidean()),
        (torch.randn(6, 5, dtype=torch.float64), gq.AdaptiveEuclidean()),
    ]
    kwargs = dict(rho=0.5, iters=15)
    value, xi, history = textbook_apgd(
        groups, shared_gradient_objective, update=gram_update, **kwargs
    )
    result = maximize_in_ball(groups, shared_gradient_objective, **kwargs)
    assert (result.value, result.history) == (value, history)
    assert all(torch.equal(a, b) for a, b in zip(result.xi, xi))


def test_straight_path_gradient_and_value_are_those_of_x_plus_xi():
    """The perturbed point written into the ball's buffer and differentiated there gives
    the value and gradient of x + ξ differentiated in ξ, bit for bit, at every call."""
    torch.manual_seed(0)
    point = torch.randn(8, 5, dtype=torch.float64)
    a = torch.randn(5, dtype=torch.float64)

    def objective(points):
        return torch.tanh(points[0] @ a).pow(3).sum()

    ball, paths = apgd.prepare_ball([(point, gq.AdaptiveEuclidean())], 1.0, "second_order")
    assert paths[0] is apgd.straight_path
    autocast = apgd.AutocastState.capture()
    for seed in range(3):
        xi = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        value, (grad,) = apgd.evaluate_in_ball(ball, paths, objective, [xi], True, autocast)
        leaf = xi.clone().requires_grad_()
        expected_value = objective([point + leaf])
        (expected_grad,) = torch.autograd.grad(expected_value, leaf)
        assert torch.equal(value, expected_value.detach()) and torch.equal(grad, expected_grad)


@pytest.mark.parametrize("keep, most", [(False, 2), (True, 3)])
def test_iterates_reuse_their_buffers(keep, most):
    """Over 40 iterations with restarts Auto-PGD allocates the zero start, the perturbed
    point and, with the kept gradient, the first update's output, and nothing more: the
    next iterate is written over the previous one or over the gradient, and where the
    best iterate holds both (after a restart) over the iterate the restart left."""
    objective, _ = restarting_objective()
    allocations = []
    original = buffers.joint_buffer

    def counted(*args, **kwargs):
        allocations.append(1)
        return original(*args, **kwargs)

    point = torch.ones(3, dtype=torch.float64)
    try:
        buffers.joint_buffer = counted
        result = maximize_in_ball(
            [(point, gq.AdaptiveEuclidean())],
            objective,
            rho=1.0,
            iters=40,
            keep_best_gradient=keep,
        )
    finally:
        buffers.joint_buffer = original
    assert result.gradients >= 40
    assert len(allocations) <= most


@pytest.mark.parametrize("keep, most", [(False, 3), (True, 5)])
def test_a_run_allocates_no_more_vectors_than_it_holds_at_once(keep, most, monkeypatch):
    """Over runs of 30 iterations with restarts, the ball's vectors (iterates, and the
    gradients the layout writes into freed ones) are allocated only while the loop holds
    more of them than ever before: at most three iterates and, with the kept gradient, two
    gradients, per batch; without it the gradient is the layout's own vector, over the
    perturbed point (none allocated). A freed vector (a gradient, an earlier best iterate,
    an iterate a restart left) is written over, not dropped for a new one to be faulted
    in."""
    model, batches = tiny_bert()
    allocations = []
    joint, gradient_buffers = buffers.joint_buffer, layout_module.BallLayout.gradient_buffers

    def counted_joint(*args, **kwargs):
        allocations.append("iterate")
        return joint(*args, **kwargs)

    def counted_gradients(self, spare, own=None, own_vector=False):
        if spare is None and not own_vector:
            allocations.append("gradient")
        return gradient_buffers(self, spare, own, own_vector)

    monkeypatch.setattr(buffers, "joint_buffer", counted_joint)
    monkeypatch.setattr(layout_module.BallLayout, "gradient_buffers", counted_gradients)
    result = measure(model, batches, "adaptive", rho=0.5, iters=30, keep_best_gradient=keep)
    restarts = sum(result.backward_passes) - 30 * len(batches)
    assert (restarts == 0) if keep else (restarts > 0)  # kept: a restart costs no pass
    assert ("gradient" in allocations) == keep and len(allocations) <= most * len(batches)


# ---------------------------------------------------------------- gradient on arrival
@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(1, 700),
    block=st.sampled_from([7, 64, 1 << 18]),
    kind=st.sampled_from(["column", "gram"]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_a_gradient_sweep_in_any_order_of_blocks_is_the_one_sweep(size, block, kind, dtype, seed):
    """A :class:`GradientSweep` whose blocks are done in any order, some of them twice,
    then finished, rescales the gradient and sums the Gram entries bit for bit as the one
    sweep of ``egrad2rgrad_column_`` / ``egrad2rgrad_gram_`` does."""
    from geoopt_quotient.manifolds import adaptive

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, generator=generator, dtype=dtype)
    x[::5] = 0.0
    space = gq.AdaptiveEuclidean().tangent_space(x)
    xi, xi_prev = space.random(generator), space.random(generator)
    egrad = torch.randn(size, generator=generator, dtype=dtype) * 3
    old, adaptive.GRAM_BLOCK = adaptive.GRAM_BLOCK, block
    try:
        one = (space.egrad2rgrad_column_ if kind == "column" else space.egrad2rgrad_gram_)(
            (xi, egrad.clone(), xi_prev), 1
        )
        gradient = egrad.clone()
        sweep = space.gradient_sweep((xi, gradient, xi_prev), 1, kind)
        order = torch.randperm(sweep.blocks, generator=generator).tolist()
        for index in order[: len(order) // 2] + order[:1]:
            sweep.block(index)
        result = sweep.finish()
    finally:
        adaptive.GRAM_BLOCK = old
    assert torch.equal(gradient, one[0]) and torch.equal(result, one[1])
    assert sweep.matches((xi, gradient, xi_prev), 1, kind)
    assert not sweep.matches((xi, gradient.clone(), xi_prev), 1, kind)


def unused_tail_model(dtype):
    """Linear layers, the last two never used: their segments get no gradient."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(24, 24) for _ in range(6)]
    model = torch.nn.Sequential(*layers).to(dtype)
    batch = torch.randn(5, 24, dtype=dtype)

    def loss(m, x):
        for layer in list(m)[:4]:
            x = torch.tanh(layer(x))
        return (x**2).mean()

    return model, [batch, batch * 0.5], loss


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("build", ["bert", "unused tail"])
def test_the_gradient_converted_as_it_arrives_changes_no_value(build, keep, dtype, monkeypatch):
    """The fused adaptive group's gradient swept block by block during the backward pass
    (blocks of 64 entries: most blocks span parameters, some span the gradient's
    segments, some lie in segments without gradient) gives the run of the sweep after the
    pass, bit for bit, and many blocks are first swept in the backward pass (those of a
    segment with an unused parameter only after it: a third of the unused tail's)."""
    from geoopt_quotient.manifolds import adaptive

    monkeypatch.setattr(adaptive, "GRAM_BLOCK", 64)
    monkeypatch.setattr(layout_module, "GRADIENT_SEGMENT_BYTES", 1)  # a segment a parameter
    if build == "bert":
        model, batches = tiny_bert()
        model, loss = model.to(dtype), loss_fn
    else:
        model, batches, loss = unused_tail_model(dtype)
    during = []
    block = adaptive.GradientSweep.block

    def counted(self, index):
        if self._parts[index] is None:  # a block's first sweep: during the pass, or after
            during.append(torch._C._current_graph_task_id() != -1)
        return block(self, index)

    def run():
        options = dict(rho=0.3, iters=10, progress=False, keep_best_gradient=keep)
        return gq.adaptive_sharpness(model, loss, batches, **options)

    monkeypatch.setattr(adaptive.GradientSweep, "block", counted)
    on_arrival = run()
    assert sum(during) > len(during) / 3
    monkeypatch.setattr(apgd.TangentBall, "gradient_sweep", lambda self, index, grad: None)
    after = run()
    assert on_arrival.value == after.value and on_arrival.histories == after.histories
    assert on_arrival.per_batch == after.per_batch


def test_a_gradient_of_few_blocks_is_swept_after_the_pass(monkeypatch):
    """Below :data:`~geoopt_quotient.sharpness.layout.ARRIVAL_MIN_BLOCKS` blocks the
    gradient is in cache after the pass: no block is swept during the backward pass, and
    the values are those of the arrival's run."""
    from geoopt_quotient.manifolds import adaptive

    model, batches, loss = unused_tail_model(torch.float64)
    size = sum(p.numel() for p in model.parameters())
    during = []
    block = adaptive.GradientSweep.block

    def counted(self, index):
        during.append(torch._C._current_graph_task_id() != -1)
        return block(self, index)

    def run():
        return gq.adaptive_sharpness(model, loss, batches, rho=0.3, iters=6, progress=False)

    monkeypatch.setattr(adaptive.GradientSweep, "block", counted)
    monkeypatch.setattr(adaptive, "GRAM_BLOCK", 64)  # many blocks: swept on arrival
    monkeypatch.setattr(layout_module, "GRADIENT_SEGMENT_BYTES", 1)  # a segment a parameter
    assert size > 8 * 64
    many = run()
    assert any(during)
    during.clear()
    blocks = layout_module.ARRIVAL_MIN_BLOCKS - 1
    monkeypatch.setattr(adaptive, "GRAM_BLOCK", -(-size // blocks))  # fewer blocks
    few = run()
    assert during and not any(during)
    assert few.value == pytest.approx(many.value, rel=1e-12)


def test_a_sweep_not_taken_leaves_no_trace():
    """A gradient evaluated with a sweep but converted for other iterates (or alone) is
    converted once: the sweep is finished, not repeated; an evaluation that drops it
    makes the next conversion start afresh."""
    x = torch.randn(300, dtype=torch.float64)
    ball = apgd.TangentBall([BallGroup(x, gq.AdaptiveEuclidean())], 1.0)
    xi, xi_prev, other = ([torch.randn(300, dtype=torch.float64)] for _ in range(3))
    egrad = torch.randn(300, dtype=torch.float64)
    expected_rgrad = ball.spaces[0].egrad2rgrad(egrad)
    expected = ball.gram([other, [expected_rgrad], xi_prev])
    ball.expect_gradient(xi, xi_prev)
    gradient = egrad.clone()
    sweep = ball.gradient_sweep(0, gradient)
    sweep.block(0)  # part of it arrived
    rgrads, gram = ball.riemannian_gradient_gram_([gradient], other, xi_prev)
    assert torch.equal(rgrads[0], expected_rgrad) and torch.allclose(gram, expected, rtol=1e-12)
    alone = egrad.clone()
    ball.expect_gradient(xi, xi_prev)
    ball.gradient_sweep(0, alone).block(0)
    assert torch.equal(ball.riemannian_gradients_([alone])[0], expected_rgrad)
    assert ball.sweeps == {}


@settings(max_examples=60, deadline=None)
@given(
    start=st.integers(0, 50),
    chunks=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    step=st.integers(1, 30),
)
def test_a_segments_blocks_tile_it_by_chunk_and_block(start, chunks, step):
    """Each piece lies in one chunk and one block; the pieces tile the segment in order."""
    pieces = [
        (block, piece)
        for block, lo, hi, parts in layout_module.segment_blocks(start, sum(chunks), chunks, step)
        for piece in parts
        if lo // step == block and (hi - 1) // step == block
    ]
    position = start
    bounds = [start + sum(chunks[:i]) for i in range(len(chunks) + 1)]
    for block, (lo, hi, chunk, chunk_start) in pieces:
        assert lo == position and lo < hi and lo // step == block == (hi - 1) // step
        assert chunk_start == bounds[chunk] <= lo and hi <= bounds[chunk + 1]
        position = hi
    assert position == start + sum(chunks)
