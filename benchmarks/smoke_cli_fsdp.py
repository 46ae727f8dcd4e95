"""Smoke run of ``geoopt-quotient sharpness --fsdp`` under torchrun, against one process.

Saves a tiny float64 Llama checkpoint (with a word-level tokenizer) and a text file in a
temporary directory, measures it with ``python -m geoopt_quotient sharpness`` in one
process and with ``torchrun --standalone --nproc_per_node N ... --fsdp`` on the same
batches and device, and compares the values (1e-10 relative, float64). Exit status 1 on
a mismatch or a failed run. On CUDA the sharded run uses NCCL, each process on the GPU of
its LOCAL_RANK (``--nproc 1``: the 1-GPU smoke test of the command's sharded path); on
the CPU, gloo. No timing.

    python benchmarks/smoke_cli_fsdp.py --device cuda --nproc 1
    python benchmarks/smoke_cli_fsdp.py --device cpu --nproc 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

VOCABULARY = "one two three four five six seven eight nine ten".split()
COMMAND = ["--block-size", "8", "--batch-size", "4", "--max-examples", "8", "--iters", "5"]
COMMAND += ["--metric", "both", "--rho", "0.05", "--quiet"]


def save_checkpoint(directory: Path) -> None:
    """A 2-layer float64 Llama (2 query heads on 1 key/value head) and its tokenizer."""
    import tokenizers
    import transformers

    words = {w: i for i, w in enumerate(["<unk>", "<eos>", *VOCABULARY])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>"
    ).save_pretrained(directory)
    config = transformers.LlamaConfig(
        vocab_size=len(words),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=24,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).double().save_pretrained(directory)


def run(argv, out: Path) -> dict:
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run([*argv, "--json", str(out)], check=True, env=env, timeout=600)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        save_checkpoint(root / "llama")
        words = torch.randint(0, len(VOCABULARY), (40, 12), generator=torch.manual_seed(0))
        text = "\n".join(" ".join(VOCABULARY[i] for i in line) for line in words.tolist())
        (root / "valid.txt").write_text(text + "\n")
        command = ["sharpness", "--model", str(root / "llama"), "--text", str(root / "valid.txt")]
        command += [*COMMAND, "--device", args.device]
        one = run([sys.executable, "-m", "geoopt_quotient", *command], root / "one.json")
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        torchrun += ["--nproc_per_node", str(args.nproc), "-m", "geoopt_quotient"]
        sharded = run([*torchrun, *command, "--fsdp"], root / "fsdp.json")
    failed = False
    for name, result in one["results"].items():
        got = sharded["results"][name]["value"]
        agree = math.isclose(got, result["value"], rel_tol=1e-10)
        failed |= not agree
        print(f"{name:13s} one process {result['value']:.17g}  --fsdp {got:.17g}  {agree}")
    print(f"fsdp: {sharded['fsdp']}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
