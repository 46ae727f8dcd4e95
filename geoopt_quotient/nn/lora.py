"""LoRA adapters whose factor pair lives on the GL quotient."""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Union

import torch
import torch.nn.functional as F
from geoopt import ManifoldParameter
from torch import nn

from .._checks import check_positive_int
from ..manifolds import GLQuotient
from ._factors import orthonormal_frame

__all__ = ["LoRALinear", "wrap_linear_layers"]


class LoRALinear(nn.Module):
    r"""A frozen :class:`torch.nn.Linear` plus a rank-``rank`` adapter on the GL quotient.

    .. math::

        y = \operatorname{base}(x) + x\, \Delta W^\top, \qquad
        \Delta W = s\,(B A^\top - B_0 A_0^\top), \qquad s = \alpha / r,

    with :math:`B \in \mathbb{R}^{\text{out} \times r}` and
    :math:`A \in \mathbb{R}^{\text{in} \times r}` (LoRA's ``A`` is :math:`A^\top`) held as
    one :class:`geoopt.ManifoldParameter` ``factors = [B; A]`` on
    :class:`~geoopt_quotient.GLQuotient` ``(n=out, m=in)``, and
    :math:`(B_0, A_0)` a frozen copy of the initial factors (buffer ``init_factors``).

    Why not LoRA's initialisation: LoRA starts from :math:`B = 0`, which makes
    :math:`\Delta W = 0` but puts the pair at a rank-deficient point, outside the
    quotient of full-rank pairs (the metric and the horizontal projection are singular
    there). Small full-rank factors would avoid that but change the pretrained function
    and, with a small product, start where the quotient is strongly curved
    (its curvature grows roughly like the inverse of the smallest singular value of
    :math:`B A^\top`). Instead :math:`(B_0, A_0)` is a well-conditioned, balanced pair
    whose scaled product :math:`s B_0 A_0^\top` has all :math:`r` singular values equal
    to ``init_scale``, and the same product is subtracted, so the wrapped layer computes
    exactly ``base`` at initialisation. The price: the learned update
    :math:`B A^\top - B_0 A_0^\top` has rank at most :math:`2r` (it is a rank-:math:`r`
    point minus a fixed rank-:math:`r` matrix), and the forward pass costs two extra
    thin products (done in one call on the stacked factors). With
    ``cancel_init=False`` there is no offset: :math:`\Delta W = s B A^\top` starts with
    singular values ``init_scale`` (choose it small).

    Parameters
    ----------
    base : torch.nn.Linear
        The layer to adapt. Its parameters are frozen (``requires_grad=False``) and
        not copied.
    rank : int
        Adapter rank :math:`r \le \min(\text{in}, \text{out})`.
    alpha : float
        LoRA scaling numerator: :math:`s = \alpha / r`.
    metric : {"mix", "inv"}
        The GL-invariant metric. ``"mix"`` makes the Riemannian gradient the
        :math:`(A^\top A)^{-1}`, :math:`(B^\top B)^{-1}` preconditioned gradient
        (as in "Riemannian preconditioned LoRA"), whose first-order step in
        :math:`\Delta W` does not depend on the scale of the factors.
    init_scale : float
        Singular values of the initial (scaled) product :math:`s B_0 A_0^\top`. With
        ``cancel_init`` it changes no function, only where on the quotient training
        starts: keep it well above the change of :math:`\Delta W` per step (for
        RiemannianAdam with the mix metric about ``lr * s`` in Frobenius norm), or
        the first steps can leave the full-rank set (a Cholesky error), and of the
        order of the update you expect. Larger values make training closer to a
        linear (tangent-space) update :math:`s(X A_0^\top + B_0 Y^\top)`.
    cancel_init : bool
        Subtract the initial product (default) or not.
    eps : float
        Relaxation of the quotient metric.
    generator : torch.Generator, optional
        Source of randomness for the initial frames.
    """

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        metric: str = "mix",
        *,
        init_scale: float = 1.0,
        cancel_init: bool = True,
        eps: float = 0.0,
        generator: Optional[torch.Generator] = None,
    ):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"`base` must be a torch.nn.Linear, got {type(base).__name__}")
        self.rank = check_positive_int(rank, "rank")
        if rank > min(base.in_features, base.out_features):
            raise ValueError(
                f"`rank` must be <= min(in_features, out_features) = "
                f"{min(base.in_features, base.out_features)}, got {rank}"
            )
        if not alpha > 0:
            raise ValueError(f"`alpha` must be > 0, got {alpha}")
        if not init_scale > 0:
            raise ValueError(f"`init_scale` must be > 0, got {init_scale}")
        self.alpha = float(alpha)
        self.scaling = self.alpha / rank
        self.init_scale = float(init_scale)
        self.cancel_init = bool(cancel_init)
        self.base = base
        base.requires_grad_(False)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.manifold = GLQuotient(base.out_features, base.in_features, metric=metric, eps=eps)

        factory = {"dtype": base.weight.dtype, "device": base.weight.device}
        # s B0 A0^T = init_scale * Q_B Q_A^T: all singular values init_scale, balanced
        root = (self.init_scale / self.scaling) ** 0.5
        b0 = orthonormal_frame(base.out_features, rank, generator=generator, **factory) * root
        a0 = orthonormal_frame(base.in_features, rank, generator=generator, **factory) * root
        point = self.manifold.from_factors(b0, a0)
        self.factors = ManifoldParameter(point.clone(), manifold=self.manifold)
        if self.cancel_init:
            self.register_buffer("init_factors", point.clone())
        else:
            self.register_buffer("init_factors", None)

    @property
    def weight(self) -> torch.Tensor:
        """The frozen base weight (for code that reads ``module.weight``)."""
        return self.base.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        """The frozen base bias."""
        return self.base.bias

    def delta_weight(self) -> torch.Tensor:
        r"""The adapter's dense update :math:`\Delta W`, shape ``(out, in)``."""
        delta = self.manifold.product(self.factors)
        if self.init_factors is not None:
            delta = delta - self.manifold.product(self.init_factors)
        return self.scaling * delta

    def merged_weight(self) -> torch.Tensor:
        r"""The effective dense weight :math:`W_0 + \Delta W`."""
        return self.base.weight + self.delta_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, a = self.manifold.factors(self.factors)
        if self.init_factors is not None:
            b0, a0 = self.manifold.factors(self.init_factors)
            b, a = torch.cat((b, -b0), dim=-1), torch.cat((a, a0), dim=-1)
        return self.base(x) + self.scaling * F.linear(F.linear(x, a.mT), b)

    def extra_repr(self) -> str:
        return (
            f"rank={self.rank}, alpha={self.alpha}, metric={self.manifold.metric!r}, "
            f"init_scale={self.init_scale}, cancel_init={self.cancel_init}"
        )


NamesOrPredicate = Union[str, Iterable[str], Callable[[str, nn.Module], bool]]


def _matcher(names_or_predicate: NamesOrPredicate) -> Callable[[str, nn.Module], bool]:
    if callable(names_or_predicate):
        return names_or_predicate
    names = (
        [names_or_predicate] if isinstance(names_or_predicate, str) else list(names_or_predicate)
    )
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError("`names_or_predicate` must be a name, a list of names or a callable")

    def match(path: str, module: nn.Module) -> bool:
        return any(path == n or path.endswith("." + n) for n in names)

    return match


def wrap_linear_layers(
    model: nn.Module,
    names_or_predicate: NamesOrPredicate,
    rank: int,
    alpha: float,
    metric: str = "mix",
    **lora_kwargs,
) -> List[str]:
    r"""Replace chosen :class:`torch.nn.Linear` modules of ``model`` by :class:`LoRALinear`.

    Every parameter of ``model`` is frozen first, so afterwards exactly the adapter
    factors require gradients (unfreeze e.g. a classifier head yourself).

    Parameters
    ----------
    model : torch.nn.Module
        Modified in place.
    names_or_predicate : str, iterable of str, or callable
        A name matches a module whose dotted path equals it or ends with ``"." + name``
        (``"query"`` matches ``bert.encoder.layer.0.attention.self.query``). A callable
        is called as ``predicate(path, module)`` for every ``nn.Linear``.
    rank, alpha, metric, **lora_kwargs
        Passed to :class:`LoRALinear`.

    Returns
    -------
    list of str
        The dotted paths of the wrapped modules, in ``named_modules`` order.

    Raises
    ------
    ValueError
        If no ``nn.Linear`` matches.
    """
    match = _matcher(names_or_predicate)
    targets = [
        path
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) and path and match(path, module)
    ]
    # never wrap the base layer of an existing adapter
    adapters = {p for p, m in model.named_modules() if isinstance(m, LoRALinear)}
    targets = [p for p in targets if p.rpartition(".")[0] not in adapters]
    if not targets:
        raise ValueError("no torch.nn.Linear module of `model` matches `names_or_predicate`")
    model.requires_grad_(False)
    for path in targets:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, attr, LoRALinear(getattr(parent, attr), rank, alpha, metric, **lora_kwargs))
    return targets
