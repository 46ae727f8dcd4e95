"""What a checkpoint's config says its model is, read without loading the model.

Both the classifier loaders (:mod:`~geoopt_quotient.experiments.classifiers`, to say what
to do with a causal LM given as a classifier) and the causal-LM loaders ask it, so it
lives below both; its public home is :mod:`~geoopt_quotient.experiments.causal_lm`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_causal_lm"]


def is_causal_lm(config: Any) -> bool:
    """Whether ``config.architectures`` names a causal language model of transformers.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        A checkpoint's config.

    Returns
    -------
    bool
        Whether one of its architectures is a class of ``AutoModelForCausalLM``
        (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ``GPTNeoXForCausalLM``, ...).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(name in known for name in getattr(config, "architectures", None) or ())
