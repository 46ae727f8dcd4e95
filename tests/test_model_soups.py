"""model-soups CLIP checkpoints: the OpenAI key layout on Hugging Face CLIP, image folders,
and ``population --format model-soups`` end to end (tau table, JSON, figure, resume after a
kill), on small checkpoints written here in the release's format; the full ViT-B/32 key
set and shapes load and show their 12 + 12 attention groups of 12 heads; a pickle that
carries code is refused."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import OrderedDict

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from geoopt_quotient.cli import main
from geoopt_quotient.experiments.classifiers import InputError
from geoopt_quotient.experiments.images import read_image_folder, sample_indices
from geoopt_quotient.experiments.model_soups import (
    CLIPVisionArchitecture,
    ModelSoupsClassifier,
    infer_architecture,
    load_model_soups_checkpoint,
    model_soups_key_shapes,
)
from geoopt_quotient.symmetry import find_symmetries

SMALL = dict(width=128, layers=2, patch=8, image=32, embed=64, classes=3)
VIT_B32 = dict(width=768, layers=12, patch=32, image=224, embed=512, classes=1000)
RUN = ["--iters", "2", "--batch-size", "8", "--bootstrap", "100", "--protocol", "imagenet"]


def model_soups_state(
    *, width, layers, patch, image, embed, classes, seed=0, text=(64, 100), fill="random"
):
    """A state dict as model-soups saves it: OpenAI CLIP ViT keys under ``model.``, the
    text-side tensors left after the text transformer is deleted, ``classification_head``.

    ``fill="random"``: weights of a trained-like scale; ``"cheap"``: small random values,
    and uninitialised memory for the text-side tensors, which are never read.
    """
    generator = torch.Generator().manual_seed(seed)
    arch = CLIPVisionArchitecture(
        width, layers, width // 64, patch, image, embed, 4 * width, classes
    )
    state = OrderedDict()
    text_width, vocab = text
    for key, shape in {
        "model.positional_embedding": (77, text_width),
        "model.text_projection": (text_width, embed),
        "model.logit_scale": (),
        "model.token_embedding.weight": (vocab, text_width),
        "model.ln_final.weight": (text_width,),
        "model.ln_final.bias": (text_width,),
    }.items():
        state[key] = (
            torch.empty(shape) if fill == "cheap" else torch.randn(shape, generator=generator)
        )
    for key, shape in model_soups_key_shapes(arch).items():
        fan_in = shape[-1] if len(shape) == 2 else int(np.prod(shape[1:])) if len(shape) > 2 else 1
        values = torch.randn(shape, generator=generator) / fan_in**0.5
        if key.endswith(("ln_pre.weight", "ln_post.weight", "ln_1.weight", "ln_2.weight")):
            values = 1 + 0.1 * values
        state[key] = values
    return state


def reference_logits(state, pixels, heads):
    """model-soups' forward written directly on the OpenAI layout (``x @ proj``, fused
    ``in_proj``, QuickGELU): the conversion to Hugging Face must reproduce it."""
    f = torch.nn.functional
    v = {k[len("model.visual.") :]: t for k, t in state.items() if k.startswith("model.visual.")}
    x = f.conv2d(pixels, v["conv1.weight"], stride=v["conv1.weight"].shape[-1])
    x = x.flatten(2).transpose(1, 2)
    cls = v["class_embedding"].expand(x.shape[0], 1, -1)
    x = torch.cat([cls, x], dim=1) + v["positional_embedding"]
    width = x.shape[-1]

    def norm(t, name):
        return f.layer_norm(t, (width,), v[f"{name}.weight"], v[f"{name}.bias"], 1e-5)

    x = norm(x, "ln_pre")
    layers = len([k for k in v if k.endswith("attn.in_proj_weight")])
    for i in range(layers):
        b = f"transformer.resblocks.{i}."
        h = norm(x, f"{b}ln_1").transpose(0, 1)
        attended, _ = f.multi_head_attention_forward(
            h, h, h, width, heads, v[f"{b}attn.in_proj_weight"], v[f"{b}attn.in_proj_bias"],
            None, None, False, 0.0, v[f"{b}attn.out_proj.weight"], v[f"{b}attn.out_proj.bias"],
            training=False, need_weights=False,
        )  # fmt: skip
        x = x + attended.transpose(0, 1)
        h = f.linear(norm(x, f"{b}ln_2"), v[f"{b}mlp.c_fc.weight"], v[f"{b}mlp.c_fc.bias"])
        h = h * torch.sigmoid(1.702 * h)
        x = x + f.linear(h, v[f"{b}mlp.c_proj.weight"], v[f"{b}mlp.c_proj.bias"])
    features = norm(x[:, 0], "ln_post") @ v["proj"]
    features = features / features.norm(dim=-1, keepdim=True)
    return f.linear(
        features, state["classification_head.weight"], state["classification_head.bias"]
    )


def write_image_folder(root, *, classes, per_class, seed):
    """PNGs of several sizes (CLIP's resize and crop at work), a colour cast per class."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for label in range(classes):
        directory = root / f"n{label:08d}"
        directory.mkdir(parents=True)
        for index in range(per_class):
            height, width = rng.integers(30, 48, size=2)
            pixels = rng.integers(0, 256, size=(height, width, 3)).astype(np.float64)
            pixels[..., label % 3] = 0.5 * pixels[..., label % 3] + 127
            Image.fromarray(pixels.astype(np.uint8)).save(directory / f"{index:03d}.png")
    return root


@pytest.fixture(scope="module")
def population(tmp_path_factory):
    """Three small checkpoints (seeds 0, 1, 2) and train/test image folders."""
    root = tmp_path_factory.mktemp("soups")
    checkpoints = root / "checkpoints"
    checkpoints.mkdir()
    for seed in range(3):
        torch.save(model_soups_state(**SMALL, seed=seed), checkpoints / f"soup_{seed}.pt")
    train = write_image_folder(root / "train", classes=3, per_class=6, seed=0)
    test = write_image_folder(root / "test", classes=3, per_class=4, seed=1)
    return checkpoints, train, test


def test_architecture_is_read_off_the_shapes_and_the_forward_is_the_wrappers():
    state = model_soups_state(**SMALL, seed=3)
    arch = infer_architecture(state)
    assert arch == CLIPVisionArchitecture(128, 2, 2, 8, 32, 64, 512, 3)
    model = ModelSoupsClassifier(arch)
    model.load_openai_state_dict(state)
    model = model.double().eval()
    pixels = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    pixels = pixels.double()
    with torch.no_grad():
        got = model(pixel_values=pixels).logits
        want = reference_logits({k: v.double() for k, v in state.items()}, pixels, heads=2)
    scale = want.abs().max().item()
    eps = torch.finfo(torch.float64).eps
    torch.testing.assert_close(got, want, rtol=0, atol=1e3 * eps * scale)


def test_wrong_state_dicts_are_named(tmp_path):
    state = model_soups_state(**SMALL)
    del state["model.visual.transformer.resblocks.1.mlp.c_fc.bias"]
    with pytest.raises(InputError, match=r"no tensor .*resblocks\.1\.mlp\.c_fc\.bias"):
        infer_architecture(state)
    state = model_soups_state(**SMALL)
    state["model.transformer.resblocks.0.attn.in_proj_weight"] = torch.zeros(3, 3)
    with pytest.raises(InputError, match="unexpected tensors"):
        infer_architecture(state)
    with pytest.raises(InputError, match=r"no 'model\.visual\.' keys"):
        infer_architecture({"weight": torch.zeros(2)})


def test_full_vit_b32_key_set_loads_with_12_qk_and_12_vo_groups_of_12_heads():
    """The shapes of OpenAI's ViT-B/32 (text side included) with the model-soups head:
    random weights, nothing downloaded. Discovery finds one Q/K and one V/O pair of 12
    heads per block (checked on the model's outputs for the small models below: a
    ViT-B/32 verification takes 10 s on a CPU)."""
    state = model_soups_state(**VIT_B32, text=(512, 49408), fill="cheap")
    arch = infer_architecture(state)
    assert arch == CLIPVisionArchitecture(768, 12, 12, 32, 224, 512, 3072, 1000)
    model = ModelSoupsClassifier(arch, initialize=False)
    model.load_openai_state_dict(state)
    assert torch.equal(model.clip.visual_projection.weight, state["model.visual.proj"].t())
    del state
    plan = find_symmetries(model, metric="mix", verify=False)  # proven on the small models
    groups = plan.groups
    assert [g.kind for g in groups] == ["query-key", "value-output"]
    for group in groups:
        assert group.count == 12 * 12
        assert tuple(group.index.shape[:2]) == (12, 12)  # blocks, heads
        assert group.index.shape[-1] == 64  # head width h: GL(64) per head
    assert not [n for n in plan.notes if not n.startswith(("verified", "pairs not replayed"))]


class Payload:
    """Unpickling this runs ``os.system``: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_carries_code_is_refused(population, tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    evil = tmp_path / "evil"
    evil.mkdir()
    for seed in range(2):
        torch.save(model_soups_state(**SMALL, seed=seed), evil / f"soup_{seed}.pt")
    state = model_soups_state(**SMALL, seed=2)
    state["extra"] = Payload(marker)
    with open(evil / "soup_2.pt", "wb") as handle:
        pickle.dump(state, handle, protocol=2)
    with pytest.raises(InputError, match="refused to load"):
        load_model_soups_checkpoint(str(evil / "soup_2.pt"))
    _, train, test = population
    argv = ["population", "--checkpoints", str(evil), "--format", "model-soups"]
    argv += ["--train-images", str(train), "--test-images", str(test), *RUN]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path / "out"), "--quiet"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("geoopt-quotient population: error: checkpoint ")
    assert "refused to load" in err and err.count("\n") == 1
    assert not marker.exists()


def test_image_folders_give_sorted_class_labels(population):
    _, train, _ = population
    folder = read_image_folder(str(train))
    assert folder.classes == ("n00000000", "n00000001", "n00000002")
    assert folder.labels == (0,) * 6 + (1,) * 6 + (2,) * 6
    drawn = sample_indices(len(folder), 9)
    assert len(set(drawn.tolist())) == 9 and len({folder.labels[i] for i in drawn}) > 1


def run_population(population, out, *extra):
    checkpoints, train, test = population
    argv = ["population", "--checkpoints", str(checkpoints), "--format", "model-soups"]
    argv += ["--train-images", str(train), "--test-images", str(test), *RUN, "--out", str(out)]
    assert main([*argv, *extra]) == 0
    return json.loads((out / "population.json").read_text())


def comparable(document):
    """Per model: everything but wall-clock times."""
    models = []
    for model in document["models"]:
        model = {k: v for k, v in model.items() if k != "seconds"}
        model["measures"] = {
            name: {k: v for k, v in m.items() if k != "seconds"}
            for name, m in model["measures"].items()
        }
        models.append(model)
    return models, document["tau"]


@pytest.fixture(scope="module")
def reference(population, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    return out, run_population(population, out)


def test_population_end_to_end(reference, population, capsys):
    out, document = reference
    assert document["format"] == "model-soups" and document["gap_source"] == "measured"
    settings = document["settings"]  # --protocol imagenet, --iters/--batch-size override it
    assert (settings["max_examples"], settings["batch_size"], settings["iters"]) == (2048, 8, 2)
    assert [m["checkpoint"] for m in document["models"]] == [f"soup_{s}.pt" for s in range(3)]
    for model in document["models"]:
        assert model["class"] == "ModelSoupsClassifier"
        assert model["gap"] == pytest.approx(model["test_error"] - model["train_error"])
        groups = model["plan"]["symmetric_groups"]
        assert list(groups.values()) == [4, 4]  # Q/K and V/O: 2 blocks x 2 heads each
        for measure in ("adaptive", "geodesic_inv", "geodesic_mix"):
            value = model["measures"][measure]["value"]
            assert np.isfinite(value) and value >= 0
            assert len(model["measures"][measure]["per_batch"]) == 3  # 18 images, batches of 8
    assert set(document["tau"]) == {"adaptive", "geodesic_inv", "geodesic_mix"}
    assert (out / "population.png").stat().st_size > 0
    # the tau table, printed without --quiet; --resume reuses every model's record
    again = run_population(population, out, "--resume")
    assert comparable(again) == comparable(document)
    printed = capsys.readouterr().out
    assert "Kendall tau between sharpness and generalization gap, 3 models:" in printed
    assert "geodesic_mix" in printed and "paper: ImageNet" in printed


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_result(reference, population, tmp_path):
    _, expected = reference
    checkpoints, train, test = population
    out = tmp_path / "killed"
    records = out / "population-records.jsonl"
    command = [sys.executable, "-m", "geoopt_quotient", "population"]
    command += ["--checkpoints", str(checkpoints), "--format", "model-soups"]
    command += ["--train-images", str(train), "--test-images", str(test), *RUN]
    command += ["--out", str(out), "--quiet"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if records.exists() and records.read_text().count("\n") >= 1:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    finished = records.read_text().count("\n")
    assert 1 <= finished < 3 and not (out / "population.json").exists()

    resumed = run_population(population, out, "--resume", "--quiet")
    assert records.read_text().count("\n") == 3  # the finished models were not measured again
    assert comparable(resumed) == comparable(expected)


def test_image_inputs_are_checked(population, tmp_path, capsys):
    checkpoints, train, test = population
    base = ["population", "--checkpoints", str(checkpoints), "--out", str(tmp_path / "o")]
    soups = [*base, "--format", "model-soups"]
    usage_errors = [
        (soups, "needs --train-images"),
        ([*soups, "--train-images", str(train)], "the gaps are needed"),
        ([*soups, "--train-images", str(train), "--data", "x.jsonl"], "--data is for --format hf"),
        ([*base, "--train-images", str(train), "--gaps", "g.csv"], "need --format model-soups"),
    ]
    for argv, message in usage_errors:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: geoopt-quotient population") and message in err
    four = write_image_folder(tmp_path / "four", classes=4, per_class=1, seed=2)
    empty = tmp_path / "empty"
    empty.mkdir()
    data_errors = [
        ([*soups, "--train-images", str(empty), "--test-images", str(test)], "no class sub-dir"),
        ([*soups, "--train-images", str(four), "--test-images", str(test)], "4 class directories"),
    ]
    for argv, message in data_errors:
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, *RUN, "--quiet"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("geoopt-quotient population: error: ") and message in err
