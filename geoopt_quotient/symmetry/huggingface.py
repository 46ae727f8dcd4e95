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
stacked as extra rows of one factor. Q/K under rotary position embeddings (or per-head
Q/K normalisation) is left to the adaptive geometry with a note. Modules that look like
attention but do not fit these patterns are reported in notes, never guessed.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from .layouts import PairSpec, head_columns, head_rows

__all__ = [
    "Findings",
    "attention_pairs",
    "bert_style_pairs",
    "find_attention",
    "gpt2_pairs",
    "linear_attention_pairs",
]

HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "key_value_proj_dim", "head_size")
KV_HEADS_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")

#: (query, key, value, candidate output names) of attention with four projections.
SEPARATE_CONVENTIONS: Tuple[Tuple[str, str, str, Tuple[str, ...]], ...] = (
    ("q_proj", "k_proj", "v_proj", ("o_proj", "out_proj", "dense")),
    ("q_lin", "k_lin", "v_lin", ("out_lin",)),
    ("q", "k", "v", ("o",)),
)
#: Children that add a per-head bias to the attention scores (symmetry-neutral):
#: T5's bucketed relative bias, Swin's relative position bias table.
SCORE_BIAS_CHILDREN = ("relative_attention_bias", "relative_position_bias")
#: Children that act on queries/keys per head: the Q/K symmetry does not survive them.
QK_BREAKING_CHILDREN = (
    "q_norm",
    "k_norm",
    "query_norm",
    "key_norm",
    "q_layernorm",
    "k_layernorm",
    "distance_embedding",
)
ROTARY_FORWARD_ARGS = ("position_embeddings", "rotary_pos_emb", "freqs_cis", "rotary_emb")
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

    def note(self, message: str, path: str = "") -> None:
        self._notes.setdefault(message, []).append(path)

    def extend(self, other: Findings) -> None:
        self.specs.extend(other.specs)
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


def _int_attr(module: torch.nn.Module, names: Sequence[str]) -> Optional[int]:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _linear(module: torch.nn.Module, name: str) -> Optional[torch.nn.Linear]:
    child = getattr(module, name, None)
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
            return torch.cat((stacked(q_build(*t[:q_arity])), k_build(*t[q_arity:])), dim=-2)

        n_qk = group * (q.in_features + int(q.bias is not None))
        m_qk = k.in_features + int(k.bias is not None)
        params = {**entries(q_path, q), **entries(k_path, k)}
        specs.append(
            PairSpec("query-key", module_path, params, qk_layout, n_qk, m_qk, head_dim, n_kv)
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


# ---------------------------------------------------------------- structure checks
def _rotary_reason(
    owner: torch.nn.Module, model_config: object, model_has_rotary: bool
) -> Optional[str]:
    """Why Q/K of ``owner`` may be under rotary embeddings, or ``None``."""
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


def _unexpected_parameters(owner: torch.nn.Module, known: Set[str]) -> List[str]:
    """Direct parameters and parameter-holding children of ``owner`` outside ``known``."""
    out = [name for name, _ in owner.named_parameters(recurse=False)]
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
    heads = _int_attr(owner, HEADS_ATTRS)
    if heads is None and q.out_features % head_dim == 0:
        heads = q.out_features // head_dim
    n_kv = _int_attr(owner, KV_HEADS_ATTRS)
    groups = _int_attr(owner, ("num_key_value_groups",))
    if n_kv is None and heads is not None and groups is not None and heads % groups == 0:
        n_kv = heads // groups
    if n_kv is None and k.out_features % head_dim == 0:
        n_kv = k.out_features // head_dim
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
    unexpected = _unexpected_parameters(owner, known)
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
        found.note(
            f"{label}: {'Q/K' if not qk_ok else 'V/O'} shapes do not fit {heads} heads "
            f"({n_kv} key/value heads) of size {head_dim} ({shapes}); left to the adaptive "
            "geometry",
            path,
        )
        return found
    breakers = _qk_breakers(owner)
    rotary = _rotary_reason(owner, context.model_config, context.model_has_rotary)
    if breakers:
        found.note(
            f"Q/K acted on per head ({', '.join(breakers)}): the Q/K GL(h) symmetry does not "
            "survive; Q/K left to the adaptive geometry",
            path,
        )
    elif rotary is not None:
        found.note(
            f"Q/K under rotary position embeddings ({rotary}): only the rotary-commuting "
            "subgroup (C*)^(h/2) survives, which this version does not model; Q/K left to "
            "the adaptive geometry (V/O is handled)",
            path,
        )
    found.specs.extend(
        linear_attention_pairs(
            path,
            projections,
            heads,
            head_dim,
            num_kv_heads=n_kv,
            query_key=not breakers and rotary is None,
        )
    )
    return found


# ---------------------------------------------------------------- families
def _separate_projections(
    path: str, module: torch.nn.Module, context: _Context
) -> Optional[Findings]:
    for q_name, k_name, v_name, o_names in SEPARATE_CONVENTIONS:
        q, k, v = _linear(module, q_name), _linear(module, k_name), _linear(module, v_name)
        if q is None or k is None or v is None:
            continue
        o_name = next((n for n in o_names if _linear(module, n) is not None), None)
        if o_name is None:
            continue
        if q_name == "q" and _int_attr(module, HEADS_ATTRS + HEAD_DIM_ATTRS) is None:
            continue  # bare q/k/v/o children without head attributes: not attention evidence
        projections = tuple(
            (_prefixed(path, n), _linear(module, n)) for n in (q_name, k_name, v_name, o_name)
        )
        return attention_pairs(path, module, projections, context)
    return None


def _split_projections(path: str, module: torch.nn.Module, context: _Context) -> Optional[Findings]:
    """``X.{self|attention}.{query,key,value}`` with the output in ``X.output.dense``."""
    output = getattr(module, "output", None)
    o = _linear(output, "dense") if isinstance(output, torch.nn.Module) else None
    if o is None:
        return None
    for inner_name in ("self", "attention"):
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
    c_attn, c_proj = getattr(module, "c_attn", None), getattr(module, "c_proj", None)
    if conv1d is None or not isinstance(c_attn, conv1d) or not isinstance(c_proj, conv1d):
        return None
    q_attn = getattr(module, "q_attn", None)
    cross = isinstance(q_attn, conv1d)
    found = Findings(claimed={path})
    label = f"attention-like module ({type(module).__name__})"
    heads, head_dim = _int_attr(module, HEADS_ATTRS), _int_attr(module, HEAD_DIM_ATTRS)
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


def _looks_like_attention(module: torch.nn.Module) -> bool:
    if _int_attr(module, HEADS_ATTRS + HEAD_DIM_ATTRS) is None:
        return False
    conv1d = _conv1d_class()
    kinds = (torch.nn.Linear,) + ((conv1d,) if conv1d is not None else ())
    return any(
        isinstance(c, kinds) or isinstance(getattr(c, "base_layer", None), kinds)
        for c in module.children()
    )


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
    context = _Context(getattr(model, "config", None), model_has_rotary)
    found = Findings()
    modules = list(model.named_modules())
    for path, module in modules:
        if path in skip or path in found.claimed:
            continue
        for detector in (_split_projections, gpt2_pairs, _separate_projections):
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
    return found


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
