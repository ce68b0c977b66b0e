"""oneDNN's batch normalization, backward and training forward, as a benchmark peer, through
its C API with ctypes.

Optional: the shared library comes from the `onednn-cpu-gomp` wheel (GNU OpenMP, the runtime
bnbw_native uses, so `threadpoolctl` and `omp_set_num_threads` set both thread counts).  No
headers are needed at run time: the few enum values and argument indices used are written
below, and `header_mismatches()` compares them with the headers of `onednn-devel-cpu-gomp`
where those are installed (the smoke test does).

Every primitive works on the caller's NumPy buffers: memory descriptors are built from the
arrays' own strides, so oneDNN reads and writes the very arrays the other implementations use.

    lib = load()                       # None when oneDNN is not installed (see `why_absent`)
    call = lib.backward(x, dy, mean, var, gamma, out, epsilon=1e-5, data_format="NCX",
                        formula="training")
    call()                             # one execution; call.impl names the implementation
    call = lib.forward(x, gamma, beta, (y, mean, var), epsilon=1e-5, data_format="NXC",
                       relu=False)     # forward_training: y and the batch statistics
"""
import ctypes
import ctypes.util
import glob
import os
import subprocess
import sys
import tempfile

import numpy as np

# --- values from dnnl_common_types.h, dnnl_types.h and dnnl_config.h (oneDNN 3.x), checked by
# header_mismatches() against the installed headers
dnnl_success = 0
dnnl_unimplemented = 3
dnnl_cpu = 1
dnnl_stream_default_flags = 1
dnnl_f16 = 1
dnnl_bf16 = 2
dnnl_f32 = 3
dnnl_forward_training = 64
dnnl_backward = 128
dnnl_backward_data = 160
dnnl_use_global_stats = 0x1
dnnl_use_scale = 0x2
dnnl_use_shift = 0x4
dnnl_fuse_norm_relu = 0x8
dnnl_query_impl_info_str = 8
dnnl_query_workspace_md = 135
DNNL_ARG_SRC = 1
DNNL_ARG_DST = 17
DNNL_ARG_MEAN = 49
DNNL_ARG_VARIANCE = 50
DNNL_ARG_SCALE = 51
DNNL_ARG_SHIFT = 52
DNNL_ARG_WORKSPACE = 64
DNNL_ARG_DIFF_SRC = 129
DNNL_ARG_DIFF_DST = 145
DNNL_ARG_DIFF_SCALE = 255
DNNL_ARG_DIFF_SHIFT = 256
DNNL_MAX_NDIMS = 12
DNNL_RUNTIME_SEQ = 1
DNNL_RUNTIME_OMP = 2
DNNL_RUNTIME_TBB = 4
DNNL_RUNTIME_THREADPOOL = 8
CONSTANTS = {name: value for name, value in globals().items()
             if name.startswith(("dnnl_", "DNNL_")) and isinstance(value, int)}

STATUS = {0: "success", 1: "out_of_memory", 2: "invalid_arguments", 3: "unimplemented",
          4: "last_impl_reached", 5: "runtime_error", 6: "not_required"}

# Storage dtype name (numpy / ml_dtypes) -> oneDNN data type.
DATA_TYPES = {"float32": dnnl_f32, "bfloat16": dnnl_bf16, "float16": dnnl_f16}

Dims = ctypes.c_int64 * DNNL_MAX_NDIMS


class ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


class Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]


def dense(a):
    """Whether `a` fills its memory span without gaps (any order of the axes)."""
    span = 1 + sum((n - 1) * s for n, s in zip(a.shape, a.strides)) // a.itemsize
    return all(s >= 0 for s in a.strides) and span == a.size


def same_layout(a):
    """A new array with the shape, dtype and strides of `a` (non-negative strides)."""
    span = 1 + sum((n - 1) * s for n, s in zip(a.shape, a.strides)) // a.itemsize
    buf = np.empty(max(span, 1), a.dtype)
    return np.lib.stride_tricks.as_strided(buf, a.shape, a.strides)


class OneDNNError(RuntimeError):
    """A oneDNN call returned a status other than success."""

    def __init__(self, what, status):
        self.status = status
        super().__init__(f"{what}: {STATUS.get(status, status)}")


class Unsupported(OneDNNError):
    """oneDNN has no implementation for this case (dnnl_unimplemented), or this binding
    declines it (`why`)."""

    def __init__(self, what, status=dnnl_unimplemented, why=None):
        super().__init__(what, status)
        if why:
            self.args = (why,)


def library_candidates():
    """Where the wheel puts libdnnl (<prefix>/lib), then the loader's own search."""
    names = []
    if os.environ.get("BNBW_ONEDNN_LIB"):
        names.append(os.environ["BNBW_ONEDNN_LIB"])
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        names += sorted(glob.glob(os.path.join(prefix, "lib", "libdnnl.so.3*")))
    found = ctypes.util.find_library("dnnl")
    if found:
        names.append(found)
    return names


def header_dir():
    """The include directory of onednn-devel-cpu-gomp, or None."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        where = os.path.join(prefix, "include")
        if os.path.exists(os.path.join(where, "oneapi", "dnnl", "dnnl_types.h")):
            return where
    return None


def header_mismatches(include=None, cc=None):
    """{name: (ours, header's)} for every constant that differs from the installed headers
    (empty when all agree).  Compiles a tiny C program; raises OSError without headers or a
    compiler."""
    include = include or header_dir()
    if include is None:
        raise OSError("oneDNN headers not found (pip install onednn-devel-cpu-gomp)")
    lines = ["#include <stdio.h>", "#include \"oneapi/dnnl/dnnl.h\"", "int main(void) {"]
    lines += [f'    printf("%s %lld\\n", "{name}", (long long){name});' for name in CONSTANTS]
    lines += ["    return 0;", "}"]
    with tempfile.TemporaryDirectory() as tmp:
        source, exe = os.path.join(tmp, "k.c"), os.path.join(tmp, "k")
        with open(source, "w") as f:
            f.write("\n".join(lines) + "\n")
        done = subprocess.run([cc or os.environ.get("CC") or "cc", "-I", include, source,
                               "-o", exe], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(done.stderr.strip()[-400:])
        printed = subprocess.run([exe], capture_output=True, text=True, timeout=60).stdout
    theirs = {name: int(value) for name, value in (ln.split() for ln in printed.splitlines())}
    return {name: (value, theirs.get(name)) for name, value in CONSTANTS.items()
            if theirs.get(name) != value}


why_absent = None
_loaded = None


def load():
    """The oneDNN binding (one per process), or None with the reason in `why_absent`."""
    global _loaded, why_absent
    if _loaded is None and why_absent is None:
        errors = []
        for path in library_candidates():
            try:
                _loaded = OneDNN(ctypes.CDLL(path), path)
                break
            except (OSError, AttributeError, OneDNNError) as exc:
                errors.append(f"{path}: {exc}")
        else:
            why_absent = ("oneDNN not found (pip install onednn-cpu-gomp)" if not errors
                          else "oneDNN unusable: " + "; ".join(errors))
    return _loaded


class OneDNN:
    """One CPU engine and one in-order stream over a loaded libdnnl."""

    def __init__(self, lib, path):
        self.lib, self.path = lib, path
        p, i, u = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
        pp = ctypes.POINTER(ctypes.c_void_p)
        sig = {
            "dnnl_engine_create": [pp, i, ctypes.c_size_t],
            "dnnl_stream_create": [pp, p, u],
            "dnnl_stream_wait": [p],
            "dnnl_memory_desc_create_with_strides": [pp, i, Dims, i, Dims],
            "dnnl_memory_desc_destroy": [p],
            "dnnl_memory_desc_get_size": [p],
            "dnnl_memory_create": [pp, p, p, p],
            "dnnl_memory_destroy": [p],
            "dnnl_batch_normalization_forward_primitive_desc_create":
                [pp, p, i, p, p, ctypes.c_float, u, p],
            "dnnl_batch_normalization_backward_primitive_desc_create":
                [pp, p, i, p, p, p, ctypes.c_float, u, p, p],
            "dnnl_primitive_desc_query": [p, i, i, p],
            "dnnl_primitive_desc_query_md": [p, i, i],
            "dnnl_primitive_desc_destroy": [p],
            "dnnl_primitive_create": [pp, p],
            "dnnl_primitive_execute": [p, p, i, ctypes.POINTER(ExecArg)],
            "dnnl_primitive_destroy": [p],
        }
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        lib.dnnl_primitive_desc_query_md.restype = ctypes.c_void_p
        lib.dnnl_version.restype = ctypes.POINTER(Version)
        lib.dnnl_version.argtypes = []
        v = lib.dnnl_version().contents
        self.version = f"{v.major}.{v.minor}.{v.patch}"
        self.git_hash = v.hash.decode() if v.hash else None
        # The runtime oneDNN was built with: with OpenMP, threads follow omp_set_num_threads.
        self.cpu_runtime = {DNNL_RUNTIME_SEQ: "sequential", DNNL_RUNTIME_OMP: "OpenMP",
                            DNNL_RUNTIME_TBB: "TBB", DNNL_RUNTIME_THREADPOOL: "threadpool"}.get(
            v.cpu_runtime, str(v.cpu_runtime))
        self.engine, self.stream = ctypes.c_void_p(), ctypes.c_void_p()
        self.check("dnnl_engine_create",
                   lib.dnnl_engine_create(ctypes.byref(self.engine), dnnl_cpu, 0))
        self.check("dnnl_stream_create",
                   lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine,
                                          dnnl_stream_default_flags))

    @staticmethod
    def check(what, status):
        if status == dnnl_unimplemented:
            raise Unsupported(what, status, why=f"no implementation ({what})")
        if status != dnnl_success:
            raise OneDNNError(what, status)

    def describe(self):
        return {"version": self.version, "git_hash": self.git_hash,
                "cpu_runtime": self.cpu_runtime, "library": self.path}

    def backward(self, x, dy, mean, var, gamma, out, *, epsilon, data_format, formula,
                 relu_dst=None, beta=None):
        """A callable running oneDNN's backward on these very arrays (see Backward).  Create
        it under the thread count it will run with: oneDNN fixes that at creation."""
        return Backward(self, x, dy, mean, var, gamma, out, epsilon=epsilon,
                        data_format=data_format, formula=formula, relu_dst=relu_dst,
                        beta=beta)

    def forward(self, x, gamma, beta, out, *, epsilon, data_format, relu=False):
        """A callable running oneDNN's training forward on these very arrays (see Forward);
        create it under the thread count it will run with."""
        return Forward(self, x, gamma, beta, out, epsilon=epsilon, data_format=data_format,
                       relu=relu)


class Bound:
    """A oneDNN primitive bound to NumPy arrays: memory descriptors from the arrays' strides,
    memory objects over their buffers, one execution per call.  Subclasses build `prim`,
    `args` and `nargs` in `_build`."""

    def __init__(self, dnnl, keep, build):
        self.dnnl, self.lib = dnnl, dnnl.lib
        self._owned = []            # (destroy function, handle), destroyed in reverse
        self.keep = list(keep)
        try:
            build()
        except BaseException:
            self.close()
            raise

    def _own(self, destroy, handle):
        self._owned.append((destroy, handle))
        return handle

    def _md(self, arr, data_format):
        """A memory descriptor of `arr` in oneDNN's logical order (N, C, spatial...)."""
        dtype = DATA_TYPES.get(arr.dtype.name)
        if dtype is None:
            raise TypeError(f"oneDNN peer: no data type for {arr.dtype}")
        shape, strides = list(arr.shape), [s // arr.itemsize for s in arr.strides]
        if data_format == "NXC" and arr.ndim > 2:     # channel last in memory: move it to 1
            shape.insert(1, shape.pop())
            strides.insert(1, strides.pop())
        md = ctypes.c_void_p()
        self.dnnl.check("dnnl_memory_desc_create_with_strides",
                        self.lib.dnnl_memory_desc_create_with_strides(
                            ctypes.byref(md), arr.ndim, Dims(*shape), dtype, Dims(*strides)))
        return self._own(self.lib.dnnl_memory_desc_destroy, md)

    def _memory(self, md, arr):
        mem = ctypes.c_void_p()
        self.dnnl.check("dnnl_memory_create", self.lib.dnnl_memory_create(
            ctypes.byref(mem), md, self.dnnl.engine, ctypes.c_void_p(arr.ctypes.data)))
        return self._own(self.lib.dnnl_memory_destroy, mem)

    def _primitive(self, pd):
        prim = ctypes.c_void_p()
        self.dnnl.check("dnnl_primitive_create",
                        self.lib.dnnl_primitive_create(ctypes.byref(prim), pd))
        return self._own(self.lib.dnnl_primitive_destroy, prim)

    def _impl(self, pd):
        """The implementation oneDNN chose for primitive descriptor `pd`."""
        info = ctypes.c_char_p()
        self.dnnl.check("query impl_info_str", self.lib.dnnl_primitive_desc_query(
            pd, dnnl_query_impl_info_str, 0, ctypes.byref(info)))
        return info.value.decode()

    def _workspace(self, pd):
        """A zeroed workspace array for primitive descriptor `pd`, and its memory object."""
        ws_md = self.lib.dnnl_primitive_desc_query_md(pd, dnnl_query_workspace_md, 0)
        if not ws_md:
            raise OneDNNError("query workspace_md", -1)
        workspace = np.zeros(self.lib.dnnl_memory_desc_get_size(ws_md), np.uint8)
        self.keep.append(workspace)
        return workspace, self._memory(ws_md, workspace)

    @staticmethod
    def _args(pairs):
        return (ExecArg * len(pairs))(*[ExecArg(k, v) for k, v in pairs]), len(pairs)

    def _ready(self, pd, args):
        self.prim = self._primitive(pd)
        self.args, self.nargs = self._args(args)
        self._execute = self.lib.dnnl_primitive_execute
        self._wait = self.lib.dnnl_stream_wait

    def __call__(self):
        status = self._execute(self.prim, self.dnnl.stream, self.nargs, self.args)
        if status == dnnl_success:
            status = self._wait(self.dnnl.stream)
        if status != dnnl_success:
            raise OneDNNError("execute", status)

    def close(self):
        while self._owned:
            destroy, handle = self._owned.pop()
            destroy(handle)
        self.keep = []

    def __del__(self):
        try:
            self.close()
        except Exception:        # interpreter shutdown: the library may be gone already
            pass


def check_stats(C, *arrays):
    stat = np.dtype(np.float32)
    if any(a.dtype != stat or a.shape != (C,) for a in arrays):
        raise TypeError("oneDNN peer: statistics must be float32 of shape (C,)")


def relu_on_dense(x):
    """fuse_norm_relu only on a tensor without gaps: oneDNN 3.2 accepts it on a strided one
    (its reference implementation), then indexes the workspace, sized for a dense tensor, with
    the strides of x: out of bounds."""
    if not dense(x):
        raise Unsupported("fuse_norm_relu", why="fuse_norm_relu on a tensor with gaps")


class Forward(Bound):
    """oneDNN's batch-normalization training forward bound to NumPy arrays.

    Prop kind forward_training, flags use_scale | use_shift (+ fuse_norm_relu with `relu`,
    whose workspace, oneDNN's record of the positive outputs, is allocated here once): y into
    out[0], the batch mean and the biased batch variance into out[1] and out[2] (outputs: no
    use_global_stats).  oneDNN keeps no running statistics.  x and y are in the layout of
    `data_format`; their strides become the memory descriptors, so no copy is made."""

    def __init__(self, dnnl, x, gamma, beta, out, *, epsilon, data_format, relu=False):
        super().__init__(dnnl, [x, gamma, beta, *out], lambda: self._build(
            x, gamma, beta, out, float(epsilon), data_format, relu))

    def _build(self, x, gamma, beta, out, eps, data_format, relu):
        lib = self.lib
        y, mean, var = out
        C = mean.shape[0]
        check_stats(C, mean, var)
        scale = np.ones(C, np.float32) if gamma is None else gamma
        shift = np.zeros(C, np.float32) if beta is None else beta
        check_stats(C, scale, shift)
        self.keep += [scale, shift]
        flags = dnnl_use_scale | dnnl_use_shift
        if relu:
            relu_on_dense(x)
            flags |= dnnl_fuse_norm_relu
        src_md, dst_md = self._md(x, data_format), self._md(y, data_format)
        pd = ctypes.c_void_p()
        self.dnnl.check("batch_normalization_forward_primitive_desc_create",
                        lib.dnnl_batch_normalization_forward_primitive_desc_create(
                            ctypes.byref(pd), self.dnnl.engine, dnnl_forward_training, src_md,
                            dst_md, ctypes.c_float(eps), flags, None))
        self._own(lib.dnnl_primitive_desc_destroy, pd)
        self.impl = self._impl(pd)
        vec_md = self._md(np.empty(C, np.float32), "NCX")
        args = [(DNNL_ARG_SRC, self._memory(src_md, x)),
                (DNNL_ARG_DST, self._memory(dst_md, y)),
                (DNNL_ARG_MEAN, self._memory(vec_md, mean)),
                (DNNL_ARG_VARIANCE, self._memory(vec_md, var)),
                (DNNL_ARG_SCALE, self._memory(vec_md, scale)),
                (DNNL_ARG_SHIFT, self._memory(vec_md, shift))]
        if relu:
            args.append((DNNL_ARG_WORKSPACE, self._workspace(pd)[1]))
        self._ready(pd, args)


class Backward(Bound):
    """oneDNN's batch-normalization backward bound to NumPy arrays.

    formula "training": prop kind backward, flags use_scale | use_shift: dx, d(scale) and
    d(shift) into out = (dx, dgamma, dbeta).  "frozen": prop kind backward_data with global
    statistics and no scale, dx = dy / sqrt(var + eps), as ours with num_outputs=1.
    relu_dst=True: flag fuse_norm_relu as well; the workspace (oneDNN's record of which outputs
    were positive) comes from one forward training pass run here, with the same statistics as
    global ones.  `relu_y` then holds that forward's output, for checking the mask.

    x, dy, dx are in the layout of `data_format` (channel at axis 1 for NCX, last for NXC);
    their strides become the memory descriptors, so no copy is made.
    """

    def __init__(self, dnnl, x, dy, mean, var, gamma, out, *, epsilon, data_format, formula,
                 relu_dst=None, beta=None):
        self.relu_y = None
        super().__init__(dnnl, [x, dy, mean, var, gamma, *out], lambda: self._build(
            x, dy, mean, var, gamma, out, float(epsilon), data_format, formula, relu_dst, beta))

    def _build(self, x, dy, mean, var, gamma, out, eps, data_format, formula, relu_dst, beta):
        lib, check = self.lib, self.dnnl.check
        C = mean.shape[0]
        check_stats(C, mean, var)
        src_md = self._md(x, data_format)
        diff_dst_md = self._md(dy, data_format)
        diff_src_md = self._md(out[0], data_format)
        training = formula == "training"
        flags = dnnl_use_scale | dnnl_use_shift if training else dnnl_use_global_stats
        if relu_dst:
            relu_on_dense(x)
            flags |= dnnl_fuse_norm_relu

        # The forward hint (and, for ReLU, the forward that makes the workspace).  With global
        # statistics it normalises with the very mean and variance the backward is given.
        fwd_flags = flags | dnnl_use_global_stats | dnnl_use_scale | dnnl_use_shift
        y = same_layout(x)            # the forward's output, laid out like x
        dst_md = self._md(y, data_format)
        fwd_pd = ctypes.c_void_p()
        check("batch_normalization_forward_primitive_desc_create",
              lib.dnnl_batch_normalization_forward_primitive_desc_create(
                  ctypes.byref(fwd_pd), self.dnnl.engine, dnnl_forward_training, src_md,
                  dst_md, ctypes.c_float(eps), fwd_flags, None))
        self._own(lib.dnnl_primitive_desc_destroy, fwd_pd)

        pd = ctypes.c_void_p()
        check("batch_normalization_backward_primitive_desc_create",
              lib.dnnl_batch_normalization_backward_primitive_desc_create(
                  ctypes.byref(pd), self.dnnl.engine,
                  dnnl_backward if training else dnnl_backward_data, diff_src_md,
                  diff_dst_md, src_md, ctypes.c_float(eps), flags, fwd_pd, None))
        self._own(lib.dnnl_primitive_desc_destroy, pd)
        self.impl = self._impl(pd)

        vec_md = self._md(np.empty(C, np.float32), "NCX")
        ones = np.ones(C, np.float32)
        scale = gamma if (training and gamma is not None) else ones
        args = [(DNNL_ARG_SRC, self._memory(src_md, x)),
                (DNNL_ARG_DIFF_DST, self._memory(diff_dst_md, dy)),
                (DNNL_ARG_MEAN, self._memory(vec_md, mean)),
                (DNNL_ARG_VARIANCE, self._memory(vec_md, var)),
                (DNNL_ARG_DIFF_SRC, self._memory(diff_src_md, out[0]))]
        if training:
            args += [(DNNL_ARG_SCALE, self._memory(vec_md, scale)),
                     (DNNL_ARG_DIFF_SCALE, self._memory(vec_md, out[1])),
                     (DNNL_ARG_DIFF_SHIFT, self._memory(vec_md, out[2]))]
        self.keep += [ones, scale]
        if relu_dst:
            _, ws_mem = self._workspace(fwd_pd)
            shift = np.zeros(C, np.float32) if beta is None else beta
            fwd = self._primitive(fwd_pd)
            fwd_args, n = self._args([
                (DNNL_ARG_SRC, args[0][1]),
                (DNNL_ARG_DST, self._memory(dst_md, y)),
                (DNNL_ARG_MEAN, args[2][1]), (DNNL_ARG_VARIANCE, args[3][1]),
                (DNNL_ARG_SCALE, self._memory(vec_md, scale)),
                (DNNL_ARG_SHIFT, self._memory(vec_md, shift)),
                (DNNL_ARG_WORKSPACE, ws_mem)])
            check("forward (workspace)", lib.dnnl_primitive_execute(fwd, self.dnnl.stream, n,
                                                                    fwd_args))
            check("stream_wait", lib.dnnl_stream_wait(self.dnnl.stream))
            self.keep.append(shift)
            self.relu_y = y
            args.append((DNNL_ARG_WORKSPACE, ws_mem))
        self._ready(pd, args)
