"""Hostile inputs (issue 26): what a hostile user did to an earlier commit, and what it must do now.

1. Out of memory for a plan's temporary: a MemoryError (C API: ERROR_OUT_OF_MEMORY) and the
   outputs as they were - it corrupted the heap.
2. ctypes pointer objects as DirectML buffers: a TypeError saying to pass the address as an int -
   their own 8 bytes were taken as the buffer.
3. Buffer addresses near the top of memory: a ValueError (C API: ERROR_ADDRESS) - the overlap
   check wrapped around 2^64 and the kernels ran into unmapped memory.
4. torch tensors with the negative bit: inputs are read as their values, outputs with it are
   refused - their raw memory (holding -x) was computed on.
5. bfloat16 torch tensors: accepted by every array front-end, as inputs and as `out=` written in
   place - they were refused.
6. backward_apply's negative count: the message names the value given.

Every refusal leaves the outputs as they were (each test fills them with a sentinel first).
Cases that crashed the interpreter run in a fresh one (tests/cext.py's run_python), so a crash
fails its test instead of ending the run.
"""
import ctypes
import json
import os
import re
import sys
import textwrap

import numpy as np
import pytest

import bnbw_native as bn
from bnbw_native import dml, intel_spec, ngraph, reference
from cext import build_extension, c_compiler, run_python
from error_bounds import BF16, assert_close

try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")
needs_bf16 = pytest.mark.skipif(BF16 is None, reason="bfloat16 arrays need ml_dtypes")
needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="reads /proc/self/status and sets RLIMIT_AS")

EPS = 1e-3
SENTINEL = 7.0
MEMBERS = dml.MEMBERS
OUTPUT_MEMBERS = MEMBERS[5:]


def isolated(code, tmp_path, *path, prelude="", env=None):
    """Run `prelude` then `code` (dedented) in a fresh interpreter, with `path` on its
    PYTHONPATH; returns the JSON object it printed last.  A crash (a signal, an abort from the
    allocator) fails the test with what the process said."""
    source = textwrap.dedent(prelude) + "\n" + textwrap.dedent(code)
    proc = run_python(["-c", source], *path, cwd=tmp_path, env=env)
    assert proc.returncode == 0, (f"the interpreter died (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def untouched(*arrays):
    return all(bool(np.all(np.asarray(a) == SENTINEL)) for a in arrays)


# ---- DirectML operands shared by defects 1 to 3 --------------------------------------------

def dml_case(n=4, c=3, w=2):
    """A training-grad operator over packed (n, c, w) float32 tensors, its eight buffers (outputs
    filled with the sentinel) and the reference results."""
    rng = np.random.default_rng(26)
    x = (rng.standard_normal((n, c, w)) + 2).astype(np.float32)
    dy = rng.standard_normal((n, c, w)).astype(np.float32)
    mean = x.astype(np.float64).mean(axis=(0, 2), keepdims=True).astype(np.float32)
    var = x.astype(np.float64).var(axis=(0, 2), keepdims=True).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, (1, c, 1)).astype(np.float32)
    big, stats = dml.TensorDesc("float32", (n, c, w)), dml.TensorDesc("float32", (1, c, 1))
    op = dml.BatchNormalizationTrainingGrad(
        input=big, input_gradient=big, mean=stats, variance=stats, scale=stats,
        output_gradient=big, output_scale_gradient=stats, output_bias_gradient=stats,
        epsilon=EPS)
    buffers = dict(zip(MEMBERS, (x, dy, mean, var, scale, np.full_like(x, SENTINEL),
                                 np.full_like(mean, SENTINEL), np.full_like(mean, SENTINEL))))
    want = reference.backward(x, dy, mean, var, scale, epsilon=EPS, reduce_axes=(0, 2))
    return op, buffers, want


# ---- a C caller of include/bnbw_native.h, built once ---------------------------------------

CAPI_SOURCE = r"""
/* A C caller for tests/surfaces/test_hostile_inputs.py: one operator, described from Python,
 * executed on raw addresses, reporting the status as the C API names it. */
#include <Python.h>
#include <stdint.h>
#include "bnbw_native.h"

static int read_dims(PyObject *seq, int64_t *out, uint32_t *count)
{
    Py_ssize_t n = PySequence_Length(seq), i;
    if (n < 0)
        return -1;
    if (n > BNBW_MAX_DIMENSIONS) {
        PyErr_SetString(PyExc_ValueError, "more than BNBW_MAX_DIMENSIONS dims");
        return -1;
    }
    for (i = 0; i < n; ++i) {
        PyObject *item = PySequence_GetItem(seq, i);
        if (item == NULL)
            return -1;
        out[i] = PyLong_AsLongLong(item);
        Py_DECREF(item);
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    *count = (uint32_t)n;
    return 0;
}

/* run(op_type, data_type, descs, addresses, epsilon, num_threads) -> (status name, message)
 * descs: 8 (sizes, strides or None) in member order; addresses: 8 ints. */
static PyObject *run(PyObject *self, PyObject *args)
{
    int op_type, data_type, num_threads, i;
    float epsilon;
    PyObject *descs, *addresses, *result;
    int64_t sizes[8][BNBW_MAX_DIMENSIONS], strides[8][BNBW_MAX_DIMENSIONS];
    bnbw_tensor_desc t[8];
    const void *ptr[8];
    bnbw_operator *op = NULL;
    bnbw_status st;
    if (!PyArg_ParseTuple(args, "iiOOfi", &op_type, &data_type, &descs, &addresses, &epsilon,
                          &num_threads))
        return NULL;
    if (bnbw_import() < 0)
        return NULL;
    if (PySequence_Length(descs) != 8 || PySequence_Length(addresses) != 8) {
        PyErr_SetString(PyExc_ValueError, "8 descriptors and 8 addresses, in member order");
        return NULL;
    }
    for (i = 0; i < 8; ++i) {
        PyObject *d = PySequence_GetItem(descs, i), *s = NULL, *st_obj = NULL, *a;
        uint32_t n = 0, ns = 0;
        unsigned long long address;
        int bad;
        if (d == NULL)
            return NULL;
        s = PySequence_GetItem(d, 0);
        st_obj = PySequence_GetItem(d, 1);
        Py_DECREF(d);
        bad = s == NULL || st_obj == NULL || read_dims(s, sizes[i], &n) < 0
              || (st_obj != Py_None && read_dims(st_obj, strides[i], &ns) < 0);
        t[i].data_type = (bnbw_data_type)data_type;
        t[i].dimension_count = n;
        t[i].sizes = sizes[i];
        t[i].strides = st_obj == Py_None ? NULL : strides[i];
        Py_XDECREF(s);
        Py_XDECREF(st_obj);
        if (bad)
            return NULL;
        st = bnbw_api->calc_buffer_tensor_size(t[i].data_type, n, t[i].sizes, t[i].strides, NULL,
                                               &t[i].total_tensor_size_in_bytes);
        if (st != BNBW_OK)
            return Py_BuildValue("(ss)", bnbw_api->status_name(st), bnbw_api->error_message());
        a = PySequence_GetItem(addresses, i);
        if (a == NULL)
            return NULL;
        address = PyLong_AsUnsignedLongLong(a);
        Py_DECREF(a);
        if (PyErr_Occurred())
            return NULL;
        ptr[i] = (const void *)(uintptr_t)address;
    }
    {
        bnbw_batch_normalization_grad_desc desc = {&t[0], &t[1], &t[2], &t[3], &t[4], &t[5],
                                                   &t[6], &t[7], epsilon};
        bnbw_bindings b = {ptr[0], ptr[1], ptr[2], ptr[3], ptr[4], (void *)ptr[5],
                           (void *)ptr[6], (void *)ptr[7]};
        Py_BEGIN_ALLOW_THREADS
        st = bnbw_api->create_operator((bnbw_operator_type)op_type, &desc, &op);
        if (st == BNBW_OK)
            st = bnbw_api->execute(op, &b, num_threads);
        Py_END_ALLOW_THREADS
    }
    result = Py_BuildValue("(ss)", bnbw_api->status_name(st),
                           st == BNBW_OK ? "" : bnbw_api->error_message());
    bnbw_api->destroy_operator(op);
    return result;
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS, "Build and execute one operator on raw addresses."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hostile_capi", NULL, -1, methods};

PyMODINIT_FUNC PyInit_hostile_capi(void) { return PyModule_Create(&module); }
"""

TRAINING_GRAD = 2           # BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD
FLOAT32 = 1                 # BNBW_DATA_TYPE_FLOAT32


@pytest.fixture(scope="module")
def capi(tmp_path_factory):
    """The directory holding the built C caller `hostile_capi` (for a subprocess's path)."""
    if c_compiler() is None:
        pytest.skip("no C compiler found to build a C API caller")
    out = tmp_path_factory.mktemp("hostile_capi")
    source = out / "hostile_capi.c"
    source.write_text(CAPI_SOURCE)
    build_extension("hostile_capi", [source], out)
    return out


# =============================================================================================
# 1. Out of memory for a temporary
# =============================================================================================
#
# A plan that writes dx through a temporary laid out like x (dx in another memory order than x
# and dy) allocates it inside the engine, and so does one reading relu_dst in another order.
# The process's address space is capped at what it maps now plus a headroom: the 16 MiB
# temporary cannot be had, everything else can - the same call with every operand in x's order
# runs under the same cap.  A fixed mmap threshold makes glibc return every large block to the
# system when freed, so the cap measures what is really in use.

OOM_ENV = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}

OOM_PRELUDE = """
import json, resource
import numpy as np

def cap_memory(headroom_mib=4):           # a temporary needs 16 MiB
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            used = int(line.split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (used + (headroom_mib << 20), resource.RLIM_INFINITY))

def uncap_memory():
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

N, H, W, C = 64, 32, 32, 64                        # 4 Mi elements: 16 MiB in float32
rng = np.random.default_rng(1)
x = (rng.standard_normal((N, H, W, C), dtype=np.float32) + 1)       # NXC memory
dy = rng.standard_normal((N, H, W, C), dtype=np.float32)
mean = x.mean(axis=(0, 1, 2), dtype=np.float64).astype(np.float32)
var = x.var(axis=(0, 1, 2), dtype=np.float64).astype(np.float32)
gamma = rng.uniform(0.5, 1.5, C).astype(np.float32)

def sentinels(*shapes):
    return [np.full(s, 7.0, np.float32) for s in shapes]

def untouched(*arrays):
    return all(bool((a == 7.0).all()) for a in arrays)
"""


@needs_linux
@pytest.mark.parametrize("relu_dst,headroom_mib", [
    pytest.param(None, 4, id="dx"),
    pytest.param("channels-first", 4, id="dx-then-relu_dst"),
    # room for dx's temporary, not for relu_dst's: the one allocated must be freed, unwritten
    pytest.param("channels-first", 20, id="relu_dst-after-dx"),
])
def test_out_of_memory_for_a_temporary_array_call(tmp_path, relu_dst, headroom_mib):
    got = isolated(f"""
    import bnbw_native as bn
    kw = dict(epsilon=1e-3, num_threads=1)
    y = None
    if {relu_dst!r} == "channels-first":       # the forward's output, in another order than x
        y = np.ascontiguousarray(x.transpose(0, 3, 1, 2)).transpose(0, 2, 3, 1)
    kw["relu_dst"] = y
    first, dg, db = sentinels((N, C, H, W), C, C)
    dx = first.transpose(0, 2, 3, 1)       # channels-first memory seen as NXC: via a temporary
    same_order = sentinels((N, H, W, C), C, C)
    y_same_order = None if y is None else np.ascontiguousarray(y)
    cap_memory({headroom_mib})              # from here to uncap_memory(): the calls only
    try:
        bn.batchnorm_training_backward(x, dy, mean, var, gamma, out=(dx, dg, db), **kw)
        error = None
    except MemoryError as exc:
        error = str(exc)
    try:
        bn.batchnorm_training_backward(x, dy, mean, var, gamma, out=same_order,
                                       **dict(kw, relu_dst=y_same_order))
        control_error = None
    except MemoryError as exc:
        control_error = str(exc)
    uncap_memory()
    res = dict(error=error, control_error=control_error, untouched=untouched(dx, dg, db))
    want = bn.batchnorm_training_backward(x, dy, mean, var, gamma, **kw)
    res["same_order_runs"] = all(np.array_equal(a, b) for a, b in zip(same_order, want))
    bn.batchnorm_training_backward(x, dy, mean, var, gamma, out=(dx, dg, db), **kw)
    res["runs_uncapped"] = all(np.array_equal(a, b) for a, b in zip((dx, dg, db), want))
    print(json.dumps(res))
    """, tmp_path, env=OOM_ENV, prelude=OOM_PRELUDE)
    assert got["error"] is not None and "out of memory" in got["error"], got
    assert got["untouched"], "a call refused for want of memory wrote its outputs"
    assert got["control_error"] is None, "the cap left no room for the call itself"
    assert got["same_order_runs"]
    assert got["runs_uncapped"]


DML_OOM = OOM_PRELUDE + """
import bnbw_native as bn
from bnbw_native import dml
nhwc = dml.TensorDesc("float32", (N, C, H, W), strides=(H * W * C, 1, W * C, C))
nchw = dml.TensorDesc("float32", (N, C, H, W))
stats = dml.TensorDesc("float32", (1, C, 1, 1))

def operator(out_desc):
    return dml.BatchNormalizationTrainingGrad(
        input=nhwc, input_gradient=nhwc, mean=stats, variance=stats, scale=stats,
        output_gradient=out_desc, output_scale_gradient=stats, output_bias_gradient=stats,
        epsilon=1e-3)
"""


@needs_linux
def test_out_of_memory_for_a_temporary_directml_operator(tmp_path):
    got = isolated("""
    via_temp, direct = operator(nchw), operator(nhwc)
    inputs = dict(input=x, input_gradient=dy, mean=mean, variance=var, scale=gamma)
    dx, dg, db = sentinels((N, C, H, W), C, C)
    again = sentinels((N, H, W, C), C, C)
    cap_memory()                             # from here to uncap_memory(): the calls only
    try:
        via_temp.execute(**inputs, output_gradient=dx, output_scale_gradient=dg,
                         output_bias_gradient=db, num_threads=1)
        error = None
    except MemoryError as exc:
        error = str(exc)
    try:
        direct.execute(**inputs, output_gradient=again[0], output_scale_gradient=again[1],
                       output_bias_gradient=again[2], num_threads=1)
        control_error = None
    except MemoryError as exc:
        control_error = str(exc)
    uncap_memory()
    res = dict(error=error, control_error=control_error, untouched=untouched(dx, dg, db))
    want = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3)
    res["same_order_runs"] = all(np.array_equal(a, b.reshape(a.shape)) for a, b in zip(again, want))
    via_temp.execute(**inputs, output_gradient=dx, output_scale_gradient=dg,
                     output_bias_gradient=db, num_threads=1)
    res["runs_uncapped"] = (np.array_equal(dx.transpose(0, 2, 3, 1), want[0])
                            and np.array_equal(dg, want[1]) and np.array_equal(db, want[2]))
    print(json.dumps(res))
    """, tmp_path, env=OOM_ENV, prelude=DML_OOM)
    assert got["error"] is not None and "out of memory" in got["error"], got
    assert got["untouched"], "a call refused for want of memory wrote its outputs"
    assert got["control_error"] is None, "the cap left no room for the call itself"
    assert got["same_order_runs"]
    assert got["runs_uncapped"]


@needs_linux
def test_out_of_memory_for_a_temporary_c_api(tmp_path, capi):
    got = isolated("""
    import bnbw_native._capi              # what bnbw_import() loads: before the cap
    import hostile_capi
    nhwc = ((N, C, H, W), (H * W * C, 1, W * C, C))
    nchw = ((N, C, H, W), None)
    stats = ((1, C, 1, 1), None)

    def run(out_desc, outputs):
        descs = [nhwc, nhwc, stats, stats, stats, out_desc, stats, stats]
        arrays = [x, dy, mean, var, gamma, *outputs]
        addresses = [a.__array_interface__["data"][0] for a in arrays]
        return hostile_capi.run(2, 1, descs, addresses, 1e-3, 1)

    dx, dg, db = sentinels((N, C, H, W), C, C)
    again = sentinels((N, H, W, C), C, C)
    cap_memory()                             # from here to uncap_memory(): the calls only
    status, message = run(nchw, (dx, dg, db))
    same_order = run(nhwc, again)
    uncap_memory()
    res = dict(status=status, message=message, same_order=same_order[0],
               untouched=untouched(dx, dg, db))
    want = bnbw_native.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=1e-3)
    res["same_order_runs"] = all(np.array_equal(a, b) for a, b in zip(again, want))
    res["uncapped"] = run(nchw, (dx, dg, db))[0]
    res["runs_uncapped"] = (np.array_equal(dx.transpose(0, 2, 3, 1), want[0])
                            and np.array_equal(dg, want[1]) and np.array_equal(db, want[2]))
    print(json.dumps(res))
    """, tmp_path, capi, env=OOM_ENV, prelude=OOM_PRELUDE)
    assert got["status"] == "ERROR_OUT_OF_MEMORY", got
    assert "out of memory" in got["message"]
    assert got["untouched"], "a call refused for want of memory wrote its outputs"
    assert got["same_order"] == "OK" and got["same_order_runs"], got
    assert got["uncapped"] == "OK" and got["runs_uncapped"], got


# =============================================================================================
# 2. ctypes pointer objects are not buffers
# =============================================================================================
#
# A ctypes pointer exports its own 8 bytes through the buffer protocol.  The statistics here
# are 2 float32 (8 bytes, a pointer's size), so no size check can tell them apart from memory.

POINTER_KINDS = {
    "c_void_p": lambda addr: ctypes.c_void_p(addr),
    "POINTER(c_float)": lambda addr: ctypes.cast(addr, ctypes.POINTER(ctypes.c_float)),
    "c_char_p": lambda addr: ctypes.c_char_p(addr),
    "CFUNCTYPE": lambda addr: ctypes.CFUNCTYPE(None)(addr),
}


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("kind", sorted(POINTER_KINDS))
def test_ctypes_pointer_objects_are_refused_as_buffers(kind, member):
    op, buffers, want = dml_case(n=3, c=2, w=2)
    target = buffers[member]
    pointer = POINTER_KINDS[kind](target.ctypes.data)
    own_bytes = bytes(memoryview(pointer).cast("B"))
    target_before = target.copy()
    bound = dict(buffers, **{member: pointer})
    with pytest.raises(TypeError, match=rf"^{member}: .*pointer object.*address as an int.*"
                                        r"ptr\.value"):
        op.execute(**bound)
    assert bytes(memoryview(pointer).cast("B")) == own_bytes, "the pointer's own bytes changed"
    assert np.array_equal(target, target_before, equal_nan=True)
    assert untouched(*(buffers[m] for m in OUTPUT_MEMBERS))
    # what the message says to do works: the address as an int
    op.execute(**dict(buffers, **{member: target.ctypes.data}))
    for m, w in zip(OUTPUT_MEMBERS, want):
        assert_close(buffers[m], w, "float32", m)


# =============================================================================================
# 3. Addresses near the top of memory
# =============================================================================================
#
# 2**64 - 8 is aligned for every item size, and every buffer here is longer than 8 bytes: each
# would run past the end of the address space.  The old overlap check added the size to the
# address, wrapped, passed, and the kernels then read or wrote there (SIGSEGV).

TOP = 2 ** 64 - 8

DML_PRELUDE = """
import json
import numpy as np
from bnbw_native import dml
n, c, w = 4, 3, 2
big, stats = dml.TensorDesc("float32", (n, c, w)), dml.TensorDesc("float32", (1, c, 1))
op = dml.BatchNormalizationTrainingGrad(
    input=big, input_gradient=big, mean=stats, variance=stats, scale=stats,
    output_gradient=big, output_scale_gradient=stats, output_bias_gradient=stats, epsilon=1e-3)
x = np.linspace(-2, 3, n * c * w, dtype=np.float32).reshape(n, c, w)
ones = np.ones((1, c, 1), np.float32)
outputs = [np.full((n, c, w), 7.0, np.float32), np.full((1, c, 1), 7.0, np.float32),
           np.full((1, c, 1), 7.0, np.float32)]
buffers = dict(zip(dml.MEMBERS, [x, x.copy(), ones * 0.5, ones, ones, *outputs]))
"""


@pytest.mark.parametrize("member", MEMBERS)
def test_address_near_the_top_of_memory_is_refused(tmp_path, member):
    got = isolated(f"""
    buffers[{member!r}] = {TOP}
    try:
        op.execute(**buffers)
        error = None
    except ValueError as exc:
        error = str(exc)
    print(json.dumps(dict(error=error, untouched=all(bool((o == 7).all()) for o in outputs))))
    """, tmp_path, prelude=DML_PRELUDE)
    assert got["error"] is not None, "an address running past 2**64 was accepted"
    assert re.match(rf"{member}: .*runs past the end of the address space", got["error"]), got
    assert got["untouched"]


def test_buffers_ending_at_the_top_of_memory_still_meet_the_overlap_check(tmp_path):
    # mean and output_scale_gradient: 12 bytes each, both ending exactly at 2**64 (their end
    # wraps to 0 in 64 bits): they overlap, and the call is refused before touching either
    top = 2 ** 64 - 12
    got = isolated(f"""
    buffers.update(mean={top}, output_scale_gradient={top})
    try:
        op.execute(**buffers)
        error = None
    except ValueError as exc:
        error = str(exc)
    print(json.dumps(dict(error=error, untouched=all(bool((o == 7).all()) for o in outputs))))
    """, tmp_path, prelude=DML_PRELUDE)
    assert got["error"] is not None and "output_scale_gradient overlaps" in got["error"], got
    assert got["untouched"]


CAPI_PRELUDE = DML_PRELUDE + """
import hostile_capi
descs = [((n, c, w), None)] * 2 + [((1, c, 1), None)] * 3 + [((n, c, w), None)] \
        + [((1, c, 1), None)] * 2
addresses = [a.__array_interface__["data"][0] for a in buffers.values()]
"""


@pytest.mark.parametrize("member", MEMBERS)
def test_address_near_the_top_of_memory_is_refused_c_api(tmp_path, capi, member):
    got = isolated(f"""
    addresses[{MEMBERS.index(member)}] = {TOP}
    status, message = hostile_capi.run(2, 1, descs, addresses, 1e-3, 1)
    print(json.dumps(dict(status=status, message=message,
                          untouched=all(bool((o == 7).all()) for o in outputs))))
    """, tmp_path, capi, prelude=CAPI_PRELUDE)
    assert got["status"] == "ERROR_ADDRESS", got
    assert got["message"].startswith(f"{member}: ") and "address space" in got["message"], got
    assert got["untouched"]


def test_c_api_runs_on_these_buffers(tmp_path, capi):
    # the control of the two tests above: the same buffers at their own addresses give the
    # reference result through the C caller
    got = isolated("""
    status, message = hostile_capi.run(2, 1, descs, addresses, 1e-3, 1)
    print(json.dumps(dict(status=status, outputs=[o.ravel().tolist() for o in outputs])))
    """, tmp_path, capi, prelude=CAPI_PRELUDE)
    assert got["status"] == "OK"
    n, c, w = 4, 3, 2
    x = np.linspace(-2, 3, n * c * w, dtype=np.float32).reshape(n, c, w)
    ones = np.ones((1, c, 1), np.float32)
    want = reference.backward(x, x, ones * 0.5, ones, ones, epsilon=EPS, reduce_axes=(0, 2))
    for got_values, ref, what in zip(got["outputs"], want, OUTPUT_MEMBERS):
        assert_close(np.array(got_values, np.float32).reshape(ref.shape), ref, "float32", what)


# =============================================================================================
# Torch tensors: shared data
# =============================================================================================

def tensors(seed=0, n=6, c=5, h=4, w=3):
    """x, dy (NCHW float32 tensors) and float32 statistics of x, gamma, beta (length C)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g) * 2 + 1
    dy = torch.randn(n, c, h, w, generator=g)
    x64 = x.double()
    mean = x64.mean(dim=(0, 2, 3)).float()
    var = x64.var(dim=(0, 2, 3), unbiased=False).float()
    gamma = torch.rand(c, generator=g) + 0.5
    beta = torch.randn(c, generator=g)
    return x, dy, mean, var, gamma, beta


def values(t):
    """A tensor's logical values as float64 NumPy (through torch, which resolves every bit)."""
    return t.detach().resolve_neg().resolve_conj().double().numpy()


def ref_ncx(x, dy, mean, var, gamma):
    return reference.batchnorm_training_backward(values(x), values(dy), values(mean),
                                                 values(var), values(gamma), epsilon=EPS,
                                                 data_format="NCX")


def dml_ref(x, dy, mean, var, scale, formula):
    return reference.backward(values(x), values(dy), values(mean), values(var), values(scale),
                              epsilon=EPS, reduce_axes=(0, 2, 3), formula=formula)


def nchw_stats(t):
    """A length-C tensor in DirectML's (1, C, 1, 1) layout."""
    return t.reshape(1, -1, 1, 1)


# =============================================================================================
# 4. The negative bit
# =============================================================================================

def negative_bit(t):
    """A tensor equal to t whose memory holds -t: the imaginary part of a conjugated complex
    tensor carries the negative bit."""
    v = torch.complex(torch.zeros_like(t), -t).conj().imag
    assert v.is_neg() and torch.equal(v, t)
    return v


@needs_torch
def test_negative_bit_tensors_hold_the_negation_in_memory():
    # what makes these tests matter: DLPack exports the raw memory, which holds -x
    x = tensors()[0]
    raw = np.from_dlpack(negative_bit(x))
    assert np.array_equal(raw, -x.numpy())
    with pytest.raises(RuntimeError, match="negative bit"):
        negative_bit(x).numpy()           # torch's own NumPy export refuses them


def all_negative(*ts):
    return [negative_bit(t) for t in ts]


NEG_FRONT_ENDS = ["onednn_graph", "intel_spec", "ngraph", "two_phase", "dml_grad",
                  "dml_training_grad"]


def call_front_end(name, x, dy, mean, var, gamma, beta, partial=None, out=None):
    """One front-end on NCX tensors; returns (results, reference of the values)."""
    if name == "onednn_graph":
        got = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                             data_format="NCX", out=out)
    elif name == "intel_spec":
        got = intel_spec.batch_norm_training_backprop(x, dy, mean, var, gamma, epsilon=EPS,
                                                      data_format="NCX", out=out)
    elif name == "ngraph":
        got = ngraph.batch_norm_training_backprop(x, gamma, beta, mean, var, dy, epsilon=EPS,
                                                  out=out)
    elif name == "two_phase":
        if partial is None:
            partial, _ = bn.backward_reduce(x, dy, mean, data_format="NCX")
        count = x.shape[0] * x.shape[2] * x.shape[3]
        got = bn.backward_apply(x, dy, mean, var, gamma, partial, count, epsilon=EPS,
                                data_format="NCX", out=out)
    else:
        f = (dml.batch_normalization_grad if name == "dml_grad"
             else dml.batch_normalization_training_grad)
        got = f(x, dy, nchw_stats(mean), nchw_stats(var), nchw_stats(gamma), EPS)
        want = dml_ref(x, dy, nchw_stats(mean), nchw_stats(var), nchw_stats(gamma),
                       "frozen" if name == "dml_grad" else "training")
        return got, want
    return got, ref_ncx(x, dy, mean, var, gamma)


@needs_torch
@pytest.mark.parametrize("front_end", NEG_FRONT_ENDS)
def test_negative_bit_inputs_are_read_as_their_values(front_end):
    x, dy, mean, var, gamma, beta = tensors()
    # mean is positive: read as raw memory, -mean would move every centred value
    args = all_negative(x, dy, mean, var, gamma, beta)
    got, want = call_front_end(front_end, *args)
    for g, w, what in zip(got, want, ("dx", "dscale", "dbias")):
        assert_close(g, w, "float32", f"{front_end} {what}")


@needs_torch
def test_negative_bit_partial_sums_are_read_as_their_values():
    x, dy, mean, var, gamma, beta = tensors()
    partial, _ = bn.backward_reduce(x, dy, mean, data_format="NCX")
    got, want = call_front_end("two_phase", x, dy, mean, var, gamma, beta,
                               partial=negative_bit(torch.from_numpy(partial)))
    for g, w, what in zip(got, want, ("diff_src", "diff_gamma", "diff_beta")):
        assert_close(g, w, "float32", what)


@needs_torch
def test_negative_bit_relu_dst_is_read_as_its_values():
    # the forward's output y: read as raw memory, its sign (and so the mask) would flip
    x, dy, mean, var, gamma, _ = tensors()
    y = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    got = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                         data_format="NCX", relu_dst=negative_bit(y))
    want = ref_ncx(x, dy * (y > 0), mean, var, gamma)
    for g, w, what in zip(got, want, ("diff_src", "diff_gamma", "diff_beta")):
        assert_close(g, w, "float32", what)


NEG_OUT_CALLS = {
    "onednn_graph": (lambda a, out: bn.batchnorm_training_backward(
        *a[:5], epsilon=EPS, data_format="NCX", out=out), ("diff_src", "diff_gamma", "diff_beta")),
    "intel_spec": (lambda a, out: intel_spec.batch_norm_training_backprop(
        *a[:5], epsilon=EPS, data_format="NCX", out=out),
        ("input_delta", "gamma_delta", "beta_delta")),
    "ngraph": (lambda a, out: ngraph.batch_norm_training_backprop(
        a[0], a[4], a[5], a[2], a[3], a[1], epsilon=EPS, out=out),
        ("input_delta", "gamma_delta", "beta_delta")),
    "two_phase": (lambda a, out: bn.backward_apply(
        *a[:5], bn.backward_reduce(a[0], a[1], a[2], data_format="NCX")[0],
        a[0].numel() // a[0].shape[1], epsilon=EPS, data_format="NCX", out=out),
        ("diff_src", "diff_gamma", "diff_beta")),
}


@needs_torch
@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("front_end", sorted(NEG_OUT_CALLS))
def test_negative_bit_output_is_refused(front_end, position):
    args = tensors()
    x = args[0]
    call, names = NEG_OUT_CALLS[front_end]
    out = [torch.full_like(x, SENTINEL), torch.full((x.shape[1],), SENTINEL),
           torch.full((x.shape[1],), SENTINEL)]
    out[position] = negative_bit(out[position])
    with pytest.raises(ValueError, match=rf"out\[{position}\] \({names[position]}\) is a "
                                         r"tensor with the negative bit set"):
        call(args, tuple(out))
    assert all(bool((t == SENTINEL).all()) for t in out), "a refused call wrote an output"


@needs_torch
def test_negative_bit_diff_residual_is_refused():
    x, dy, mean, var, gamma, _ = tensors()
    dres = negative_bit(torch.full_like(x, SENTINEL))
    out = (torch.full_like(x, SENTINEL), torch.full((5,), SENTINEL), torch.full((5,), SENTINEL))
    with pytest.raises(ValueError, match=r"diff_residual is a tensor with the negative bit"):
        bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS, data_format="NCX",
                                       relu_dst=x, diff_residual=dres, out=out)
    assert bool((dres == SENTINEL).all())
    assert all(bool((t == SENTINEL).all()) for t in out)


# =============================================================================================
# 5. bfloat16 torch tensors
# =============================================================================================

def address(a):
    return a.data_ptr() if torch is not None and isinstance(a, torch.Tensor) \
        else a.__array_interface__["data"][0]


def bf16_case(stats_bf16):
    """x, dy bfloat16; statistics, gamma, beta bfloat16 or float32."""
    x, dy, mean, var, gamma, beta = tensors(seed=3)
    stats = (mean, var, gamma, beta)
    if stats_bf16:
        stats = tuple(t.bfloat16() for t in stats)
    return (x.bfloat16(), dy.bfloat16(), *stats)


# (front-end, statistics in bfloat16): what each convention's dtype rule allows
BF16_CASES = [("onednn_graph", False), ("onednn_graph", True), ("intel_spec", False),
              ("intel_spec", True), ("ngraph", True), ("two_phase", False),
              ("dml_grad", True), ("dml_training_grad", True)]


@needs_torch
@needs_bf16
@pytest.mark.parametrize("front_end,stats_bf16", BF16_CASES)
def test_bfloat16_tensors_are_accepted(front_end, stats_bf16):
    args = bf16_case(stats_bf16)
    got, want = call_front_end(front_end, *args)
    stat_type = "bfloat16" if stats_bf16 else "float32"
    for g, w, t, what in zip(got, want, ("bfloat16", stat_type, stat_type),
                             ("dx", "dscale", "dbias")):
        assert g.dtype == np.dtype(t if t == "float32" else BF16), what
        assert_close(g, w, t, f"{front_end} {what}")


@needs_torch
@needs_bf16
def test_bfloat16_tensor_inputs_are_viewed_not_copied():
    from bnbw_native import _dlpack
    t = torch.randn(6, 5, 4).bfloat16().transpose(0, 2)
    arr = _dlpack.as_array(t, "src")
    assert arr.dtype == BF16 and address(arr) == t.data_ptr()
    assert arr.strides == tuple(2 * s for s in t.stride())
    assert np.array_equal(arr.astype(np.float32), t.float().numpy())


@needs_torch
@needs_bf16
@pytest.mark.parametrize("front_end,stats_bf16", [c for c in BF16_CASES if c[0] in NEG_OUT_CALLS])
def test_bfloat16_out_tensors_are_written_in_place(front_end, stats_bf16):
    args = bf16_case(stats_bf16)
    x, gamma = args[0], args[4]
    call, _ = NEG_OUT_CALLS[front_end]
    out = (torch.full_like(x, SENTINEL), torch.full((x.shape[1],), SENTINEL, dtype=gamma.dtype),
           torch.full((x.shape[1],), SENTINEL, dtype=gamma.dtype))
    pointers = [t.data_ptr() for t in out]
    got = call(args, out)
    _, want = call_front_end(front_end, *args)
    stat_type = "bfloat16" if stats_bf16 else "float32"
    for result, tensor, ptr, w, t in zip(got, out, pointers, want,
                                         ("bfloat16", stat_type, stat_type)):
        assert tensor.data_ptr() == ptr and address(result) == ptr   # written in place
        assert_close(tensor.float().numpy().astype(np.float32 if t == "float32" else BF16),
                     w, t)


@needs_torch
@needs_bf16
def test_bfloat16_out_may_be_the_gradient_itself():
    x, dy, mean, var, gamma, _ = bf16_case(False)
    want = ref_ncx(x, dy, mean, var, gamma)
    ptr = dy.data_ptr()
    bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS, data_format="NCX",
                                   out=(dy, torch.empty(5), torch.empty(5)))
    assert dy.data_ptr() == ptr
    assert_close(dy.float().numpy().astype(BF16), want[0], "bfloat16", "dx over dy")


class LegacyProducer:
    """A DLPack producer from before DLPack 1.0: `__dlpack__` takes no max_version and hands a
    "dltensor" capsule."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, stream=None):
        return self.tensor.__dlpack__()

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


@needs_torch
@needs_bf16
def test_bfloat16_from_a_legacy_producer():
    x, dy, mean, var, gamma, _ = bf16_case(False)
    got = bn.batchnorm_training_backward(LegacyProducer(x), LegacyProducer(dy), mean, var, gamma,
                                         epsilon=EPS, data_format="NCX")
    want = ref_ncx(x, dy, mean, var, gamma)
    for g, w, t in zip(got, want, ("bfloat16", "float32", "float32")):
        assert_close(g, w, t)
    # a legacy capsule cannot say it is writable: NumPy views it read-only, so as an output it
    # is refused as every dtype's is (test_dlpack.py), and nothing is written
    dx = torch.full_like(x, SENTINEL)
    with pytest.raises(ValueError, match=r"out\[0\] \(diff_src\) is read-only"):
        bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS, data_format="NCX",
                                       out=(LegacyProducer(dx), torch.empty(5), torch.empty(5)))
    assert bool((dx == SENTINEL).all())


@needs_torch
def test_bfloat16_without_ml_dtypes_says_to_install_it(tmp_path):
    got = isolated("""
    import importlib.abc, json, sys

    class NoMlDtypes(importlib.abc.MetaPathFinder):       # as if ml_dtypes were not installed
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "ml_dtypes":
                raise ImportError("No module named 'ml_dtypes'", name=name)

    sys.meta_path.insert(0, NoMlDtypes())
    import torch
    import bnbw_native as bn
    x = torch.randn(4, 3, 2)
    mean, var = x.mean(dim=(0, 2)), x.var(dim=(0, 2), unbiased=False)
    res = {}
    try:
        bn.batchnorm_training_backward(x.bfloat16(), x.bfloat16(), mean, var, epsilon=1e-3,
                                       data_format="NCX")
    except TypeError as exc:
        res["input"] = str(exc)
    out = (torch.full((4, 3, 2), 7.0, dtype=torch.bfloat16), torch.full((3,), 7.0),
           torch.full((3,), 7.0))
    try:
        bn.batchnorm_training_backward(x, x, mean, var, epsilon=1e-3, data_format="NCX", out=out)
    except TypeError as exc:
        res["output"] = str(exc)
    res["untouched"] = all(bool((t == 7).all()) for t in out)
    print(json.dumps(res))
    """, tmp_path)
    assert re.match(r"src is a bfloat16 tensor.*install.*ml_dtypes", got.get("input", "")), got
    assert re.match(r"out\[0\] \(diff_src\) is a bfloat16 tensor.*install.*ml_dtypes",
                    got.get("output", "")), got
    assert got["untouched"]


# =============================================================================================
# 6. backward_apply names the count it was given
# =============================================================================================

@pytest.mark.parametrize("count", [-1, -2, -5, -120, -2 ** 70])
def test_negative_count_is_named_as_given(count):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((8, 3)).astype(np.float32)
    dy = rng.standard_normal((8, 3)).astype(np.float32)
    mean, var, gamma = x.mean(axis=0), x.var(axis=0), np.ones(3, np.float32)
    partial, _ = bn.backward_reduce(x, dy, mean)
    out = (np.full_like(x, SENTINEL), np.full(3, SENTINEL, np.float32),
           np.full(3, SENTINEL, np.float32))
    with pytest.raises(ValueError, match=rf"^count .*got {count}$"):
        bn.backward_apply(x, dy, mean, var, gamma, partial, count, epsilon=EPS, out=out)
    assert untouched(*out)
