"""
GLQuotient basics
=================

A point of :class:`~geoopt_quotient.manifolds.GLQuotient` is a pair of full-rank factors
:math:`(G, H)` stored as one tensor ``[G; H]``, modulo the action
:math:`(G, H) \\mapsto (G A^{-1}, H A^\\top)` of :math:`\\mathrm{GL}(h)`. This example
checks the invariances that make the geometry well defined on the quotient, then compares
the second-order retraction with the exact exponential map.
"""

import matplotlib.pyplot as plt
import torch

from geoopt_quotient.manifolds import GLQuotient

torch.manual_seed(0)
manifold = GLQuotient(n=7, m=5, metric="mix")
x = manifold.random(3, 7 + 5, 4, dtype=torch.float64)  # 3 heads, h = 4
print(manifold)
print("point:", tuple(x.shape), "  dimension of the quotient per head:", manifold.dim(4))

# %%
# The group action and the invariant product
# ------------------------------------------
#
# One group element per head moves the factors but not their product :math:`GH^\top`.

a = torch.randn(3, 4, 4, dtype=torch.float64)
moved = manifold.act(x, a)
print("factors moved by", (moved - x).abs().max().item())
print("product moved by", (manifold.product(moved) - manifold.product(x)).abs().max().item())

# %%
# Horizontal vectors and the invariant metric
# -------------------------------------------
#
# :meth:`~geoopt_quotient.manifolds.GLQuotient.proju` projects a vector onto the
# horizontal space, metric-orthogonal to the directions along the orbit. A vertical
# vector :math:`(-G\Omega, H\Omega^\top)` projects to zero, and the metric is the same at
# every representative.

xi = manifold.proju(x, torch.randn_like(x))
g, h = manifold.factors(x)
omega = torch.randn(3, 4, 4, dtype=torch.float64)
vertical = manifold.from_factors(-g @ omega, h @ omega.mT)
print("|proju(vertical)| =", manifold.proju(x, vertical).abs().max().item())
print("<xi, xi> at x        :", manifold.inner(x, xi).sum().item())
print("<A.xi, A.xi> at A.x  :", manifold.inner(moved, manifold.act(xi, a)).sum().item())

# %%
# Retraction against the exponential map
# --------------------------------------
#
# The second-order retraction :math:`X + \xi - \tfrac12\Gamma_X(\xi, \xi)` agrees with the
# geodesic to third order in :math:`|\xi|`; the straight line :math:`X + \xi` only to
# second order. The error is measured on the invariant product, for both metrics.

scales = torch.logspace(-2, 0, 9).tolist()
fig, ax = plt.subplots(figsize=(6, 4))
for metric in ("mix", "inv"):
    m = GLQuotient(n=7, m=5, metric=metric)
    v = m.proju(x, torch.randn_like(x))
    v = v / m.norm(x, v).max()
    errors = {"second-order retraction": [], "straight line": []}
    for t in scales:
        exact = m.product(m.expmap(x, t * v, steps=64))
        errors["second-order retraction"].append(
            (m.product(m.retr(x, t * v)) - exact).norm().item()
        )
        errors["straight line"].append((m.product(x + t * v) - exact).norm().item())
    for (label, values), style in zip(errors.items(), ("o-", "s--")):
        ax.loglog(scales, values, style, label=f"{metric}: {label}")
ax.set_xlabel("metric norm of the tangent vector")
ax.set_ylabel("error of the product $GH^T$")
ax.set_title("Retractions against the exponential map")
ax.legend()
ax.grid(alpha=0.3)
fig.tight_layout()
