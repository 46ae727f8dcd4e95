"""The testing kit needs hypothesis: say which extra installs it, before anything else fails."""

from .._extras import require

require("hypothesis", "geoopt_quotient.testing")
