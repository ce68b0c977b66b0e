"""Smoke test of the benchmark machinery (bench/): one tiny shape, one call per measurement,
every layout, dtype and formula (the backward's and the forward's), the peers (oneDNN where
installed, torch.compile's where it compiles), kernel bodies, the report and the command line,
the layer rows; and one shape above glibc's 32 MiB mmap ceiling, where the page faults of each
timed call show which peers allocate.  No timing assertions."""
import importlib.util
import json
import os
from dataclasses import asdict, replace

import numpy as np
import pytest

import bnbw_native
from bnbw_native import _config
from conftest import BENCH_DIR as BENCH, bench_module

(bandwidth, cases, checks, onednn_peer, peers, procmem, report, runner, shapes, timing,
 torch_cache, torch_layers) = (bench_module(name) for name in (
    "bandwidth", "cases", "checks", "onednn_peer", "peers", "procmem", "report", "runner",
    "shapes", "timing", "torch_cache", "torch_layers"))


TINY = {"tiny-2d": shapes.SMALL_ODD["tiny-2d"]}
ODD = {"odd-4d": shapes.SMALL_ODD["odd-4d"]}
ONE_CALL = timing.Protocol(fixed_rounds=1)
ONEDNN = onednn_peer.load()
TORCH_CACHE = torch_cache.load() if peers.torch is not None else None
quiet = dict(echo=lambda line: None)


@pytest.fixture(scope="module")
def probe():
    return bandwidth.Probe()


@pytest.fixture(scope="module")
def rows(probe):
    run = runner.Runner(ONE_CALL, threads=[1, 2], dtypes=list(cases.DTYPES),
                        formulas=cases.FORMULAS, probe=probe, **quiet)
    return run.run_shapes(TINY)


def test_shape_lists_are_named_and_in_ncx_order():
    assert set(shapes.QUICK) <= set(shapes.ALL) and set(shapes.DEFAULT) <= set(shapes.ALL)
    for name, shape in shapes.ALL.items():
        assert isinstance(name, str) and 2 <= len(shape) <= 8, name
        assert all(isinstance(n, int) and n > 0 for n in shape), name
    assert any(len(s) == 5 for s in shapes.VOLUMETRIC.values())
    assert shapes.OVERHEAD_SHAPE == (8, 16)


def test_network_groups_hold_every_batch_norm_once():
    for group, layers in shapes.NETWORK_LAYERS.items():
        members = shapes.GROUPS[group]
        assert len(set(members.values())) == len(members), group     # distinct shapes
        assert all(shape[0] == 50 and len(shape) == 4 for shape in members.values()), group
        assert sum(shapes.LAYERS[name] for name in members) == layers
        assert cases.select_shapes(group, quick=False) == members
    # the network groups are asked for by name; the default run keeps its shapes
    assert not set(shapes.DEFAULT) & set(shapes.RESNET50_B50)


def worst(errs):
    """The largest of a peer's errors (None: an output it does not give)."""
    return max(e for e in errs if e is not None)


def test_every_case_produces_a_checked_row(rows):
    expected = len(cases.LAYOUTS) * len(cases.DTYPES) * len(cases.FORMULAS) * 2
    assert len(rows) == expected
    assert {(r.layout, r.dtype, r.formula, r.threads) for r in rows} == {
        (layout, dtype, formula, threads) for layout in cases.LAYOUTS
        for dtype in cases.DTYPES for formula in cases.FORMULAS for threads in (1, 2)}
    for row in rows:
        assert row.check == "pass"
        assert row.ours_ms > 0 and row.probe_ms > 0 and row.roofline_pct > 0
        assert max(row.err) <= max(checks.TOLERANCE[row.dtype])
        assert row.numpy_ms > 0 and row.ref_ms > 0
        assert (row.torch_ms is not None) == (peers.torch is not None)
        assert (row.torch_alloc_ms is not None) == (peers.torch is not None)
        relu = row.formula in cases.RELU_FORMULAS
        unfused = relu or row.formula == "forward-relu"
        assert (row.unfused_ms is not None) == (unfused and peers.torch is not None)
        # every timed implementation's page faults are counted (whether they stay at zero is
        # checked on a big tensor below: one call here may meet a first touch of anything)
        assert {"ours", "probe", "numpy"} <= set(row.faults_per_call), row.faults_per_call
        assert all(f >= 0 for f in row.faults_per_call.values())
        if peers.torch is not None:
            assert {"torch", "torch-alloc"} <= set(row.faults_per_call)
            assert row.vs_torch == pytest.approx(row.torch_ms / row.ours_ms)
            assert row.vs_torch_alloc == pytest.approx(row.torch_alloc_ms / row.ours_ms)
            assert row.torch_peer.startswith("reused blocks" if TORCH_CACHE else "allocating")
            assert ("threshold_backward.grad_input" in row.torch_peer) == relu
            assert ("torch.relu_" in row.torch_peer) == (row.formula == "forward-relu")
            if TORCH_CACHE is not None:
                assert row.torch_new_blocks_per_call == 0, row     # every block was reused
            assert worst(row.torch_err) <= checks.SEMANTICS_LIMIT
            assert worst(row.torch_alloc_err) <= checks.SEMANTICS_LIMIT
        itemsize = np.dtype(cases.DTYPES[row.dtype]).itemsize
        assert row.model_bytes == ((cases.PASSES[row.formula] * itemsize
                                    + cases.MASK_PASSES[row.formula])
                                   * row.elements * cases.STRIDE_FACTOR[row.layout])
        assert row.body == _config.kernel_body() and row.body_cap is None


@pytest.mark.skipif(ONEDNN is None, reason=f"oneDNN: {onednn_peer.why_absent}")
def test_onednn_rows_are_checked_and_name_their_implementation(rows):
    for row in rows:
        assert row.onednn_impl, row
        if row.onednn_impl.startswith("unsupported"):
            assert row.onednn_ms is None and row.vs_onednn is None
        else:
            assert row.onednn_ms > 0 and row.vs_onednn > 0
            assert worst(row.onednn_err) <= checks.SEMANTICS_LIMIT
    # every CPU oneDNN runs on has f32 kernels for dense tensors (halves depend on the CPU)
    dense = [r for r in rows if r.layout != "strided" and r.dtype == "f32"]
    assert all(not r.onednn_impl.startswith(("unsupported", "error")) for r in dense)


@pytest.mark.skipif(ONEDNN is None, reason=f"oneDNN: {onednn_peer.why_absent}")
def test_onednn_constants_match_its_headers():
    try:
        mismatches = onednn_peer.header_mismatches()
    except OSError as exc:
        pytest.skip(f"cannot compile against the oneDNN headers: {exc}")
    assert mismatches == {}


@pytest.mark.skipif(ONEDNN is None, reason=f"oneDNN: {onednn_peer.why_absent}")
def test_onednn_fused_relu_gets_its_mask_from_its_forward():
    problem = cases.make_problem("odd", ODD["odd-4d"], "f32", relu=True)
    arrays = cases.layout_arrays(problem, "NXC")
    C = problem["shape"][1]
    out = (np.zeros_like(arrays["x"]), np.zeros(C, np.float32), np.zeros(C, np.float32))
    call = ONEDNN.backward(arrays["x"], arrays["dy"], problem["mean"], problem["var"],
                           problem["gamma"], out, epsilon=cases.EPSILON, data_format="NXC",
                           formula="training", relu_dst=True, beta=problem["beta"])
    call()
    assert np.array_equal(call.relu_y > 0, arrays["mask"])
    ref = peers.reference(arrays["x"], arrays["g"], problem["mean"], problem["var"],
                          problem["gamma"], epsilon=cases.EPSILON, data_format="NXC")
    assert np.allclose(out[0], ref[0], rtol=1e-4, atol=1e-5)
    call.close()


def test_without_onednn_its_column_is_skipped_with_a_note(probe, monkeypatch):
    monkeypatch.setattr(onednn_peer, "library_candidates", lambda: [])
    monkeypatch.setattr(onednn_peer, "_loaded", None)
    monkeypatch.setattr(onednn_peer, "why_absent", None)
    run = runner.Runner(ONE_CALL, threads=[1], dtypes=["f32"], layouts=["NCX"],
                        formulas=["training"], probe=probe, **quiet)
    assert run.onednn is None and any("oneDNN column skipped" in n for n in run.notes)
    (row,) = run.run_shapes(TINY)
    assert row.onednn_ms is None and row.onednn_impl is None and row.check == "pass"


def test_results_written_as_json(rows, tmp_path):
    path = tmp_path / "out.json"
    report.write_json({"rows": [asdict(r) for r in rows]}, str(path))
    loaded = json.loads(path.read_text())
    assert len(loaded["rows"]) == len(rows)
    assert {"ours_ms", "gbs", "roofline_pct", "vs_torch", "vs_torch_alloc", "torch_peer",
            "faults_per_call", "vs_onednn", "onednn_impl", "vs_unfused", "body",
            "err"} <= set(loaded["rows"][0])
    table = report.Table(unfused=True, bodies=True)
    assert "xonednn" in table.header and "xunfus" in table.header
    assert "xtorch-alloc" in table.header
    assert "xtorch-alloc" not in report.Table(torch_alloc=False).header
    # the column sits under its header: the row's text at the header's position is its ratio
    row = replace(rows[0], vs_torch_alloc=12.5)
    at = table.header.index("xtorch-alloc")
    assert table.row(row)[at:at + len("xtorch-alloc")].strip() == "12.50"
    for row in rows:
        assert row.case in table.row(row) and row.case in report.format_row(row)
    # the weak-row summary counts every weak row once, in the group of its row's case
    weak = report.weak_rows(rows)
    summary = report.weak_summary(rows, weak)
    assert sum(stats["weak"] for _, stats in summary) == len(weak)
    assert all(0 < stats["weak"] <= stats["rows"] for _, stats in summary)
    assert report.weak_summary(rows, []) == []
    first = rows[0]
    ((key, stats),) = report.weak_summary(rows, [(first, "made weak here")])
    assert key == (first.size_class, first.dtype, first.formula, first.layout, first.threads)
    assert stats["weak"] == 1 and stats["rows"] == sum(
        (r.size_class, r.dtype, r.formula, r.layout, r.threads) == key for r in rows)


def test_network_totals_weigh_each_shape_by_its_layers(rows):
    fake = [replace(rows[0], case=name, ours_ms=1.0, torch_ms=2.0, torch_alloc_ms=3.0,
                    onednn_ms=None) for name in shapes.RESNET50_B50]
    (total,) = report.network_totals(fake)
    assert total["network"] == "RESNET50_B50" and total["ours_ms"] == 53
    assert total["vs_torch"] == 2 and total["onednn_ms"] is None
    assert total["torch_alloc_ms"] == 3 * 53 and total["vs_torch_alloc"] == 3
    assert report.network_totals(fake[1:]) == []          # a shape missing: no total
    # the forward rows of the same shapes: every batch norm's forward once, a total of its own
    forward = [replace(row, formula="forward", ours_ms=0.5, onednn_ms=1.0) for row in fake]
    totals = {t["formula"]: t for t in report.network_totals(fake + forward)}
    assert set(totals) == {fake[0].formula, "forward"}
    assert totals["forward"]["ours_ms"] == 0.5 * 53 and totals["forward"]["vs_onednn"] == 2


def test_fair_summary_takes_the_faster_fair_peer_of_each_row(rows):
    base = replace(rows[0], formula="training", dtype="f32", layout="NXC", threads=2,
                   torch_alloc_ms=0.01, torch_compiled_ms=None)
    fake = [replace(base, case="a", ours_ms=1.0, torch_ms=2.0, onednn_ms=1.5, roofline_pct=80),
            replace(base, case="b", ours_ms=2.0, torch_ms=1.0, onednn_ms=None, roofline_pct=90),
            replace(base, case="c", ours_ms=1.0, torch_ms=3.0, onednn_ms=4.0,
                    torch_compiled_ms=1.2, roofline_pct=100),
            replace(base, case="d", ours_ms=1.0, torch_ms=None, onednn_ms=None),   # no peer
            replace(base, case="e", layout="NCX", ours_ms=1.0, torch_ms=4.0, onednn_ms=None)]
    summary = dict(report.fair_summary(fake))
    assert set(summary) == {("training", "f32", "NXC", 2), ("training", "f32", "NCX", 2)}
    nxc = summary[("training", "f32", "NXC", 2)]
    # ratios 1.5 (oneDNN), 0.5 (torch), 1.2 (compiled torch); torch allocating never counts
    assert nxc["rows"] == 3 and nxc["min_case"] == "b" and nxc["min"] == 0.5
    assert np.isclose(nxc["geomean"], (1.5 * 0.5 * 1.2) ** (1 / 3))
    assert nxc["at_least_1"] == 2 and nxc["at_least_1_3"] == 1 and nxc["roofline_pct"] == 90
    assert summary[("training", "f32", "NCX", 2)]["geomean"] == 4.0
    assert report.fair_summary([fake[3]]) == []


def test_plot_written(rows, tmp_path):
    pytest.importorskip("matplotlib")
    report.plot(rows[:8], str(tmp_path / "out.png"))
    assert (tmp_path / "out.png").stat().st_size > 0
    both = [r for r in rows if r.dtype == "f32" and r.formula in ("training", "forward")]
    report.plot(both, str(tmp_path / "both.png"))
    assert (tmp_path / "both.png").stat().st_size > 0


def test_a_wrong_result_fails_loudly(probe, monkeypatch):
    real = bnbw_native.batchnorm_training_backward

    def off_by_a_bit(*args, **kwargs):
        result = real(*args, **kwargs)
        result.diff_src.flat[0] += 1
        return result

    monkeypatch.setattr(bnbw_native, "batchnorm_training_backward", off_by_a_bit)
    run = runner.Runner(ONE_CALL, threads=[1], dtypes=["f32"], layouts=["NCX"],
                        formulas=["training"], peers=(), probe=probe, **quiet)
    with pytest.raises(checks.CheckFailed):
        run.run_shapes(TINY)


def test_bandwidth_probe_patterns_run(probe):
    bufs = probe.buffers(4096)
    for pattern in bandwidth.PROBE_BYTES_PER_ELEMENT:
        probe.kernel(pattern, bufs, 1)()
    bufs[0][:] = 2
    bufs[1][:] = 3
    probe.kernel("apply", bufs, 2)()          # c = 0.5 a + b
    assert np.all(bufs[2] == 4)


def test_process_memory_readings():
    before = procmem.status_bytes()
    if "VmRSS" not in before:
        pytest.skip("no /proc/self/status here")
    procmem.release_free_heap()
    assert isinstance(procmem.reset_rss_peak(), bool)
    block = np.ones(8 << 20, np.uint8)          # 8 MiB touched
    after = procmem.status_bytes()
    assert after["VmHWM"] >= after["VmRSS"] > 0 and block[-1] == 1


def test_split_times_both_phases(probe):
    run = runner.Runner(ONE_CALL, threads=[1], dtypes=["f32"], layouts=["NXC"],
                        formulas=["training", "frozen", "relu"], peers=(), probe=probe,
                        split=True, **quiet)
    training, frozen, relu = run.run_shapes(TINY)
    assert training.split["reduce_ms"] > 0 and training.split["apply_ms"] > 0
    assert relu.split["reduce_ms"] > 0
    assert frozen.split is None


def test_kernel_bodies_are_timed_side_by_side(probe):
    caps = ["portable", "avx512"]       # avx512 falls back on CPUs (or builds) without it
    run = runner.Runner(ONE_CALL, threads=[1], dtypes=["f32"], layouts=["NCX"],
                        formulas=["training"], peers=("numpy",), probe=probe, bodies=caps,
                        **quiet)
    first, second = run.run_shapes(ODD)
    assert (first.body_cap, second.body_cap) == tuple(caps)
    assert first.body == "portable" and second.body == runner.resolve_bodies(caps)["avx512"]
    assert first.vs_first_body == 1.0 and second.vs_first_body > 0
    assert first.numpy_ms == second.numpy_ms          # one measurement, one row per body
    assert _config.kernel_body() == runner.resolve_bodies([None])[None]   # cap restored


def test_command_line_quick_run(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bnbw_bench_run", BENCH / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    path = tmp_path / "r.json"
    status = run.main(["--quick", "--threads", "1", "--shapes", "tiny-2d", "--layouts", "NXC",
                       "--formulas", "training,relu-mask", "--json", str(path), "--plot", ""])
    assert status == 0
    printed = capsys.readouterr().out
    assert "xonednn" in printed and "xunfus" in printed
    results = json.loads(path.read_text())
    assert results["machine"]["kernel_body"] == _config.kernel_body()
    assert len(results["rows"]) == 2
    if peers.torch is not None:
        assert "xtorch-alloc" in printed and "torch peer: xtorch = " in printed
        described = results["torch_peer"]
        assert {"torch", "torch-alloc", "out_overload", "allocator"} <= set(described)
        assert ("torch_cache" in (described["allocator"] or "")) == (TORCH_CACHE is not None)
        assert [r["torch_peer"] is not None for r in results["rows"]] == [True, True]
    else:
        assert results["torch_peer"] is None
    assert ("onednn" in results["machine"]) == (ONEDNN is not None)


def test_half_training_table_times_every_dtype_and_layout():
    spec = importlib.util.spec_from_file_location("bnbw_bench_half", BENCH / "bench_half.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    times, keys = module.half_training_ratios((2, 3, 4, 5), rounds=2)
    assert keys[:2] == ["f32", "f16"]
    assert set(times) == {(layout, threads, key) for layout in ("NCX", "NXC")
                          for threads in (1, 2) for key in keys}
    assert all(t > 0 for t in times.values())


def test_measure_counts_events_per_timed_call():
    made = {"n": 0}

    def step(by):
        def call():
            made["n"] += by
        return call

    times = timing.measure({"two": step(2), "none": step(0)}, timing.Protocol(fixed_rounds=3),
                           subjects=("two", "none"), count=lambda: dict(made))
    assert times["two"]["per_call"] == {"n": 2.0}
    assert times["none"]["per_call"] == {"n": 0.0}
    assert timing.measure({"a": step(1)}, ONE_CALL, subjects=("a",))["a"].get("per_call") is None


@pytest.mark.skipif(TORCH_CACHE is None, reason=f"torch_cache: {torch_cache.why_absent}")
def test_torch_cache_hands_a_dropped_block_out_again():
    torch = peers.torch
    before = TORCH_CACHE.counts()
    assert TORCH_CACHE.on()
    try:
        first = torch.empty(1 << 20)
        where = first.data_ptr()
        del first
        again = torch.empty(1 << 20)
        assert again.data_ptr() == where
        counts = TORCH_CACHE.counts()
        assert counts["fresh"] == before["fresh"] + 1 and counts["reused"] >= before["reused"] + 1
    finally:
        TORCH_CACHE.off()
    after_off = TORCH_CACHE.counts()
    other = torch.empty(1 << 20)         # torch's own allocator again: not counted here
    assert TORCH_CACHE.counts()["fresh"] == after_off["fresh"]
    del again, other
    TORCH_CACHE.flush()
    assert TORCH_CACHE.counts()["waiting_blocks"] == 0


@pytest.mark.skipif(TORCH_CACHE is None, reason=f"torch_cache: {torch_cache.why_absent}")
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ASan's allocator maps and quarantines blocks its own way")
def test_fair_torch_peer_takes_no_new_pages_where_allocating_torch_does(probe):
    """dx above glibc's 32 MiB mmap ceiling: torch allocating it maps fresh pages on every call
    (so does the .out overload, which allocates and copies); with reused blocks the timed torch
    call, like ours and oneDNN's, faults on none of them."""
    shape = (1, 9, 1024, 1024)                  # 36 MiB per f32 tensor
    pages = 9 * 1024 * 1024 * 4 // 4096
    procmem.release_free_heap()
    run = runner.Runner(ONE_CALL, threads=[1], dtypes=["f32"], layouts=["NCX"],
                        formulas=["training"], peers=("torch", "torch-alloc", "onednn"),
                        probe=probe, **quiet)
    (row,) = run.run_shapes({"above-mmap-ceiling": shape})
    faults = row.faults_per_call
    assert faults["torch-alloc"] >= 1, faults
    assert faults["torch"] <= 0.01 * pages and faults["ours"] <= 0.01 * pages, faults
    if ONEDNN is not None:
        assert faults["onednn"] <= 0.01 * pages, faults
    assert row.torch_new_blocks_per_call == 0
    assert not any(note.startswith("torch faults") for note in row.notes)
    # the .out overload is no way around it: given out0, it still maps a fresh dx per call
    torch = peers.torch
    problem = cases.make_problem("above-mmap-ceiling", shape, "f32")
    X, DY = peers.torch_inputs((problem["x"], problem["dy"]), "NCX")
    C = shape[1]
    args = (DY, X, torch.from_numpy(problem["gamma"]), None, None,
            torch.from_numpy(problem["mean"]), torch.ones(C), True, cases.EPSILON, [True] * 3)
    out = (torch.empty_like(X), torch.empty(C), torch.empty(C))
    call = lambda: torch.ops.aten.native_batch_norm_backward.out(  # noqa: E731
        *args, out0=out[0], out1=out[1], out2=out[2])
    call()
    start = procmem.minor_faults()
    call()
    assert procmem.minor_faults() - start >= 1, "the .out overload no longer allocates: use it"


# ---- the compiled torch peer -----------------------------------------------------------------

def skip_without_compile():
    why = peers.compile_unavailable()
    if why:
        pytest.skip(why)


def test_compiled_torch_peer_is_timed_and_checked_when_asked_for(probe):
    """--peers torch-compiled: torch.compile of the torch column's ops, backward and forward,
    on a channels-last tiny case, compiled before the timing and checked like the other
    peers; not in the default list (a compilation per case and thread count)."""
    skip_without_compile()
    assert "torch-compiled" in runner.ALL_PEERS and "torch-compiled" not in runner.PEERS
    run = runner.Runner(ONE_CALL, threads=[1], dtypes=["f32"], layouts=["NXC"],
                        formulas=["training", "forward"], peers=("torch", "torch-compiled"),
                        probe=probe, **quiet)
    found = run.run_shapes(ODD)
    failed = [r.torch_compiled_error for r in found if r.torch_compiled_error]
    if failed:          # e.g. no C++ compiler for inductor: noted on the rows, the run went on
        assert all(r.check == "pass" and r.torch_compiled_ms is None for r in found)
        pytest.skip(f"torch.compile failed here: {failed[0]}")
    for row in found:
        assert row.check == "pass" and row.torch_compiled_compile_s > 0
        assert row.vs_torch_compiled == pytest.approx(row.torch_compiled_ms / row.ours_ms)
        assert worst(row.torch_compiled_err) <= checks.SEMANTICS_LIMIT
        assert "torch-compiled" in row.faults_per_call
    assert found[1].torch_compiled_err[1:3] == [None, None]     # forward: no running stats
    assert "torch-compiled" in run.torch_peer_info()
    # its column sits under its header
    at = run.table.header.index("xtorch-compiled")
    row = replace(found[0], vs_torch_compiled=12.5)
    assert run.table.row(row)[at:at + len("xtorch-compiled")].strip() == "12.50"


def test_a_failed_compilation_is_noted_once_per_case_and_the_run_goes_on(probe, monkeypatch):
    skip_without_compile()
    tried = []

    def fails(graph, args):
        tried.append(graph)
        raise RuntimeError("inductor could not build its kernel\n(the compiler's output)")

    monkeypatch.setattr(peers, "compiled_now", fails)
    printed = []
    run = runner.Runner(ONE_CALL, threads=[1, 2], dtypes=["f32"], layouts=["NCX"],
                        formulas=["training"], peers=("torch-compiled",), probe=probe,
                        echo=printed.append)
    found = run.run_shapes(TINY)
    assert len(tried) == 1                  # not again for the second thread count
    assert sum(line.startswith("NOTE: torch-compiled skipped") for line in printed) == 1
    for row in found:
        assert row.check == "pass" and row.torch_compiled_ms is None
        assert row.torch_compiled_error == "RuntimeError: inductor could not build its kernel"
        assert "torch-compiled failed: RuntimeError" in row.notes


# ---- the forward rows -----------------------------------------------------------------------

def test_forward_traffic_model_is_two_reads_and_one_write():
    """x read for the statistics, read again and y written: 3 passes of the storage dtype,
    12 B per f32 element, measured by a probe pattern of the same bytes."""
    for formula in cases.FORWARD_FORMULAS:
        assert cases.PASSES[formula] == 3 and cases.MASK_PASSES[formula] == 0
        assert cases.TENSORS[formula] == 2
        assert cases.PROBE_PATTERN[formula] == "forward"
        assert cases.traffic(formula, "NCX", 4, 1000) == (12000, 8000, 4000)
        assert cases.traffic(formula, "NXC", 2, 1000) == (6000, 4000, 2000)
        assert cases.traffic(formula, "strided", 4, 1000) == (24000, 16000, 8000)
    assert bandwidth.PROBE_BYTES_PER_ELEMENT["forward"] == 12
    assert cases.NUM_OUTPUTS["forward"] == len(cases.OUTPUT_NAMES["forward"]) == 5


def test_forward_probe_reads_then_writes(probe):
    bufs = probe.buffers(4096)
    bufs[0][:] = 2
    bufs[2][:] = 0
    probe.kernel("forward", bufs, 2)()           # a read-only pass, then c = 0.5 a
    assert np.all(bufs[2] == 1) and np.all(bufs[0] == 2)
    if probe.lib is not None:                      # the first pass really reads a
        assert probe.lib.bw_forward(bufs[0].ctypes.data, bufs[2].ctypes.data, bufs[0].size,
                                    1) == 2 * bufs[0].size


def test_forward_rows_check_dst_and_every_statistic(rows):
    forward = [r for r in rows if r.formula in cases.FORWARD_FORMULAS]
    assert len(forward) == len(cases.LAYOUTS) * len(cases.DTYPES) * 2 * 2
    for row in forward:
        assert row.check == "pass" and len(row.err) == 5
        tol_dst, tol_stats = checks.TOLERANCE[row.dtype]
        assert row.err[0] <= tol_dst and max(row.err[1:]) <= tol_stats
        itemsize = np.dtype(cases.DTYPES[row.dtype]).itemsize
        assert row.model_bytes == 3 * itemsize * row.elements * cases.STRIDE_FACTOR[row.layout]
        assert row.numpy_err is not None and None not in row.numpy_err
        if peers.torch is not None:
            # torch gives dst and the batch statistics; its running variance is unbiased and
            # its momentum the reverse of ours: not compared
            assert row.torch_err[1:3] == [None, None]
            assert None not in (row.torch_err[0], row.torch_err[3], row.torch_err[4])
            if row.formula == "forward-relu":
                assert row.unfused_err[0] <= tol_dst and row.vs_unfused > 0
        if ONEDNN is not None and row.onednn_err is not None:
            assert row.onednn_err[1:3] == [None, None] and row.onednn_err[0] is not None
    if ONEDNN is not None:
        # fuse_norm_relu on a tensor with gaps is declined, as for the backward
        declined = {r.onednn_impl for r in forward
                    if r.layout == "strided" and r.formula == "forward-relu"}
        assert declined == {"unsupported: fuse_norm_relu on a tensor with gaps"}
        dense_f32 = [r for r in forward if r.layout != "strided" and r.dtype == "f32"]
        assert all(r.onednn_ms > 0 and r.onednn_err[0] <= 10 * checks.TOLERANCE["f32"][0]
                   for r in dense_f32)


def test_forward_checks_use_the_forward_reference():
    """The reference the rows are checked against is the float64 forward with our momentum
    convention (the old statistics weighted by MOMENTUM) and the biased variance."""
    problem = cases.make_problem("odd", ODD["odd-4d"], "f32")
    x = problem["x"].astype(np.float64)
    ref = peers.reference_forward(problem["x"], problem["run_mean"], problem["run_var"],
                                  problem["gamma"], problem["beta"], epsilon=cases.EPSILON,
                                  momentum=cases.MOMENTUM, data_format="NCX")
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    assert np.allclose(ref[3], mean) and np.allclose(ref[4], var)
    m = cases.MOMENTUM
    assert np.allclose(ref[1], m * problem["run_mean"] + (1 - m) * mean)
    assert np.allclose(ref[2], m * problem["run_var"] + (1 - m) * var)


@pytest.mark.parametrize("which, how", [(0, "dst"), (2, "running_variance"),
                                        (3, "batch_mean"), (None, "momentum reversed")])
def test_a_wrong_forward_result_fails_loudly(probe, monkeypatch, which, how):
    real = bnbw_native.batchnorm_training_forward

    def wrong(*args, **kwargs):
        if which is None:              # torch's convention passed to ours: running stats off
            kwargs["momentum"] = 1 - kwargs["momentum"]
        result = real(*args, **kwargs)
        if which is not None:
            result[which].flat[0] += 1e-2 * (1 + abs(float(result[which].flat[0])))
        return result

    monkeypatch.setattr(bnbw_native, "batchnorm_training_forward", wrong)
    run = runner.Runner(ONE_CALL, threads=[1], dtypes=["f32"], layouts=["NXC"],
                        formulas=["forward"], peers=(), probe=probe, **quiet)
    with pytest.raises(checks.CheckFailed):
        run.run_shapes(ODD)
    assert run.rows == []


@pytest.mark.skipif(ONEDNN is None, reason=f"oneDNN: {onednn_peer.why_absent}")
def test_onednn_forward_writes_y_and_the_batch_statistics():
    problem = cases.make_problem("odd", ODD["odd-4d"], "f32")
    arrays = cases.layout_arrays(problem, "NXC")
    C = problem["shape"][1]
    out = (np.full_like(arrays["x"], np.nan), np.zeros(C, np.float32), np.zeros(C, np.float32))
    call = ONEDNN.forward(arrays["x"], problem["gamma"], problem["beta"], out,
                          epsilon=cases.EPSILON, data_format="NXC", relu=True)
    call()
    ref = peers.reference_forward(arrays["x"], problem["run_mean"], problem["run_var"],
                                  problem["gamma"], problem["beta"], epsilon=cases.EPSILON,
                                  momentum=cases.MOMENTUM, data_format="NXC", fuse_relu=True)
    assert np.allclose(out[0], ref[0], rtol=1e-5, atol=1e-5) and (out[0] >= 0).all()
    assert np.allclose(out[1], ref[3], rtol=1e-5, atol=1e-6)
    assert np.allclose(out[2], ref[4], rtol=1e-5, atol=1e-6)
    call.close()


@pytest.mark.skipif(TORCH_CACHE is None, reason=f"torch_cache: {torch_cache.why_absent}")
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ASan's allocator maps and quarantines blocks its own way")
def test_fair_torch_forward_takes_no_new_pages_where_allocating_torch_does(probe):
    """y above glibc's 32 MiB mmap ceiling: torch's forward allocating it maps fresh pages on
    every call; with reused blocks the timed torch forward (its ReLU in place too) faults on
    none of them, like ours and oneDNN's."""
    shape = (1, 9, 1024, 1024)                  # 36 MiB per f32 tensor
    pages = 9 * 1024 * 1024 * 4 // 4096
    procmem.release_free_heap()
    run = runner.Runner(ONE_CALL, threads=[1], dtypes=["f32"], layouts=["NCX", "NXC"],
                        formulas=["forward", "forward-relu"],
                        peers=("torch", "torch-alloc", "onednn"), probe=probe, **quiet)
    found = run.run_shapes({"above-mmap-ceiling": shape})
    assert [(r.layout, r.formula) for r in found] == [
        ("NCX", "forward"), ("NCX", "forward-relu"), ("NXC", "forward"),
        ("NXC", "forward-relu")]
    for row in found:
        faults = row.faults_per_call
        assert faults["torch-alloc"] >= 0.5 * pages, (row.layout, row.formula, faults)
        assert faults["torch"] <= 0.01 * pages and faults["ours"] <= 0.01 * pages, faults
        assert row.formula == "forward" or faults["unfused"] <= 0.01 * pages, faults
        if ONEDNN is not None:
            assert faults["onednn"] <= 0.01 * pages, faults
        assert row.torch_new_blocks_per_call == 0
        assert not any(note.startswith("torch faults") for note in row.notes)
        assert row.check == "pass" and row.err[0] <= checks.TOLERANCE["f32"][0]
    # unlike the backward's, the forward's .out overload is a kernel of its own that writes in
    # place (the JSON's torch_peer says so): the bench does not use it, but the claim holds
    torch = peers.torch
    problem = cases.make_problem("above-mmap-ceiling", shape, "f32")
    (X,) = peers.torch_inputs((problem["x"],), "NCX")
    C = shape[1]
    out = (torch.empty_like(X), torch.empty(C), torch.empty(C))
    call = lambda: torch.ops.aten.native_batch_norm.out(  # noqa: E731
        X, torch.ones(C), torch.zeros(C), torch.zeros(C), torch.ones(C), True, 0.1,
        cases.EPSILON, out=out[0], save_mean=out[1], save_invstd=out[2])
    call()
    start = procmem.minor_faults()
    result = call()
    assert procmem.minor_faults() - start <= 0.01 * pages
    assert result[0].data_ptr() == out[0].data_ptr()
    assert "writes into its out tensors" in run.torch_peer_info()["forward_out_overload"]


# ---- the layer rows -------------------------------------------------------------------------

needs_torch = pytest.mark.skipif(peers.torch is None, reason="torch is not importable")


@needs_torch
def test_layer_rows_pair_every_layer_in_both_formats():
    found = torch_layers.layer_rows(torch_layers.QUICK_SHAPES, [1], ONE_CALL)
    names = [name for name, _, _ in torch_layers.PAIRS]
    assert [(r.memory_format, r.layer) for r in found] == [
        (fmt, name) for fmt in torch_layers.FORMATS for name in names]
    for row in found:
        assert row.ours_ms > 0 and row.torch_ms > 0 and row.threads == 1
        assert row.vs_torch == pytest.approx(row.torch_ms / row.ours_ms)
        residual = {"residual.grad"} if row.layer == "BatchNormAddReLU" else set()
        assert set(row.err) == set(torch_layers.CHECKED) | residual
        assert max(row.err.values()) <= 1e-4, row.err
        assert set(row.faults_per_call) == {"ours", "torch"}
        assert row.ours_impl.endswith(" ours") and row.torch_impl == f"{row.layer} torch"
        line = torch_layers.format_row(row)
        assert row.layer in line and f"{row.vs_torch:7.2f}" in line
    # the in-place ReLU pair times ours once: the same measurement as BatchNormReLU's
    by = {(r.memory_format, r.layer): r for r in found}
    for fmt in torch_layers.FORMATS:
        assert by[fmt, "BatchNormReLU/inplace"].ours_ms == by[fmt, "BatchNormReLU"].ours_ms


@needs_torch
def test_a_layer_that_differs_from_torch_fails_loudly(monkeypatch):
    real = torch_layers.make_layers

    def off(channels):
        layers = real(channels)
        with peers.torch.no_grad():
            layers["BatchNorm ours"].weight.fill_(2.0)     # torch's weight stays 1
        return layers

    monkeypatch.setattr(torch_layers, "make_layers", off)
    with pytest.raises(checks.CheckFailed, match="BatchNorm"):
        torch_layers.layer_rows(torch_layers.QUICK_SHAPES, [1], ONE_CALL)


@needs_torch
def test_relu_flips_are_left_out_of_the_gradients_but_many_fail():
    # an element whose ReLU input rounds to 0 on one side only: its gradient is left out of
    # the comparison (and counted); a layer whose y is 0 where torch's is positive far more
    # often than rounding allows fails
    x, dy, residual = torch_layers.case_inputs((8, 16, 10, 10), "NCHW")
    layers = torch_layers.make_layers(16)
    ours, theirs = layers["BatchNormReLU ours"], layers["BatchNormReLU torch"]
    errs, flips = torch_layers.compare(ours, theirs, x, dy, residual)
    assert flips == 0 and max(errs.values()) < 1e-5
    with peers.torch.no_grad():
        ours.bias.fill_(-0.01)            # bn(x) within 0.01 above 0: 0 on our side only
    with pytest.raises(checks.CheckFailed, match="positive on one side only"):
        torch_layers.compare(ours, theirs, x, dy, residual)


def load_run_module():
    spec = importlib.util.spec_from_file_location("bnbw_bench_run", BENCH / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    return run


def test_command_line_forward_rows_and_layers(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch_layers, "SHAPES", torch_layers.QUICK_SHAPES)
    monkeypatch.setattr(timing, "FULL", ONE_CALL)
    run = load_run_module()
    path = tmp_path / "r.json"
    status = run.main(["--threads", "1", "--dtypes", "f32", "--shapes", "tiny-2d",
                       "--layouts", "NCX,strided", "--formulas", "forward,forward-relu",
                       "--layers", "--json", str(path), "--plot", str(tmp_path / "r.png")])
    assert status == 0
    printed = capsys.readouterr().out
    drawn = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "r.png").exists() == drawn
    assert ("not drawn: matplotlib is not installed" in printed) == (not drawn)
    assert "err dx|y" in printed and "forward and forward-relu 12" in printed
    assert " forward " in printed.replace("  ", " ") and "xunfus" in printed
    table = [line.split() for line in printed.splitlines() if line.startswith("tiny-2d")]
    assert [(t[1], t[3]) for t in table] == [("NCX", "forward"), ("NCX", "forward-relu"),
                                              ("strided", "forward"),
                                              ("strided", "forward-relu")]
    assert all(t[-1] == "pass" or "pass" in t for t in table)
    results = json.loads(path.read_text())
    model = results["traffic_model"]
    assert model["forward_bytes_per_f32_element"] == 12
    assert model["forward_relu_bytes_per_f32_element"] == 12
    assert model["probe_pattern"]["forward"] == "forward"
    assert results["err_outputs"]["forward"] == list(cases.OUTPUT_NAMES["forward"])
    assert results["forward_momentum"] == cases.MOMENTUM
    assert len(results["rows"]) == 4
    for row in results["rows"]:
        assert row["check"] == "pass" and len(row["err"]) == 5
        assert row["model_bytes"] == 12 * row["elements"] * (2 if row["layout"] == "strided"
                                                               else 1)
        assert {"ours", "probe"} <= set(row["faults_per_call"])
    assert any(e["formula"] == "forward" for e in results["bandwidth_per_class"])
    assert all("forward" in e for e in results["bandwidth"])        # the probe's column
    if peers.torch is not None:
        assert "layer rows" in printed and "BatchNormReLU/inplace" in printed
        assert len(results["layers"]) == 2 * len(torch_layers.PAIRS)
        assert {"layer", "vs_torch", "ours_ms", "torch_ms", "err",
                "faults_per_call"} <= set(results["layers"][0])
        assert "forward" in results["torch_peer"] and "relu_" in results["rows"][1]["torch_peer"]
    else:
        assert results["layers"] == []


@needs_torch
def test_command_line_layers_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch_layers, "SHAPES", torch_layers.QUICK_SHAPES)
    run = load_run_module()
    path = tmp_path / "l.json"
    assert run.main(["--quick", "--layers-only", "--threads", "1", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "layer rows" in printed and "bandwidth probes" not in printed
    results = json.loads(path.read_text())
    assert "rows" not in results and len(results["layers"]) == 2 * len(torch_layers.PAIRS)
    assert all(r["vs_torch"] > 0 for r in results["layers"])


def test_source_version_names_only_a_checkout_of_this_project(bench, tmp_path):
    """The benchmark's header names a git version only when bnbw_native was imported from a
    checkout of its own: a package installed into a virtual environment that lives inside
    another project's repository reported that project's version."""
    import shutil
    import subprocess
    if shutil.which("git") is None:       # (the aarch64 stage's Debian root has none)
        pytest.skip("git is not installed: the test makes git repositories")

    def tree(top, package_dir, pyproject):
        (package_dir / "bnbw_native").mkdir(parents=True)
        (package_dir / "bnbw_native" / "__init__.py").write_text("")
        if pyproject:
            (package_dir / "pyproject.toml").write_text('[project]\nname = "bnbw_native"\n')
        for cmd in (["init", "-q"], ["add", "-A"],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
            subprocess.run(["git", "-C", str(top), *cmd], check=True, capture_output=True)
        return str(package_dir / "bnbw_native" / "__init__.py")

    version = bench.machine.source_version
    checkout = tmp_path / "checkout"
    assert version(tree(checkout, checkout, True))                  # our checkout: named
    other = tmp_path / "other"                # our files one level down in another repository
    assert version(tree(other, other / "env", True)) is None
    plain = tmp_path / "plain"                # a repository without our pyproject.toml
    assert version(tree(plain, plain, False)) is None


def test_every_command_line_option_says_what_it_does():
    """`--help` of every script (bench/, examples/, bnbw-demo) describes each option: every
    add_argument call has a help text (bench/run.py's --layouts, --json and --plot had none)."""
    import ast
    root = BENCH.parent
    scripts = [*BENCH.glob("*.py"), *(root / "examples").glob("*.py"),
               root / "bnbw_native" / "demo.py"]
    bare = []
    for path in scripts:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"
                    and not any(k.arg == "help" for k in node.keywords)):
                bare.append(f"{path.name}:{node.lineno}")
    assert bare == []


def test_bench_readme_commands_run_against_the_installed_package():
    """bench/README's commands are those of an installed package (no PYTHONPATH=., which
    imports the checkout's unbuilt bnbw_native after `pip install .`), name scripts that exist
    and only options their parser knows."""
    import re
    import shlex
    text = (BENCH / "README.md").read_text()
    block = re.search(r"## Running.*?```bash\n(.*?)```", text, re.S).group(1)
    lines = block.replace("\\\n", " ").splitlines()
    options = {a for action in runner_parser()._actions for a in action.option_strings}
    for line in lines:
        words = shlex.split(line.split("#", 1)[0])
        assert not any(w.startswith("PYTHONPATH") for w in words), line
        if words[:1] == ["python"]:
            assert (BENCH.parent / words[1]).is_file(), line
            if words[1] == "bench/run.py":
                assert {w for w in words[2:] if w.startswith("--")} <= options, line


def runner_parser():
    spec = importlib.util.spec_from_file_location("bench_run_cli", BENCH / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parser()


def test_bench_imports_no_private_module_of_the_package():
    """The benchmark reaches the engine's knobs through bnbw_native.tuning, the one public
    door for them; a private module (bnbw_native._x) imported there would tie it to the
    engine's layout."""
    import ast
    private = []
    for path in BENCH.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            private += [f"{path.name}:{node.lineno} {n}" for n in names
                        if n.startswith("bnbw_native.") and n.split(".")[1].startswith("_")]
    assert private == []


def test_rows_from_memory_rotate_copies_and_check_against_torch():
    from_memory = bench_module("from_memory")
    calls = []
    run = from_memory.rotating(calls.append, 3)
    for _ in range(7):
        run()
    assert calls == [0, 1, 2, 0, 1, 2, 0]
    assert from_memory.copies_for(100, 1000) == 10
    assert from_memory.copies_for(100, 50) == 2
    assert from_memory.copies_for(1, 1e12) == from_memory.MAX_COPIES
    got = from_memory.rows(["odd-4d"], ["NCX", "NXC"], [1], ONE_CALL, budget=1 << 20)
    assert [(r["layout"], r["pass"]) for r in got] == [
        ("NCX", "forward"), ("NCX", "backward"), ("NXC", "forward"), ("NXC", "backward")]
    for r in got:
        assert r["copies"] >= 2 and r["ours_ms"] > 0
        if peers.torch is None:
            assert r["torch_ms"] is None and r["err"] is None
        else:
            assert r["torch_ms"] > 0 and r["err"] <= from_memory.TOLERANCE


def test_rows_from_memory_refuse_to_time_a_wrong_result(monkeypatch):
    pytest.importorskip("torch")
    from_memory = bench_module("from_memory")
    right = from_memory.ours

    def wrong(c, layout, threads):
        forward, backward = right(c, layout, threads)

        def spoiled(k):
            forward(k)
            c["out"][k][...] *= 1.01
        return spoiled, backward
    monkeypatch.setattr(from_memory, "ours", wrong)
    with pytest.raises(RuntimeError, match="differ by"):
        from_memory.rows(["odd-4d"], ["NCX"], [1], ONE_CALL, budget=1 << 20)
