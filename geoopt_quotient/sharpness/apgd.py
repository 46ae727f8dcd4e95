r"""Worst- and average-case objectives over a metric ball in a tangent space.

Everything here is generic: a list of (base point, geoopt manifold) groups, a radius
:math:`\rho` and a function of the perturbed points. The feasible set is the horizontal
subspace intersected with the joint metric ball
:math:`|\xi|^2 = \sum_g |\xi_g|^2_{x_g} \le \rho^2` at the *fixed* base point; projecting
onto it is the horizontal projection followed by radial scaling (exact, because the
projection is metric-orthogonal and the ball is centred at 0).

The worst case is found with Auto-PGD (Croce & Hein, 2020), as in Algorithm 1 of
"Hide & Seek" (da Silva, Dangel & Oore, 2025).
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from geoopt.manifolds.base import Manifold

from .._checks import PATHS, check_choice, check_positive_float, check_positive_int
from ..errors import GeooptQuotientError
from ..manifolds._linalg import block_length, capped, compute_dtype
from ..manifolds.adaptive import GRAM_BLOCK, GradientSweep
from ..manifolds.tangent import TangentSpace, tangent_space
from . import buffers
from .buffers import AutoPGDVectors
from .functional import check_depends_on_perturbation, check_loss_value
from .precision import AutocastState

__all__ = [
    "PATHS",
    "BallGroup",
    "BallMaxResult",
    "NonFiniteError",
    "apgd_checkpoints",
    "average_in_ball",
    "combine_",
    "maximize_in_ball",
]

Path = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Objective = Callable[[List[torch.Tensor]], torch.Tensor]


#: ``keep_best_gradient=None`` keeps the best gradient up to this size (1 GiB, about 268M
#: float32 entries: BERT-base, ViT-B, GPT-2 medium): one more vector of the ball (4 bytes
#: per float32 parameter: 24 instead of 20 for adaptive sharpness), against one forward and
#: backward pass saved per Auto-PGD restart (about one in four iterations).
KEEP_GRADIENT_MAX_BYTES = 1 << 30

#: The dtypes ``state_dtype`` may name (:func:`state_dtype_for`). float16 is not one:
#: its range would flush small perturbation entries (under 6.1e-5) to subnormals.
STATE_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


def check_state_dtype(state_dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``state_dtype`` as a dtype of :data:`STATE_DTYPES` (a name such as ``"bfloat16"``
    is accepted), or ``None``; a ValueError saying what to pass otherwise."""
    if state_dtype is None:
        return None
    dtype = getattr(torch, state_dtype, None) if isinstance(state_dtype, str) else state_dtype
    if dtype not in STATE_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in STATE_DTYPES)
        hint = (
            " (float16's range would flush small perturbation entries to subnormals: use "
            "bfloat16, or the default float32)"
            if dtype is torch.float16
            else ""
        )
        raise ValueError(f"`state_dtype` must be None or one of {names}; got {state_dtype!r}{hint}")
    return dtype


def state_dtype_for(dtype: torch.dtype, state_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype in which the ball stores the vectors of a point of ``dtype``
    (iterates and gradients) for a requested ``state_dtype`` (:func:`check_state_dtype`).

    ``None``: :func:`~geoopt_quotient.manifolds._linalg.compute_dtype` of the point,
    float32 or better, the precision the ball computes in. ``torch.bfloat16`` stores the
    state of bfloat16 points in bfloat16 (their gradients arrive in bfloat16); points of
    other dtypes keep it in their compute dtype. A dtype more precise than the compute
    dtype is an error: the arithmetic would not keep that precision.
    """
    compute = compute_dtype(dtype)
    if state_dtype is None or state_dtype == compute:
        return compute
    if torch.finfo(state_dtype).eps < torch.finfo(compute).eps:
        raise ValueError(
            f"state_dtype={state_dtype} is more precise than the {compute} arithmetic of "
            f"the ball at {dtype} parameters; convert the model (e.g. model.double()) or "
            f"leave state_dtype=None"
        )
    return state_dtype if state_dtype == dtype else compute


def state_vector_bytes(points: Sequence[torch.Tensor], state_dtype: torch.dtype | None) -> int:
    """Memory of one vector of the ball at ``points`` (an iterate or a gradient), stored
    as :func:`state_dtype_for` says."""
    return sum(x.numel() * state_dtype_for(x.dtype, state_dtype).itemsize for x in points)


class NonFiniteError(GeooptQuotientError, FloatingPointError):
    """The objective or its gradient became NaN/Inf during the maximisation."""


@dataclass(frozen=True)
class BallGroup:
    r"""A base point, the manifold whose metric and horizontal space define the ball, and
    optionally a path ``(x, xi) -> perturbed point`` overriding the global ``path``.

    Parameters
    ----------
    point : torch.Tensor
        The base point :math:`x` (floating point), fixed during the maximisation.
    manifold : geoopt.manifolds.Manifold
        Its geometry: the metric that measures :math:`|\xi|_x`, the horizontal
        projection ``proju`` and the paths ``retr`` / ``expmap``.
    path : callable or None
        ``path(x, xi) -> perturbed point`` for this group, overriding the ``path``
        argument of :func:`maximize_in_ball` (default ``None``: use it).
    """

    point: torch.Tensor
    manifold: Manifold
    path: Path | None = None


@dataclass
class BallMaxResult:
    """Outcome of :func:`maximize_in_ball`.

    Attributes
    ----------
    value : float
        Best objective value found (at ``xi``).
    xi : list of torch.Tensor
        Best perturbation, one tangent vector per group, in the ball.
    initial_value : float
        Objective at the initial perturbation (the unperturbed value when ``init="zero"``).
    history : list of float
        Objective at every iterate, the initial one first.
    step_sizes : list of float
        Step size used at every iteration.
    evaluations : int
        Objective evaluations (forward passes): one per iterate, plus one per restart
        from an earlier best iterate, whose gradient is recomputed rather than kept.
    gradients : int
        Of those, the evaluations that were differentiated (backward passes): all but
        the last iterate's.
    initial_gradient : list of torch.Tensor or None
        With ``keep_initial_gradient``: the Riemannian gradient of the objective at the
        initial iterate (at the base point for ``init="zero"``), one horizontal vector
        per group; else ``None``.
    spaces : list of TangentSpace or None
        The tangent spaces at the groups' points, sharing the factorisations the search
        made there (:meth:`~geoopt_quotient.manifolds.tangent.TangentSpace.at_same_point`):
        further computation at the same points (the path gap's estimate) need not
        factorise them again.
    """

    value: float
    xi: List[torch.Tensor]
    initial_value: float
    history: List[float] = field(default_factory=list)
    step_sizes: List[float] = field(default_factory=list)
    evaluations: int = 0
    gradients: int = 0
    initial_gradient: Optional[List[torch.Tensor]] = None
    spaces: Optional[List[TangentSpace]] = field(default=None, repr=False, compare=False)


def path_function(manifold: Manifold, path: str) -> Path:
    """The map from a tangent vector to a perturbed point for a path name."""
    if path == "exact":
        return manifold.expmap
    if path == "second_order":
        return manifold.retr
    return straight_path


def straight_path(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    r"""The straight path :math:`x + u` (``path="straight"``, and ``"second_order"`` where
    the retraction is the straight line). The evaluations recognise it by identity
    (``path is straight_path``) and write :math:`x + \xi` into a buffer of their own
    (:func:`explicit_path`)."""
    return x + u


def random_tangent(
    manifold: Manifold, x: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A standard Gaussian tangent vector in the manifold's metric (see :class:`TangentSpace`)."""
    return tangent_space(manifold, x).random(generator)


def apgd_checkpoints(iters: int) -> List[int]:
    r"""Auto-PGD checkpoints :math:`w_j = \lceil p_j N \rceil`,
    :math:`p_0 = 0, p_1 = 0.22, p_{j+1} = p_j + \max(p_j - p_{j-1} - 0.03, 0.06)`."""
    p = [0.0, 0.22]
    while p[-1] < 1:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
    marks = sorted({math.ceil(q * iters - 1e-9) for q in p if q <= 1})
    return [w for w in marks if 0 < w <= iters]


class TangentBall:
    """The feasible set and its geometry at fixed base points: the ball of
    :func:`maximize_in_ball` and :func:`average_in_ball`, made by :func:`prepare_ball`.

    Its vectors are stored in :attr:`dtypes`: by default :func:`compute_dtype` of their
    points (float32 for a bfloat16 or float16 model), so that Auto-PGD's iterates keep
    full precision and only the perturbed point is rounded to the model's dtype; with
    ``state_dtype=torch.bfloat16`` those of bfloat16 points in bfloat16
    (:func:`state_dtype_for`). The arithmetic is in :attr:`compute_dtypes` either way:
    the stored vectors are read into it and each result rounded once when written, which
    the radial scaling leaves room for (:class:`NormError`).
    """

    def __init__(
        self,
        groups: Sequence[BallGroup],
        rho: float,
        spaces: Sequence[TangentSpace] | None = None,
        state_dtype: torch.dtype | None = None,
    ):
        self.points = [g.point.detach() for g in groups]
        if spaces is None:
            spaces = [tangent_space(g.manifold, x) for g, x in zip(groups, self.points)]
        #: The tangent spaces at the points: given (e.g. another ball's
        #: :meth:`~geoopt_quotient.manifolds.tangent.TangentSpace.at_same_point`), or made
        self.spaces = list(spaces)
        #: Per group, the dtype its vectors are stored in, and the one they are computed in
        self.dtypes = [state_dtype_for(x.dtype, state_dtype) for x in self.points]
        self.compute_dtypes = [compute_dtype(x.dtype) for x in self.points]
        #: Whether some vectors are stored in a coarser dtype than they are computed in
        self.rounded = self.dtypes != self.compute_dtypes
        #: Per group, whether its vectors get buffers of their own
        #: (:func:`~geoopt_quotient.sharpness.buffers.joint_buffer`)
        self.apart = [space.own_buffer for space in self.spaces]
        self.rho = rho
        #: The rounding of norms computed from Gram matrices and of combinations, which
        #: radial scaling leaves room for (:class:`NormError`)
        self.norm_error = NormError.of(
            self.compute_dtypes, max(x.numel() for x in self.points), self.dtypes
        )
        self._perturbed: List[torch.Tensor] | None = None
        #: ``(xi, per group: whether x + xi is in its perturbed-point buffer)``, as the
        #: last update left it (:func:`apgd_update`); taken by the next evaluation.
        self.written: Tuple[List[torch.Tensor], List[bool]] | None = None
        #: Sums a local inner product or Gram matrix over the processes that hold the
        #: other pieces of the ball (a sharded model's); ``None``: the ball is all here.
        self.reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        #: ``(G, xi, xi_prev, run)``: the Gram matrix of the last update's output and
        #: input iterates, derived from the update's (:func:`_iterates_gram`), which was
        #: the ``run``-th in a row with derived entries; taken by the next Riemannian
        #: gradient (:meth:`riemannian_gradient_gram_`).
        self.iterates: Tuple[torch.Tensor, List, Sequence, int] | None = None
        #: The zero first iterate (:meth:`start_at_zero`): per tensor, a weak reference
        #: (it must not keep a freed iterate's buffer alive) and its version then
        self.zero: List[Tuple[weakref.ref, int]] | None = None
        #: How many Gram matrices in a row, up to the last one made, had iterate
        #: entries derived rather than summed over the entries (0: summed).
        self.derived_run = 0
        #: ``(xi, xi_prev, kind)``: the gradient of the next evaluation goes to
        #: :meth:`riemannian_gradient_gram_` with these iterates, which sums the ``kind``
        #: of Gram entries (:meth:`expect_gradient`); ``None``: not known.
        self.pending: Tuple[Sequence, Sequence, str] | None = None
        #: Per group, the sweep that converts the last evaluation's gradient as it
        #: arrives (:meth:`gradient_sweep`), taken by the Riemannian gradient.
        self.sweeps: Dict[int, GradientSweep] = {}

    def vector_bytes(self) -> int:
        """Memory of one vector of the ball."""
        return sum(x.numel() * d.itemsize for x, d in zip(self.points, self.dtypes))

    def zeros(self) -> List[torch.Tensor]:
        """The zero vector, in one :func:`~geoopt_quotient.sharpness.buffers.joint_buffer`."""
        return buffers.joint_buffer(self.points, self.dtypes, zero=True, apart=self.apart)

    def start_at_zero(self, xi: List[torch.Tensor]) -> None:
        r"""Take ``xi`` (:meth:`zeros`) as Auto-PGD's first iterate, also its previous one.
        While it is unchanged (:meth:`is_zero`), its evaluation writes the base point as
        the perturbed point and takes the gradient there as it is (a path's point at
        :math:`\xi = 0` is :math:`x` and its differential the identity:
        :func:`explicit_path`), and the tangent spaces know their products with it
        (:meth:`~geoopt_quotient.manifolds.tangent.TangentSpace.known_zero`). The Gram
        entries of these iterates are known exactly, all zero, so that the first
        Riemannian gradient sums its own column alone (:meth:`riemannian_gradient_gram_`),
        not the metric's products of the zero iterates; none of its entries is derived
        from rounded ones, so it starts no run of derived matrices. Not where every
        matrix is summed whole (:data:`MAX_DERIVED_RUN` 0) or the stored vectors are
        rounded (:attr:`rounded`), as :meth:`_gram_kind` decides for derived entries."""
        self.zero = [(weakref.ref(t), t._version) for t in xi]
        for space, u in zip(self.spaces, xi):
            space.known_zero(u)
        if MAX_DERIVED_RUN > 0 and not self.rounded:
            zero = torch.zeros(2, 2, dtype=torch.float64, device=self.points[0].device)
            self.iterates = (zero, xi, xi, -1)

    def is_zero(self, xi: Sequence[torch.Tensor]) -> bool:
        """Whether ``xi`` is the zero vector of :meth:`start_at_zero`, unchanged since."""
        known = self.zero
        return (
            known is not None
            and len(known) == len(xi)
            and all(ref() is t and t._version == v for (ref, v), t in zip(known, xi))
        )

    def inner(self, u: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> torch.Tensor:
        return self._reduced(sum(space.inner(a, b) for space, a, b in zip(self.spaces, u, v)))

    def _reduced(self, local: torch.Tensor) -> torch.Tensor:
        return local if self.reduce_sum is None else self.reduce_sum(local)

    def norm(self, u: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.inner(u, u).clamp_min(0).sqrt()

    def project(self, u: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Metric projection onto the feasible set: horizontal part, then radial scaling."""
        return self.clip([space.proju(a) for space, a in zip(self.spaces, u)])

    def clip(self, horizontal: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        r"""Radial scaling into the ball, for vectors already horizontal: by
        :math:`\min(1, \rho / \bar n)` with :math:`\bar n` the computed norm's bound on
        the norm of the scaled vector as it is rounded (:meth:`NormError.bound`), so that
        the result lies in the ball when its norm is recomputed from its entries.

        Auto-PGD's iterates are linear combinations of horizontal vectors at the fixed
        base point, so they stay horizontal and need only this part of the projection.
        """
        norm = self.norm(horizontal).to(torch.float64)
        scale = _clip_scale(self.norm_error.bound(norm * norm, norm), self.rho)
        return [h * scale.to(h.dtype) for h in horizontal]

    def gram(self, vectors: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        r"""The matrix :math:`G_{ij} = \langle u_i, u_j \rangle` of ``k`` vectors of the ball,
        summed over the groups, in float64 (``(k, k)``, on the first point's device)."""
        return self._summed(
            [space.gram([u[i] for u in vectors]) for i, space in enumerate(self.spaces)]
        )

    def _summed(self, per_group: Sequence[torch.Tensor]) -> torch.Tensor:
        """The groups' Gram matrices summed on the first point's device, and over the
        processes that hold other pieces of the ball."""
        device = self.points[0].device
        return self._reduced(torch.stack([g.to(device) for g in per_group]).sum(0))

    def _gram_kind(self, xi: Sequence[torch.Tensor], xi_prev: Sequence[torch.Tensor]) -> str:
        """Which Gram entries :meth:`riemannian_gradient_gram_` sums for ``(xi, xi_prev)``
        as :attr:`iterates` stand: ``"column"`` (the gradient's, the iterates' derived)
        or ``"gram"`` (all)."""
        iterates = self.iterates
        usable = iterates is not None and iterates[1] is xi and iterates[2] is xi_prev
        usable = usable and not self.rounded  # derived entries would miss the rounding
        return "column" if usable and iterates[3] < MAX_DERIVED_RUN else "gram"

    def expect_gradient(self, xi: Sequence[torch.Tensor], xi_prev: Sequence[torch.Tensor]) -> None:
        """Announce that the next evaluation's gradient goes to
        :meth:`riemannian_gradient_gram_` with ``(xi, xi_prev)``, so that the evaluation
        can convert it as it arrives (:meth:`gradient_sweep`)."""
        self.pending = (xi, xi_prev, self._gram_kind(xi, xi_prev))

    def gradient_sweep(self, index: int, grad: torch.Tensor) -> GradientSweep | None:
        r"""The sweep of :meth:`riemannian_gradient_gram_` over group ``index``'s
        gradient ``grad`` (to be written), for the evaluation to run block by block as
        the backward pass writes ``grad`` (each block while it is in cache, instead of a
        read of the whole gradient after it is written); ``None`` where no gradient is
        :meth:`expect_gradient`-ed or the group's space has no such sweep. Kept in
        :attr:`sweeps` until the Riemannian gradient takes it."""
        if self.pending is None:
            return None
        xi, xi_prev, kind = self.pending
        sweep = self.spaces[index].gradient_sweep((xi[index], grad, xi_prev[index]), 1, kind)
        if sweep is not None:
            self.sweeps[index] = sweep
        return sweep

    def _swept(
        self, index: int, vectors: Tuple[torch.Tensor, ...], kind: str | None
    ) -> torch.Tensor | None:
        """Where group ``index``'s gradient ``vectors[1]`` has a sweep: the rest of it
        done (the gradient then Riemannian), and the Gram entries ``kind`` asks for
        (``"gram"``: the matrix of ``vectors``, ``"column"``: its gradient's column,
        ``None``: none, an empty tensor); ``None`` where it has no sweep (the gradient
        is as the backward pass left it)."""
        sweep = self.sweeps.pop(index, None)
        if sweep is None or sweep.vectors[1] is not vectors[1]:
            return None
        if kind is not None and sweep.matches(vectors, 1, kind):
            return sweep.finish()
        sweep.finish()  # not the entries asked for: those of the Riemannian gradient
        if kind is None:
            return vectors[1].new_empty(0)
        gram = self.spaces[index].gram(vectors).to(torch.float64)
        return gram if kind == "gram" else gram[:, 1]

    def riemannian_gradient_gram_(
        self,
        egrads: List[torch.Tensor],
        xi: Sequence[torch.Tensor],
        xi_prev: Sequence[torch.Tensor],
    ) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """Replace the Euclidean gradients in ``egrads`` by Riemannian ones (horizontal for
        the quotients), group by group, written into their buffers where the manifold can
        (the buffers must belong to the caller alone), and the :meth:`gram` of
        ``(xi, rgrads, xi_prev)`` that the next Auto-PGD update reads (the same values),
        in one sweep over each group's vectors where its manifold can (the adaptive
        metric's). Returns ``(egrads, gram)``.

        Where the last update made ``xi`` from ``xi_prev`` (:attr:`iterates`), the
        entries of the iterates alone are derived from that update's Gram matrix
        (:func:`_iterates_gram`) and only the gradient's column is summed over the
        entries: for the adaptive metric 7 operations per block instead of 13. At most
        :data:`MAX_DERIVED_RUN` of them in a row; then the whole matrix is summed again,
        so that the rounding of the derived entries does not accumulate."""
        kind = self._gram_kind(xi, xi_prev)
        iterates, self.iterates = self.iterates, None
        if kind == "gram":
            self.derived_run = 0
            grams = []
            for i, space in enumerate(self.spaces):
                vectors = (xi[i], egrads[i], xi_prev[i])
                gram = self._swept(i, vectors, kind)
                if gram is None:
                    egrads[i], gram = space.egrad2rgrad_gram_(vectors, 1)
                grams.append(gram)
            return egrads, self._summed(grams)
        self.derived_run = iterates[3] + 1
        columns = []
        for i, space in enumerate(self.spaces):
            vectors = (xi[i], egrads[i], xi_prev[i])
            column = self._swept(i, vectors, kind)
            if column is None:
                egrads[i], column = space.egrad2rgrad_column_(vectors, 1)
            columns.append(column)
        return egrads, _with_column(iterates[0], self._summed(columns))

    def riemannian_gradients_(self, egrads: List[torch.Tensor]) -> List[torch.Tensor]:
        """The Riemannian gradients of ``egrads``, written into their buffers where the
        manifold can (the buffers must belong to the caller alone)."""
        return [
            g if self._swept(i, (g, g, g), None) is not None else space.egrad2rgrad_(g)
            for i, (space, g) in enumerate(zip(self.spaces, egrads))
        ]

    def perturbed_buffer(self, index: int) -> torch.Tensor:
        """A buffer of the ``index``-th point's shape and dtype for a perturbed point, the
        same at every call: the straight paths write into it instead of allocating anew."""
        if self._perturbed is None:
            self._perturbed = buffers.joint_buffer(self.points)
        return self._perturbed[index]

    def take_written(self, xi: Sequence[torch.Tensor]) -> List[bool]:
        """Per group, whether its perturbed-point buffer holds :math:`x + \\xi` for this
        ``xi`` (written by the update that made it); forgotten once asked, since the
        evaluation that asks writes the buffers anew."""
        written, self.written = self.written, None
        if written is None or written[0] is not xi:
            return [False] * len(self.points)
        return written[1]

    def random(self, generator: torch.Generator, scale: float) -> List[torch.Tensor]:
        """A Gaussian vector of the ball times ``scale``, in the compute dtypes."""
        return [
            space.random(generator).to(dtype) * scale
            for space, dtype in zip(self.spaces, self.compute_dtypes)
        ]


def prepare_ball(
    groups: Sequence[Union[BallGroup, Tuple[torch.Tensor, Manifold]]],
    rho: float,
    path: str,
    spaces: Sequence[TangentSpace] | None = None,
    state_dtype: torch.dtype | str | None = None,
) -> Tuple[TangentBall, List[Path]]:
    """The ball of radius ``rho`` at the groups' points, and each group's path.

    Checks the arguments as :func:`maximize_in_ball` documents them (``groups`` as
    :class:`BallGroup` or ``(point, manifold)`` pairs, ``rho > 0``, ``path`` one of
    :data:`PATHS`) and resolves each group's path: its own ``path``, else the named one
    at the ball's tangent space (:func:`straight_path` where the retraction is the
    straight line, so that the evaluation writes the point into a buffer). ``spaces``:
    the tangent spaces at the groups' points where already made (:class:`TangentBall`);
    ``state_dtype``: as :func:`maximize_in_ball` takes it.
    """
    groups = [g if isinstance(g, BallGroup) else BallGroup(*g) for g in groups]
    if not groups:
        raise ValueError("`groups` is empty: nothing to perturb")
    rho = check_positive_float(rho, "rho")
    check_choice(path, PATHS, "path")
    for g in groups:
        if not g.point.is_floating_point():
            raise TypeError(
                f"base points must be floating-point tensors, got {g.point.dtype}; "
                "convert the model with .float() or .double()"
            )
    ball = TangentBall(groups, float(rho), spaces, check_state_dtype(state_dtype))
    paths = [g.path or _space_path(space, path) for g, space in zip(groups, ball.spaces)]
    return ball, paths


def _space_path(space, path: str) -> Path:
    """The path at the ball's fixed base point, reusing its cached tangent space."""
    if path == "exact":
        return lambda x, u: space.expmap(u)
    if path == "second_order" and not space.straight_retraction:
        return _Retraction(space)
    return straight_path


class _Retraction:
    """The retraction of a tangent space, as a path; :func:`evaluate_in_ball` uses the space's
    explicit pullback (:meth:`~geoopt_quotient.manifolds.tangent.TangentSpace.retr_vjp`)
    where it has one."""

    def __init__(self, space):
        self.space = space

    def __call__(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.space.retr(u)


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    """A new generator on ``device`` seeded with ``seed``: the random starts and samples of
    this module and the Hessian estimators draw from it, on the model's device."""
    return torch.Generator(device=device).manual_seed(seed)


def evaluate_in_ball(
    ball: TangentBall,
    paths: Sequence[Path],
    objective: Objective,
    xi: Sequence[torch.Tensor],
    grad: bool,
    autocast: AutocastState,
    recycled: List[List[torch.Tensor]] | None = None,
    own_vector: bool = False,
) -> Tuple[torch.Tensor, List[torch.Tensor] | None]:
    r"""The objective at the perturbed points, and its gradient with respect to ``xi``.

    The paths run in full precision, the objective under the caller's ``autocast``. A
    straight path :math:`x + \xi` in the point's own dtype is written into the ball's
    :meth:`~TangentBall.perturbed_buffer` and differentiated there (its gradient is that of
    :math:`\xi`, bit for bit); so is a retraction with an explicit pullback
    (:func:`explicit_path`), whose pullback then maps that gradient to one with respect
    to :math:`\xi`, in place. The gradients are the leaves' ``.grad``, which autograd
    copies where it cannot hand over a buffer of its own: they belong to the caller.

    An objective with an ``evaluate_ball`` method (a
    :class:`~geoopt_quotient.sharpness.layout.BallLayout`'s) evaluates itself, through
    the layout's flat buffers. ``recycled`` holds vectors of the ball that the caller no
    longer needs; such an objective may take one (pop it) and write the gradient into it
    instead of into a new buffer (one of a large model's size is faulted in page by page:
    in system time, several copies' worth); other evaluations release them all before
    the objective runs (empty the list), since autograd allocates the gradient anyway.
    ``own_vector``: such an objective, if it has an ``owns(vector)`` method that tells
    it, may instead return the gradient in a vector of its own, which its next
    evaluation writes over; the caller reads it before then and never writes into it.
    """
    custom = getattr(objective, "evaluate_ball", None)
    if custom is not None:
        args = (ball, paths, xi, grad, autocast, recycled)
        if own_vector and callable(getattr(objective, "owns", None)):
            return custom(*args, own_vector=True)
        return custom(*args)
    if recycled:
        recycled.clear()  # freed before the objective runs
    leaves, moved, pullbacks = [], [], []
    written, zero = ball.take_written(xi), ball.is_zero(xi)
    for index, (p, x, v) in enumerate(zip(paths, ball.points, xi)):
        buffer = functools.partial(ball.perturbed_buffer, index)
        point, pullback = explicit_path(p, x, v, buffer, written[index], zero)
        if point is not None:
            leaf = point.detach().requires_grad_(grad)
            leaves.append(leaf)
            moved.append(leaf)
        else:
            leaves.append(v.detach().requires_grad_(grad))
            moved.append(None)
        pullbacks.append(pullback)
    with torch.enable_grad() if grad else torch.no_grad():
        moved = [
            m if m is not None else p(x, v).to(x.dtype)
            for m, p, x, v in zip(moved, paths, ball.points, leaves)
        ]
        with autocast.restored():
            value = as_scalar(objective(moved))
        if not grad:
            return value.detach().reshape(()), None
        check_depends_on_perturbation(value, grads_found=True)
        torch.autograd.backward(value, inputs=leaves)
    grads = [leaf.grad for leaf in leaves]
    check_depends_on_perturbation(value, any(g is not None for g in grads))
    grads = [
        torch.zeros_like(v) if g is None else g if pullback is None else pullback(g)
        for v, g, pullback in zip(xi, grads, pullbacks)
    ]
    return value.detach().reshape(()), grads


def explicit_path(
    path: Path,
    x: torch.Tensor,
    v: torch.Tensor,
    buffer: Callable[[], torch.Tensor],
    written: bool = False,
    zero: bool = False,
) -> Tuple[torch.Tensor | None, Callable[[torch.Tensor], torch.Tensor] | None]:
    r"""The perturbed point written into ``buffer()``, and the pullback of the gradient
    there to one with respect to ``v`` (``None``: the identity), for the paths that
    have them without autograd: the straight line and explicit retractions. ``(None,
    None)`` for the others. ``written``: the straight line's point is in ``buffer()``
    already (:meth:`TangentBall.take_written`). ``zero``: ``v`` is zero
    (:meth:`TangentBall.is_zero`), where either path's point is ``x`` and its
    differential the identity (a retraction's :math:`R_x(0) = x`, :math:`D R_x(0) =
    \mathrm{id}`; the formulas give both exactly there): ``x`` is copied, no pullback."""
    if v.dtype != x.dtype:
        return None, None
    with torch.no_grad():
        if zero and (path is straight_path or isinstance(path, _Retraction)):
            return buffer().copy_(x), None
        if path is straight_path:
            return (buffer() if written else torch.add(x, v, out=buffer())), None
        if isinstance(path, _Retraction):
            explicit = path.space.retr_vjp(v, buffer())
            if explicit is not None:
                return explicit
    return None, None


def as_scalar(value: object) -> torch.Tensor:
    """``value`` as a 0-dim tensor, or a TypeError saying what the objective must return
    (:func:`~geoopt_quotient.sharpness.functional.check_loss_value`)."""
    check_loss_value(value)
    return value.reshape(())


def check_scalar_finite(value: object) -> float:
    """The unperturbed loss as a float: a scalar tensor, finite."""
    return _read_finite(as_scalar(value).detach(), step=0)


def _read_finite(value: torch.Tensor, step: int) -> float:
    value = float(value)
    _raise_if_not_finite(value, 0.0, step)
    return value


def _raise_if_not_finite(value: float, grad_norm: float, step: int) -> None:
    if not math.isfinite(grad_norm):
        raise NonFiniteError(
            f"the gradient has NaN/Inf entries at Auto-PGD iteration {step}; "
            "use a smaller `rho`, or check the loss for overflow"
        )
    if not math.isfinite(value):
        raise NonFiniteError(
            f"the objective is {value} at Auto-PGD iteration {step}; check the loss on "
            "unperturbed parameters, or use a smaller `rho`"
        )


def maximize_in_ball(
    groups: Sequence[Union[BallGroup, Tuple[torch.Tensor, Manifold]]],
    objective: Objective,
    *,
    rho: float,
    iters: int = 20,
    path: str = "second_order",
    seed: int = 0,
    init: Union[str, Sequence[torch.Tensor]] = "zero",
    momentum: float = 0.75,
    check_finite: bool = True,
    keep_best_gradient: bool | None = None,
    keep_initial_gradient: bool = False,
    state_dtype: torch.dtype | str | None = None,
) -> BallMaxResult:
    r"""Maximise ``objective`` over the horizontal metric ball of radius ``rho`` with Auto-PGD.

    Approximates

    .. math::

        \max_{\xi \in \mathcal H_x,\ |\xi|_x \le \rho} f(\gamma_\xi(1)), \qquad
        |\xi|_x^2 = \sum_g |\xi_g|_{x_g}^2,

    over the joint ball of all ``groups`` at their fixed base points :math:`x_g`, with
    :math:`\gamma_\xi(1)` the perturbed points along ``path``. Auto-PGD (Algorithm 1 of
    da Silva, Dangel & Oore 2025) takes steps along the Riemannian gradient at the base
    point (``egrad2rgrad``, horizontal), normalised to unit metric norm, and projects by
    radial scaling into the ball; the step :math:`\eta` starts at :math:`2\rho` and is
    halved at the checkpoints :math:`\lceil p_j N \rceil`,
    :math:`p_0 = 0, p_1 = 0.22, p_{j+1} = p_j + \max(p_j - p_{j-1} - 0.03, 0.06)`, when
    the loss rose in fewer than 75% of the steps since the last checkpoint or stalled
    (then it restarts from the best iterate). The value found is a lower bound of the
    maximum.

    Parameters
    ----------
    groups : sequence of BallGroup or (tensor, manifold)
        Base points and their manifolds; the ball is joint over all groups.
    objective : callable
        ``objective(points) -> scalar tensor``, with ``points`` the perturbed points;
        differentiable in at least one of them
        (:class:`~geoopt_quotient.sharpness.functional.IndependentLossError` otherwise).
        An objective with a ``reduce_sum`` method holds one piece of a ball split over
        processes (:class:`~geoopt_quotient.sharpness.sharded.ShardedBall`): the ball's
        inner products and Gram matrices are passed through it, to sum them over the
        pieces.
    rho : float
        Radius :math:`\rho > 0` of the ball, in the joint metric norm :math:`|\xi|_x`.
    iters : int
        Number of Auto-PGD iterations :math:`N`, each one forward and backward pass
        (default 20).
    path : {"second_order", "exact", "straight"}
        From :math:`\xi` to the perturbed point: ``manifold.retr``, ``manifold.expmap``
        or :math:`x + \xi`. A group's own ``path`` overrides it.
    seed : int
        Seeds the random start (``init="random"``).
    init : {"zero", "random"} or sequence of torch.Tensor
        Start at :math:`\xi_0 = 0`, at a random feasible point, or at a given tangent
        vector (one tensor per group, shaped like its point), projected onto the
        feasible set: e.g. the maximiser found in a smaller ball, which lies in this one
        (the balls at one base point are nested). It is copied, never written to.
    momentum : float
        :math:`\alpha` of Auto-PGD's update
        :math:`\xi_{k+1} = P(\xi_k + \alpha(z_k - \xi_k) + (1 - \alpha)(\xi_k - \xi_{k-1}))`
        (1 on the first step); default 0.75.
    check_finite : bool
        Raise :class:`NonFiniteError` as soon as the objective or its gradient is
        NaN/Inf (default); ``False`` lets the iterates go on.
    keep_best_gradient : bool or None
        Keep a copy of the best iterate's gradient, so that a restart from it costs no
        pass, at the price of one more vector of the ball's size alive throughout (two
        with an objective that otherwise returns the gradient in a vector of its own:
        ``own_vector`` of :func:`evaluate_in_ball`). ``None``: keep it when that vector
        takes at most :data:`KEEP_GRADIENT_MAX_BYTES`.
    keep_initial_gradient : bool
        Return a copy of the Riemannian gradient at the initial iterate
        (:attr:`BallMaxResult.initial_gradient`; one more vector of the ball's size, no
        extra pass), e.g. for the first-order shares of the maximiser
        (:func:`~geoopt_quotient.sharpness.maximiser_shares`). Default ``False``.
    state_dtype : torch.dtype, str or None
        The dtype of the iterates and gradients. ``None`` (default): float32 or better
        (the points' compute dtype). ``torch.bfloat16`` (or ``"bfloat16"``): bfloat16
        points keep them in bfloat16, half the memory, computed in float32 and rounded
        once when written; the radial scaling then leaves room for that rounding, so
        the ball shrinks by up to :math:`2^{-8}` of :math:`\rho` (points of other dtypes
        are unaffected; :func:`state_dtype_for`).

    Returns
    -------
    BallMaxResult
        The best value and perturbation :math:`\xi`, the objective at the start, the
        history of values and step sizes, and the passes made.

    Raises
    ------
    ValueError
        For no groups, a non-positive ``rho`` or ``iters``, an unknown ``path`` or
        ``init``, or an ``init`` vector that does not match the groups' shapes.
    TypeError
        For base points that are not floating point, or an objective that does not
        return a scalar tensor.
    NonFiniteError
        With ``check_finite``, when the objective or its gradient becomes NaN/Inf.
    IndependentLossError
        When the objective does not depend on any perturbed point.

    Notes
    -----
    Besides the base points, the state kept across an evaluation of the objective is
    :math:`\xi_{k+1}`, :math:`\xi_k` and the best :math:`\xi` (often one of them), and
    the perturbed point of a straight path or of a retraction with an explicit pullback
    (the GL(h) quotients'; one buffer, rewritten at every evaluation, the gradient there
    pulled back to :math:`\xi` in place): no gradient, unless ``keep_best_gradient``.
    With an objective that writes the gradient into a vector of the ball (the engine's
    flat layout), the loop also keeps the vectors it has freed, for the next gradients
    and iterates to be written into: with those in use, never more than it held at once
    before, so that a run stops allocating once it has that many
    (:class:`~geoopt_quotient.sharpness.buffers.AutoPGDVectors`; the loop itself is
    :func:`auto_pgd`).
    Each update is one linear combination of :math:`\xi_k`, the Riemannian gradient and
    :math:`\xi_{k-1}` (see :func:`apgd_update`), written into a freed iterate's buffer;
    the Riemannian gradient is written into the Euclidean gradient's. Kept, the best
    gradient is a reference, not a copy. When Auto-PGD restarts from an earlier best
    iterate (after halving the step), that iterate's gradient is the kept one, or is recomputed:
    one more forward and backward pass; :attr:`BallMaxResult.evaluations` and
    :attr:`BallMaxResult.gradients` count the passes. So ``iters`` costs ``iters``
    forward and backward passes and one forward pass, plus, without the kept gradient,
    one forward and backward pass per restart (up to one per checkpoint
    :func:`apgd_checkpoints`: 7 for 20 iterations). Both give the same iterates.

    The loop reads one scalar pair from the device per iteration (the new value and the
    gradient's norm), its only host synchronisation. Under ``torch.autocast`` the
    objective runs in the autocast precision and everything else (the ball, the paths,
    the updates) in full precision; the iterates are float32 or better.

    References
    ----------
    Croce & Hein (2020), "Reliable evaluation of adversarial robustness with an ensemble
    of diverse parameter-free attacks", ICML :cite:`croce2020reliable`; its use on
    quotient manifolds: da Silva, Dangel & Oore (2025) :cite:`dasilva2025hide`.

    Examples
    --------
    A linear objective :math:`g^\top w'` over the adaptive ball (straight path) has the
    maximum :math:`g^\top w + \rho\, |w \odot g|_2`, which the first step reaches:

    >>> import torch
    >>> from geoopt_quotient import AdaptiveEuclidean, maximize_in_ball
    >>> w = torch.tensor([1.0, 2.0, -4.0], dtype=torch.float64)
    >>> g = torch.ones(3, dtype=torch.float64)
    >>> def objective(points):
    ...     return (points[0] * g).sum()
    >>> result = maximize_in_ball(
    ...     [(w, AdaptiveEuclidean(ndim=1))], objective, rho=0.5, iters=10, path="straight"
    ... )
    >>> exact = float((w * g).sum() + 0.5 * (w * g).norm())
    >>> abs(result.value - exact) < 1e-9
    True
    >>> [tuple(xi.shape) for xi in result.xi], len(result.history)
    ([(3,)], 11)
    """
    autocast = AutocastState.capture()
    with autocast.disabled():
        return _maximize(
            groups,
            objective,
            autocast,
            rho=rho,
            iters=iters,
            path=path,
            seed=seed,
            init=init,
            momentum=momentum,
            check_finite=check_finite,
            keep_best_gradient=keep_best_gradient,
            keep_initial_gradient=keep_initial_gradient,
            state_dtype=state_dtype,
        )


def _maximize(
    groups: Sequence[Union[BallGroup, Tuple[torch.Tensor, Manifold]]],
    objective: Objective,
    autocast: AutocastState,
    *,
    rho: float,
    iters: int,
    path: str,
    seed: int,
    init: Union[str, Sequence[torch.Tensor]],
    momentum: float,
    check_finite: bool,
    keep_best_gradient: bool | None = None,
    keep_initial_gradient: bool = False,
    state_dtype: torch.dtype | str | None = None,
) -> BallMaxResult:
    """:func:`maximize_in_ball` with autocast off, ``autocast`` its caller's."""
    ball, paths = prepare_ball(groups, rho, path, state_dtype=state_dtype)
    ball.reduce_sum = getattr(objective, "reduce_sum", None)
    keep = ball.vector_bytes() <= KEEP_GRADIENT_MAX_BYTES
    keep = keep if keep_best_gradient is None else bool(keep_best_gradient)
    iters = check_positive_int(iters, "iters")
    vectors = AutoPGDVectors(_initial_vector(ball, init, seed), ball.apart, keep)
    passes = BallPasses(ball, paths, objective, autocast, vectors)
    result = auto_pgd(
        passes,
        iters=iters,
        momentum=momentum,
        check_finite=check_finite,
        keep_initial_gradient=keep_initial_gradient,
    )
    result.spaces = [space.at_same_point() for space in ball.spaces]
    return result


#: Auto-PGD halves its step at a checkpoint where the objective rose in fewer than this
#: fraction of the steps since the last one (:math:`\rho` of Croce & Hein, 2020).
RISING_FRACTION = 0.75


class StepRule:
    r"""Croce & Hein's step size rule of Auto-PGD.

    The step :math:`\eta` starts at :math:`2\rho` (the ball's diameter). At each checkpoint
    :math:`w_j` (:func:`apgd_checkpoints`) it is halved when either

    1. the objective rose in fewer than :data:`RISING_FRACTION` of the steps since the
       last checkpoint, :math:`\#\{k \in [w_{j-1}, w_j) : f(\xi_{k+1}) > f(\xi_k)\}
       < 0.75\,(w_j - w_{j-1})`, or
    2. the step was not halved at the last checkpoint and the best value did not rise
       since, :math:`f_{best}(w_j) \le f_{best}(w_{j-1})`;

    the loop then restarts from the best iterate.

    Parameters
    ----------
    rho : float
        The ball's radius.
    iters : int
        The number of iterations :math:`N` (the checkpoints' scale).
    value : float
        The objective at the first iterate (the first checkpoint's best value).
    """

    def __init__(self, rho: float, iters: int, value: float):
        self.step = 2.0 * rho
        self.checkpoints = apgd_checkpoints(iters)
        self.last_mark, self.increases = 0, 0
        self.best_at_last_mark, self.halved_at_last_mark = value, True

    def record(self, rose: bool) -> None:
        """One step taken: whether the objective rose along it."""
        self.increases += int(rose)

    def halves_after(self, iteration: int, best_value: float) -> bool:
        """Whether the step is halved after ``iteration`` iterations (1-based), which
        halves it there; ``best_value``: the best objective so far."""
        if iteration not in self.checkpoints:
            return False
        since = iteration - self.last_mark
        too_few_increases = self.increases < RISING_FRACTION * since
        stalled = (not self.halved_at_last_mark) and best_value <= self.best_at_last_mark
        self.halved_at_last_mark = too_few_increases or stalled
        if self.halved_at_last_mark:
            self.step /= 2.0
        self.last_mark, self.increases, self.best_at_last_mark = iteration, 0, best_value
        return self.halved_at_last_mark


def auto_pgd(
    passes: BallPasses,
    *,
    iters: int,
    momentum: float,
    check_finite: bool,
    keep_initial_gradient: bool,
) -> BallMaxResult:
    r"""Auto-PGD (Croce & Hein, 2020) over the ball of ``passes``, from its first iterate.

    With :math:`g_k` the Riemannian gradient at :math:`\xi_k`, :math:`P` the projection
    onto the ball (radial scaling), :math:`\eta` the step of :class:`StepRule` and
    :math:`\alpha` the momentum (1 at the first step),

    .. math::

        z_{k+1} = P\Big(\xi_k + \eta \frac{g_k}{|g_k|}\Big), \qquad
        \xi_{k+1} = P\big(\xi_k + \alpha (z_{k+1} - \xi_k)
            + (1 - \alpha)(\xi_k - \xi_{k-1})\big)

    (one linear combination, :func:`apgd_update`), for :math:`k = 0, \dots, N - 1`, with
    the step rule of Croce & Hein (:class:`StepRule`): :math:`\eta = 2\rho` at first;
    at each checkpoint :math:`w_j = \lceil p_j N \rceil`, :math:`p_0 = 0, p_1 = 0.22,
    p_{j+1} = p_j + \max(p_j - p_{j-1} - 0.03, 0.06)` (:func:`apgd_checkpoints`), before
    the last iteration, :math:`\eta` is halved when the objective rose in fewer than
    75% (:data:`RISING_FRACTION`) of the steps since the last checkpoint, or when it was
    not halved there and the best value has not risen since. Where it is halved, the
    loop restarts from the best iterate (:math:`\xi_{k-1}` stays), with the gradient
    there kept or recomputed. The last iterate is evaluated without its gradient.

    Which buffer holds each vector is :class:`~geoopt_quotient.sharpness.buffers.AutoPGDVectors`'s
    concern, and the arithmetic on the ball :class:`BallPasses`'s: neither changes a
    value.

    Parameters
    ----------
    passes : BallPasses
        The ball, the objective and the vectors the loop holds, at the first iterate.
    iters : int
        The number of iterations :math:`N \ge 1`.
    momentum : float
        :math:`\alpha` after the first step.
    check_finite : bool
        Raise :class:`NonFiniteError` at a NaN/Inf value or gradient.
    keep_initial_gradient : bool
        Return a copy of the Riemannian gradient at the first iterate.

    Returns
    -------
    BallMaxResult
        As :func:`maximize_in_ball` returns it.
    """
    vectors = passes.vectors
    value_t = passes.evaluate_iterate(grad=True)
    value = _read_finite(value_t, step=0) if check_finite else float(value_t)
    passes.make_riemannian()
    initial_gradient = [g.clone() for g in vectors.rgrads] if keep_initial_gradient else None
    if vectors.keep_best_gradient:
        vectors.best_rgrads = vectors.rgrads
    rule, initial, best_value = StepRule(passes.ball.rho, iters, value), value, value
    history, steps = [value], []
    for k in range(iters):
        grad_norm = passes.update(rule.step, alpha=1.0 if k == 0 else momentum)
        need_grad = k + 1 < iters
        new_value_t = passes.evaluate_iterate(grad=need_grad)
        # the loop's one host read: the new value, with the gradient's norm as NaN/Inf guard
        new_value, norm = torch.stack((new_value_t, grad_norm.to(new_value_t))).tolist()
        if check_finite:
            _raise_if_not_finite(new_value, norm, k)
        steps.append(rule.step)
        history.append(new_value)
        rule.record(new_value > value)
        value = new_value
        if new_value > best_value:
            best_value = new_value
            vectors.take_best()
        if need_grad and rule.halves_after(k + 1, best_value):
            if vectors.best_xi is not vectors.xi:
                passes.restart()
                value = best_value
        if vectors.grads is not None:
            passes.make_riemannian()
    return BallMaxResult(
        value=best_value,
        xi=[v.detach() for v in vectors.best_xi],
        initial_value=initial,
        history=history,
        step_sizes=steps,
        evaluations=passes.evaluations,
        gradients=passes.gradients,
        initial_gradient=initial_gradient,
    )


class BallPasses:
    """What Auto-PGD's loop asks of the ball: evaluations of the objective at the current
    iterate, its gradient made Riemannian, updates and restarts, on the vectors of an
    :class:`~geoopt_quotient.sharpness.buffers.AutoPGDVectors` (which decides their
    buffers), counting the passes.

    Between a gradient made Riemannian and the next update it keeps the Gram matrix of
    :math:`(\\xi_k, g_k, \\xi_{k-1})` that the conversion computed in the same sweep
    (:meth:`TangentBall.riemannian_gradient_gram_`, whose iterate entries may be derived
    from the last update's), for the update to read instead of summing it anew.

    Parameters
    ----------
    ball : TangentBall
        The feasible set (:func:`prepare_ball`).
    paths : sequence of callable
        Per group, the path from a tangent vector to the perturbed point.
    objective : callable
        ``objective(points) -> scalar tensor``, as :func:`maximize_in_ball` takes it.
    autocast : AutocastState
        The caller's autocast, under which the objective runs.
    vectors : AutoPGDVectors
        The loop's vectors, at the first iterate.
    """

    def __init__(
        self,
        ball: TangentBall,
        paths: Sequence[Path],
        objective: Objective,
        autocast: AutocastState,
        vectors: AutoPGDVectors,
    ):
        self.ball, self.paths, self.objective, self.autocast = ball, paths, objective, autocast
        self.vectors = vectors
        self.targets = _perturbed_targets(ball, paths, objective)
        #: ``(G, xi, rgrads, xi_prev)`` of the last conversion, until the next update
        self.known: Tuple | None = None
        #: ``(block, derived run)`` of the best iterate: the ``(xi, rgrads)`` block of its
        #: conversion's Gram matrix, and how many derived matrices led to it
        self.best_gram: Tuple[torch.Tensor, int] | None = None
        self.evaluations, self.gradients = 0, 0

    def evaluate(self, xi: Sequence[torch.Tensor], grad: bool):
        """:func:`evaluate_in_ball` at ``xi``, its gradient possibly written into a free
        vector; ``(value, gradient or None)``."""
        ball = self.ball
        ball.sweeps = {}  # an earlier evaluation's, not taken (its gradient was dropped)
        vectors = self.vectors
        # the objective's own vector as the gradient where no role keeps a gradient
        # beyond the next update (the best one): one vector of the model's size less
        own = not vectors.keep_best_gradient
        try:
            args = (ball, self.paths, self.objective, xi, grad, self.autocast, vectors.free, own)
            value, grads = evaluate_in_ball(*args)
        finally:
            ball.pending = None  # announced for this evaluation only
        owns = getattr(self.objective, "owns", None)
        if grads is not None and owns is not None and owns(grads):
            vectors.lent = list(grads)  # its tensors, whatever becomes of the list
        self.evaluations, self.gradients = self.evaluations + 1, self.gradients + int(grad)
        return value, grads

    def evaluate_iterate(self, grad: bool) -> torch.Tensor:
        """The objective at the current iterate (a 0-d tensor), its gradient (``grad``)
        announced to the ball for the next conversion and kept in the vectors."""
        vectors = self.vectors
        if grad:
            self.ball.expect_gradient(vectors.xi, vectors.xi_prev)
        value, grads = self.evaluate(vectors.xi, grad)
        vectors.set_gradient(grads)
        return value

    def make_riemannian(self) -> None:
        """The last evaluation's gradient made Riemannian in place, with the Gram matrix
        the next update reads."""
        v = self.vectors
        rgrads, gram = self.ball.riemannian_gradient_gram_(v.grads, v.xi, v.xi_prev)
        self.known = (gram, v.xi, rgrads, v.xi_prev)
        if v.xi is v.best_xi:
            self.best_gram = (gram[:2, :2].clone(), self.ball.derived_run)
        v.set_riemannian(rgrads)

    def update(self, step: float, alpha: float) -> torch.Tensor:
        """Auto-PGD's next iterate (:func:`apgd_update`) made the current one; returns the
        norm of the gradient it stepped along (a 0-d tensor)."""
        v = self.vectors
        out = v.output()
        gram, self.known = _known_gram(self.known, (v.xi, v.rgrads, v.xi_prev)), None
        args = (self.ball, v.xi, v.xi_prev, v.rgrads, step, alpha, out, gram, self.targets)
        xi_next, grad_norm = apgd_update(*args)
        v.advance(xi_next)
        return grad_norm

    def restart(self) -> None:
        r"""Back to the best iterate, with the gradient there: the kept one, else
        recomputed (one more pass) and converted alone, so that the update reads the same
        Gram matrix whether the gradient is kept or not.

        Where the previous iterate is the best one (the last step did not improve: most
        restarts of a short call), the update's vectors are :math:`(\xi^*, g^*, \xi^*)`,
        whose Gram matrix is the :math:`(\xi^*, g^*)` block of the one computed when
        :math:`g^*` was converted (:attr:`best_gram`): the update reads it instead of
        summing it anew over the vectors' entries (a sweep over three parameter-sized
        vectors and the point). Otherwise, or where no Gram entry may be derived
        (:data:`MAX_DERIVED_RUN` 0), the update sums it."""
        vectors = self.vectors
        vectors.restart()
        if vectors.rgrads is None:
            grads = self.evaluate(vectors.xi, grad=True)[1]
            vectors.rgrads = self.ball.riemannian_gradients_(grads)
        if MAX_DERIVED_RUN and self.best_gram is not None and vectors.xi_prev is vectors.xi:
            block, run = self.best_gram
            (a, b), (_, c) = block.unbind()
            gram = torch.stack((a, b, a, b, c, b, a, b, a)).view(3, 3)
            self.known = (gram, vectors.xi, vectors.rgrads, vectors.xi_prev)
            self.ball.derived_run = run  # the rounding's lineage: that of the block


def _initial_vector(
    ball: TangentBall, init: Union[str, Sequence[torch.Tensor]], seed: int
) -> List[torch.Tensor]:
    """Auto-PGD's first iterate: zero, random, or the given vector projected onto the
    feasible set (in the compute dtypes), in a buffer of its own in the ball's
    :attr:`~TangentBall.dtypes` (the loop writes into freed iterates). The zero one is
    announced to the ball (:meth:`TangentBall.start_at_zero`), which then skips its
    retraction and the metric's products of it."""
    if isinstance(init, str):
        check_choice(init, ("zero", "random"), "init")
        if init == "zero":
            zero = ball.zeros()
            ball.start_at_zero(zero)
            return zero
        vectors = ball.random(seeded_generator(ball.points[0].device, seed), ball.rho)
        if not ball.rounded:
            return ball.project(vectors)
    else:
        init = list(init)
        shapes = [tuple(v.shape) for v in init]
        if shapes != [tuple(x.shape) for x in ball.points]:
            raise ValueError(
                f"`init` must hold one tangent vector per group, shaped like its point; got "
                f"shapes {shapes} for points {[tuple(x.shape) for x in ball.points]}"
            )
        vectors = [
            v.detach().to(dtype=d, device=x.device)
            for v, d, x in zip(init, ball.compute_dtypes, ball.points)
        ]
    out = buffers.joint_buffer(ball.points, ball.dtypes, apart=ball.apart)
    for o, v in zip(out, ball.project(vectors)):
        o.copy_(v)
    return out


def _perturbed_targets(
    ball: TangentBall, paths: Sequence[Path], objective: Objective
) -> List[Tuple[torch.Tensor, torch.Tensor] | None] | None:
    """Per group, ``(x, buffer)`` where the update writes the perturbed point
    :math:`x + \\xi` as well, in its sweep over the new iterate (a straight path in the
    point's dtype, on the CPU, into the buffer the evaluation reads it from), else
    ``None`` (also where the objective's ``perturbed_buffer`` gives none); ``None`` for
    an objective whose evaluation has no such buffers.

    On the CPU this saves a read of the iterate per evaluation; on an accelerator, where
    the update's blocks are few and large, it would add operators and save nothing.
    """
    if getattr(objective, "evaluate_ball", None) is None:
        buffer = ball.perturbed_buffer
    else:
        buffer = getattr(objective, "perturbed_buffer", None)
    if buffer is None:
        return None
    targets: List[Tuple[torch.Tensor, torch.Tensor] | None] = []
    for i, (path, x, dtype) in enumerate(zip(paths, ball.points, ball.dtypes)):
        straight = path is straight_path and dtype == x.dtype and not capped(x.device)
        target = buffer(i) if straight else None  # None: the evaluation's own vector
        targets.append(None if target is None else (x, target))
    return targets if any(t is not None for t in targets) else None


def _known_gram(known: Tuple | None, vectors: Tuple) -> torch.Tensor | None:
    """The Gram matrix in ``known`` (``(gram, *its vectors)``) if it is of ``vectors``."""
    if known is None or any(a is not b for a, b in zip(known[1:], vectors)):
        return None
    return known[0]


def apgd_update(
    ball: TangentBall,
    xi: Sequence[torch.Tensor],
    xi_prev: Sequence[torch.Tensor],
    rgrads: Sequence[torch.Tensor],
    step: float,
    alpha: float,
    out: List[torch.Tensor],
    gram: torch.Tensor | None = None,
    targets: Sequence[Tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> Tuple[List[torch.Tensor], torch.Tensor]:
    r"""Auto-PGD's next iterate, written into ``out``, and the norm of the Riemannian
    gradient ``rgrads`` at ``xi``; ``gram``: the Gram matrix of ``(xi, rgrads, xi_prev)``
    where the caller has it (:meth:`TangentBall.riemannian_gradient_gram_`); ``targets``: per
    group, ``(x, buffer)`` where the straight path's perturbed point :math:`x + \xi_{next}`
    is written too, in the same sweep (:func:`_perturbed_targets`; recorded in
    :attr:`TangentBall.written` for the next evaluation), or ``None``.

    With :math:`g` the Riemannian gradient, :math:`P` the radial scaling into the ball and
    :math:`\eta` the step,

    .. math::

        z = P\Big(\xi + \frac{\eta}{|g|} g\Big), \qquad
        \xi_{next} = P\big(\xi + \alpha(z - \xi) + (1 - \alpha)(\xi - \xi_{prev})\big).

    Both are linear combinations of :math:`\xi`, :math:`g` and :math:`\xi_{prev}`, and
    radial scaling multiplies by :math:`\min(1, \rho / |v|)`, so the whole update is
    :math:`\xi_{next} = w_1 \xi + w_2 g + w_3 \xi_{prev}` with weights from the 3 × 3
    Gram matrix of the three vectors (:func:`update_weights`): one read of the vectors
    for the Gram matrix and one for the combination, instead of a pass per operation.
    ``out`` may be ``xi_prev`` itself; the other inputs are only read. Each group's
    tangent space is told the combination
    (:meth:`~geoopt_quotient.manifolds.tangent.TangentSpace.combination`), so that it
    keeps what it derives of :math:`\xi_{next}` from what it knows of the three
    vectors (the GL(h) quotients: the products with the point that its retraction needs);
    where the Gram matrix's iterate entries are derived too, so that the rounding of both
    is refreshed at the same updates (:data:`MAX_DERIVED_RUN`).
    """
    vectors = (xi, rgrads, xi_prev)
    if gram is None:
        gram, ball.derived_run = ball.gram(vectors), 0
    weights, grad_norm = update_weights(gram, step, alpha, ball.rho, ball.norm_error)
    per_dtype: Dict[Tuple[torch.dtype, torch.device], Tuple[torch.Tensor, ...]] = {}
    shifts = [None] * len(out) if targets is None else targets
    derived = []  # told the tensors written once all are: a write may bump another's version
    derive = ball.derived_run > 0  # refreshed with the Gram entries (MAX_DERIVED_RUN)
    groups = zip(out, xi, rgrads, xi_prev, shifts, ball.spaces, ball.compute_dtypes)
    for o, x, g, p, shift, space, dtype in groups:
        key = (dtype, o.device)
        if key not in per_dtype:
            per_dtype[key] = weights.to(dtype=dtype, device=o.device).unbind()
        derived.append(space.combination((x, g, p), per_dtype[key]) if derive else None)
        combine_(o, (x, g, p), per_dtype[key], shift)
    for written, o in zip(derived, out):
        if written is not None:
            written(o)
    if targets is not None:
        ball.written = (out, [t is not None for t in targets])
    ball.iterates = (_iterates_gram(gram, weights), out, xi, ball.derived_run)
    return out, grad_norm


#: At most this many Gram matrices in a row have iterate entries derived from the
#: previous update's (:meth:`TangentBall.riemannian_gradient_gram_`); the next is summed whole.
MAX_DERIVED_RUN = 8


def _iterates_gram(gram: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    r"""The Gram matrix of :math:`(\xi_{next}, \xi)` for :math:`\xi_{next} = w_1 \xi
    + w_2 g + w_3 \xi_{prev}`, from the Gram matrix :math:`G` of :math:`(\xi, g,
    \xi_{prev})`: :math:`|\xi_{next}|^2 = w^\top G w`,
    :math:`\langle \xi_{next}, \xi \rangle = (G w)_1`, :math:`|\xi|^2 = G_{11}`
    (float64, exact but for the rounding of :math:`\xi_{next}`'s entries, a relative
    :math:`\varepsilon` of its dtype)."""
    product = gram @ weights
    cross = product[0]
    return torch.stack((weights @ product, cross, cross, gram[0, 0])).view(2, 2)


def _with_column(iterates: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    r"""The Gram matrix of :math:`(\xi, g, \xi_{prev})` from that of
    :math:`(\xi, \xi_{prev})` and the column :math:`\langle \cdot, g \rangle`."""
    (a, b), (_, c) = iterates.to(column.device).unbind()
    g0, g1, g2 = column.unbind()
    return torch.stack((a, g0, b, g0, g1, g2, b, g2, c)).view(3, 3)


def update_weights(
    gram: torch.Tensor, step: float, alpha: float, rho: float, error: NormError
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""The weights of :math:`(\xi, g, \xi_{prev})` in :func:`apgd_update` from their
    Gram matrix (float64), and :math:`|g|`.

    The last radial scaling divides by the bound :meth:`NormError.bound` of the norm of
    the combination as :func:`combine_` rounds it, not by its Gram-based norm
    :math:`\sqrt{w^\top G w}`: the rounding of :math:`G` and of the combination could
    otherwise put the iterate outside the ball by a few parts in :math:`10^6` (float32).
    The intermediate :math:`z` is never evaluated and is scaled by its Gram-based norm.
    """
    xx, xg, _, _, gg, *_ = gram.reshape(-1).unbind()  # two operators, not six
    grad_norm = gg.clamp_min(0).sqrt()
    length = torch.where(grad_norm > 0, step / grad_norm.clamp_min(1e-300), 0.0)
    z_norm = (xx + 2 * length * xg + length * length * gg).clamp_min(0).sqrt()
    z_scale = _clip_scale(z_norm, rho)
    weights = torch.stack(
        (
            2 * (1 - alpha) + alpha * z_scale,
            alpha * z_scale * length,
            torch.full_like(z_scale, -(1 - alpha)),
        )
    )
    spread = weights.abs() @ gram.diagonal().clamp_min(0).sqrt()
    bound = error.bound(weights @ gram @ weights, spread)
    return weights * _clip_scale(bound, rho), grad_norm


def _clip_scale(norm: torch.Tensor, rho: float) -> torch.Tensor:
    r""":math:`\min(1, \rho / |v|)`, the radial scaling into the ball."""
    return (rho / norm.clamp_min(1e-300)).clamp(max=1.0)


#: :math:`\lambda` of the probabilistic rounding error bound of :class:`NormError`: it
#: fails with probability at most :math:`2 m e^{-\lambda^2 (1 - u)^2 / 2}` per Gram entry,
#: under :math:`10^{-8}` for sums of up to :math:`m = 2^{18}` terms.
ROUNDING_LAMBDA = 8.0


@dataclass(frozen=True)
class NormError:
    r"""Relative rounding errors of the ball's norms, which radial scaling leaves room for.

    A combination :math:`o = \sum_j w_j v_j` of vectors of the ball is scaled into the
    ball by its norm :math:`\sqrt{w^\top \hat G w}` computed from the Gram matrix
    :math:`\hat G` of the :math:`v_j` (:func:`update_weights`), and :func:`combine_`
    writes it with rounding. With :math:`s = \sum_j |w_j| \sqrt{\hat G_{jj}}` and
    :math:`u` the unit roundoff of the vectors' dtype:

    - the Gram entries are sums of :math:`m` products in the vectors' dtype (at most
      :data:`~geoopt_quotient.manifolds.adaptive.GRAM_BLOCK` per block, the blocks
      added in float64); by Cauchy–Schwarz and the probabilistic bound of Higham & Mary
      (2019, Theorem 3.1), :math:`|\hat G_{ij} - G_{ij}| \le \delta_G \sqrt{G_{ii}
      G_{jj}}` with :math:`\delta_G = \lambda \sqrt m\, u` (:data:`ROUNDING_LAMBDA`;
      the worst-case :math:`m u` would shrink a float32 ball by a percent), so
      :math:`|w^\top G w - w^\top \hat G w| \le \delta_G s^2`;
    - each entry of :math:`o` is rounded at most four times (the weights to the dtype,
      the products and the sums), so the written vector differs from :math:`o` by at
      most :math:`\delta_c \sum_j |w_j| |v_j|` entry by entry,
      :math:`\delta_c = \gamma_4 = 4u / (1 - 4u)`, and in a metric diagonal in the
      entries by at most :math:`\delta_c s` in norm (a quotient's metric multiplies
      this by its condition number's square root; the margin of the first term covers
      it in practice, as the tests check).

    Hence the written vector's norm is at most
    :math:`\bar n = \sqrt{w^\top \hat G w + \delta_G s^2} + \delta_c s`, and scaling
    the weights by :math:`\min(1, \rho / \bar n)` scales :math:`\bar n` to at most
    :math:`\rho`. A norm recomputed from the vector's entries in its dtype is rounded
    by about :math:`\log_2(n)\, u` (pairwise sums), well inside the margin. In
    float32 the ball shrinks by at most about :math:`\delta_G / 2 + \delta_c`
    (:math:`1.2 \cdot 10^{-4}` of :math:`\rho` for :math:`m = 2^{18}`), in float64 by
    :math:`2 \cdot 10^{-13}`.

    Attributes
    ----------
    gram : float
        :math:`\delta_G`.
    combination : float
        :math:`\delta_c`.
    """

    gram: float
    combination: float

    @staticmethod
    def of(
        dtypes: Sequence[torch.dtype],
        entries: int,
        stored: Sequence[torch.dtype] | None = None,
    ) -> NormError:
        r"""The errors for vectors computed in ``dtypes`` (the least precise counts) whose
        largest group has ``entries`` entries; ``stored``: the dtypes they are stored in
        where coarser (a bfloat16 state): each written entry is then rounded once more,
        by at most :math:`u_s |o_i|`, which adds :math:`u_s (1 + \delta_c) s` to the
        norm's bound (the Gram matrices are then always summed from the stored entries,
        :meth:`TangentBall.riemannian_gradient_gram_`)."""
        u = max(torch.finfo(d).eps for d in dtypes) / 2
        m = max(1, min(entries, GRAM_BLOCK))
        gram, combination = ROUNDING_LAMBDA * math.sqrt(m) * u, 4 * u / (1 - 4 * u)
        u_stored = max(torch.finfo(d).eps for d in stored or dtypes) / 2
        if u_stored > u:
            combination += u_stored * (1 + combination)
        return NormError(gram, combination)

    def bound(self, squared: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
        r""":math:`\bar n` from the Gram-based squared norm :math:`w^\top \hat G w` and
        :math:`s` (0-d float64 tensors)."""
        return (squared + self.gram * spread * spread).clamp_min(0).sqrt() + (
            self.combination * spread
        )


#: Entries per block of :func:`combine_` on the CPU: the block of the output stays in
#: cache across its three operations (elsewhere whole tensors: a block costs launches);
#: on 11M-entry float32 vectors, one thread, 19 ms with blocks of 64k entries, 14.5 ms
#: with 256k (whole iterations: ``benchmarks/bench_block_sizes.py``).
COMBINE_BLOCK = 1 << 18


def combine_(
    out: torch.Tensor,
    vectors: Tuple[torch.Tensor, ...],
    weights: Tuple[torch.Tensor, ...],
    shift: Tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    r"""Auto-PGD's update kernel: ``out = w_2 v_2 + w_0 v_0 + w_1 v_1``, in this order.

    The one pass over the vectors that each Auto-PGD update makes
    (:func:`apgd_update`: :math:`\xi_{next} = w_0 \xi + w_1 g + w_2 \xi_{prev}`),
    block by block on the CPU (:data:`COMBINE_BLOCK` entries), whole tensors elsewhere.
    Its order of operations fixes the rounding of every iterate, so benchmarks and tests
    that time or check the update call it directly.

    Parameters
    ----------
    out : torch.Tensor
        Written with the result. It may be one of the ``vectors``: ``v_2`` is
        overwritten after it is read, any other is summed into a block-sized buffer
        first, so that the rounding does not depend on which buffer receives it.
    vectors : tuple of torch.Tensor
        ``(v_0, v_1, v_2)``, shaped like ``out``.
    weights : tuple of torch.Tensor
        ``(w_0, w_1, w_2)``, 0-d tensors on ``out``'s device, in the dtype the
        combination is computed in: where ``out`` or a vector is in another (a bfloat16
        state, :func:`state_dtype_for`), each block is computed in the weights' dtype and
        rounded once into ``out``.
    shift : (torch.Tensor, torch.Tensor) or None
        ``(x, buffer)``: also ``buffer = x + out`` (the straight path's perturbed point),
        from each block of ``out`` while it is in cache.
    """
    (a, b, c), (wa, wb, wc) = vectors, weights
    operands = (out, a, b, c, *(shift or ()))
    rounded = any(t.dtype != wa.dtype for t in (out, a, b, c))
    staged = rounded or out is a or out is b
    if out.device.type == "cpu" and all(
        t.is_contiguous() and t.shape == out.shape for t in operands
    ):
        flats = [t.view(-1) for t in operands]
        step = block_length(out.numel(), COMBINE_BLOCK, out.device)
        blocks = [[f[start : start + step] for f in flats] for start in range(0, out.numel(), step)]
    else:
        blocks = [operands]
    stage = None
    if staged:
        stage = torch.empty(blocks[0][0].numel(), dtype=wa.dtype, device=out.device)
    for o, a_, b_, c_, *shifted in blocks:
        target = stage[: o.numel()].view(o.shape) if staged else o
        if rounded:  # in the weights' dtype, then rounded once into ``o``
            target.copy_(c_).mul_(wc).addcmul_(a_, wa).addcmul_(b_, wb)
        else:
            torch.mul(c_, wc, out=target).addcmul_(a_, wa).addcmul_(b_, wb)
        if staged:
            o.copy_(target)
        if shifted:
            torch.add(shifted[0], o if rounded else target, out=shifted[1])


def average_in_ball(
    groups: Sequence[Union[BallGroup, Tuple[torch.Tensor, Manifold]]],
    objective: Objective,
    *,
    rho: float,
    samples: int = 20,
    path: str = "second_order",
    seed: int = 0,
) -> Tuple[float, List[float]]:
    r"""Mean of ``objective`` over horizontal Gaussian :math:`\xi \sim \mathcal N(0, \rho^2 I)`.

    The Monte Carlo estimate

    .. math::

        \frac1S \sum_{s=1}^S f(\gamma_{\xi_s}(1)), \qquad
        \xi_s = \rho\, z_s,\ z_s \sim \mathcal N(0, I) \text{ on } \mathcal H_x,

    where the Gaussian is the metric's (identity covariance in the metric on the
    horizontal space), so the estimate is invariant under the group. Note that
    :math:`\rho` is the scale of each coordinate, not a radius: :math:`|\xi_s|_x` is
    about :math:`\rho \sqrt{\dim \mathcal H_x}`.

    Parameters
    ----------
    groups : sequence of BallGroup or (tensor, manifold)
        Base points and their manifolds, as for :func:`maximize_in_ball`.
    objective : callable
        ``objective(points) -> scalar tensor`` of the perturbed points; evaluated
        without gradients.
    rho : float
        Standard deviation :math:`\rho > 0` of the samples, in the metric.
    samples : int
        Number :math:`S` of samples (forward passes); default 20.
    path : {"second_order", "exact", "straight"}
        From :math:`\xi` to the perturbed point, as for :func:`maximize_in_ball`.
    seed : int
        Seed of the samples' generator (on the first point's device).

    Returns
    -------
    mean : float
        The mean of the objective over the samples.
    per_sample : list of float
        The objective at each sample.

    Raises
    ------
    ValueError
        For no groups, or a non-positive ``rho`` or ``samples``.
    NonFiniteError
        When the objective is NaN/Inf at a sample.
    """
    autocast = AutocastState.capture()
    with autocast.disabled():
        ball, paths = prepare_ball(groups, rho, path)
        samples = check_positive_int(samples, "samples")
        generator = seeded_generator(ball.points[0].device, seed)
        values = []
        for _ in range(samples):
            xi = ball.random(generator, ball.rho)
            values.append(evaluate_in_ball(ball, paths, objective, xi, False, autocast)[0])
    per_sample = torch.stack(values).tolist()
    for index, value in enumerate(per_sample):
        _raise_if_not_finite(value, 0.0, index)
    return sum(per_sample) / len(per_sample), per_sample
