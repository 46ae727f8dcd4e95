"""Symmetries of ``torch.nn.MultiheadAttention`` and of declared ManifoldParameters."""

from __future__ import annotations

from typing import List

import geoopt
import torch

from ..manifolds.base import QuotientManifold, is_plain_euclidean
from .layouts import PairSpec, head_columns, head_rows
from .plan import SymmetryGroup, whole_parameter_group

__all__ = ["manifold_parameter_groups", "multihead_attention_pairs"]


def multihead_attention_pairs(path: str, module: torch.nn.MultiheadAttention) -> List[PairSpec]:
    r"""Q/K and V/O pairs of every head of an ``nn.MultiheadAttention``.

    Fused ``in_proj_weight`` rows ``[0, E)`` are Q, ``[E, 2E)`` K, ``[2E, 3E)`` V (or the
    separate ``q/k/v_proj_weight`` when ``kdim``/``vdim`` differ from ``E``). ``bias_k``
    and ``bias_v`` are extra key/value rows after the projection, hence extra rows of
    :math:`H` (Q/K) and of :math:`G` (V/O).

    Parameters
    ----------
    path : str
        The module's path in the model (``""`` for the model itself), prefixed to the
        parameter names.
    module : torch.nn.MultiheadAttention
        The attention module.

    Returns
    -------
    list of PairSpec
        The query-key pair (:math:`G` from the query rows, :math:`H` from the key rows,
        each with its bias row) and the value-output pair (:math:`G` from the value
        rows and bias, :math:`H` from the columns of ``out_proj.weight``), each for
        all heads.
    """
    heads, hd = module.num_heads, module.head_dim
    prefix = f"{path}." if path else ""
    has_bias = module.in_proj_bias is not None
    params = dict(module.named_parameters(recurse=False))
    names = {n: prefix + n for n in params}

    def shapes(*keys):
        return {names[k]: params[k].shape for k in keys}

    e = module.embed_dim
    bias_k = ("bias_k",) if module.bias_k is not None else ()
    bias_v = ("bias_v",) if module.bias_v is not None else ()
    qkv_bias = ("in_proj_bias",) if has_bias else ()
    out_w = f"{prefix}out_proj.weight"

    if module._qkv_same_embed_dim:
        qk_keys = ("in_proj_weight", *qkv_bias, *bias_k)

        def qk(w, *rest):
            b = rest[0] if has_bias else None
            extra = rest[1:] if has_bias else rest
            g = head_rows(w[:e], heads, hd, None if b is None else b[:e])
            h = head_rows(w[e : 2 * e], heads, hd, None if b is None else b[e : 2 * e], extra)
            return torch.cat((g, h), dim=-2)

        vo_keys = ("in_proj_weight", *qkv_bias, *bias_v)

        def vo(w, *rest, out):
            b = rest[0] if has_bias else None
            extra = rest[1:] if has_bias else rest
            g = head_rows(w[2 * e :], heads, hd, None if b is None else b[2 * e :], extra)
            return torch.cat((g, head_columns(out, heads, hd)), dim=-2)

        n_q, n_k, n_v = e, e, e
    else:
        qk_keys = ("q_proj_weight", "k_proj_weight", *qkv_bias, *bias_k)

        def qk(wq, wk, *rest):
            b = rest[0] if has_bias else None
            extra = rest[1:] if has_bias else rest
            g = head_rows(wq, heads, hd, None if b is None else b[:e])
            h = head_rows(wk, heads, hd, None if b is None else b[e : 2 * e], extra)
            return torch.cat((g, h), dim=-2)

        vo_keys = ("v_proj_weight", *qkv_bias, *bias_v)

        def vo(wv, *rest, out):
            b = rest[0] if has_bias else None
            extra = rest[1:] if has_bias else rest
            g = head_rows(wv, heads, hd, None if b is None else b[2 * e :], extra)
            return torch.cat((g, head_columns(out, heads, hd)), dim=-2)

        n_q, n_k, n_v = e, module.kdim, module.vdim

    qk_params = shapes(*qk_keys)
    vo_params = {**shapes(*vo_keys), out_w: module.out_proj.weight.shape}
    n_qk = n_q + int(has_bias)
    m_qk = n_k + int(has_bias) + len(bias_k)
    n_vo = n_v + int(has_bias) + len(bias_v)

    def vo_layout(*tensors):
        return vo(*tensors[:-1], out=tensors[-1])

    return [
        PairSpec("query-key", path, qk_params, qk, n_qk, m_qk, hd, heads),
        PairSpec("value-output", path, vo_params, vo_layout, n_vo, e, hd, heads),
    ]


def manifold_parameter_groups(
    model: torch.nn.Module, metric: str, eps: float
) -> List[SymmetryGroup]:
    """Groups for parameters the user declared as ``geoopt.ManifoldParameter``.

    The project's quotients get the requested metric; geoopt's own manifolds (sphere,
    Stiefel...) are used as declared; Euclidean ones are left to the adaptive geometry.
    """
    groups = []
    for name, p in model.named_parameters():
        if not isinstance(p, geoopt.ManifoldParameter) or not p.requires_grad:
            continue
        manifold = p.manifold
        if is_plain_euclidean(manifold):
            continue
        if isinstance(manifold, QuotientManifold):
            manifold = manifold.with_metric(metric, eps)
        groups.append(whole_parameter_group(name, p.shape, manifold, kind="manifold-parameter"))
    return groups
