"""bench/profile_train.py's trace arithmetic (the capture itself needs a GPU)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench")]

import profile_train  # noqa: E402


def test_busy_time_is_the_union_of_overlapping_intervals():
    assert profile_train.busy_us([]) == 0.0
    assert profile_train.busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17.0


def test_idle_gaps_lists_each_gap_with_the_cpu_ranges_open_then():
    def kernel(ts, dur, name="k"):
        return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name}

    trace = {"traceEvents": [
        kernel(0, 100), kernel(150, 100),             # 50 us: below the threshold
        kernel(1000, 100, "after_gap"),               # 750 us idle from t=250
        kernel(1050, 500), kernel(1200, 10),          # overlapping: no gap
        kernel(2000, 10, "late"),                     # 450 us idle from t=1550
        {"ph": "X", "cat": "cpu_op", "ts": 200, "dur": 900, "name": "Optimizer.step"},
        {"ph": "X", "cat": "cpu_op", "ts": 240, "dur": 20, "name": "too_short"},
    ]}
    lines = profile_train.idle_gaps(trace)
    assert lines[0] == "2 gaps over 0.3 ms, 1.2 ms in all"
    assert "idle  0.75 ms" in lines[1] and "'after_gap'" in lines[1]
    assert "Optimizer.step" in lines[1] and "too_short" not in lines[1]
    assert "idle  0.45 ms" in lines[2] and "'late'" in lines[2] and "cpu: []" in lines[2]


def _capture(path: Path) -> Path:
    """A minimal Nsight Systems SQLite export: two kernels and a memcpy on the GPU, the train
    stage and two ranges inside it on the host, CUDA API calls (times in ns)."""
    import sqlite3
    db = sqlite3.connect(str(path))
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT);
        CREATE TABLE NVTX_EVENTS (start INT, end INT, text TEXT, textId INT, globalTid INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INT, end INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT, end INT, nameId INT);
        INSERT INTO StringIds VALUES (1, 'train/optimizer'), (2, 'cudaLaunchKernel_v7000'),
                                     (3, 'cudaStreamSynchronize_v3020');
        INSERT INTO NVTX_EVENTS VALUES (0, 10000000, ':train', NULL, 7),
                                       (0, 3000000, 'train/replay', NULL, 7),
                                       (3000000, 10000000, NULL, 1, 7),
                                       (3000000, 10000000, 'other thread', NULL, 8);
        INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (500000, 2500000), (2400000, 3500000),
                                                      (6000000, 9950000);
        INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (3500000, 3600000);
        INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (3700000, 3900000, 2),
                                                        (5000000, 6500000, 3);
    """)
    db.commit()
    db.close()
    return path


def test_nsys_gaps_attributes_each_idle_gap_to_the_open_range(tmp_path):
    import nsys_gaps
    text = nsys_gaps.report(_capture(tmp_path / "cap.sqlite"), "train", gap_us=100, top=5)
    lines = text.splitlines()
    # busy: [0.5, 3.6) and [6.0, 9.95) ms = 7.05 ms; gaps: 0.5 ms at the start, 2.4 ms
    # from 3.6 (the optimizer range) and 0.05 ms at the end (under 100 us: not a gap)
    assert lines[0] == (":train: wall 10.0 ms, GPU busy 7.0 ms, 2 gaps >= 100 us = 2.9 ms")
    assert "2.40     1  train/optimizer" in lines[2]
    assert "0.50     1  train/replay" in lines[3]
    # API time inside the gaps, clipped to them: the sync's 1.0 ms before 6.0, the launch 0.2
    assert "1.00  cudaStreamSynchronize" in text and "0.20  cudaLaunchKernel" in text
    assert nsys_gaps.report(tmp_path / "cap.sqlite", "rollout", 100, 5).startswith("no NVTX")


def _host_lead_trace() -> dict:
    """A train stage in miniature (times in us): a compiled forward whose two kernels start
    1000 us after their launches (the host ahead), a post-backward callback and an optimizer
    step with the GPU idle, then a compiled call whose kernel starts at once (the host behind)."""
    def op(ts, dur, name, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name}

    def launch(ts, corr):
        return {**op(ts, 5, "cuLaunchKernelEx", "cuda_driver"), "args": {"correlation": corr}}

    def kernel(ts, dur, corr):
        return {**op(ts, dur, "k", "kernel"), "args": {"correlation": corr}}

    return {"traceEvents": [
        op(0, 50, "TorchDynamo Cache Lookup"), op(50, 2100, "Torch-Compiled Region: 0/0"),
        launch(100, 1), launch(2100, 2), kernel(1100, 2000, 1), kernel(3100, 1500, 2),
        op(5000, 3000, "FSDP::root_post_backward_callback"),
        op(8200, 500, "Optimizer.step#AdamW.step"), op(8250, 50, "aten::_fused_adamw_"),
        op(8900, 30, "TorchDynamo Cache Lookup"), op(8930, 200, "Torch-Compiled Region: 0/0"),
        launch(9000, 3), kernel(9010, 990, 3),
    ]}


def test_host_lead_reports_the_lead_busy_share_and_the_idle_update_boundary():
    import host_lead
    text = host_lead.report(_host_lead_trace(), window_ms=5.0)
    lines = text.splitlines()
    assert lines[0] == "trace: 10.0 ms, 3 GPU events"
    # window 0-5 ms: 3.5 ms of kernels, two launches each 1.0 ms ahead of its kernel
    assert lines[2].split("|")[1].strip() == "70.0 %"
    assert lines[2].split("|")[3].strip() == "1.00 /  1.00"
    # window 5-10 ms: 0.99 ms of kernels; its one launch only 0.01 ms ahead
    assert lines[3].split("|")[1].strip() == "19.8 %" and "0.01 /  0.01" in lines[3]
    # the median call (the longer of two): 2.1 ms of host time holding both launches
    assert "Torch-Compiled Region: 0/0 | 2 | 2.10 | 2 | 0.01" in text
    assert "guard evaluation (TorchDynamo Cache Lookup): 2 calls, median 0.050 ms, 0.1 ms" in text
    # from the callback (5.0 ms) to the next compiled call (8.93 ms), no kernel runs; the
    # optimizer step is listed, its nested fused call is not a top-level op
    assert "update boundary 1: 3.9 ms of host time, GPU idle 3.9 ms of it" in text
    assert "Optimizer.step#AdamW.step" in text and "_fused_adamw_" not in text


def test_host_lead_says_when_the_trace_has_no_gpu_work():
    import host_lead
    assert host_lead.report({"traceEvents": []}).startswith("no GPU work")
