"""C callers (contract 3.5): tests/surfaces/capi/example.c, compiled here against include/bnbw_native.h."""
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import bnbw_native
from bnbw_native import dml

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

from bnbw_native.reference import backward as BACKWARD
from error_bounds import assert_close

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = ROOT / "include"
EXAMPLE = Path(__file__).resolve().parent / "capi" / "example.c"
EPS = 1e-3
EPS32 = float(np.float32(EPS))
DATA_TYPE = {"float32": 1, "float16": 2, "bfloat16": 3}          # bnbw_data_type
OPERATOR = {"frozen": 1, "training": 2}                          # bnbw_operator_type
STATUS = {"OK": 0, "NULL_POINTER": 1, "DATA_TYPE": 2, "DIMENSION_COUNT": 3, "SIZES": 4,
          "STRIDES": 5, "TOTAL_SIZE": 6, "OVERLAP": 7, "EPSILON": 8, "NUM_THREADS": 9,
          "ALIGNMENT": 10, "OPERATOR_TYPE": 11, "OUT_OF_MEMORY": 12, "ADDRESS": 13}


def c_compiler():
    cc = os.environ.get("CC") or (sysconfig.get_config_var("CC") or "cc")
    return shutil.which(shlex.split(cc)[0]) or shutil.which("cc")


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """Build capi/example.c as the extension module bnbw_capi_example and import it."""
    if c_compiler() is None:
        pytest.skip("no C compiler found (set CC, or install cc/gcc/clang) to build the C API "
                    "example")
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    out = tmp_path_factory.mktemp("capi")
    ext = Extension("bnbw_capi_example", [str(EXAMPLE)], include_dirs=[str(INCLUDE)],
                    extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"],
                    libraries=["pthread"] if os.name == "posix" else [])
    dist = Distribution({"name": "bnbw_capi_example", "ext_modules": [ext]})
    cmd = build_ext(dist)
    cmd.build_lib = str(out)
    cmd.build_temp = str(out / "tmp")
    cmd.ensure_finalized()
    cmd.run()
    path = next(out.glob("bnbw_capi_example*"))
    spec = importlib.util.spec_from_file_location("bnbw_capi_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the walk-through ---------------------------------------------------------------------

def test_demo_matches_reference(example):
    n, c, h, w = 2, 3, 4, 5
    res = example.demo()
    assert res["version"] == bnbw_native.__version__

    def nchw(raw):         # NHWC memory, logical NCHW
        return np.frombuffer(raw, np.float32).reshape(n, h, w, c).transpose(0, 3, 1, 2)

    def stats(raw):
        return np.frombuffer(raw, np.float32).reshape(1, c, 1, 1)

    args = [a.astype(np.float64) for a in (nchw(res["x"]), nchw(res["dy"]), stats(res["mean"]),
                                          stats(res["variance"]), stats(res["scale"]))]
    for key, formula in (("grad", "frozen"), ("training_grad", "training")):
        want = BACKWARD(*args, epsilon=EPS32, reduce_axes=(0, 2, 3), formula=formula)
        dx, ds, db = res[key]
        for got, ref, what in zip((nchw(dx), stats(ds), stats(db)), want, ("dx", "ds", "db")):
            assert_close(got, ref, "float32", f"{key} {what}")


# ---- any layout, against the reference and bit for bit against the Python front-end ---------

LAYOUTS = {
    # name: (sizes, stats sizes, memory order outermost first, padding of the inner memory dim)
    "nchw": ((3, 4, 5, 6), (1, 4, 1, 1), (0, 1, 2, 3), 0),
    "nhwc-strided": ((3, 4, 5, 6), (1, 4, 1, 1), (0, 2, 3, 1), 0),
    "nhwc-padded": ((3, 4, 5, 6), (1, 4, 1, 1), (0, 2, 3, 1), 3),
    "stats-per-c-w": ((3, 4, 5, 6), (1, 4, 1, 6), (0, 1, 2, 3), 1),
    "stats-per-n": ((5, 4, 3, 2), (5, 1, 1, 1), (3, 2, 1, 0), 0),
    "no-reduced-dim": ((3, 4), (3, 4), (1, 0), 0),
    "one-dim": ((50,), (1,), (0,), 0),
}


def low(values, dtype_name):
    """values rounded to dtype_name, as an array of that dtype (uint16 bits for bfloat16) and as
    float64."""
    values = np.asarray(values, np.float32)
    if dtype_name == "float32":
        arr = values
    elif dtype_name == "float16":
        arr = values.astype(np.float16)
    elif ml_dtypes is not None:
        arr = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    else:
        bits = values.view(np.uint32).astype(np.uint64)
        arr = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return arr, to_f64(arr, dtype_name)


def to_f64(arr, dtype_name):
    if dtype_name == "bfloat16":
        return (np.asarray(arr, np.uint16).astype(np.uint32) << 16).view(np.float32) \
            .astype(np.float64)
    return np.asarray(arr).astype(np.float64)


def strided(values, order, pad):
    """(base, view): base contiguous memory laid out in `order` with padding, view = values."""
    perm = [values.shape[d] for d in order]
    perm[-1] += pad
    base = np.zeros(perm, values.dtype)
    view = base[tuple(slice(0, values.shape[d]) for d in order)]
    view[...] = values.transpose(order)
    return base, view.transpose(np.argsort(order))


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("formula", ["frozen", "training"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_run(example, layout, formula, dtype_name, in_place):
    sizes, stat_sizes, order, pad = LAYOUTS[layout]
    rng = np.random.default_rng(len(layout))
    x, x64 = low(rng.standard_normal(sizes) + 2, dtype_name)
    dy, dy64 = low(rng.standard_normal(sizes), dtype_name)
    mean, m64 = low(2 + 0.1 * rng.standard_normal(stat_sizes), dtype_name)
    var, v64 = low(1 + rng.random(stat_sizes), dtype_name)
    scale, g64 = low(rng.standard_normal(stat_sizes), dtype_name)
    (xb, xv), (dyb, dyv) = strided(x, order, pad), strided(dy, order, pad)
    itemsize = x.dtype.itemsize
    strides = tuple(s // itemsize for s in xv.strides)
    raw = example.run(OPERATOR[formula], DATA_TYPE[dtype_name], sizes, strides, stat_sizes,
                      xb.tobytes(), dyb.tobytes(), mean.tobytes(), var.tobytes(), scale.tobytes(),
                      EPS, 1, int(in_place))
    dx = np.lib.stride_tricks.as_strided(np.frombuffer(raw[0], x.dtype), sizes, xv.strides)
    ds, db = (np.frombuffer(r, x.dtype).reshape(stat_sizes) for r in raw[1:])
    want = BACKWARD(x64, dy64, m64, v64, g64, epsilon=EPS32, formula=formula,
                    reduce_axes=[d for d, s in enumerate(stat_sizes) if s == 1])
    for got, ref, what in zip((dx, ds, db), want, ("dx", "ds", "db")):
        assert_close(got, ref, dtype_name, what)       # bfloat16 as uint16 bits

    # the Python front-end runs the same engine on the same layout: the very same bits
    desc = dml.TensorDesc(dtype_name, sizes, strides)
    sdesc = dml.TensorDesc(dtype_name, stat_sizes)
    op = (dml.BatchNormalizationGrad if formula == "frozen" else
          dml.BatchNormalizationTrainingGrad)(
        input=desc, input_gradient=desc, mean=sdesc, variance=sdesc, scale=sdesc,
        output_gradient=desc, output_scale_gradient=sdesc, output_bias_gradient=sdesc,
        epsilon=EPS)
    py = [np.zeros_like(xb), np.zeros_like(mean), np.zeros_like(mean)]
    op.execute(input=xb, input_gradient=dyb, mean=mean, variance=var, scale=scale,
               output_gradient=py[0], output_scale_gradient=py[1], output_bias_gradient=py[2])
    assert bytes(memoryview(py[0]).cast("B"))[:len(raw[0])] == raw[0]
    assert py[1].tobytes() == raw[1] and py[2].tobytes() == raw[2]


def test_run_num_threads_bit_identical(example):
    sizes, stats = (8, 16, 24, 20), (1, 16, 1, 1)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(sizes) + 1).astype(np.float32)
    dy = rng.standard_normal(sizes).astype(np.float32)
    s = np.ones(stats, np.float32)
    runs = [example.run(2, 1, sizes, None, stats, x.tobytes(), dy.tobytes(), s.tobytes(),
                        s.tobytes(), s.tobytes(), EPS, n, 0) for n in (0, 1, 2, 3)]
    assert all(r == runs[0] for r in runs[1:])


def test_run_refusal_is_reported(example):
    with pytest.raises(ValueError, match="ERROR_SIZES: mean: sizes"):
        example.run(1, 1, (2, 3), None, (2, 2), bytes(24), bytes(24), bytes(16), bytes(16),
                    bytes(16), EPS, 1, 0)
    with pytest.raises(ValueError, match="ERROR_EPSILON: epsilon"):
        example.run(1, 1, (2, 3), None, (1, 3), bytes(24), bytes(24), bytes(12), bytes(12),
                    bytes(12), 0.0, 1, 0)


# ---- refused calls ------------------------------------------------------------------------

EXPECTED = {
    "create: desc NULL": ("NULL_POINTER", "desc"),
    "create: op NULL after refusal": ("OK", None),
    "create: out pointer NULL": ("NULL_POINTER", "op"),
    "create: operator type": ("OPERATOR_TYPE", "type"),
    "create: variance NULL": ("NULL_POINTER", "variance"),
    "create: input_gradient sizes NULL": ("NULL_POINTER", "input_gradient: sizes"),
    "create: input data type unknown": ("DATA_TYPE", "input: data_type"),
    "create: data types differ": ("DATA_TYPE", "mean: data_type float16 differs"),
    "create: output_gradient dimension count 0": ("DIMENSION_COUNT", "output_gradient: sizes"),
    "create: output_gradient dimension count 9": ("DIMENSION_COUNT", "output_gradient: sizes"),
    "create: mean size neither 1 nor input's": ("SIZES", "mean: sizes[2]"),
    "create: size 0": ("SIZES", "input: sizes[3] must be a positive integer"),
    "create: negative stride": ("STRIDES", "input: strides[1] must be non-negative"),
    "ok: broadcast input": ("OK", None),
    "create: output_gradient stride 0": ("OVERLAP", "output_gradient: strides[1] is 0"),
    "create: output_gradient overlapping strides": ("OVERLAP", "output_gradient: the strides"),
    "create: total size below minimum": ("TOTAL_SIZE", "mean: total_tensor_size_in_bytes"),
    "create: byte count overflow": ("SIZES", "input: sizes describe more than 2^63"),
    "create: epsilon 0": ("EPSILON", "epsilon"),
    "create: epsilon negative": ("EPSILON", "epsilon"),
    "create: epsilon NaN": ("EPSILON", "epsilon"),
    "create: epsilon inf": ("EPSILON", "epsilon"),
    "calc: sizes NULL": ("NULL_POINTER", "sizes is NULL"),
    "ok: create": ("OK", None),
    "execute: op NULL": ("NULL_POINTER", "op"),
    "execute: bindings NULL": ("NULL_POINTER", "bindings"),
    "execute: mean NULL": ("NULL_POINTER", "mean: the buffer pointer is NULL"),
    "execute: output_bias_gradient NULL": ("NULL_POINTER", "output_bias_gradient"),
    "execute: misaligned input": ("ALIGNMENT", "input: address"),
    "execute: negative num_threads": ("NUM_THREADS", "num_threads"),
    "execute: output_gradient overlaps input": ("OVERLAP", "output_gradient overlaps the input"),
    "execute: output_scale_gradient overlaps mean": ("OVERLAP",
                                                     "output_scale_gradient overlaps the input mean"),
    "execute: outputs overlap": ("OVERLAP", "output_scale_gradient overlaps output_bias_gradient"),
    "ok: execute": ("OK", None),
    "ok: execute in place": ("OK", None),
    "status name": ("OK", None),
}


@pytest.fixture(scope="module")
def refusals(example):
    cases = example.errors()
    assert cases[-1] == "ERROR_OVERLAP"           # status_name()
    return {name: (status, message) for name, status, message in cases[:-1]}


def test_every_case_ran(refusals):
    assert set(refusals) == set(EXPECTED)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_refusal(refusals, case):
    status, message = refusals[case]
    want_status, want_text = EXPECTED[case]
    assert status == STATUS[want_status], (case, status, message)
    if want_text is not None:
        assert want_text in message, message


def test_concurrent_executes(example):
    assert example.concurrent(4) is True


@pytest.mark.parametrize("lang", ["c", "c++"])
def test_header_alone_compiles(lang):
    """BNBW_NATIVE_NO_IMPORT gives the types without Python.h, in C and in C++."""
    compiler = c_compiler() if lang == "c" else (shutil.which("c++") or shutil.which("g++"))
    if compiler is None:
        pytest.skip(f"no {lang} compiler found")
    src = ('#define BNBW_NATIVE_NO_IMPORT\n#include "bnbw_native.h"\n'
           "int main(void) { bnbw_tensor_desc d = {BNBW_DATA_TYPE_FLOAT32, 1, 0, 0, 4};\n"
           "  return (int)d.dimension_count - 1 + (int)sizeof(bnbw_api_table) * 0; }\n")
    proc = subprocess.run([compiler, "-x", lang, "-fsyntax-only", "-Wall", "-Werror",
                           f"-I{INCLUDE}", "-"], input=src, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_header_with_python_compiles_quietly():
    """Including the header (with Python.h) and using nothing warns about nothing."""
    cc = c_compiler()
    if cc is None:
        pytest.skip("no C compiler found")
    src = '#include <Python.h>\n#include "bnbw_native.h"\nint f(void) { return 0; }\n'
    proc = subprocess.run([cc, "-x", "c", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
                           f"-I{INCLUDE}", f"-I{sysconfig.get_paths()['include']}", "-"],
                          input=src, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("desc, bindings, table", [
    ("bnbw_batch_normalization_grad_desc", "bnbw_bindings", "GRAD_TABLE"),
    ("bnbw_batch_normalization_training_desc", "bnbw_training_bindings", "TRAINING_TABLE")])
def test_structs_hold_the_member_table(desc, bindings, table):
    """_directml copies these structs as arrays of member pointers: every field, by name and
    type, is the member table's, in its order (the descriptors then epsilon and options)."""
    import re
    from bnbw_native import _directml
    header = (INCLUDE / "bnbw_native.h").read_text()

    def fields(struct):
        body = re.search(r"typedef struct %s \{(.*?)\}" % struct, header, re.S).group(1)
        return re.findall(r"^\s*([^;/]+?)\s*;", body, re.M)
    rows = getattr(_directml, table)
    members = [f"const bnbw_tensor_desc *{name}" for name, _, _ in rows]
    assert fields(desc)[:len(rows) + 1] == members + ["float epsilon"]
    assert fields(bindings) == [f"{'' if role == 'output' else 'const '}void *{name}"
                                for name, _, role in rows]


def test_capsule():
    from bnbw_native import _capi
    assert type(_capi._C_API).__name__ == "PyCapsule"
    assert "bnbw_native._capi._C_API" in repr(_capi._C_API)
    assert sys.modules["bnbw_native._capi"] is _capi


# ---- the training forward -------------------------------------------------------------------

TRAINING_EXPECTED = {
    "create: desc NULL": ("NULL_POINTER", "desc"),
    "create: out pointer NULL": ("NULL_POINTER", "op"),
    "create: mean NULL": ("NULL_POINTER", "mean: the tensor descriptor pointer is NULL"),
    "create: batch variance sizes": ("SIZES", "output_batch_variance: sizes[3] is 2"),
    "create: momentum above 1": ("EPSILON", "momentum must be finite and in [0, 1]"),
    "create: momentum NaN": ("EPSILON", "momentum"),
    "create: epsilon 0": ("EPSILON", "epsilon"),
    "create: op NULL after refusals": ("OK", None),
    "ok: create": ("OK", None),
    "ok: create gradient": ("OK", None),
    "execute: bindings NULL": ("NULL_POINTER", "bindings"),
    "execute: scale given to an operator made without it": ("NULL_POINTER",
                                                             "scale: the operator was made"),
    "execute: output_running_mean over variance": ("OVERLAP",
                                                   "output_running_mean overlaps the input "
                                                   "variance"),
    "execute: output overlaps input": ("OVERLAP", "output overlaps input"),
    "execute: a gradient operator": ("OPERATOR_TYPE", "run it with execute"),
    "execute: the training operator through execute": ("OPERATOR_TYPE", "execute_training"),
    "ok: execute": ("OK", None),
    "ok: execute in place": ("OK", None),
}


@pytest.fixture(scope="module")
def training_refusals(example):
    return {name: (status, message) for name, status, message in example.training_errors()}


def test_every_training_case_ran(training_refusals):
    assert set(training_refusals) == set(TRAINING_EXPECTED)


@pytest.mark.parametrize("case", sorted(TRAINING_EXPECTED))
def test_training_refusal(training_refusals, case):
    status, message = training_refusals[case]
    want_status, want_text = TRAINING_EXPECTED[case]
    assert status == STATUS[want_status], (case, status, message)
    if want_text is not None:
        assert want_text in message, message


def _nhwc(rng, N, C, H, W, dtype):
    """NCHW sizes over NHWC memory: the bytes, the element strides, the logical NCHW array."""
    x = (2 + rng.standard_normal((N, H, W, C))).astype(dtype)
    return x.tobytes(), (H * W * C, 1, W * C, C), x.transpose(0, 3, 1, 2)


@pytest.mark.parametrize("dtype_name", ["float32", "float16"]
                         + (["bfloat16"] if ml_dtypes is not None else []))
@pytest.mark.parametrize("affine", [True, False], ids=["scale-bias", "none"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in-place"])
def test_training_forward_through_c_equals_the_array_front_end(example, rng, dtype_name, affine,
                                                               in_place):
    """The C operator and bnbw_native.batchnorm_training_forward run the same engine: the same
    bits, on NCHW sizes over NHWC memory with DirectML-shaped statistics."""
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else np.dtype(dtype_name)
    N, C, H, W = 3, 5, 4, 6
    raw, strides, x = _nhwc(rng, N, C, H, W, dtype)
    stats = [a.astype(dtype) for a in (rng.standard_normal(C), 0.5 + rng.random(C),
                                       rng.standard_normal(C), rng.standard_normal(C))]
    if not affine:
        stats[2:] = [None, None]
    got = example.training(DATA_TYPE[dtype_name], (N, C, H, W), strides, (1, C, 1, 1), raw,
                           stats[0].tobytes(), stats[1].tobytes(),
                           None if stats[2] is None else stats[2].tobytes(),
                           None if stats[3] is None else stats[3].tobytes(), EPS, 0.75, 1, 2,
                           in_place)
    want = None
    if dtype_name != "float16":    # the array front-end takes f32 statistics with f16 data
        want = bnbw_native.batchnorm_training_forward(
            np.ascontiguousarray(x.transpose(0, 2, 3, 1)), *stats, epsilon=EPS, momentum=0.75,
            fuse_relu=True)
    y = np.frombuffer(got[0], dtype).reshape(N, H, W, C)
    c_stats = [np.frombuffer(b, dtype) for b in got[1:]]
    ref = bnbw_native.reference.forward(x, *(None if s is None else s.reshape(1, C, 1, 1)
                                             for s in stats), epsilon=EPS, momentum=0.75,
                                        reduce_axes=(0, 2, 3), relu=True)
    tol = {"float32": 3e-6, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype_name]
    assert np.allclose(y.transpose(0, 3, 1, 2).astype(np.float64), ref[0], rtol=tol, atol=tol)
    for g, r in zip(c_stats, ref[1:]):
        assert np.allclose(g.astype(np.float64), r.reshape(-1), rtol=tol, atol=tol * 1e-3)
    if want is not None:
        assert np.array_equal(y.view(np.uint8), want.dst.view(np.uint8))
        for g, w in zip(c_stats, want[1:]):
            assert np.array_equal(g.view(np.uint8), w.view(np.uint8))
