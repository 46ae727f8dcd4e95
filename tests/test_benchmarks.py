"""The benchmark scripts run (reduced sizes; this checks that they work, not timings)."""

from __future__ import annotations

import importlib
import json
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(autouse=True)
def benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))


def keys_named(report, key: str) -> list:
    """Every value stored under ``key`` anywhere in a nested report."""
    if isinstance(report, dict):
        found = [report[key]] if key in report else []
        return found + [v for item in report.values() for v in keys_named(item, key)]
    if isinstance(report, list):
        return [v for item in report for v in keys_named(item, key)]
    return []


QUICK = [
    "bench_ball_memory",
    "bench_sharpness_iteration",
    "bench_iteration_overhead",
    "bench_geometry",
    "bench_memory",
    "bench_cuda",
    "bench_sam",
    "profile_cpu_iteration",
    "bench_small_kernels",
    "bench_compiled_update",
    "bench_discovery",
    "bench_geodesic",
    "bench_path_gap_cost",
    "bench_gl_iteration",
    "bench_iteration_flops",
    "sweep_zoo",
    "bench_verification",
    "bench_block_sizes",
]


@pytest.mark.parametrize("name", [*QUICK, "bench_precision"])
def test_benchmark_runs_in_quick_mode(name, tmp_path):
    module = importlib.import_module(name)
    out = tmp_path / f"{name}.json"
    argv = ["--quick", "--json", str(out)]
    if name == "bench_sharpness_iteration":
        argv += ["--iters", "1", "--repeats", "1"]
    if name == "bench_precision":
        argv += ["--device", "cpu"]
    if name == "bench_iteration_flops":  # the counter's per-operator work: one model
        argv += ["--models", "bert-11m"]
    if name == "bench_gl_iteration":  # this checkout beside itself
        argv += ["--repeats", "2", "--baseline", str(pathlib.Path(__file__).resolve().parents[1])]
    report = module.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    if name == "bench_sharpness_iteration":
        assert set(report["ratio_to_adaptive"]) == {"adaptive", "geodesic-inv", "geodesic-mix"}
    if name == "bench_geometry":
        assert report["projection"]["max_abs_difference"] < 1e-8
    if name == "bench_ball_memory":
        for row in report["measures"].values():
            # kept: two gradients of their own; not kept: one, over the perturbed points
            # (the symmetry groups' own tensors, a part of a vector)
            kept, lent = row["kept"], row["not_kept"]
            assert kept["gradients"] == pytest.approx(8, rel=0.05) and lent["gradients"] < 2
            assert kept["total"] - kept["gradients"] == pytest.approx(
                lent["total"] - lent["gradients"]
            )
    if name == "bench_memory":
        assert report["peak_ratio_to_training_step"]["train"] == 1.0
    if name == "bench_small_kernels":
        rows = report["models"]
        assert [r["add_product_takes"] for r in rows["products"]] == ["bmm_then_add"] * 2
        assert rows["write_back"]["tiny-vit"]["scatter_takes"] == "index_map"
        assert all(len(r) == 4 for r in rows["geometry"].values())
    if name == "bench_compiled_update":  # compiled where a C++ compiler is found
        row = report["models"]["tiny-vit"]
        assert {"eager gram", "eager combination + perturbed point"} <= set(row["seconds"])
        if "compiled" in row:
            assert row["compiled"].startswith("unavailable")
        else:
            assert row["gram_max_rel_difference"] < 1e-5
            assert row["combination_max_rel_difference"] < 1e-5
    if name == "bench_iteration_flops":  # the quotient groups' geometry makes products
        for row in report["models"].values():
            small = 1e-4 * row["plain_gflop"]  # adaptive: Auto-PGD's 3 x 3 algebra at most
            assert abs(row["adaptive"]["geometry_gflop"]) < small
            assert row["inv"]["geometry_gflop"] > small and row["mix"]["geometry_gflop"] > small
            floors = list(row["inv"]["floor_at_batch"].values())
            assert floors == sorted(floors, reverse=True) and floors[-1] > 1
    if name == "profile_cpu_iteration":
        row = report["models"]["tiny-vit"]
        assert {"plain", "adaptive", "inv", "mix"} <= set(row)
        assert all(row[k]["wall_s"] > 0 and len(row[k]["operators"]) == 3 for k in ("plain", "mix"))
        assert all(
            row[k]["operator_calls"] >= sum(op["calls"] for op in row[k]["operators"]) > 0
            for k in ("plain", "mix")
        )
        assert report["malloc"]["malloc"] == "default" and report["malloc"]["applied"]
        for key in ("plain", "mix"):  # one more iteration, and its faults by call site
            assert set(row[key]["marginal"]) == set(row[key]) & set(row[key]["marginal"])
            assert {"wall_s", "minor_page_faults"} <= set(row[key]["marginal"])
            sites = row[key]["faults_by_operator"]
            assert 1 <= len(sites) <= 3  # the top 3, where that many sites fault
            assert all({"operator", "site"} <= set(s) for s in sites)
            moved = row[key]["bytes_by_site"]  # the tiny ViT has no tensor of 4 MiB
            assert set(moved["passes"]) == {"model", "ball"} and len(moved["sites"]) <= 3
            assert all(moved["passes"][part]["memory"] == 0 for part in ("model", "ball"))
        phases = row["mix"]["phases_s"]
        assert phases["loop"] == pytest.approx(sum(v for k, v in phases.items() if k != "loop"))
        assert phases["forward"] > 0 and phases["retraction"] > 0
    if name == "bench_block_sizes":  # each size measured; the package's sizes restored
        from geoopt_quotient.manifolds import adaptive
        from geoopt_quotient.sharpness import apgd

        assert set(report["models"]) == {"2^18", "2^17", "2^16"}
        assert all(len(r["inv"]["marginal_ratios"]) == 2 for r in report["models"].values())
        defaults = report["package_blocks"]
        assert apgd.GRAM_BLOCK == adaptive.GRAM_BLOCK == defaults["GRAM_BLOCK"]
        assert apgd.COMBINE_BLOCK == defaults["COMBINE_BLOCK"]
    if name == "bench_cuda":  # on CPU: no memory statistics, no compiling in quick mode
        assert report["status"] == "complete" and keys_named(report, "error") == []
        for model in ("bert-base", "vit-b32"):
            for precision in ("float32", "bf16-autocast"):
                unit = report["iteration"]["results"][model][precision]
                assert set(unit["ratio_to_adaptive"]) == {"geodesic-inv", "geodesic-mix"}
                protocol = report["protocol"]["results"][model][precision]["measures"]
                # 2 batches x 1 iteration (no exact-path report: it is on request)
                passes = {"adaptive": 2, "geodesic-mix": 2}
                for measure, forward in passes.items():
                    expected = {"forward_backward": 2, "forward": forward}
                    assert protocol[measure]["passes"] == expected
        assert "skipped" in report["memory"] and "skipped" in report["compile"]
    if name == "bench_geodesic":  # the span's integration is the reference's
        for row in report["shapes"].values():
            assert row["max_difference_relative_to_step"] < 1e-10
            assert set(row["seconds"]) == {"reference", "span"}
    if name == "bench_sam":
        assert report["models"]["bert"]["ratio_to_sam"]["sam"] == 1.0
    if name == "bench_gl_iteration":  # after the first iteration, no slice-sized tensor
        assert set(report["models"]) == {"inv-sliced", "inv-capped", "mix-sliced", "mix-capped"}
        for row in report["models"].values():
            assert row["same_perturbed_point"] and row["max_gradient_difference"] == 0
            assert row["this"]["allocations_gram"]["count"] == 0
            assert row["this"]["allocations_column"]["count"] == 0
        for metric in ("inv", "mix"):
            assert report["models"][f"{metric}-sliced"]["retraction"]["max_difference"] < 1e-5
    if name == "bench_discovery":
        for model in ("llama-7b", "mistral-7b", "vit-b32", "bert-base"):
            for kinds in ("default", "all"):
                row = report["models"][model][kinds]
                assert row["boxes"] > 0 and row["side_by_side"]["index_map_s"] > 0
    if name == "sweep_zoo":  # gpt2, and cohere whose interleaved rotary planes are read
        rows = {row["family"]: row for row in report["families"]}
        assert rows["gpt2"]["exact"] and rows["cohere"]["exact"]
        assert rows["cohere"]["groups"] and report["summary"]["not_exact"] == {}
    if name == "bench_precision":  # float64 is the reference, the others are compared to it
        rows = report["models"]["bert-tiny"]
        assert {r["mode"] for r in rows} == {"float64", "float32", "bf16-autocast"}
        assert all(r["abs_error"] == 0.0 for r in rows if r["mode"] == "float64")
        assert all(r["rel_error"] < 0.5 for r in rows), rows
    assert sys.modules[name]


def test_gl_iteration_benchmark_compares_slice_sizes_that_agree(tmp_path):
    """``--slices``: every size of the CPU's slices gives the same iteration (the slices
    only group independent products), one row per metric, ratios to the first size.
    The quick stack's points take 2.5 KiB: a point a slice, then the whole batch."""
    module = importlib.import_module("bench_gl_iteration")
    argv = ["--quick", "--slices", "1,16", "--repeats", "2", "--json", str(tmp_path / "s.json")]
    report = module.main(argv)
    assert set(report["models"]) == {"inv-sliced", "mix-sliced"}
    for row in report["models"].values():
        assert row["same_perturbed_point"] and row["max_gradient_difference"] == 0
        assert set(row["ratio_to_default"]) == {"1 KiB", "16 KiB"}
        assert row["ratio_to_default"]["1 KiB"] == 1.0
        assert "retraction" not in row and row["1 KiB"]["allocations_column"]["count"] == 0


@pytest.mark.parametrize("name", ["bench_host_syncs", "profile_cuda_iteration"])
def test_cuda_only_scripts_import_and_explain_themselves(name, capsys):
    """They need a GPU to measure anything; here: they import and answer --help."""
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert stop.value.code == 0 and "--json" in capsys.readouterr().out


class FakeMemory:
    """Allocator statistics that a CPU run can give: 1000 bytes allocated, peak 1500."""

    @staticmethod
    def available(device):
        return True

    @staticmethod
    def allocated(device):
        return 1000

    @staticmethod
    def reset_peak(device):
        pass

    @staticmethod
    def peak(device):
        return 1500

    @staticmethod
    def peak_reserved(device):
        return 2000


def test_cuda_benchmark_memory_section_with_fake_statistics(tmp_path, monkeypatch):
    module = importlib.import_module("bench_cuda")
    monkeypatch.setattr(module, "MEMORY", FakeMemory())
    argv = ["--quick", "--sections", "memory", "--models", "bert-base", "--precisions", "float32"]
    report = module.main([*argv, "--json", str(tmp_path / "memory.json")])
    unit = report["memory"]["results"]["bert-base"]["float32"]
    assert set(unit["runs"]) == {"train-step", "adaptive", "geodesic-inv", "geodesic-mix"}
    assert unit["runs"]["train-step"]["passes"] == {"forward_backward": 1, "forward": 0}
    # one forward for the clean loss (the exact-path report, one more, is on request)
    assert unit["runs"]["geodesic-mix"]["passes"] == {"forward_backward": 1, "forward": 1}
    assert unit["peak_ratio_to_training_step"]["geodesic-inv"] == 1.0
    assert unit["increment_ratio_to_training_step"]["adaptive"] == 1.0
    assert report["iteration"]["results"] == {} and report["protocol"]["results"] == {}


def test_flat_ball_gpu_script_dry_run_writes_its_document(tmp_path):
    """The GPU script's CPU dry run: tiny models, every unit recorded, no error."""
    module = importlib.import_module("bench_flat_ball_gpu")
    out = tmp_path / "flat_ball.json"
    options = ["--dry-run", "--models", "vit-b32,bert-base", "--dtypes", "bfloat16"]
    report = module.main([str(out), *options, "--device", "cpu", "--engine", "abc1234"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report["units"]) == {"bert-base bf16-autocast", "vit-b32 bf16-autocast"}
    for row in report["units"].values():
        assert "error" not in row, row
        assert set(row["seconds_per_iteration"]) == {"step", "adaptive", "inv", "mix"}
        assert all(len(r) == 1 for r in row["seconds_per_iteration_by_round"].values())
        assert row["engine"] == "abc1234"
    with pytest.raises(SystemExit):  # an unknown model is refused before anything runs
        module.main([str(out), "--dry-run", "--models", "vit-b16"])


def test_malloc_retain_is_set_through_mallopt_and_recorded():
    """``--malloc retain`` in a process of its own (it is process-wide): glibc takes both
    thresholds, and the record says so; elsewhere the record says why not."""
    import platform
    import subprocess

    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from _malloc import configure_malloc;"
        "print(json.dumps(configure_malloc('retain')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True, text=True, check=True
    )
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["malloc"] == "retain"
    if platform.libc_ver()[0] == "glibc":
        assert record["trim_threshold"] >= 1 << 30  # glibc takes any trim threshold
        if record["applied"]:
            assert record["mmap_threshold"] == record["trim_threshold"]
        else:  # versions that cap the mmap threshold at half their heap size refuse it
            assert "mmap_threshold" not in record and "refused" in record["note"]
    else:
        assert not record["applied"] and "glibc" in record["note"]
    from _malloc import configure_malloc

    assert configure_malloc("default") == {
        "malloc": "default",
        "applied": True,
        "libc": record["libc"],
    }
    with pytest.raises(ValueError, match="malloc"):
        configure_malloc("jemalloc")


def _huge_pages_mode() -> str | None:
    """The kernel's transparent huge page mode (the bracketed word), or ``None``."""
    path = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    text = path.read_text()
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


@pytest.mark.parametrize("late", [False, True], ids=["first", "after-an-allocation"])
def test_malloc_huge_is_recorded_by_what_a_fresh_tensor_faults(late):
    """``--malloc huge`` in a process of its own: PyTorch's allocator takes
    ``THP_MEM_ALLOC_ENABLE`` where it is set before its first allocation and the kernel
    gives huge pages on request; set after an allocation it does not take, and the record
    says so (unless the kernel gives every large mapping huge pages anyway)."""
    import subprocess

    code = (
        "import json, sys, torch; sys.path.insert(0, sys.argv[1]);"
        + ("torch.ones(8);" if late else "")
        + "from _malloc import configure_malloc; print(json.dumps(configure_malloc('huge')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True, text=True, check=True
    )
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["malloc"] == "huge" and record["THP_MEM_ALLOC_ENABLE"] == "1"
    pages = record["probe_page_faults"]
    mode = _huge_pages_mode() if sys.platform == "linux" else None
    if mode == "always" or (mode == "madvise" and not late):
        assert record["applied"] and pages < (64 << 20) // 4096 // 4, record
    else:
        assert not record["applied"] and "huge pages" in record["note"], record
        if mode == "madvise":  # the variable came too late: every 4 KiB page faulted
            assert pages >= (64 << 20) // 4096, record


def test_derived_result_files_are_what_their_measured_files_give(tmp_path):
    """``derive_results.py --check`` passes on the committed files and fails once a
    measured figure changes, until the derived file is written again from it."""
    module = importlib.import_module("derive_results")
    assert module.main(["--check"]) == 0
    results = tmp_path / "results"
    (results / "reproductions").mkdir(parents=True)
    measured = json.loads((module.RESULTS / "reproductions/transformers_seeds.json").read_text())
    path = results / "reproductions/transformers_seeds.json"
    path.write_text(json.dumps(measured))
    assert module.main(["--results", str(results), "--check"]) == 1  # no derived file yet
    assert module.main(["--results", str(results)]) == 0
    assert module.main(["--results", str(results), "--check"]) == 0
    taus = [run["tau"]["adaptive"]["tau"] for run in measured["runs"]]
    derived = json.loads(path.with_suffix(".derived.json").read_text())["derived"]
    assert derived["tau_over_seeds"]["adaptive"]["max"] == max(taus)
    measured["runs"][0]["tau"]["adaptive"]["tau"] = max(taus) + 1.0
    path.write_text(json.dumps(measured))
    assert module.main(["--results", str(results), "--check"]) == 1


def test_results_table_cells_show_what_the_row_holds_and_nothing_else():
    """The docs' ``results-table`` cells: units, bound keys, lists; a missing, ``None`` or
    non-finite field reads "not measured", never a number."""
    docs_ext = BENCHMARKS.parent / "docs" / "_ext"
    pytest.importorskip("sphinx")
    sys.path.insert(0, str(docs_ext))
    try:
        table = importlib.import_module("results_table")
    finally:
        sys.path.remove(str(docs_ext))
    row = {"s": 0.01234, "m": "b", "a": {"b": [1, 2.5]}, "none": None, "nan": float("nan")}
    assert table.cell("{s:ms:.1f} ms", row) == "12.3 ms"
    assert table.cell("{s:%:.2g}%", row) == "1.2%"
    assert table.cell("{a[$m][-1]:.1f}", row) == "2.5"
    assert table.cell("{a[b]:range:.1f} / {a[b]:join:.0f}", row) == "1.0–2.5 / 1 / 2"
    assert table.cell("{none:opt:.1f}", row) == "–"
    for template in ("{none:.1f}", "{nan:.1f}", "{missing}", "{a[c]}", "{a[b][7]}", "x {s} {none}"):
        assert table.cell(template, row) == table.NOT_MEASURED, template
    rows = list(table.walk({"m": {"x": {"v": 1}, "y": 2}}, ["m", "{k}"], {}, None))
    assert [(r["k"], r.get("v", r.get("value"))) for r in rows] == [("x", 1), ("y", 2)]
    assert table.matches(rows[0], {"k": "x", "v": None}) and not table.matches(rows[1], {"v": None})


def test_whole_calls_split_with_their_arithmetic_floor():
    """``bench_path_gap_cost --calls --split`` times the fixed work and one iteration
    apart and counts the same calls' matrix products: the geodesic call does the
    adaptive call's and its geometry's on top (every floor at least 1), and the counted
    calls are the timed ones (an iteration's products positive)."""
    module = importlib.import_module("bench_path_gap_cost")
    report = module.main(["--calls", "--split", "--quick", "--models", "bert-4x256"])
    row = report["models"]["bert-4x256"]
    floor = row["arithmetic_floor"]
    assert set(row["split"]) >= {"fixed_over_adaptive", "iteration_over_adaptive"}
    for key in ("geodesic_over_adaptive", "fixed_over_adaptive", "iteration_over_adaptive"):
        assert floor[key] >= 1.0, key
    counts = floor["gflop"]["geodesic"]
    assert counts["2"] > counts["1"] > 0
