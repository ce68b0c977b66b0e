"""One row per case and thread count (and kernel body, with --bodies): ours, the roofline probe
and the peers timed interleaved on the same data, every result checked against the float64
reference.  A backward case (`run_backward_case`) and a forward case (`run_forward_case`) each
say what is called and how its results are checked; timing, rows and verdicts are shared."""
import contextlib
import os
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np
from threadpoolctl import ThreadpoolController

import bnbw_native
from bnbw_native import tuning

import onednn_peer
import torch_cache
from bandwidth import PROBE_BYTES_PER_ELEMENT, Probe
from cases import (DEFAULT_FORMULAS, EPSILON, FORWARD_FORMULAS, LAYOUTS, MOMENTUM,
                   NUM_OUTPUTS, PROBE_PATTERN, RELU_FORMULAS, arrange, layout_arrays,
                   make_problem, traffic)
from checks import (TOLERANCE, CheckFailed, errors, forward_errors, peer_verdict, ref_scales,
                    within)
from machine import size_class
from report import Table
from peers import (REFERENCE_NAME, compile_unavailable, from_torch, numpy_f32_backward,
                   numpy_f32_forward, reference, reference_forward, torch, torch_call,
                   torch_compiled_call, torch_compiled_forward_call, torch_forward_call,
                   torch_forward_result, torch_inputs, torch_result)
from procmem import minor_faults
from timing import measure

# Timed like ours (more rounds): ours, the probes, the two phases.
SUBJECTS = ("ours", "probe", "probe1", "reduce", "apply", "probe_reduce", "probe_apply")
PEERS = ("torch", "torch-alloc", "numpy", "reference", "onednn")     # the default run's
# Asked for by name only: compiling once per case and thread count (1-4 s each) would more than
# double a default run.
OPTIONAL_PEERS = ("torch-compiled",)
ALL_PEERS = PEERS + OPTIONAL_PEERS
TORCH_COLUMNS = {"torch", "torch-alloc", "torch-compiled"}
# The columns whose outputs come from torch_cache.cpp's reused blocks while they are timed.
REUSED_BLOCKS = ("torch", "torch-compiled")
# How each torch column gets its outputs (JSON "torch_peer"; bench/README.md, "Peers").
TORCH_PEER = {
    "torch": "aten.native_batch_norm_backward with its outputs in reused blocks: "
             "bench/torch_cache.cpp is torch's CPU allocator while this column is timed and "
             "the previous call's result is dropped first, so dx lands on pages already "
             "resident; ReLU rows: threshold_backward.grad_input into a preallocated buffer",
    "torch-alloc": "aten.native_batch_norm_backward allocating its outputs with torch's own "
                   "allocator (glibc malloc: blocks above its mmap threshold, at most 32 MiB, "
                   "are fresh pages on every call); ReLU rows: threshold_backward allocating",
    "out_overload": "not used: aten.native_batch_norm_backward.out is generated from the "
                    "allocating op (native_functions.yaml: autogen), so it allocates dx, then "
                    "copies it into out0, and it rejects any out1/out2 for the frozen form "
                    "(output_mask [True, False, False])",
    "forward": "forward rows: aten.native_batch_norm in training mode (momentum 1 - ours, the "
               "same update; torch's running variance is the unbiased one, not compared), "
               "forward-relu rows followed by torch.relu_ in place; its outputs (y, save_mean, "
               "save_invstd) in reused blocks for xtorch, allocated by torch's own allocator "
               "for xtorch-alloc",
    "forward_out_overload": "not used, so that the forward's torch columns get their memory "
                            "as the backward's do: aten.native_batch_norm.out is a CPU kernel "
                            "of its own (batch_norm_cpu_out) and, unlike the backward's, "
                            "writes into its out tensors without new pages",
    "torch-compiled": "the torch column's ops on the same views in a function compiled by "
                      "torch.compile (inductor, dynamic=False, fullgraph=True): "
                      "aten.native_batch_norm_backward with the row's saved statistics "
                      "(after aten.threshold_backward on ReLU rows, fused), forward rows "
                      "aten.native_batch_norm in training mode (+ torch.relu, fused); "
                      "compiled once per case and thread count before the timing (inductor's "
                      "loops are written for torch.get_num_threads()), a compilation while "
                      "timed fails the run; outputs in reused blocks as the torch column's; its "
                      "errors are inductor's float32 arithmetic",
}
# Rows whose torch call faults more than this share of dx's 4 KiB pages get a note: the reused
# blocks did not hold.
TORCH_FAULT_NOTE = 0.01


@dataclass
class Row:
    case: str
    shape: tuple
    layout: str
    dtype: str
    formula: str
    threads: int
    elements: int
    size_class: str
    footprint_bytes: int
    model_bytes: int
    ours_ms: float
    ours_min_ms: float
    ours_iqr_ms: float
    gbs: float
    probe_ms: float            # roofline time: the probe's median (best of 1 and n threads),
    #                            scaled to the row's model bytes
    probe_gbs: float
    roofline_pct: float
    probe_threads_ms: float    # the probe on exactly `threads` threads, scaled alike
    torch_ms: float = None     # outputs in reused blocks (TORCH_PEER["torch"])
    torch_alloc_ms: float = None  # outputs allocated on every call (TORCH_PEER["torch-alloc"])
    torch_compiled_ms: float = None  # torch.compile of the torch column's ops (TORCH_PEER)
    numpy_ms: float = None
    ref_ms: float = None
    onednn_ms: float = None
    unfused_ms: float = None   # relu rows: torch's ReLU backward into a buffer, then our call;
    #                            forward-relu rows: our forward without ReLU, then torch.relu_
    vs_torch: float = None
    vs_torch_alloc: float = None
    vs_torch_compiled: float = None
    vs_numpy: float = None
    vs_ref: float = None
    vs_onednn: float = None
    vs_unfused: float = None
    err: list = field(default_factory=list)   # cases.OUTPUT_NAMES order; None: not given
    torch_err: list = None
    torch_alloc_err: list = None
    torch_compiled_err: list = None
    numpy_err: list = None
    onednn_err: list = None
    unfused_err: list = None
    onednn_impl: str = None    # the implementation oneDNN chose, "unsupported: why", or None
    body: str = None           # the kernel body ours ran on (bnbw_native.tuning.kernel_body)
    body_cap: str = None       # --bodies: the cap asked for (use_kernels)
    vs_first_body: float = None  # --bodies: first body's time / this body's time
    check: str = "pass"
    notes: list = field(default_factory=list)
    load1: float = None        # 1-minute load average when the row was measured
    split: dict = None         # --split: the two phases' times and % of their own roofline
    torch_peer: str = None     # how the torch column got its outputs on this row
    faults_per_call: dict = None  # {implementation: page faults per timed call (getrusage)}
    torch_new_blocks_per_call: float = None  # blocks torch_cache.cpp had to make per timed
    #                                          torch call (0: every output was a reused block)
    torch_compiled_compile_s: float = None   # seconds torch.compile took for this row (untimed)
    torch_compiled_error: str = None   # why the case's compilation failed (no column then)


def resolve_bodies(caps):
    """{cap: body that actually runs under it} (a cap the CPU cannot run falls back)."""
    found = {}
    for cap in caps:
        previous = tuning.use_kernels(cap)
        try:
            found[cap] = tuning.kernel_body()
        finally:
            tuning.use_kernels(previous)
    return found


@contextlib.contextmanager
def no_recompilation(active, where):
    """Around the timing of the torch-compiled column: a compilation meanwhile (a guard that no
    longer held) would be in its times, so it fails the run.  Counted, not refused:
    torch.compiler.set_stance("fail_on_recompile") costs ~17 us a call (torch 2.13), more than
    the whole call of ours on a tiny case."""
    if not active:
        yield
        return
    from torch._dynamo.utils import counters
    before = counters["stats"]["unique_graphs"]
    yield
    if counters["stats"]["unique_graphs"] != before:
        raise CheckFailed(f"{where}: torch-compiled was compiled again while it was timed")


def first_line(exc, most=200):
    """An exception as one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:most]}" if lines else type(exc).__name__


class Runner:
    """The case machinery: shapes x dtypes x layouts x formulas x threads -> Rows."""

    def __init__(self, protocol, threads, dtypes, layouts=LAYOUTS, formulas=DEFAULT_FORMULAS,
                 peers=PEERS, probe=None, echo=print, split=False, bodies=None, table=None):
        self.protocol = protocol
        self.threads = list(threads)
        self.dtypes = list(dtypes)
        self.layouts = list(layouts)
        self.formulas = list(formulas)
        self.peers = set(peers)
        self.notes = []
        if torch is None and self.peers & {"torch", "torch-alloc"}:
            self.peers -= {"torch", "torch-alloc"}
            self.notes.append("torch and unfused columns skipped: torch is not importable")
        if "torch-compiled" in self.peers:
            why = compile_unavailable()
            if why:
                self.peers.discard("torch-compiled")
                self.notes.append(f"torch-compiled column skipped: {why}")
        # The fair torch peers' allocator; without it their columns allocate (noted).
        self.torch_cache = (torch_cache.load() if self.peers & set(REUSED_BLOCKS) else None)
        if self.torch_cache is not None:
            installed = self.torch_cache.on()
            self.torch_cache.off()
            if not installed:
                self.torch_cache = None
                torch_cache.why_absent = ("torch kept another CPU allocator of higher priority "
                                          "(c10::SetCPUAllocator)")
        if self.peers & set(REUSED_BLOCKS) and self.torch_cache is None:
            columns = " and ".join(c for c in REUSED_BLOCKS if c in self.peers)
            self.notes.append(f"{columns} column allocates its outputs: "
                              f"{torch_cache.why_absent}")
        self.onednn = onednn_peer.load() if "onednn" in self.peers else None
        if "onednn" in self.peers and self.onednn is None:
            self.peers.discard("onednn")
            self.notes.append(f"oneDNN column skipped: {onednn_peer.why_absent}")
        self.pools = ThreadpoolController()   # OpenMP and BLAS, found once
        self.probe = probe or Probe()
        self.reference, self.reference_name = reference, REFERENCE_NAME
        self.echo = echo
        # --split: time the two phases (backward_reduce, backward_apply) of training rows too
        self.split = split
        # --bodies: ours once per kernel body cap, interleaved; None = the body in use
        self.bodies = resolve_bodies(bodies) if bodies else None
        if self.bodies:
            for cap, body in self.bodies.items():
                if body.lower().replace("-", "") != cap:
                    self.notes.append(f"kernel body cap {cap!r} runs {body} on this CPU")
        relu = set(RELU_FORMULAS) | {"forward-relu"}
        self.table = table or Table(unfused=bool(set(self.formulas) & relu),
                                    bodies=bool(self.bodies),
                                    torch_alloc="torch-alloc" in self.peers,
                                    torch_compiled="torch-compiled" in self.peers,
                                    forward=bool(set(self.formulas) & set(FORWARD_FORMULAS)))
        self.rows = []

    # -- the loop over cases -----------------------------------------------------------------

    def run_shapes(self, named_shapes):
        relu = bool(set(self.formulas) & set(RELU_FORMULAS))
        try:
            for name, shape in named_shapes.items():
                for dtype_key in self.dtypes:
                    problem = make_problem(name, shape, dtype_key, relu=relu)
                    probe_bufs = {}
                    for layout in self.layouts:
                        arrays = layout_arrays(problem, layout)
                        for formula in self.formulas:
                            self.run_case(problem, layout, arrays, formula, probe_bufs)
                        del arrays
                    del problem, probe_bufs
        finally:
            if self.bodies:
                tuning.use_kernels(None)
        return self.rows

    def ours_names(self):
        """{timing name: body cap} for ours: one entry, or one per --bodies cap."""
        if not self.bodies:
            return {"ours": None}
        return {f"ours:{cap}": cap for cap in self.bodies}

    def torch_peer(self, formula):
        """How this run's torch column gets its outputs, in a few words (a row's `torch_peer`)."""
        how = ("reused blocks (bench/torch_cache.cpp)" if self.torch_cache is not None
               else f"allocating ({torch_cache.why_absent})")
        if formula in RELU_FORMULAS:
            how += ", threshold_backward.grad_input into a preallocated buffer"
        elif formula == "forward-relu":
            how += ", then torch.relu_ in place"
        return how

    def torch_peer_info(self):
        """The JSON's "torch_peer": what each torch column is, and the allocator's state."""
        info = dict(TORCH_PEER)
        if self.torch_cache is None:
            info["torch"] = ("aten.native_batch_norm_backward allocating its outputs (as "
                             f"torch-alloc): {torch_cache.why_absent}; ReLU rows: "
                             "threshold_backward.grad_input into a preallocated buffer")
        info["allocator"] = (self.torch_cache.path if self.torch_cache is not None else None)
        return info

    def events(self):
        """Running totals read around every timed batch: page faults of the process, and the
        blocks torch_cache.cpp has had to make (not hand out again)."""
        found = {"faults": minor_faults()}
        if self.torch_cache is not None:
            found["torch_new_blocks"] = self.torch_cache.counts()["fresh"]
        return found

    def run_case(self, problem, layout, arrays, formula, probe_bufs):
        if formula in FORWARD_FORMULAS:
            self.run_forward_case(problem, layout, arrays, formula, probe_bufs)
        else:
            self.run_backward_case(problem, layout, arrays, formula, probe_bufs)

    # -- what every case shares ----------------------------------------------------------------

    def case_traffic(self, problem, layout, formula, itemsize, probe_bufs):
        """The row's bytes and its probe: {elements, model_bytes, footprint, probe_scale,
        pattern, bufs} (probe buffers shared by the case's layouts and formulas of one size)."""
        elements = int(np.prod(problem["shape"]))
        model_bytes, footprint, array_bytes = traffic(formula, layout, itemsize, elements)
        pattern = PROBE_PATTERN[formula]
        if array_bytes not in probe_bufs:
            probe_bufs[array_bytes] = self.probe.buffers(array_bytes)
        return {"elements": elements, "model_bytes": model_bytes, "footprint": footprint,
                "probe_scale": model_bytes / (PROBE_BYTES_PER_ELEMENT[pattern] // 4
                                              * array_bytes),
                "pattern": pattern, "bufs": probe_bufs[array_bytes],
                "dx_bytes": itemsize * elements}

    def probe_fns(self, tr, nthreads):
        fns = {"probe": self.probe.kernel(tr["pattern"], tr["bufs"], nthreads)}
        if nthreads > 1:   # the roofline may use fewer threads than it is given
            fns["probe1"] = self.probe.kernel(tr["pattern"], tr["bufs"], 1)
        return fns

    def fair_torch(self, call, holder, name="torch"):
        """A fair torch column: the previous result's blocks go back before the next call."""
        def fair():
            holder.pop(name, None)
            holder[name] = call()
        return fair

    def timed(self, fns, nthreads, known, dx_bytes, build_onednn, build_compiled=None,
              where=""):
        """Time `fns` interleaved inside the row's thread limit; (times, oneDNN's call or None).
        oneDNN fixes a primitive's thread count when it is created, and inductor its loops'
        when it compiles, so `build_onednn` and `build_compiled` (the torch-compiled call or
        None) run here, inside the limit, before the timing."""
        before = {}
        with self.pools.limit(limits=nthreads):
            if torch is not None:
                torch.set_num_threads(nthreads)
            onednn_call = build_onednn()
            if onednn_call is not None:
                fns["onednn"] = onednn_call
            compiled_call = build_compiled() if build_compiled is not None else None
            if compiled_call is not None:
                fns["torch-compiled"] = compiled_call
            steps = {name: [] for name in fns}
            if self.bodies:     # ours under each cap; everything else under the first
                first = next(iter(self.bodies))
                for name in fns:
                    cap = self.ours_names().get(name, first)
                    steps[name].append(lambda cap=cap: tuning.use_kernels(cap))
            if self.torch_cache is not None:   # torch's outputs reused for these columns alone
                for name in fns:
                    steps[name].append(self.torch_cache.on if name in REUSED_BLOCKS
                                       else self.torch_cache.off)
            for name, todo in steps.items():
                if todo:
                    before[name] = lambda todo=tuple(todo): [step() for step in todo]
            # Untimed first calls, so that a sample is never a first call (in --quick a
            # slow peer's one sample is its warm-up call): torch's reused blocks and
            # oneDNN's scratchpad exist, and are resident, before the timing.  torch-compiled
            # first: both torch columns draw on one pool of blocks, and torch's calls settle
            # (up to 3) around the block compiled code holds; the other way round, compiled
            # code took the block torch's NCX path makes but never fills, and every timed
            # torch call faulted on a fresh one.
            for name in ("torch-compiled", "torch", "onednn"):
                if name in fns:
                    self.prime(fns[name], before.get(name), dx_bytes)
            try:
                with no_recompilation(compiled_call is not None,
                                      f"{where} threads={nthreads}"):
                    times = measure(fns, self.protocol, subjects=SUBJECTS, known=known,
                                    before=before, count=self.events)
            finally:
                if self.torch_cache is not None:
                    self.torch_cache.off()
        return times, onednn_call

    def case_rows(self, problem, layout, formula, nthreads, tr, times, onednn_state, outs,
                  check):
        """One row per kernel body of ours, counted and checked (`check(row, out)` raises
        CheckFailed), every body's outputs bit for bit the first's."""
        rows = []
        for name, cap in self.ours_names().items():
            row = self.make_row(problem, layout, formula, nthreads, tr["elements"],
                                tr["footprint"], tr["model_bytes"], tr["probe_scale"], times,
                                name)
            row.body = self.bodies[cap] if cap else tuning.kernel_body()
            row.body_cap = cap
            row.onednn_impl = onednn_state.get("impl")
            self.count_row(row, times, tr["dx_bytes"])
            check(row, name)
            rows.append(row)
        if len(rows) > 1:
            first_name = next(iter(outs))
            for name, row in zip(list(outs)[1:], rows[1:]):
                if not all(np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))
                           for a, b in zip(outs[first_name], outs[name])):
                    row.check = "FAIL"
                    self.echo(self.format(row))
                    raise CheckFailed(f"{problem['name']} {layout} {problem['dtype_key']} "
                                      f"{formula} threads={nthreads}: kernel bodies "
                                      f"{rows[0].body} and {row.body} give different bits")
            for row in rows:
                row.vs_first_body = rows[0].ours_ms / row.ours_ms
        return rows

    def judge_peers(self, rows, found, dtype_key, where):
        """{peer: errors}: beyond the semantics limit the run fails, beyond 10x our tolerance
        the rows get a note (numpy f32 is recorded, never judged)."""
        for name, errs in found.items():
            try:
                note = None if name == "numpy" else peer_verdict(name, errs, dtype_key, where)
            except CheckFailed:
                for row in rows:
                    row.check = "FAIL"
                raise
            for row in rows:
                setattr(row, f"{name.replace('-', '_')}_err", errs)
                if note:
                    row.notes.append(note)

    def publish(self, rows, onednn_call):
        if self.torch_cache is not None:
            self.torch_cache.flush()       # the results are gone: free their blocks
        if onednn_call is not None:
            onednn_call.close()
        for row in rows:
            self.rows.append(row)
            self.echo(self.format(row))

    def onednn_try(self, state, make):
        """make() -> oneDNN's call, or None (when absent, or the case is "unsupported: why" or
        "error: what" in state["impl"], remembered for the next thread counts)."""
        if self.onednn is None or state.get("impl", "").startswith(("unsupported", "error")):
            return None
        try:
            call = make()
        except onednn_peer.Unsupported as exc:
            state["impl"] = f"unsupported: {exc}"
            return None
        except (onednn_peer.OneDNNError, TypeError) as exc:
            state["impl"] = f"error: {exc}"
            return None
        return call

    def compiled_builder(self, compile_call, state, holder, where):
        """`timed`'s build_compiled for a case with the torch-compiled column, else None."""
        if compile_call is None:
            return None
        return lambda: self.compiled_build(compile_call, state, holder, where)

    def compiled_build(self, compile_call, state, holder, where):
        """The torch-compiled column's call for this row, compiled now by `compile_call` (in
        the row's thread limit, before the timing), or None when the case's compilation
        failed, at this thread count or an earlier one: state["error"] says why, printed once
        per case and kept on its rows (`note_compiled`); the run goes on without the column."""
        if "error" in state:
            return None
        t0 = perf_counter()
        try:
            call = compile_call()
        except Exception as exc:   # inductor fails in many ways (compiler, platform, lowering)
            state["error"] = first_line(exc)
            self.echo(f"NOTE: torch-compiled skipped on {where}: {state['error']}")
            return None
        state["compile_s"] = perf_counter() - t0
        return self.fair_torch(call, holder, "torch-compiled")

    @staticmethod
    def note_compiled(rows, state):
        """The rows' compile time (one compilation for all bodies' rows), or why the case's
        compilation failed."""
        compile_s = state.pop("compile_s", None)
        for row in rows:
            row.torch_compiled_compile_s = compile_s
            if "error" in state:
                row.torch_compiled_error = state["error"]
                row.notes.append(f"torch-compiled failed: {state['error'].split(':')[0]}")

    # -- the backward --------------------------------------------------------------------------

    def run_backward_case(self, problem, layout, arrays, formula, probe_bufs):
        x, dy, data_format = arrays["x"], arrays["dy"], arrays["data_format"]
        k = NUM_OUTPUTS[formula]
        C = problem["shape"][1]
        mean, var, gamma = problem["mean"], problem["var"], problem["gamma"]
        relu_dst = {"relu": arrays.get("y"), "relu-mask": arrays.get("mask")}.get(formula)
        grad = arrays["g"] if relu_dst is not None else dy     # what the reference is given
        relu_kw = {} if relu_dst is None else {"relu_dst": relu_dst}
        where = f"{problem['name']} {layout} {problem['dtype_key']} {formula}"

        t0 = perf_counter()
        ref = self.reference(x, grad, mean, var, gamma, epsilon=EPSILON,
                             data_format=data_format, num_outputs=k)
        known = {"reference": perf_counter() - t0}   # single-threaded: any thread count
        ref = [None if a is None else np.asarray(a).astype(np.float64) for a in ref[:3]]
        scales = ref_scales(ref)

        # Ours writes into preallocated outputs; each kernel body into its own, to check both.
        outs, gaps = {}, {}
        for i, name in enumerate(self.ours_names()):
            dx, gaps[name] = (arrays["dx"], arrays["dx_gaps"]) if i == 0 else arrange(
                np.zeros(problem["shape"], x.dtype), layout, np.nan)
            outs[name] = (dx, np.zeros(C, np.float32), np.zeros(C, np.float32))[:k]
        tr = self.case_traffic(problem, layout, formula, x.dtype.itemsize, probe_bufs)

        views = None
        if self.peers & TORCH_COLUMNS:
            views = torch_inputs([x, dy] + ([arrays["y"]] if relu_dst is not None else []),
                                 layout)
        relu_y = views[2] if views is not None and relu_dst is not None else None
        # ReLU rows: the fair torch peer and the unfused call each write ReLU's backward into a
        # buffer of their own, laid out like dy (threshold_backward.grad_input fills it in
        # place: checked after the timing)
        grad_bufs = {}
        if relu_y is not None and "torch" in self.peers:
            grad_bufs = {who: torch.empty_like(views[1]) for who in ("torch", "unfused")}
        buf_layout = {who: (b.data_ptr(), b.stride()) for who, b in grad_bufs.items()}
        onednn_state = {}      # what one build found, for the next thread counts
        compiled_state = {}    # a failed compilation, for the next thread counts, or its time
        compile_call = None
        if "torch-compiled" in self.peers:
            compile_call = lambda: torch_compiled_call(  # noqa: E731
                views[0], views[1], problem, k, Y=relu_y)

        for nthreads in self.threads:
            fns = {}
            for name, cap in self.ours_names().items():
                out = outs[name]
                fns[name] = (lambda out=out: bnbw_native.batchnorm_training_backward(
                    x, dy, mean, var, gamma, epsilon=EPSILON, data_format=data_format,
                    num_outputs=k, out=out, num_threads=nthreads, **relu_kw))
            fns.update(self.probe_fns(tr, nthreads))
            if self.split and k == 3:
                fns.update(self.phase_fns(x, dy, mean, var, gamma, data_format,
                                          outs[next(iter(outs))], nthreads, tr["bufs"],
                                          relu_kw))
            holder = {}
            if "torch" in self.peers:
                fns["torch"] = self.fair_torch(torch_call(
                    views[0], views[1], problem, k, Y=relu_y, grad_buf=grad_bufs.get("torch")),
                    holder)
                if relu_dst is not None:
                    fns["unfused"] = self.unfused_fn(views, arrays, problem, layout, nthreads,
                                                     holder, grad_bufs["unfused"])
            if "torch-alloc" in self.peers:
                allocating = torch_call(views[0], views[1], problem, k, Y=relu_y)
                fns["torch-alloc"] = lambda: holder.__setitem__("torch-alloc", allocating())
            if "numpy" in self.peers:
                fns["numpy"] = lambda: holder.__setitem__("numpy", numpy_f32_backward(
                    x, dy, mean, var, gamma, EPSILON, data_format, k, relu_dst=relu_dst))
            if "reference" in self.peers:
                fns["reference"] = lambda: self.reference(
                    x, grad, mean, var, gamma, epsilon=EPSILON, data_format=data_format,
                    num_outputs=k)
            times, onednn_call = self.timed(
                fns, nthreads, known, tr["dx_bytes"],
                lambda: self.onednn_build(problem, layout, arrays, formula, onednn_state),
                self.compiled_builder(compile_call, compiled_state, holder, where), where)
            for who, (ptr, strides) in buf_layout.items():
                buf = grad_bufs[who]
                if (buf.data_ptr(), buf.stride()) != (ptr, strides):
                    raise CheckFailed(f"{where}: threshold_backward.grad_input did not fill "
                                      f"the {who} buffer in place")

            rows = self.case_rows(problem, layout, formula, nthreads, tr, times, onednn_state,
                                  outs, lambda row, name: self.check_row(
                                      row, outs[name], ref, scales, problem, gaps[name]))
            if compile_call is not None:
                self.note_compiled(rows, compiled_state)
            self.check_peers(rows, holder, onednn_call, onednn_state, ref, scales, problem,
                             layout, k, where, outs)
            self.publish(rows, onednn_call)

    def format(self, row):
        return self.table.row(row)

    @staticmethod
    def prime(fn, hook, dx_bytes, most=3):
        """Call `fn` (after `hook`) until a call faults on at most TORCH_FAULT_NOTE of the pages
        of a dense dx of `dx_bytes`, `most` calls at most.  torch needs two: its NCX path makes
        dx twice and fills only the second, so the block it first drops was never touched."""
        for _ in range(most):
            if hook is not None:
                hook()
            start = minor_faults()
            fn()
            if minor_faults() - start <= TORCH_FAULT_NOTE * dx_bytes / 4096:
                break

    def count_row(self, row, times, dx_bytes):
        """The row's page faults per timed call, how its torch column got its outputs, and a
        note when a torch call of reused blocks (torch, torch-compiled) faulted on more than
        TORCH_FAULT_NOTE of the pages of its dx (or y: dense, `dx_bytes`)."""
        row.faults_per_call = {name: t["per_call"]["faults"] for name, t in times.items()
                               if t.get("per_call")}
        if "torch" in times:
            row.torch_peer = self.torch_peer(row.formula)
            per_call = times["torch"].get("per_call") or {}
            row.torch_new_blocks_per_call = per_call.get("torch_new_blocks")
        for name in REUSED_BLOCKS:
            faults = row.faults_per_call.get(name)
            if faults is not None and faults >= 1 and faults > TORCH_FAULT_NOTE * dx_bytes / 4096:
                row.notes.append(f"{name} faults {faults:.0f}/call")

    # -- peers ---------------------------------------------------------------------------------

    def onednn_build(self, problem, layout, arrays, formula, state):
        """oneDNN's backward on this case's arrays (its own outputs), or None when oneDNN is
        absent or has no implementation ("unsupported" in state["impl"]).  ReLU rows: the
        workspace comes from oneDNN's own forward, so its mask is compared with ours once
        and, where an element differs, the reference is recomputed on oneDNN's mask."""
        x, dy = arrays["x"], arrays["dy"]
        k = NUM_OUTPUTS[formula]
        C = problem["shape"][1]
        out = (arrange(np.zeros(problem["shape"], x.dtype), layout, np.nan)[0],
               np.zeros(C, np.float32), np.zeros(C, np.float32))
        relu = formula in RELU_FORMULAS
        call = self.onednn_try(state, lambda: onednn_peer.Backward(
            self.onednn, x, dy, problem["mean"], problem["var"], problem["gamma"], out,
            epsilon=EPSILON, data_format=arrays["data_format"],
            formula="training" if k == 3 else "frozen", relu_dst=relu, beta=problem["beta"]))
        if call is None:
            return None
        call.out = out
        if "impl" not in state:
            state["impl"] = call.impl
            if relu:
                theirs = call.relu_y > 0
                differ = int(np.count_nonzero(theirs != arrays["mask"]))
                if differ:      # elements where y rounds to ~0 in one forward and not the other
                    state["note"] = f"onednn mask differs on {differ}"
                    g = np.where(theirs, dy, 0).astype(dy.dtype)
                    r = self.reference(x, g, problem["mean"], problem["var"], problem["gamma"],
                                       epsilon=EPSILON, data_format=arrays["data_format"],
                                       num_outputs=k)
                    r = [None if a is None else np.asarray(a).astype(np.float64)
                         for a in r[:3]]
                    state["ref"] = (r, ref_scales(r))
        return call

    def unfused_fn(self, views, arrays, problem, layout, nthreads, holder, grad_buf):
        """BatchNorm + ReLU unfused: torch's ReLU backward into a preallocated buffer
        (threshold_backward.grad_input), then our call without relu_dst on that buffer."""
        aten = torch.ops.aten
        X, DY, Y = views
        x = arrays["x"]
        C = problem["shape"][1]
        out = (arrange(np.zeros(problem["shape"], x.dtype), layout, np.nan)[0],
               np.zeros(C, np.float32), np.zeros(C, np.float32))
        mean, var, gamma = problem["mean"], problem["var"], problem["gamma"]
        data_format = arrays["data_format"]
        g = from_torch(grad_buf, x.dtype, layout)      # the buffer itself, as NumPy sees it
        assert g.ctypes.data == grad_buf.data_ptr(), "the unfused buffer was copied"

        def run():
            aten.threshold_backward.grad_input(DY, Y, 0, grad_input=grad_buf)
            bnbw_native.batchnorm_training_backward(
                x, g, mean, var, gamma, epsilon=EPSILON, data_format=data_format, out=out,
                num_threads=nthreads)
            holder["unfused"] = out
        return run

    def check_peers(self, rows, holder, onednn_call, onednn_state, ref, scales, problem,
                    layout, k, where, outs):
        """The backward peers' results against the reference (judge_peers)."""
        x = next(iter(outs.values()))[0]
        found = {}
        for name in ("torch", "torch-alloc", "torch-compiled"):
            if name in holder:
                found[name] = errors(torch_result(holder.pop(name), x, layout, k), ref,
                                     scales, problem, k)
        for name in ("unfused", "numpy"):
            if name in holder:
                found[name] = errors(holder.pop(name), ref, scales, problem, k)
        if onednn_call is not None:
            r, s = onednn_state.get("ref", (ref, scales))
            found["onednn"] = errors(onednn_call.out, r, s, problem, k)
        self.judge_peers(rows, found, problem["dtype_key"], where)
        if onednn_call is not None and onednn_state.get("note"):
            for row in rows:
                row.notes.append(onednn_state["note"])

    def phase_fns(self, x, dy, mean, var, gamma, data_format, out, nthreads, bufs, relu_kw):
        """The reduce and apply phases of a training call, and their probe patterns."""
        partial, count = bnbw_native.backward_reduce(x, dy, mean, data_format=data_format,
                                                     num_threads=nthreads, **relu_kw)
        probe = self.probe
        return {
            "reduce": lambda: bnbw_native.backward_reduce(
                x, dy, mean, data_format=data_format, num_threads=nthreads, **relu_kw),
            "apply": lambda: bnbw_native.backward_apply(
                x, dy, mean, var, gamma, partial, count, epsilon=EPSILON,
                data_format=data_format, out=out, num_threads=nthreads, **relu_kw),
            "probe_reduce": probe.kernel("reduce", bufs, nthreads),
            "probe_apply": probe.kernel("apply", bufs, nthreads),
        }

    # -- the forward ---------------------------------------------------------------------------

    def run_forward_case(self, problem, layout, arrays, formula, probe_bufs):
        """batchnorm_training_forward (all five outputs into preallocated arrays, momentum
        MOMENTUM, fuse_relu for forward-relu) next to torch's native_batch_norm (+ relu_),
        oneDNN's forward_training, float32 NumPy and the float64 reference; dst and the
        statistics checked against the reference."""
        x, data_format = arrays["x"], arrays["data_format"]
        relu = formula == "forward-relu"
        C = problem["shape"][1]
        gamma, beta = problem["gamma"], problem["beta"]
        run_mean, run_var = problem["run_mean"], problem["run_var"]
        kw = dict(epsilon=EPSILON, momentum=MOMENTUM, data_format=data_format)
        where = f"{problem['name']} {layout} {problem['dtype_key']} {formula}"

        t0 = perf_counter()
        ref = reference_forward(x, run_mean, run_var, gamma, beta, fuse_relu=relu, **kw)
        known = {"reference": perf_counter() - t0}   # single-threaded: any thread count
        ref = [np.asarray(a, np.float64) for a in ref]
        scales = ref_scales(ref)

        # dst of the first body is the case's dx array (NaN gaps when strided): the rows of
        # one case run one after another and each checks what it wrote right after its timing
        outs, gaps = {}, {}
        for i, name in enumerate(self.ours_names()):
            dst, gaps[name] = (arrays["dx"], arrays["dx_gaps"]) if i == 0 else arrange(
                np.zeros(problem["shape"], x.dtype), layout, np.nan)
            outs[name] = (dst,) + tuple(np.zeros(C, np.float32) for _ in range(4))
        tr = self.case_traffic(problem, layout, formula, x.dtype.itemsize, probe_bufs)

        X = torch_inputs([x], layout)[0] if self.peers & TORCH_COLUMNS else None
        unfused_out = unfused_dst = None
        if relu and "torch" in self.peers:   # our forward without ReLU, then torch.relu_
            unfused_out = ((arrange(np.zeros(problem["shape"], x.dtype), layout, np.nan)[0],)
                           + tuple(np.zeros(C, np.float32) for _ in range(4)))
            unfused_dst = torch_inputs([unfused_out[0]], layout)[0]   # a view, no copy
        onednn_state = {}
        compiled_state = {}
        compile_call = None
        if "torch-compiled" in self.peers:
            compile_call = lambda: torch_compiled_forward_call(X, problem, relu)  # noqa: E731

        for nthreads in self.threads:
            fns = {}
            for name in self.ours_names():
                fns[name] = (lambda out=outs[name]: bnbw_native.batchnorm_training_forward(
                    x, run_mean, run_var, gamma, beta, fuse_relu=relu, out=out,
                    num_threads=nthreads, **kw))
            fns.update(self.probe_fns(tr, nthreads))
            holder = {}
            if "torch" in self.peers:
                fns["torch"] = self.fair_torch(torch_forward_call(X, problem, relu), holder)
                if unfused_out is not None:
                    def unfused(nthreads=nthreads):
                        bnbw_native.batchnorm_training_forward(
                            x, run_mean, run_var, gamma, beta, out=unfused_out,
                            num_threads=nthreads, **kw)
                        torch.relu_(unfused_dst)
                        holder["unfused"] = unfused_out
                    fns["unfused"] = unfused
            if "torch-alloc" in self.peers:
                allocating = torch_forward_call(X, problem, relu)
                fns["torch-alloc"] = lambda: holder.__setitem__("torch-alloc", allocating())
            if "numpy" in self.peers:
                fns["numpy"] = lambda: holder.__setitem__("numpy", numpy_f32_forward(
                    x, run_mean, run_var, gamma, beta, EPSILON, MOMENTUM, data_format, relu))
            if "reference" in self.peers:
                fns["reference"] = lambda: reference_forward(x, run_mean, run_var, gamma, beta,
                                                             fuse_relu=relu, **kw)
            times, onednn_call = self.timed(
                fns, nthreads, known, tr["dx_bytes"],
                lambda: self.onednn_forward_build(problem, layout, arrays, relu, onednn_state),
                self.compiled_builder(compile_call, compiled_state, holder, where), where)

            rows = self.case_rows(problem, layout, formula, nthreads, tr, times, onednn_state,
                                  outs, lambda row, name: self.check_forward_row(
                                      row, outs[name], ref, scales, gaps[name]))
            if compile_call is not None:
                self.note_compiled(rows, compiled_state)
            found = {}
            for name in ("torch", "torch-alloc", "torch-compiled"):
                if name in holder:
                    found[name] = forward_errors(torch_forward_result(holder.pop(name), x,
                                                                      layout), ref, scales)
            for name in ("unfused", "numpy"):
                if name in holder:
                    found[name] = forward_errors(holder.pop(name), ref, scales)
            if onednn_call is not None:
                dst, mean, var = onednn_call.out
                found["onednn"] = forward_errors((dst, None, None, mean, var), ref, scales)
            self.judge_peers(rows, found, problem["dtype_key"], where)
            self.publish(rows, onednn_call)

    def onednn_forward_build(self, problem, layout, arrays, relu, state):
        """oneDNN's training forward on this case's x, into arrays of its own (y, the batch
        mean and variance), or None."""
        x = arrays["x"]
        C = problem["shape"][1]
        out = (arrange(np.zeros(problem["shape"], x.dtype), layout, np.nan)[0],
               np.zeros(C, np.float32), np.zeros(C, np.float32))
        call = self.onednn_try(state, lambda: onednn_peer.Forward(
            self.onednn, x, problem["gamma"], problem["beta"], out, epsilon=EPSILON,
            data_format=arrays["data_format"], relu=relu))
        if call is not None:
            call.out = out
            state.setdefault("impl", call.impl)
        return call

    # -- rows and checks -----------------------------------------------------------------------

    def make_row(self, problem, layout, formula, nthreads, elements, footprint, model_bytes,
                 probe_scale, times, ours_name="ours"):
        ours = times[ours_name]["median"]
        probe_n = times["probe"]["median"] * probe_scale
        probe = min(probe_n, times["probe1"]["median"] * probe_scale) \
            if "probe1" in times else probe_n
        row = Row(
            case=problem["name"], shape=problem["shape"], layout=layout,
            dtype=problem["dtype_key"], formula=formula, threads=nthreads, elements=elements,
            size_class=size_class(footprint), footprint_bytes=footprint,
            model_bytes=model_bytes, ours_ms=ours * 1e3,
            ours_min_ms=times[ours_name]["min"] * 1e3,
            ours_iqr_ms=(times[ours_name]["q3"] - times[ours_name]["q1"]) * 1e3,
            gbs=model_bytes / ours / 1e9, probe_ms=probe * 1e3,
            probe_gbs=model_bytes / probe / 1e9, roofline_pct=100 * probe / ours,
            probe_threads_ms=probe_n * 1e3, load1=os.getloadavg()[0])
        for peer in ("torch", "torch-alloc", "torch-compiled", "numpy", "onednn", "unfused"):
            if peer in times:
                setattr(row, f"{peer.replace('-', '_')}_ms", times[peer]["median"] * 1e3)
        if "reference" in times:
            row.ref_ms = times["reference"]["median"] * 1e3
        if "reduce" in times:
            t = {k: times[k]["median"] for k in ("reduce", "apply", "probe_reduce",
                                                  "probe_apply")}
            row.split = {"reduce_ms": t["reduce"] * 1e3, "apply_ms": t["apply"] * 1e3,
                         "reduce_roofline_pct": 100 * t["probe_reduce"] / t["reduce"],
                         "apply_roofline_pct": 100 * t["probe_apply"] / t["apply"]}
            row.notes.append(f"reduce {row.split['reduce_roofline_pct']:.0f}% "
                             f"apply {row.split['apply_roofline_pct']:.0f}%")
        for peer, attr in (("torch", "torch_ms"), ("torch_alloc", "torch_alloc_ms"),
                           ("torch_compiled", "torch_compiled_ms"), ("numpy", "numpy_ms"),
                           ("ref", "ref_ms"), ("onednn", "onednn_ms"), ("unfused", "unfused_ms")):
            value = getattr(row, attr)
            setattr(row, f"vs_{peer}", value / row.ours_ms if value else None)
        return row

    def check_row(self, row, out, ref, scales, problem, dx_gaps):
        result = tuple(out) + (None,) * (3 - len(out))
        row.err = errors(result, ref, scales, problem, len(out))
        self.verdict(row, dx_gaps, "diff_src")

    def check_forward_row(self, row, out, ref, scales, dst_gaps):
        row.err = forward_errors(out, ref, scales)
        self.verdict(row, dst_gaps, "dst")

    def verdict(self, row, gaps, what):
        """Fail the row (print it, raise CheckFailed) when its errors exceed the tolerance or
        the call wrote between the elements of a strided output (`gaps`, NaN before)."""
        problems = []
        if not within(row.err, row.dtype):
            problems.append(f"errors {row.err} above tolerance {TOLERANCE[row.dtype]}")
        if gaps is not None and gaps.size and not np.isnan(gaps).all():
            problems.append(f"wrote between the elements of a strided {what}")
        if problems:
            row.check = "FAIL"
            self.echo(self.format(row))
            raise CheckFailed(f"{row.case} {row.shape} {row.layout} {row.dtype} {row.formula} "
                              f"threads={row.threads}" +
                              (f" body={row.body}" if row.body_cap else "") + ": " +
                              "; ".join(problems))
