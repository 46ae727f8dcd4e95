r"""Local Hugging Face causal language models and their data: next-token loss on a text file.

A checkpoint is a directory with ``config.json``, safetensors weights and a tokenizer
(:mod:`~geoopt_quotient.experiments.classifiers` checks and loads them; nothing is
downloaded). The data is a UTF-8 text file, tokenised as one document with the
checkpoint's own tokenizer and cut into blocks of :math:`T` consecutive tokens (the
remainder is dropped); a seeded draw of blocks makes the batches. The loss of a batch
of :math:`B` blocks :math:`x_{b,1..T}` is the mean next-token cross-entropy

.. math::

    L = -\frac{1}{B(T-1)} \sum_{b=1}^{B} \sum_{t=1}^{T-1}
        \log p_\theta(x_{b,t+1} \mid x_{b,1..t}),

computed from the logits in float32 or better whatever the model's dtype. Example::

    from geoopt_quotient import find_symmetries, geodesic_sharpness
    from geoopt_quotient.experiments.causal_lm import (
        load_causal_lm, load_text_batches, next_token_loss)

    model, tokenizer = load_causal_lm("./my-llama", dtype="float32")
    batches = load_text_batches("valid.txt", model, tokenizer, block_size=128,
                                batch_size=8, max_blocks=64, seed=0)
    plan = find_symmetries(model, probe_inputs=batches[0][0])
    result = geodesic_sharpness(model, next_token_loss, batches, rho=0.05,
                                symmetries=plan.bind(model))
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ._architectures import is_causal_lm
from .classifiers import (
    Batch,
    InputError,
    load_pretrained,
    load_tokenizer,
    read_config,
    text_lines,
)

__all__ = [
    "is_causal_lm",
    "load_causal_lm",
    "load_text_batches",
    "load_text_blocks",
    "next_token_error",
    "next_token_loss",
    "sample_blocks",
    "text_blocks",
]


def load_causal_lm(
    directory: str,
    device: torch.device | str = "cpu",
    *,
    dtype: str | torch.dtype = "auto",
    where: Optional[str] = None,
) -> Tuple[torch.nn.Module, Any]:
    """A causal LM checkpoint in eval mode (safetensors only, offline) and its tokenizer.

    Parameters
    ----------
    directory : str
        The checkpoint directory: ``config.json`` whose ``architectures`` name a causal
        LM (:func:`is_causal_lm`), safetensors weights with the language-model head
        (or a head tied to the input embedding), and a tokenizer.
    device : torch.device or str
        Where to put the model (default ``"cpu"``).
    dtype : str or torch.dtype
        The dtype of the weights (:func:`~geoopt_quotient.experiments.classifiers.torch_dtype`;
        default ``"auto"``, the checkpoint's own). Measure sharpness in ``"float32"`` or
        better: a perturbation of a bfloat16 weight is rounded to 2^-8 of it.
    where : str or None
        Prefix of the error messages (default ``"checkpoint DIR"``).

    Returns
    -------
    model : torch.nn.Module
        The causal LM, in eval mode on ``device``.
    tokenizer : object
        Its tokenizer.

    Raises
    ------
    InputError
        If the directory is not a complete checkpoint, its architectures name no causal
        LM, or it lacks weights of the model (e.g. the language-model head), which
        loading would initialise at random.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    where = where or f"checkpoint {directory}"
    config = read_config(directory, where=where)
    architectures = list(getattr(config, "architectures", None) or ())
    if architectures and not is_causal_lm(config):
        raise InputError(
            f"{where}: not a causal language model (config.json's architectures: "
            f"{', '.join(architectures)}); measure a classifier on labelled examples "
            "(--data FILE on the command line)"
        )
    tokenizer = load_tokenizer(directory, where=where)
    model = load_pretrained(AutoModelForCausalLM, directory, dtype=dtype, where=where)
    return model.to(device).eval(), tokenizer


def text_blocks(
    path: str, tokenizer: Any, block_size: int, *, where: Optional[str] = None
) -> torch.Tensor:
    """The token ids of a text file in consecutive blocks of ``block_size``.

    The whole file is tokenised as one document (the tokenizer's special tokens, e.g. a
    beginning-of-sequence token, are added as for any document) and cut into
    ``len // block_size`` blocks; the last ``len % block_size`` tokens are dropped.

    Parameters
    ----------
    path : str
        A UTF-8 text file.
    tokenizer : callable
        A Hugging Face tokenizer.
    block_size : int
        Tokens per block, at least 2 (one next-token prediction).
    where : str or None
        Prefix of the error messages (default ``"text PATH"``).

    Returns
    -------
    torch.Tensor
        ``(blocks, block_size)`` token ids (``torch.long``).

    Raises
    ------
    InputError
        If the file cannot be read, is not UTF-8 (the message names the line), or holds
        fewer than ``block_size`` tokens.
    ValueError
        If ``block_size < 2``.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")
    where = where or f"text {path}"
    text = "".join(line for _, line in text_lines(path, where, expected="UTF-8 text"))
    if not text.strip():
        raise InputError(f"{where}: no text")
    ids = torch.tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.long)
    count = ids.numel() // block_size
    if count == 0:
        raise InputError(
            f"{where}: {ids.numel()} tokens, fewer than one block of {block_size}; give a "
            "longer text or a smaller block size"
        )
    return ids[: count * block_size].view(count, block_size)


def sample_blocks(
    blocks: torch.Tensor,
    batch_size: int,
    *,
    max_blocks: Optional[int] = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> List[Batch]:
    """Batches of blocks drawn at random without replacement, reproducibly.

    A permutation of the blocks from a CPU generator seeded with ``seed`` (the same on
    every machine) gives the order; its first ``max_blocks`` blocks are cut into batches
    of ``batch_size`` (the last one may be smaller).

    Parameters
    ----------
    blocks : torch.Tensor
        ``(blocks, block_size)`` token ids (:func:`text_blocks`).
    batch_size : int
        Blocks per batch.
    max_blocks : int or None
        Draw this many blocks (default all, in random order).
    seed : int
        Seed of the draw (default 0).
    device : torch.device or str
        Where to put the tensors.

    Returns
    -------
    list of (dict, torch.Tensor)
        Per batch, the model's inputs ``{"input_ids": ids}`` and the targets ``ids``
        (:func:`next_token_loss` shifts them).

    Raises
    ------
    ValueError
        If ``batch_size < 1``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(blocks.shape[0], generator=generator)[:max_blocks]
    chosen = blocks[order].to(device)
    return [({"input_ids": ids}, ids) for ids in chosen.split(batch_size)]


def _max_positions(config: Any) -> Optional[int]:
    for name in ("max_position_embeddings", "n_positions", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_text_blocks(
    path: str,
    model: torch.nn.Module,
    tokenizer: Any,
    block_size: int,
    *,
    where: Optional[str] = None,
) -> torch.Tensor:
    """:func:`text_blocks` of a file for ``model``, checked against its positions and
    vocabulary.

    Parameters
    ----------
    path : str
        A UTF-8 text file.
    model : torch.nn.Module
        The causal LM (its ``config`` gives the positions and the vocabulary size).
    tokenizer : callable
        Its tokenizer.
    block_size : int
        Tokens per block, at most the model's maximum positions.
    where : str or None
        Prefix of the error messages (default ``"text PATH"``).

    Returns
    -------
    torch.Tensor
        ``(blocks, block_size)`` token ids.

    Raises
    ------
    InputError
        For a problem with the file (:func:`text_blocks`), a block longer than the
        model's positions, or a token id outside the model's vocabulary.
    """
    where = where or f"text {path}"
    config = model.config
    positions = _max_positions(config)
    if positions is not None and block_size > positions:
        raise InputError(
            f"{where}: blocks of {block_size} tokens are longer than the model's "
            f"{positions} positions; give a block size of at most {positions}"
        )
    blocks = text_blocks(path, tokenizer, block_size, where=where)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and int(blocks.max()) >= vocab:
        raise InputError(
            f"{where}: the tokenizer gives token id {int(blocks.max())}, outside the "
            f"model's vocabulary of {vocab}: tokenizer and model do not belong together"
        )
    return blocks


def load_text_batches(
    path: str,
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    block_size: int,
    batch_size: int,
    max_blocks: Optional[int] = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    where: Optional[str] = None,
) -> List[Batch]:
    """Next-token batches of a text file for ``model``: :func:`load_text_blocks`, then
    :func:`sample_blocks`.

    Parameters
    ----------
    path : str
        A UTF-8 text file.
    model : torch.nn.Module
        The causal LM (its ``config`` gives the positions and the vocabulary size).
    tokenizer : callable
        Its tokenizer.
    block_size : int
        Tokens per block, at most the model's maximum positions.
    batch_size : int
        Blocks per batch.
    max_blocks : int or None
        Draw this many blocks (default all).
    seed : int
        Seed of the draw.
    device : torch.device or str
        Where to put the tensors.
    where : str or None
        Prefix of the error messages (default ``"text PATH"``).

    Returns
    -------
    list of (dict, torch.Tensor)
        The batches of :func:`sample_blocks`.

    Raises
    ------
    InputError
        As :func:`load_text_blocks`.
    """
    blocks = load_text_blocks(path, model, tokenizer, block_size, where=where)
    return sample_blocks(blocks, batch_size, max_blocks=max_blocks, seed=seed, device=device)


def next_token_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    r"""Mean next-token cross-entropy of a batch of blocks, in float32 or better.

    .. math::

        L = -\frac{1}{B(T-1)} \sum_{b=1}^{B} \sum_{t=1}^{T-1}
            \log \operatorname{softmax}(z_{b,t})_{x_{b,t+1}}

    with :math:`z_{b,t}` the logits at position :math:`t` (cast to float32 for a
    half-precision model: sharpness is a small difference of two losses).

    Parameters
    ----------
    model : torch.nn.Module
        A causal LM whose output has ``logits`` of shape ``(B, T, vocab)``.
    batch : (dict, torch.Tensor)
        The model's inputs and the ``(B, T)`` token ids (:func:`sample_blocks`).

    Returns
    -------
    torch.Tensor
        The scalar loss, for :func:`~geoopt_quotient.geodesic_sharpness`.
    """
    inputs, ids = batch
    logits = model(**inputs, use_cache=False).logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


@torch.no_grad()
def next_token_error(model: torch.nn.Module, batches: Sequence[Batch]) -> float:
    r"""Fraction of next tokens the model gets wrong (argmax of the logits), in eval mode.

    Over all blocks :math:`b` and positions :math:`t < T`: the share of
    :math:`\arg\max z_{b,t} \neq x_{b,t+1}`, the error rate of a language model, as
    :func:`~geoopt_quotient.experiments.classifiers.error_rate` is a classifier's.

    Parameters
    ----------
    model : torch.nn.Module
        A causal LM (used in the mode it is in).
    batches : sequence of (dict, torch.Tensor)
        Inputs and token ids (:func:`sample_blocks`).

    Returns
    -------
    float
        Wrong predictions over all predictions, in [0, 1].

    Raises
    ------
    ValueError
        For no predictions (no batches, or blocks of one token).
    """
    wrong = total = 0
    for inputs, ids in batches:
        predicted = model(**inputs, use_cache=False).logits[:, :-1].argmax(-1)
        wrong += int((predicted != ids[:, 1:]).sum())
        total += predicted.numel()
    if total == 0:
        raise ValueError("next_token_error needs at least one prediction")
    return wrong / total
