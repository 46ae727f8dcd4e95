"""The ball's memory beside the model: no staging buffer for the symmetry groups, and
the model's parameters left in their own storages (a reference the user holds to one of
them keeps aliasing it, which the stale-reference check relies on)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from test_ball_norm import tiny_bert as bert_and_batch

import geoopt_quotient as gq
from geoopt_quotient.sharpness.ball import LocalBall
from geoopt_quotient.sharpness.measure import resolve_plan


def tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return bert_and_batch(torch.float32)[0]


def loss_fn(model, batch):
    return model(**batch).loss


BATCH = {"input_ids": torch.tensor([[1, 5, 7, 2], [3, 4, 9, 8]]), "labels": torch.tensor([0, 2])}


def owns_storage(p: torch.Tensor) -> bool:
    return p.untyped_storage().nbytes() == p.numel() * p.element_size()


def open_ball(model, measure):
    plan = (
        gq.SymmetryPlan().bind(model)
        if measure == "adaptive"
        else resolve_plan(model, None, measure)
    )
    return LocalBall(
        model, plan, loss_fn, kind="worst", path="second_order", norm=True, keep_best_gradient=None
    )


@pytest.mark.parametrize("measure", ["adaptive", "inv"])
def test_the_parameters_keep_their_storages_through_a_worst_case_call(measure):
    model = tiny_bert()
    storages = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    alias = model.classifier.weight.detach()
    call = gq.adaptive_sharpness if measure == "adaptive" else gq.geodesic_sharpness
    call(model, loss_fn, [BATCH], rho=0.01, iters=2, progress=False)
    assert {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()} == storages
    assert alias.data_ptr() == model.classifier.weight.data_ptr()


@pytest.mark.parametrize("share_storage", [False, True])
def test_the_symmetry_groups_need_no_staging_buffer(monkeypatch, share_storage):
    """The symmetry groups' perturbed points and gradients are the evaluation's own
    vector (the gradient's): no buffer as large as the groups beside it, in a whole call."""
    import geoopt_quotient.sharpness.ball as ball_module

    layouts = []

    class Recorded(ball_module.BallLayout):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            layouts.append(self)

    monkeypatch.setattr(ball_module, "BallLayout", Recorded)
    options = dict(rho=0.05, iters=3, progress=False, share_storage=share_storage)
    gq.geodesic_sharpness(tiny_bert(), loss_fn, [BATCH], **options)
    ((rest,),) = [layout._rests for layout in layouts]
    assert rest.scatters()
    assert rest._scratch is None
    assert layouts[0].bytes_per_parameter(keep_best_gradient=False)["staging"] == 0


def test_gradients_scattered_per_parameter_equal_the_flat_gradient_read_by_blocks():
    """:class:`_Scatter` copies each parameter's gradient into the groups' shapes: the
    entries of the flat gradient read out by the blocks, a parameter with no gradient
    zero, and the padding zero."""
    from geoopt_quotient.sharpness.layout import _Scatter, _strided

    layout = open_ball(tiny_bert(), "inv").layout
    (rest,) = layout._rests
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=generator) for s in rest.flat.shapes]
    grads[1] = None
    given = [torch.zeros(s) if g is None else g for g, s in zip(grads, rest.flat.shapes)]
    flat = rest.flat.filled(given)
    expected = [torch.zeros(s) for s in rest.shapes]
    for block in rest.blocks[0]:
        _strided(expected[block.group].view(-1), block.point).copy_(_strided(flat, block.flat))
    out = [torch.full(s, float("nan")) for s in rest.shapes]
    segments = rest.flat.segments(3)
    scatter = _Scatter(rest, segments, out)
    grads_left = iter(grads)
    taken = [[next(grads_left) for _ in segment.shapes] for segment in segments]
    for segment, segment_grads in reversed(list(zip(segments, taken))):  # any order
        scatter.write(segment, segment_grads)
    for got, want in zip(out, expected):
        assert torch.equal(got, want)


def call_for(measure):
    if measure == "adaptive":
        return gq.adaptive_sharpness
    return lambda *args, **kwargs: gq.geodesic_sharpness(*args, metric=measure, **kwargs)


def measured(model, measure, **options):
    return call_for(measure)(model, loss_fn, [BATCH], rho=0.05, iters=4, progress=False, **options)


@pytest.mark.parametrize("measure", ["adaptive", "inv", "mix"])
def test_sharing_the_storage_moves_the_parameters_and_changes_no_value(measure):
    model = tiny_bert().double()
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    objects = dict(model.named_parameters())
    plain = measured(model, measure)
    shared = measured(model, measure, share_storage=True)
    assert shared.value == plain.value  # bit for bit: the same arithmetic
    assert shared.histories == plain.histories
    assert dict(model.named_parameters()) == objects  # the same Parameter objects
    for name, param in model.named_parameters():
        assert torch.equal(param, values[name]), name
        assert param.requires_grad
    moved = [p for p in model.parameters() if not owns_storage(p)]
    assert moved, "no parameter moved into the ball's buffer"
    # one buffer for the fused parameters, one for the symmetry groups' (written in place)
    buffers = 1 if measure == "adaptive" else 2
    assert len({p.untyped_storage().data_ptr() for p in moved}) == buffers


@pytest.mark.parametrize("measure", ["inv", "mix"])
def test_the_symmetry_groups_are_perturbed_in_the_models_storage_and_restored(measure):
    """With ``share_storage``, the attention weights' flat buffer is the model's own
    storage: each pass reads the perturbed point there, and the base point is written
    back after it, also when the loss raises."""
    model = tiny_bert().double()
    query = model.bert.encoder.layer[0].attention.self.query.weight
    base = query.detach().clone()
    seen = []

    def watching(m, batch):
        seen.append(not torch.equal(query, base))  # the parameter object's own storage
        return loss_fn(m, batch)

    shared = functools.partial(
        gq.geodesic_sharpness,
        model,
        batches=[BATCH],
        rho=0.05,
        metric=measure,
        iters=3,
        progress=False,
        share_storage=True,
    )
    shared(loss_fn=watching)
    assert any(seen) and torch.equal(query, base)
    calls = []

    def failing(m, batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory, say")
        return loss_fn(m, batch)

    with pytest.raises(RuntimeError, match="out of memory"):
        shared(loss_fn=failing)
    assert torch.equal(query, base)


def test_a_later_call_reuses_the_buffer_the_parameters_moved_into():
    model = tiny_bert().double()
    first = measured(model, "adaptive", share_storage=True)
    storages = {
        n: (p.untyped_storage().data_ptr(), p.data_ptr()) for n, p in model.named_parameters()
    }
    second = measured(model, "adaptive", share_storage=True)
    assert {
        n: (p.untyped_storage().data_ptr(), p.data_ptr()) for n, p in model.named_parameters()
    } == storages
    assert second.value == first.value
    # training in between moves values, not storages, and the next call sees them
    with torch.no_grad():
        model.classifier.weight.mul_(1.5)
    third = measured(model, "adaptive", share_storage=True)
    assert third.value != first.value
    copy = tiny_bert().double()
    copy.load_state_dict(model.state_dict())
    assert measured(copy, "adaptive").value == third.value


def test_a_parameter_sharing_its_storage_with_another_stays_where_it_is():
    model = tiny_bert().double()
    weight = model.classifier.weight
    twin = torch.nn.Parameter(weight.data)  # a second Parameter over the same storage
    model.classifier.register_parameter("twin", twin)
    model.classifier.forward = lambda x, c=model.classifier: torch.nn.functional.linear(
        x, c.weight + 0 * c.twin, c.bias
    )
    measured(model, "adaptive", share_storage=True)
    assert owns_storage(weight) and owns_storage(twin)
    assert weight.untyped_storage().data_ptr() == twin.untyped_storage().data_ptr()


def test_the_base_point_is_counted_once_when_shared():
    model = tiny_bert()
    plan = gq.SymmetryPlan().bind(model)
    copied = LocalBall(
        model, plan, loss_fn, kind="worst", path="straight", norm=True, keep_best_gradient=False
    ).layout.bytes_per_parameter(keep_best_gradient=False)
    shared = LocalBall(
        model,
        plan,
        loss_fn,
        kind="worst",
        path="straight",
        norm=True,
        keep_best_gradient=False,
        share_storage=True,
    ).layout.bytes_per_parameter(keep_best_gradient=False)
    assert copied["base"] == pytest.approx(4.0, rel=0.01)
    assert shared["base"] == 0.0
    assert shared["total"] == pytest.approx(copied["total"] - copied["base"])


def test_share_storage_is_for_the_worst_case():
    with pytest.raises(ValueError, match="share_storage"):
        gq.adaptive_sharpness(
            tiny_bert(), loss_fn, [BATCH], rho=0.05, iters=2, kind="average", share_storage=True
        )


def test_a_stale_reference_is_still_caught_and_named_when_shared():
    model = tiny_bert()
    held = model.classifier.weight  # the unperturbed parameter, held outside loss_fn

    def stale_loss(m, batch):
        return m(**batch).loss + 0 * held.sum()

    measured(model, "adaptive", share_storage=True)  # the parameters move first
    with pytest.raises(gq.StaleParameterError, match=r"classifier\.weight"):
        gq.adaptive_sharpness(
            model, stale_loss, [BATCH], rho=0.05, iters=2, progress=False, share_storage=True
        )


def test_measures_in_turn_move_the_parameters_between_their_buffers():
    """adaptive (every parameter fused), then inv (the attention weights in symmetry
    groups: left out of its buffer), then adaptive again: each call's fused parameters
    share one buffer, the others own their storages (the earlier buffer is freed), and
    every value is that of a model that was never moved."""
    model, reference = tiny_bert().double(), tiny_bert().double()
    for measure in ["adaptive", "inv", "adaptive"]:
        assert (
            measured(model, measure, share_storage=True).value == measured(reference, measure).value
        )
        storages = {}
        for param in model.parameters():
            storages.setdefault(param.untyped_storage().data_ptr(), []).append(param)
        shared = [group for group in storages.values() if len(group) > 1]
        assert len(shared) == (1 if measure == "adaptive" else 2)  # + the attention weights'
        assert all(owns_storage(group[0]) for group in storages.values() if len(group) == 1)
        fused = max(len(group) for group in shared)
        assert fused == len(list(model.parameters())) if measure == "adaptive" else fused < 30


def test_a_monitor_sharing_the_storage_measures_as_one_that_does_not():
    """Training between measurements (an optimizer holding the parameters) updates the
    moved parameters in place; each measurement equals that of a model never moved."""
    from geoopt_quotient.integrations import SharpnessMonitor

    models = [tiny_bert().double(), tiny_bert().double()]
    monitors = [
        SharpnessMonitor([BATCH], 1, ["adaptive"], loss_fn=loss_fn, iters=3, **o)
        for o in ({}, {"share_storage": True})
    ]
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
    for step in (1, 2, 3):
        values = [monitor.step(m, step) for monitor, m in zip(monitors, models)]
        assert values[0] == values[1]
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            loss_fn(model, BATCH).backward()
            optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    assert not all(owns_storage(p) for p in models[1].parameters())


def test_a_calls_gradient_leaves_are_freed_without_the_cycle_collector(monkeypatch):
    """The leaves' hooks hold no reference back to the leaves: their buffers go with the
    call, not at the next garbage collection (a model-sized buffer per call otherwise)."""
    import gc
    import weakref

    from geoopt_quotient.sharpness import layout

    made = []
    init = layout._GradientLeaves.__init__

    def recorded(self, *args):
        init(self, *args)
        made.append(weakref.ref(self.leaves[0]))

    monkeypatch.setattr(layout._GradientLeaves, "__init__", recorded)
    model = tiny_bert()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for measure in ("adaptive", "inv"):
            measured(model, measure)
        assert made and all(leaf() is None for leaf in made)
    finally:
        if enabled:
            gc.enable()


def test_a_later_call_on_the_same_plan_reuses_the_strided_blocks(monkeypatch):
    """The unfused groups' flat layout and strided blocks depend on the bound plan and
    the points' shapes, dtype and device alone: a second ball on the same plan reuses
    them (no position per entry derived again) and perturbs the model as the first; a
    plan bound again derives its own."""
    from geoopt_quotient.sharpness import layout as layout_module

    model = tiny_bert()
    plan = resolve_plan(model, None, "inv")
    first = LocalBall(
        model, plan, loss_fn, kind="worst", path="second_order", norm=True, keep_best_gradient=None
    ).layout
    derived = []
    monkeypatch.setattr(
        layout_module,
        "strided_blocks",
        lambda *args, **kwargs: derived.append(1) or pytest.fail("derived again"),
    )
    second = LocalBall(
        model, plan, loss_fn, kind="worst", path="second_order", norm=True, keep_best_gradient=None
    ).layout
    ((a,), (b,)) = first._rests, second._rests
    assert a.blocks is not None and b.blocks is a.blocks and b.flat is a.flat
    assert b.destination is None and b.source is None
    points = [g.point for g in second.groups]
    out_first, out_second = (torch.empty(r.flat.size) for r in (a, b))
    a.write(points[: len(a.groups)], out_first)
    b.write(points[: len(b.groups)], out_second)
    assert torch.equal(out_first, out_second)
    monkeypatch.undo()
    again = resolve_plan(model, None, "inv")
    calls = []
    original = layout_module.strided_blocks
    monkeypatch.setattr(
        layout_module, "strided_blocks", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    LocalBall(
        model, again, loss_fn, kind="worst", path="second_order", norm=True, keep_best_gradient=None
    )
    assert calls == [1]


def test_a_plan_passed_unbound_is_bound_once_and_its_blocks_derived_once(monkeypatch):
    """A plan found once and passed unbound to each call (as a script or a benchmark
    does) is bound once per model (:func:`~geoopt_quotient.symmetry.plan.bound_once`),
    so that the layout's strided blocks are derived by the first call alone; a change of
    the plan or of the model's trainable parameters binds it again."""
    from geoopt_quotient.sharpness import layout as layout_module

    model = tiny_bert()
    plan = gq.find_symmetries(model, metric="inv")
    calls = []
    original = layout_module.strided_blocks
    monkeypatch.setattr(
        layout_module, "strided_blocks", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    values = [
        gq.geodesic_sharpness(
            model,
            loss_fn,
            [BATCH],
            metric="inv",
            symmetries=plan,
            rho=0.01,
            iters=2,
            progress=False,
        ).value
        for _ in range(2)
    ]
    assert calls == [1] and values[0] == values[1]
    bound = resolve_plan(model, plan, "inv")
    same_groups = gq.SymmetryPlan(list(plan.groups), plan.adaptive_eps, list(plan.notes))
    assert resolve_plan(model, same_groups, "inv") is bound
    changed = gq.SymmetryPlan(list(plan.groups), 1e-3, list(plan.notes))
    assert resolve_plan(model, changed, "inv").groups[-1].manifold.eps == 1e-3
    model.classifier.bias.requires_grad_(False)
    frozen = resolve_plan(model, plan, "inv")
    assert frozen is not bound and "classifier.bias" not in frozen.param_names
    model.classifier.bias.requires_grad_(True)
    model.classifier.bias = torch.nn.Parameter(model.classifier.bias.detach().clone())
    replaced = resolve_plan(model, plan, "inv")
    assert replaced is not bound and replaced is not frozen
    assert resolve_plan(model, plan, "inv") is replaced


class Lending:
    """The layout's objective, recording whether each gradient it returned is its own
    vector (written over the perturbed points)."""

    def __init__(self, inner):
        self.inner, self.lent = inner, []

    def perturbed_buffer(self, index):
        return self.inner.perturbed_buffer(index)

    def owns(self, vector):
        return self.inner.owns(vector)

    def evaluate_ball(self, ball, paths, xi, grad, autocast, recycled=None, own_vector=False):
        value, grads = self.inner.evaluate_ball(
            ball, paths, xi, grad, autocast, recycled, own_vector
        )
        if grads is not None:
            self.lent.append(self.inner.owns(grads))
        return value, grads


@pytest.mark.parametrize("measure", ["adaptive", "inv", "mix"])
def test_without_the_kept_gradient_it_is_written_over_the_perturbed_points(measure, monkeypatch):
    """Where Auto-PGD keeps no best gradient, each evaluation returns the gradient in the
    layout's own vector: for the fused groups the flat buffers the model read the
    perturbed points from (a segment's gradient written once the backward pass is done
    with its parameters, here one a segment), for the symmetry groups the tensors their
    points were written from. The run is the one with the kept gradient, value for
    value (a restart recomputes the gradient), with one vector of the model's size
    less."""
    from geoopt_quotient.sharpness import layout as layout_module

    monkeypatch.setattr(layout_module, "GRADIENT_SEGMENT_BYTES", 1)
    model = tiny_bert().double()
    plan = gq.SymmetryPlan().bind(model) if measure == "adaptive" else None
    plan = plan or resolve_plan(model, None, measure)
    runs = {}
    for keep in (True, False):
        ball = LocalBall(
            model,
            plan,
            loss_fn,
            kind="worst",
            path="second_order",
            norm=True,
            keep_best_gradient=keep,
        )
        objective = Lending(ball.objective(BATCH))
        result = gq.maximize_in_ball(
            ball.groups, objective, rho=3.0, iters=12, keep_best_gradient=keep
        )
        runs[keep] = result, objective.lent, ball.layout
    (kept, kept_lent, _), (lent, lent_flags, layout) = runs[True], runs[False]
    assert kept.history == lent.history and kept.value == lent.value
    assert lent.gradients > kept.gradients  # restarts recomputed the gradient
    assert not any(kept_lent) and lent_flags and all(lent_flags)
    own = layout.evaluation_vector()
    fused = range(len(layout._rest_points), len(layout.groups))
    assert all(own[i] is layout.perturbed_buffer(i) for i in fused)
    counted = layout.bytes_per_parameter(keep_best_gradient=False)
    assert counted["gradients"] == (
        0
        if measure == "adaptive"
        else pytest.approx(layout._own_rest_bytes() / sum(p.numel() for p in model.parameters()))
    )


class ReadsAWeightLate(torch.nn.Module):
    """A loss that reads ``first.weight`` through a ``detach()`` in a node that autograd
    runs after the weight's own gradient is complete (made earlier in the forward pass)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(6, 6)
        self.second = torch.nn.Linear(6, 6)

    def forward(self, x):
        late = (self.second.weight * self.first.weight.detach()).square().sum()
        return late + self.second(torch.tanh(self.first(x))).square().mean()


def test_a_loss_reading_a_weight_after_its_gradient_falls_back_to_a_vector_of_its_own(
    monkeypatch,
):
    """The gradient written over a weight's perturbed point once autograd completed it
    would be read as that weight by a later node holding a ``detach()`` of it: the
    weight's version, bumped by the write, makes autograd raise instead, and the
    evaluation runs again with the gradient in a vector of its own, as all later ones
    do. The value is the one with the kept gradient, bit for bit."""
    from geoopt_quotient.sharpness import layout as layout_module

    monkeypatch.setattr(layout_module, "GRADIENT_SEGMENT_BYTES", 1)  # a segment a parameter
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    values, layouts = {}, []
    original = layout_module.BallLayout.__init__

    def recorded(self, *args, **kwargs):
        original(self, *args, **kwargs)
        layouts.append(self)

    monkeypatch.setattr(layout_module.BallLayout, "__init__", recorded)
    for keep in (True, False):
        torch.manual_seed(0)
        model = ReadsAWeightLate().double()
        values[keep] = gq.adaptive_sharpness(
            model,
            lambda m, b: m(b),
            [x],
            rho=0.1,
            iters=5,
            progress=False,
            keep_best_gradient=keep,
        ).value
    assert values[False] == values[True] and values[True] > 0
    assert layouts[0].lends and not layouts[-1].lends


@pytest.mark.parametrize("measure", ["adaptive", "inv"])
def test_a_float32_state_of_a_bfloat16_model_holds_as_many_vectors_without_the_kept_gradient(
    measure, monkeypatch
):
    """A bfloat16 model's gradient, written over its perturbed parameters, is made
    Riemannian in the float32 state's new tensors, which Auto-PGD then owns: the free
    vectors, of no use to an evaluation, are released before each (as with the kept
    gradient) instead of piling up from one iteration to the next, and the values are
    those with the kept gradient."""
    from geoopt_quotient.sharpness import buffers

    most = []
    output = buffers.AutoPGDVectors.output

    def counted(self):
        most.append(len(self.free))
        return output(self)

    monkeypatch.setattr(buffers.AutoPGDVectors, "output", counted)
    values = {}
    for keep in (True, False):
        torch.manual_seed(0)
        model = bert_and_batch(torch.bfloat16)[0]
        most.clear()
        with warnings.catch_warnings():  # the bfloat16 model's resolution, warned of
            warnings.simplefilter("ignore", UserWarning)
            values[keep] = call_for(measure)(
                model,
                loss_fn,
                [BATCH],
                rho=0.05,
                iters=12,
                progress=False,
                keep_best_gradient=keep,
            )
    assert values[False].value == values[True].value
    assert max(most) <= 2  # freed since the evaluation: the gradient, an old best
