"""Causal language models end to end: ``geoopt-quotient sharpness --text`` on tiny Llama
and GPT-NeoX checkpoints saved with ``save_pretrained``, the refusal of checkpoints that
lack weights, ``--dtype``, and the next-token data of
:mod:`geoopt_quotient.experiments.causal_lm`."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from geoopt_quotient.cli import main  # noqa: E402
from geoopt_quotient.experiments.causal_lm import (  # noqa: E402
    is_causal_lm,
    load_causal_lm,
    load_text_batches,
    next_token_loss,
    sample_blocks,
    text_blocks,
)
from geoopt_quotient.experiments.classifiers import InputError  # noqa: E402

WORDS = "the a cat dog sat ran on in mat park good bad movie film was is very not".split()


def save_word_tokenizer(directory) -> None:
    """A whitespace word-level tokenizer over :data:`WORDS`, built offline."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *WORDS])}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>"
    )
    fast.save_pretrained(directory)
    reloaded = transformers.AutoTokenizer.from_pretrained(directory)
    assert reloaded(" ".join(WORDS))["input_ids"] == [vocab[w] for w in WORDS], "no word ids"


VOCAB = len(WORDS) + 2


def tiny_config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
    common.update(intermediate_size=24, max_position_embeddings=64, initializer_range=0.2)
    if family == "llama":
        return transformers.LlamaConfig(num_key_value_heads=1, tie_word_embeddings=False, **common)
    return transformers.GPTNeoXConfig(rotary_pct=0.5, **common)


def save_causal_lm(directory, family: str, dtype=torch.float32):
    config = tiny_config(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(directory)
    save_word_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(WORDS), (40, 12), generator=generator).tolist()
    path = tmp_path_factory.mktemp("text") / "valid.txt"
    path.write_text("\n".join(" ".join(WORDS[i] for i in line) for line in picks) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_causal_lm(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def gpt_neox(tmp_path_factory):
    return save_causal_lm(tmp_path_factory.mktemp("gpt-neox"), "gpt_neox")


def run_json(argv, capsys):
    capsys.readouterr()  # drop what saving the checkpoints printed
    assert main([*argv, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def error_of(argv, capsys) -> str:
    """stderr of a refused command: exit status 2, one line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("geoopt-quotient sharpness: error: ")
    assert err.count("\n") == 1 and "usage:" not in err
    return err


def sharpness_argv(model, text, *extra):
    argv = ["sharpness", "--model", str(model), "--text", text, "--metric", "both"]
    return [*argv, "--block-size", "16", "--batch-size", "3", "--max-examples", "6", *extra]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_causal_lm_sharpness_is_reproducible(family, llama, gpt_neox, text, capsys):
    checkpoint = {"llama": llama, "gpt_neox": gpt_neox}[family]
    argv = sharpness_argv(checkpoint, text, "--iters", "2")
    first, second = run_json(argv, capsys), run_json(argv, capsys)
    assert first["model"]["task"] == "causal-lm"
    assert (
        first["model"]["class"]
        == {"llama": "LlamaForCausalLM", "gpt_neox": "GPTNeoXForCausalLM"}[family]
    )
    assert first["data"] == {"blocks": 6, "block_size": 16, "batches": 2}
    assert set(first["results"]) == {"adaptive", "geodesic_mix", "geodesic_inv"}
    for name, result in first["results"].items():
        assert result["value"] > 0
        assert result["value"] == second["results"][name]["value"]
        assert result["per_batch"] == second["results"][name]["per_batch"]
    # the clean loss is the model's own next-token loss (transformers shifts the labels)
    model, tokenizer = load_causal_lm(str(checkpoint))
    batches = load_text_batches(
        text, model, tokenizer, block_size=16, batch_size=3, max_blocks=6, seed=0
    )
    with torch.no_grad():
        own = [float(model(input_ids=ids, labels=ids).loss) for _, ids in batches]
    assert first["results"]["adaptive"]["clean_losses"] == pytest.approx(own, rel=1e-6)
    # another draw of blocks gives other batches, hence other values
    other = run_json([*argv, "--data-seed", "1"], capsys)
    assert (
        other["results"]["adaptive"]["clean_losses"] != first["results"]["adaptive"]["clean_losses"]
    )


def test_causal_lm_prints_its_blocks(llama, text, capsys):
    assert main(sharpness_argv(llama, text, "--iters", "1", "--metric", "mix")) == 0
    printed = capsys.readouterr().out
    assert "LlamaForCausalLM from" in printed and "float32 parameters" in printed
    assert "6 blocks of 16 tokens in 2 batches" in printed and "geodesic_mix" in printed


def test_checkpoint_without_its_head_is_refused(llama, text, tmp_path, capsys):
    """A causal LM whose lm_head is not in the checkpoint: loading would initialise it at
    random (and the sharpness would differ on every run)."""
    from safetensors.torch import load_file, save_file

    headless = tmp_path / "headless"
    headless.mkdir()
    for name in os.listdir(llama):
        if name != "model.safetensors":
            (headless / name).write_bytes((llama / name).read_bytes())
    weights = load_file(llama / "model.safetensors")
    assert "lm_head.weight" in weights
    del weights["lm_head.weight"]
    save_file(weights, headless / "model.safetensors", metadata={"format": "pt"})
    err = error_of(sharpness_argv(headless, text), capsys)
    assert "no weights for lm_head.weight" in err and "random" in err


def test_causal_lm_given_labelled_data_is_refused(llama, tmp_path, capsys):
    """The issue's case: a causal LM measured as a sequence classifier got a random score
    head and exit status 0; now it is refused and told to use --text."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "the cat sat", "label": 0}) + "\n")
    err = error_of(["sharpness", "--model", str(llama), "--data", str(data)], capsys)
    assert "no weights for score.weight" in err and "LlamaForCausalLM" in err
    assert "sharpness --text FILE" in err


def test_classifier_given_text_is_refused(text, tmp_path, capsys):
    from conftest import save_tiny_bert_classifier

    bert = save_tiny_bert_classifier(tmp_path, layers=1)
    err = error_of(["sharpness", "--model", str(bert), "--text", text], capsys)
    assert "not a causal language model" in err and "BertForSequenceClassification" in err


def test_bfloat16_checkpoint_is_measured_in_float32(tmp_path, text, capsys):
    """--dtype float32 measures a bfloat16 checkpoint exactly as a float32 checkpoint of
    the same (bfloat16-rounded) weights, without the low-precision warning; without it,
    the warning names the flag."""
    half = save_causal_lm(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    model, _ = load_causal_lm(str(half), dtype="float32")
    assert model.dtype == torch.float32
    full = tmp_path / "f32"
    model.save_pretrained(full)
    save_word_tokenizer(full)
    argv = ["--iters", "2", "--metric", "mix"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        measured = run_json(sharpness_argv(half, text, *argv, "--dtype", "float32"), capsys)
    assert not [w for w in caught if "bfloat16" in str(w.message)]
    assert measured["model"]["dtype"] == "float32"
    reference = run_json(sharpness_argv(full, text, *argv), capsys)
    for name in ("adaptive", "geodesic_mix"):
        assert measured["results"][name]["value"] == reference["results"][name]["value"]
    with pytest.warns(UserWarning, match="--dtype float32"):
        as_saved = run_json(sharpness_argv(half, text, *argv, "--iters", "1"), capsys)
    assert as_saved["model"]["dtype"] == "bfloat16"


def test_bfloat16_checkpoint_with_a_bfloat16_state(tmp_path, text, capsys):
    """--state-dtype bfloat16 on a bfloat16 checkpoint measured as saved: recorded, and
    not the float32 state's values (the search rounds its state)."""
    half = save_causal_lm(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    argv = ["--iters", "3", "--metric", "mix"]
    with pytest.warns(UserWarning, match="--dtype float32"):
        default = run_json(sharpness_argv(half, text, *argv), capsys)
        halved = run_json(sharpness_argv(half, text, *argv, "--state-dtype", "bfloat16"), capsys)
    assert halved["arguments"]["state_dtype"] == "bfloat16"
    for name in ("adaptive", "geodesic_mix"):
        result, reference = halved["results"][name], default["results"][name]
        assert result["settings"]["state_dtype"] == "bfloat16"
        assert "state_dtype" not in reference["settings"]
        assert result["clean_losses"] == reference["clean_losses"]
    assert any(
        halved["results"][n]["value"] != default["results"][n]["value"]
        for n in ("adaptive", "geodesic_mix")
    )


def test_block_size_beyond_the_positions_is_refused(llama, text, capsys):
    err = error_of(sharpness_argv(llama, text, "--block-size", "65"), capsys)
    assert "longer than the model's 64 positions" in err


@pytest.mark.parametrize(
    ("mode", "option", "message"),
    [
        ("--data", ["--block-size", "8"], "--block-size is for --text, not --data"),
        ("--data", ["--data-seed", "1"], "--data-seed is for --text, not --data"),
        ("--text", ["--max-length", "8"], "--max-length is for --data, not --text"),
    ],
)
def test_options_of_the_other_data_mode_are_argument_errors(mode, option, message, capsys):
    """An option that the data mode would ignore is an error, not silently dropped."""
    with pytest.raises(SystemExit) as exit_info:
        main(["sharpness", "--model", "m", mode, "f", *option])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err
    with pytest.raises(SystemExit):
        main(["sharpness", "--model", "m", "--data", "f", "--text", "g"])
    assert "not allowed with argument" in capsys.readouterr().err


# ---------------------------------------------------------------- the library
@pytest.fixture(scope="module")
def tokenizer(llama):
    return transformers.AutoTokenizer.from_pretrained(llama)


def test_text_blocks_drop_the_remainder(tokenizer, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("the cat sat on the mat\nthe dog ran\n")  # 9 tokens
    blocks = text_blocks(str(path), tokenizer, 4)
    words = "the cat sat on the mat the dog ran".split()
    expected = [2 + WORDS.index(w) for w in words[:8]]  # <unk>, <eos>, then WORDS
    assert blocks.tolist() == [expected[:4], expected[4:]]
    with pytest.raises(InputError, match="9 tokens, fewer than one block of 10"):
        text_blocks(str(path), tokenizer, 10)
    path.write_bytes(b"the cat\n\xff\xfe\n")
    with pytest.raises(InputError, match="line 2: not UTF-8 text"):
        text_blocks(str(path), tokenizer, 2)


def test_sample_blocks_is_a_seeded_draw_without_replacement():
    blocks = torch.arange(40).view(10, 4)
    batches = sample_blocks(blocks, 3, max_blocks=7, seed=5)
    assert [ids.shape[0] for _, ids in batches] == [3, 3, 1]
    drawn = torch.cat([ids for _, ids in batches])
    assert all(inputs["input_ids"] is ids for inputs, ids in batches)
    assert len({int(row[0]) for row in drawn}) == 7  # distinct blocks, whole rows
    assert all(row.tolist() in blocks.tolist() for row in drawn)
    again = torch.cat([ids for _, ids in sample_blocks(blocks, 3, max_blocks=7, seed=5)])
    assert torch.equal(drawn, again)
    other = torch.cat([ids for _, ids in sample_blocks(blocks, 3, max_blocks=7, seed=6)])
    assert not torch.equal(drawn, other)


def test_next_token_loss_is_the_shifted_cross_entropy(llama):
    model, _ = load_causal_lm(str(llama), dtype="float64")
    assert is_causal_lm(model.config) and model.dtype == torch.float64
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = next_token_loss(model, ({"input_ids": ids}, ids))
        logits = model(input_ids=ids).logits
    manual = (
        -sum(torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]] for b in range(2) for t in range(4))
        / 8
    )
    assert loss.dtype == torch.float64
    assert float(loss) == pytest.approx(float(manual), rel=1e-12)
    shifted = ({"input_ids": ids}, ids.roll(1, dims=1))  # wrong targets give another loss
    with torch.no_grad():
        assert abs(float(next_token_loss(model, shifted)) - float(loss)) > 1e-3


# ---------------------------------------------------------------- population
def copy_checkpoint(source, target) -> None:
    target.mkdir(parents=True)
    for name in os.listdir(source):
        (target / name).write_bytes((source / name).read_bytes())


def test_population_of_causal_lms(tmp_path, text, capsys):
    """Next-token sharpness of every model, and gaps from next-token errors on --train and
    --test text. Labelled examples are refused for causal LMs (they used to get random
    classification heads)."""
    runs = tmp_path / "runs"
    for index in range(3):
        config = tiny_config("llama")
        torch.manual_seed(index)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(runs / f"m{index}")
        save_word_tokenizer(runs / f"m{index}")
    test = tmp_path / "test.txt"
    test.write_text("the dog ran in the park and the cat sat on a mat\n" * 4)
    argv = ["population", "--checkpoints", str(runs), "--train", text, "--test", str(test)]
    argv += ["--max-length", "16", "--max-examples", "4", "--batch-size", "2", "--iters", "1"]
    argv += ["--out", str(tmp_path / "out"), "--quiet", "--bootstrap", "10", "--no-verify"]
    capsys.readouterr()
    assert main(argv) == 0
    document = json.loads((tmp_path / "out" / "population.json").read_text())
    models = document["models"]
    assert [m["class"] for m in models] == ["LlamaForCausalLM"] * 3
    model, tokenizer = load_causal_lm(str(runs / "m1"))
    batches = load_text_batches(text, model, tokenizer, block_size=16, batch_size=2, max_blocks=4)
    with torch.no_grad():
        own = sum(float(model(input_ids=ids, labels=ids).loss) for _, ids in batches) / 2
    assert models[1]["measures"]["adaptive"]["clean_loss"] == pytest.approx(own, rel=1e-6)
    for record in models:
        assert 0 <= record["train_error"] <= 1 and 0 <= record["test_error"] <= 1
        assert record["gap"] == pytest.approx(record["test_error"] - record["train_error"])
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "the cat sat", "label": 0}) + "\n")
    gaps = tmp_path / "gaps.csv"
    gaps.write_text("checkpoint,gap\n" + "".join(f"m{i},0.{i}\n" for i in range(3)))
    argv = ["population", "--checkpoints", str(runs), "--data", str(data), "--gaps", str(gaps)]
    argv += ["--out", str(tmp_path / "out2"), "--quiet", "--dtype", "float32"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("geoopt-quotient population: error: ") and err.count("\n") == 1
    assert "a causal LM is measured on plain text" in err and "'m0'" in err


def test_population_dtype_is_a_setting_that_keeps_old_fingerprints(tmp_path):
    from dataclasses import asdict

    from geoopt_quotient.experiments.population.study import (
        StudySettings,
        file_digest,
        study_fingerprint,
    )
    from geoopt_quotient.experiments.records import fingerprint

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "the cat", "label": 0}) + "\n")
    before = asdict(StudySettings())
    del before["dtype"]  # a study of the previous version, without the option
    old = fingerprint({"settings": before, "files": {"data": file_digest(str(data))}})
    assert study_fingerprint(StudySettings(), str(data), None, None) == old
    assert study_fingerprint(StudySettings(dtype="float32"), str(data), None, None) != old
    with pytest.raises(ValueError, match="dtype"):
        StudySettings(dtype="float8")


def test_population_dtype_is_for_hugging_face_checkpoints(tmp_path, capsys):
    argv = ["population", "--checkpoints", str(tmp_path), "--format", "model-soups"]
    argv += ["--train-images", str(tmp_path), "--gaps", "g.csv", "--dtype", "float64"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "--dtype is for --format hf" in capsys.readouterr().err


def test_help_explains_the_causal_lm_options(capsys):
    with pytest.raises(SystemExit):
        main(["sharpness", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in (
        "--text FILE (causal language models",
        "next-token cross-entropy",
        "the remainder is dropped",
        "drawn at random with --data-seed",
        "--dtype float32",
        "rounded to 2^-8 (bfloat16)",
        "is refused, never completed with random weights",
        "--model ./my-llama --text valid.txt --dtype float32",
    ):
        assert needle in text, needle
