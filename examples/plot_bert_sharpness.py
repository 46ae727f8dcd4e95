"""
Geodesic sharpness of a tiny BERT
=================================

A Hugging Face :class:`transformers.BertForSequenceClassification`, built from a small
config (random weights, nothing is downloaded), measured on a ``DataLoader`` of dict
batches with the model's own loss. Moving the model along its attention symmetries
changes its adaptive sharpness but not its geodesic sharpness: the network is the same,
and only the quotient geometry knows it.
"""

import matplotlib.pyplot as plt
import torch
import transformers
from torch.utils.data import DataLoader

import geoopt_quotient as gq
from geoopt_quotient.testing import transformed_copy

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
torch.manual_seed(0)
config = transformers.BertConfig(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    num_labels=3,
    initializer_range=0.3,  # larger than BERT's 0.02, so that attention is far from uniform
)
model = transformers.BertForSequenceClassification(config).eval()
examples = [
    {
        "input_ids": torch.randint(0, 100, (12,)),
        "attention_mask": torch.ones(12, dtype=torch.long),
        "labels": torch.tensor(i % 3),
    }
    for i in range(32)
]
loader = DataLoader(examples, batch_size=16)  # default collate: dicts of stacked tensors


def loss_fn(m, b):  # during the call, m's parameters are the perturbed ones
    return m(**b).loss


# %%
# The symmetries, and the two measures
# ------------------------------------

plan = gq.find_symmetries(model, metric="mix")
print(plan.bind(model).summary(max_adaptive_rows=6))

# each measure at its default radius (gq.sharpness.DEFAULT_RADII: mix 0.003, adaptive 0.01)
geodesic = gq.geodesic_sharpness(model, loss_fn, loader, symmetries=plan, iters=10)
adaptive = gq.adaptive_sharpness(model, loss_fn, loader, iters=10)
print(f"geodesic sharpness {geodesic.value:.6g} over {len(geodesic.per_batch)} batches")
print(f"adaptive sharpness {adaptive.value:.6g}")

# %%
# The same network, other factors
# -------------------------------
#
# :func:`~geoopt_quotient.testing.transformed_copy` applies a random group element, of a
# given condition number, to every query/key and value/output pair. The outputs do not
# change (up to float32 rounding); adaptive sharpness does, more as the elements are
# worse conditioned.

conditions = [1.0, 3.0, 10.0, 30.0]
values = {"geodesic (mix)": [], "adaptive": []}
for condition in conditions:
    moved = transformed_copy(model, condition=condition, seed=1)
    batch = next(iter(loader))
    with torch.no_grad():
        change = (moved(**batch).logits - model(**batch).logits).abs().max().item()
    geo = gq.geodesic_sharpness(moved, loss_fn, loader, iters=10).value
    ada = gq.adaptive_sharpness(moved, loss_fn, loader, iters=10).value
    values["geodesic (mix)"].append(geo)
    values["adaptive"].append(ada)
    print(
        f"condition {condition:>4g}: logits moved {change:.1e}, "
        f"geodesic {geo:.6g}, adaptive {ada:.6g}"
    )

fig, ax = plt.subplots(figsize=(6, 4))
for label, series in values.items():
    ax.plot(conditions, series, "o-", label=label)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("condition number of the group elements")
ax.set_ylabel("worst-case sharpness, ρ = 0.05")
ax.set_title("One network, several factorisations")
ax.legend()
ax.grid(alpha=0.3)
fig.tight_layout()
