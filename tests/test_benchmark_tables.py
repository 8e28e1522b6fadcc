"""benchmarks/gpu_benchmark.py's tables: runs split over several processes merged into one
table, its speedups in the peer's layout and their geometric means (run as the script, in a
subprocess: it enables float64 for the whole process)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _row(problem, kind, dtype, cells):
    """A result row: `cells` maps an implementation to its fwd / bwd / dbl milliseconds."""
    return {
        "problem": problem, "dtype": dtype, "kind": kind, "sizes": "B=8",
        "bound_ms": {"fwd": 0.5, "bwd": 0.5, "dbl": 0.5, "dbl_2k": 1.0},
        "impls": {name: dict(zip(("fwd", "bwd", "dbl"), ({"ms": t} for t in times))) for name, times in cells.items()},
        "checks": {},
    }  # fmt: skip


def _result(rows, bandwidth):
    meta = {"date": "2026-11-25", "mode": "tp", "device": "NVIDIA H200", "copy_bandwidth_GBps": bandwidth,
            "repeat": 5, "calls": 10, "versions": {"jax": "0.11.2"}}  # fmt: skip
    return {"meta": meta, "rows": rows}


def _merge(tmp_path, results, tag):
    """Run ``gpu_benchmark.py --merge`` on `results` (written as files); the merged JSON and markdown."""
    files = []
    for n, result in enumerate(results):
        files.append(tmp_path / f"p{n}.json")
        files[-1].write_text(json.dumps(result))
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_benchmark.py"), "--merge", ",".join(map(str, files)),
         "--out", str(tmp_path), "--tag", tag],
        capture_output=True, text=True, cwd=ROOT / "benchmarks", timeout=300,
        env={k: v for k, v in os.environ.items() if k != "OUT"},  # the script copies its files to $OUT too
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    stem = tmp_path / f"2026-11-25-h200-tp-{tag}"
    return json.loads(stem.with_suffix(".json").read_text()), stem.with_suffix(".md").read_text()


def test_merged_table_has_geometric_means_in_each_peers_layout(tmp_path):
    f32 = _result([
        # cuex is compared with jequi in ir_mul (1.0 / 2.0 / 4.0 ms), e3nn with jequi in mul_ir
        _row("a", "uvu", "float32", {"jequi-default": (1.0, 1.0, 1.0), "jequi-default-ir_mul": (1.0, 2.0, 4.0),
                                     "cuex": (2.0, 2.0, 2.0), "e3nn": (4.0, 4.0, 4.0)}),
    ], 4000)  # fmt: skip
    f64 = _result([_row("b", "uvw", "float64", {"jequi-default": (1.0, 1.0, 1.0), "cuex": (1.0, 1.0, 1.0), "e3nn": (8.0, 8.0, 8.0)})], 4100)
    merged, md = _merge(tmp_path, [f32, f64], "both")
    assert [r["problem"] for r in merged["rows"]] == ["a", "b"]
    assert merged["meta"]["copy_bandwidths_GBps"] == [4000, 4100]
    assert "| a | float32 | default 1.000 / default 1.000 / default 1.000 | 4.00x / 4.00x / 4.00x | 2.00x / 1.00x / 0.50x |" in md
    # b: no jequi in ir_mul, so cuex is compared with jequi's mul_ir (marked *)
    assert "| b | float64 | default 1.000 / default 1.000 / default 1.000 | 8.00x / 8.00x / 8.00x | 1.00x* / 1.00x* / 1.00x* |" in md
    cuex_all = math.exp((math.log(2.0) + math.log(0.5)) / 6)
    assert f"| all | {4 ** 0.5 * 8 ** 0.5:.2f}x (6) | {cuex_all:.2f}x (6) |" in md
    assert "| channelwise (uvu) | 4.00x (3) | 1.00x (3) |" in md and "| uvw | 8.00x (3) | 1.00x (3) |" in md
    assert "Cells where a peer is faster: a float32 dbl vs cuex 0.50x." in md
    # the double backward against both bounds: the fused kernel's and the two-kernel one's
    assert "| dbl %HBM | dbl 2-kernel %HBM |" in md and "| 50% | 50% | 50% | 100% |" in md


def test_later_run_of_a_row_replaces_it_in_place(tmp_path):
    first = _result([_row(p, "uvu", "float32", {"jequi-default": (1.0, 1.0, 1.0), "cuex": (1.0, 1.0, 1.0)}) for p in "abc"], 4000)
    again = _result([_row("b", "uvu", "float32", {"jequi-default": (1.0, 1.0, 1.0), "cuex": (2.0, 2.0, 2.0)})], 4100)
    merged, md = _merge(tmp_path, [first, again], "again")
    assert [r["problem"] for r in merged["rows"]] == ["a", "b", "c"]
    assert merged["rows"][1]["impls"]["cuex"]["fwd"]["ms"] == 2.0
    assert "Rows merged from p0.json, p1.json" in md and "their copy bandwidths 4000, 4100 GB/s" in md
    other = dict(again, meta=dict(again["meta"], batch=1000))
    with pytest.raises(AssertionError, match="differ in one of device, mode, batch"):
        _merge(tmp_path, [first, other], "other")


def test_later_run_of_some_passes_replaces_those_passes_of_every_implementation(tmp_path):
    first = _result([_row("a", "uvu", "float32", {"jequi-default": (1.0, 1.0, 1.0), "cuex": (1.0, 1.0, 1.0), "e3nn": (4.0, 4.0, 4.0)})], 4000)
    fwd = _row("a", "uvu", "float32", {"jequi-default": (0.5,), "cuex": (2.0,)})
    merged, md = _merge(tmp_path, [first, _result([dict(fwd, checks={"fwd check": "1e-7"})], 4100)], "fwd")
    impls = merged["rows"][0]["impls"]
    assert {i: {p: c["ms"] for p, c in cells.items()} for i, cells in impls.items()} == {
        "jequi-default": {"fwd": 0.5, "bwd": 1.0, "dbl": 1.0},
        "cuex": {"fwd": 2.0, "bwd": 1.0, "dbl": 1.0},
        "e3nn": {"bwd": 4.0, "dbl": 4.0},  # its fwd cell came from the other run: dropped
    }  # fmt: skip
    assert merged["rows"][0]["checks"] == {"fwd check": "1e-7"}
    assert "| a | float32 | default 0.500 / default 1.000 / default 1.000 |" in md
