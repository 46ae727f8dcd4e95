"""Shared test models and helpers."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch
from device_mode import TensorsOnDevice
from hypothesis import settings
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def pytest_addoption(parser):
    parser.addoption(
        "--torch-device",
        default="cpu",
        help="run the tests marked 'on_device' with the tensors they create on this torch "
        "device (e.g. cuda) and deselect the others; default: cpu, everything",
    )


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says it)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per usable core, at most 8 (each holds torch and models)."""
    return max(1, min(usable_cores(), 8))


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:  # a share of the cores per worker, not every core for each
        torch.set_num_threads(max(1, usable_cores() // int(workers)))
    config.addinivalue_line(
        "markers",
        "on_device: runs on the device of --torch-device (geometry, sharpness, Hessian, layers, "
        "symmetries); the other tests are CPU-only and deselected by --torch-device",
    )
    device = run_device(config)
    if device.type == "cpu":
        return
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--torch-device {device}: CUDA is not available here")
    # the first call of a GPU library (cuBLAS, cuSOLVER) takes a while: no deadlines
    settings.register_profile("device", deadline=None)
    settings.load_profile("device")
    config._device_mode = TensorsOnDevice(device)
    config._device_mode.__enter__()


def pytest_unconfigure(config):
    mode = getattr(config, "_device_mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)


def pytest_collection_modifyitems(config, items):
    if run_device(config).type == "cpu":
        return
    keep = [item for item in items if item.get_closest_marker("on_device")]
    kept = set(map(id, keep))
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = keep


def run_device(config) -> torch.device:
    return torch.device(config.getoption("--torch-device"))


@pytest.fixture
def device(request) -> torch.device:
    """The device of this run (``--torch-device``)."""
    return run_device(request.config)


class TinyTransformer(torch.nn.Module):
    """Two post-LN encoder layers with multi-head attention (biases on) and a linear head."""

    def __init__(self, vocab: int = 11, dim: int = 12, heads: int = 3, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True
            )
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


@pytest.fixture(scope="module")
def single_thread():
    """Tiny tensors: intra-op threads only add scheduling latency, and on a busy machine
    each of thousands of tiny LAPACK calls can wait for a descheduled worker thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_close(actual, expected, rtol, scale=None, what=""):
    """``max|actual - expected| <= rtol * max(max|expected|, scale)``, result finite."""
    actual, expected = torch.broadcast_tensors(actual, expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert torch.isfinite(actual).all(), f"{what}: non-finite result"
    err = (actual.double() - expected.double()).abs().max().item()
    ref = expected.double().abs().max().item() if expected.numel() else 0.0
    if scale is not None:
        ref = max(ref, float(scale))
    assert err <= rtol * ref, f"{what}: error {err:.3g} > {rtol:g} * {ref:.3g}"


class FreshTensors(TorchDispatchMode):
    """Records every tensor an operator returns in storage of its own (not one of its
    operands': ``out=`` and in-place calls, views), that is, that it allocated:
    ``records`` holds ``(operator, entries, bytes of the storage)`` of each."""

    def __init__(self):
        super().__init__()
        self.records: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = (t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        operands = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in operands:
                storage = t.untyped_storage()
                self.records.append((func.overloadpacket.__name__, t.numel(), storage.nbytes()))
        return out


def cross_entropy_loss(model, batch):
    tokens, labels = batch
    return torch.nn.functional.cross_entropy(model(tokens), labels)


def random_gl(shape, h, max_condition, generator, dtype=torch.float64):
    """Random invertible matrices (..., h, h) with condition numbers up to ``max_condition``."""
    u, _ = torch.linalg.qr(torch.randn(*shape, h, h, generator=generator, dtype=dtype))
    v, _ = torch.linalg.qr(torch.randn(*shape, h, h, generator=generator, dtype=dtype))
    exponents = torch.rand(*shape, h, generator=generator, dtype=dtype)
    exponents[..., 0], exponents[..., -1] = 0.0, 1.0
    s = max_condition**exponents
    return u @ torch.diag_embed(s) @ v.mT


def tiny_bert_classifier(*, initializer_range: float = 0.02) -> torch.nn.Module:
    """A tiny BertForSequenceClassification (vocabulary 30, 2 layers of 2 heads of 8,
    3 labels) in float64 and eval mode, seeded."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        num_labels=3,
        initializer_range=initializer_range,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).double().eval()


def tiny_llama_causal_lm(layers: int = 1) -> torch.nn.Module:
    """A tiny LlamaForCausalLM (vocabulary 50, ``layers`` layers of 4 query and 2
    key/value heads of 4) in float64, seeded."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


TINY_BERT_WORDS = "the a cat dog sat ran on in mat park good bad movie film was is very not".split()


def save_tiny_bert_classifier(directory, *, layers: int, initializer_range: float | None = None):
    """A tiny BertForSequenceClassification and a BertTokenizerFast over
    ``TINY_BERT_WORDS``, saved to ``directory`` with safetensors, as the CLI expects."""
    import transformers

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *TINY_BERT_WORDS]
    (directory / "vocab.txt").write_text("\n".join(tokens) + "\n")
    # from_pretrained reads vocab.txt under transformers 4 and 5 alike; transformers 5
    # ignores a ``vocab_file=`` argument and maps every word to [UNK]
    tokenizer = transformers.BertTokenizerFast.from_pretrained(directory)
    expected = [tokens.index(t) for t in ["[CLS]", *TINY_BERT_WORDS, "[SEP]"]]
    assert tokenizer(" ".join(TINY_BERT_WORDS))["input_ids"] == expected, "vocab.txt not read"
    extra = {} if initializer_range is None else {"initializer_range": initializer_range}
    config = transformers.BertConfig(
        vocab_size=len(tokens),
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
        num_labels=2,
        id2label={0: "negative", 1: "positive"},
        label2id={"negative": 0, "positive": 1},
        **extra,
    )
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(
        directory, safe_serialization=True
    )
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture
def tiny_transformer():
    torch.manual_seed(0)
    return TinyTransformer().double()


@pytest.fixture
def token_batches():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 11, (16, 6), generator=g)
    labels = torch.randint(0, 2, (16,), generator=g)
    return [(tokens[:8], labels[:8]), (tokens[8:], labels[8:])]


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def smollm2_bench():
    """``benchmarks/bench_smollm2.py``, the loader of the real SmolLM2-135M-Instruct, or a
    skip that says which part of the ``llm`` extra is missing."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        module = importlib.import_module("bench_smollm2")
        reason = module.missing()
        if reason:
            pytest.skip(f"SmolLM2-135M: {reason}")
        yield module
