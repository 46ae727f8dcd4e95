"""Multi-head self-attention whose per-head weight pairs live on GL quotients."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from geoopt import ManifoldParameter
from torch import nn

from .._checks import check_positive_int
from ..manifolds import GLQuotient

__all__ = ["QuotientMultiheadAttention"]


class QuotientMultiheadAttention(nn.Module):
    r"""Multi-head attention parametrised by per-head Q/K and V/O factor pairs.

    With :math:`\bar x = [x, 1]` (the input augmented with a one, if ``bias``), head
    :math:`i` of dimension :math:`d` = ``embed_dim // num_heads`` computes

    .. math::

        s^{(i)}_{jk} = \frac{\bar x_j\, G^{(i)}_{QK} H^{(i)\top}_{QK}\, \bar x_k^\top}{\sqrt d},
        \qquad
        y_j = \sum_i \sum_k \operatorname{softmax}_k(s^{(i)}_{j\cdot})\,
            \bar x_k\, G^{(i)}_{VO} H^{(i)\top}_{VO} + b_O .

    The pairs are stored as two batched :class:`geoopt.ManifoldParameter`:

    * ``qk``, shape ``(num_heads, 2 (E + 1), d)`` on ``GLQuotient(E + 1, E + 1)``:
      :math:`G_{QK} = [W_Q^{(i)\top}; b_Q^{(i)}]`, :math:`H_{QK} = [W_K^{(i)\top}; b_K^{(i)}]`;
    * ``vo``, shape ``(num_heads, (E + 1) + E, d)`` on ``GLQuotient(E + 1, E)``:
      :math:`G_{VO} = [W_V^{(i)\top}; b_V^{(i)}]`, :math:`H_{VO} = W_O[:, \text{head } i]`,

    where :math:`W_Q^{(i)}` are the rows of head :math:`i` of
    :class:`torch.nn.MultiheadAttention`'s ``in_proj_weight`` (likewise K, V) and
    ``E = embed_dim``; without ``bias`` the bias rows are dropped (``E + 1 -> E``) and
    there is no output bias :math:`b_O` (an ordinary parameter ``out_bias``). The output
    depends on the factors only through the products, so it is invariant under
    independent per-head actions :math:`(G, H) \mapsto (G A^{-1}, H A^\top)`,
    :math:`A \in \mathrm{GL}(d)`, on both pairs.

    Parameters
    ----------
    embed_dim, num_heads : int
        As for :class:`torch.nn.MultiheadAttention`; ``num_heads`` must divide
        ``embed_dim``.
    metric : {"mix", "inv"}
        The GL-invariant metric of both quotients.
    bias : bool
        Learn the Q/K/V biases (as last factor rows) and the output bias.
    batch_first : bool
        Inputs are ``(batch, seq, feature)`` if true, else ``(seq, batch, feature)``.
    dropout : float
        Dropout probability on the attention weights (training mode only).
    eps : float
        Relaxation of the quotient metrics.
    generator : torch.Generator, optional
        Source of randomness for the initialisation.
    device, dtype
        Factory keyword arguments.

    Notes
    -----
    The initial function has the distribution of a fresh
    :class:`torch.nn.MultiheadAttention` (Xavier-uniform input projection,
    Kaiming-uniform output projection, zero biases). :meth:`from_torch` and
    :meth:`to_torch` convert exactly. Self-attention and attention with separate
    ``key``/``value`` tensors of the same ``embed_dim`` are supported; ``kdim``,
    ``vdim``, ``add_bias_kv`` and ``add_zero_attn`` are not.
    As a replacement for ``nn.TransformerEncoderLayer.self_attn`` it works in train and
    eval mode (the class attributes ``in_proj_bias = None`` and
    ``_qkv_same_embed_dim = False`` turn the layer's fused fast path off). An
    ``nn.TransformerEncoder`` built around such layers turns its nested-tensor path off
    by itself; after swapping ``self_attn`` into an *existing* encoder set
    ``encoder.use_nested_tensor = False``.
    """

    # attributes that nn.TransformerEncoderLayer inspects before taking its fused fast
    # path: with these it always calls forward() instead
    in_proj_bias = None
    _qkv_same_embed_dim = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        metric: str = "mix",
        bias: bool = True,
        batch_first: bool = True,
        dropout: float = 0.0,
        eps: float = 0.0,
        *,
        generator: Optional[torch.Generator] = None,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        self.embed_dim = check_positive_int(embed_dim, "embed_dim")
        self.num_heads = check_positive_int(num_heads, "num_heads")
        if embed_dim % num_heads:
            raise ValueError(f"`num_heads` ({num_heads}) must divide `embed_dim` ({embed_dim})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {dropout}")
        self.head_dim = embed_dim // num_heads
        self.batch_first = bool(batch_first)
        self.dropout = float(dropout)
        self.has_bias = bool(bias)
        n_in = embed_dim + int(bias)
        self.qk_manifold = GLQuotient(n_in, n_in, metric=metric, eps=eps)
        self.vo_manifold = GLQuotient(n_in, embed_dim, metric=metric, eps=eps)
        factory = {"device": device, "dtype": dtype}
        self.qk = ManifoldParameter(
            self.qk_manifold.origin(num_heads, 2 * n_in, self.head_dim, **factory),
            manifold=self.qk_manifold,
        )
        self.vo = ManifoldParameter(
            self.vo_manifold.origin(num_heads, n_in + embed_dim, self.head_dim, **factory),
            manifold=self.vo_manifold,
        )
        if bias:
            self.out_bias = nn.Parameter(torch.zeros(embed_dim, **factory))
        else:
            self.register_parameter("out_bias", None)
        self.reset_parameters(generator=generator)

    # ------------------------------------------------------------------ conversion
    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Re-draw the weights as :class:`torch.nn.MultiheadAttention` would."""
        e = self.embed_dim
        # drawn where the generator lives (a CPU generator may seed a layer on the GPU)
        source = self.qk.device if generator is None else generator.device
        in_proj = torch.empty(3 * e, e, device=source, dtype=self.qk.dtype)
        nn.init.xavier_uniform_(in_proj, generator=generator)
        out_proj = torch.empty(e, e, device=source, dtype=self.qk.dtype)
        nn.init.kaiming_uniform_(out_proj, a=math.sqrt(5), generator=generator)
        in_proj, out_proj = in_proj.to(self.qk.device), out_proj.to(self.qk.device)
        factory = {"device": self.qk.device, "dtype": self.qk.dtype}
        in_bias = torch.zeros(3 * e, **factory) if self.has_bias else None
        out_bias = torch.zeros(e, **factory) if self.has_bias else None
        self.load_projections(in_proj, in_bias, out_proj, out_bias)

    @torch.no_grad()
    def load_projections(
        self,
        in_proj_weight: torch.Tensor,
        in_proj_bias: Optional[torch.Tensor],
        out_proj_weight: torch.Tensor,
        out_proj_bias: Optional[torch.Tensor],
    ) -> None:
        """Set the factors from :class:`torch.nn.MultiheadAttention`-style projections.

        ``in_proj_weight`` is ``(3E, E)`` (rows Q, K, V), ``out_proj_weight`` ``(E, E)``.
        The biases must be given iff the module has ``bias=True``.
        """
        e, nh, d = self.embed_dim, self.num_heads, self.head_dim
        if (in_proj_bias is None) == self.has_bias or (out_proj_bias is None) == self.has_bias:
            raise ValueError("biases must be given exactly when the module has bias=True")

        def input_factor(block: int) -> torch.Tensor:
            w = in_proj_weight[block * e : (block + 1) * e]  # (E_out, E_in)
            rows = [w.mT]
            if self.has_bias:
                rows.append(in_proj_bias[block * e : (block + 1) * e].unsqueeze(0))
            f = torch.cat(rows, dim=0)  # (E_in [+1], E_out)
            return f.reshape(f.shape[0], nh, d).transpose(0, 1)  # (nh, E_in [+1], d)

        g_q, h_k, g_v = input_factor(0), input_factor(1), input_factor(2)
        h_o = out_proj_weight.reshape(e, nh, d).transpose(0, 1)  # (nh, E, d)
        self.qk.copy_(self.qk_manifold.from_factors(g_q, h_k))
        self.vo.copy_(self.vo_manifold.from_factors(g_v, h_o))
        if self.has_bias:
            self.out_bias.copy_(out_proj_bias)

    def projections(
        self,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
        """``(in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias)`` as in torch."""
        e = self.embed_dim
        g_q, h_k = self.qk_manifold.factors(self.qk)
        g_v, h_o = self.vo_manifold.factors(self.vo)

        def flat(f: torch.Tensor) -> torch.Tensor:  # (nh, E_in [+1], d) -> (E_in [+1], E)
            return f.transpose(0, 1).reshape(f.shape[1], e)

        blocks = [flat(f) for f in (g_q, h_k, g_v)]
        in_proj_weight = torch.cat([b[:e].mT for b in blocks], dim=0)
        in_proj_bias = torch.cat([b[e] for b in blocks]) if self.has_bias else None
        out_proj_weight = flat(h_o)
        return in_proj_weight, in_proj_bias, out_proj_weight, self.out_bias

    @classmethod
    def from_torch(
        cls, mha: nn.MultiheadAttention, metric: str = "mix", eps: float = 0.0
    ) -> QuotientMultiheadAttention:
        """The same function as ``mha`` (same ``batch_first`` and ``dropout``)."""
        if not mha._qkv_same_embed_dim:
            raise ValueError("kdim/vdim different from embed_dim are not supported")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported")
        weight = mha.in_proj_weight
        out = cls(
            mha.embed_dim,
            mha.num_heads,
            metric=metric,
            bias=mha.in_proj_bias is not None,
            batch_first=mha.batch_first,
            dropout=mha.dropout,
            eps=eps,
            device=weight.device,
            dtype=weight.dtype,
        )
        out.load_projections(
            weight.detach(),
            None if mha.in_proj_bias is None else mha.in_proj_bias.detach(),
            mha.out_proj.weight.detach(),
            None if mha.out_proj.bias is None else mha.out_proj.bias.detach(),
        )
        return out

    @torch.no_grad()
    def to_torch(self) -> nn.MultiheadAttention:
        """A :class:`torch.nn.MultiheadAttention` computing the same function."""
        w_in, b_in, w_out, b_out = self.projections()
        mha = nn.MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            dropout=self.dropout,
            bias=self.has_bias,
            batch_first=self.batch_first,
            device=w_in.device,
            dtype=w_in.dtype,
        )
        mha.in_proj_weight.copy_(w_in)
        mha.out_proj.weight.copy_(w_out)
        if self.has_bias:
            mha.in_proj_bias.copy_(b_in)
            mha.out_proj.bias.copy_(b_out)
        return mha

    def qk_product(self) -> torch.Tensor:
        r"""The invariant bilinear forms :math:`G_{QK} H_{QK}^\top`, ``(num_heads, E+1, E+1)``."""
        return self.qk_manifold.product(self.qk)

    def vo_product(self) -> torch.Tensor:
        r"""The invariant maps :math:`G_{VO} H_{VO}^\top`, ``(num_heads, E+1, E)``."""
        return self.vo_manifold.product(self.vo)

    # ------------------------------------------------------------------ forward
    def _augment(self, x: torch.Tensor) -> torch.Tensor:
        if not self.has_bias:
            return x
        return torch.cat((x, x.new_ones(*x.shape[:-1], 1)), dim=-1)

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor] = None,
        value: Optional[torch.Tensor] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = False,
        attn_mask: Optional[torch.Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Attention output and (optionally) attention weights.

        Same call signature and mask conventions as
        :meth:`torch.nn.MultiheadAttention.forward` (boolean masks: ``True`` means
        *not allowed*; float masks are added to the scores), except that ``key``
        defaults to ``query``, ``value`` to ``key``, ``need_weights`` to ``False``,
        and ``is_causal=True`` without ``attn_mask`` builds the causal mask.

        Returns
        -------
        output : torch.Tensor
            Shape of ``query``.
        weights : torch.Tensor or None
            ``(batch, L, S)`` (averaged over heads) or ``(batch, num_heads, L, S)``
            if ``need_weights``, else ``None``.
        """
        key = query if key is None else key
        value = key if value is None else value
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        batch, length, _ = query.shape
        source = key.shape[1]

        g_q, h_k = self.qk_manifold.factors(self.qk)
        g_v, h_o = self.vo_manifold.factors(self.vo)
        q = torch.einsum("bln,hnd->bhld", self._augment(query), g_q)
        k = torch.einsum("bsn,hnd->bhsd", self._augment(key), h_k)
        v = torch.einsum("bsn,hnd->bhsd", self._augment(value), g_v)
        scores = (q @ k.mT) / math.sqrt(self.head_dim)  # (B, H, L, S)

        if is_causal and attn_mask is None:
            attn_mask = torch.ones(length, source, dtype=torch.bool, device=query.device).triu(1)
        if attn_mask is not None:
            mask = _additive(attn_mask, scores.dtype)
            if mask.dim() == 3:
                mask = mask.reshape(batch, self.num_heads, length, source)
            scores = scores + mask
        if key_padding_mask is not None:
            scores = scores + _additive(key_padding_mask, scores.dtype).reshape(batch, 1, 1, source)
        weights = torch.softmax(scores, dim=-1)
        if self.dropout > 0.0:
            weights = F.dropout(weights, p=self.dropout, training=self.training)
        context = weights @ v  # (B, H, L, d)
        out = torch.einsum("bhld,hed->ble", context, h_o)
        if self.out_bias is not None:
            out = out + self.out_bias

        if unbatched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        if average_attn_weights:
            weights = weights.mean(dim=1)
        return out, (weights.squeeze(0) if unbatched else weights)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"metric={self.qk_manifold.metric!r}, bias={self.has_bias}, "
            f"batch_first={self.batch_first}"
        )


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean masks (``True`` = not allowed) become ``-inf``/``0``; float masks pass."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf")
        )
    return mask.to(dtype)
