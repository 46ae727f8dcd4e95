r"""GL(r) symmetries of PEFT LoRA adapters, detected by module structure.

A PEFT LoRA layer holds ``lora_A`` and ``lora_B`` (``nn.ModuleDict`` of ``nn.Linear``,
one entry per adapter name) and adds :math:`s\,B A x` to its base layer, with
:math:`A` of shape ``(r, in)`` and :math:`B` of shape ``(out, r)``. The product is
unchanged by :math:`(B, A) \mapsto (B M^{-1}, M A)`, i.e. the pair
:math:`G = B` (``out x r``), :math:`H = A^\top` (``in x r``) lives on
``GLQuotient(out, in)``. Embedding adapters (``lora_embedding_A``/``lora_embedding_B``,
``nn.ParameterDict``: :math:`A` ``(r, vocab)``, :math:`B` ``(dim, r)``) are the same pair.
A bias on ``lora_A`` (not PEFT's default) is an extra row of :math:`H`; a bias on
``lora_B`` (``lora_bias=True``) lives in the output space and stays adaptive.
"""

from __future__ import annotations

from typing import Dict

import torch

from .huggingface import Findings, module_attribute
from .layouts import PairSpec, child_path

__all__ = ["lora_pairs"]


def _full_rank(weight: torch.Tensor, rank: int) -> bool:
    with torch.no_grad():
        svals = torch.linalg.svdvals(weight.detach().to(torch.float64))
    return bool(svals.numel() >= rank and svals[rank - 1] > svals[0] * 1e-10 > 0)


def lora_pairs(model: torch.nn.Module, eps: float = 0.0) -> Findings:
    """GL(r) pairs of every PEFT-style LoRA adapter in ``model``.

    Parameters
    ----------
    model : torch.nn.Module
        Any model; modules with ``lora_A``/``lora_B`` ``ModuleDict`` (or
        ``lora_embedding_A``/``lora_embedding_B`` ``ParameterDict``) are adapters.
    eps : float
        The quotient relaxation that will be used: with ``eps == 0`` a rank-deficient
        pair (e.g. PEFT's initialisation ``B = 0``) is left to the adaptive geometry
        with a note, as the exact quotient geometry is singular there.

    Returns
    -------
    Findings
        One spec per adapter, shape ``(1, out [+0] + in [+1], r)``.
    """
    found = Findings()
    for path, module in model.named_modules():
        dict_a, dict_b = module_attribute(module, "lora_A"), module_attribute(module, "lora_B")
        if isinstance(dict_a, torch.nn.ModuleDict) and isinstance(dict_b, torch.nn.ModuleDict):
            found.claimed.add(path)
            for name, a in dict_a.items():
                b = dict_b[name] if name in dict_b else None
                _linear_adapter(found, path, name, a, b, eps)
        emb_a = module_attribute(module, "lora_embedding_A")
        emb_b = module_attribute(module, "lora_embedding_B")
        if isinstance(emb_a, torch.nn.ParameterDict) and isinstance(emb_b, torch.nn.ParameterDict):
            found.claimed.add(path)
            for name, a in emb_a.items():
                b = emb_b[name] if name in emb_b else None
                _embedding_adapter(found, path, name, a, b, eps)
    return found


def _check(
    found: Findings, where: str, a_weight: torch.Tensor, b_weight: torch.Tensor, eps: float
) -> bool:
    r = a_weight.shape[0]
    if r > min(a_weight.shape[1], b_weight.shape[0]):
        found.note(
            f"LoRA adapter rank {r} exceeds min(in, out): no GL(r) quotient; left to adaptive",
            where,
        )
        return False
    if not (a_weight.requires_grad and b_weight.requires_grad):
        if a_weight.requires_grad or b_weight.requires_grad:
            found.note("LoRA adapter with only one trainable factor: left to adaptive", where)
        return False
    if eps == 0 and not (_full_rank(a_weight, r) and _full_rank(b_weight, r)):
        found.note(
            "LoRA adapter pair is rank-deficient (PEFT initialises B = 0): the exact quotient "
            "geometry is singular there, so it is left to the adaptive geometry; pass eps > 0 "
            "to use the relaxed quotient",
            where,
        )
        return False
    return True


def _linear_adapter(
    found: Findings,
    path: str,
    name: str,
    a: torch.nn.Module,
    b: torch.nn.Module | None,
    eps: float,
) -> None:
    where = f"{path} [{name}]"
    if not isinstance(a, torch.nn.Linear) or not isinstance(b, torch.nn.Linear):
        kinds = f"{type(a).__name__}/{type(b).__name__}"
        found.note(f"LoRA adapter with {kinds} factors is not handled: left to adaptive", where)
        return
    if a.out_features != b.in_features:
        found.note(
            f"LoRA factors do not chain (A {tuple(a.weight.shape)}, B {tuple(b.weight.shape)}): "
            "left to adaptive",
            where,
        )
        return
    if not _check(found, where, a.weight, b.weight, eps):
        return
    a_path, b_path = child_path(path, f"lora_A.{name}"), child_path(path, f"lora_B.{name}")
    params: Dict[str, torch.Size] = {child_path(b_path, "weight"): b.weight.shape}
    params[child_path(a_path, "weight")] = a.weight.shape
    with_bias = a.bias is not None and a.bias.requires_grad
    if with_bias:
        params[child_path(a_path, "bias")] = a.bias.shape

    def layout(wb, wa, *bias):
        h = torch.cat((wa.mT, bias[0][None]), dim=0) if bias else wa.mT
        return torch.cat((wb, h), dim=0)[None]

    r = a.out_features
    m = a.in_features + int(with_bias)
    found.specs.append(PairSpec("lora", where, params, layout, b.out_features, m, r, 1))


def _embedding_adapter(
    found: Findings,
    path: str,
    name: str,
    a: torch.Tensor,
    b: torch.Tensor | None,
    eps: float,
) -> None:
    where = f"{path} [{name}, embedding]"
    if b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        found.note("LoRA embedding adapter with unexpected shapes: left to adaptive", where)
        return
    if not _check(found, where, a, b, eps):
        return
    params = {
        child_path(path, f"lora_embedding_B.{name}"): b.shape,
        child_path(path, f"lora_embedding_A.{name}"): a.shape,
    }

    def layout(wb, wa):
        return torch.cat((wb, wa.mT), dim=0)[None]

    found.specs.append(
        PairSpec("lora", where, params, layout, b.shape[0], a.shape[1], a.shape[0], 1)
    )
