"""Low precision, autocast, and the CUDA paths (run when a GPU is present, skipped otherwise).

The tests without the ``cuda`` mark run on the device of ``--torch-device`` (CPU by default).
"""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
from conftest import TINY_BERT_WORDS, TinyTransformer, assert_close, save_tiny_bert_classifier

import geoopt_quotient as gq
from geoopt_quotient.manifolds.gl_quotient import PointState
from geoopt_quotient.testing import assert_invariant, count_host_syncs, host_syncs_per_iteration

pytestmark = pytest.mark.on_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def float_loss(model, batch):
    tokens, labels = batch
    return torch.nn.functional.cross_entropy(model(tokens).float(), labels)


def token_batch():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 11, (8, 6), generator=g), torch.randint(0, 2, (8,), generator=g))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_gets_its_geometry_in_float32_or_better(dtype):
    torch.manual_seed(0)
    model = TinyTransformer().to(dtype)
    with pytest.warns(UserWarning, match=str(dtype)):
        geo = gq.geodesic_sharpness(
            model, float_loss, token_batch(), rho=0.05, iters=3, metric="inv"
        )
        ada = gq.adaptive_sharpness(model, float_loss, token_batch(), rho=0.05, iters=3)
    assert math.isfinite(geo.value) and math.isfinite(ada.value) and geo.value > 0
    x = gq.GLQuotient(5, 4).random(3, 9, 2).to(dtype)
    state = PointState(gq.GLQuotient(5, 4), x)
    assert state.dtype == torch.float32 and state.grams_exact[0].dtype == torch.float64
    assert all(p.dtype == dtype for p in model.parameters())


@cuda
@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_manifold_operations_on_cuda_match_cpu(metric):
    torch.manual_seed(0)
    manifold = gq.GLQuotient(7, 5, metric)
    x = manifold.random(4, 12, 3, dtype=torch.float64, device="cpu")
    u = torch.randn_like(x)
    for name in ("proju", "egrad2rgrad", "retr", "expmap"):
        on_cpu = getattr(manifold, name)(x, u * 0.1)
        on_gpu = getattr(manifold, name)(x.cuda(), (u * 0.1).cuda())
        assert on_gpu.device.type == "cuda"
        torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-9, atol=1e-11)


# ------------------------------------------------------------ mixed precision
LOW_PRECISION_EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def check_low_precision(name, dtype, low, reference) -> None:
    """Within 16 units of the low precision, relative, where the sharpness is at least 2% of
    the clean loss (user guide, "Precision": below that, low precision loses it). Measured:
    up to 7 units on an H100, 4.4 on a CPU."""
    assert reference.value >= 0.02 * reference.clean_losses[0], "not the regime tested"
    error = abs(low.value - reference.value) / reference.value
    print(
        f"{name} {dtype}: relative error {error:.2e} ({error / LOW_PRECISION_EPS[dtype]:.2f} eps)"
    )
    assert error <= 16 * LOW_PRECISION_EPS[dtype], f"{name}: {low.value} vs {reference.value}"


def sharpness_runs(model, batches, **options):
    """Adaptive and geodesic (inv, mix) sharpness at radii where each is a sizeable
    fraction of the loss, so that low precision can resolve it."""
    return {
        "adaptive": lambda: gq.adaptive_sharpness(
            model, float_loss, batches, rho=0.2, iters=8, **options
        ),
        "inv": lambda: gq.geodesic_sharpness(
            model, float_loss, batches, rho=1.0, iters=8, metric="inv", **options
        ),
        "mix": lambda: gq.geodesic_sharpness(
            model, float_loss, batches, rho=0.2, iters=8, metric="mix", **options
        ),
    }


def wide_batch(device):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 11, (32, 6), generator=g)
    return [(tokens.to(device), torch.randint(0, 2, (32,), generator=g).to(device))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sharpness_under_autocast_agrees_with_float32(device, dtype):
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    batches = wide_batch(device)
    for name, run in sharpness_runs(model, batches).items():
        reference = run()
        with torch.autocast(device.type, dtype=dtype):
            check_low_precision(name, dtype, run(), reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sharpness_of_a_low_precision_model_agrees_with_float32(device, dtype):
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    batches = wide_batch(device)
    reference = {name: run() for name, run in sharpness_runs(model, batches).items()}
    model = model.to(dtype)
    for name, run in sharpness_runs(model, batches).items():
        with pytest.warns(UserWarning, match="rounded to that resolution"):
            low = run()
        check_low_precision(name, dtype, low, reference[name])
    assert all(p.dtype == dtype for p in model.parameters())


def test_a_bfloat16_state_of_a_bfloat16_model_agrees_with_float32(device):
    """Iterates and gradients stored in bfloat16 (state_dtype): within the same bound as
    the float32 state of the same model (measured on a CPU: 0.7%, 1.8% and 2.1% for
    adaptive, inv and mix, 1.7, 4.5 and 5.3 units of 2^-8)."""
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    batches = wide_batch(device)
    reference = {name: run() for name, run in sharpness_runs(model, batches).items()}
    model = model.to(torch.bfloat16)
    for name, run in sharpness_runs(model, batches, state_dtype=torch.bfloat16).items():
        with pytest.warns(UserWarning, match="rounded to that resolution"):
            low = run()
        assert low.settings["state_dtype"] == "bfloat16"
        check_low_precision(name, torch.bfloat16, low, reference[name])


def test_under_autocast_the_loss_runs_in_low_precision_and_the_geometry_in_full(device):
    """The objective sees the caller's autocast; the paths, the ball and the iterates
    do not: the perturbation stays horizontal and in the ball to float32 accuracy."""
    torch.manual_seed(0)
    gl = gq.GLQuotient(6, 5, "inv")
    x = gl.random(3, 11, 3, dtype=torch.float32).to(device)
    w = torch.randn(7, 4, device=device)
    probe = torch.randn(6, 5, device=device)
    seen = {"objective": [], "path": []}

    def path(point, u):
        seen["path"].append(torch.is_autocast_enabled(device.type))
        return gl.retr(point, u)

    def objective(points):
        seen["objective"].append(torch.is_autocast_enabled(device.type))
        product = gl.product(points[1]).sum(0)  # (6, 5), in bfloat16 under autocast
        return (points[0].pow(3).sum() + (product @ probe.mT).trace()).float().sin()

    groups = [gq.BallGroup(w, gq.AdaptiveEuclidean()), gq.BallGroup(x, gl, path)]
    with torch.autocast(device.type, dtype=torch.bfloat16):
        result = gq.maximize_in_ball(groups, objective, rho=0.3, iters=6)
    assert all(seen["objective"]) and not any(seen["path"])
    assert [v.dtype for v in result.xi] == [torch.float32, torch.float32]
    left, right = gl._horizontality_terms(x, result.xi[1])
    assert_close(left, right, rtol=1e-5, what="horizontality")
    squared = gq.AdaptiveEuclidean().inner(w, result.xi[0]).sum() + gl.inner(x, result.xi[1]).sum()
    assert float(squared.sqrt()) <= 0.3 * (1 + 1e-5)


def test_under_autocast_every_evaluation_casts_the_current_perturbed_weights(device):
    """The perturbed parameters are leaves whose values change between evaluations inside
    the caller's autocast region, whose cache would keep a leaf's first cast until the
    region ends: the loss runs with the cache off, and the sharpness under autocast is
    that of fresh casts (the same as with autocast entered anew for every evaluation)."""
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    batches = wide_batch(device)
    cached = []

    def loss(m, batch):
        cached.append(torch.is_autocast_cache_enabled())
        return float_loss(m, batch)

    with torch.autocast(device.type, dtype=torch.bfloat16):
        outer = gq.geodesic_sharpness(model, loss, batches, rho=0.2, iters=5, metric="mix")
    assert cached and not any(cached)

    def fresh_casts(m, batch):  # its own region per evaluation: an empty cache each time
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return float_loss(m, batch)

    fresh = gq.geodesic_sharpness(model, fresh_casts, batches, rho=0.2, iters=5, metric="mix")
    assert outer.value == fresh.value and outer.histories == fresh.histories


def test_hessian_under_autocast_keeps_the_geometry_in_full_precision(device):
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    batches = wide_batch(device)
    reference = gq.hessian_trace(model, float_loss, batches, probes=4)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        low = gq.hessian_trace(model, float_loss, batches, probes=4)
    assert math.isfinite(low.value)
    assert low.value == pytest.approx(reference.value, rel=0.1)


# ------------------------------------------------------------ CUDA: host synchronisation
def measures_at(model, batches, path="second_order"):
    return {
        "adaptive": lambda n: gq.adaptive_sharpness(model, float_loss, batches, rho=0.05, iters=n),
        "inv": lambda n: gq.geodesic_sharpness(
            model, float_loss, batches, rho=0.05, iters=n, metric="inv", path=path
        ),
        "mix": lambda n: gq.geodesic_sharpness(
            model, float_loss, batches, rho=0.05, iters=n, metric="mix", path=path
        ),
    }


@cuda
def test_at_most_one_host_synchronisation_per_auto_pgd_iteration():
    torch.manual_seed(0)
    model = TinyTransformer().cuda()
    batches = wide_batch(torch.device("cuda"))

    def plain_pass(n):
        for _ in range(n):
            float_loss(model, batches[0]).backward()

    own = host_syncs_per_iteration(plain_pass)  # the model's own, per forward+backward
    counts = {
        name: host_syncs_per_iteration(run) for name, run in measures_at(model, batches).items()
    }
    assert all(count - own <= 1 for count in counts.values()), (own, counts)


@cuda
def test_count_host_syncs_counts_reads_and_passes_other_warnings_on():
    x = torch.randn(10, device="cuda")
    with pytest.warns(UserWarning, match="mine"):
        with count_host_syncs() as syncs:
            float(x.sum())
            x.tolist()
            y = x * 2  # no synchronisation
            warnings.warn("mine", stacklevel=1)
    assert syncs.value == 2 and y.device.type == "cuda"


# ------------------------------------------------------------ CUDA: results match the CPU
def loss64(model, batch):
    tokens, labels = batch
    return torch.nn.functional.cross_entropy(model(tokens), labels)


def float64_pair():
    """A float64 TinyTransformer and its batch on the CPU, and copies on the GPU."""
    torch.manual_seed(0)
    model = TinyTransformer(dim=12).to("cpu", torch.float64)
    batches = [(t.cpu(), y.cpu()) for t, y in token_batch()]
    on_gpu = copy.deepcopy(model).cuda()
    return (model, batches), (on_gpu, [(t.cuda(), y.cuda()) for t, y in batches])


@cuda
@pytest.mark.parametrize(
    "kwargs",
    [dict(metric="inv"), dict(metric="mix", path="exact"), dict(measure="adaptive")],
    ids=["inv", "mix-exact", "adaptive"],
)
def test_sharpness_on_cuda_matches_cpu_in_float64(kwargs):
    kwargs = dict(kwargs)
    measure = gq.adaptive_sharpness if kwargs.pop("measure", "") else gq.geodesic_sharpness
    (model, batches), (on_gpu, gpu_batches) = float64_pair()
    on_cpu = measure(model, loss64, batches, rho=0.05, iters=5, **kwargs)
    result = measure(on_gpu, loss64, gpu_batches, rho=0.05, iters=5, **kwargs)
    assert result.value == pytest.approx(on_cpu.value, rel=1e-9)
    assert result.histories[0] == pytest.approx(on_cpu.histories[0], rel=1e-9)


@cuda
def test_average_case_on_cuda_is_repeatable():
    """Its samples come from a generator on the model's device: other numbers than on the
    CPU, the same ones for the same seed."""
    _, (model, batches) = float64_pair()
    runs = [
        gq.geodesic_sharpness(model, loss64, batches, rho=0.05, iters=4, kind="average")
        for _ in range(2)
    ]
    assert runs[0].histories == runs[1].histories and math.isfinite(runs[0].value)


@cuda
@pytest.mark.parametrize("riemannian", [True, False])
def test_hessian_trace_on_cuda_matches_cpu_with_the_same_probes(riemannian):
    (model, batches), (on_gpu, gpu_batches) = float64_pair()
    plan = gq.find_symmetries(model).bind(model)
    if riemannian:
        shapes = [g.shape for g in plan.groups]
    else:
        shapes = [p.shape for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(5)
    probes = [
        [torch.randn(s, generator=g, dtype=torch.float64, device="cpu") for s in shapes]
        for _ in range(3)
    ]
    kwargs = dict(symmetries=plan, riemannian=riemannian, probes=3)
    on_cpu = gq.hessian_trace(
        model, loss64, batches, probe_vectors=lambda b, p: probes[p], **kwargs
    )
    result = gq.hessian_trace(
        on_gpu,
        loss64,
        gpu_batches,
        probe_vectors=lambda b, p: [v.cuda() for v in probes[p]],
        **kwargs,
    )
    assert result.value == pytest.approx(on_cpu.value, rel=1e-9)
    seeded = gq.hessian_trace(on_gpu, loss64, gpu_batches, probes=3, riemannian=riemannian)
    assert math.isfinite(seeded.value)  # probes drawn by a generator on the model's device


@cuda
def test_assert_invariant_acts_on_a_cuda_model():
    torch.manual_seed(0)
    model = TinyTransformer().double().cuda().eval()
    tokens = token_batch()[0][0].cuda()
    moved = assert_invariant(lambda m: m(tokens), model, condition=100.0, rtol=1e-9, atol=1e-10)
    assert all(p.device.type == "cuda" for p in moved.parameters())


# ------------------------------------------------------------ CUDA: the command line
@cuda
def test_sharpness_command_on_cuda_matches_cpu(tmp_path):
    from geoopt_quotient.cli import main

    (tmp_path / "bert").mkdir()
    checkpoint = save_tiny_bert_classifier(tmp_path / "bert", layers=2, initializer_range=0.3)
    data = tmp_path / "data.jsonl"
    words = TINY_BERT_WORDS
    rows = [{"text": " ".join(words[i : i + 4]), "label": i % 2} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    values = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.json"
        argv = ["sharpness", "--model", str(checkpoint), "--data", str(data), "--metric", "both"]
        argv += ["--iters", "3", "--batch-size", "4", "--device", device, "--json", str(out)]
        assert main(argv) == 0
        results = json.loads(out.read_text())["results"]
        values[device] = {name: r["value"] for name, r in results.items()}
    assert set(values["cuda"]) == {"adaptive", "geodesic_inv", "geodesic_mix"}
    for name, value in values["cpu"].items():
        assert values["cuda"][name] == pytest.approx(value, rel=1e-3, abs=1e-6)


@cuda
def test_population_command_on_cuda_matches_cpu(tmp_path):
    from geoopt_quotient.cli import main

    root = tmp_path / "checkpoints"
    for i in range(3):
        (root / f"bert-{i}").mkdir(parents=True)
        save_tiny_bert_classifier(root / f"bert-{i}", layers=1, initializer_range=0.1 + 0.1 * i)
    rows = [" ".join(TINY_BERT_WORDS[j : j + 3]) for j in range(12)]
    for name, chunk in (("train", rows[:6]), ("test", rows[6:])):
        lines = [json.dumps({"text": t, "label": k % 2}) + "\n" for k, t in enumerate(chunk)]
        (tmp_path / f"{name}.jsonl").write_text("".join(lines))
    documents = {}
    for device in ("cpu", "cuda"):
        argv = ["population", "--checkpoints", str(root), "--iters", "2", "--quiet"]
        argv += ["--train", str(tmp_path / "train.jsonl"), "--test", str(tmp_path / "test.jsonl")]
        argv += ["--bootstrap", "50", "--device", device, "--out", str(tmp_path / device)]
        assert main(argv) == 0
        documents[device] = json.loads((tmp_path / device / "population.json").read_text())
    for cpu, gpu in zip(documents["cpu"]["models"], documents["cuda"]["models"]):
        assert gpu["gap"] == pytest.approx(cpu["gap"], abs=1e-9)
        for name, measured in cpu["measures"].items():
            assert gpu["measures"][name]["value"] == pytest.approx(
                measured["value"], rel=1e-3, abs=1e-6
            )
