"""An Auto-PGD iteration on the flat ball dispatches about the operators of one forward
and backward pass: the ball's update costs a constant number of operators, whatever the
number of parameter tensors (counted with a ``TorchDispatchMode``, on the CPU, with the
blocks capped as on an accelerator: by default the CPU keeps cache-sized blocks, whose
number grows with the model's size, because there a block costs microseconds of dispatch
and saves passes over memory)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import geoopt_quotient as gq
from geoopt_quotient.manifolds import _linalg
from geoopt_quotient.sharpness import apgd

pytestmark = [
    pytest.mark.filterwarnings("ignore::geoopt_quotient.ZeroSharpnessWarning"),
    pytest.mark.usefixtures("single_thread", "blocks_as_on_an_accelerator"),
]


@pytest.fixture
def blocks_as_on_an_accelerator(monkeypatch):
    monkeypatch.setattr(_linalg, "CAP_ON_CPU", True)


class OperatorCount(TorchDispatchMode):
    """Counts the operators dispatched while active."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.by_name: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.by_name[str(func)] += 1
        return func(*args, **(kwargs or {}))


def bert(layers: int, width: int = 256):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=100,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * width,
        max_position_embeddings=32,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    batch = (torch.randint(0, 100, (2, 8)), torch.randint(0, 3, (2,)))

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(input_ids=b[0]).logits, b[1])

    return model, batch, loss_fn


def llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 100, (2, 8))
    return model, ids, lambda m, b: m(input_ids=b, labels=b).loss


def forward_backward_operators(model, batch, loss_fn) -> int:
    with OperatorCount() as counter:
        loss_fn(model, batch).backward()
    model.zero_grad(set_to_none=True)
    return counter.count


def counted_call(model, batch, loss_fn, measure: str, iters: int, plan=None) -> OperatorCount:
    """The operators of one sharpness call of ``measure`` (geodesic: with ``plan``, else
    discovering its own)."""
    options = dict(rho=0.01, iters=iters, progress=False)
    with OperatorCount() as counter:
        if measure == "adaptive":
            gq.adaptive_sharpness(model, loss_fn, [batch], **options)
        else:
            gq.geodesic_sharpness(
                model, loss_fn, [batch], metric=measure, symmetries=plan, **options
            )
    return counter


def operators_per_iteration(model, batch, loss_fn, measure: str) -> float:
    """Operators of one more Auto-PGD iteration: the difference of two runs."""
    runs = [counted_call(model, batch, loss_fn, measure, iters).count for iters in (6, 3)]
    return (runs[0] - runs[1]) / 3


@pytest.mark.parametrize("build", [bert, llama], ids=["bert", "llama"])
def test_an_adaptive_iteration_costs_about_one_forward_and_backward_pass(build):
    model, batch, loss_fn = build(4)
    passes = forward_backward_operators(model, batch, loss_fn)
    iteration = operators_per_iteration(model, batch, loss_fn, "adaptive")
    assert passes < iteration <= 1.25 * passes


#: Operators per geodesic iteration over those of a forward and backward pass.
GEODESIC_RATIO = 1.5


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("build", [bert, llama], ids=["bert", "llama"])
def test_a_geodesic_iteration_costs_at_most_one_and_a_half_passes(build, metric):
    model, batch, loss_fn = build(4)
    passes = forward_backward_operators(model, batch, loss_fn)
    iteration = operators_per_iteration(model, batch, loss_fn, metric)
    assert passes < iteration <= GEODESIC_RATIO * passes


@pytest.mark.parametrize(
    "build, measure",
    [(bert, "adaptive"), (bert, "inv"), (bert, "mix"), (llama, "inv")],
    ids=["bert-adaptive", "bert-inv", "bert-mix", "llama-inv"],
)
def test_the_operators_beyond_the_pass_do_not_grow_with_depth(build, measure):
    """One more iteration's operators beyond a forward and backward pass grow by at most
    a quarter of their number from 4 to 12 layers. They may be fewer than none: the
    ball's pass accumulates no ``.grad`` per parameter, and one more iteration (runs of 6
    and 3) includes restarts to the best iterate, whose Gram matrix the update reads
    from that iterate's conversion where the previous iterate is the best."""
    extra = {}
    for layers in (4, 12):
        model, batch, loss_fn = build(layers)
        passes = forward_backward_operators(model, batch, loss_fn)
        iteration = operators_per_iteration(model, batch, loss_fn, measure)
        assert iteration > 0.9 * passes  # a forward and backward pass each
        extra[layers] = iteration - passes
    assert extra[12] <= extra[4] + 0.25 * abs(extra[4])


#: Linear-algebra operators (factorisations, inverses and solves), by their ATen names.
LINALG = frozenset(
    "linalg_qr linalg_eigh _linalg_eigh linalg_cholesky_ex cholesky_inverse cholesky_solve "
    "linalg_solve_triangular _linalg_solve_ex linalg_lu_factor_ex linalg_lu_solve "
    "linalg_inv_ex geqrf linalg_householder_product _linalg_svd".split()
)


def linalg_operators(counter: OperatorCount) -> int:
    return sum(n for name, n in counter.by_name.items() if name.split(".")[1] in LINALG)


def fixed_operators(model, batch, loss_fn, measure: str, plan) -> tuple:
    """``(operators, linear-algebra operators)`` of one call that no Auto-PGD iteration
    accounts for: the checks, the layout, the factorisations at the base point, the
    final evaluation and the estimate, ``2 c(2) - c(4)`` of calls of 2 and 4 iterations.
    Geodesic measures take their plan, bound afresh for each call (discovery is not
    part of the count, but the layout is: a call on a plan bound before derives it)."""
    short, long = (
        counted_call(model, batch, loss_fn, measure, n, plan and plan.bind(model)) for n in (2, 4)
    )
    return 2 * short.count - long.count, 2 * linalg_operators(short) - linalg_operators(long)


#: The fixed operators of a call may grow with depth by at most the operators of the
#: model's forward and backward pass (per layer of a BERT of width 64, counted from 2 to 8 layers:
#: 126.5 for adaptive, 113.5 for inv and 114 for mix against the pass's 134; 141.5 and 142
#: for inv and mix while the groups' points and positions took three and two views per
#: box, and 175 while they took a copy, an ``arange`` and slices per layer).
FIXED_PER_PASS = 1.0
#: ... and beyond that by at most this many operators from 2 to 8 layers (a count that
#: does not depend on depth may still differ by a few: restarts, the step rule's checks).
FIXED_SLACK = 8


def narrow_bert(layers: int):
    return bert(layers, width=64)


@pytest.mark.parametrize("measure", ["adaptive", "inv", "mix"])
@pytest.mark.parametrize("build", [narrow_bert, llama], ids=["bert", "llama"])
def test_the_fixed_work_of_a_call_grows_with_depth_as_the_pass_at_most(build, measure, monkeypatch):
    """What a call does once (checks of the weights and the base point, the layout, the
    factorisations at the base point, the final evaluation, the path gap's estimate) is
    paid in full by a short call (a training callback's few iterations): its operators
    grow with the number of layers as the forward and backward pass at most, and its
    linear-algebra operators not at all (the layers' matrices are factorised in batches).
    The step is never halved here: a restart to the best iterate is an iteration's work,
    and calls of 2 and 4 iterations restart at different iterations. (The Llama's
    grouped query-key heads make several boxes per weight and layer: 138, 143.5 and
    141.5 operators per layer for adaptive, inv and mix against the pass's 219.)"""
    monkeypatch.setattr(apgd.StepRule, "halves_after", lambda *args: False)
    beyond, linalg = {}, {}
    for layers in (2, 4, 8):
        model, batch, loss_fn = build(layers)
        plan = None
        if measure != "adaptive":
            plan = gq.find_symmetries(model, metric=measure)
        passes = forward_backward_operators(model, batch, loss_fn)
        fixed, linalg[layers] = fixed_operators(model, batch, loss_fn, measure, plan)
        beyond[layers] = fixed - FIXED_PER_PASS * passes
    assert beyond[4] <= beyond[2] + FIXED_SLACK and beyond[8] <= beyond[2] + FIXED_SLACK, beyond
    assert linalg[2] == linalg[4] == linalg[8], linalg
    assert (linalg[2] > 0) == (measure != "adaptive")  # the base point's factorisations


#: Operators of one ``geodesic_sharpness`` call's path gap on the 4-layer BERT (the exact
#: geodesic at the maximiser, its error control and one forward pass): 996 (inv) and 1006
#: (mix) counted, 1,040 and 1,042 before the span's coordinates came from a Cholesky factor
#: and the error control's norms were summed together; the bound leaves 5% over the larger.
PATH_GAP_OPERATORS = 1056
#: ... and its host synchronisations: 7 counted (11 before).
PATH_GAP_SYNCS = 7


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_the_path_gap_dispatches_a_bounded_number_of_operators(metric, monkeypatch):
    from geoopt_quotient.sharpness import engine

    model, batch, loss_fn = bert(4)
    counters, original = [], engine.path_gap

    def counted(*args):
        with OperatorCount() as counter:
            out = original(*args)
        counters.append(counter)
        return out

    monkeypatch.setattr(engine, "path_gap", counted)
    result = gq.geodesic_sharpness(
        model, loss_fn, [batch], metric=metric, rho=0.01, iters=3, progress=False, path_report=True
    )
    ((gap, _),) = zip(result.path_gaps, result.exact_losses)
    (counter,) = counters
    assert 0 < gap < 1e-3  # an integrated geodesic, not a breakdown (NaN)
    passes = forward_backward_operators(model, batch, loss_fn)
    assert passes / 2 < counter.count <= PATH_GAP_OPERATORS  # it includes a forward pass
    assert counter.by_name["aten._local_scalar_dense.default"] <= PATH_GAP_SYNCS
    # no factorisation that a GPU runs one matrix at a time (a batched QR of more than
    # 256 rows loops there)
    assert not [name for name in counter.by_name if "qr" in name or "geqrf" in name]


def main() -> None:
    """Print the ratios the tests bound (``python tests/test_operator_count.py``): per
    model, measure and depth, operators per iteration over those of a forward and
    backward pass, and the operators beyond it."""
    torch.set_num_threads(1)
    _linalg.CAP_ON_CPU = True
    for build in (bert, llama):
        for layers in (4, 12):
            model, batch, loss_fn = build(layers)
            passes = forward_backward_operators(model, batch, loss_fn)
            for measure in ("adaptive", "inv", "mix"):
                iteration = operators_per_iteration(model, batch, loss_fn, measure)
                print(
                    f"{build.__name__:6} {layers:2} layers {measure:8} "
                    f"{iteration / passes:.3f} passes ({iteration - passes:.0f} beyond the pass)"
                )


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    main()
