"""Benchmarks as data: the harness writes well-formed rows, bench/results.csv is well-formed,
the generated tables are up to date with it, and the GPU entry point resolves every purpose."""
from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import make_table, results  # noqa: E402


def _recorder(**kw) -> results.Recorder:
    context = dict(device="NVIDIA H200", torch="2.11.0", commit="abc123", date="2026-12-01",
                   command="python bench/bench_x.py")
    return results.Recorder("bench_x", **{**context, **kw})


def test_recorder_appends_well_formed_rows_with_their_spread(tmp_path):
    path = tmp_path / "results.csv"
    rec = _recorder()
    rec.add("case-a", "step_s", 0.5, "s", samples=[0.7, 0.5, 0.4])
    rec.add("case-a", "peak_memory", 11.3, "GB")
    assert rec.add("case-a", "not_measured", float("nan"), "GB") is None
    rec.write(path)
    later = _recorder(date="2026-12-02")
    later.add("case-a", "step_s", 0.45, "s")
    later.write(path)

    text = path.read_text()
    assert text.count("bench,case,metric") == 1  # one header however many writes
    rows = results.read_rows(path)
    assert [r["metric"] for r in rows] == ["step_s", "peak_memory", "step_s"]
    first = rows[0]
    assert (first["min"], first["median"], first["max"]) == ("0.4", "0.5", "0.7")
    assert first["device"] == "NVIDIA H200" and first["command"] == "python bench/bench_x.py"
    assert rows[1]["min"] == rows[1]["median"] == rows[1]["max"] == ""
    assert results.file_problems(path) == []
    latest = results.current(rows)
    assert latest[("bench_x", "case-a", "step_s", "NVIDIA H200")]["value"] == "0.45"


def test_recorder_defaults_name_the_checkout_and_the_command():
    rec = results.Recorder("bench_x", device="cpu")
    row = rec.add("c", "m", 1.0, "s")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"])
    assert row["commit"] != "" and row["torch"] != ""
    assert row["command"].startswith("python ")


@pytest.mark.parametrize("bad, problem", [
    ({"date": "1 Dec 2026"}, "date"),
    ({"value": "fast"}, "value='fast' is not a number"),
    ({"value": "inf"}, "not finite"),
    ({"min": "2", "median": "1", "max": "3"}, "min 2.0 <= median 1.0 <= max 3.0"),
    ({"min": "1", "median": "", "max": ""}, "given together"),
    ({"device": ""}, "device is empty"),
])
def test_malformed_rows_are_refused_and_named(tmp_path, bad, problem):
    row = {**_recorder().add("c", "m", 1.0, "s"), **bad}
    problems = results.row_problems(row)
    assert any(problem in p for p in problems), problems
    path = tmp_path / "r.csv"
    with pytest.raises(ValueError, match="malformed"):
        results.append_rows([row], path)
    assert not path.exists()  # nothing half-written


def test_merge_checks_every_file_before_appending_any(tmp_path):
    good, bad, into = tmp_path / "good.csv", tmp_path / "bad.csv", tmp_path / "into.csv"
    rec = _recorder()
    rec.add("c", "m", 1.0, "s")
    rec.write(good)
    rec.write(bad)
    rows = list(csv.DictReader(bad.open()))
    rows[0]["date"] = "yesterday"
    with bad.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=results.FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    assert results.main(["merge", str(good), str(bad), "--into", str(into)]) == 1
    assert not into.exists()
    assert results.main(["merge", str(good), "--into", str(into)]) == 0
    assert len(results.read_rows(into)) == 1


def test_merge_fills_in_the_commit_a_copy_without_git_could_not_read(tmp_path, monkeypatch):
    src, into = tmp_path / "gpu.csv", tmp_path / "into.csv"
    rec = _recorder(commit=results.UNRECORDED)
    rec.add("c", "m", 1.0, "s")
    rec.write(src)
    kept = _recorder(commit="keepme")
    kept.add("c", "m2", 2.0, "s")
    kept.write(src)
    assert results.main(["merge", str(src), "--into", str(into), "--commit", "abc1234"]) == 0
    assert [r["commit"] for r in results.read_rows(into)] == ["abc1234", "keepme"]
    monkeypatch.setenv("BENCH_COMMIT", "fromenv")
    assert results.Recorder("b", device="cpu").add("c", "m", 1.0, "s")["commit"] == "fromenv"


def test_the_repository_results_file_is_well_formed():
    assert results.file_problems(results.DEFAULT_PATH) == []
    assert len(results.read_rows(results.DEFAULT_PATH)) > 100


def test_generated_tables_are_up_to_date_with_results_csv():
    stale = [path for path, text in make_table.rendered().items()
             if path.read_text(encoding="utf-8") != text]
    assert stale == [], "run python bench/make_table.py"


def _readme_after_run(copy: Path, bench: str, commit: str, date: str,
                      figures: list[tuple[str, str, float, str]]) -> str:
    """The README's headline table once an H200 run of ``bench`` appended ``figures``
    (case, metric, value, unit) to ``copy``."""
    run = results.Recorder(bench, device="NVIDIA H200", torch="2.12.0", commit=commit,
                           date=date, command=f"python bench/{bench}.py {commit}")
    for case, metric, value, unit in figures:
        run.add(case, metric, value, unit)
    run.write(copy)
    return make_table.rendered(results=copy)[make_table.MAIN_README]


def test_tables_follow_the_latest_row(tmp_path):
    copy = tmp_path / "results.csv"
    shutil.copy(results.DEFAULT_PATH, copy)
    readme = _readme_after_run(copy, "bench_rewards", "abc", "2027-01-02", [
        ("pickscore-arch-bfloat16-256x384-32prompts", "images_per_s", 4321.0, "images/s")])
    assert "| 4,321 images/s |" in readme and "2027-01-02" in readme
    assert "1,264 images/s" not in readme


def test_a_same_run_headline_shows_the_latest_run_that_measured_all_its_figures(tmp_path):
    copy = tmp_path / "results.csv"
    shutil.copy(results.DEFAULT_PATH, copy)
    readme = _readme_after_run(copy, "bench_step", "abc", "2027-01-02", [
        ("qwen8l-lora", "engine_images_per_s", 98.7, "images/s")])
    assert "98.7" not in readme  # no diffusers figure from that run: the older pair stays
    readme = _readme_after_run(copy, "bench_step", "def", "2027-01-03", [
        ("qwen8l-lora", "engine_images_per_s", 65.4, "images/s"),
        ("qwen8l-diffusers-eager-pipeline", "images_per_s", 43.2, "images/s")])
    assert "| 65.4 / 43.2 images/s |" in readme and "2027-01-03" in readme


def test_a_headline_missing_from_the_results_is_named(tmp_path):
    copy = tmp_path / "results.csv"
    rows = [r for r in results.read_rows(results.DEFAULT_PATH) if r["bench"] != "bench_ipc"]
    results.append_rows(rows, copy)
    with pytest.raises(KeyError, match="ipc-adapter-sync-1440-tensors/ms"):
        make_table.rendered(results=copy)


def _toy_seed_rows(algo: str, seed: int, *, reached: int | None, parallel: int = 1,
                   commit: str = "abc") -> list[dict[str, str]]:
    """The rows bench_toy_learning writes for one variant (``reached``: rollouts to +0.10,
    None where the run never gained it)."""
    run = results.Recorder("bench_toy_learning", device="cpu", torch="2.14.1", commit=commit,
                           date="2027-01-02", command=(
                               "python bench/bench_toy_learning.py --rollouts 100 --eval-every 10 "
                               f"--stop-after-gain 0.10 --device cpu --parallel {parallel}"))
    case = f"toy-{algo}_s{seed}"
    run.add(case, "s_per_rollout", 4.0 + seed, "s")
    if reached is not None:
        run.add(case, "rollouts_to_gain_0.1", reached, "rollouts")
        run.add(case, "wall_s_to_gain_0.1", 10.0 * reached, "s")
        run.add(case, "train_s_to_gain_0.1", 5.0 * reached, "s")
        for component, change in (("color", 0.2), ("count", -0.01 * seed), ("position", 0.05)):
            run.add(case, f"eval_{component}_change_at_gain_0.1", change, "reward")
    return run.rows


def test_the_time_to_reward_table_reads_each_seeds_latest_run_at_the_shared_footing():
    from bench.time_to_reward import ALGORITHMS, time_to_reward_table

    rows = []
    for algo, _ in ALGORITHMS:
        for seed in range(3):
            rows += _toy_seed_rows(algo, seed, reached=None if (algo, seed) == ("mixgrpo", 2)
                                   else 40 + 10 * seed)
    # a faster figure from another footing (6 variants at once) is not read
    rows += _toy_seed_rows("flowgrpo", 0, reached=10, parallel=6, commit="zzz")
    table = time_to_reward_table(rows, make_table.fmt)
    line = {cells.split(" | ")[0]: cells for cells in
            (line.strip("| ") for line in table.splitlines()[2:])}
    assert line["Flow-GRPO"].startswith(
        "Flow-GRPO | 3 of 3 | 50 [40, 60] | 500 [400, 600] |")
    assert "zzz" not in table
    # a seed that never gained 0.10 counts against its algorithm, not in its spread
    assert "| 2 of 3 | 45 [40, 50] |" in line["MixGRPO"]
    assert line["DiffusionNFT"].endswith("| 5 [4, 6] | 0.2 / -0.01 / 0.05 | abc")

    without = [r for r in rows if r["case"] != "toy-flowgrpo_fast_s1"]
    with pytest.raises(KeyError, match="toy-flowgrpo_fast_s1"):
        time_to_reward_table(without, make_table.fmt)


def test_every_bench_script_writes_rows_through_the_harness():
    scripts = sorted(REPO.glob("bench/bench_*.py")) + [REPO / "bench" / "peer_step.py"]
    silent = [p.name for p in scripts
              if not re.search(r"from (bench\.results|record_rows) import", p.read_text())]
    assert silent == []


def _gpu_sh(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "bench" / "gpu.sh"), *args], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **env})


def test_gpu_sh_lists_every_purpose_with_commands_that_resolve():
    proc = _gpu_sh("--list")
    assert proc.returncode == 0, proc.stderr
    listed = re.findall(r"^(\S+):$", proc.stdout, flags=re.M)
    assert listed == ["kernels", "ipc", "engine", "step", "multigpu", "gpu-tests", "toy-sweep"]
    files = set(re.findall(r"(?:bench|tests|lab)/[\w./-]+\.(?:py|txt)", proc.stdout))
    missing = [f for f in files if not (REPO / f).exists()]
    assert missing == [] and files
    gpu_tests = proc.stdout.split("gpu-tests:")[1].split("toy-sweep:")[0]
    # every GPU test runs: the offload tests in their own part, the rest in the first
    assert "-m gpu tests --ignore=tests/test_offload_gpu.py" in gpu_tests
    assert "-m gpu tests/test_offload_gpu.py" in gpu_tests
    for script in [*REPO.glob("bench/bench_*.py")]:
        assert f"bench/{script.name}" in gpu_tests, f"no smoke case of {script.name}"
    for piece in ("--floors", "--peer", "--diffusers"):  # floors.py and peer_step.py
        assert piece in gpu_tests


def test_gpu_sh_dry_run_of_each_purpose_and_refusals():
    for purpose in ("kernels", "ipc", "engine", "multigpu", "gpu-tests", "toy-sweep"):
        proc = _gpu_sh(purpose, DRY_RUN="1")
        assert proc.returncode == 0 and "(" in proc.stdout, (purpose, proc.stderr)
    for variant in ("default", "peer", "offload", "nsys", "profile", "attention", "accumulate",
                    "textlen", "optimizer"):
        assert _gpu_sh("step", variant, DRY_RUN="1").returncode == 0
    assert _gpu_sh("step", "bogus", DRY_RUN="1").returncode == 1
    parts = {only: _gpu_sh("gpu-tests", DRY_RUN="1", ONLY=only).stdout
             for only in ("tests", "offload", "smoke")}
    assert "ckpt_selfcheck" in parts["tests"] and "smoke_" not in parts["tests"]
    assert "gpu_tests_offload" in parts["offload"] and "ckpt_selfcheck" not in parts["offload"]
    assert "smoke_step" in parts["smoke"] and "gpu_tests" not in parts["smoke"]
    unknown = _gpu_sh("bogus")
    assert unknown.returncode == 2 and "kernels ipc engine" in unknown.stderr
    assert _gpu_sh().returncode == 2
