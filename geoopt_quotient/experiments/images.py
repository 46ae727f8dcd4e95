"""Image classification data in the ``ImageFolder`` layout, with CLIP's preprocessing.

A root directory holds one sub-directory per class; the classes in sorted order are the
labels ``0, 1, ...`` (as for ImageNet's synset directories, and as torchvision's
``ImageFolder`` numbers them). Images are found recursively under each class directory,
in sorted order; an empty class directory keeps its label. Preprocessing is CLIP's:
resize the shorter side to the model's image size (bicubic), centre crop, scale to
``[0, 1]``, normalise with OpenAI's channel means and standard deviations; it is done by
``transformers``' CLIP image processor on its PIL backend (no torchvision needed).
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._extras import require
from .classifiers import Batch, InputError

__all__ = [
    "IMAGE_SUFFIXES",
    "ImageFolder",
    "clip_image_processor",
    "folder_digest",
    "image_batches",
    "iter_image_batches",
    "read_image_folder",
    "sample_indices",
]

#: File name endings read as images (case-insensitive), as torchvision's ImageFolder.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
#: Seed of the draw of the sharpness examples from a folder: the same images for every model.
SAMPLE_SEED = 0


@dataclass(frozen=True)
class ImageFolder:
    """The images of an ``ImageFolder`` tree: class names, files, labels.

    Attributes
    ----------
    root : str
        The tree's root directory (``ROOT/CLASS/IMAGE``).
    classes : tuple of str
        The class directories' names, sorted; class ``i`` has label ``i``.
    files : tuple of str
        The image paths, class by class, sorted within each class.
    labels : tuple of int
        The label of each file.
    """

    root: str
    classes: Tuple[str, ...]
    files: Tuple[str, ...]
    labels: Tuple[int, ...]

    def __len__(self) -> int:
        return len(self.files)


def _class_images(directory: str) -> List[str]:
    found = []
    for parent, subdirs, names in os.walk(directory, followlinks=True):
        subdirs.sort()
        found.extend(
            os.path.join(parent, n) for n in sorted(names) if n.lower().endswith(IMAGE_SUFFIXES)
        )
    return found


@functools.lru_cache(maxsize=8)
def read_image_folder(root: str, *, where: Optional[str] = None) -> ImageFolder:
    """List an ``ImageFolder`` tree (cached per root; the listing, not the pixels).

    Parameters
    ----------
    root : str
        The root directory: one sub-directory per class (hidden ones skipped), images
        with the endings of :data:`IMAGE_SUFFIXES` anywhere below it.
    where : str or None
        Prefix of the error messages (default ``"images ROOT"``).

    Returns
    -------
    ImageFolder
        The listing.

    Raises
    ------
    InputError
        If ``root`` is not a directory, has no class sub-directories or no images.
    """
    where = where or f"images {root}"
    if not os.path.isdir(root):
        raise InputError(f"{where}: not a directory")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise InputError(
            f"{where}: no class sub-directories (expected ROOT/CLASS/IMAGE, the ImageFolder "
            "layout: the sorted class directories give the labels)"
        )
    files: List[str] = []
    labels: List[int] = []
    for label, name in enumerate(classes):
        images = _class_images(os.path.join(root, name))
        files.extend(images)
        labels.extend([label] * len(images))
    if not files:
        raise InputError(f"{where}: no images ({', '.join(IMAGE_SUFFIXES)}) in its classes")
    return ImageFolder(root, tuple(classes), tuple(files), tuple(labels))


def folder_digest(root: str) -> str:
    """SHA-256 over the relative paths, sizes and modification times of a folder's images.

    Identifies the data of a run without reading the pixels (first 16 hex digits).
    The labels enter the digest too.

    Parameters
    ----------
    root : str
        The ``ImageFolder`` root (:func:`read_image_folder`).

    Returns
    -------
    str
        16 hex digits.
    """
    folder = read_image_folder(root)
    digest = hashlib.sha256()
    for path, label in zip(folder.files, folder.labels):
        stat = os.stat(path)
        relative = os.path.relpath(path, root)
        digest.update(f"{relative}\0{label}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def clip_image_processor(image_size: int) -> Any:
    """``transformers``' CLIP image processor for ``image_size`` pixels, PIL backend.

    Parameters
    ----------
    image_size : int
        The shortest edge after resizing, and the size of the square centre crop.

    Returns
    -------
    transformers.CLIPImageProcessor
        The processor (``CLIPImageProcessorPil`` with transformers 5).
    """
    try:  # transformers >= 5: the default CLIPImageProcessor needs torchvision
        from transformers import CLIPImageProcessorPil as Processor
    except ImportError:  # transformers 4: CLIPImageProcessor is the PIL/NumPy one
        from transformers import CLIPImageProcessor as Processor
    return Processor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )


def sample_indices(count: int, limit: Optional[int], seed: int = SAMPLE_SEED) -> np.ndarray:
    """``limit`` of ``range(count)`` drawn without replacement (all, shuffled, without limit).

    A seeded permutation (NumPy's PCG64, the same on every machine), so the first
    examples of a class-sorted folder cover the classes.

    Parameters
    ----------
    count : int
        Number of items.
    limit : int or None
        How many to draw (``None``: all).
    seed : int
        Seed of the permutation (default :data:`SAMPLE_SEED`).

    Returns
    -------
    numpy.ndarray
        The drawn indices, in the order drawn.
    """
    order = np.random.default_rng(seed).permutation(count)
    return order if limit is None else order[:limit]


class _ImageDataset(torch.utils.data.Dataset):
    def __init__(self, folder: ImageFolder, indices: Sequence[int], image_size: int):
        self.folder, self.indices, self.image_size = folder, list(indices), image_size
        self.processor = None

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> Tuple[torch.Tensor, int]:
        pil_image = require("PIL.Image", "reading images")
        if self.processor is None:  # built in the worker that uses it
            self.processor = clip_image_processor(self.image_size)
        index = self.indices[position]
        path = self.folder.files[index]
        try:
            with pil_image.open(path) as image:
                pixels = self.processor(images=image.convert("RGB"), return_tensors="pt")
        except (OSError, pil_image.UnidentifiedImageError) as error:
            raise InputError(f"image {path}: cannot be read ({error})") from None
        return pixels["pixel_values"][0], self.folder.labels[index]


def iter_image_batches(
    folder: ImageFolder,
    image_size: int,
    *,
    batch_size: int,
    indices: Optional[Sequence[int]] = None,
    device: torch.device | str = "cpu",
    workers: int = 0,
) -> Iterator[Batch]:
    """``({"pixel_values": x}, labels)`` batches of ``folder`` (in ``indices`` order),
    preprocessed as CLIP's, decoded by ``workers`` processes (0: this one).

    Parameters
    ----------
    folder : ImageFolder
        The images.
    image_size : int
        The side of the square images after preprocessing (:func:`clip_image_processor`).
    batch_size : int
        Images per batch.
    indices : sequence of int or None
        The images to read, in order (default all, in the folder's order).
    device : torch.device or str
        Where to put the tensors (default ``"cpu"``).
    workers : int
        Decoding processes (0: in this process).

    Yields
    ------
    inputs : dict
        ``{"pixel_values": tensor of shape (batch, 3, image_size, image_size)}``.
    labels : torch.Tensor
        The images' labels.

    Raises
    ------
    InputError
        For an image that cannot be read.
    """
    indices = range(len(folder)) if indices is None else indices
    dataset = _ImageDataset(folder, indices, image_size)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=False, num_workers=workers
    )
    for pixels, labels in loader:
        yield {"pixel_values": pixels.to(device)}, labels.to(device)


@functools.lru_cache(maxsize=2)
def _sample_batches(
    root: str, image_size: int, batch_size: int, limit: Optional[int], workers: int
) -> Tuple[Batch, ...]:
    folder = read_image_folder(root)
    indices = sample_indices(len(folder), limit)
    batches = iter_image_batches(
        folder, image_size, batch_size=batch_size, indices=indices, workers=workers
    )
    return tuple(batches)


def image_batches(
    root: str,
    image_size: int,
    *,
    batch_size: int,
    max_examples: Optional[int] = None,
    device: torch.device | str = "cpu",
    workers: int = 0,
) -> List[Batch]:
    """The sharpness examples of an image folder: ``max_examples`` images drawn with a
    fixed seed (:func:`sample_indices`), in batches of ``batch_size``.

    The same for every model of a population; the preprocessed batches of the last two
    requests are kept in memory (on the CPU), so a population decodes them once.

    Parameters
    ----------
    root : str
        The ``ImageFolder`` root.
    image_size : int
        The side of the square images after preprocessing.
    batch_size : int
        Images per batch.
    max_examples : int or None
        Number of images drawn (default all).
    device : torch.device or str
        Where to put the batches (default ``"cpu"``).
    workers : int
        Decoding processes (0: in this process).

    Returns
    -------
    list of (dict, torch.Tensor)
        ``({"pixel_values": x}, labels)`` batches.

    Raises
    ------
    InputError
        For a folder that cannot be listed or an image that cannot be read.
    """
    batches = _sample_batches(root, image_size, batch_size, max_examples, workers)
    return [({k: v.to(device) for k, v in x.items()}, y.to(device)) for x, y in batches]
