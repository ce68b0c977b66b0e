"""bnbw-demo (bnbw_native.demo): the sizes it prints are the arrays' own, it checks our results
against the float64 reference (and fails when they disagree), and with PyTorch importable it
runs torch's CPU backward on the same arrays and reports its accuracy and time too.  Small
shapes stand in for the ResNet-50 ones so that the tests stay quick."""
import re

import numpy as np
import pytest

from bnbw_native import demo

SMALL = {"small-conv": (4, 8, 5, 6), "small-dense": (16, 8)}


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(demo, "DEMO_SHAPES", dict(SMALL))


def _rows(out):
    """The table's data rows, split into words."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(line)
    return rows


def test_the_demo_prints_the_real_shapes(small, capsys):
    assert demo.main(["--repeat", "1", "--no-torch"]) == 0
    out = capsys.readouterr().out
    assert "(N, C, H, W)" not in out and "(N, C)" not in out
    rows = _rows(out)
    assert len(rows) == 2 * len(SMALL)
    # each layout's row names the shape of the arrays it ran: (N, C, H, W) or (N, H, W, C)
    assert re.match(r"small-conv\s+NCX\s+\(4, 8, 5, 6\)\s", rows[0])
    assert re.match(r"small-conv\s+NXC\s+\(4, 5, 6, 8\)\s", rows[1])
    assert re.match(r"small-dense\s+NCX\s+\(16, 8\)\s", rows[2])
    assert "results agree with the float64 reference" in out
    assert "compared with the float64 reference only" in out
    assert "torch" not in out.split("-----")[0].splitlines()[-1]      # no torch columns


def test_the_demo_fails_when_a_result_is_wrong(small, capsys, monkeypatch):
    real = demo.batchnorm_training_backward

    def off_by_a_little(*args, out, **kwargs):
        real(*args, out=out, **kwargs)
        out[1][0] *= 1.001                          # diff_gamma of channel 0, 1e-3 relative
    monkeypatch.setattr(demo, "batchnorm_training_backward", off_by_a_little)
    assert demo.main(["--repeat", "1", "--no-torch"]) == 1
    assert "results DISAGREE with the float64 reference" in capsys.readouterr().out


def test_the_demo_compares_with_torch(small, capsys):
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    assert demo.main(["--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert torch.get_num_threads() == threads                  # the demo restores torch's count
    header = out.split("-----")[0].splitlines()[-1]
    assert header.count("torch ms") == len({1, demo.get_num_threads()})
    assert header.rstrip().endswith("torch err")
    for row in _rows(out):
        torch_err = float(row.split()[-1])
        assert 0 <= torch_err < 1e-4, row                       # float32 torch vs float64
    summary = re.search(r"PyTorch (\S+): aten\.native_batch_norm_backward on the same arrays, "
                        r"worst max-relative error (\S+);", out)
    assert summary and summary.group(1) == torch.__version__
    assert float(summary.group(2)) == max(float(r.split()[-1]) for r in _rows(out))


def test_torch_peer_sees_channels_last_as_the_same_memory():
    """The NXC case reaches torch as an (N, C, H, W) view of the same buffer, and its results
    come back in our layout: equal to the reference within float32 accuracy."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    x, dy, mean, var, gamma = demo.make_case((3, 4, 5, 6), "NXC", rng)
    peer = demo.TorchPeer(torch)
    peer.bind(x, dy, mean, var, gamma, "NXC")
    view = peer.args[1]
    assert x.shape == (3, 5, 6, 4) and tuple(view.shape) == (3, 4, 5, 6)
    assert view.data_ptr() == x.ctypes.data
    assert view.is_contiguous(memory_format=torch.channels_last)
    want = demo.reference(x, dy, mean, var, gamma, epsilon=demo.EPSILON, data_format="NXC")
    for got, ref in zip(peer.results(), want):
        assert got.shape == ref.shape
        assert demo.max_relative_error(got, ref) < 1e-5


def test_the_demo_says_when_the_machine_is_busy(small, capsys, monkeypatch):
    """A loaded machine made 2 threads 5-90x slower than 1 with no word: the demo reads the
    load average before it starts and says so, and says which cases ran slower on more
    threads."""
    assert demo.busy_note(0.1, 2, 2) is None                 # idle
    assert demo.busy_note(3.0, 4, 1) is None                 # one thread: nothing to fight for
    note = demo.busy_note(1.6, 2, 2)
    assert "busy" in note and "load average 1.60 over 2 CPUs" in note and "0.4 idle" in note
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (1.6, 1.0, 1.0))
    monkeypatch.setattr(demo, "get_num_threads", lambda: 2)
    calls = iter(range(10 ** 6))

    def timed(fn, repeat):       # per case: the reference, 1 thread, 2 threads (twice as long)
        fn()
        return 2.0 if next(calls) % 3 == 2 else 1.0
    monkeypatch.setattr(demo, "best_time", timed)
    assert demo.main(["--repeat", "1", "--no-torch"]) == 0
    out = capsys.readouterr().out
    assert "NOTE: this machine is busy (load average 1.60" in out
    assert "NOTE: 4 of 4 cases ran slower on 2 threads than on 1" in out, out
