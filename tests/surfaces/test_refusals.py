"""A catalogue of refused calls (contract 6): one test per refusal path of every public function and
constructor.

Each case builds a valid call with every output (and every input) in place, spoils one argument,
and checks three things: the documented exception type, a message that names the argument as
the convention calls it, and that not one byte of any array reachable from the call changed
(outputs are prefilled with a sentinel byte pattern).  Covered elsewhere, not repeated here:
the C API's NULL-pointer paths (tests/test_capi.py, tests/capi/example.c "errors") and every
refusal of bnbw_native.half (tests/test_half.py, with sentinel outputs).  The integer address 0
of DirectML's execute is here.
"""
import math
import re
from typing import Callable, NamedTuple, Optional, Tuple

import numpy as np
import pytest

import bnbw_native
from bnbw_native import dml, ngraph, intel_spec, reference

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    ml_dtypes = None
    BF16 = None

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
PATTERN = 0xA5
SHAPE = (4, 3, 5)          # NCX: C = 3, M = 20
C = 3


def sentinel(shape, dtype=F32):
    a = np.empty(shape, dtype)
    a.view(np.uint8)[...] = PATTERN
    return a


def named(name):
    """A regex matching `name` as a whole word (so "src" does not match "diff_src")."""
    return rf"(?<![\w\[]){re.escape(name)}(?![\w])"


def arrays_in(obj, found=None):
    """Every ndarray reachable from obj (dicts, tuples, lists), each once."""
    found = [] if found is None else found
    if isinstance(obj, np.ndarray):
        if not any(a is obj for a in found):
            found.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            arrays_in(v, found)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            arrays_in(v, found)
    return found


def snapshot(arrays):
    return [np.asarray(a).tobytes() for a in arrays]


def assert_refused(call, kwargs, error, match):
    arrays = arrays_in(kwargs)
    before = snapshot(arrays)
    with pytest.raises(error, match=match):
        call(**kwargs)
    assert snapshot(arrays) == before, "a refused call wrote to an array"


# =========================================================================================
# Array front-ends: oneDNN Graph (3 and 1 outputs), Intel spec, nGraph, the two phases
# =========================================================================================

class Front(NamedTuple):
    names: dict             # role -> the convention's argument name
    roles: Tuple[str, ...]  # the array arguments it takes
    options: Tuple[str, ...]
    n_out: int              # entries of out= (0: no out)


GRAPH_NAMES = dict(x="src", dy="diff_dst", mean="mean", var="variance", scale="gamma",
                   dx="diff_src", dscale="diff_gamma", dbias="diff_beta")
FRONTS = {
    "graph": Front(GRAPH_NAMES, ("x", "dy", "mean", "var", "scale"),
                   ("epsilon", "data_format", "num_outputs", "num_threads"), 3),
    "graph1": Front(GRAPH_NAMES, ("x", "dy", "mean", "var", "scale"),
                    ("epsilon", "data_format", "num_outputs", "num_threads"), 1),
    "intel": Front(dict(x="input_forward", dy="output_delta", mean="mean", var="variance",
                        scale="gamma", dx="input_delta", dscale="gamma_delta",
                        dbias="beta_delta"),
                   ("x", "dy", "mean", "var", "scale"), ("epsilon", "data_format", "num_threads"),
                   3),
    "ngraph": Front(dict(x="input", dy="normalized_delta", mean="mean", var="variance",
                         scale="gamma", beta="beta", dx="input_delta", dscale="gamma_delta",
                         dbias="beta_delta"),
                    ("x", "dy", "mean", "var", "scale", "beta"), ("epsilon", "num_threads"), 3),
    "reduce": Front(dict(x="x", dy="dy", mean="mean"), ("x", "dy", "mean"),
                    ("data_format", "num_threads"), 0),
    "apply": Front(dict(x="x", dy="dy", mean="mean", var="variance", scale="gamma",
                        dx="diff_src", dscale="diff_gamma", dbias="diff_beta"),
                   ("x", "dy", "mean", "var", "scale"),
                   ("epsilon", "data_format", "num_threads", "partial", "count"), 3),
}


def valid_args(front):
    """role -> value for a valid call of `front`; outputs are sentinel-filled."""
    f = FRONTS[front]
    rng = np.random.default_rng(0)
    args = dict(x=rng.normal(3, 1, SHAPE).astype(F32), dy=rng.normal(0, 1, SHAPE).astype(F32),
                mean=np.full(C, 3.0, F32), var=np.full(C, 1.0, F32),
                scale=np.full(C, 1.5, F32), beta=np.zeros(C, F32))
    args = {k: v for k, v in args.items() if k in f.roles}
    if "epsilon" in f.options:
        args["epsilon"] = 1e-3
    if "data_format" in f.options:
        args["data_format"] = "NCX"
    if "num_outputs" in f.options:
        args["num_outputs"] = 1 if front == "graph1" else 3
    if "partial" in f.options:
        args["partial"], args["count"] = bnbw_native.backward_reduce(
            args["x"], args["dy"], args["mean"], data_format="NCX")
    if f.n_out:
        args["out"] = (sentinel(SHAPE), sentinel(C), sentinel(C))[:f.n_out]
    return args


def invoke(front, args):
    a = dict(args)
    if front in ("graph", "graph1"):
        return bnbw_native.batchnorm_training_backward(
            a.pop("x"), a.pop("dy"), a.pop("mean"), a.pop("var"), a.pop("scale"), **a)
    if front == "intel":
        return intel_spec.batch_norm_training_backprop(
            a.pop("x"), a.pop("dy"), a.pop("mean"), a.pop("var"), a.pop("scale"), **a)
    if front == "ngraph":
        return ngraph.batch_norm_training_backprop(
            a.pop("x"), a.pop("scale"), a.pop("beta"), a.pop("mean"), a.pop("var"),
            a.pop("dy"), **a)
    if front == "reduce":
        return bnbw_native.backward_reduce(a.pop("x"), a.pop("dy"), a.pop("mean"), **a)
    return bnbw_native.backward_apply(a.pop("x"), a.pop("dy"), a.pop("mean"), a.pop("var"),
                                      a.pop("scale"), a.pop("partial"), a.pop("count"), **a)


@pytest.mark.parametrize("front", sorted(FRONTS))
def test_valid_call_succeeds(front):
    """The baseline of every case below is accepted (so each refusal is the spoiled argument's)."""
    args = valid_args(front)
    invoke(front, args)
    for index, arr in enumerate(args.get("out", ())):
        assert not (arr.view(np.uint8) == PATTERN).all(), f"out[{index}] not written"


def out_label(front, index):
    names = FRONTS[front].names
    return f"out[{index}] ({names[('dx', 'dscale', 'dbias')[index]]})"


class Case(NamedTuple):
    id: str
    applies: Callable[[str], bool]
    spoil: Callable[[dict, str], None]
    error: type
    name: Callable[[str], str]          # front -> the name the message must contain
    bug: Optional[str] = None           # a known defect: the case is xfail(strict)


def role_case(cid, role, value, error, only=None):
    """Replace the argument of `role` by value(args) (a callable) or value."""
    def spoil(args, front):
        args[role] = value(args) if callable(value) else value
    applies = (lambda fr: role in FRONTS[fr].roles and (only is None or fr in only))
    return Case(f"{role}-{cid}", applies, spoil, error, lambda fr: FRONTS[fr].names[role])


def option_case(cid, option, value, error, only=None):
    def spoil(args, front):
        args[option] = value
    applies = (lambda fr: option in FRONTS[fr].options and (only is None or fr in only))
    return Case(f"{option}-{cid}", applies, spoil, error, lambda fr: option)


def out_case(cid, spoil, error, index, min_out=1, bug=None):
    """index: the out entry the message names (None: "out" itself)."""
    applies = (lambda fr: FRONTS[fr].n_out >= min_out)
    name = (lambda fr: "out") if index is None else (lambda fr: out_label(fr, index))
    return Case(f"out-{cid}", applies, spoil, error, name, bug)


def ragged():
    return [[1.0], [1.0, 2.0]]


STAT_ROLES = ("mean", "var", "scale", "beta")
CASES = []
for _role in ("x", "dy", "mean", "var", "scale", "beta"):
    _none_ok = ("graph", "graph1", "intel", "apply") if _role == "scale" else ()
    CASES += [
        role_case("none", _role, None, TypeError,
                  only=[f for f in FRONTS if f not in _none_ok]),
        role_case("string", _role, "abc", TypeError),
        role_case("numpy-scalar", _role, np.float32(1.0), TypeError),
        role_case("ragged-list", _role, ragged(), TypeError),
        role_case("object", _role, object(), TypeError),
        role_case("float64", _role, lambda a, r=_role: a[r].astype(np.float64), TypeError),
        role_case("uint16-bits", _role, lambda a, r=_role: a[r].view(np.uint16), TypeError),
    ]
    if _role in STAT_ROLES:
        CASES += [
            role_case("too-long", _role, np.ones(C + 1, F32), ValueError),
            role_case("too-short", _role, np.ones(C - 1, F32), ValueError),
            role_case("2-d", _role, np.ones((1, C), F32), ValueError),
            role_case("0-d", _role, np.ones((), F32), ValueError),
            role_case("float16", _role, np.ones(C, F16), TypeError),
        ]
        if BF16 is not None:
            CASES.append(role_case("bfloat16-with-float32-data", _role, np.ones(C, BF16),
                                   TypeError))

CASES += [
    role_case("rank-1", "x", lambda a: a["x"][:, 0, 0].copy(), ValueError),
    role_case("rank-0-array", "x", np.ones((), F32), ValueError),
    role_case("rank-9", "x", lambda a: a["x"].reshape(SHAPE + (1,) * 6), ValueError),
    role_case("float16", "dy", lambda a: a["dy"].astype(F16), TypeError),
    role_case("wrong-shape", "dy", lambda a: np.ones((4, 3, 6), F32), ValueError),
    role_case("transposed-shape", "dy", lambda a: np.ascontiguousarray(a["dy"].T), ValueError),
    role_case("rank-differs", "dy", lambda a: a["dy"][..., None], ValueError),
]
if BF16 is not None:
    CASES.append(role_case("bfloat16", "dy", lambda a: a["dy"].astype(BF16), TypeError))

for _value, _error, _cid in [
        ("1e-3", TypeError, "string"), (None, TypeError, "none"), (True, TypeError, "bool"),
        (1e-3j, TypeError, "complex"), (np.array([1e-3]), TypeError, "1-d-array"),
        ([1e-3], TypeError, "list"), (0.0, ValueError, "zero"), (-0.0, ValueError, "minus-zero"),
        (-1e-3, ValueError, "negative"), (float("nan"), ValueError, "nan"),
        (float("inf"), ValueError, "inf"), (float("-inf"), ValueError, "minus-inf"),
        (1e-50, ValueError, "underflows-float32"), (1e39, ValueError, "overflows-float32"),
        (10 ** 400, ValueError, "huge-int"), (np.float64(np.nan), ValueError, "numpy-nan")]:
    CASES.append(option_case(_cid, "epsilon", _value, _error))
for _value, _error, _cid in [(b"NCX", TypeError, "bytes"), (None, TypeError, "none"),
                             (1, TypeError, "int"), ("NCHW", ValueError, "NCHW"),
                             ("ncx", ValueError, "lower-case"), ("", ValueError, "empty")]:
    CASES.append(option_case(_cid, "data_format", _value, _error))
for _value, _error, _cid in [("3", TypeError, "string"), (3.0, TypeError, "float"),
                             (True, TypeError, "bool"), (None, TypeError, "none"),
                             (2, ValueError, "two"), (0, ValueError, "zero"),
                             (-1, ValueError, "negative")]:
    CASES.append(option_case(_cid, "num_outputs", _value, _error))
for _value, _error, _cid in [(0, ValueError, "zero"), (-1, ValueError, "negative"),
                             (-2 ** 70, ValueError, "huge-negative"),
                             (1.5, TypeError, "float"), (2.0, TypeError, "integral-float"),
                             ("2", TypeError, "string"), (True, TypeError, "bool")]:
    CASES.append(option_case(_cid, "num_threads", _value, _error))


def _set_out(index, make):
    def spoil(args, front):
        out = list(args["out"])
        out[index] = make(args, out)
        args["out"] = tuple(out)
    return spoil


def _misaligned(shape, dtype=F32):
    raw = np.zeros(math.prod(shape) * np.dtype(dtype).itemsize + 1, np.uint8)
    return raw[1:].view(dtype).reshape(shape)


def _read_only(a):
    a.flags.writeable = False
    return a


CASES += [
    out_case("not-a-sequence", lambda a, f: a.update(out=a["out"][0]), TypeError, None),
    out_case("a-dict", lambda a, f: a.update(out={0: a["out"][0]}), TypeError, None),
    out_case("an-iterator", lambda a, f: a.update(out=iter(a["out"])), TypeError, None),
    out_case("too-short", lambda a, f: a.update(out=a["out"][:-1]), ValueError, None),
    out_case("too-long", lambda a, f: a.update(out=a["out"] + (sentinel(C),)), ValueError,
             None),
    out_case("entry-none", _set_out(0, lambda a, o: None), TypeError, 0),
    out_case("entry-list", _set_out(0, lambda a, o: [0.0] * 60), TypeError, 0),
    out_case("entry-float64", _set_out(0, lambda a, o: np.zeros(SHAPE)), TypeError, 0),
    out_case("entry-byteswapped", _set_out(0, lambda a, o: np.zeros(SHAPE, ">f4")), TypeError,
             0),
    out_case("entry-float16", _set_out(0, lambda a, o: np.zeros(SHAPE, F16)), TypeError, 0),
    out_case("entry-wrong-shape", _set_out(0, lambda a, o: sentinel((4, 3, 6))), ValueError,
             0),
    out_case("entry-transposed-shape", _set_out(0, lambda a, o: sentinel(SHAPE[::-1])),
             ValueError, 0),
    out_case("entry-read-only", _set_out(0, lambda a, o: _read_only(sentinel(SHAPE))),
             ValueError, 0),
    out_case("entry-broadcast", _set_out(0, lambda a, o: np.broadcast_to(sentinel(5), SHAPE)),
             ValueError, 0),
    out_case("entry-misaligned", _set_out(0, lambda a, o: _misaligned(SHAPE)), ValueError, 0),
    out_case("entry-overlaps-itself", _set_out(0, lambda a, o: np.lib.stride_tricks.as_strided(
        sentinel(40), SHAPE, (40, 4, 4))), ValueError, 0),
    out_case("dx-over-src", _set_out(0, lambda a, o: a["x"]), ValueError, 0),
    out_case("dx-over-diff-dst-reversed", _set_out(0, lambda a, o: a["dy"][::-1]), ValueError,
             0),
    out_case("dx-over-part-of-diff-dst", lambda a, f: _shifted_over(a), ValueError, 0),
    out_case("dgamma-wrong-dtype", _set_out(1, lambda a, o: np.zeros(C, F16)), TypeError, 1,
             min_out=3),
    out_case("dgamma-wrong-shape", _set_out(1, lambda a, o: sentinel((C, 1))), ValueError, 1,
             min_out=3),
    out_case("dbeta-read-only", _set_out(2, lambda a, o: _read_only(sentinel(C))), ValueError,
             2, min_out=3),
    out_case("dbeta-is-dgamma", _set_out(2, lambda a, o: o[1]), ValueError, 1, min_out=3),
    out_case("dgamma-inside-dx", _set_out(1, lambda a, o: o[0][0, :, 0]), ValueError, 0,
             min_out=3),
    out_case("dgamma-over-mean", _set_out(1, lambda a, o: a["mean"]), ValueError, 1,
             min_out=3),
    out_case("dbeta-over-variance", _set_out(2, lambda a, o: a["var"]), ValueError, 2,
             min_out=3),
]


def _shifted_over(args):
    """diff_dst and out[0] in one buffer, one element apart: they overlap without being the
    very same array."""
    base = np.empty(math.prod(SHAPE) + 1, F32)
    base[:-1] = args["dy"].reshape(-1)
    base[-1] = 0
    args["dy"] = base[:-1].reshape(SHAPE)
    args["out"] = (base[1:].reshape(SHAPE),) + tuple(args["out"][1:])


def _partial_case(cid, spoil, error, name, bug=None):
    return Case(f"{name}-{cid}", lambda fr: fr == "apply", spoil, error, lambda fr: name, bug)


CASES += [
    _partial_case("none", lambda a, f: a.update(partial=None), TypeError, "partial"),
    _partial_case("string", lambda a, f: a.update(partial="abc"), TypeError, "partial"),
    _partial_case("object", lambda a, f: a.update(partial=object()), TypeError, "partial"),
    _partial_case("float32", lambda a, f: a.update(partial=a["partial"].astype(F32)), TypeError,
                  "partial"),
    _partial_case("int64", lambda a, f: a.update(partial=a["partial"].astype(np.int64)),
                  TypeError, "partial"),
    _partial_case("shape-transposed", lambda a, f: a.update(partial=a["partial"].T.copy()),
                  ValueError, "partial"),
    _partial_case("shape-3-rows", lambda a, f: a.update(partial=np.zeros((3, C))), ValueError,
                  "partial"),
    _partial_case("flat", lambda a, f: a.update(partial=a["partial"].reshape(-1)), ValueError,
                  "partial"),
    _partial_case("ragged-list", lambda a, f: a.update(partial=[[0.0] * C, [0.0]]), TypeError,
                  "partial"),
    _partial_case("float", lambda a, f: a.update(count=20.0), TypeError, "count"),
    _partial_case("bool", lambda a, f: a.update(count=True), TypeError, "count"),
    _partial_case("string", lambda a, f: a.update(count="20"), TypeError, "count"),
    _partial_case("none", lambda a, f: a.update(count=None), TypeError, "count"),
    _partial_case("below-local", lambda a, f: a.update(count=19), ValueError, "count"),
    _partial_case("zero", lambda a, f: a.update(count=0), ValueError, "count"),
    _partial_case("negative", lambda a, f: a.update(count=-20), ValueError, "count"),
    _partial_case("beyond-float-range", lambda a, f: a.update(count=10 ** 400), ValueError,
                  "count"),
]

ARRAY_CASES = [pytest.param(front, case, id=f"{front}:{case.id}",
                            marks=[pytest.mark.xfail(strict=True, reason=f"bug: {case.bug}")]
                            if case.bug else [])
               for case in CASES for front in FRONTS if case.applies(front)]


@pytest.mark.parametrize("front, case", ARRAY_CASES)
def test_array_front_refusal(front, case):
    args = valid_args(front)
    case.spoil(args, front)
    assert_refused(lambda **kw: invoke(front, kw), args, case.error, named(case.name(front)))


@pytest.mark.parametrize("front", ["graph", "graph1", "intel", "ngraph", "apply"])
def test_output_that_cannot_be_allocated_raises_memory_error(front):
    """A broadcast input describing 12 TiB of output: NumPy cannot allocate diff_src, so the call
    raises MemoryError at once (before any kernel runs); no value of any type is written."""
    args = valid_args(front)
    shape = (2 ** 20, C, 2 ** 20)
    small = [args["x"][:1, :, :1].copy(), args["dy"][:1, :, :1].copy()]
    args["x"] = np.broadcast_to(small[0], shape)
    args["dy"] = np.broadcast_to(small[1], shape)
    args.pop("out", None)
    if front == "apply":
        args["count"] = 2 ** 40
    arrays = small + [a for a in arrays_in(args) if a.base is None]
    before = snapshot(arrays)
    with pytest.raises(MemoryError):
        invoke(front, args)
    assert snapshot(arrays) == before


# =========================================================================================
# bnbw_native.set_num_threads
# =========================================================================================

@pytest.mark.parametrize("value, error", [
    (0, ValueError), (-1, ValueError), (np.int64(0), ValueError), (2.0, TypeError),
    ("2", TypeError), (True, TypeError), (np.float32(2), TypeError), ([2], TypeError)],
    ids=["zero", "negative", "numpy-zero", "float", "string", "bool", "numpy-float", "list"])
def test_set_num_threads_refusal(value, error):
    bnbw_native.set_num_threads(3)
    try:
        with pytest.raises(error, match=named("n")):
            bnbw_native.set_num_threads(value)
        assert bnbw_native.get_num_threads() == 3, "a refused call changed the default"
    finally:
        bnbw_native.set_num_threads(None)


# =========================================================================================
# DirectML: TensorDesc, TensorDesc.from_array, the operators, execute, the conveniences
# =========================================================================================

DESC_CASES = [
    # (id, args, kwargs, error, name)
    ("data_type-unknown-name", ("float64", (2, 3)), {}, TypeError, "data_type"),
    ("data_type-upper-case", ("FLOAT32", (2, 3)), {}, TypeError, "data_type"),
    ("data_type-none", (None, (2, 3)), {}, TypeError, "data_type"),
    ("data_type-int", (1, (2, 3)), {}, TypeError, "data_type"),
    ("data_type-numpy-int8", (np.int8, (2, 3)), {}, TypeError, "data_type"),
    ("data_type-uint16", ("uint16", (2, 3)), {}, TypeError, "data_type"),
    ("data_type-list", ([], (2, 3)), {}, TypeError, "data_type"),
    ("sizes-int", ("float32", 5), {}, TypeError, "sizes"),
    ("sizes-string", ("float32", "23"), {}, TypeError, "sizes"),
    ("sizes-none", ("float32", None), {}, TypeError, "sizes"),
    ("sizes-float-entry", ("float32", (2.0, 3)), {}, TypeError, "sizes"),
    ("sizes-bool-entry", ("float32", (True, 3)), {}, TypeError, "sizes"),
    ("sizes-none-entry", ("float32", (2, None)), {}, TypeError, "sizes"),
    ("sizes-no-dims", ("float32", ()), {}, ValueError, "sizes"),
    ("sizes-9-dims", ("float32", (1,) * 9), {}, ValueError, "sizes"),
    ("sizes-zero", ("float32", (2, 0, 3)), {}, ValueError, "sizes"),
    ("sizes-negative", ("float32", (-1, 3)), {}, ValueError, "sizes"),
    ("sizes-beyond-int64", ("float32", (2 ** 64, 1)), {}, ValueError, "sizes"),
    ("sizes-bytes-overflow-64-bits", ("float32", (2 ** 31, 2 ** 31)), {}, ValueError, "sizes"),
    ("sizes-bytes-overflow-2^63", ("float16", (2 ** 62,)), {}, ValueError, "sizes"),
    ("sizes-product-overflows-int64", ("float32", (2 ** 32, 2 ** 32, 2 ** 32)), {}, ValueError,
     "sizes"),
    ("strides-int", ("float32", (2, 3), 3), {}, TypeError, "strides"),
    ("strides-string", ("float32", (2, 3), "31"), {}, TypeError, "strides"),
    ("strides-float-entry", ("float32", (2, 3), (3.0, 1)), {}, TypeError, "strides"),
    ("strides-bool-entry", ("float32", (2, 3), (3, True)), {}, TypeError, "strides"),
    ("strides-too-few", ("float32", (2, 3), (1,)), {}, ValueError, "strides"),
    ("strides-too-many", ("float32", (2, 3), (3, 1, 1)), {}, ValueError, "strides"),
    ("strides-negative", ("float32", (2, 3), (-3, 1)), {}, ValueError, "strides"),
    ("strides-beyond-int64", ("float32", (2, 3), (2 ** 64, 1)), {}, ValueError, "strides"),
    ("strides-reach-overflows-64-bits", ("float32", (3, 2), (2 ** 62, 1)), {}, ValueError,
     "strides"),
    ("strides-sum-overflows", ("float32", (2, 2, 2), (2 ** 61, 2 ** 61, 2 ** 61)), {},
     ValueError, "strides"),
    ("total-float", ("float32", (2, 3)), dict(total_tensor_size_in_bytes=24.0), TypeError,
     "total_tensor_size_in_bytes"),
    ("total-bool", ("float32", (1,)), dict(total_tensor_size_in_bytes=True), TypeError,
     "total_tensor_size_in_bytes"),
    ("total-string", ("float32", (2, 3)), dict(total_tensor_size_in_bytes="24"), TypeError,
     "total_tensor_size_in_bytes"),
    ("total-below-minimum", ("float32", (2, 3)), dict(total_tensor_size_in_bytes=23),
     ValueError, "total_tensor_size_in_bytes"),
    ("total-zero", ("float32", (2, 3)), dict(total_tensor_size_in_bytes=0), ValueError,
     "total_tensor_size_in_bytes"),
    ("total-negative", ("float32", (2, 3)), dict(total_tensor_size_in_bytes=-24), ValueError,
     "total_tensor_size_in_bytes"),
    ("total-beyond-uint64", ("float32", (2, 3)), dict(total_tensor_size_in_bytes=2 ** 64),
     ValueError, "total_tensor_size_in_bytes"),
    ("total-below-strided-minimum", ("float32", (2, 3), (8, 2)),
     dict(total_tensor_size_in_bytes=24), ValueError, "total_tensor_size_in_bytes"),
]


@pytest.mark.parametrize("args, kwargs, error, name",
                         [pytest.param(*c[1:], id=c[0]) for c in DESC_CASES])
def test_tensor_desc_refusal(args, kwargs, error, name):
    with pytest.raises(error, match=named(name)):
        dml.TensorDesc(*args, **kwargs)


FROM_ARRAY_CASES = [
    ("not-an-array", lambda: ([1.0, 2.0],), TypeError, "array"),
    ("numpy-scalar", lambda: (np.float32(1),), TypeError, "array"),
    ("float64", lambda: (np.zeros(3),), TypeError, "data_type"),
    ("int16", lambda: (np.zeros(3, np.int16),), TypeError, "data_type"),
    ("uint16-without-data-type", lambda: (np.zeros(3, np.uint16),), TypeError, "data_type"),
    ("bad-data-type", lambda: (np.zeros(3, F32), "float8"), TypeError, "data_type"),
    ("itemsize-differs", lambda: (np.zeros(3, F32), "bfloat16"), TypeError, "data_type"),
    ("negative-strides", lambda: (np.zeros((2, 3), F32)[::-1],), ValueError, "strides"),
    ("strides-not-multiple-of-item",
     lambda: (np.ndarray((3,), F32, np.zeros(16, np.uint8), 0, (6,)),), ValueError, "strides"),
    ("0-d", lambda: (np.zeros((), F32),), ValueError, "sizes"),
    ("empty", lambda: (np.zeros((0, 3), F32),), ValueError, "sizes"),
    ("9-d", lambda: (np.zeros((1,) * 9, F32),), ValueError, "sizes"),
]


@pytest.mark.parametrize("make, error, name",
                         [pytest.param(*c[1:], id=c[0]) for c in FROM_ARRAY_CASES])
def test_tensor_desc_from_array_refusal(make, error, name):
    args = make()
    before = snapshot(arrays_in(args))
    with pytest.raises(error, match=named(name)):
        dml.TensorDesc.from_array(*args)
    assert snapshot(arrays_in(args)) == before


MEMBERS = list(dml.MEMBERS)
OUTPUTS = MEMBERS[5:]
BIG, STATS = (2, 3, 4), (1, 3, 1)
OPERATORS = {"grad": dml.BatchNormalizationGrad,
             "training_grad": dml.BatchNormalizationTrainingGrad}


def desc(sizes, data_type="float32", strides=None):
    return dml.TensorDesc(data_type, sizes, strides)


def valid_members():
    m = {k: desc(BIG if k in ("input", "input_gradient", "output_gradient") else STATS)
         for k in MEMBERS}
    m["epsilon"] = 1e-3
    return m


# an output layout whose non-overlap the bounded search can neither prove nor refute
UNDECIDED = ((8, 11, 6, 11, 8, 2, 5, 5), (3732, 7534, 3729, 3717, 7394, 7438, 3758, 7394))


def _undecided(m):
    big = desc(UNDECIDED[0])
    stats = desc((1,) * 8)
    m.update({k: stats for k in MEMBERS}, input=big, input_gradient=big,
             output_gradient=desc(UNDECIDED[0], strides=UNDECIDED[1]))


OPERATOR_CASES = [
    ("input-not-a-desc", lambda m: m.update(input=np.zeros(BIG, F32)), TypeError, "input"),
    ("scale-none", lambda m: m.update(scale=None), TypeError, "scale"),
    ("output_bias_gradient-a-tuple", lambda m: m.update(output_bias_gradient=STATS), TypeError,
     "output_bias_gradient"),
    ("variance-missing", lambda m: m.pop("variance"), TypeError, "variance"),
    ("epsilon-missing", lambda m: m.pop("epsilon"), TypeError, "epsilon"),
    ("unknown-member", lambda m: m.update(bias=desc(STATS)), TypeError, "bias"),
    ("mean-other-data-type", lambda m: m.update(mean=desc(STATS, "float16")), TypeError,
     "mean"),
    ("output_gradient-other-data-type",
     lambda m: m.update(output_gradient=desc(BIG, "bfloat16")), TypeError, "output_gradient"),
    ("input_gradient-dimension-count", lambda m: m.update(input_gradient=desc((2, 3, 4, 1))),
     ValueError, "input_gradient"),
    ("mean-dimension-count", lambda m: m.update(mean=desc((3, 1))), ValueError, "mean"),
    ("input_gradient-sizes", lambda m: m.update(input_gradient=desc((2, 3, 5))), ValueError,
     "input_gradient"),
    ("output_gradient-sizes", lambda m: m.update(output_gradient=desc((4, 3, 2))), ValueError,
     "output_gradient"),
    ("variance-sizes", lambda m: m.update(variance=desc((1, 3, 4))), ValueError, "variance"),
    ("output_scale_gradient-sizes", lambda m: m.update(output_scale_gradient=desc((1, 1, 1))),
     ValueError, "output_scale_gradient"),
    ("mean-size-neither-1-nor-input", lambda m: m.update(
        **{k: desc((1, 2, 1)) for k in ("mean", "variance", "scale", "output_scale_gradient",
                                        "output_bias_gradient")}), ValueError, "mean"),
    ("epsilon-zero", lambda m: m.update(epsilon=0.0), ValueError, "epsilon"),
    ("epsilon-negative", lambda m: m.update(epsilon=-1e-5), ValueError, "epsilon"),
    ("epsilon-nan", lambda m: m.update(epsilon=float("nan")), ValueError, "epsilon"),
    ("epsilon-inf", lambda m: m.update(epsilon=float("inf")), ValueError, "epsilon"),
    ("epsilon-underflows-float32", lambda m: m.update(epsilon=1e-50), ValueError, "epsilon"),
    ("epsilon-overflows-float32", lambda m: m.update(epsilon=1e39), ValueError, "epsilon"),
    ("epsilon-string", lambda m: m.update(epsilon="1e-3"), TypeError, "epsilon"),
    ("epsilon-none", lambda m: m.update(epsilon=None), TypeError, "epsilon"),
    ("output_gradient-stride-0", lambda m: m.update(output_gradient=desc(BIG, strides=(12, 0, 1))),
     ValueError, "output_gradient"),
    ("output_gradient-strides-collide",
     lambda m: m.update(output_gradient=desc(BIG, strides=(4, 3, 1))), ValueError,
     "output_gradient"),
    ("output_scale_gradient-stride-0",
     lambda m: m.update(output_scale_gradient=desc(STATS, strides=(0, 0, 0))), ValueError,
     "output_scale_gradient"),
    ("output_gradient-overlap-undecided", _undecided, ValueError, "output_gradient"),
]


@pytest.mark.parametrize("kind", sorted(OPERATORS))
@pytest.mark.parametrize("spoil, error, name",
                         [pytest.param(*c[1:], id=c[0]) for c in OPERATOR_CASES])
def test_operator_refusal(kind, spoil, error, name):
    m = valid_members()
    OPERATORS[kind](**m)                       # the baseline is valid
    spoil(m)
    with pytest.raises(error, match=named(name)):
        OPERATORS[kind](**m)


def valid_execute(kind):
    """A compiled operator and sentinel-filled buffers for it."""
    op = OPERATORS[kind](**valid_members())
    rng = np.random.default_rng(1)
    bufs = dict(input=rng.normal(size=BIG).astype(F32), input_gradient=rng.normal(size=BIG)
                .astype(F32), mean=np.zeros(STATS, F32), variance=np.ones(STATS, F32),
                scale=np.ones(STATS, F32), output_gradient=sentinel(BIG),
                output_scale_gradient=sentinel(STATS), output_bias_gradient=sentinel(STATS))
    return op, bufs


def _bind(member, make):
    def spoil(bufs):
        bufs[member] = make(bufs)
    return spoil


def _noncontiguous(b):
    wide = np.zeros(48, F32)
    return wide[::2]


EXECUTE_CASES = [
    ("input-string", _bind("input", lambda b: "abc"), TypeError, "input"),
    ("input-float", _bind("input", lambda b: 1.5), TypeError, "input"),
    ("input-none", _bind("input", lambda b: None), TypeError, "input"),
    ("input-list", _bind("input", lambda b: [0.0] * 24), TypeError, "input"),
    ("input-object", _bind("input", lambda b: object()), TypeError, "input"),
    ("input-bool", _bind("input", lambda b: True), TypeError, "input"),
    ("mean-object-array", _bind("mean", lambda b: np.full(3, 1.0, object)), TypeError, "mean"),
    ("mean-null-address", _bind("mean", lambda b: 0), ValueError, "mean"),
    ("output_gradient-null-address", _bind("output_gradient", lambda b: 0), ValueError,
     "output_gradient"),
    ("scale-negative-address", _bind("scale", lambda b: -8), ValueError, "scale"),
    ("scale-address-beyond-pointer", _bind("scale", lambda b: 2 ** 64), ValueError, "scale"),
    ("input-non-contiguous-array", _bind("input", _noncontiguous), ValueError, "input"),
    ("input-non-contiguous-memoryview", _bind("input", lambda b: memoryview(np.zeros(48, F32))
                                              [::2]), ValueError, "input"),
    ("output_gradient-non-contiguous", _bind("output_gradient", _noncontiguous), ValueError,
     "output_gradient"),
    ("output_gradient-bytes", _bind("output_gradient", lambda b: bytes(96)), ValueError,
     "output_gradient"),
    ("output_scale_gradient-read-only-array",
     _bind("output_scale_gradient", lambda b: _read_only(sentinel(STATS))), ValueError,
     "output_scale_gradient"),
    ("output_bias_gradient-read-only-memoryview",
     _bind("output_bias_gradient", lambda b: memoryview(bytes(12))), ValueError,
     "output_bias_gradient"),
    ("input-too-small", _bind("input", lambda b: b["input"].reshape(-1)[:-1]), ValueError,
     "input"),
    ("variance-too-small-bytearray", _bind("variance", lambda b: bytearray(11)), ValueError,
     "variance"),
    ("output_gradient-too-small", _bind("output_gradient", lambda b: sentinel(23)), ValueError,
     "output_gradient"),
    ("output_bias_gradient-empty", _bind("output_bias_gradient", lambda b: bytearray()),
     ValueError, "output_bias_gradient"),
    ("input-misaligned", _bind("input", lambda b: memoryview(bytearray(97))[1:]), ValueError,
     "input"),
    ("output_gradient-misaligned-address",
     _bind("output_gradient", lambda b: b["output_gradient"].ctypes.data + 2), ValueError,
     "output_gradient"),
    ("output_gradient-over-input", _bind("output_gradient", lambda b: b["input"]), ValueError,
     "output_gradient"),
    ("output_scale_gradient-over-mean", _bind("output_scale_gradient", lambda b: b["mean"]),
     ValueError, "output_scale_gradient"),
    ("output_bias_gradient-over-output_scale_gradient",
     _bind("output_bias_gradient", lambda b: b["output_scale_gradient"]), ValueError,
     "output_bias_gradient"),
    ("output_bias_gradient-inside-output_gradient",
     _bind("output_bias_gradient", lambda b: b["output_gradient"].ctypes.data + 8), ValueError,
     "output_bias_gradient"),
    ("num_threads-zero", lambda b: b.update(num_threads=0), ValueError, "num_threads"),
    ("num_threads-negative", lambda b: b.update(num_threads=-1), ValueError, "num_threads"),
    ("num_threads-float", lambda b: b.update(num_threads=1.5), TypeError, "num_threads"),
    ("num_threads-string", lambda b: b.update(num_threads="2"), TypeError, "num_threads"),
    ("num_threads-bool", lambda b: b.update(num_threads=True), TypeError, "num_threads"),
    ("variance-missing", lambda b: b.pop("variance"), TypeError, "variance"),
    ("unknown-member", lambda b: b.update(bias=np.zeros(3, F32)), TypeError, "bias"),
]


@pytest.mark.parametrize("kind", sorted(OPERATORS))
@pytest.mark.parametrize("spoil, error, name",
                         [pytest.param(*c[1:], id=c[0]) for c in EXECUTE_CASES])
def test_execute_refusal(kind, spoil, error, name):
    op, bufs = valid_execute(kind)
    outputs = [bufs[k] for k in OUTPUTS]
    spoil(bufs)
    arrays = arrays_in(bufs) + [o for o in outputs if not any(o is a for a in arrays_in(bufs))]
    before = snapshot(arrays)
    with pytest.raises(error, match=named(name)):
        op.execute(**bufs)
    assert snapshot(arrays) == before, "a refused execute wrote to a buffer"


def test_execute_strided_descriptor_reaching_past_the_buffer():
    """A descriptor whose strides reach further than the packed buffer bound to it."""
    strided = desc(BIG, strides=(24, 8, 2))       # minimum (24 + 16 + 6 + 1) * 4 = 188 bytes
    m = valid_members()
    m.update(input=strided, input_gradient=strided)
    op = dml.BatchNormalizationTrainingGrad(**m)
    _, bufs = valid_execute("training_grad")
    arrays = arrays_in(bufs)
    before = snapshot(arrays)
    with pytest.raises(ValueError, match=named("input") + ".*at least 188"):
        op.execute(**bufs)
    assert snapshot(arrays) == before


def test_execute_in_place_needs_identical_descriptors():
    m = valid_members()
    m["output_gradient"] = desc(BIG, strides=(1, 2, 6))      # a different layout of (2, 3, 4)
    op = dml.BatchNormalizationGrad(**m)
    _, bufs = valid_execute("grad")
    bufs["output_gradient"] = bufs["input_gradient"]
    arrays = arrays_in(bufs)
    before = snapshot(arrays)
    with pytest.raises(ValueError, match=named("output_gradient") + ".*identical"):
        op.execute(**bufs)
    assert snapshot(arrays) == before


CONVENIENCE_CASES = [
    ("input-none", dict(input=None), TypeError, "input"),
    ("input-string", dict(input="abc"), TypeError, "input"),
    ("input-ragged", dict(input=[[1.0], [1.0, 2.0]]), TypeError, "input"),
    ("input-float64", dict(input=np.zeros(BIG)), TypeError, "input"),
    ("input-uint16", dict(input=np.zeros(BIG, np.uint16)), TypeError, "input"),
    ("input_gradient-float16", dict(input_gradient=np.zeros(BIG, F16)), TypeError,
     "input_gradient"),
    ("mean-float16", dict(mean=np.zeros(STATS, F16)), TypeError, "mean"),
    ("variance-none", dict(variance=None), TypeError, "variance"),
    ("scale-object", dict(scale=object()), TypeError, "scale"),
    ("input-0-d", dict(input=np.zeros((), F32), input_gradient=np.zeros((), F32)), ValueError,
     "input"),
    ("input-9-d", dict(input=np.zeros((1,) * 9, F32), input_gradient=np.zeros((1,) * 9, F32)),
     ValueError, "input"),
    ("input_gradient-shape", dict(input_gradient=np.zeros((2, 3, 5), F32)), ValueError,
     "input_gradient"),
    ("mean-rank", dict(mean=np.zeros(3, F32)), ValueError, "mean"),
    ("mean-size-neither-1-nor-input", dict(mean=np.zeros((1, 2, 1), F32)), ValueError, "mean"),
    ("variance-shape", dict(variance=np.ones((1, 3, 4), F32)), ValueError, "variance"),
    ("scale-shape", dict(scale=np.ones((2, 3, 1), F32)), ValueError, "scale"),
    ("epsilon-zero", dict(epsilon=0.0), ValueError, "epsilon"),
    ("epsilon-nan", dict(epsilon=float("nan")), ValueError, "epsilon"),
    ("epsilon-negative", dict(epsilon=-1.0), ValueError, "epsilon"),
    ("epsilon-inf", dict(epsilon=float("inf")), ValueError, "epsilon"),
    ("epsilon-underflows-float32", dict(epsilon=1e-50), ValueError, "epsilon"),
    ("epsilon-string", dict(epsilon="x"), TypeError, "epsilon"),
    ("num_threads-zero", dict(num_threads=0), ValueError, "num_threads"),
    ("num_threads-float", dict(num_threads=2.0), TypeError, "num_threads"),
]
CONVENIENCES = {"grad": dml.batch_normalization_grad,
                "training_grad": dml.batch_normalization_training_grad}


@pytest.mark.parametrize("kind", sorted(CONVENIENCES))
@pytest.mark.parametrize("spoil, error, name",
                         [pytest.param(*c[1:], id=c[0]) for c in CONVENIENCE_CASES])
def test_dml_convenience_refusal(kind, spoil, error, name):
    rng = np.random.default_rng(2)
    kwargs = dict(input=rng.normal(size=BIG).astype(F32),
                  input_gradient=rng.normal(size=BIG).astype(F32), mean=np.zeros(STATS, F32),
                  variance=np.ones(STATS, F32), scale=np.ones(STATS, F32), epsilon=1e-3)
    CONVENIENCES[kind](**kwargs)
    kwargs.update(spoil)
    assert_refused(CONVENIENCES[kind], kwargs, error, named(name))


# =========================================================================================
# bnbw_native.reference (minimal validation, still named)
# =========================================================================================

def _ref_args():
    x = np.ones((4, 3), F32)
    return dict(x=x, dy=x.copy(), mean=np.zeros((1, 3)), variance=np.ones((1, 3)),
                scale=None, epsilon=1e-3, reduce_axes=(0,))


REFERENCE_CASES = [
    ("backward", "formula", dict(formula="inference"), ValueError, "formula"),
    ("backward", "x-int", dict(x=np.ones((4, 3), np.int32)), TypeError, "x"),
    ("backward", "dy-shape", dict(dy=np.ones((4, 4))), ValueError, "dy"),
    ("backward", "dy-string", dict(dy=np.array(["a"] * 12).reshape(4, 3)), TypeError, "dy"),
    ("backward", "mean-shape", dict(mean=np.zeros((4, 1))), ValueError, "mean"),
    ("backward", "variance-rank", dict(variance=np.ones(3)), ValueError, "variance"),
    ("backward", "scale-shape", dict(scale=np.ones((2, 3))), ValueError, "scale"),
    ("graph", "data_format", dict(data_format="NCHW"), ValueError, "data_format"),
    ("graph", "num_outputs", dict(num_outputs=2), ValueError, "num_outputs"),
    ("graph", "src-rank-1", dict(src=np.ones(3, F32), diff_dst=np.ones(3, F32)), ValueError,
     "src"),
]


@pytest.mark.parametrize("function, change, error, name",
                         [pytest.param(c[0], *c[2:], id=f"{c[0]}:{c[1]}")
                          for c in REFERENCE_CASES])
def test_reference_refusal(function, change, error, name):
    if function == "backward":
        kwargs = _ref_args()
        call = reference.backward
    else:
        x = np.ones((4, 3), F32)
        kwargs = dict(src=x, diff_dst=x.copy(), mean=np.zeros(3, F32),
                      variance=np.ones(3, F32), epsilon=1e-3)
        call = reference.batchnorm_training_backward
    call(**kwargs)
    kwargs.update(change)
    assert_refused(call, kwargs, error, named(name))
