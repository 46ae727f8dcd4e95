"""
Benchmark results at a glance
=============================

The benchmark scripts in ``benchmarks/`` write their measurements as JSON into
``benchmarks/results/``; the tables of the performance page are generated from the same
files. This example reads two of them and draws the cost of a step or an iteration of each
method. It measures nothing itself: the numbers are those recorded in the files, on the
device each file names.
"""

import json
from pathlib import Path

import matplotlib.pyplot as plt

# the repository's benchmarks/results/, found from the working directory (the repository
# root or examples/, where the documentation build runs the script)
ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "benchmarks").is_dir())
RESULTS = ROOT / "benchmarks" / "results"


def load(name):
    path = RESULTS / name
    if not path.is_file():
        print(f"{name}: not measured (no such file)")
        return None
    return json.loads(path.read_text())


# %%
# A GeodesicSAM step against SAM, ASAM and SGD (CPU)
# --------------------------------------------------

sam = load("sam/bench_sam.json")
fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
if sam is not None:
    env = sam["environment"]
    print(f"bench_sam.json: CPU ({env['machine']}), {env['threads']} thread(s)", end="")
    print(f", torch {env['torch']}")
    for ax, model in zip(axes, sam["models"].values()):
        methods = list(model["median_seconds_per_step"])
        step = [1e3 * model["median_seconds_per_step"][m] for m in methods]
        ascent = [1e3 * model["median_ascent_seconds_per_step"][m] for m in methods]
        ax.barh(methods, step, color="tab:blue", label="whole step")
        ax.barh(methods, ascent, color="tab:orange", label="first_step (ascent)")
        for y, (m, s) in enumerate(zip(methods, step)):
            ax.text(s, y, f" {model['ratio_to_sam'][m]:.2f}x SAM", va="center", fontsize=8)
        ax.set_xlabel("milliseconds per step")
        ax.set_title(model["model"], fontsize=9)
        ax.invert_yaxis()
        ax.set_xlim(0, max(step) * 1.35)
    axes[0].legend(loc="lower right", fontsize=8)
fig.suptitle("Cost of a step (bench_sam.json)")
fig.tight_layout()

# %%
# One Auto-PGD iteration on a GPU
# -------------------------------

cuda = load("gpu/bench_cuda.json")
fig, ax = plt.subplots(figsize=(8, 3.8))
if cuda is not None:
    env = cuda["environment"]
    print(f"bench_cuda.json: {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}")
    measures = ["forward-backward", "adaptive", "geodesic-inv", "geodesic-mix"]
    units = [
        (model, precision, unit)
        for model, by_precision in cuda["iteration"]["results"].items()
        for precision, unit in by_precision.items()
        if "seconds_per_iteration" in unit
    ]
    width = 0.8 / len(measures)
    for i, measure in enumerate(measures):
        seconds = [unit["seconds_per_iteration"][measure] for _, _, unit in units]
        ax.bar([j + i * width for j in range(len(units))], seconds, width, label=measure)
    ax.set_xticks(
        [j + 1.5 * width for j in range(len(units))],
        [f"{model}\n{precision}" for model, precision, _ in units],
    )
    ax.set_ylabel("seconds per iteration")
    ax.legend(fontsize=8)
ax.set_title("One Auto-PGD iteration against a plain forward and backward pass (bench_cuda.json)")
fig.tight_layout()
