"""Symmetries of Hugging Face transformers, detected by module structure (not by names).

Attention modules are recognised by their children and attributes, never by full
parameter names (those changed between transformers 4.x and 5.x):

* separate projections in one module: ``q_proj/k_proj/v_proj`` + ``o_proj``, ``out_proj``
  or ``dense`` (ViT 5.x, CLIP, LLaMA-family, BART, OPT, Whisper...), ``q_lin/k_lin/v_lin``
  + ``out_lin`` (DistilBERT), ``q/k/v/o`` (T5 self- and cross-attention);
* split modules: ``X.{self,attention}.{query,key,value}`` + ``X.output.dense``
  (BERT, RoBERTa, ViT 4.x...);
* GPT-2's fused ``Conv1D`` ``c_attn`` (``(in, 3d)``: Q columns ``[0, d)``, K ``[d, 2d)``,
  V ``[2d, 3d)``) and ``c_proj`` (rows of head ``i``), with ``q_attn`` for cross-attention.

The head size comes from the module (``head_dim``, ``attention_head_size``,
``key_value_proj_dim``), never from ``hidden / heads``. Grouped-query attention shares
one group element per key/value head: its query heads (Q/K) or output slices (V/O) are
stacked as extra rows of one factor. Q/K under rotary position embeddings is quotiented
by the rotary-commuting subgroup (:class:`~geoopt_quotient.RotaryGLQuotient`, see
:func:`rotary_geometry`); under per-head Q/K normalisation it is left to the adaptive
geometry with a note. Hugging Face attention with a fused QKV ``nn.Linear`` is split by
its class's row layout (:func:`fused_rows`). Modules that look like attention but do not
fit these patterns are reported in notes, never guessed.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from .._model_state import preserved_model_state
from .layouts import PairSpec, head_columns, head_rows
from .probe import (
    ForwardRecord,
    canonical_rotary,
    local_tolerance,
    moved_by_element,
    pair_holds,
    recorded_forward,
    rotary_planes,
    why_not_runnable,
)
from .verify import REPORT, SymmetryNotProvenWarning

__all__ = [
    "Findings",
    "attention_pairs",
    "bert_style_pairs",
    "find_attention",
    "fused_attention_pairs",
    "fused_qkv_pairs",
    "fused_rows",
    "gpt2_pairs",
    "linear_attention_pairs",
    "rotary_geometry",
]

HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_attn_heads")
HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "key_value_proj_dim", "head_size", "dim_head")
KV_HEADS_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads")

#: (query, key, value, candidate output names) of attention with four projections.
SEPARATE_CONVENTIONS: Tuple[Tuple[str, str, str, Tuple[str, ...]], ...] = (
    ("q_proj", "k_proj", "v_proj", ("o_proj", "out_proj", "dense", "Wo")),
    ("q_lin", "k_lin", "v_lin", ("out_lin",)),
    ("q", "k", "v", ("o",)),
    ("Wq", "Wk", "Wv", ("dense",)),
    ("project_q", "project_k", "project_v", ("attention_out",)),
    ("query_proj", "key_proj", "value_proj", ("out_proj",)),
)
#: Children that add a per-head bias to the attention scores (symmetry-neutral):
#: T5's bucketed relative bias, Swin's relative position bias table, ProphetNet's relative
#: position logits (computed from the layer's input).
SCORE_BIAS_CHILDREN = (
    "relative_attention_bias",
    "relative_position_bias",
    "relative_pos_embeddings",
)
#: Parameters of an attention module that act on the scores alone, the same for every
#: group element: attention sinks (a learned logit per head in the softmax's denominator:
#: GPT-OSS, Granite SWA).
SCORE_NEUTRAL_PARAMETERS = ("sinks",)
#: Children that act on queries/keys per head: the Q/K symmetry does not survive them.
QK_BREAKING_CHILDREN = (
    "qk_norm",
    "query_layernorm",
    "key_layernorm",
    "q_norm",
    "k_norm",
    "query_norm",
    "key_norm",
    "q_layernorm",
    "k_layernorm",
    "distance_embedding",
)
#: The children of :data:`QK_BREAKING_CHILDREN` that are norms of the queries or keys.
QK_NORM_CHILDREN = QK_BREAKING_CHILDREN[:9]
#: Children that act on the values or the attention output (an elementwise or per-head
#: sigmoid/softplus gate computed from the input, a norm of the concatenated heads, Doge's
#: ``dt_proj`` and ``A``, a mask of the scores computed from the values): V/O's GL(h) does
#: not survive them (a gate leaves diagonal scalings, not quotiented here), Q/K does (they
#: never see the queries or keys; the Q/K pair is replayed on its module to be sure).
OUTPUT_BREAKING_CHILDREN = (
    "gate_proj",
    "g_proj",
    "attn_sub_norm",
    "dt_proj",
    "A",
    # differential attention (DiffLlama): softmax_1 V - lambda softmax_2 V, then a group norm
    "groupnorm",
    "lambda_q1",
    "lambda_k1",
    "lambda_q2",
    "lambda_k2",
)
#: Why V/O is left adaptive under such a child.
OUTPUT_BROKEN = (
    "{names} act on the values or the attention output (a gate from the input, a norm of "
    "the concatenated heads, a mask computed from the values): V/O's GL(h) does not "
    "survive them (an elementwise gate leaves only diagonal scalings, which are not "
    "quotiented): V/O left to the adaptive geometry (Q/K is handled)"
)
ROTARY_FORWARD_ARGS = (
    "position_embeddings",
    "rotary_pos_emb",
    "freqs_cis",
    "rotary_emb",
    "sinusoidal_pos",
)
ROTARY_CONFIG_ATTRS = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim", "rotary_pct")


def _prefixed(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@dataclass
class Findings:
    """What a detector found: pair specs, notes, and the module paths it accounted for.

    Notes are collected as ``(message, module path)`` and rendered with one line per
    message, module paths collapsed over layer indices (:meth:`rendered_notes`).
    """

    specs: List[PairSpec] = field(default_factory=list)
    claimed: Set[str] = field(default_factory=set)
    _notes: Dict[str, List[str]] = field(default_factory=dict)
    #: specs to replay on their module before they are kept, with what a failure means
    to_check: List[Tuple[PairSpec, str]] = field(default_factory=list)

    def note(self, message: str, path: str = "") -> None:
        self._notes.setdefault(message, []).append(path)

    def add_replayed(self, specs: Sequence[PairSpec], why: str, claim: str = "") -> None:
        """Add ``specs``, each replayed on its module before it is kept (``why``: what a
        failure there means, :func:`check_locally`); ``claim``: the module path they
        account for, if any."""
        for spec in specs:
            self.specs.append(spec)
            self.to_check.append((spec, why))
        if claim:
            self.claimed.add(claim)

    def retract(self, path: str, marker: str) -> None:
        """Withdraw the notes on ``path`` whose message contains ``marker`` (a later
        detector handled what they said was left out)."""
        for message in [m for m in self._notes if marker in m]:
            kept = [p for p in self._notes[message] if p != path]
            if kept:
                self._notes[message] = kept
            else:
                del self._notes[message]

    def extend(self, other: Findings) -> None:
        self.specs.extend(other.specs)
        self.to_check.extend(other.to_check)
        self.claimed |= other.claimed
        for message, paths in other._notes.items():
            self._notes.setdefault(message, []).extend(paths)

    def rendered_notes(self) -> List[str]:
        out = []
        for message, paths in self._notes.items():
            paths = [p for p in paths if p] or [""]
            where = collapse_paths(paths)
            out.append(f"{where}: {message}" if where else message)
        return out


def collapse_paths(paths: Sequence[str]) -> str:
    """``layers.0.attn``, ``layers.1.attn`` -> ``layers.*.attn (2 modules)``."""
    if not paths or paths == [""]:
        return ""
    if len(paths) == 1:
        return paths[0]
    patterns: Dict[str, int] = {}
    for p in paths:
        key = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", p)
        patterns[key] = patterns.get(key, 0) + 1
    parts = [f"{k} ({n} modules)" if n > 1 else k for k, n in patterns.items()]
    if len(parts) > 4:
        parts = [*parts[:3], f"... ({len(paths)} modules in all)"]
    return ", ".join(parts)


def module_attribute(module: object, name: str) -> object:
    """``getattr(module, name, None)``, without the exception ``nn.Module.__getattr__``
    raises for an absent name (most names discovery asks for are absent, and the
    exception costs more than the lookup)."""
    if getattr(type(module), "__getattr__", None) is not torch.nn.Module.__getattr__:
        return getattr(module, name, None)  # (not a module, or one that answers absent names)
    own = module.__dict__
    if name in own:
        return own[name]
    if (
        name in own.get("_modules", ())
        or name in own.get("_parameters", ())
        or name in own.get("_buffers", ())
        or hasattr(type(module), name)
    ):
        return getattr(module, name, None)
    return None


def _int_attr(module: torch.nn.Module, names: Sequence[str]) -> Optional[int]:
    for name in names:
        value = module_attribute(module, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _linear(module: torch.nn.Module, name: str) -> Optional[torch.nn.Linear]:
    child = module_attribute(module, name)
    return child if isinstance(child, torch.nn.Linear) else None


def _has_params(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _has_trainable(module: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


# ---------------------------------------------------------------- generic layouts
def linear_attention_pairs(
    module_path: str,
    projections: Tuple[Tuple[str, torch.nn.Linear], ...],
    num_heads: int,
    head_dim: int,
    *,
    num_kv_heads: Optional[int] = None,
    query_key: bool = True,
    value_output: bool = True,
    rotary_dim: int = 0,
    pairing: str = "half",
    head_order: Optional[Sequence[int]] = None,
) -> List[PairSpec]:
    """Q/K and V/O pairs of attention built from four ``nn.Linear`` (q, k, v, o).

    Parameters
    ----------
    module_path : str
        Path of the attention module (used in labels).
    projections : tuple of (str, torch.nn.Linear)
        Each projection's module path and the module, in the order q, k, v, o.
    num_heads, head_dim : int
        Query heads and the per-head size.
    num_kv_heads : int, optional
        Key/value heads (grouped-query attention; default ``num_heads``). Query head
        ``i`` uses key/value head ``i // (num_heads // num_kv_heads)``; each
        key/value head gets one group element, its query heads' Q slices (Q/K) or
        output slices (V/O) are stacked as extra rows of ``G`` or ``H``.
    query_key, value_output : bool
        Which pairs to build.
    rotary_dim : int
        Dimensions of each query/key head that rotary embeddings rotate (the first
        ones; 0: none). With ``rotary_dim > 0`` the Q/K pair is a point of
        :class:`~geoopt_quotient.RotaryGLQuotient`.
    pairing : {"half", "interleaved"}
        How the rotary embedding pairs those dimensions into planes.
    head_order : sequence of int, optional
        A permutation of each Q/K head's dimensions (column ``c`` of the point is
        dimension ``head_order[c]`` of the head), for rotary planes that ``rotary_dim``
        and ``pairing`` on the first dimensions do not describe (see
        :func:`~geoopt_quotient.symmetry.probe.canonical_rotary`).

    Returns
    -------
    list of PairSpec
        Biases of q, k, v are appended as rows of their factors; the bias of o is in
        no pair. Points have shape ``(kv_heads, n + m, head_dim)``.
    """
    (q_path, q), (k_path, k), (v_path, v), (o_path, o) = projections
    n_kv = num_heads if num_kv_heads is None else num_kv_heads
    group = num_heads // n_kv

    def entries(path: str, linear: torch.nn.Linear) -> Dict[str, torch.Size]:
        out = {_prefixed(path, "weight"): linear.weight.shape}
        if linear.bias is not None:
            out[_prefixed(path, "bias")] = linear.bias.shape
        return out

    def factor(linear: torch.nn.Linear, heads: int):
        def build(weight, *bias):
            return head_rows(weight, heads, head_dim, bias[0] if bias else None)

        return build, 1 + int(linear.bias is not None)

    def stacked(rows: torch.Tensor) -> torch.Tensor:
        # (heads, r, h) -> (kv_heads, group * r, h): query heads of one kv head stacked
        return rows.reshape(n_kv, group * rows.shape[-2], head_dim)

    specs = []
    if query_key:
        q_build, q_arity = factor(q, num_heads)
        k_build, _ = factor(k, n_kv)

        def qk_layout(*t):
            point = torch.cat((stacked(q_build(*t[:q_arity])), k_build(*t[q_arity:])), dim=-2)
            return _reordered(point, head_order)

        n_qk = group * (q.in_features + int(q.bias is not None))
        m_qk = k.in_features + int(k.bias is not None)
        params = {**entries(q_path, q), **entries(k_path, k)}
        specs.append(
            PairSpec(
                "query-key",
                module_path,
                params,
                qk_layout,
                n_qk,
                m_qk,
                head_dim,
                n_kv,
                rotary_dim,
                pairing,
            )
        )
    if value_output:
        v_build, v_arity = factor(v, n_kv)

        def vo_layout(*t):
            h = stacked(head_columns(t[-1], num_heads, head_dim))
            return torch.cat((v_build(*t[:v_arity]), h), dim=-2)

        n_vo = v.in_features + int(v.bias is not None)
        params = {**entries(v_path, v), _prefixed(o_path, "weight"): o.weight.shape}
        specs.append(
            PairSpec(
                "value-output",
                module_path,
                params,
                vo_layout,
                n_vo,
                group * o.out_features,
                head_dim,
                n_kv,
            )
        )
    return specs


def _reordered(point: torch.Tensor, head_order: Optional[Sequence[int]]) -> torch.Tensor:
    """``point`` with each head's dimensions in ``head_order`` (an index-only map)."""
    if head_order is None:
        return point
    return point[..., torch.as_tensor(list(head_order), device=point.device)]


# ---------------------------------------------------------------- structure checks
def _rotary_reason(
    owner: torch.nn.Module, model_config: object, model_has_rotary: bool
) -> Optional[str]:
    """Why Q/K of ``owner`` may be under rotary embeddings, or ``None``."""
    config = getattr(owner, "config", None) or model_config
    if getattr(config, "alibi", None) is True:
        return None  # ALiBi (Falcon, Bloom): a bias on the scores, no rotation
    try:
        params = inspect.signature(owner.forward).parameters
    except (TypeError, ValueError):
        params = {}
    for name in ROTARY_FORWARD_ARGS:
        if name in params:
            return f"its forward takes `{name}` (rotary position embeddings)"
    for name, child in owner.named_children():
        if "rotary" in type(child).__name__.lower() or hasattr(child, "inv_freq"):
            return f"it has a rotary embedding child `{name}`"
    config = getattr(owner, "config", None)
    if config is None:
        if model_has_rotary:
            return "the model has a rotary position embedding module"
        config = model_config
    if config is not None:
        for name in ROTARY_CONFIG_ATTRS:
            if getattr(config, name, None) is not None:
                return f"its config sets `{name}` (rotary position embeddings)"
        if str(getattr(config, "position_embedding_type", "")).lower() in ("rotary", "rope"):
            return "its config uses rotary position embeddings"
    return None


def _qk_breakers(owner: torch.nn.Module) -> List[str]:
    found = [
        n for n in QK_BREAKING_CHILDREN if isinstance(getattr(owner, n, None), torch.nn.Module)
    ]
    kind = getattr(owner, "position_embedding_type", None)
    if isinstance(kind, str) and kind.lower() not in ("absolute", "none", ""):
        found.append(f"position_embedding_type={kind!r}")
    return found


def _gainless_norm_reason(names: Sequence[str], rotary: bool) -> str:
    r"""Why a q/k norm without gains (Llama 4's L2 norm of each rotated head) leaves no
    group the library quotients: :math:`A = c\,O` survives for every orthogonal :math:`O`
    (that commutes with the rotations, under rotary embeddings: a rotation of each rotary
    plane), a continuous subgroup of :math:`\mathrm{GL}(h)` without a quotient here."""
    subgroup = (
        "a rotation of each rotary plane (U(1) per plane) times one scale c > 0 per head, "
        "which the rotary quotient does not divide by (it divides by all of C* per plane)"
        if rotary
        else "c O with O orthogonal (O(h) times a scale), a subgroup without a quotient here"
    )
    return (
        f"{' and '.join(names)} normalise each head's queries and keys without gains, so "
        "an action A on a head's Q rows survives only if it keeps their norm up to a "
        f"factor (A = c O, O orthogonal): the continuous group left is {subgroup}"
    )


def _qk_norm_reason(
    names: Sequence[str], norms: Sequence[object], head_dim: int, rotary: bool
) -> str:
    r"""Why per-head (or all-heads) q/k norms leave no group on Q/K to quotient.

    With :math:`\tilde q = \gamma \odot A u / \mathrm{rms}(A u)` (:math:`u` a head's
    query, :math:`A` the candidate action on its rows of :math:`W_q`), the scores can be
    restored by an action on the key side only if :math:`\mathrm{rms}(A u) \propto
    \mathrm{rms}(u)` for every :math:`u`, i.e. :math:`A = c\,O` with :math:`O`
    orthogonal, and :math:`D_\gamma O D_\gamma^{-1}` is again such a map (and, under
    rotary embeddings, commutes with the rotations). For gains that differ from one
    dimension (or rotary plane) to the next, that leaves :math:`O = \pm 1` per dimension
    (per plane): a finite group of sign flips shared with K, without tangent directions.
    """
    sizes = {int(getattr(getattr(n, "weight", None), "numel", lambda: 0)()) for n in norms}
    if sizes == {0}:
        return _gainless_norm_reason(names, rotary)
    together = bool(sizes) and min(sizes) > head_dim
    scope = "over all heads together" if together else "over each head"
    scale = "one c > 0 for all heads" if together else "a scale c > 0 per head"
    gains = "per key/value head and" if together else "shared by the heads, per"
    unit = "rotary plane" if rotary else "dimension"
    return (
        f"{' and '.join(names)} normalise the queries and keys {scope}, so an action A on "
        "a head's Q rows survives only if it keeps their RMS up to a factor (A = c O, O "
        "orthogonal) and the norm's gains turn it into such a map again"
        + (" that commutes with the rotary rotations" if rotary else "")
        + f"; for gains that differ from one {unit} to the next this leaves O = +-1 per "
        f"{unit} (sign flips shared with K: a finite group, nothing to quotient) and "
        f"{scale}, which the norm removes only up to its eps and which acts on W_q alone "
        "(no pair with K); the one exact continuous symmetry, the gains of q_norm and "
        f"k_norm scaled by s and 1/s ({gains} {unit}), acts on the gains, not on Q/K, and "
        "is not quotiented"
    )


def _unexpected_parameters(owner: torch.nn.Module, known: Set[str]) -> List[str]:
    """Direct parameters and parameter-holding children of ``owner`` outside ``known``."""
    out = [
        name
        for name, _ in owner.named_parameters(recurse=False)
        if name not in SCORE_NEUTRAL_PARAMETERS
    ]
    for name, child in owner.named_children():
        if name in known or name in SCORE_BIAS_CHILDREN or name in QK_BREAKING_CHILDREN:
            continue
        if _has_params(child):
            out.append(name)
    return out


@dataclass
class _Context:
    model_config: object
    model_has_rotary: bool
    model: Optional[torch.nn.Module] = None

    def record(self) -> Tuple[Optional[ForwardRecord], str]:
        """The model's recorded probe forward (one per model, cached), or why there is none."""
        if self.model is None:
            return None, "no model to run"
        return recorded_forward(self.model)


#: ``f(record) -> (..., heads, head_dim)``: a module's queries (or keys) per head, read
#: from the recorded outputs of its projections.
HeadsReader = Callable[[ForwardRecord], Optional[torch.Tensor]]


def _rows_reader(linear_path: str, rows: torch.Tensor) -> HeadsReader:
    """Heads ``rows`` (``(heads, head_dim)`` output rows) of a recorded ``nn.Linear``."""

    def read(record: ForwardRecord) -> Optional[torch.Tensor]:
        out = record.linear_outputs.get(linear_path)
        if out is None:
            return None
        return out[..., rows.reshape(-1)].reshape(*out.shape[:-1], *rows.shape)

    return read


def attention_pairs(
    path: str,
    owner: torch.nn.Module,
    projections: Tuple[Tuple[str, torch.nn.Linear], ...],
    context: _Context,
    extra_known: Sequence[str] = (),
) -> Findings:
    """Pairs of one attention module with four ``nn.Linear`` projections, after checks.

    ``owner`` holds the head attributes; ``projections`` are (path, Linear) for q, k, v,
    o. Unexpected shapes or parameters produce notes instead of pairs.
    """
    found = Findings(claimed={path})
    label = f"attention-like module ({type(owner).__name__})"
    (_, q), (_, k), (_, v), (_, o) = projections
    head_dim = _int_attr(owner, HEAD_DIM_ATTRS)
    if head_dim is None:
        found.note(
            f"{label} has no head-size attribute ({', '.join(HEAD_DIM_ATTRS)}): "
            "heads not guessed, left to the adaptive geometry",
            path,
        )
        return found
    heads, n_kv = _head_counts(owner, q, k, head_dim)
    shapes = (
        f"q {tuple(q.weight.shape)}, k {tuple(k.weight.shape)}, v {tuple(v.weight.shape)}, "
        f"o {tuple(o.weight.shape)}"
    )
    if heads is None or n_kv is None or heads % n_kv:
        found.note(
            f"{label} with head size {head_dim}: head counts do not fit the projections "
            f"({shapes}); left to the adaptive geometry",
            path,
        )
        return found
    known = {p.rsplit(".", 1)[-1] for p, _ in projections} | set(extra_known)
    known |= {p.rsplit(".", 2)[-2] for p, _ in projections if p.endswith(".linear")}
    unexpected, *output_children = _output_children(
        owner, _unexpected_parameters(owner, known), heads
    )
    if unexpected:
        found.note(
            f"{label} has parameters the detector does not know ({', '.join(unexpected)}): "
            "not guessed, left to the adaptive geometry",
            path,
        )
        return found
    qk_ok = q.out_features == heads * head_dim and k.out_features == n_kv * head_dim
    vo_ok = v.out_features == n_kv * head_dim and o.in_features == heads * head_dim
    if not (qk_ok and vo_ok):
        # a module understood only in part (e.g. a gate packed into q_proj) may compute
        # something else entirely: neither pair is claimed
        packed = q.out_features == 2 * o.in_features
        found.note(
            f"{label}: {'Q/K' if not qk_ok else 'V/O'} shapes do not fit {heads} heads "
            f"({n_kv} key/value heads) of size {head_dim} ({shapes})"
            + (PACKED_GATE if packed else "")
            + "; left to the adaptive geometry",
            path,
        )
        return found
    _add_attention_specs(
        found, path, owner, projections, context, (heads, n_kv, head_dim), output_children
    )
    return found


def _head_counts(
    owner: torch.nn.Module, q: torch.nn.Linear, k: torch.nn.Linear, head_dim: int
) -> Tuple[Optional[int], Optional[int]]:
    """``(heads, key/value heads)`` of an attention module: from its attributes
    (:data:`HEADS_ATTRS`, :data:`KV_HEADS_ATTRS`, ``num_key_value_groups``), else from the
    rows of ``q`` and ``k`` when they are whole heads; ``None`` where neither tells."""
    heads = _int_attr(owner, HEADS_ATTRS)
    if heads is None and q.out_features % head_dim == 0:
        heads = q.out_features // head_dim
    n_kv = _int_attr(owner, KV_HEADS_ATTRS)
    groups = _int_attr(owner, ("num_key_value_groups",))
    if n_kv is None and heads is not None and groups is not None and heads % groups == 0:
        n_kv = heads // groups
    if n_kv is None and k.out_features % head_dim == 0:
        n_kv = k.out_features // head_dim
    return heads, n_kv


def _add_attention_specs(
    found: Findings,
    path: str,
    owner: torch.nn.Module,
    projections: Tuple[Tuple[str, torch.nn.Linear], ...],
    context: _Context,
    sizes: Tuple[int, int, int],
    output_children: Tuple[List[str], List[str]],
) -> None:
    """Add the Q/K and V/O pairs of an attention module whose shapes fit ``sizes``
    (``(heads, key/value heads, head_dim)``), with their checks; ``output_children`` are
    the children that break V/O and the per-head output gates (:func:`_output_children`)."""
    heads, n_kv, head_dim = sizes
    output_breakers, head_gates = output_children
    (q_path, _), (k_path, _) = projections[:2]
    readers = (
        _rows_reader(q_path, torch.arange(heads * head_dim).reshape(heads, head_dim)),
        _rows_reader(k_path, torch.arange(n_kv * head_dim).reshape(n_kv, head_dim)),
    )
    query_key, rotary_dim, pairing, order, qk_check = _query_key_group(
        path, owner, context, head_dim, found, readers
    )
    if output_breakers:
        found.note(OUTPUT_BROKEN.format(names=", ".join(output_breakers)), path)
    if output_breakers or head_gates:
        qk_check = qk_check or (
            f"{', '.join(output_breakers + head_gates)} reach the queries or keys after all, "
            "so Q/K's group does not survive them"
        )
    specs = linear_attention_pairs(
        path,
        projections,
        heads,
        head_dim,
        num_kv_heads=n_kv,
        query_key=query_key,
        value_output=not output_breakers,
        rotary_dim=rotary_dim,
        pairing=pairing,
        head_order=order,
    )
    _add_checked(found, specs, qk_check)


#: What a query projection with twice the rows the output reads usually holds.
PACKED_GATE = (
    ": q_proj has twice the rows o_proj reads, as when each head's queries come with an "
    "output gate (Qwen3-Next, Qwen3.5: a sigmoid gate multiplies each head's output "
    "elementwise, which leaves V/O diagonal scalings at most), a layout not guessed"
)
#: Output gates that may scale each head's output by one number (then V/O survives).
GATE_CHILDREN = ("gate_proj", "g_proj")


def _output_children(
    owner: torch.nn.Module, unexpected: List[str], heads: int
) -> Tuple[List[str], List[str], List[str]]:
    r"""Split ``unexpected`` children into ``(unknown, output breakers, per-head gates)``.

    A gate with one output per head (Laguna's ``g_proj`` with ``gating="per-head"``)
    scales each head's output by one number, which commutes with every
    :math:`B \in \mathrm{GL}(h)` acting on that head's values: V/O survives it (and is
    replayed on the module, as always). Other children of
    :data:`OUTPUT_BREAKING_CHILDREN` break V/O.
    """
    head_gates = [
        n for n in unexpected
        if n in GATE_CHILDREN and getattr(_linear(owner, n), "out_features", None) == heads
    ]  # fmt: skip
    breakers = [n for n in unexpected if n in OUTPUT_BREAKING_CHILDREN and n not in head_gates]
    rest = [n for n in unexpected if n not in OUTPUT_BREAKING_CHILDREN]
    return rest, breakers, head_gates


def _add_checked(found: Findings, specs: Sequence[PairSpec], qk_check: Optional[str]) -> None:
    """Add ``specs``; the V/O pair (and the Q/K pair where ``qk_check`` says why) is
    replayed on its module before it is kept (:func:`check_locally`)."""
    for spec in specs:
        found.specs.append(spec)
        if spec.kind == "query-key" and qk_check:
            found.to_check.append((spec, qk_check))
        if spec.kind == "value-output":
            found.to_check.append(
                (
                    spec,
                    "the values pass through something between v and o (a norm of the "
                    "values, a rotation...): only a smaller group, if any, survives (e.g. O(h) "
                    "under a parameter-free norm of each head's values, which the library has no "
                    "quotient for)",
                )
            )


def _query_key_group(
    path: str,
    owner: torch.nn.Module,
    context: _Context,
    head_dim: int,
    found: Findings,
    readers: Tuple[HeadsReader, HeadsReader],
) -> Tuple[bool, int, str, Optional[List[int]], Optional[str]]:
    """Which group acts on Q/K: ``(quotiented, rotary_dim, pairing, head_order, check)``;
    a note says why where Q/K is left to the adaptive geometry, ``check`` why the pair
    must be replayed on its module before it is kept (``None``: no need).

    The rotary planes are read by probing the model's own rotary function
    (:func:`~geoopt_quotient.symmetry.probe.rotary_planes`); names and the config are
    read only on the meta device, where nothing can be computed (with a note).
    """
    breakers = _qk_breakers(owner)
    rotary = _rotary_reason(owner, context.model_config, context.model_has_rotary)
    if breakers:
        norms = [getattr(owner, n, None) for n in breakers]
        if all(n in QK_NORM_CHILDREN for n in breakers):
            why = _qk_norm_reason(breakers, norms, head_dim, rotary is not None)
        else:
            why = (
                "a per-head action on Q/K must commute with them, which no continuous "
                "subgroup of GL(h) is known to do"
            )
        found.note(
            f"Q/K normalised or acted on ({', '.join(breakers)}): {why}: Q/K left "
            "to the adaptive geometry (V/O is handled)",
            path,
        )
        return False, 0, "half", None, None
    record, why_not = context.record()
    if record is None:
        return _unprobed_query_key(path, owner, context, head_dim, found, rotary, why_not)
    reading = rotary_planes(record, path, *readers)
    if reading.reason and not reading.found:  # the module did not run in the probe
        return _unprobed_query_key(path, owner, context, head_dim, found, rotary, reading.reason)
    if reading.reason:
        found.note(
            f"Q/K under rotary position embeddings, but {reading.reason} (read by probing "
            "the model's rotary function): Q/K left to the adaptive geometry (V/O is handled)",
            path,
        )
        return False, 0, "half", None, None
    if reading.found and reading.planes:
        return (True, *canonical_rotary(reading.planes, head_dim), None)
    if rotary is None:
        return True, 0, "half", None, None
    check = (
        f"Q/K looked rotary ({rotary}) but no rotary function was seen rotating its "
        "queries and keys in the probe forward, and a general GL(h) on Q/K changes the "
        "module's output"
    )
    return True, 0, "half", None, check


def _unprobed_query_key(
    path: str,
    owner: torch.nn.Module,
    context: _Context,
    head_dim: int,
    found: Findings,
    rotary: Optional[str],
    why_not: str,
) -> Tuple[bool, int, str, Optional[List[int]], Optional[str]]:
    """Q/K of a model that could not be probed: on the meta device or sharded, the rotary
    geometry read from the config and names (noted as unverified); otherwise left
    adaptive."""
    if rotary is None:
        return True, 0, "half", None, None
    meta = bool(why_not_runnable(owner))  # on the meta device, or sharded (FSDP2)
    geometry, why = rotary_geometry(owner, context.model_config, head_dim)
    if not meta or geometry is None:
        reason = why_not if not meta else why
        found.note(
            f"Q/K under rotary position embeddings ({rotary}), but the rotary planes could "
            f"not be read ({reason}): Q/K left to the adaptive geometry (V/O is handled)",
            path,
        )
        return False, 0, "half", None, None
    found.note(
        f"Q/K under rotary position embeddings ({rotary}): {why_not}, so the rotary "
        f"function was not probed; assumed {geometry[0]} rotating dimensions with "
        f"{geometry[1]!r} pairing, read from the config and the modelling module's names "
        "(not verified: run discovery on the materialised model to read them)",
        path,
    )
    return True, *geometry, None, None


def _partial_rotary_factor(config: object, owner: torch.nn.Module) -> Optional[float]:
    """The config's partial rotary factor for ``owner``'s layer: ``rope_parameters`` may
    hold one dict per layer type (``config.layer_types[owner.layer_idx]``)."""
    rope = getattr(config, "rope_parameters", None)
    types, index = getattr(config, "layer_types", None), getattr(owner, "layer_idx", None)
    if isinstance(rope, dict) and isinstance(types, (list, tuple)) and isinstance(index, int):
        if index < len(types) and isinstance(rope.get(types[index]), dict):
            rope = rope[types[index]]
    candidates = [rope.get("partial_rotary_factor") if isinstance(rope, dict) else None]
    candidates += [getattr(config, name, None) for name in ("partial_rotary_factor", "rotary_pct")]
    return next((float(c) for c in candidates if isinstance(c, (int, float))), None)


def rotary_geometry(
    owner: torch.nn.Module, config: object, head_dim: int
) -> Tuple[Optional[Tuple[int, str]], str]:
    """How rotary embeddings act on the heads of ``owner``, read from its config and names
    (used only where the model's rotary function cannot be probed, e.g. on the meta
    device; see :mod:`~geoopt_quotient.symmetry.probe`): ``((rotary_dim, pairing), "")``,
    or ``(None, reason)`` where it cannot be read.

    The rotating dimensions are the first ``rotary_dim`` of each head: the module's
    ``rotary_ndims`` / ``rotary_dim`` attribute, else ``head_dim`` times the config's
    partial rotary factor (``rope_parameters["partial_rotary_factor"]``,
    ``partial_rotary_factor``, ``rotary_pct``) or its ``rotary_dim``, else all of them.
    The pairing is read from the module that defines the attention class: Hugging
    Face's ``rotate_half`` pairs dimension ``j`` with ``j + rotary_dim / 2``
    (``"half"``), ``rotate_every_two`` pairs ``2j`` with ``2j + 1`` (``"interleaved"``).

    Parameters
    ----------
    owner : torch.nn.Module
        The attention module (the one holding the head attributes).
    config : object
        The model's config, or ``None``.
    head_dim : int
        The head size.

    Returns
    -------
    tuple
        ``((rotary_dim, pairing), "")`` or ``(None, reason)``.
    """
    rotary_dim = _int_attr(owner, ("rotary_ndims", "rotary_dim"))
    if rotary_dim is None and config is not None:
        factor = _partial_rotary_factor(config, owner)
        config_dim = getattr(config, "rotary_dim", None)
        if factor is not None:
            rotary_dim = int(head_dim * factor)
        elif isinstance(config_dim, int) and config_dim > 0:
            rotary_dim = config_dim
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
        return None, f"its rotary size {rotary_dim} does not fit heads of size {head_dim}"
    source = sys.modules.get(type(owner).__module__)
    half, every_two = (hasattr(source, n) for n in ("rotate_half", "rotate_every_two"))
    if half == every_two:
        return None, (
            f"the rotary pairing of {type(owner).__name__} could not be read from its module "
            "(neither or both of rotate_half / rotate_every_two)"
        )
    return (rotary_dim, "half" if half else "interleaved"), ""


# ---------------------------------------------------------------- families
def _separate_projections(
    path: str, module: torch.nn.Module, context: _Context
) -> Optional[Findings]:
    for q_name, k_name, v_name, o_names in SEPARATE_CONVENTIONS:
        query = _projection(module, q_name)
        if query is None:  # most modules: no query child, no need to look further
            continue
        found = [query, _projection(module, k_name), _projection(module, v_name)]
        if any(f is None for f in found):
            continue
        o_found = next((f for n in o_names if (f := _projection(module, n)) is not None), None)
        if o_found is None:
            continue
        if q_name == "q" and _int_attr(module, HEADS_ATTRS + HEAD_DIM_ATTRS) is None:
            continue  # bare q/k/v/o children without head attributes: not attention evidence
        projections = tuple((_prefixed(path, n), linear) for n, linear in (*found, o_found))
        return attention_pairs(path, module, projections, context)
    return None


def _projection(module: torch.nn.Module, name: str) -> Optional[Tuple[str, torch.nn.Linear]]:
    """``(relative path, nn.Linear)`` of child ``name``: the child itself, or the one
    ``nn.Linear`` a parameter-free wrapper holds as ``linear`` (Moshi's ``MoshiLinear``)."""
    child = module_attribute(module, name)
    if isinstance(child, torch.nn.Linear):
        return name, child
    inner = _linear(child, "linear") if isinstance(child, torch.nn.Module) else None
    if inner is None or any(True for _ in child.parameters(recurse=False)):
        return None
    if any(c is not inner for c in child.children()):
        return None
    return f"{name}.linear", inner


def _split_projections(path: str, module: torch.nn.Module, context: _Context) -> Optional[Findings]:
    """``X.{self|attention|self_attention}.{query,key,value}`` with the output in
    ``X.output.dense``."""
    output = module_attribute(module, "output")
    o = _linear(output, "dense") if isinstance(output, torch.nn.Module) else None
    if o is None:
        return None
    for inner_name in ("self", "attention", "self_attention"):  # (Reformer: self_attention)
        inner = getattr(module, inner_name, None)
        if not isinstance(inner, torch.nn.Module) or inner is module:
            continue
        q, k, v = _linear(inner, "query"), _linear(inner, "key"), _linear(inner, "value")
        if q is None or k is None or v is None:
            continue
        inner_path = _prefixed(path, inner_name)
        projections = (
            (_prefixed(inner_path, "query"), q),
            (_prefixed(inner_path, "key"), k),
            (_prefixed(inner_path, "value"), v),
            (_prefixed(path, "output.dense"), o),
        )
        found = attention_pairs(path, inner, projections, context)
        found.claimed |= {inner_path, _prefixed(path, "output")}
        return found
    return None


def _conv1d_class() -> Optional[type]:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return Conv1D


def gpt2_pairs(path: str, module: torch.nn.Module, context: _Context) -> Optional[Findings]:
    """GPT-2-style attention with fused ``Conv1D`` projections (weights stored ``(in, out)``).

    Self-attention: ``c_attn`` columns ``[0, d)`` are Q, ``[d, 2d)`` K, ``[2d, 3d)`` V, head
    ``i`` at offset ``i * h``; cross-attention: Q in ``q_attn``, K and V in ``c_attn``.
    The output ``c_proj`` contributes rows ``i*h:(i+1)*h`` (head ``i``); its bias is in
    no pair.
    """
    conv1d = _conv1d_class()
    c_attn, c_proj = module_attribute(module, "c_attn"), module_attribute(module, "c_proj")
    if conv1d is None or not isinstance(c_attn, conv1d) or not isinstance(c_proj, conv1d):
        return None
    q_attn = module_attribute(module, "q_attn")
    cross = isinstance(q_attn, conv1d)
    found = Findings(claimed={path})
    label = f"attention-like module ({type(module).__name__})"
    heads, head_dim = _int_attr(module, HEADS_ATTRS), _int_attr(module, HEAD_DIM_ATTRS)
    split = _int_attr(module, ("split_size",))
    if head_dim is None and heads and split and split % heads == 0:
        head_dim = split // heads  # OpenAI GPT: view(..., n_head, split_size // n_head)
    d = None if heads is None or head_dim is None else heads * head_dim
    w_attn, w_proj = c_attn.weight, c_proj.weight
    expected = 2 * d if (cross and d) else 3 * d if d else None
    shapes_ok = (
        d is not None
        and w_attn.shape[1] == expected
        and w_proj.shape[0] == d
        and (not cross or q_attn.weight.shape[1] == d)
        and getattr(module, "split_size", d) == d
    )
    known = {"c_attn", "c_proj", "q_attn"}
    unexpected = _unexpected_parameters(module, known)
    if not shapes_ok or unexpected:
        why = (
            f"parameters the detector does not know ({', '.join(unexpected)})"
            if unexpected
            else f"head attributes {heads} x {head_dim} do not fit c_attn "
            f"{tuple(w_attn.shape)} / c_proj {tuple(w_proj.shape)}"
        )
        found.note(f"{label} with fused Conv1D projections: {why}; left to adaptive", path)
        return found

    def conv_rows(weight, bias, start):
        # (in, out) Conv1D: head i of the block at ``start`` is columns start + i*h
        w = weight[:, start : start + d].reshape(weight.shape[0], heads, head_dim)
        b = bias[start : start + d].reshape(heads, 1, head_dim)
        return torch.cat((w.permute(1, 0, 2), b), dim=-2)

    def out_rows(weight):
        return weight.reshape(heads, head_dim, weight.shape[1]).mT

    attn_w, attn_b = _prefixed(path, "c_attn.weight"), _prefixed(path, "c_attn.bias")
    proj_w = _prefixed(path, "c_proj.weight")
    n_in = w_attn.shape[0] + 1
    if cross:
        q_w, q_b = _prefixed(path, "q_attn.weight"), _prefixed(path, "q_attn.bias")
        qk_params = {
            q_w: q_attn.weight.shape,
            q_b: q_attn.bias.shape,
            attn_w: w_attn.shape,
            attn_b: c_attn.bias.shape,
        }

        def qk_layout(qw, qb, aw, ab):
            return torch.cat((conv_rows(qw, qb, 0), conv_rows(aw, ab, 0)), dim=-2)

        n_q, v_start = q_attn.weight.shape[0] + 1, d
    else:
        qk_params = {attn_w: w_attn.shape, attn_b: c_attn.bias.shape}

        def qk_layout(aw, ab):
            return torch.cat((conv_rows(aw, ab, 0), conv_rows(aw, ab, d)), dim=-2)

        n_q, v_start = n_in, 2 * d
    # V/O shares c_attn with Q/K: both groups read disjoint columns of the same tensors.
    vo_params = {attn_w: w_attn.shape, attn_b: c_attn.bias.shape, proj_w: w_proj.shape}

    def vo_layout(aw, ab, pw):
        return torch.cat((conv_rows(aw, ab, v_start), out_rows(pw)), dim=-2)

    found.specs.append(
        PairSpec("query-key", path, qk_params, qk_layout, n_q, n_in, head_dim, heads)
    )
    found.specs.append(
        PairSpec("value-output", path, vo_params, vo_layout, n_in, w_proj.shape[1], head_dim, heads)
    )
    return found


#: Fused projections: child name -> how its output rows are laid out.
FUSED_QKV_CHILDREN = ("query_key_value", "qkv_proj", "Wqkv", "c_attn")
FUSED_OUTPUT_CHILDREN = ("dense", "o_proj", "out_proj", "c_proj")
#: Fused projections whose rows are all queries, then all keys, then all values (MPT's
#: ``chunk(3)``, DBRX's ``split``, Phi-3).
BLOCK_CHILDREN = ("qkv_proj", "Wqkv")


def fused_rows(layout: str, heads: int, kv_heads: int, head_dim: int, shards: int = 1):
    """Output rows of a fused QKV projection, per head: ``(q, k, v)`` integer tensors of
    shapes ``(heads, head_dim)``, ``(kv_heads, head_dim)``, ``(kv_heads, head_dim)``.

    ``"per-head"``: ``[q; k; v]`` for each head in turn (GPT-NeoX, Bloom, Falcon without
    multi-query); ``"blocks"``: all query heads, then all key heads, then all value heads
    (Phi-3 ``qkv_proj``, Falcon's multi-query layout); ``"kv-groups"``: per key/value
    head its query heads, its key head and its value head (Falcon's new decoder
    architecture).

    Parameters
    ----------
    layout : {"per-head", "blocks", "kv-groups", "mp-shards"}
        The row layout.
    heads, kv_heads, head_dim : int
        Query heads, key/value heads and the head size.
    shards : int
        Model-parallel shards of the ``"mp-shards"`` layout.

    Returns
    -------
    tuple of torch.Tensor
        The row indices of Q, K and V, head by head.
    """
    group = heads // kv_heads
    if layout == "mp-shards":
        rows = torch.arange(3 * heads * head_dim).reshape(shards, 3, -1)
        return tuple(rows[:, part].reshape(-1, head_dim) for part in (0, 2, 1))
    if layout == "per-head":
        rows = torch.arange(3 * heads * head_dim).reshape(heads, 3, head_dim)
        return rows[:, 0], rows[:, 1], rows[:, 2]
    if layout == "blocks":
        q_rows, k_rows = heads * head_dim, kv_heads * head_dim
        rows = torch.arange(q_rows + 2 * k_rows)
        return (
            rows[:q_rows].reshape(heads, head_dim),
            rows[q_rows : q_rows + k_rows].reshape(kv_heads, head_dim),
            rows[q_rows + k_rows :].reshape(kv_heads, head_dim),
        )
    rows = torch.arange((heads + 2 * kv_heads) * head_dim).reshape(kv_heads, group + 2, head_dim)
    return rows[:, :group].reshape(heads, head_dim), rows[:, group], rows[:, group + 1]


def fused_attention_pairs(
    module_path: str,
    fused: Tuple[str, torch.nn.Linear],
    output: Tuple[str, torch.nn.Linear],
    rows: Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    query_key: bool = True,
    rotary_dim: int = 0,
    pairing: str = "half",
    head_order: Optional[Sequence[int]] = None,
) -> List[PairSpec]:
    """Q/K and V/O pairs of attention with one fused ``nn.Linear`` for Q, K and V.

    Like :func:`linear_attention_pairs`, with the heads read from the fused weight's
    output rows (:func:`fused_rows`); the Q/K and V/O groups read disjoint rows of it.

    Parameters
    ----------
    module_path : str
        Path of the attention module (used in labels).
    fused, output : tuple of (str, torch.nn.Linear)
        The fused projection and the output projection, with their paths.
    rows : tuple of torch.Tensor
        Output rows of Q ``(heads, head_dim)``, K and V ``(kv_heads, head_dim)``.
    query_key : bool
        Whether to build the Q/K pair.
    rotary_dim, pairing, head_order
        As for :func:`linear_attention_pairs`.

    Returns
    -------
    list of PairSpec
        Points of shape ``(kv_heads, n + m, head_dim)``.
    """
    (fused_path, linear), (o_path, o) = fused, output
    q_rows, k_rows, v_rows = rows
    heads, head_dim = q_rows.shape
    n_kv = k_rows.shape[0]
    group = heads // n_kv
    has_bias = linear.bias is not None
    params = {_prefixed(fused_path, "weight"): linear.weight.shape}
    if has_bias:
        params[_prefixed(fused_path, "bias")] = linear.bias.shape

    def factor(weight, bias, selected):
        # (count, in [+1], head_dim): the selected rows of each head, transposed
        parts = [weight[selected.reshape(-1)].reshape(*selected.shape, -1).mT]
        if bias is not None:
            parts.append(bias[selected.reshape(-1)].reshape(selected.shape[0], 1, head_dim))
        return torch.cat(parts, dim=-2)

    def stacked(part):
        return part.reshape(n_kv, group * part.shape[-2], head_dim)

    n_in = linear.in_features + int(has_bias)
    specs = []
    if query_key:

        def qk_layout(weight, *bias):
            b = bias[0] if bias else None
            point = torch.cat(
                (stacked(factor(weight, b, q_rows)), factor(weight, b, k_rows)), dim=-2
            )
            return _reordered(point, head_order)

        specs.append(
            PairSpec(
                "query-key",
                module_path,
                dict(params),
                qk_layout,
                group * n_in,
                n_in,
                head_dim,
                n_kv,
                rotary_dim,
                pairing,
            )
        )

    def vo_layout(weight, *rest):
        b = rest[0] if has_bias else None
        h = stacked(head_columns(rest[-1], heads, head_dim))
        return torch.cat((factor(weight, b, v_rows), h), dim=-2)

    vo_params = {**params, _prefixed(o_path, "weight"): o.weight.shape}
    specs.append(
        PairSpec(
            "value-output",
            module_path,
            vo_params,
            vo_layout,
            n_in,
            group * o.out_features,
            head_dim,
            n_kv,
        )
    )
    return specs


def _fused_layout(module: torch.nn.Module, child: str) -> str:
    """The row layout of a fused projection, from the module's attributes."""
    if _int_attr(module, ("mp_num",)) is not None:
        return "mp-shards"
    if child in BLOCK_CHILDREN or (
        getattr(module, "multi_query", False) is True
        and not getattr(module, "new_decoder_architecture", False)
    ):
        return "blocks"
    if getattr(module, "new_decoder_architecture", False) is True:
        return "kv-groups"
    return "per-head"


def fused_qkv_pairs(path: str, module: torch.nn.Module, context: _Context) -> Optional[Findings]:
    """Hugging Face attention with a fused QKV ``nn.Linear`` (``query_key_value``,
    ``qkv_proj``), its row layout read from the module (:func:`fused_rows`)."""
    if not type(module).__module__.startswith("transformers."):
        return None  # the row layouts below are Hugging Face's conventions
    fused_name = next((n for n in FUSED_QKV_CHILDREN if _linear(module, n) is not None), None)
    o_name = next((n for n in FUSED_OUTPUT_CHILDREN if _linear(module, n) is not None), None)
    if fused_name is None or o_name is None:
        return None
    fused, o = _linear(module, fused_name), _linear(module, o_name)
    found = Findings(claimed={path})
    label = f"attention-like module ({type(module).__name__}) with fused {fused_name}"
    config = getattr(module, "config", None) or context.model_config
    head_dim = _int_attr(module, HEAD_DIM_ATTRS)
    heads = _int_attr(module, HEADS_ATTRS) or _int_attr(config, HEADS_ATTRS)
    layout = _fused_layout(module, fused_name)
    shards = _int_attr(module, ("mp_num",)) or 1
    n_kv = _int_attr(module, KV_HEADS_ATTRS)
    if layout in ("per-head", "mp-shards"):
        n_kv = heads
    elif n_kv is None and layout == "blocks" and fused_name in BLOCK_CHILDREN:
        n_kv = _int_attr(config, KV_HEADS_ATTRS) or heads
    if heads is None and head_dim and layout == "per-head":
        heads = n_kv = fused.out_features // (3 * head_dim)
    fits = (
        head_dim is not None
        and heads is not None
        and n_kv is not None
        and heads % n_kv == 0
        and fused.out_features == (heads + 2 * n_kv) * head_dim
        and o.in_features == heads * head_dim
        and (heads * head_dim) % shards == 0
    )
    unexpected = _unexpected_parameters(module, {fused_name, o_name})
    clip = getattr(module, "clip_qkv", None)
    if fits and not unexpected and clip:
        found.note(f"{label}: {CLAMPED_QKV.format(clip=clip)}", path)
        return found
    if not fits or unexpected:
        why = (
            f"parameters the detector does not know ({', '.join(unexpected)})"
            if unexpected
            else f"{heads} heads ({n_kv} key/value) of size {head_dim} do not fit "
            f"{fused_name} {tuple(fused.weight.shape)} / {o_name} {tuple(o.weight.shape)}"
        )
        found.note(f"{label}: {why}; left to the adaptive geometry", path)
        return found
    rows = fused_rows(layout, heads, n_kv, head_dim, shards)
    fused_path = _prefixed(path, fused_name)
    readers = (_rows_reader(fused_path, rows[0]), _rows_reader(fused_path, rows[1]))
    query_key, rotary_dim, pairing, order, qk_check = _query_key_group(
        path, module, context, head_dim, found, readers
    )
    specs = fused_attention_pairs(
        path,
        (fused_path, fused),
        (_prefixed(path, o_name), o),
        rows,
        query_key=query_key,
        rotary_dim=rotary_dim,
        pairing=pairing,
        head_order=order,
    )
    _add_checked(found, specs, qk_check)
    return found


#: Why attention that clamps its queries, keys and values keeps no continuous symmetry.
CLAMPED_QKV = (
    "q, k and v are clamped elementwise to [-{clip}, {clip}] (clip_qkv) before the heads "
    "are split; a clamp commutes only with signed permutations of each head's dimensions "
    "(a finite group), so neither Q/K nor V/O has a continuous symmetry to quotient; left "
    "to the adaptive geometry (a model without clip_qkv gets both)"
)


def _looks_like_attention(module: torch.nn.Module) -> bool:
    conv1d = _conv1d_class()
    kinds = (torch.nn.Linear,) + ((conv1d,) if conv1d is not None else ())
    projects = any(
        isinstance(c, kinds) or isinstance(getattr(c, "base_layer", None), kinds)
        for c in module.children()
    )  # (first: most modules have no such child, and reading absent attributes is slow)
    return projects and _int_attr(module, HEADS_ATTRS + HEAD_DIM_ATTRS) is not None


def _wrapped_projection_note(path: str, module: torch.nn.Module, found: Findings) -> bool:
    """Projections wrapped by an adapter (``base_layer``): note only if the base is trainable."""
    wrapped = [
        (name, c)
        for name, c in module.named_children()
        if isinstance(getattr(c, "base_layer", None), torch.nn.Module)
    ]
    if not wrapped:
        return False
    if any(_has_trainable(c.base_layer) for _, c in wrapped):
        found.note(
            "attention projections are wrapped by adapters (e.g. PEFT LoRA) and their base "
            "weights are trainable: the attention GL(h) symmetries are not used (the adapters' "
            "own pairs are)",
            path,
        )
    return True


def find_attention(model: torch.nn.Module, skip: Set[str] = frozenset()) -> Findings:
    """Every recognised attention module of ``model`` (see the module docstring).

    ``skip`` holds module paths already handled elsewhere (e.g. ``nn.MultiheadAttention``).
    """
    model_has_rotary = any(
        "rotary" in type(m).__name__.lower() or hasattr(m, "inv_freq") for m in model.modules()
    )
    context = _Context(getattr(model, "config", None), model_has_rotary, model)
    found = Findings()
    modules = list(model.named_modules())
    for path, module in modules:
        if path in skip or path in found.claimed:
            continue
        for detector in (_split_projections, gpt2_pairs, _separate_projections, fused_qkv_pairs):
            result = detector(path, module, context)
            if result is not None:
                found.extend(result)
                break
    for path, module in modules:
        if path in skip or path in found.claimed or not _looks_like_attention(module):
            continue
        if not _has_trainable(module) or _wrapped_projection_note(path, module, found):
            continue
        found.note(
            f"attention-like module ({type(module).__name__}) whose projections do not match a "
            "known layout (fused QKV, extra position projections...): left to the adaptive "
            "geometry",
            path,
        )
    return check_locally(model, found)


#: Depth of :func:`deferred_replays` scopes.
_DEFERRED = [0]


@contextlib.contextmanager
def deferred_replays() -> Iterator[None]:
    """Within this scope :func:`check_locally` replays nothing and leaves ``to_check`` to
    the caller: discovery proves the plan on the model first, and replays the pairs only
    where the proof fails (to say what broke them), since a model-level proof that holds
    settles every pair at once."""
    _DEFERRED[0] += 1
    try:
        yield
    finally:
        _DEFERRED[0] -= 1


def check_locally(model: torch.nn.Module, found: Findings) -> Findings:
    """Replay the module of each spec in ``found.to_check`` with a random element of its
    group acting on its parameters; drop the specs whose module output moves, with a note.

    Runs only where the model's probe forward was recorded
    (:func:`~geoopt_quotient.symmetry.probe.recorded_forward`); elsewhere the specs are
    kept and a note says they were not replayed. Within :func:`deferred_replays` it
    returns ``found`` as it is.
    """
    if not found.to_check or _DEFERRED[0]:
        return found
    record, why_not = recorded_forward(model)
    if record is None:
        found.note(f"pairs not replayed on their modules: {why_not}")
        found.to_check = []
        return found
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    dropped = set()
    with preserved_model_state(model):  # eval mode: no dropout in the replays
        replays = [
            (spec, meaning, _replayed(spec, record, modules, params))
            for spec, meaning in found.to_check
        ]
    for spec, meaning, (holds, deviation, moved) in replays:
        if holds is False:
            dropped.add(id(spec))
            ran = _other_children(record, spec, modules)
            message = (
                f"{spec.kind} pair dropped: a random element of its group changes the "
                f"module's output by {deviation:.2g} (relative; tolerance "
                f"{local_tolerance(next(iter(moved.values())).dtype):.1g}): {meaning}"
                + (f"; modules run besides the pair's: {ran}" if ran else "")
            )
            found.note(message, spec.module)
            if not ran:  # nothing in the module explains it (a hook, an unknown computation)
                warnings.warn(
                    f"{spec.module}: {message} ({REPORT})", SymmetryNotProvenWarning, stacklevel=4
                )
    found.specs = [s for s in found.specs if id(s) not in dropped]
    found.to_check = []
    return found


def _replayed(spec: PairSpec, record: ForwardRecord, modules, params) -> Tuple:
    """``(holds, deviation, moved)`` of the spec's module replayed with a random element of
    its group; ``holds=None`` where the module cannot be replayed (a module shared under
    another name, a call it refuses): the model-level proof of discovery decides there."""
    if any(n not in params for n in spec.params):
        return None, 0.0, {}
    try:
        moved = moved_by_element(spec, params)
        holds, deviation = pair_holds(record, spec.module, modules[spec.module], moved)
    except Exception:
        return None, 0.0, {}
    return holds, deviation, moved


def _other_children(
    record: ForwardRecord, spec: PairSpec, modules: Dict[str, torch.nn.Module]
) -> str:
    """The children a module ran in the probe forward, other than the pair's own and other
    than linear projections (the module's other pairs) and dropout."""
    prefix = f"{spec.module}." if spec.module else ""
    own = {n.rsplit(".", 1)[0] for n in spec.params}
    ran = []
    for child in record.children_run.get(spec.module, []):
        name = child[len(prefix) :]
        plain = isinstance(modules.get(child), (torch.nn.Linear, torch.nn.Dropout))
        if child not in own and name not in ran and not plain:
            ran.append(name)
    return ", ".join(ran)


def bert_style_pairs(model: torch.nn.Module) -> Iterator[PairSpec]:
    """BERT/RoBERTa-style attention: ``X.self.{query,key,value}`` and ``X.output.dense``.

    The head size comes from the module (``attention_head_size``), not from
    ``hidden / heads``.

    Parameters
    ----------
    model : torch.nn.Module
        A Hugging Face BERT-like model (its ``config`` is read when present).

    Yields
    ------
    PairSpec
        The query-key and value-output pairs of each attention module, in module order.
    """
    context = _Context(getattr(model, "config", None), False)
    for path, module in model.named_modules():
        result = _split_projections(path, module, context)
        if result is not None:
            yield from result.specs
