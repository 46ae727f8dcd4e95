"""Discovery on a DeepSeek-V3-shaped model on the ``meta`` device: time and host memory.

``transformers.DeepseekV3Config()`` is DeepSeek-V3's own shape (61 layers, hidden 7168,
128 heads of multi-head latent attention, 256 routed experts of 2048 units per MoE
layer, 3 dense layers first). The model is built under ``torch.device("meta")`` (shapes,
no weights), then ``find_symmetries(kinds="all")`` and ``plan.bind(model)`` run once, on
one thread; nothing can be computed on the meta device, so the plan is returned with a
note that it is unverified. Reported: the wall time of discovery and of discovery plus
binding, the process's peak resident memory (``ru_maxrss``) before and after them, and
the groups found (kind, shape).

    python benchmarks/bench_discovery_moe.py --json benchmarks/results/cpu/discovery_moe.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import time
import warnings
from typing import Any, Dict, List, Optional

import torch
import transformers

import geoopt_quotient as gq


def peak_mib() -> float:
    """The process's peak resident memory so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="where to write the results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = transformers.DeepseekV3Config()
    start = time.perf_counter()
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.DeepseekV3ForCausalLM(config)
    built, before = time.perf_counter() - start, peak_mib()
    start = time.perf_counter()
    plan = gq.find_symmetries(model, kinds="all")
    discovered = time.perf_counter() - start
    bound = plan.bind(model)
    total = time.perf_counter() - start
    document = {
        "benchmark": "bench_discovery_moe",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "shape": {
            "layers": config.num_hidden_layers,
            "hidden": config.hidden_size,
            "heads": config.num_attention_heads,
            "routed_experts": config.n_routed_experts,
            "expert_units": config.moe_intermediate_size,
        },
        "build_seconds": round(built, 2),
        "discover_seconds": round(discovered, 2),
        "discover_and_bind_seconds": round(total, 2),
        "peak_rss_mib_before": round(before, 1),
        "peak_rss_mib_after": round(peak_mib(), 1),
        "groups": [{"kind": g.kind, "shape": list(g.shape)} for g in plan.groups],
        "symmetric_groups_bound": len(bound.symmetric_groups),
        "notes": list(plan.notes),
    }
    print(json.dumps({k: v for k, v in document.items() if k != "notes"}, indent=1))
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1) + "\n")
    return document


if __name__ == "__main__":
    main()
