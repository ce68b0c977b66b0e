"""Smoke test of the benchmark machinery (bench/shapes.py, bench/run.py): one tiny shape, one
call per measurement, every layout, dtype and formula.  No timing assertions."""
import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

import bnbw_native

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import shapes  # noqa: E402


def load_runner():
    spec = importlib.util.spec_from_file_location("bnbw_bench_run", BENCH / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = load_runner()
TINY = {"tiny-2d": shapes.SMALL_ODD["tiny-2d"]}
ONE_CALL = run.Protocol(fixed_rounds=1)


@pytest.fixture(scope="module")
def probe():
    return run.Probe()


@pytest.fixture(scope="module")
def rows(probe):
    runner = run.Runner(ONE_CALL, threads=[1, 2], dtypes=list(run.DTYPES), probe=probe,
                        echo=lambda line: None)
    return runner.run_shapes(TINY)


def test_shape_lists_are_named_and_in_ncx_order():
    assert set(shapes.QUICK) <= set(shapes.ALL)
    for name, shape in shapes.ALL.items():
        assert isinstance(name, str) and 2 <= len(shape) <= 8, name
        assert all(isinstance(n, int) and n > 0 for n in shape), name
    assert any(len(s) == 5 for s in shapes.VOLUMETRIC.values())
    assert shapes.OVERHEAD_SHAPE == (8, 16)


def test_every_case_produces_a_checked_row(rows):
    expected = len(run.LAYOUTS) * len(run.DTYPES) * len(run.FORMULAS) * 2
    assert len(rows) == expected
    assert {(r.layout, r.dtype, r.formula, r.threads) for r in rows} == {
        (layout, dtype, formula, threads) for layout in run.LAYOUTS for dtype in run.DTYPES
        for formula in run.FORMULAS for threads in (1, 2)}
    for row in rows:
        assert row.check == "pass"
        assert row.ours_ms > 0 and row.probe_ms > 0 and row.roofline_pct > 0
        assert max(row.err) <= max(run.TOLERANCE[row.dtype])
        assert row.numpy_ms is not None and row.ref_ms is not None
        assert (row.torch_ms is not None) == (run.torch is not None)
        assert row.model_bytes == (run.PASSES[row.formula] * np.dtype(run.DTYPES[row.dtype])
                                   .itemsize * row.elements * run.STRIDE_FACTOR[row.layout])


def test_results_written_as_json(rows, tmp_path):
    path = tmp_path / "out.json"
    run.write_json({"rows": [run.asdict(r) for r in rows]}, str(path))
    loaded = json.loads(path.read_text())
    assert len(loaded["rows"]) == len(rows)
    assert {"ours_ms", "gbs", "roofline_pct", "vs_torch", "err"} <= set(loaded["rows"][0])
    for row in rows:
        assert row.case in run.format_row(row)
    assert run.weak_summary(rows, run.weak_rows(rows)) is not None


def test_plot_written(rows, tmp_path):
    pytest.importorskip("matplotlib")
    run.plot(rows[:6], str(tmp_path / "out.png"))
    assert (tmp_path / "out.png").stat().st_size > 0


def test_a_wrong_result_fails_loudly(probe, monkeypatch):
    real = bnbw_native.batchnorm_training_backward

    def off_by_a_bit(*args, **kwargs):
        result = real(*args, **kwargs)
        result.diff_src.flat[0] += 1
        return result

    monkeypatch.setattr(bnbw_native, "batchnorm_training_backward", off_by_a_bit)
    runner = run.Runner(ONE_CALL, threads=[1], dtypes=["f32"], layouts=["NCX"],
                        formulas=["training"], peers=(), probe=probe, echo=lambda line: None)
    with pytest.raises(run.CheckFailed):
        runner.run_shapes(TINY)


def test_bandwidth_probe_patterns_run(probe):
    bufs = probe.buffers(4096)
    for pattern in run.PROBE_BYTES_PER_ELEMENT:
        probe.kernel(pattern, bufs, 1)()
    bufs[0][:] = 2
    bufs[1][:] = 3
    probe.kernel("apply", bufs, 2)()          # c = 0.5 a + b
    assert np.all(bufs[2] == 4)


def test_split_times_both_phases(probe):
    if not hasattr(bnbw_native, "backward_reduce"):
        pytest.skip("this build has no two-phase API")
    runner = run.Runner(ONE_CALL, threads=[1], dtypes=["f32"], layouts=["NXC"],
                        formulas=["training", "frozen"], peers=(), probe=probe,
                        echo=lambda line: None, split=True)
    training, frozen = runner.run_shapes(TINY)
    assert training.split["reduce_ms"] > 0 and training.split["apply_ms"] > 0
    assert frozen.split is None


def test_half_training_table_times_every_dtype_and_layout():
    spec = importlib.util.spec_from_file_location("bnbw_bench_half", BENCH / "bench_half.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    times, keys = module.half_training_ratios((2, 3, 4, 5), rounds=2)
    assert keys[:2] == ["f32", "f16"]
    assert set(times) == {(layout, threads, key) for layout in ("NCX", "NXC")
                          for threads in (1, 2) for key in keys}
    assert all(t > 0 for t in times.values())
