"""The catalogue of refused calls (contract 6): every refusal of every public surface, once.

A refused call raises the documented exception (`TypeError` for a wrong kind of object or
dtype, `ValueError` for a wrong value), its message names the argument as the surface calls it
(and, where a case says so, says what was expected), and it writes nothing: each case builds a
valid call with every output in place (prefilled with a sentinel byte pattern), spoils one
thing, and checks that not one byte of any array or writable buffer reachable from the call
changed.  A case lives in one table and runs on every surface it applies to:

* array front-ends: oneDNN Graph (3 and 1 outputs), Intel spec, nGraph, the two phases, with
  relu_dst= / diff_residual= where a front takes them; any kind of array argument; messages
  that teach; `set_num_threads`
* DLPack producers as inputs and as `out=` (torch)
* DirectML: `TensorDesc`, `TensorDesc.from_array`, both operators, `execute`, the conveniences
* `bnbw_native.half`'s conversion helpers
* the PyTorch layers (`BatchNorm`, `BatchNormReLU`), their options when made
* the training forward (`batchnorm_training_forward`, `dml.BatchNormalizationTraining`)
* `bnbw_native.reference` (minimal validation, still named), `show_config`

Elsewhere, because they are not Python refusals of this kind: the C API's statuses and NULL
pointers (surfaces/test_capi.py, surfaces/capi/example.c "errors"), what a hostile caller
found that could crash or corrupt (surfaces/test_hostile_inputs.py: out of memory, pointer
objects, addresses at the top of memory, negative-bit tensors - each run where a crash cannot
take pytest down), the private row converters
of `_half` (surfaces/test_half.py), a missing torch.distributed group or MPI engine
(surfaces/test_distributed.py), double backward (surfaces/test_torch_compile.py), and the
brute-force check that DirectML refuses exactly the self-overlapping output layouts
(surfaces/test_directml.py).
"""
import math
import re
from typing import Callable, NamedTuple, Optional, Tuple, Union

import numpy as np
import pytest

import bnbw_native
from bnbw_native import dml, half, ngraph, intel_spec, reference

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
requires_bf16 = pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")


def sentinel(shape, dtype=F32):
    a = np.empty(shape, dtype)
    a.reshape(-1).view(np.uint8)[...] = PATTERN
    return a


def named(name):
    """A regex matching `name` as a whole word (so "src" does not match "diff_src"); a tuple of
    names matches any one of them."""
    if isinstance(name, tuple):
        return "|".join(named(n) for n in name)
    return rf"(?<![\w\[]){re.escape(name)}(?![\w])"


def arrays_in(obj, found=None):
    """Every ndarray and writable raw buffer (bytearray, memoryview) reachable from obj (dicts,
    tuples, lists), each once."""
    found = [] if found is None else found
    if isinstance(obj, (np.ndarray, bytearray, memoryview)):
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
    return [np.asarray(a).tobytes() if isinstance(a, np.ndarray) else bytes(a) for a in arrays]


def assert_refused(call, kwargs, error, match, says=None, arrays=None):
    """call(**kwargs) raises `error` with a message matching `match` (and `says`, when given),
    and leaves every array reachable from kwargs (and `arrays`) as it was."""
    arrays = arrays_in(kwargs) + [a for a in (arrays or ()) if not any(a is b for b in
                                                                         arrays_in(kwargs))]
    before = snapshot(arrays)
    with pytest.raises(error, match=match) as refused:
        call(**kwargs)
    if says is not None:
        assert re.search(says, str(refused.value)), str(refused.value)
    assert snapshot(arrays) == before, "a refused call wrote to an array"
    return refused


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
RELU = ("relu_dst", "diff_residual")
FRONTS = {
    "graph": Front(GRAPH_NAMES, ("x", "dy", "mean", "var", "scale"),
                   ("epsilon", "data_format", "num_outputs", "num_threads") + RELU, 3),
    "graph1": Front(GRAPH_NAMES, ("x", "dy", "mean", "var", "scale"),
                    ("epsilon", "data_format", "num_outputs", "num_threads") + RELU, 1),
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
                    ("data_format", "num_threads", "relu_dst"), 0),
    "apply": Front(dict(x="x", dy="dy", mean="mean", var="variance", scale="gamma",
                        dx="diff_src", dscale="diff_gamma", dbias="diff_beta"),
                   ("x", "dy", "mean", "var", "scale"),
                   ("epsilon", "data_format", "num_threads", "partial", "count") + RELU, 3),
}
# the fronts with oneDNN's two storage groups: T1 for src and diff_dst, T2 for the statistics
T1_T2_FRONTS = ("graph", "graph1", "intel", "apply")


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


@pytest.mark.parametrize("front", sorted(f for f in FRONTS if "relu_dst" in FRONTS[f].options))
def test_valid_call_with_relu_succeeds(front):
    """The baseline of the relu_dst= and diff_residual= cases below is accepted too."""
    args = valid_args(front)
    args["relu_dst"] = relu_dst(args)
    if "diff_residual" in FRONTS[front].options:
        args["diff_residual"] = sentinel(SHAPE)
    invoke(front, args)
    if "diff_residual" in args:
        assert not (args["diff_residual"].view(np.uint8) == PATTERN).all()


def out_label(front, index):
    names = FRONTS[front].names
    return f"out[{index}] ({names[('dx', 'dscale', 'dbias')[index]]})"


class Case(NamedTuple):
    id: str
    applies: Callable[[str], bool]
    spoil: Callable[[dict, str], None]
    error: type
    name: Callable[[str], Union[str, Tuple[str, ...]]]   # front -> the name(s) the message names
    bug: Optional[str] = None           # a known defect: the case is xfail(strict)
    says: Optional[str] = None          # a regex the message must match as well
    marks: tuple = ()


def role_case(cid, role, value, error, only=None, says=None, marks=()):
    """Replace the argument of `role` by value(args) (a callable) or value."""
    def spoil(args, front):
        args[role] = value(args) if callable(value) else value
    applies = (lambda fr: role in FRONTS[fr].roles and (only is None or fr in only))
    return Case(f"{role}-{cid}", applies, spoil, error, lambda fr: FRONTS[fr].names[role],
                says=says, marks=marks)


def option_case(cid, option, value, error, only=None):
    def spoil(args, front):
        args[option] = value
    applies = (lambda fr: option in FRONTS[fr].options and (only is None or fr in only))
    return Case(f"{option}-{cid}", applies, spoil, error, lambda fr: option)


def out_case(cid, spoil, error, index, min_out=1, bug=None, marks=()):
    """index: the out entry the message names (None: "out" itself)."""
    applies = (lambda fr: FRONTS[fr].n_out >= min_out)
    name = (lambda fr: "out") if index is None else (lambda fr: out_label(fr, index))
    return Case(f"out-{cid}", applies, spoil, error, name, bug, marks=marks)


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
        role_case("int32", _role, lambda a, r=_role: (a[r] * 4).astype(np.int32), TypeError),
        role_case("uint16-bits", _role, lambda a, r=_role: a[r].view(np.uint16), TypeError),
    ]
    if _role in STAT_ROLES:
        CASES += [
            role_case("too-long", _role, np.ones(C + 1, F32), ValueError),
            role_case("too-short", _role, np.ones(C - 1, F32), ValueError),
            role_case("2-d-row", _role, np.ones((1, C), F32), ValueError),
            role_case("2-d-column", _role, np.ones((C, 1), F32), ValueError),
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
    role_case("rank-1", "dy", lambda a: a["dy"][:, 0, 0].copy(), ValueError),
]
if BF16 is not None:
    CASES.append(role_case("bfloat16", "dy", lambda a: a["dy"].astype(BF16), TypeError))


def _storage(t1, t2, changed=None):
    """src and diff_dst stored as t1, the statistics as t2; then `changed` = (role, type)."""
    def spoil(args, front):
        for role in ("x", "dy"):
            args[role] = args[role].astype(t1)
        for role in ("mean", "var", "scale"):
            args[role] = args[role].astype(t2)
        if changed is not None:
            args[changed[0]] = args[changed[0]].astype(changed[1])
    return spoil


# T1/T2 combinations outside the rule (T2 = bf16 only with T1 = bf16; never f16): the message
# names the statistics' type or src
for _t1, _t2 in [(F32, F16), (F16, F16), (F32, BF16), (F16, BF16), (BF16, F16)]:
    if BF16 is None and BF16 in (_t1, _t2):
        continue
    CASES.append(Case(f"storage-{_t1.name}-{_t2.name}", lambda fr: fr in T1_T2_FRONTS,
                      _storage(_t1, _t2), TypeError, lambda fr: (FRONTS[fr].names["mean"],
                                                                 FRONTS[fr].names["x"])))
# within a group the types agree: bf16 data with f32 statistics, one of them changed
if BF16 is not None:
    for _role, _t in [("dy", F16), ("var", BF16), ("scale", BF16)]:
        CASES.append(Case(f"{_role}-{_t.name}-in-bfloat16-float32-storage",
                          lambda fr: fr in T1_T2_FRONTS, _storage(BF16, F32, (_role, _t)),
                          TypeError, lambda fr, r=_role: FRONTS[fr].names[r]))

for _value, _error, _cid in [
        ("1e-3", TypeError, "string"), (None, TypeError, "none"), (True, TypeError, "bool"),
        (1e-3j, TypeError, "complex"), (np.array([1e-3]), TypeError, "1-d-array"),
        ([1e-3], TypeError, "list"), (0.0, ValueError, "zero"), (-0.0, ValueError, "minus-zero"),
        (-1e-3, ValueError, "negative"), (float("nan"), ValueError, "nan"),
        (float("inf"), ValueError, "inf"), (float("-inf"), ValueError, "minus-inf"),
        (1e-50, ValueError, "underflows-float32"), (1e39, ValueError, "overflows-float32"),
        (1e300, ValueError, "far-beyond-float32"),
        (10 ** 400, ValueError, "huge-int"), (np.float64(np.nan), ValueError, "numpy-nan")]:
    CASES.append(option_case(_cid, "epsilon", _value, _error))
for _value, _error, _cid in [(b"NCX", TypeError, "bytes"), (None, TypeError, "none"),
                             (1, TypeError, "int"), ("NCHW", ValueError, "NCHW"),
                             ("NHWC", ValueError, "NHWC"),
                             ("ncx", ValueError, "lower-case"), ("", ValueError, "empty")]:
    CASES.append(option_case(_cid, "data_format", _value, _error))
for _value, _error, _cid in [("3", TypeError, "string"), (3.0, TypeError, "float"),
                             (True, TypeError, "bool"), (None, TypeError, "none"),
                             (2, ValueError, "two"), (0, ValueError, "zero"),
                             (4, ValueError, "four"), (-1, ValueError, "negative")]:
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


def _shifted_over(args, front):
    """diff_dst and out[0] in one buffer, one element apart: they overlap without being the
    very same array."""
    base = np.empty(math.prod(SHAPE) + 1, F32)
    base[:-1] = args["dy"].reshape(-1)
    base[-1] = 0
    args["dy"] = base[:-1].reshape(SHAPE)
    args["out"] = (base[1:].reshape(SHAPE),) + tuple(args["out"][1:])


def _shifted_parameter_gradients(args, front):
    """diff_gamma and diff_beta in one buffer, one element apart."""
    base = sentinel(C + 1)
    args["out"] = (args["out"][0], base[:-1], base[1:])


CASES += [
    out_case("not-a-sequence", lambda a, f: a.update(out=a["out"][0]), TypeError, None),
    out_case("a-dict", lambda a, f: a.update(out={0: a["out"][0]}), TypeError, None),
    out_case("a-string", lambda a, f: a.update(out="out"), TypeError, None),
    out_case("an-int", lambda a, f: a.update(out=3), TypeError, None),
    out_case("an-iterator", lambda a, f: a.update(out=iter(a["out"])), TypeError, None),
    out_case("too-short", lambda a, f: a.update(out=a["out"][:-1]), ValueError, None),
    out_case("one-entry-of-three", lambda a, f: a.update(out=a["out"][:1]), ValueError, None,
             min_out=3),
    out_case("empty", lambda a, f: a.update(out=()), ValueError, None),
    out_case("too-long", lambda a, f: a.update(out=a["out"] + (sentinel(C),)), ValueError,
             None),
    out_case("two-too-many", lambda a, f: a.update(out=a["out"] + a["out"][:1] + (sentinel(C),)),
             ValueError, None),
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
    out_case("entry-rank-differs", _set_out(0, lambda a, o: sentinel(SHAPE + (1,))),
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
    out_case("dx-over-part-of-diff-dst", _shifted_over, ValueError, 0),
    out_case("dgamma-wrong-dtype", _set_out(1, lambda a, o: np.zeros(C, F16)), TypeError, 1,
             min_out=3),
    out_case("dgamma-float64", _set_out(1, lambda a, o: np.zeros(C)), TypeError, 1,
             min_out=3),
    out_case("dbeta-float16", _set_out(2, lambda a, o: np.zeros(C, F16)), TypeError, 2,
             min_out=3),
    out_case("dbeta-object", _set_out(2, lambda a, o: object()), TypeError, 2, min_out=3),
    out_case("dgamma-wrong-shape", _set_out(1, lambda a, o: sentinel((C, 1))), ValueError, 1,
             min_out=3),
    out_case("dgamma-wrong-length", _set_out(1, lambda a, o: sentinel(C + 1)), ValueError, 1,
             min_out=3),
    out_case("dbeta-wrong-length", _set_out(2, lambda a, o: sentinel(C + 1)), ValueError, 2,
             min_out=3),
    out_case("dbeta-2-d", _set_out(2, lambda a, o: sentinel((1, C))), ValueError, 2,
             min_out=3),
    out_case("dgamma-read-only", _set_out(1, lambda a, o: _read_only(sentinel(C))), ValueError,
             1, min_out=3),
    out_case("dbeta-read-only", _set_out(2, lambda a, o: _read_only(sentinel(C))), ValueError,
             2, min_out=3),
    out_case("dbeta-is-dgamma", _set_out(2, lambda a, o: o[1]), ValueError, 1, min_out=3),
    out_case("dbeta-shifted-over-dgamma", _shifted_parameter_gradients, ValueError, 1,
             min_out=3),
    out_case("dgamma-inside-dx", _set_out(1, lambda a, o: o[0][0, :, 0]), ValueError, 0,
             min_out=3),
    out_case("dgamma-over-mean", _set_out(1, lambda a, o: a["mean"]), ValueError, 1,
             min_out=3),
    out_case("dbeta-over-variance", _set_out(2, lambda a, o: a["var"]), ValueError, 2,
             min_out=3),
    out_case("dbeta-over-gamma", _set_out(2, lambda a, o: a["scale"]), ValueError, 2,
             min_out=3),
]
if BF16 is not None:
    CASES.append(out_case("dgamma-bfloat16", _set_out(1, lambda a, o: np.zeros(C, BF16)),
                          TypeError, 1, min_out=3))


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
    _partial_case("too-few-channels", lambda a, f: a.update(partial=np.zeros((2, C - 1))),
                  ValueError, "partial"),
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


# ---- relu_dst= and diff_residual= (contract 8) ----------------------------------------------

def relu_dst(args):
    """A valid relu_dst for `args`: the forward's output, some elements > 0, some not."""
    return (args["x"] - 3).astype(F32)


def _relu_case(cid, name, spoil, error, needs):
    """needs: the option the case's front must take ("relu_dst" or "diff_residual")."""
    def full_spoil(args, front):
        args["relu_dst"] = relu_dst(args)
        spoil(args)
    return Case(f"{name}-{cid}", lambda fr: needs in FRONTS[fr].options, full_spoil, error,
                lambda fr: name)


def _no_relu_dst(args, front):
    args["diff_residual"] = sentinel(SHAPE)


CASES += [
    Case("diff_residual-without-relu_dst", lambda fr: "diff_residual" in FRONTS[fr].options,
         _no_relu_dst, ValueError, lambda fr: "diff_residual"),
    _relu_case("wrong-shape", "relu_dst", lambda a: a.update(relu_dst=np.zeros((4, 3, 6), F32)),
               ValueError, "relu_dst"),
    _relu_case("float16", "relu_dst", lambda a: a.update(relu_dst=np.zeros(SHAPE, F16)),
               TypeError, "relu_dst"),
    _relu_case("int32", "relu_dst", lambda a: a.update(relu_dst=np.zeros(SHAPE, np.int32)),
               TypeError, "relu_dst"),
    _relu_case("string", "relu_dst", lambda a: a.update(relu_dst="y"), TypeError, "relu_dst"),
    _relu_case("wrong-shape", "diff_residual",
               lambda a: a.update(diff_residual=sentinel((4, 3, 6))), ValueError,
               "diff_residual"),
    _relu_case("float16", "diff_residual", lambda a: a.update(diff_residual=sentinel(SHAPE, F16)),
               TypeError, "diff_residual"),
    _relu_case("over-src", "diff_residual", lambda a: a.update(diff_residual=a["x"]),
               ValueError, "diff_residual"),
    _relu_case("over-part-of-diff_dst", "diff_residual",
               lambda a: a.update(diff_residual=a["dy"][::-1]), ValueError, "diff_residual"),
    _relu_case("over-relu_dst", "diff_residual",
               lambda a: a.update(diff_residual=a["relu_dst"]), ValueError, "diff_residual"),
    Case("diff_residual-over-diff_src", lambda fr: "diff_residual" in FRONTS[fr].options,
         lambda a, f: a.update(relu_dst=relu_dst(a), diff_residual=a["out"][0]), ValueError,
         lambda fr: ("diff_residual", "diff_src")),
]

ARRAY_CASES = [pytest.param(front, case, id=f"{front}:{case.id}",
                            marks=list(case.marks) + (
                                [pytest.mark.xfail(strict=True, reason=f"bug: {case.bug}")]
                                if case.bug else []))
               for case in CASES for front in FRONTS if case.applies(front)]


@pytest.mark.parametrize("front, case", ARRAY_CASES)
def test_array_front_refusal(front, case):
    args = valid_args(front)
    case.spoil(args, front)
    assert_refused(lambda **kw: invoke(front, kw), args, case.error, named(case.name(front)),
                   case.says)


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


# ---- any kind of array argument gets the refusal a NumPy array gets --------------------------

class Sub(np.ndarray):
    pass


def _torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch


KINDS = {"subclass": lambda a: a.view(Sub), "memoryview": lambda a: memoryview(a)}
if _torch_or_none() is not None:
    KINDS["torch (DLPack)"] = lambda a: _torch_or_none().from_numpy(a)

SPOILED_BY_KIND = {
    "x float64": dict(x=lambda a: a.astype(np.float64)),
    "dy shape": dict(dy=lambda a: a[:, :8]),
    "mean float16 (graph rule)": dict(mean=lambda a: a.astype(np.float16)),
    "var length": dict(var=lambda a: a[:8]),
    "gamma 2-D": dict(gamma=lambda a: a[None, :]),
}


@pytest.mark.parametrize("case", sorted(SPOILED_BY_KIND))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_of_array_gets_the_same_refusal(rng, case, kind):
    C16 = 16
    args = dict(x=rng.standard_normal((8, C16)).astype(F32),
                dy=rng.standard_normal((8, C16)).astype(F32),
                mean=rng.standard_normal(C16).astype(F32),
                var=(rng.random(C16) + 0.5).astype(F32),
                gamma=rng.standard_normal(C16).astype(F32))
    for role, spoil in SPOILED_BY_KIND[case].items():
        args[role] = np.ascontiguousarray(spoil(args[role]))
    call = lambda a: bnbw_native.batchnorm_training_backward(  # noqa: E731
        a["x"], a["dy"], a["mean"], a["var"], a["gamma"], epsilon=1e-5)
    with pytest.raises((TypeError, ValueError)) as plain:
        call(args)
    (role,) = SPOILED_BY_KIND[case]
    args[role] = KINDS[kind](args[role])
    with pytest.raises(plain.type) as other:
        call(args)
    assert str(other.value) == str(plain.value)


# ---- messages that teach -------------------------------------------------------------------

def test_float64_input_is_refused_with_the_conversion_to_use(rng):
    x = rng.standard_normal((8, 16))
    stats = np.ones(16, F32)
    with pytest.raises(TypeError, match=r"src .*float64.*\.astype\(np\.float32\)"):
        bnbw_native.batchnorm_training_backward(x, x.astype(F32), stats, stats, stats,
                                                epsilon=1e-5)


@pytest.mark.parametrize("shape, given, suggested", [
    ((8, 16, 5, 5), "NXC", "NCX"),        # NCHW data under the default data_format
    ((8, 5, 5, 16), "NCX", "NXC"),
])
def test_statistics_of_the_other_channel_axis_suggest_the_data_format(rng, shape, given,
                                                                      suggested):
    x = rng.standard_normal(shape).astype(F32)
    stats = np.ones(16, F32)
    with pytest.raises(ValueError, match=f"did you mean data_format='{suggested}'"):
        bnbw_native.batchnorm_training_backward(x, x, stats, stats, epsilon=1e-5,
                                                data_format=given)


def test_no_data_format_hint_where_the_convention_has_none(rng):
    x = rng.standard_normal((8, 5, 5, 16)).astype(F32)       # nGraph: always axis 1
    stats = np.ones(16, F32)
    with pytest.raises(ValueError) as refused:
        ngraph.batch_norm_training_backprop(x, stats, stats, stats, stats, x, epsilon=1e-5)
    assert "data_format" not in str(refused.value)


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
# DLPack producers (torch tensors and bare producers) as inputs and as out=
# =========================================================================================

@pytest.fixture
def torch():
    return pytest.importorskip("torch")


class Producer:
    """A bare DLPack producer around a NumPy array (what other libraries hand over)."""

    def __init__(self, array, versioned=True):
        self.array, self.versioned = array, versioned

    def __dlpack__(self, stream=None, **kwargs):
        # versioned: DLPack 1.x capsules, which carry the read-only flag; legacy: 0.x ones
        return self.array.__dlpack__(**kwargs) if self.versioned else self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def _tensor_batch(torch):
    """x, dy (6, 5, 4, 7) NCHW tensors and float32 statistics as tensors."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn((6, 5, 4, 7), generator=g) * 2 + 1
    dy = torch.randn((6, 5, 4, 7), generator=g)
    x64 = x.double()
    mean = x64.mean(dim=(0, 2, 3)).float()
    var = x64.var(dim=(0, 2, 3), unbiased=False).float()
    return dict(src=x, diff_dst=dy, mean=mean, variance=var,
                gamma=torch.rand(5, generator=g) + 0.5, epsilon=1e-3, data_format="NCX")


def _frozen(shape):
    a = np.zeros(shape, F32)
    a.flags.writeable = False
    return a


DLPACK_CASES = {
    # id: (spoil(kwargs, torch), error, message regex)
    "input-carrying-a-gradient": (lambda k, t: k.update(src=k["src"].requires_grad_()),
                                  TypeError, named("src")),
    "input-bfloat16-beside-float32": (lambda k, t: k.update(diff_dst=k["diff_dst"].bfloat16()),
                                      TypeError, named("diff_dst")),
    "out-read-only-producer": (lambda k, t: k.update(out=(k["out"][0], Producer(_frozen(5)),
                                                          k["out"][2])),
                               ValueError, r"out\[1\].*read-only"),
    "out-read-only-legacy-producer": (
        lambda k, t: k.update(out=(k["out"][0], Producer(_frozen(5), versioned=False),
                                   k["out"][2])), (TypeError, ValueError), r"out\[1\]"),
    "out-carrying-a-gradient": (lambda k, t: k.update(out=(k["out"][0].requires_grad_(),)
                                                      + k["out"][1:]), TypeError, r"out\[0\]"),
    "out-expanded": (lambda k, t: k.update(out=(t.zeros((5, 4, 7)).expand((6, 5, 4, 7)),)
                                           + k["out"][1:]), ValueError, r"out\[0\]"),
    # a negated view is read through a copy: an output over its memory overlaps it all the same
    "out-over-a-negative-bit-input": (
        lambda k, t: k.update(src=t._neg_view(k["out"][0])), ValueError,
        r"out\[0\] \(diff_src\) overlaps the input src"),
    # more elements than NumPy can view: a size that is wrong, not a wrong kind of object
    "input-expanded-past-numpy": (lambda k, t: k.update(src=t.zeros((1, 5, 4, 7)).expand(
        (2 ** 55, 5, 4, 7))), ValueError, r"src is too large"),
    # ... and so is one whose values would be copied (a negated view) into more than memory
    "negative-bit-input-expanded-past-numpy": (
        lambda k, t: k.update(src=t._neg_view(t.zeros((1, 5, 4, 7))).expand(
            (2 ** 55, 5, 4, 7))), ValueError, r"src is too large"),
}


@pytest.mark.parametrize("case", sorted(DLPACK_CASES))
def test_dlpack_refusal(torch, case):
    """Gradient-carrying tensors are no inputs, and a bfloat16 tensor beside float32 ones breaks
    the dtype rule as an array would; read-only producers (a DLPack 0.x capsule cannot say read-only: NumPy refuses to
    export it), gradient-carrying tensors and expanded tensors (all rows share one row of
    memory) are no outputs.  Nothing is written to the outputs given."""
    kwargs = _tensor_batch(torch)
    kwargs["out"] = (torch.full_like(kwargs["src"], 7.0), torch.full((5,), 7.0),
                     torch.full((5,), 7.0))
    spoil, error, match = DLPACK_CASES[case]
    spoil(kwargs, torch)
    outs = [o for o in kwargs["out"] if isinstance(o, torch.Tensor) and not o.requires_grad
            and o.stride()[0] != 0]
    before = [o.clone() for o in outs]
    with pytest.raises(error, match=match):
        bnbw_native.batchnorm_training_backward(**kwargs)
    for o, b in zip(outs, before):
        assert torch.equal(o, b), "a refused call wrote to an output tensor"


# =========================================================================================
# DirectML: TensorDesc, TensorDesc.from_array, the operators, execute, the conveniences
# =========================================================================================

POSITIVE = r"sizes\[\d\] must be a positive integer"
ONE_TO_EIGHT = "sizes must have 1 to 8 dimensions"
DESC_CASES = [
    # (id, args, kwargs, error, name[, says])
    ("data_type-unknown-name", ("float64", (2, 3)), {}, TypeError, "data_type"),
    ("data_type-int8-name", ("int8", (2, 3)), {}, TypeError, "data_type"),
    ("data_type-upper-case", ("FLOAT32", (2, 3)), {}, TypeError, "data_type"),
    ("data_type-upper-case-prefix", ("FLOAT", (2, 3)), {}, TypeError, "data_type"),
    ("data_type-none", (None, (2, 3)), {}, TypeError, "data_type"),
    ("data_type-int", (1, (2, 3)), {}, TypeError, "data_type"),
    ("data_type-numpy-int8", (np.int8, (2, 3)), {}, TypeError, "data_type"),
    ("data_type-numpy-float64", (np.float64, (2, 3)), {}, TypeError, "data_type"),
    ("data_type-uint16", ("uint16", (2, 3)), {}, TypeError, "data_type"),
    ("data_type-list", ([], (2, 3)), {}, TypeError, "data_type"),
    ("sizes-int", ("float32", 5), {}, TypeError, "sizes"),
    ("sizes-string", ("float32", "23"), {}, TypeError, "sizes"),
    ("sizes-none", ("float32", None), {}, TypeError, "sizes"),
    ("sizes-float-entry", ("float32", (2.0, 3)), {}, TypeError, "sizes"),
    ("sizes-string-entry", ("float32", ("2", 3)), {}, TypeError, "sizes"),
    ("sizes-bool-entry", ("float32", (True, 3)), {}, TypeError, "sizes"),
    ("sizes-none-entry", ("float32", (2, None)), {}, TypeError, "sizes"),
    ("sizes-only-entry-none", ("float32", (None,)), {}, TypeError, "sizes"),
    ("sizes-no-dims", ("float32", ()), {}, ValueError, "sizes", ONE_TO_EIGHT),
    ("sizes-9-dims", ("float32", (1,) * 9), {}, ValueError, "sizes", ONE_TO_EIGHT),
    ("sizes-zero", ("float32", (2, 0, 3)), {}, ValueError, "sizes", POSITIVE),
    ("sizes-zero-1-d", ("float32", (0,)), {}, ValueError, "sizes", POSITIVE),
    ("sizes-negative", ("float32", (-1, 3)), {}, ValueError, "sizes", POSITIVE),
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
    ("strides-one-of-two", ("float32", (2, 3), (3,)), {}, ValueError, "strides"),
    ("strides-too-many", ("float32", (2, 3), (3, 1, 1)), {}, ValueError, "strides"),
    ("strides-negative", ("float32", (2, 3), (-3, 1)), {}, ValueError, "strides"),
    ("strides-negative-one", ("float32", (2, 3), (-1, 1)), {}, ValueError, "strides"),
    ("strides-beyond-int64", ("float32", (2, 3), (2 ** 64, 1)), {}, ValueError, "strides"),
    ("strides-2^70", ("float32", (2, 3), (2 ** 70, 1)), {}, ValueError, "strides"),
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
    ("total-minus-four", ("float32", (2, 3)), dict(total_tensor_size_in_bytes=-4), ValueError,
     "total_tensor_size_in_bytes"),
    ("total-beyond-uint64", ("float32", (2, 3)), dict(total_tensor_size_in_bytes=2 ** 64),
     ValueError, "total_tensor_size_in_bytes"),
    ("total-below-strided-minimum", ("float32", (2, 3), (8, 2)),
     dict(total_tensor_size_in_bytes=24), ValueError, "total_tensor_size_in_bytes"),
]


def _says(case, n):
    """The optional trailing `says` regex of a case tuple whose fixed part has n entries."""
    return case[n] if len(case) > n else None


@pytest.mark.parametrize("args, kwargs, error, name, says",
                         [pytest.param(*c[1:5], _says(c, 5), id=c[0]) for c in DESC_CASES])
def test_tensor_desc_refusal(args, kwargs, error, name, says):
    with pytest.raises(error, match=named(name)) as refused:
        dml.TensorDesc(*args, **kwargs)
    if says is not None:
        assert re.search(says, str(refused.value)), str(refused.value)


@pytest.mark.parametrize("sizes, strides", [
    ((2 ** 62, 4), None), ((2 ** 31,) * 3, None), ((2 ** 70,), None),
    ((3, 2), (2 ** 62, 1)), ((2 ** 40, 2 ** 40), (1, 2 ** 40)), ((2 ** 61,), (2,)),
])
def test_tensor_desc_refuses_byte_counts_past_64_bits(sizes, strides):
    with pytest.raises(ValueError, match="64"):
        dml.TensorDesc("float32", sizes, strides)


FROM_ARRAY_CASES = [
    ("not-an-array", lambda: ([1.0, 2.0],), TypeError, "array"),
    ("numpy-scalar", lambda: (np.float32(1),), TypeError, "array"),
    ("float64", lambda: (np.zeros(3),), TypeError, "data_type"),
    ("int16", lambda: (np.zeros(3, np.int16),), TypeError, "data_type"),
    ("uint16-without-data-type", lambda: (np.zeros(3, np.uint16),), TypeError, "data_type"),
    ("bad-data-type", lambda: (np.zeros(3, F32), "float8"), TypeError, "data_type"),
    ("itemsize-differs", lambda: (np.zeros(3, F32), "bfloat16"), TypeError, "data_type"),
    ("negative-strides", lambda: (np.zeros((2, 3), F32)[::-1],), ValueError, "strides"),
    ("negative-strides-3-d", lambda: (np.zeros((4, 5, 6), F16)[::-1],), ValueError, "strides"),
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
STAT_MEMBERS = ("mean", "variance", "scale", "output_scale_gradient", "output_bias_gradient")
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


def _stats_shape(shape):
    def spoil(m):
        m.update({k: desc(shape) for k in STAT_MEMBERS})
    return spoil


def _overlapping_output(member, strides):
    """`member` described with `strides` over (2, 3, 4), or (1, 3, 4) for a statistics-shaped
    member (the other statistics then packed (1, 3, 4))."""
    def spoil(m):
        if member == "output_gradient":
            m[member] = dml.TensorDesc("float32", BIG, strides)
        else:
            m.update({k: desc((1, 3, 4)) for k in STAT_MEMBERS})
            m[member] = dml.TensorDesc("float32", (1, 3, 4), strides)
    return spoil


NEITHER_1_NOR_INPUTS = r"mean: sizes.*must be 1 .*or input's"
OPERATOR_CASES = [
    # (id, spoil, error, name[, says])
    ("input-not-a-desc", lambda m: m.update(input=np.zeros(BIG, F32)), TypeError, "input"),
    ("scale-none", lambda m: m.update(scale=None), TypeError, "scale"),
    ("output_bias_gradient-a-stats-tuple", lambda m: m.update(output_bias_gradient=STATS),
     TypeError, "output_bias_gradient"),
    ("variance-missing", lambda m: m.pop("variance"), TypeError, "variance"),
    ("epsilon-missing", lambda m: m.pop("epsilon"), TypeError, "epsilon"),
    ("unknown-member", lambda m: m.update(bias=desc(STATS)), TypeError, "bias"),
    ("output_gradient-other-data-type",
     lambda m: m.update(output_gradient=desc(BIG, "bfloat16")), TypeError, "output_gradient"),
    ("input_gradient-dimension-count", lambda m: m.update(input_gradient=desc((2, 3, 4, 1))),
     ValueError, "input_gradient", "input_gradient: sizes have"),
    ("mean-dimension-count", lambda m: m.update(mean=desc((3, 1))), ValueError, "mean"),
    ("mean-dimension-count-1", lambda m: m.update(mean=desc((3,))), ValueError, "mean",
     "mean: sizes have"),
    ("output_bias_gradient-dimension-count",
     lambda m: m.update(output_bias_gradient=desc((3,))), ValueError, "output_bias_gradient",
     "output_bias_gradient: sizes have"),
    ("input_gradient-sizes", lambda m: m.update(input_gradient=desc((2, 3, 5))), ValueError,
     "input_gradient", "input_gradient: sizes.*share sizes"),
    ("output_gradient-sizes", lambda m: m.update(output_gradient=desc((4, 3, 2))), ValueError,
     "output_gradient"),
    ("output_gradient-sizes-last-dim", lambda m: m.update(output_gradient=desc((2, 3, 5))),
     ValueError, "output_gradient", "output_gradient: sizes.*share sizes"),
    ("output_scale_gradient-sizes", lambda m: m.update(output_scale_gradient=desc((1, 1, 1))),
     ValueError, "output_scale_gradient"),
    ("mean-size-neither-1-nor-input", _stats_shape((1, 2, 1)), ValueError, "mean",
     NEITHER_1_NOR_INPUTS),
    ("mean-size-neither-1-nor-input-dim-0", _stats_shape((2, 2, 1)), ValueError, "mean",
     NEITHER_1_NOR_INPUTS),
    ("mean-size-neither-1-nor-input-dim-2", _stats_shape((1, 3, 3)), ValueError, "mean",
     NEITHER_1_NOR_INPUTS),
    ("mean-size-beyond-input", _stats_shape((1, 4, 1)), ValueError, "mean",
     NEITHER_1_NOR_INPUTS),
    ("epsilon-zero", lambda m: m.update(epsilon=0.0), ValueError, "epsilon"),
    ("epsilon-negative", lambda m: m.update(epsilon=-1e-5), ValueError, "epsilon"),
    ("epsilon-nan", lambda m: m.update(epsilon=float("nan")), ValueError, "epsilon"),
    ("epsilon-inf", lambda m: m.update(epsilon=float("inf")), ValueError, "epsilon"),
    ("epsilon-underflows-float32", lambda m: m.update(epsilon=1e-50), ValueError, "epsilon"),
    ("epsilon-overflows-float32", lambda m: m.update(epsilon=1e39), ValueError, "epsilon"),
    ("epsilon-string", lambda m: m.update(epsilon="1e-3"), TypeError, "epsilon"),
    ("epsilon-none", lambda m: m.update(epsilon=None), TypeError, "epsilon"),
    ("epsilon-bool", lambda m: m.update(epsilon=True), TypeError, "epsilon"),
    ("epsilon-complex", lambda m: m.update(epsilon=1e-5j), TypeError, "epsilon"),
    ("output_gradient-strides-collide",
     lambda m: m.update(output_gradient=desc(BIG, strides=(4, 3, 1))), ValueError,
     "output_gradient"),
    ("output_scale_gradient-stride-0",
     lambda m: m.update(output_scale_gradient=desc(STATS, strides=(0, 0, 0))), ValueError,
     "output_scale_gradient"),
    ("output_gradient-overlap-undecided", _undecided, ValueError, "output_gradient"),
]
OPERATOR_CASES += [(f"{member}-a-tuple", lambda m, k=member: m.update({k: BIG}), TypeError,
                    member) for member in MEMBERS]
OPERATOR_CASES += [
    (f"{member}-float16", lambda m, k=member: m.update(
        {k: desc(BIG if k in ("input_gradient", "output_gradient") else STATS, "float16")}),
     TypeError, member, f"{member}: data_type float16 differs") for member in MEMBERS[1:]]
OPERATOR_CASES += [
    (f"{member}-sizes-(1, 3, 4)", lambda m, k=member: m.update({k: desc((1, 3, 4))}),
     ValueError, member, f"{member}: sizes.*share sizes")
    for member in ("variance", "scale", "output_scale_gradient", "output_bias_gradient")]
OPERATOR_CASES += [
    (f"{member}-{label}", _overlapping_output(member, strides), ValueError, member,
     f"{member}: .*{why}")
    for member in OUTPUTS
    for label, strides, why in [("stride-0", (12, 0, 1), r"strides\[1\] is 0"),
                                ("strides-1-1-1", (1, 1, 1), "share memory"),
                                ("strides-12-1-2", (12, 1, 2), "share memory"),
                                ("strides-6-2-1", (6, 2, 1), "share memory")]]


@pytest.mark.parametrize("kind", sorted(OPERATORS))
@pytest.mark.parametrize("spoil, error, name, says",
                         [pytest.param(*c[1:4], _says(c, 4), id=c[0]) for c in OPERATOR_CASES])
def test_operator_refusal(kind, spoil, error, name, says):
    m = valid_members()
    OPERATORS[kind](**m)                       # the baseline is valid
    spoil(m)
    with pytest.raises(error, match=named(name)) as refused:
        OPERATORS[kind](**m)
    if says is not None:
        assert re.search(says, str(refused.value)), str(refused.value)


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


def _read_only_copy(a):
    return _read_only(np.array(a))


READ_ONLY_KINDS = {"bytes": lambda a: a.tobytes(), "read-only-array": _read_only_copy,
                   "read-only-memoryview": lambda a: memoryview(a.tobytes())}
WRONG_KINDS = {"string": "abc", "list": [1.0] * 24, "float": 1.5, "none": None, "bool": True,
               "object": object(), "object-array": np.full(24, 1.0, dtype=object)}

EXECUTE_CASES = [
    # (id, spoil, error, name[, says])
    ("mean-object-array", _bind("mean", lambda b: np.full(3, 1.0, object)), TypeError, "mean"),
    ("mean-null-address", _bind("mean", lambda b: 0), ValueError, "mean"),
    ("output_gradient-null-address", _bind("output_gradient", lambda b: 0), ValueError,
     "output_gradient"),
    ("scale-null-address", _bind("scale", lambda b: 0), ValueError, "scale",
     "scale: an integer address"),
    ("scale-negative-address", _bind("scale", lambda b: -8), ValueError, "scale",
     "scale: an integer address"),
    ("scale-address-beyond-pointer", _bind("scale", lambda b: 2 ** 64), ValueError, "scale"),
    ("variance-too-small-bytearray", _bind("variance", lambda b: bytearray(11)), ValueError,
     "variance"),
    ("output_gradient-too-small", _bind("output_gradient", lambda b: sentinel(23)), ValueError,
     "output_gradient"),
    ("output_bias_gradient-empty", _bind("output_bias_gradient", lambda b: bytearray()),
     ValueError, "output_bias_gradient"),
    ("input-misaligned", _bind("input", lambda b: memoryview(bytearray(97))[1:]), ValueError,
     "input", r"input: address .* not aligned"),
    ("output_gradient-misaligned", _bind("output_gradient",
                                         lambda b: memoryview(bytearray(97))[1:]),
     ValueError, "output_gradient", r"output_gradient: address .* not aligned"),
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
    ("num_threads-minus-two", lambda b: b.update(num_threads=-2), ValueError, "num_threads"),
    ("num_threads-float", lambda b: b.update(num_threads=1.5), TypeError, "num_threads"),
    ("num_threads-string", lambda b: b.update(num_threads="2"), TypeError, "num_threads"),
    ("num_threads-bool", lambda b: b.update(num_threads=True), TypeError, "num_threads"),
    ("variance-missing", lambda b: b.pop("variance"), TypeError, "variance"),
    ("unknown-member", lambda b: b.update(bias=np.zeros(3, F32)), TypeError, "bias"),
]
EXECUTE_CASES += [
    (f"{member}-one-element-short", _bind(member, lambda b, k=member: np.asarray(b[k])
                                          .reshape(-1)[:-1]),
     ValueError, member, f"{member}: the buffer holds") for member in MEMBERS]
EXECUTE_CASES += [
    (f"{member}-{label}", _bind(member, lambda b, k=member, make=make: make(b[k])), ValueError,
     member, f"{member}: .*read-only")
    for member in OUTPUTS for label, make in READ_ONLY_KINDS.items()]
EXECUTE_CASES += [
    (f"{member}-non-contiguous-{label}", _bind(member, make), ValueError, member,
     f"{member}: .*not contiguous")
    for member in ("input", "output_gradient")
    for label, make in [("array", _noncontiguous),
                        ("memoryview", lambda b: memoryview(np.zeros(48, F32))[::2])]]
EXECUTE_CASES += [
    (f"{member}-{label}", _bind(member, lambda b, obj=obj: obj), TypeError, member)
    for member in ("input", "output_bias_gradient") for label, obj in WRONG_KINDS.items()]


@pytest.mark.parametrize("kind", sorted(OPERATORS))
@pytest.mark.parametrize("spoil, error, name, says",
                         [pytest.param(*c[1:4], _says(c, 4), id=c[0]) for c in EXECUTE_CASES])
def test_execute_refusal(kind, spoil, error, name, says):
    op, bufs = valid_execute(kind)
    outputs = [bufs[k] for k in OUTPUTS]
    spoil(bufs)
    assert_refused(op.execute, bufs, error, named(name), says, arrays=outputs)


def test_execute_strided_descriptor_reaching_past_the_buffer():
    """A descriptor whose strides reach further than the packed buffer bound to it."""
    strided = desc(BIG, strides=(24, 8, 2))       # minimum (24 + 16 + 6 + 1) * 4 = 188 bytes
    m = valid_members()
    m.update(input=strided, input_gradient=strided)
    op = dml.BatchNormalizationTrainingGrad(**m)
    _, bufs = valid_execute("training_grad")
    assert_refused(op.execute, bufs, ValueError, named("input") + ".*at least 188")


@pytest.mark.parametrize("sizes, strides", [(BIG, (1, 2, 6)), ((4, 6), (1, 4))],
                         ids=["3-d", "2-d"])
def test_execute_in_place_needs_identical_descriptors(sizes, strides):
    """output_gradient may be input_gradient's very buffer only under the very same
    descriptor: here another layout of the same sizes."""
    stats = (1, sizes[1]) + (1,) * (len(sizes) - 2)
    m = {k: desc(sizes if k in ("input", "input_gradient", "output_gradient") else stats)
         for k in MEMBERS}
    m["output_gradient"] = desc(sizes, strides=strides)
    op = dml.BatchNormalizationGrad(**m, epsilon=1e-3)
    rng = np.random.default_rng(1)
    dy = rng.normal(size=sizes).astype(F32)
    bufs = dict(input=rng.normal(size=sizes).astype(F32), input_gradient=dy,
                mean=np.zeros(stats, F32), variance=np.ones(stats, F32),
                scale=np.ones(stats, F32), output_gradient=dy,
                output_scale_gradient=sentinel(stats), output_bias_gradient=sentinel(stats))
    assert_refused(op.execute, bufs, ValueError,
                   named("output_gradient") + " overlaps input_gradient.*identical")


@pytest.mark.parametrize("output, other, says", [
    ("output_gradient", "input", "overlaps the input input"),
    ("output_gradient", "mean", None),
    ("output_scale_gradient", "mean", "overlaps the input mean"),
    ("output_bias_gradient", "scale", "overlaps the input scale"),
    ("output_bias_gradient", "output_scale_gradient", "outputs must not overlap each other"),
])
def test_execute_refuses_outputs_over_other_buffers(output, other, says):
    """An output bound to memory that another buffer's extent reaches (a shifted view)."""
    op, bufs = valid_execute("training_grad")
    outputs = [bufs[k] for k in OUTPUTS]
    raw = np.full(64, 7.0, F32)
    bufs[output] = raw
    bufs[other] = raw[2:] if output == "output_gradient" else raw
    assert_refused(op.execute, bufs, ValueError, says or "overlap", arrays=outputs)


def test_execute_refuses_int_addresses_whose_extents_overlap():
    """Integer addresses are trusted, but their extents come from the descriptors: 12-byte
    statistics 8 bytes apart overlap (12 bytes apart they do not: see test_directml.py)."""
    op, bufs = valid_execute("training_grad")
    raw = np.full(64, 7.0, F32)
    base = raw.ctypes.data
    bufs.update(output_scale_gradient=base, output_bias_gradient=base + 8)
    assert_refused(op.execute, bufs, ValueError, "overlap", arrays=[raw])


CONVENIENCE_CASES = [
    # (id, changes, error, name[, says])
    ("input-none", dict(input=None), TypeError, "input"),
    ("input-string", dict(input="abc"), TypeError, "input"),
    ("input-ragged", dict(input=[[1.0], [1.0, 2.0]]), TypeError, "input"),
    ("input-float64", dict(input=np.zeros(BIG)), TypeError, "input", "input must be a float32"),
    ("input-uint16", dict(input=np.zeros(BIG, np.uint16)), TypeError, "input"),
    ("input_gradient-float16", dict(input_gradient=np.zeros(BIG, F16)), TypeError,
     "input_gradient", "input_gradient: data_type float16 differs"),
    ("mean-float16", dict(mean=np.zeros(STATS, F16)), TypeError, "mean"),
    ("mean-list", dict(mean=np.zeros(STATS).tolist()), TypeError, "mean"),
    ("scale-uint16", dict(scale=np.zeros(STATS, np.uint16)), TypeError, "scale"),
    ("variance-none", dict(variance=None), TypeError, "variance"),
    ("scale-object", dict(scale=object()), TypeError, "scale"),
    ("input-0-d", dict(input=np.zeros((), F32), input_gradient=np.zeros((), F32)), ValueError,
     "input", "input must have 1 to 8"),
    ("input-9-d", dict(input=np.zeros((1,) * 9, F32), input_gradient=np.zeros((1,) * 9, F32)),
     ValueError, "input"),
    ("input_gradient-shape", dict(input_gradient=np.zeros((2, 3, 5), F32)), ValueError,
     "input_gradient"),
    ("mean-rank", dict(mean=np.zeros(3, F32)), ValueError, "mean",
     "mean: sizes have 1 dimensions, input's 3"),
    ("mean-size-neither-1-nor-input", dict(mean=np.zeros((1, 2, 1), F32)), ValueError, "mean",
     r"mean: sizes\[1\] must be 1"),
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
@pytest.mark.parametrize("changes, error, name, says",
                         [pytest.param(*c[1:4], _says(c, 4), id=c[0])
                          for c in CONVENIENCE_CASES])
def test_dml_convenience_refusal(kind, changes, error, name, says):
    rng = np.random.default_rng(2)
    kwargs = dict(input=rng.normal(size=BIG).astype(F32),
                  input_gradient=rng.normal(size=BIG).astype(F32), mean=np.zeros(STATS, F32),
                  variance=np.ones(STATS, F32), scale=np.ones(STATS, F32), epsilon=1e-3)
    CONVENIENCES[kind](**kwargs)
    kwargs.update(changes)
    assert_refused(CONVENIENCES[kind], kwargs, error, named(name), says)


# =========================================================================================
# bnbw_native.half: the four conversion helpers
# =========================================================================================

def _bf16_or_bits():
    return BF16 if BF16 is not None else np.dtype(np.uint16)


# name -> (function, source dtype, result dtype); the bfloat16 ones need ml_dtypes here
HALF = {
    "float32_to_float16": (half.float32_to_float16, F32, F16),
    "float16_to_float32": (half.float16_to_float32, F16, F32),
    "float32_to_bfloat16": (half.float32_to_bfloat16, F32, _bf16_or_bits()),
    "bfloat16_to_float32": (half.bfloat16_to_float32, _bf16_or_bits(), F32),
}


def half_params():
    return [pytest.param(name, id=name, marks=requires_bf16 if "bfloat16" in name else ())
            for name in HALF]


def _half_params_with(table):
    return [pytest.param(name, value, id=f"{name}-{np.dtype(value).str if label is None else label}",
                         marks=requires_bf16 if "bfloat16" in name else ())
            for name, values in table.items() for value, label in values]


HALF_WRONG_SOURCE = {
    "float32_to_float16": [(np.float64, "float64"), (np.float16, "float16"), (np.int32, "int32"),
                           (np.uint32, "uint32")],
    "float16_to_float32": [(np.float32, "float32"), (np.uint16, "uint16"), (np.int16, "int16")],
    "float32_to_bfloat16": [(np.float64, "float64"), (np.float16, "float16"),
                            (np.uint32, "uint32")],
    "bfloat16_to_float32": [(np.float32, "float32"), (np.float16, "float16"), (np.int16, "int16"),
                            (np.int32, "int32")],
}


@pytest.mark.parametrize("name, dtype", _half_params_with(HALF_WRONG_SOURCE))
def test_half_refuses_a_source_of_another_type(name, dtype):
    func, _, result = HALF[name]
    out = sentinel((4, 5), result)
    refused = assert_refused(func, dict(a=np.ones((4, 5), dtype), out=out), TypeError, "'a'")
    assert np.dtype(dtype).name in str(refused.value)


def test_half_float64_refusal_says_the_source_must_be_float32():
    with pytest.raises(TypeError, match="source type must be float32"):
        half.float32_to_float16(np.ones(3))


@pytest.mark.parametrize("name", half_params())
@pytest.mark.parametrize("junk", [None, "abc", object(), {"a": 1}, [[1.0], [1.0, 2.0]], 1.5],
                         ids=["None", "str", "object", "dict", "ragged", "python_float"])
def test_half_refuses_a_source_that_is_no_array(name, junk):
    func, _, result = HALF[name]
    assert_refused(func, dict(a=junk, out=sentinel((), result)), TypeError, "'a'")


@pytest.mark.parametrize("name", half_params())
@pytest.mark.parametrize("junk", [[0.0] * 6, "abc", 3, memoryview(bytearray(12))],
                         ids=["list", "str", "int", "memoryview"])
def test_half_refuses_an_out_that_is_no_array(name, junk):
    func, source, _ = HALF[name]
    with pytest.raises(TypeError, match="'out'"):
        func(np.zeros(6, source), out=junk)


HALF_WRONG_OUT = {
    "float32_to_float16": [(np.float32, None), (np.uint16, None), (np.int16, None),
                           (np.dtype(">f2"), None)],
    "float16_to_float32": [(np.float16, None), (np.float64, None), (np.uint32, None),
                           (np.dtype(">f4"), None)],
    "float32_to_bfloat16": [(np.float16, None), (np.int16, None), (np.float32, None),
                            (np.dtype(">u2"), None)],
    "bfloat16_to_float32": [(np.float64, None), (np.uint32, None), (np.uint16, None)],
}


@pytest.mark.parametrize("name, dtype", _half_params_with(HALF_WRONG_OUT))
def test_half_refuses_an_out_of_another_type(name, dtype):
    func, source, _ = HALF[name]
    assert_refused(func, dict(a=np.zeros((3, 4), source), out=sentinel((3, 4), dtype)),
                   TypeError, "'out'")


@pytest.mark.parametrize("name", half_params())
@pytest.mark.parametrize("shape", [(4, 3), (12,), (1, 3, 4), (3, 5), ()])
def test_half_refuses_an_out_of_another_shape(name, shape):
    func, source, result = HALF[name]
    assert_refused(func, dict(a=np.zeros((3, 4), source), out=sentinel(shape, result)),
                   ValueError, "'out'")


@pytest.mark.parametrize("name", half_params())
def test_half_refuses_a_read_only_out(name):
    func, source, result = HALF[name]
    assert_refused(func, dict(a=np.zeros((3, 4), source), out=_read_only(sentinel((3, 4), result))),
                   ValueError, "'out'.*writable")


@pytest.mark.parametrize("name", half_params())
@pytest.mark.parametrize("where", ["same_start", "one_element_in", "last_element_only"])
def test_half_refuses_an_out_overlapping_the_source(name, where):
    """`out` carved from the bytes of `a`, from full overlap down to a single element."""
    func, source, result = HALF[name]
    n = 16
    src = np.random.default_rng(5).integers(0, 1 << 16, n).astype(np.uint16)
    src = src.view(source) if source.itemsize == 2 else src.astype(np.uint32).view(source)
    buf = np.zeros(src.nbytes + n * result.itemsize, np.uint8)
    a = buf[: src.nbytes].view(source)
    a[...] = src
    start = {"same_start": 0, "one_element_in": src.itemsize,
             "last_element_only": src.nbytes - src.itemsize}[where]
    out = buf[start:][: n * result.itemsize].view(result)
    assert_refused(func, dict(a=a, out=out), ValueError, "'out'.*overlap", arrays=[buf])


@pytest.mark.parametrize("name", half_params())
@pytest.mark.parametrize("num_threads, error", [(0, ValueError), (-3, ValueError),
                                                (1.5, TypeError), ("2", TypeError),
                                                (True, TypeError)])
def test_half_refuses_bad_num_threads(name, num_threads, error):
    func, source, result = HALF[name]
    assert_refused(func, dict(a=np.zeros(5, source), out=sentinel(5, result),
                              num_threads=num_threads), error, "num_threads")


@requires_bf16
def test_half_without_ml_dtypes_refuses_bfloat16_arrays(monkeypatch):
    """Without ml_dtypes, bfloat16 travels as uint16 bit patterns: arrays of ml_dtypes'
    bfloat16 (which a caller could still hold) are refused, as source and as out."""
    monkeypatch.setattr(half, "ml_dtypes", None)
    with pytest.raises(TypeError, match="'a'.*uint16"):
        half.bfloat16_to_float32(np.zeros(3, BF16))
    assert_refused(half.float32_to_bfloat16, dict(a=np.zeros(3, F32), out=sentinel(3, BF16)),
                   TypeError, "'out'.*uint16")


# =========================================================================================
# The PyTorch layers
# =========================================================================================

def _torch_input(torch, kind):
    return {"channels": lambda: torch.ones(4, 5, 3),
            "float64-into-float32-layer": lambda: torch.ones(4, 3, 2, dtype=torch.float64),
            "int": lambda: torch.ones(4, 3, dtype=torch.int32),
            "one-value": lambda: torch.ones(1, 3),
            "ndarray": lambda: np.ones((4, 3), F32)}[kind]()


TORCH_LAYER_CASES = [
    ("channels", ValueError, "num_features"),
    ("float64-into-float32-layer", TypeError, r"weight must be float64.*double"),
    ("int", TypeError, "float32"),
    ("one-value", ValueError, "more than 1 value"),
    ("ndarray", TypeError, "torch.Tensor"),
]


@pytest.mark.parametrize("layer", ["BatchNorm", "BatchNormReLU"])
@pytest.mark.parametrize("kind, error, match", TORCH_LAYER_CASES,
                         ids=[c[0] for c in TORCH_LAYER_CASES])
def test_torch_layer_refusal(torch, layer, kind, error, match):
    from bnbw_native import autograd
    module = getattr(autograd, layer)(3)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(error, match=match):
        module(_torch_input(torch, kind))
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items()), \
        "a refused call changed the layer's state"
    if kind in ("one-value", "int", "ndarray"):          # the functional form refuses alike
        with pytest.raises(error, match=match):
            autograd.batch_norm(_torch_input(torch, kind), relu=layer == "BatchNormReLU")


@pytest.mark.parametrize("layer", ["BatchNorm", "BatchNormReLU"])
@pytest.mark.parametrize("options, error, match", [
    (dict(eps=float("nan")), ValueError, "eps must be finite and > 0"),
    (dict(eps=0.0), ValueError, "eps must be finite and > 0"),
    (dict(eps=-1e-5), ValueError, "eps must be finite and > 0"),
    (dict(eps=float("inf")), ValueError, "eps must be finite and > 0"),
    (dict(eps=1e-50), ValueError, "eps must be finite and > 0"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(num_threads=1.5), TypeError, "num_threads"),
], ids=["eps-nan", "eps-0", "eps-negative", "eps-inf", "eps-underflows", "threads-0",
        "threads-float"])
def test_torch_layer_options_refused_when_made(torch, layer, options, error, match):
    """torch.nn.BatchNorm2d takes eps=nan and returns NaN; these layers refuse it when made
    (and the functional form when called)."""
    from bnbw_native import autograd
    with pytest.raises(error, match=match):
        getattr(autograd, layer)(3, **options)
    with pytest.raises(error, match=match):
        autograd.batch_norm(torch.randn(4, 3), **options)


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


# =========================================================================================
# show_config
# =========================================================================================

def test_show_config_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be one of 'stdout', 'dicts', got 'dict'"):
        bnbw_native.show_config(mode="dict")

# =========================================================================================
# The training forward (contract 10): the array front-end and its descriptor operator
# =========================================================================================

FWD_EPS = 1e-5


def _forward_problem():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    stats = [rng.standard_normal(3).astype(np.float32), (0.5 + rng.random(3)).astype(np.float32),
             rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)]
    return x, stats


def sentinel_outputs(x, C, dtype=np.float32):
    return (np.full_like(x, 7), *(np.full(C, 7, dtype) for _ in range(4)))


def untouched(outputs):
    return all((np.asarray(o, np.float64) == 7).all() for o in outputs)


FORWARD_CASES = [
    ("src", dict(src=np.zeros((4, 3), np.float64)), TypeError, "src"),
    ("src rank", dict(src=np.zeros(3, np.float32)), ValueError, "src"),
    ("mean length", dict(mean=np.zeros(4, np.float32)), ValueError, "mean"),
    ("variance dtype", dict(variance=np.zeros(3, np.float16)), TypeError, "variance"),
    ("gamma shape", dict(gamma=np.zeros((3, 1), np.float32)), ValueError, "gamma"),
    ("beta dtype", dict(beta=np.zeros(3, np.float64)), TypeError, "beta"),
    ("epsilon zero", dict(epsilon=0.0), ValueError, "epsilon"),
    ("epsilon tiny", dict(epsilon=1e-50), ValueError, "epsilon"),
    ("epsilon str", dict(epsilon="1e-5"), TypeError, "epsilon"),
    ("momentum above 1", dict(momentum=1.5), ValueError, "momentum"),
    ("momentum negative", dict(momentum=-0.1), ValueError, "momentum"),
    ("momentum nan", dict(momentum=float("nan")), ValueError, "momentum"),
    ("momentum None", dict(momentum=None), TypeError, "momentum"),
    ("momentum str", dict(momentum="0.9"), TypeError, "momentum"),
    ("data_format", dict(data_format="NHWC"), ValueError, "data_format"),
    ("fuse_relu int", dict(fuse_relu=1), TypeError, "fuse_relu"),
    ("num_threads", dict(num_threads=0), ValueError, "num_threads"),
    ("num_threads huge", dict(num_threads=2 ** 64), ValueError, "num_threads"),
]


@pytest.mark.parametrize("name, change, error, says", FORWARD_CASES,
                         ids=[r[0] for r in FORWARD_CASES])
def test_forward_refusal(name, change, error, says):
    x, (mean, var, gamma, beta) = _forward_problem()
    out = sentinel_outputs(x, 3)
    m, v = mean.copy(), var.copy()
    args = dict(src=x, mean=m, variance=v, gamma=gamma, beta=beta, epsilon=FWD_EPS, out=out)
    args.update(change)
    if "out" not in change and (args["src"].shape != x.shape or args["src"].dtype != x.dtype):
        args.pop("out")
    src = args.pop("src")
    with pytest.raises(error, match=named(says)):
        bnbw_native.batchnorm_training_forward(src, **args)
    assert untouched(out)
    assert np.array_equal(m, mean) and np.array_equal(v, var)


FORWARD_OUT_CASES = [
    ("four outputs", lambda o: o[:4], ValueError, r"out must hold 5"),
    ("not a tuple", lambda o: o[0], TypeError, r"out must be a tuple"),
    ("dst dtype", lambda o: (o[0].astype(np.float16), *o[1:]), TypeError, r"out\[0\] \(dst\)"),
    ("dst shape", lambda o: (o[0][:2], *o[1:]), ValueError, r"out\[0\] \(dst\)"),
    ("batch_mean shape", lambda o: (*o[:3], o[3][:2], o[4]), ValueError,
     r"out\[3\] \(batch_mean\)"),
    ("running_variance read-only", lambda o: (*o[:2], readonly(o[2]), *o[3:]), ValueError,
     r"out\[2\] \(running_variance\)"),
    ("two outputs overlap", lambda o: (o[0], o[1], o[1], o[3], o[4]), ValueError, "overlaps"),
]


def readonly(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("name, edit, error, message", FORWARD_OUT_CASES,
                         ids=[r[0] for r in FORWARD_OUT_CASES])
def test_forward_out_refusal(name, edit, error, message):
    x, stats = _forward_problem()
    out = sentinel_outputs(x, 3)
    with pytest.raises(error, match=message):
        bnbw_native.batchnorm_training_forward(x, *stats, epsilon=FWD_EPS, out=edit(out))
    assert untouched(out)


def test_forward_in_place_only_for_its_three_pairs():
    x, (mean, var, gamma, beta) = _forward_problem()
    m, v = mean.copy(), var.copy()
    out = sentinel_outputs(x, 3)
    for bad in [(out[0], v, out[2], out[3], out[4]),          # running_mean over variance
                (out[0], out[1], out[2], m, out[4]),          # batch_mean over mean
                (out[0], gamma, out[2], out[3], out[4]),
                (x[::-1], *out[1:])]:                         # dst over src, another view
        with pytest.raises(ValueError, match="overlaps"):
            bnbw_native.batchnorm_training_forward(x, m, v, gamma, beta, epsilon=FWD_EPS, out=bad)
    assert np.array_equal(m, mean) and np.array_equal(v, var) and untouched(out)


def test_forward_statistics_dtypes_follow_the_graph_rule():
    x = np.random.default_rng(3).standard_normal((4, 3)).astype(np.float16)
    s16 = np.ones(3, np.float16)
    with pytest.raises(TypeError, match="mean"):
        bnbw_native.batchnorm_training_forward(x, s16, s16, epsilon=FWD_EPS)
    if BF16 is not None:
        sb = np.ones(3, BF16)
        with pytest.raises(TypeError, match="mean"):
            bnbw_native.batchnorm_training_forward(x, sb, sb, epsilon=FWD_EPS)
        xb = x.astype(BF16)
        got = bnbw_native.batchnorm_training_forward(xb, sb, sb, epsilon=FWD_EPS)
        assert got.batch_mean.dtype == BF16 and got.dst.dtype == BF16




def _training_operator(sizes, strides, C, **kw):
    big = dml.TensorDesc("float32", sizes, strides=strides)
    stat = dml.TensorDesc("float32", (1, C) + (1,) * (len(sizes) - 2))
    members = dict(input=big, mean=stat, variance=stat, output=big, output_running_mean=stat,
                   output_running_variance=stat, output_batch_mean=stat,
                   output_batch_variance=stat)
    members.update(kw.pop("members", {}))
    return dml.BatchNormalizationTraining(**members, epsilon=FWD_EPS, **kw)


def test_forward_descriptor_operator_refusal():
    with pytest.raises(ValueError, match="momentum"):
        _training_operator((2, 3, 4), None, 3, momentum=1.25)
    with pytest.raises(ValueError, match="output_batch_mean: sizes"):
        _training_operator((2, 3, 4), None, 3,
                           members=dict(output_batch_mean=dml.TensorDesc("float32", (1, 3, 4))))
    with pytest.raises(TypeError, match="fuse_relu"):
        _training_operator((2, 3, 4), None, 3, fuse_relu="yes")
    op = _training_operator((2, 3, 4), None, 3)
    x = np.ones((2, 3, 4), np.float32)
    s = [np.ones(3, np.float32) for _ in range(6)]
    with pytest.raises(ValueError, match="scale: the operator was made without it"):
        op.execute(input=x, mean=s[0], variance=s[1], scale=s[2], output=np.empty_like(x),
                   output_running_mean=s[3], output_running_variance=s[4],
                   output_batch_mean=s[5], output_batch_variance=np.empty(3, np.float32))
    y = np.full_like(x, 7)
    with pytest.raises(ValueError, match="output_running_mean overlaps the input variance"):
        op.execute(input=x, mean=s[0], variance=s[1], output=y, output_running_mean=s[1],
                   output_running_variance=s[4], output_batch_mean=s[5],
                   output_batch_variance=np.empty(3, np.float32))
    assert (y == 7).all()


# ---- outputs over an input the call reads through a copy ----------------------------------

_COPIED_NAMES = ("src", "diff_dst", "mean", "variance", "gamma")


def _copied_case(rng, name, how, overlapping):
    """batchnorm_training_backward's arguments with input `name` in a raw buffer that also holds
    diff_src: byte-swapped or 2 bytes off its item size (read through a copy), over diff_src's
    last bytes or, when not overlapping, before them."""
    n, c = 8, 4
    x = rng.standard_normal((n, c)).astype(np.float32)
    args = dict(src=x, diff_dst=rng.standard_normal((n, c)).astype(np.float32),
                mean=x.mean(0), variance=x.var(0) + 0.5,
                gamma=rng.standard_normal(c).astype(np.float32))
    value = args[name]
    raw = np.zeros(4 * n * c * 3 + 128, np.uint8)
    dx_at = (-raw.ctypes.data) % 64 + 2 * 4 * n * c
    dx = raw[dx_at:dx_at + 4 * n * c].view(np.float32).reshape(n, c)
    start = dx_at + 4 * n * c - value.nbytes if overlapping else dx_at - value.nbytes - 8
    dtype = np.dtype(np.float32)
    if how == "byte-swapped":
        dtype = dtype.newbyteorder()
    else:
        start -= 2
    moved = raw[start:start + value.nbytes].view(dtype).reshape(value.shape)
    moved[...] = value
    args[name] = moved
    out = (dx, np.full(c, -1, np.float32), np.full(c, -1, np.float32))
    return dict(args, epsilon=1e-3, out=out), raw, value


@pytest.mark.parametrize("how", ["byte-swapped", "misaligned"])
@pytest.mark.parametrize("name", _COPIED_NAMES)
def test_an_output_over_an_input_read_through_a_copy_is_refused(rng, name, how):
    """An input the kernels cannot read in place is copied first: the outputs must still stay
    apart from the caller's memory, which the call would otherwise overwrite."""
    kwargs, raw, _ = _copied_case(rng, name, how, overlapping=True)
    assert_refused(bnbw_native.batchnorm_training_backward, kwargs, ValueError,
                   named("diff_src") + ".*overlaps the input " + named(name), arrays=[raw])


@pytest.mark.parametrize("how", ["byte-swapped", "misaligned"])
@pytest.mark.parametrize("name", _COPIED_NAMES)
def test_an_input_read_through_a_copy_apart_from_the_outputs_is_taken(rng, name, how):
    kwargs, _, value = _copied_case(rng, name, how, overlapping=False)
    got = bnbw_native.batchnorm_training_backward(**kwargs)
    want = bnbw_native.batchnorm_training_backward(**dict(kwargs, **{name: value}, out=None))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_backward_apply_refuses_an_output_over_partial(rng):
    x = rng.standard_normal((8, 4)).astype(np.float32)
    dy = rng.standard_normal((8, 4)).astype(np.float32)
    mean, var = x.mean(0), x.var(0) + 0.5
    partial, count = bnbw_native.backward_reduce(x, dy, mean)
    dx = np.zeros((8, 4), np.float32)
    dgamma = partial.view(np.float32)[0, :4]       # over partial's first sums
    kwargs = dict(x=x, dy=dy, mean=mean, variance=var, gamma=None, partial=partial, count=count,
                  epsilon=1e-3, out=(dx, dgamma, np.zeros(4, np.float32)))
    assert_refused(bnbw_native.backward_apply, kwargs, ValueError,
                   named("diff_gamma") + ".*overlaps the input " + named("partial"))


@pytest.mark.parametrize("value, shown", [(10 ** 400, "1.000000e+400"),
                                          (-10 ** 60, "-1.000000e+60"),
                                          (2 * 10 ** 49 - 1, "2.000000e+49"),
                                          (10 ** 40, "10000000000000000000000000000000000000000")],
                         ids=["huge", "huge-negative", "rounded", "fits"])
def test_a_refused_real_is_shown_as_given_or_in_scientific_form(value, shown):
    """A refused epsilon's message shows the value: an integer too long for the message in
    scientific form, never its leading digits alone (10**400 read as 1000...0, 47 digits)."""
    x = np.ones((4, 3), F32)
    stats = np.ones(3, F32)
    with pytest.raises(ValueError, match="epsilon") as refused:
        bnbw_native.batchnorm_training_backward(x, x, stats, stats, epsilon=value)
    assert str(refused.value).endswith("got " + shown)
    m = {k: desc((4, 3) if k in ("input", "input_gradient", "output_gradient") else (1, 3))
         for k in MEMBERS}
    with pytest.raises(ValueError, match="epsilon") as refused:
        dml.BatchNormalizationGrad(**m, epsilon=value)
    assert str(refused.value).endswith("got " + shown)


def test_the_private_mean_low_is_checked_as_a_statistic_and_as_an_output():
    """mean_low (the torch layers' exact mean): a statistic the backward reads, an output the
    forward writes; refused like the others, with every output untouched."""
    from bnbw_native import _arrays
    from bnbw_native._onednn_graph import FORWARD, GRAPH
    x = np.ones((6, 4), F32)
    x[0] = 2.0
    stats = np.ones(4, F32)
    with pytest.raises(ValueError, match="mean_low must be 1-D of length C = 4"):
        _arrays.backward(GRAPH, _arrays.TRAINING, x, x, stats, stats, stats, 1e-5, "NXC",
                         None, 1, mean_low=np.zeros(3, F32))
    with pytest.raises(TypeError, match="mean_low must have the dtype of mean"):
        _arrays.backward(GRAPH, _arrays.TRAINING, x, x, stats, stats, stats, 1e-5, "NXC",
                         None, 1, mean_low=np.zeros(4, np.float16))
    from bnbw_native import _directml
    with pytest.raises(TypeError, match="mean_low is for the one-call and apply formulas"):
        _arrays.backward(_directml.CONVENTION, _arrays.TRAINING, x, x, stats[None],
                         stats[None], stats[None], 1e-5, "NXC", None, 1,
                         mean_low=np.zeros(1, F32))       # (it crashed: never checked there)
    with pytest.raises(TypeError, match="mean_low is for the one-call and apply formulas"):
        _arrays.backward(GRAPH, _arrays.REDUCE, x, x, stats, None, None, None, "NXC", None, 1,
                         mean_low=np.zeros(4, F32))
    out = (sentinel(x.shape),) + tuple(sentinel((4,)) for _ in range(4))
    before = [o.copy() for o in out]
    with pytest.raises(ValueError, match=r"out\[3\] \(batch_mean\) overlaps mean_low"):
        _arrays.forward(FORWARD, x, stats, stats, stats, stats, 1e-5, 0.1, "NXC", False,
                        out, 1, mean_low=out[3])
    assert all(np.array_equal(o, b, equal_nan=True) for o, b in zip(out, before))
    low = np.full(4, 7.0, F32)
    _arrays.forward(FORWARD, x, stats, stats, stats, stats, 1e-5, 0.1, "NXC", False, out, 1,
                    mean_low=low)
    mean = np.float32(7 / 6)                         # (2 + 5 * 1) / 6 rounded to float32
    assert np.array_equal(out[3], np.full(4, mean))
    assert np.array_equal(low, np.full(4, np.float32(7 / 6 - np.float64(mean))))
    assert low[0] != 0
