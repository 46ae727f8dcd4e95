r"""Reading a model's structure from one recorded forward pass: rotary planes, local checks.

Discovery decides from numbers, not from names. :func:`recorded_forward` runs the model
once on tiny probe inputs (built from its config) and records, per module, the
arguments of its calls and the outputs of its ``nn.Linear`` children; it also records
every call of the model's own rotary functions (candidates found by name, ``rotary``,
``rope``, ``rotate`` or ``pos_emb`` in the attention class's module or on the class) made
directly inside an attention module, with their inputs and outputs.

:func:`rotary_planes` then feeds basis vectors of the head through the recorded rotary
call at every probed position and reads off which dimensions rotate together: a rotary
embedding maps each plane :math:`(i, j)` by :math:`\begin{pmatrix} c & -s \\ s & c
\end{pmatrix}` (angle depending on the position) and leaves the other dimensions
unchanged. The queries it rotates are matched, column by column, against the query
heads read from the projection's recorded output, so the planes are in the head's own
coordinates whatever the function's signature, its slicing (partial rotary) or its
pairing convention. :func:`pair_holds` replays one module with a random group element
applied to a pair's factors and compares its output: a parameter-free norm between the
factors (values normalised per head, a norm between the MLP's product and ``down``) or
an adapter added to one factor makes it move.

A model on the meta device (or one whose forward cannot run on the default probe) is
not probed: :func:`recorded_forward` says why, and discovery notes it.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.func import functional_call

from .plan import SymmetryGroup

__all__ = [
    "ForwardRecord",
    "RotaryReading",
    "canonical_rotary",
    "pair_holds",
    "recorded_forward",
    "rotary_planes",
    "shared_records",
    "why_not_runnable",
]

#: Names of the callables that may apply rotary embeddings (candidates only: the
#: numbers decide whether and how they rotate the queries and keys).
ROTARY_CANDIDATE = re.compile(r"rot(ary|ate)|rope|pos_emb", re.IGNORECASE)
#: Probe sequence length: a few positions, spread over the model's position range.
PROBE_LENGTH = 6
#: Calls recorded per module (a shared block may run at several layers).
CALLS_PER_MODULE = 4


@dataclass
class RotaryCall:
    """One call of a rotary candidate: its function, arguments and outputs."""

    function: Callable
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    outputs: List[torch.Tensor]


@dataclass
class ForwardRecord:
    """What one forward pass recorded, by module path."""

    calls: Dict[str, List[Tuple[Tuple[Any, ...], Dict[str, Any]]]] = field(default_factory=dict)
    linear_outputs: Dict[str, torch.Tensor] = field(default_factory=dict)
    rotary_calls: Dict[str, List[RotaryCall]] = field(default_factory=dict)
    children_run: Dict[str, List[str]] = field(default_factory=dict)
    replays: Dict[Tuple, Any] = field(default_factory=dict)
    #: the pass as the proof's reference pass
    #: (:class:`~geoopt_quotient.symmetry.verify.ReferencePass`), where it was made as one
    reference: Any = None


#: Records shared within :func:`shared_records` (one dict per active scope, by model id),
#: with whether the scope's records are made as the proof's reference pass.
_SCOPES: List[
    Tuple[Dict[int, Tuple[torch.nn.Module, Tuple[Optional[ForwardRecord], str]]], bool]
] = []


@contextlib.contextmanager
def shared_records(reference: bool = False) -> Iterator[None]:
    """Within this scope each model is run and recorded once, and the record is shared by
    every detector that asks (one discovery); outside it nothing is kept between calls.

    With ``reference`` the record is made on the proof's default probe inputs
    (:func:`~geoopt_quotient.symmetry.verify.default_probe`, positions spread as
    usual) in a pass that also serves as the proof's reference pass
    (``record.reference``, :func:`~geoopt_quotient.symmetry.verify.reference_pass`):
    gradients tracked to every floating weight, the outputs kept.
    """
    _SCOPES.append(({}, reference))
    try:
        yield
    finally:
        _SCOPES.pop()


def _fingerprint(model: torch.nn.Module) -> Tuple:
    return tuple((n, tuple(p.shape), p.dtype, str(p.device)) for n, p in model.named_parameters())


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    return value


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _candidates(model: torch.nn.Module) -> List[Tuple[Any, str, Callable, bool]]:
    """``(owner, name, function, is_class)`` of every rotary candidate to wrap."""
    seen, out = set(), []
    for module in model.modules():
        cls = type(module)
        if not cls.__module__.startswith("transformers.") or cls in seen:
            continue
        seen.add(cls)
        source = sys.modules.get(cls.__module__)
        for name, value in vars(source).items() if source is not None else ():
            # a function, or one that transformers made a module (kernels from the Hub)
            callable_ = inspect.isfunction(value) or isinstance(value, torch.nn.Module)
            if callable_ and ROTARY_CANDIDATE.search(name):
                out.append((source, name, value, False))
        for name, value in vars(cls).items():
            if isinstance(value, staticmethod) and ROTARY_CANDIDATE.search(name):
                out.append((cls, name, value.__func__, True))
    unique = {(id(owner), name): entry for entry in out for owner, name in [entry[:2]]}
    return list(unique.values())


@contextlib.contextmanager
def _recording(model: torch.nn.Module, record: ForwardRecord) -> Iterator[None]:
    """Hooks on every module and wrappers on the rotary candidates, removed on exit."""
    stack: List[str] = []
    depth = [0]
    handles = []

    def pre(path):
        def hook(module, args, kwargs):
            if stack:
                record.children_run.setdefault(stack[-1], []).append(path)
            calls = record.calls.setdefault(path, [])
            if len(calls) < CALLS_PER_MODULE:
                calls.append((_detached(args), _detached(kwargs)))
            stack.append(path)

        return hook

    def post(path):
        def hook(module, args, output):
            stack.pop()
            if isinstance(module, torch.nn.Linear) and isinstance(output, torch.Tensor):
                record.linear_outputs.setdefault(path, output.detach().clone())

        return hook

    def wrap(function):
        def wrapper(*args, **kwargs):
            depth[0] += 1
            try:
                out = function(*args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0 and stack:
                calls = record.rotary_calls.setdefault(stack[-1], [])
                if len(calls) < 2 * CALLS_PER_MODULE:
                    outputs = [t.detach().clone() for t in _tensors(out)]
                    calls.append(RotaryCall(function, _detached(args), _detached(kwargs), outputs))
            return out

        return wrapper

    patched = []
    try:
        for path, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(pre(path), with_kwargs=True))
            handles.append(module.register_forward_hook(post(path)))
        for owner, name, function, is_class in _candidates(model):
            original = owner.__dict__[name]
            replacement = staticmethod(wrap(function)) if is_class else wrap(function)
            setattr(owner, name, replacement)
            patched.append((owner, name, original))
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
        for handle in handles:
            handle.remove()


def _probe_inputs(model: torch.nn.Module) -> Dict[str, Any]:
    from .verify import probe_inputs_for

    inputs = probe_inputs_for(model, batch_size=1, seq_len=PROBE_LENGTH)
    inputs.pop("attention_mask", None)
    return inputs


def _spread_positions(model: torch.nn.Module, inputs: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The inputs with positions spread over the model's range (slow rotary planes turn
    by measurable angles), or ``None`` where the forward takes no ``position_ids``."""
    ids = inputs.get("input_ids")
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    try:
        accepts = "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        accepts = False
    if ids is None or not accepts or not isinstance(limit, int) or limit <= ids.shape[-1]:
        return None
    positions = torch.linspace(0, limit - 1, ids.shape[-1]).round().long().to(ids.device)
    return {**inputs, "position_ids": positions.expand_as(ids)}


def recorded_forward(model: torch.nn.Module) -> Tuple[Optional[ForwardRecord], str]:
    """One recorded forward pass of ``model`` on probe inputs: ``(record, "")`` or
    ``(None, reason)``; shared within :func:`shared_records`."""
    if not _SCOPES:
        return _record(model)
    scope, reference = _SCOPES[-1]
    if id(model) not in scope:
        scope[id(model)] = (model, _record(model, reference))  # the model pins its id
    return scope[id(model)][1]


def why_not_runnable(model: torch.nn.Module) -> str:
    """Why one process cannot run ``model`` here ("" if it can): its parameters are on the
    meta device, or sharded (FSDP2's ``DTensor``: a forward pass needs every rank)."""
    params = list(model.parameters())
    if any(p.is_meta for p in params):
        return "the model is on the meta device (nothing can be computed)"
    if any(type(p).__name__ == "DTensor" for p in params):
        return "the model is sharded (FSDP2): one process cannot run it alone"
    return ""


def _record(model: torch.nn.Module, reference: bool = False) -> Tuple[Optional[ForwardRecord], str]:
    why_not = why_not_runnable(model)
    if why_not:
        return None, why_not
    shared = _reference_inputs(model) if reference else None
    try:
        inputs = _probe_inputs(model) if shared is None else shared
    except Exception as error:
        return None, f"no probe inputs could be built ({error})"
    from .._model_state import preserved_model_state
    from .verify import reference_pass

    errors = []
    for attempt in (_spread_positions(model, inputs), inputs):
        if attempt is None:
            continue
        record = ForwardRecord()
        try:
            with preserved_model_state(model), _recording(model, record):
                if shared is not None:
                    record.reference = reference_pass(model, attempt)
                else:
                    with torch.no_grad():
                        model(**attempt)
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")
            continue
        return record, ""
    return None, f"its forward failed on the probe inputs ({errors[-1][:200]})"


def _reference_inputs(model: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """The proof's default probe inputs where they are keyword inputs, else ``None``."""
    from .verify import default_probe

    try:
        inputs = default_probe(model, guess=False)
    except Exception:  # the probe's own inputs decide (and say why)
        return None
    return dict(inputs) if isinstance(inputs, dict) else None


# ---------------------------------------------------------------- rotary planes
@dataclass
class RotaryReading:
    """What the probe read from an attention module's rotary calls.

    ``planes`` are pairs of head dimensions that rotate together, ``fixed`` the
    dimensions no call moves; ``reason`` says why nothing could be read (then both are
    empty), ``found`` whether any call rotated this module's queries and keys.
    """

    found: bool
    planes: List[Tuple[int, int]] = field(default_factory=list)
    fixed: List[int] = field(default_factory=list)
    reason: str = ""


def _tolerance(dtype: torch.dtype) -> float:
    # rotary tables are often computed in float32 even in a float64 model
    eps = max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    return 64 * eps


#: Tolerance of the structure read from a rotary call's maps (:func:`_planes`). Their
#: columns are the images of basis vectors, which a rotation writes exactly (products
#: with zero and one, and the tables' own ``cos`` and ``sin`` entries) in any dtype, and
#: they are computed in float32 at least (:func:`_widened`). A tolerance of the data's
#: own precision would be far too coarse in bfloat16 (0.5): a slow plane, whose angle
#: stays small at the probed positions, would pass for two fixed dimensions, and a
#: plane near a half turn for a scaling.
MAP_TOLERANCE = _tolerance(torch.float32)


def _widened(call: RotaryCall) -> RotaryCall:
    """``call`` with its floating-point tensors of less than float32's precision (the
    data, the ``cos``/``sin`` tables of a bfloat16 model) converted to float32 (exactly):
    its maps are then read in float32 arithmetic."""

    def wide(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            if torch.finfo(value.dtype).eps > torch.finfo(torch.float32).eps:
                return value.float()
        return value

    return RotaryCall(
        call.function,
        tuple(wide(a) for a in call.args),
        {k: wide(v) for k, v in call.kwargs.items()},
        [wide(o) for o in call.outputs],
    )


def _sorted_columns(t: torch.Tensor) -> torch.Tensor:
    """The entries of each column of ``t`` (last dimension) in increasing order, float64."""
    return t.reshape(-1, t.shape[-1]).to(torch.float64).sort(dim=0).values


def _column_offset(
    data: torch.Tensor,
    heads: torch.Tensor,
    sorted_columns: Callable[[torch.Tensor], torch.Tensor] = _sorted_columns,
) -> Optional[int]:
    """Offset ``o`` with ``data[..., c]`` equal (as a multiset) to ``heads[..., o + c]``,
    each head possibly repeated (key heads shared by several query heads);
    ``sorted_columns`` is :func:`_sorted_columns` (or a cache of it)."""
    r, hd = data.shape[-1], heads.shape[-1]
    rows, ref_rows = data.numel() // r, heads.numel() // hd
    if r > hd or rows % ref_rows:
        return None
    cols = sorted_columns(data)
    # sorting k copies of each column repeats each of its sorted entries k times
    ref = sorted_columns(heads).repeat_interleave(rows // ref_rows, dim=0)
    scale = ref.abs().max().clamp_min(1e-30)
    tol = _tolerance(data.dtype) * scale
    for offset in range(hd - r + 1):
        if (cols - ref[:, offset : offset + r]).abs().max() <= tol:
            return offset
    return None


def _cached_maps(
    record: ForwardRecord, call: RotaryCall, slot: int, slots: List[int]
) -> Optional[torch.Tensor]:
    """:func:`_replay_maps_of_slots`' map of ``slot``, every slot's computed at once and once
    for calls of one function on equal position inputs (every layer of a model shares its
    rotary tables)."""

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.shape == b.shape
                and a.dtype == b.dtype
                and bool(torch.equal(a, b))
            )
        return a == b

    def key_args(c: RotaryCall) -> List[Any]:
        return [a.shape if i in slots else a for i, a in enumerate(c.args)]

    cached = record.replays.setdefault("rotary maps", [])
    for function, at, args, kwargs, maps in cached:
        if function is call.function and at == slots and len(args) == len(call.args):
            mine = key_args(call)
            if all(same(a, b) for a, b in zip(args, mine)) and kwargs.keys() == call.kwargs.keys():
                if all(same(kwargs[k], call.kwargs[k]) for k in kwargs):
                    return maps[slots.index(slot)]
    maps = _replay_maps_of_slots(call, slots)
    cached.append((call.function, list(slots), key_args(call), call.kwargs, maps))
    return maps[slots.index(slot)]


def _replay_maps_of_slots(call: RotaryCall, slots: List[int]) -> List[Optional[torch.Tensor]]:
    """Per slot, matrices ``(positions, r, r)`` of the call's map on that argument: basis
    vectors in, the output of the same slot out (the other data arguments zero), or
    ``None`` where it is not a map of its own. The basis vectors of all slots go through
    one call mapped over them (:func:`torch.vmap`), or through one call per vector where
    the function cannot be mapped; in float32 at least (:func:`_widened`), or in the
    call's own dtypes where the function refuses float32."""
    widened = _widened(call)
    try:
        with warnings.catch_warnings():  # vmap's note on operators it loops over
            warnings.filterwarnings("ignore", message=".*batching rule.*")
            return _mapped_maps_of_slots(widened, slots)
    except Exception:  # a function vmap cannot follow (data-dependent control flow...)
        pass
    try:
        return [_looped_maps(widened, slot, slots) for slot in slots]
    except Exception:  # a function that insists on its own dtypes: read in them
        return [_looped_maps(call, slot, slots) for slot in slots]


def _mapped_maps_of_slots(call: RotaryCall, slots: List[int]) -> List[Optional[torch.Tensor]]:
    """:func:`_replay_maps_of_slots` in one call mapped over the basis vectors of every
    slot: sample ``(s, j)`` has basis vector ``j`` in slot ``s`` and zeros in the other
    slots, whose outputs must stay zero (else the data arguments mix, and slot ``s`` has
    no map of its own: ``None``). Each slot's map is the same arithmetic, element by
    element, as one call per vector (:func:`_looped_maps`)."""
    sizes = [call.args[s].shape[-1] for s in slots]
    starts = [sum(sizes[:k]) for k in range(len(slots))]
    inputs = []
    for s, at, r in zip(slots, starts, sizes):
        data = call.args[s]
        batch = torch.zeros(sum(sizes), *data.shape, dtype=data.dtype, device=data.device)
        eye = torch.eye(r, dtype=data.dtype, device=data.device)
        batch[at : at + r] = eye.reshape(r, *([1] * (data.dim() - 1)), r)
        inputs.append(batch)

    def column(*vectors: torch.Tensor) -> List[torch.Tensor]:
        args = list(call.args)
        for s, vector in zip(slots, vectors):
            args[s] = vector
        return _tensors(call.function(*args, **call.kwargs))

    outputs = torch.vmap(column)(*inputs)
    out: List[Optional[torch.Tensor]] = [None] * len(slots)
    if len(outputs) != len(slots):
        return out
    for k, (at, r) in enumerate(zip(starts, sizes)):
        rows = slice(at, at + r)
        if any(o[rows].abs().max() > 0 for i, o in enumerate(outputs) if i != k):
            continue  # this slot's data reaches another output: not a rotation of its own
        mapped = outputs[k][rows].reshape(r, -1, r).to(torch.float64)  # (columns, positions, r)
        out[k] = mapped.permute(1, 2, 0)
    return out


def _looped_maps(call: RotaryCall, slot: int, slots: List[int]) -> Optional[torch.Tensor]:
    """The map of ``slot`` (:func:`_replay_maps_of_slots`), one call per basis vector."""
    data = call.args[slot]
    r = data.shape[-1]
    out_index = slots.index(slot)
    columns = []
    for j in range(r):
        args = list(call.args)
        for s in slots:
            args[s] = torch.zeros_like(call.args[s])
        args[slot] = torch.zeros_like(data)
        args[slot][..., j] = 1
        outputs = _tensors(call.function(*args, **call.kwargs))
        if len(outputs) != len(slots):
            return None
        for k, other in enumerate(outputs):
            if k != out_index and other.abs().max() > 0:
                return None  # the data arguments mix: not a rotation of each
        columns.append(outputs[out_index].reshape(-1, r).to(torch.float64))
    return torch.stack(columns, dim=-1)


def _planes(maps: torch.Tensor, tol: float) -> Optional[Tuple[List[Tuple[int, int]], List[int]]]:
    """Planes and fixed dimensions of maps ``(positions, r, r)``, or ``None`` where they
    are not rotations of disjoint planes (and the identity elsewhere)."""
    r = maps.shape[-1]
    eye = torch.eye(r, dtype=maps.dtype)
    # moved[i][j]: entry (i, j) leaves the identity at some position (i != j: a coupling
    # i <- j; i == j: a scaling of dimension j)
    moved = ((maps - eye).abs().amax(dim=0) > tol).tolist()
    planes, fixed = [], []
    for j in range(r):
        partners = [i for i in range(r) if i != j and moved[i][j]]
        if not partners:
            if moved[j][j]:
                return None  # scaled, not rotated
            fixed.append(j)
            continue
        if len(partners) != 1 or [i for i in range(r) if i != j and moved[j][i]] != partners:
            return None
        if j < partners[0]:
            planes.append((j, partners[0]))
    if planes:  # each plane's block is [[c, -s], [s, c]] at every position
        first = torch.tensor([j for j, _ in planes])
        second = torch.tensor([i for _, i in planes])
        c, s = maps[:, first, first], maps[:, second, first]
        mismatch = torch.maximum(
            (maps[:, second, second] - c).abs().amax(), (maps[:, first, second] + s).abs().amax()
        )
        if mismatch > tol:
            return None
    return planes, fixed


def _cached_planes(
    record: ForwardRecord, maps: torch.Tensor, tol: float
) -> Optional[Tuple[List[Tuple[int, int]], List[int]]]:
    """:func:`_planes`, read once per map: every layer of a model shares its rotary maps,
    and the queries' and keys' maps are most often equal."""
    cached = record.replays.setdefault("rotary planes", [])
    for seen, at, planes in cached:
        if at == tol and (seen is maps or (seen.shape == maps.shape and torch.equal(seen, maps))):
            return planes
    planes = _planes(maps, tol)
    cached.append((maps, tol, planes))  # the maps stay alive in the record's cache
    return planes


def rotary_planes(
    record: ForwardRecord,
    path: str,
    query_heads: Callable[[ForwardRecord], Optional[torch.Tensor]],
    key_heads: Callable[[ForwardRecord], Optional[torch.Tensor]],
) -> RotaryReading:
    """The rotary planes of the attention module at ``path``, read from its recorded calls.

    Parameters
    ----------
    record : ForwardRecord
        The recorded forward pass.
    path : str
        The attention module (the rotary function is called in it or in a submodule).
    query_heads, key_heads : callable
        ``f(record) -> (..., heads, head_dim)``: the module's pre-rotary queries (keys)
        from the recorded projection outputs, or ``None`` if not recorded.

    Returns
    -------
    RotaryReading
        Planes in head coordinates; ``found=False`` if no recorded call rotated queries
        and keys of this module.
    """
    q, k = query_heads(record), key_heads(record)
    if q is None or k is None:
        return RotaryReading(False, reason="the module did not run in the probe forward")
    hd = q.shape[-1]
    readings = {}
    sorted_once: Dict[int, torch.Tensor] = {}  # by tensor id: q, k and each call's data

    def sorted_columns(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in sorted_once:
            sorted_once[id(t)] = _sorted_columns(t)
        return sorted_once[id(t)]

    inside = [c for p, cs in record.rotary_calls.items() if _within(p, path) for c in cs]
    for call in inside:
        slots = [
            i
            for i, a in enumerate(call.args)
            if isinstance(a, torch.Tensor) and any(a.shape == o.shape for o in call.outputs)
        ]
        for slot in slots:
            data = call.args[slot]
            for side, heads in (("query", q), ("key", k)):
                offset = (
                    _column_offset(data, heads, sorted_columns) if side not in readings else None
                )
                if offset is None:
                    continue
                maps = _cached_maps(record, call, slot, slots)
                found = None if maps is None else _cached_planes(record, maps, MAP_TOLERANCE)
                if found is None:
                    return RotaryReading(
                        True, reason=f"{call.function.__name__} does not rotate disjoint planes"
                    )
                planes, fixed = found
                moved = [(a + offset, b + offset) for a, b in planes]
                rest = [d for d in range(hd) if not any(d in p for p in moved)]
                readings[side] = (sorted(moved), rest)
    if not readings:
        return RotaryReading(False)
    if set(readings) != {"query", "key"} or readings["query"] != readings["key"]:
        return RotaryReading(True, reason="the queries and keys are not rotated alike")
    planes, fixed = readings["query"]
    return RotaryReading(True, planes, fixed)


def _within(path: str, root: str) -> bool:
    return not root or path == root or path.startswith(f"{root}.")


def canonical_rotary(
    planes: Sequence[Tuple[int, int]], head_dim: int
) -> Tuple[int, str, Optional[List[int]]]:
    """``(rotary_dim, pairing, order)`` of planes: ``order`` (``None`` where not needed)
    permutes a head's dimensions so that the planes are ``(j, j + r/2)`` on the first
    ``r`` of them (``pairing="half"``); planes ``(2j, 2j+1)`` on the first ``r`` give
    ``"interleaved"`` without a permutation."""
    planes = sorted(planes)
    k = len(planes)
    rest = [d for d in range(head_dim) if not any(d in p for p in planes)]
    if planes == [(j, j + k) for j in range(k)] and rest == list(range(2 * k, head_dim)):
        return 2 * k, "half", None
    if planes == [(2 * j, 2 * j + 1) for j in range(k)] and rest == list(range(2 * k, head_dim)):
        return 2 * k, "interleaved", None
    order = [a for a, _ in planes] + [b for _, b in planes] + rest
    return 2 * k, "half", order


# ---------------------------------------------------------------- local checks
def _leaves(output: Any) -> List[torch.Tensor]:
    return [t for t in _tensors(output) if t.is_floating_point()]


def pair_holds(
    record: ForwardRecord,
    module_path: str,
    module: torch.nn.Module,
    moved: Dict[str, torch.Tensor],
) -> Tuple[Optional[bool], float]:
    """Whether ``module`` computes the same outputs with its parameters ``moved``.

    Replays every recorded call of the module with the parameters in ``moved`` (by full
    name in the model) replaced; returns ``(holds, deviation)``, the largest deviation
    relative to the largest output, ``holds=None`` when the module was not recorded.
    """
    calls = record.calls.get(module_path)
    if not calls:
        return None, 0.0
    prefix = f"{module_path}." if module_path else ""
    local = {n[len(prefix) :]: t for n, t in moved.items() if n.startswith(prefix)}
    worst, dtype = 0.0, torch.float32
    with torch.no_grad():
        for args, kwargs in calls:
            before = _leaves(module(*args, **kwargs))
            after = _leaves(functional_call(module, local, args, kwargs, strict=False))
            for a, b in zip(before, after):
                dtype = a.dtype
                scale = a.abs().max().clamp_min(torch.finfo(a.dtype).tiny)
                worst = max(worst, float((a - b).abs().max() / scale))
    return worst <= local_tolerance(dtype), worst


def local_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of a local check: float32 resolution (many families compute
    attention or norms in float32 inside a float64 model) times a margin for the
    element's condition number and the module's depth."""
    return 4096 * max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)


def moved_by_element(spec: Any, params: Dict[str, torch.Tensor], seed: int = 0):
    """The parameters of ``spec`` (a :class:`~geoopt_quotient.symmetry.PairSpec`) moved by
    a random element of its own group (``spec.manifold(...).random_element``, condition
    number at most 4), gathered and scattered by the pair's group as plans do."""
    manifold = spec.manifold("mix", 0.0)
    group = SymmetryGroup.from_layout(spec.module, manifold, spec.params, spec.layout)
    dtype = torch.float64 if params[group.param_names[0]].dtype == torch.float64 else torch.float32
    point = group.gather(params).to(dtype)
    element = manifold.random_element(
        (spec.num_heads,),
        h=spec.head_dim,
        max_condition=4.0,
        generator=torch.Generator().manual_seed(seed),
        dtype=dtype,
    )
    moved = group.scatter(manifold.act(point, element.to(point.device)), params)
    return {n: t.to(params[n].dtype) for n, t in moved.items()}
