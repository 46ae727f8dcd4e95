r"""CLIP image classifiers saved as model-soups state dicts, on Hugging Face's CLIP vision model.

The model-soups release (Wortsman et al., 2022) saves each ImageNet fine-tune of OpenAI's
CLIP as the ``state_dict()`` of a wrapper: the CLIP model under ``model.`` (its text
transformer deleted, the other text-side tensors left in place) and a linear
``classification_head``. The wrapper's forward is

.. math::

    \operatorname{logits}(x) = W \frac{f(x)}{\lVert f(x) \rVert_2} + b,

with :math:`f(x) = P^\top \operatorname{LN}(z_{\mathrm{cls}})` the image features of
CLIP's vision transformer (class token after the last layer norm, times the projection
:math:`P`) and :math:`(W, b)` the classification head.

Here the OpenAI key layout (``model.visual.conv1.weight``,
``model.visual.transformer.resblocks.{i}.attn.in_proj_weight``, ...) is converted to a
Hugging Face :class:`~transformers.CLIPVisionModelWithProjection` (the fused
``in_proj`` split into ``q_proj``, ``k_proj``, ``v_proj``; ``proj`` transposed into
``visual_projection``), so that symmetry discovery finds its attention heads like any
Hugging Face CLIP's. The architecture is read off the tensors' shapes as OpenAI's
``build_model`` does: width from ``conv1``, layers from the ``in_proj_weight`` keys,
``heads = width / 64``, the patch size from ``conv1``'s kernel, the image size from the
positional embedding's :math:`g^2 + 1` rows (:math:`g` patches a side), the embedding
size from ``proj``. Files are read with ``torch.load(weights_only=True)`` only: a pickle
that would run code is refused.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, Dict, List, Mapping, Optional

import torch

from .classifiers import InputError
from .io import UnsafeCheckpointError, load_state_dict

__all__ = [
    "CLIPVisionArchitecture",
    "ModelSoupsClassifier",
    "checkpoint_files",
    "infer_architecture",
    "load_model_soups_checkpoint",
    "model_soups_key_shapes",
    "openai_to_hf_vision",
    "read_model_soups_state",
]

VISUAL = "model.visual."
HEAD = "classification_head."
#: Width of one attention head in OpenAI's CLIP (``heads = width // 64``).
HEAD_WIDTH = 64
#: Text-side tensors that the model-soups wrapper keeps after deleting the text transformer.
TEXT_LEFTOVERS = (
    "model.positional_embedding",
    "model.text_projection",
    "model.logit_scale",
    "model.token_embedding.weight",
    "model.ln_final.weight",
    "model.ln_final.bias",
)
_BLOCK = re.compile(r"^model\.visual\.transformer\.resblocks\.(\d+)\.attn\.in_proj_weight$")


@dataclass(frozen=True)
class CLIPVisionArchitecture:
    """The shape of a CLIP ViT image classifier, as read off its state dict.

    Attributes
    ----------
    width, layers, heads : int
        Residual width, number of residual blocks, attention heads per block.
    patch_size, image_size : int
        Side of a patch and of the (square) input image, in pixels.
    embed_dim : int
        Size of the image features (the columns of ``visual.proj``).
    mlp_width : int
        Hidden width of the blocks' MLPs.
    num_classes : int
        Outputs of the classification head.
    """

    width: int
    layers: int
    heads: int
    patch_size: int
    image_size: int
    embed_dim: int
    mlp_width: int
    num_classes: int

    @property
    def grid(self) -> int:
        """Patches along one side of the image."""
        return self.image_size // self.patch_size

    def vision_config(self):
        """The matching :class:`~transformers.CLIPVisionConfig` (QuickGELU, LN eps 1e-5)."""
        from transformers import CLIPVisionConfig

        return CLIPVisionConfig(
            hidden_size=self.width,
            intermediate_size=self.mlp_width,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            image_size=self.image_size,
            patch_size=self.patch_size,
            projection_dim=self.embed_dim,
            hidden_act="quick_gelu",
            layer_norm_eps=1e-5,
        )


def model_soups_key_shapes(arch: CLIPVisionArchitecture) -> Dict[str, tuple]:
    """The vision and head keys of a model-soups state dict of ``arch``, with their shapes.

    Parameters
    ----------
    arch : CLIPVisionArchitecture
        The architecture.

    Returns
    -------
    dict of str to tuple
        Every ``model.visual.*`` and ``classification_head.*`` key with its shape.
    """
    w, m = arch.width, arch.mlp_width
    shapes: Dict[str, tuple] = {
        f"{VISUAL}class_embedding": (w,),
        f"{VISUAL}positional_embedding": (arch.grid**2 + 1, w),
        f"{VISUAL}proj": (w, arch.embed_dim),
        f"{VISUAL}conv1.weight": (w, 3, arch.patch_size, arch.patch_size),
    }
    for name in ("ln_pre", "ln_post"):
        shapes.update({f"{VISUAL}{name}.weight": (w,), f"{VISUAL}{name}.bias": (w,)})
    for i in range(arch.layers):
        block = f"{VISUAL}transformer.resblocks.{i}."
        shapes.update(
            {
                f"{block}attn.in_proj_weight": (3 * w, w),
                f"{block}attn.in_proj_bias": (3 * w,),
                f"{block}attn.out_proj.weight": (w, w),
                f"{block}attn.out_proj.bias": (w,),
                f"{block}mlp.c_fc.weight": (m, w),
                f"{block}mlp.c_fc.bias": (m,),
                f"{block}mlp.c_proj.weight": (w, m),
                f"{block}mlp.c_proj.bias": (w,),
            }
        )
        for name in ("ln_1", "ln_2"):
            shapes.update({f"{block}{name}.weight": (w,), f"{block}{name}.bias": (w,)})
    shapes[f"{HEAD}weight"] = (arch.num_classes, arch.embed_dim)
    shapes[f"{HEAD}bias"] = (arch.num_classes,)
    return shapes


def _strip_parallel_prefix(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Keys saved from ``DataParallel`` start with ``module.``; drop it."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module.") :]: v for k, v in state.items()}
    return dict(state)


def _require(state: Mapping[str, torch.Tensor], key: str, ndim: int, where: str) -> torch.Tensor:
    if key not in state:
        hint = ""
        if key.startswith(VISUAL) and any(k.startswith(f"{VISUAL}layer1.") for k in state):
            hint = " (this is a ResNet CLIP; only ViT CLIP models are supported)"
        elif not any(k.startswith(VISUAL) for k in state):
            hint = " (not a model-soups CLIP state dict: no 'model.visual.' keys)"
        raise InputError(f"{where}: no tensor {key!r}{hint}")
    tensor = state[key]
    if tensor.ndim != ndim:
        raise InputError(f"{where}: {key!r} has shape {tuple(tensor.shape)}, expected {ndim} dims")
    return tensor


def infer_architecture(
    state: Mapping[str, torch.Tensor], *, where: str = "state dict"
) -> CLIPVisionArchitecture:
    """Read the architecture off a model-soups state dict's shapes, as OpenAI's CLIP does.

    The image size is ``patch_size * g`` with :math:`g^2 + 1` rows in the positional
    embedding (the patches and the class token). Every vision and head tensor must be
    present with the shape this architecture gives it; other ``model.`` tensors are
    allowed only among the text-side leftovers (:data:`TEXT_LEFTOVERS`).

    Parameters
    ----------
    state : dict of str to torch.Tensor
        A model-soups state dict (OpenAI key layout).
    where : str
        Prefix of the error messages (default ``"state dict"``).

    Returns
    -------
    CLIPVisionArchitecture
        The architecture the shapes give.

    Raises
    ------
    InputError
        Naming the first missing, misshapen or unknown tensor.
    """
    conv = _require(state, f"{VISUAL}conv1.weight", 4, where)
    positions = _require(state, f"{VISUAL}positional_embedding", 2, where)
    proj = _require(state, f"{VISUAL}proj", 2, where)
    head = _require(state, f"{HEAD}weight", 2, where)
    width, patch = int(conv.shape[0]), int(conv.shape[-1])
    layers = len([k for k in state if _BLOCK.match(k)])
    grid = math.isqrt(int(positions.shape[0]) - 1)
    if grid * grid + 1 != positions.shape[0]:
        raise InputError(
            f"{where}: the positional embedding has {positions.shape[0]} rows, not g^2 + 1 "
            "(g patches a side and the class token)"
        )
    if width % HEAD_WIDTH:
        raise InputError(f"{where}: width {width} is not a multiple of {HEAD_WIDTH}")
    if layers == 0:
        raise InputError(f"{where}: no residual blocks ('...resblocks.N.attn.in_proj_weight')")
    mlp_key = f"{VISUAL}transformer.resblocks.0.mlp.c_fc.weight"
    arch = CLIPVisionArchitecture(
        width=width,
        layers=layers,
        heads=width // HEAD_WIDTH,
        patch_size=patch,
        image_size=patch * grid,
        embed_dim=int(proj.shape[1]),
        mlp_width=int(_require(state, mlp_key, 2, where).shape[0]),
        num_classes=int(head.shape[0]),
    )
    _check_keys(state, arch, where)
    return arch


def _check_keys(
    state: Mapping[str, torch.Tensor], arch: CLIPVisionArchitecture, where: str
) -> None:
    expected = model_soups_key_shapes(arch)
    for key, shape in expected.items():
        if key not in state:
            raise InputError(f"{where}: no tensor {key!r} (expected for {arch})")
        if tuple(state[key].shape) != shape:
            raise InputError(
                f"{where}: {key!r} has shape {tuple(state[key].shape)}, expected {shape}"
            )
    unknown = sorted(k for k in state if k not in expected and k not in TEXT_LEFTOVERS)
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise InputError(
            f"{where}: unexpected tensors {', '.join(map(repr, unknown[:3]))}{more} "
            "(not a model-soups CLIP ViT state dict)"
        )


def openai_to_hf_vision(
    state: Mapping[str, torch.Tensor], arch: CLIPVisionArchitecture
) -> Dict[str, torch.Tensor]:
    """The keys of :class:`~transformers.CLIPVisionModelWithProjection` from the OpenAI layout.

    The fused ``in_proj_weight`` of a block stacks :math:`W_q, W_k, W_v` by rows (as
    ``torch.nn.MultiheadAttention`` does); ``proj`` maps features as ``x @ proj``, so the
    projection ``Linear``'s weight is its transpose.

    Parameters
    ----------
    state : dict of str to torch.Tensor
        A model-soups state dict (OpenAI key layout).
    arch : CLIPVisionArchitecture
        Its architecture (:func:`infer_architecture`).

    Returns
    -------
    dict of str to torch.Tensor
        The vision tower's and projection's tensors under Hugging Face's keys,
        contiguous (the classification head is not included).
    """
    out = {
        "vision_model.embeddings.class_embedding": state[f"{VISUAL}class_embedding"],
        "vision_model.embeddings.patch_embedding.weight": state[f"{VISUAL}conv1.weight"],
        "vision_model.embeddings.position_embedding.weight": state[f"{VISUAL}positional_embedding"],
        "visual_projection.weight": state[f"{VISUAL}proj"].t(),
    }
    norms = {"ln_pre": "vision_model.pre_layrnorm", "ln_post": "vision_model.post_layernorm"}
    block_map = {
        "attn.out_proj": "self_attn.out_proj",
        "ln_1": "layer_norm1",
        "mlp.c_fc": "mlp.fc1",
        "mlp.c_proj": "mlp.fc2",
        "ln_2": "layer_norm2",
    }
    for old, new in norms.items():
        for kind in ("weight", "bias"):
            out[f"{new}.{kind}"] = state[f"{VISUAL}{old}.{kind}"]
    for i in range(arch.layers):
        old_block = f"{VISUAL}transformer.resblocks.{i}."
        new_block = f"vision_model.encoder.layers.{i}."
        for kind, fused in (("weight", "in_proj_weight"), ("bias", "in_proj_bias")):
            parts = state[f"{old_block}attn.{fused}"].chunk(3, dim=0)
            for name, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[f"{new_block}self_attn.{name}.{kind}"] = part
        for old, new in block_map.items():
            for kind in ("weight", "bias"):
                out[f"{new_block}{new}.{kind}"] = state[f"{old_block}{old}.{kind}"]
    return {k: v.contiguous() for k, v in out.items()}


class ModelSoupsClassifier(torch.nn.Module):
    """model-soups' wrapper on Hugging Face CLIP: normalised image features, then a linear head.

    ``forward(pixel_values)`` returns an object with ``logits`` (as Hugging Face
    classifiers do), so the population study's loss and error rate apply unchanged.
    ``initialize=False`` skips the random initialisation (the weights are garbage until
    :meth:`load_openai_state_dict`), which takes seconds for a ViT-B/32.

    Parameters
    ----------
    arch : CLIPVisionArchitecture
        The architecture of the vision tower and of the head.
    initialize : bool
        Initialise the weights randomly (default ``True``); ``False`` when a state dict
        is loaded next.
    """

    def __init__(self, arch: CLIPVisionArchitecture, *, initialize: bool = True):
        super().__init__()
        from transformers import CLIPVisionModelWithProjection

        self.architecture = arch
        with contextlib.nullcontext() if initialize else _initialization_skipped():
            self.clip = CLIPVisionModelWithProjection(arch.vision_config())
            self.classification_head = torch.nn.Linear(arch.embed_dim, arch.num_classes)

    def forward(self, pixel_values: torch.Tensor):
        from transformers.modeling_outputs import ImageClassifierOutput

        features = self.clip(pixel_values=pixel_values).image_embeds
        features = features / features.norm(dim=-1, keepdim=True)
        return ImageClassifierOutput(logits=self.classification_head(features))

    def load_openai_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a model-soups state dict (OpenAI key layout), strictly."""
        hf = openai_to_hf_vision(state, self.architecture)
        self.clip.load_state_dict(hf, strict=True)
        head = {k[len(HEAD) :]: v for k, v in state.items() if k.startswith(HEAD)}
        self.classification_head.load_state_dict(head, strict=True)


def _initialization_skipped() -> ContextManager:
    """``transformers``' ``no_init_weights`` (its module moved in version 5)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:  # pragma: no cover - initialised, only slower
            return contextlib.nullcontext()
    return no_init_weights()


def _float32(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Floating tensors in float32 (model-soups loads its fp16 CLIP weights as float)."""
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def read_model_soups_state(path: str, *, where: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The state dict of a model-soups ``.pt`` file, read without running code.

    Parameters
    ----------
    path : str
        The ``.pt`` file.
    where : str or None
        Prefix of the error messages (default ``"checkpoint PATH"``).

    Returns
    -------
    dict of str to torch.Tensor
        The state dict, a ``module.`` prefix of data-parallel training stripped, floating
        tensors in float32.

    Raises
    ------
    InputError
        For a file that is missing, not a state dict of tensors, or a pickle that
        references anything but tensors and plain containers (refused unread).
    """
    where = where or f"checkpoint {path}"
    try:
        state = load_state_dict(path)
    except UnsafeCheckpointError as error:
        raise InputError(f"{where}: {error}") from None
    except FileNotFoundError as error:
        raise InputError(f"{where}: {error}") from None
    except (ValueError, RuntimeError, OSError, EOFError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise InputError(f"{where}: not a readable torch state dict ({first})") from None
    return _float32(_strip_parallel_prefix(state))


def load_model_soups_checkpoint(
    path: str, device: torch.device | str = "cpu", *, where: Optional[str] = None
) -> ModelSoupsClassifier:
    """A model-soups CLIP checkpoint as a :class:`ModelSoupsClassifier` in eval mode.

    Parameters
    ----------
    path : str
        The ``.pt`` file (a state dict, read without running code).
    device : torch.device or str
        Where to put the model (default ``"cpu"``).
    where : str or None
        Prefix of the error messages (default ``"checkpoint PATH"``).

    Returns
    -------
    ModelSoupsClassifier
        The classifier in float32, in eval mode on ``device``.

    Raises
    ------
    InputError
        For a file that cannot be read safely (:func:`read_model_soups_state`) or whose
        tensors do not make a CLIP classifier (:func:`infer_architecture`).
    """
    where = where or f"checkpoint {path}"
    state = read_model_soups_state(path, where=where)
    arch = infer_architecture(state, where=where)
    model = ModelSoupsClassifier(arch, initialize=False)
    model.load_openai_state_dict(state)
    return model.to(device).eval()


def checkpoint_files(root: str) -> List[Path]:
    """The ``*.pt`` files directly under ``root``, sorted by name.

    Parameters
    ----------
    root : str
        A directory.

    Returns
    -------
    list of pathlib.Path
        The files.
    """
    return sorted(p for p in Path(root).glob("*.pt") if p.is_file())
