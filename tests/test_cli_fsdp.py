"""``geoopt-quotient sharpness --fsdp``: a checkpoint sharded over processes with FSDP2.

Under ``torchrun --standalone --nproc_per_node 2`` (gloo) a tiny float64 Llama saved with
``save_pretrained`` gives the single-process value on the same batches; without torchrun
the same path runs in a mesh of one process; a batch that does not split evenly over the
processes is refused, with a ``--batch-size`` that works.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
pytest.importorskip("torch.distributed.fsdp")

from test_cli_causal_lm import WORDS, save_causal_lm  # noqa: E402

from geoopt_quotient.cli import main  # noqa: E402
from geoopt_quotient.cli._fsdp import (  # noqa: E402
    rows_of_batches,
    transformer_blocks,
    working_sizes,
)
from geoopt_quotient.experiments.classifiers import InputError  # noqa: E402

#: float64 throughout: the sharded run sums the ranks' mean losses (and the ball's norms
#: and Gram matrices) in another order than one process, a relative change of a few
#: eps = 2.2e-16 per loss; 5 Auto-PGD iterations carry it to the value smoothly (no step
#: decision flips at this distance), so 1e-10 leaves a margin of about 10^5 over the
#: 1e-15 differences seen, and is 10^6 below the change a different batch makes (the
#: negative below).
RELATIVE = 1e-10
ARGS = ["--block-size", "8", "--batch-size", "4", "--max-examples", "8", "--iters", "5"]
ARGS += ["--metric", "both", "--rho", "0.05", "--quiet"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny float64 Llama (2 layers, 2 query heads on 1 key/value head) and its text."""
    directory = save_causal_lm(tmp_path_factory.mktemp("llama"), "llama", dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(WORDS), (40, 12), generator=generator).tolist()
    text = directory / "valid.txt"
    text.write_text("\n".join(" ".join(WORDS[i] for i in line) for line in picks) + "\n")
    return directory, str(text)


def run_json(argv, capsys) -> dict:
    assert main([*argv, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def single_process(llama):
    """One process, no sharding, the same batches (1 thread, as the workers)."""
    directory, text = llama
    out = directory.parent / "one.json"
    assert (
        main(["sharpness", "--model", str(directory), "--text", text, *ARGS, "--json", str(out)])
        == 0
    )
    return json.loads(out.read_text())


def assert_same_values(
    got: dict, expected: dict, names=("adaptive", "geodesic_mix", "geodesic_inv")
) -> None:
    assert set(got["results"]) == set(names)
    for name, result in expected["results"].items():
        assert got["results"][name]["per_batch"] == pytest.approx(
            result["per_batch"], rel=RELATIVE
        ), name
        assert got["results"][name]["value"] == pytest.approx(result["value"], rel=RELATIVE)


def test_torchrun_fsdp_gives_the_single_process_value(llama, single_process, tmp_path):
    directory, text = llama
    out = tmp_path / "fsdp.json"
    argv = ["sharpness", "--model", str(directory), "--text", text, *ARGS, "--fsdp"]
    # --standalone: torchrun's own rendezvous on a port the system assigns, none probed
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc_per_node", "2", "-m", "geoopt_quotient"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [*torchrun, *argv, "--json", str(out)], env=env, timeout=300, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    document = json.loads(out.read_text())
    assert document["processes"] == 2
    total = document["model"]["parameters"]
    fsdp = document["fsdp"]
    # 4 rows per batch, 2 on each process; 2 decoder layers and the root wrapped; rank 0
    # holds about half of the entries
    assert fsdp["rows_per_process"] == [2, 2] and fsdp["fsdp_modules"] == 3
    assert 0.4 * total < fsdp["parameters_on_rank_0"] < 0.6 * total
    assert_same_values(document, single_process)


def test_fsdp_without_torchrun_runs_in_a_mesh_of_one(llama, single_process, capsys):
    directory, text = llama
    argv = ["sharpness", "--model", str(directory), "--text", text, *ARGS, "--fsdp"]
    document = run_json(argv, capsys)
    assert document["fsdp"]["rows_per_process"] == [4, 4]
    assert document["fsdp"]["parameters_on_rank_0"] == document["model"]["parameters"]
    assert_same_values(document, single_process)
    assert not dist.is_initialized()  # the group of one is left afterwards


def test_other_rows_give_another_value(llama, single_process, capsys):
    """The negative: the comparisons above can fail (other blocks, another value)."""
    directory, text = llama
    argv = ["sharpness", "--model", str(directory), "--text", text, *ARGS, "--data-seed", "1"]
    other = run_json(argv, capsys)
    for name, result in single_process["results"].items():
        assert other["results"][name]["value"] != pytest.approx(result["value"], rel=1e-4)


def batches_of(rows):
    return [
        ({"input_ids": torch.arange(n * 3).reshape(n, 3)}, torch.arange(n) + 100 * i)
        for i, n in enumerate(rows)
    ]


def test_each_process_gets_its_rows_of_every_batch():
    batches = batches_of([4, 2])
    parts = [rows_of_batches(batches, rank, 2, 4) for rank in range(2)]
    for index, (inputs, targets) in enumerate(batches):
        joined = torch.cat([part[index][1] for part in parts])
        assert torch.equal(joined, targets)
        ids = torch.cat([part[index][0]["input_ids"] for part in parts])
        assert torch.equal(ids, inputs["input_ids"])
    assert [int(t.shape[0]) for _, t in parts[1]] == [2, 1]


def test_uneven_batches_are_refused_with_a_batch_size_that_works():
    with pytest.raises(
        InputError, match=r"batch 1 has 3 rows.*2 processes.*--batch-size 2 \(or 4, 6\)$"
    ):
        rows_of_batches(batches_of([4, 3, 1]), 0, 2, 3)  # 8 rows: 4 + 4 or 2 + 2 + 2 + 2
    with pytest.raises(InputError, match=r"give --max-examples 6$"):
        rows_of_batches(batches_of([4, 3]), 0, 2, 4)  # 7 rows: no batch size splits them
    with pytest.raises(InputError, match=r"give --max-examples 6 --batch-size 2 \(or 4, 6\)$"):
        rows_of_batches(batches_of([3, 3, 1]), 0, 2, 3)  # 6 rows in 3 + 3 would not split


def advised(rows, world, batch_size):
    """The ``--max-examples`` and ``--batch-size`` values the refusal of ``rows`` advises
    (``None`` where it keeps the given one), or ``None`` where ``rows`` are accepted."""
    try:
        rows_of_batches(batches_of(rows), 0, world, batch_size)
    except InputError as error:
        message = str(error)
    else:
        return None
    examples = re.search(r"--max-examples (\d+)", message)
    sizes = re.search(r"--batch-size (\d+)(?: \(or ([\d, ]+)\))?", message)
    size_choices = [batch_size]
    if sizes:
        size_choices = [int(sizes.group(1))]
        size_choices += [int(s) for s in (sizes.group(2) or "").split(", ") if s]
    return int(examples.group(1)) if examples else sum(rows), size_choices


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("total", [5, 7, 11, 12, 13])
@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 8])
def test_following_the_advice_gives_batches_that_split(world, total, batch_size):
    """What the refusal advises is accepted: no second refusal."""
    full, rest = divmod(total, batch_size)
    rows = [batch_size] * full + ([rest] if rest else [])
    advice = advised(rows, world, batch_size)
    if advice is None:
        return
    examples, sizes = advice
    assert 0 < examples <= total
    for size in sizes:
        full, rest = divmod(examples, size)
        again = [size] * full + ([rest] if rest else [])
        assert advised(again, world, size) is None, (rows, examples, size)


@pytest.mark.parametrize(
    ("total", "world", "size"), [(8, 2, 3), (32, 4, 7), (12, 3, 5), (14, 7, 2)]
)
def test_suggested_batch_sizes_split_every_batch(total, world, size):
    sizes = working_sizes([total], world, size)
    assert sizes
    for suggested in sizes:
        full, rest = divmod(total, suggested)
        rows = [suggested] * full + ([rest] if rest else [])
        assert all(count % world == 0 for count in rows), (suggested, rows)
    assert working_sizes([total + 1], world, size) == []  # no size splits total + 1 rows


def test_transformer_blocks_are_the_models_unsplittable_layers():
    from conftest import tiny_bert_classifier, tiny_llama_causal_lm

    llama = tiny_llama_causal_lm()
    assert transformer_blocks(llama) == list(llama.model.layers)
    bert = tiny_bert_classifier()
    names = {type(block).__name__ for block in transformer_blocks(bert)}
    assert "BertLayer" in names
    with pytest.raises(InputError, match="declares no transformer blocks"):
        transformer_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_fsdp_measures_a_classifier_too(tmp_path, capsys):
    """A BERT classifier (blocks: its ``BertLayer`` modules; inputs with token type ids and
    an attention mask, split by rows), in float64, in a mesh of one."""
    from conftest import save_tiny_bert_classifier

    (tmp_path / "bert").mkdir()
    directory = save_tiny_bert_classifier(tmp_path / "bert", layers=2, initializer_range=0.3)
    rows = ["the cat sat on the mat", "a dog ran", "the movie was very good", "a bad film"]
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(rows))
    )
    argv = ["sharpness", "--model", str(directory), "--data", str(data), "--batch-size", "2"]
    argv += ["--iters", "3", "--metric", "inv", "--dtype", "float64", "--quiet"]
    alone, sharded = run_json(argv, capsys), run_json([*argv, "--fsdp"], capsys)
    assert sharded["fsdp"]["fsdp_modules"] > 2  # the layers (and the embeddings) and the root
    assert_same_values(sharded, alone, names={"adaptive", "geodesic_inv"})


def test_a_failed_symmetry_check_stops_every_process(llama, capsys, monkeypatch):
    """The check runs before sharding; its verdict is agreed by all processes (here one),
    exit status 1, and the group is left."""
    from geoopt_quotient.symmetry import SymmetryVerificationError

    def failing(*args, **kwargs):
        raise SymmetryVerificationError("logits changed by 1")

    monkeypatch.setattr("geoopt_quotient.symmetry.find_symmetries", failing)
    directory, text = llama
    argv = ["sharpness", "--model", str(directory), "--text", text, *ARGS, "--fsdp"]
    assert main(argv) == 1
    assert "symmetry check failed: logits changed by 1" in capsys.readouterr().err
    assert not dist.is_initialized()
