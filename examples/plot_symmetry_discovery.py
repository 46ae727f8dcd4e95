"""
Symmetry discovery in real architectures
========================================

:func:`~geoopt_quotient.symmetry.find_symmetries` reads a model's attention modules by
their structure and returns a :class:`~geoopt_quotient.symmetry.SymmetryPlan`: one
:math:`\\mathrm{GL}(h)` quotient per query/key and value/output head pair, stacked over
heads and layers, and everything else left to the adaptive geometry. With
``verify=True`` every group is checked on probe inputs: a random group element must
leave the outputs unchanged. The models below are built from small configs (random
weights, nothing is downloaded).
"""

import torch
import transformers

import geoopt_quotient as gq

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
torch.manual_seed(0)
small = {"vocab_size": 64, "num_hidden_layers": 2, "initializer_range": 0.2}


def show(name, model, **kwargs):
    plan = gq.find_symmetries(model.eval(), verify=True, **kwargs)
    print(f"=== {name}")
    print(plan.bind(model).summary(max_adaptive_rows=4))
    print()


# %%
# ``torch.nn.MultiheadAttention``
# -------------------------------
#
# Fused input projections: Q, K and V are row blocks of one ``in_proj_weight``.

layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
show("TransformerEncoderLayer", layer, probe_inputs=torch.randn(2, 5, 16))

# %%
# BERT
# ----
#
# Separate ``query``, ``key``, ``value`` projections and the output projection in a
# sibling module; biases become extra rows of the factors.

config = transformers.BertConfig(
    hidden_size=32, num_attention_heads=4, intermediate_size=64, **small
)
show("BERT", transformers.BertModel(config))

# %%
# GPT-2
# -----
#
# One fused ``Conv1D`` for Q, K and V, stored (in, out): the layouts slice columns.

config = transformers.GPT2Config(
    n_embd=32, n_head=4, n_layer=2, vocab_size=64, initializer_range=0.2
)
show("GPT-2", transformers.GPT2Model(config))

# %%
# LLaMA
# -----
#
# Grouped-query attention shares one value/output element per key/value head. Under
# rotary position embeddings a general :math:`\mathrm{GL}(h)` on Q/K is not a symmetry,
# so those pairs are left to the adaptive geometry, and the plan's notes say why.

config = transformers.LlamaConfig(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    **small,
)
show("LLaMA", transformers.LlamaModel(config))

# %%
# A model without attention
# -------------------------
#
# A plan that finds nothing says so; every parameter then uses the adaptive geometry,
# and geodesic sharpness equals adaptive sharpness.

mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
print(gq.find_symmetries(mlp).bind(mlp).summary(max_adaptive_rows=4))
