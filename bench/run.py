"""Benchmark runner for ``bnbw_native.batchnorm_training_backward`` and
``bnbw_native.batchnorm_training_forward``.

    python bench/run.py [--quick] [--threads 1,2] [--dtypes f32,f16,bf16] [--json PATH]
                        [--plot PATH] [--shapes NAMES] [--layouts ...] [--formulas ...]
                        [--peers torch,torch-alloc,numpy,reference,onednn,torch-compiled]
                        [--split] [--bodies avx2,avx512] [--layers | --layers-only]

Each row is one case: a named shape (bench/shapes.py) x a memory layout x a storage dtype x
a formula (the backward's training, frozen, relu, relu-mask; the forward's forward,
forward-relu) x a thread count.  For every row, in one interleaved measurement:

* ours       the package, outputs preallocated with ``out=``, ``num_threads=`` passed (once per
             kernel body with --bodies);
* probe      a STREAM-like loop (bench/stream.c) with the case's traffic pattern, over
             buffers of the case's byte size, on the same thread count: the roofline;
* torch      ``aten.native_batch_norm_backward`` (forward rows: ``aten.native_batch_norm`` in
             training mode, + ``relu_``) on views of the same data, its outputs in blocks
             reused from call to call (bench/torch_cache.cpp; optional);
* torch-alloc  the same op allocating its outputs on every call, as torch's own allocator
             does (optional);
* torch-compiled  the torch column's ops in a function compiled by torch.compile (inductor,
             CPU), once per case and thread count before the timing, its outputs in reused
             blocks too (optional; not in the default --peers, since the compilations, 1-4 s
             each, would more than double a default run: ask for it by name);
* onednn     oneDNN's batch-normalization backward (forward rows: forward_training) through
             its C API on the same buffers (optional: the onednn-cpu-gomp wheel);
* unfused    relu rows: torch's ReLU backward into a preallocated buffer, then our call
             without relu_dst; forward-relu rows: our forward without ReLU, then torch's
             relu_ in place (optional);
* numpy f32  a plain vectorised float32 NumPy implementation, what a user would write;
* reference  the package's float64 NumPy reference ``bnbw_native.reference``.

--layers adds the training-step rows of the PyTorch layers (bench/torch_layers.py: BatchNorm
and BatchNormReLU against torch.nn.BatchNorm2d and BatchNorm2d + ReLU, forward + backward);
--layers-only prints those alone.

Every row is checked against the float64 reference (fails loudly); the peers' results are
compared too.  Results go to a terminal table, a JSON file and a PNG.  bench/README.md has the
traffic model, the protocol and the columns.

Modules (bench/): machine.py (machine facts), bandwidth.py (the probe), timing.py (the
interleaved protocol), cases.py (shapes x layouts x dtypes x formulas, data), peers.py and
onednn_peer.py (the other implementations), torch_cache.py + torch_cache.cpp (the torch
peer's allocator), checks.py (against the reference), runner.py (one row), torch_layers.py
(the layer rows), procmem.py (memory readings), overhead.py and memory.py (extra measurements),
report.py (table, JSON, plot), this file (the command line).
"""
import argparse
import importlib.util
import os
import sys
from dataclasses import asdict
from time import perf_counter

import numpy as np

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

# The bench modules need BENCH_DIR on the path.
from bnbw_native import tuning  # noqa: E402

from bandwidth import PROBE_BYTES_PER_ELEMENT, Probe, bandwidth_table  # noqa: E402
from cases import (DEFAULT_FORMULAS, DTYPES, FORMULAS, FORWARD_FORMULAS, LAYOUTS,  # noqa: E402
                   MOMENTUM, OUTPUT_NAMES, PASSES, PROBE_PATTERN, select_shapes)
from checks import TOLERANCE, CheckFailed  # noqa: E402
from machine import L2_BYTES, L3_BYTES, available_cores, machine_info  # noqa: E402
from memory import peak_memory  # noqa: E402
from overhead import call_overhead  # noqa: E402
from report import (WEAK_CACHE_SPEEDUP, WEAK_DRAM_PCT, class_bandwidth,  # noqa: E402
                    fair_summary, fmt_ratio, network_totals, onednn_implementations, plot,
                    weak_rows, weak_summary, write_json)
from runner import ALL_PEERS, PEERS, TORCH_COLUMNS, Runner  # noqa: E402
from timing import FULL, QUICK  # noqa: E402
import torch_cache  # noqa: E402
import torch_layers  # noqa: E402


def parse_list(text, allowed, what):
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(allowed)})")
    return items


def parse_threads(text):
    cores = available_cores()
    out = []
    for t in text.split(","):
        t = t.strip()
        n = cores if t == "all" else int(t)
        if n <= 0:
            raise SystemExit("thread counts must be positive")
        if n not in out:
            out.append(n)
    return out


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="QUICK shapes, f32 only unless --dtypes, short measurements")
    p.add_argument("--threads", default="1,all", help="comma list, 'all' = every core")
    p.add_argument("--dtypes", default=None, help="comma list of f32,f16,bf16")
    p.add_argument("--shapes", default=None,
                   help="comma list of shape names or groups (RESNET50, RESNET50_B50, "
                        "MOBILENETV2_B50, QUICK, ...)")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"comma list of {','.join(LAYOUTS)} (NCX: channels first, NXC: "
                        "channels last)")
    p.add_argument("--formulas", default=",".join(DEFAULT_FORMULAS),
                   help=f"comma list of {','.join(FORMULAS)}")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma list of {','.join(ALL_PEERS)} ('' for none; default "
                        "%(default)s: torch-compiled, compiled once per case and thread count, "
                        "only when named)")
    p.add_argument("--split", action="store_true",
                   help="also time backward_reduce and backward_apply of training rows "
                        "against the reduce (r2) and apply (r2w1) probes")
    p.add_argument("--bodies", default=None,
                   help=f"comma list of kernel body caps ({','.join(tuning.KERNEL_CAPS)}): "
                        "ours timed once per body in the same rounds, one row each")
    p.add_argument("--layers", action="store_true",
                   help="also time a training step of the PyTorch layers against torch's own "
                        "(bench/torch_layers.py), on --threads")
    p.add_argument("--layers-only", action="store_true",
                   help="time the layer rows alone (no probes, kernel rows, overhead, memory)")
    p.add_argument("--layer-shapes", default="default",
                   help="the layer rows' shapes: comma list of sets (" +
                        ", ".join(torch_layers.SHAPE_SETS) + ")")
    p.add_argument("--json", default=os.path.join(BENCH_DIR, "results", "latest.json"),
                   help="where the rows and the machine's description are written "
                        "(default: %(default)s)")
    p.add_argument("--plot", default=os.path.join(BENCH_DIR, "results", "latest.png"),
                   help="where the ratio plot is drawn, when matplotlib is importable "
                        "(default: %(default)s)")
    return p


def print_header(info, threads, probe, runner, notes):
    print(f"machine: {info['cpu']}, {info['cores']} cores, L2 {L2_BYTES >> 10} KiB/core, "
          f"L3 {L3_BYTES >> 20} MiB; load average {info['load_average']}")
    print(f"threads used: {threads}; numpy {info['numpy']}, torch {info['torch']}, "
          f"ml_dtypes {info['ml_dtypes']}, python {info['python']}")
    for lib in info["openmp_and_blas"]:
        print(f"runtime: {lib['user_api']}/{lib['internal_api']} {lib['filepath']} "
              f"(num_threads {lib['num_threads']})")
    print(info["bnbw_native_config"])
    print(f"  imported from:    {info['bnbw_native_file']} (git {info['bnbw_native_git']})")
    if runner.bodies:
        print("kernel bodies compared: " + ", ".join(f"{cap} -> {body}" for cap, body
                                                     in runner.bodies.items()))
    if info.get("onednn"):
        o = info["onednn"]
        print(f"oneDNN: {o['version']} ({o['cpu_runtime']}), {o['library']}")
    print(f"probe: {probe.kind}; reference: {runner.reference_name}; hardware counters "
          f"(perf stat): {'yes' if info['perf_counters'] else 'not available'}")
    if runner.peers & {"torch", "torch-alloc"}:
        print("torch peer: xtorch = " + (
            "outputs in blocks reused from call to call (bench/torch_cache.cpp as torch's CPU "
            "allocator), no new pages per call" if runner.torch_cache is not None else
            "outputs allocated on every call (the reused-block allocator is unavailable)") +
            "; xtorch-alloc = outputs allocated on every call by torch's own allocator; ReLU "
            "rows: threshold_backward.grad_input into a preallocated buffer for xtorch and "
            "xunfus" + ("; forward rows: aten.native_batch_norm in training mode (momentum "
                        f"{1 - MOMENTUM:g}, torch's convention), forward-relu + torch.relu_ in "
                        "place; xunfus = our forward, then torch.relu_ on its output"
                        if set(runner.formulas) & set(FORWARD_FORMULAS) else ""))
    if "torch-compiled" in runner.peers:
        print("torch-compiled peer: xtorch-compiled = the torch column's ops (backward: "
              "aten.native_batch_norm_backward from the saved statistics; forward rows: "
              "aten.native_batch_norm in training mode) in a function compiled by torch.compile "
              "(inductor, dynamic=False, fullgraph=True) once per case and thread count, "
              "before the timing; " + ("outputs in reused blocks, as xtorch's"
                                       if runner.torch_cache is not None else
                                       "outputs allocated on every call") +
              "; its err is inductor's float32 arithmetic (JSON torch_compiled_err, compile "
              "seconds per row)")
    for note in notes:
        print(f"NOTE: {note}")


TRAFFIC_TEXT = (
    "traffic model: training 20 B/element for f32 (reduce reads x, dy: 8; apply reads x, dy, "
    "writes dx: 12); frozen 8 B/element (reads dy, writes dx); relu 28 (y read in both passes), "
    "relu-mask 22 (a 1-byte mask); forward and forward-relu 12 (the two-read model: the "
    "statistics read x, the normalisation reads x again and writes y); f16/bf16 halve the "
    "tensors' bytes; strided layout x2 (whole cache lines of a 2x wider buffer)")


def traffic_model():
    """The JSON's "traffic_model"."""
    return {"bytes_per_element_per_tensor_pass": PASSES,
            "training_bytes_per_f32_element": 20,
            "frozen_bytes_per_f32_element": 8,
            "relu_bytes_per_f32_element": 28,
            "relu_mask_bytes_per_f32_element": 22,
            "forward_bytes_per_f32_element": 12,
            "forward_relu_bytes_per_f32_element": 12,
            "forward_model": "two reads and one write of the storage dtype per element: x "
                             "for the statistics, x again and y for the normalisation",
            "probe_pattern": PROBE_PATTERN,
            "half_precision": "half of f32 for the tensors, masks 1 byte",
            "strided_factor": 2}


def layer_shapes(text):
    """The layer rows' shapes of a comma list of torch_layers.SHAPE_SETS names."""
    shapes = []
    for name in parse_list(text, tuple(torch_layers.SHAPE_SETS), "layer shape set"):
        chosen = getattr(torch_layers, torch_layers.SHAPE_SETS[name])
        shapes += [s for s in chosen if s not in shapes]
    return shapes


def run_layers(threads, protocol, shapes=None, echo=print):
    """The layer rows (bench/torch_layers.py), printed as they come; [] with a note on stderr
    when torch is not importable."""
    if torch_layers.torch is None:
        print("NOTE: layer rows skipped: torch is not importable", file=sys.stderr)
        return []
    print("\nlayer rows: one training step (forward + backward) of bnbw_native.autograd's layer "
          "and of torch's, float32, timed interleaved; ms = median per step; x torch = torch's "
          "ms / ours (> 1: ours is faster), (min) the same of the fastest samples; err = ours "
          "against torch's layer (y, x.grad, weight.grad, bias.grad); faults o/t = page faults "
          "per step, ours / torch's (both allocate through torch, whose CPU allocator is "
          f"bench/torch_cache.cpp while they are timed: "
          f"{'reused blocks' if torch_cache.load() is not None else 'absent, torch own: ' + str(torch_cache.why_absent)})")
    echo(torch_layers.HEADER)
    return torch_layers.layer_rows(torch_layers.SHAPES if shapes is None else shapes, threads,
                                   protocol,
                                   echo=lambda row: echo(torch_layers.format_row(row)))


def main(argv=None):
    args = parser().parse_args(argv)

    wall0 = perf_counter()
    protocol = QUICK if args.quick else FULL
    threads = parse_threads(args.threads)
    if args.layers_only:
        return layers_only(args, protocol, threads, wall0)
    dtypes = parse_list(args.dtypes or ("f32" if args.quick else ",".join(TOLERANCE)),
                        list(TOLERANCE), "dtype")
    notes = []
    if "bf16" in dtypes and "bf16" not in DTYPES:
        dtypes.remove("bf16")
        notes.append("bf16 rows skipped: ml_dtypes is not installed")
    peers = parse_list(args.peers, ALL_PEERS, "peer")
    bodies = parse_list(args.bodies, tuning.KERNEL_CAPS, "kernel body") if args.bodies \
        else None
    named = select_shapes(args.shapes, args.quick)
    formulas = parse_list(args.formulas, FORMULAS, "formula")

    probe = Probe()
    runner = Runner(protocol, threads, dtypes, parse_list(args.layouts, LAYOUTS, "layout"),
                    formulas, peers, probe, split=args.split, bodies=bodies)
    notes += runner.notes
    if probe.note:
        notes.append(probe.note)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        notes.append(f"plot {args.plot} not drawn: matplotlib is not installed")
        args.plot = ""

    info = machine_info(threads)
    if runner.onednn is not None:
        info["onednn"] = runner.onednn.describe()
    if runner.bodies:
        info["kernel_bodies"] = runner.bodies
    print_header(info, threads, probe, runner, notes)

    sections = {"setup": perf_counter() - wall0}
    t0 = perf_counter()
    print("\nbandwidth probes, GB/s (array = size of each of the 2-3 arrays touched):")
    bw = bandwidth_table(probe, threads, protocol, args.quick)
    sections["bandwidth table"] = perf_counter() - t0
    print(f"  {'class':<5} {'array':>9} {'thr':>3} " +
          " ".join(f"{p:>8}" for p in PROBE_BYTES_PER_ELEMENT))
    for e in bw:
        print(f"  {e['class']:<5} {e['array_bytes'] >> 10:>6}KiB {e['threads']:>3} " +
              " ".join(f"{e[p]:8.1f}" for p in PROBE_BYTES_PER_ELEMENT))

    print("\n" + TRAFFIC_TEXT)
    print("columns: ms = median of our calls; GB/s = model bytes / ms; %roof = roofline time "
          "(probe) / our time; xtorch, xtorch-alloc, xtorch-compiled, xonednn, xunfus, xnp32, "
          "xref = peer ms / our ms (xtorch: torch's outputs in reused blocks; xtorch-alloc: "
          "allocated per call; xtorch-compiled: torch.compile's, when asked for); "
          "err dx = vs float64 reference" +
          (" (err dx|y: dst's on forward rows; forward momentum "
           f"{MOMENTUM}, the old statistics' weight)" if set(formulas) & set(FORWARD_FORMULAS)
           else "") + "\n")
    print(runner.table.header)
    t0 = perf_counter()
    try:
        rows = runner.run_shapes(named)
    except CheckFailed as exc:
        print(f"\nRESULT CHECK FAILED: {exc}", file=sys.stderr)
        write_json({"machine": info, "failure": str(exc),
                    "rows": [asdict(r) for r in runner.rows]}, args.json)
        return 1
    sections["rows"] = perf_counter() - t0

    impls = onednn_implementations(rows)
    if impls:
        print("\noneDNN implementations chosen (rows): " +
              ", ".join(f"{name} ({n})" for name, n in impls.items()))

    networks = network_totals(rows)
    if networks:
        print("\nwhole networks, every batch norm once: its backward, or its forward for the "
              "forward formulas (sum of layers x ms):")
        for e in networks:
            print(f"  {e['network']:<16} {e['layout']:<7} {e['dtype']:<4} {e['formula']:<12} "
                  f"thr {e['threads']} {e['body']}: ours {e['ours_ms']:9.2f} ms, "
                  f"xtorch {fmt_ratio(e['vs_torch'])}, xtorch-alloc "
                  f"{fmt_ratio(e['vs_torch_alloc'])}, " +
                  (f"xtorch-compiled {fmt_ratio(e['vs_torch_compiled'])}, "
                   if "torch-compiled" in runner.peers else "") +
                  f"xonednn {fmt_ratio(e['vs_onednn'])}")

    fair = fair_summary(rows)
    if fair:
        print("\nagainst the faster fair peer (torch with reused blocks, compiled torch, "
              "oneDNN: its ms / ours): geometric mean (worst row), rows >= 1.0 and >= 1.3, "
              "median % of the two-pass roofline:")
        for (formula, dtype, layout, thr), s in fair:
            print(f"  {formula:<12} {dtype:<4} {layout:<7} thr {thr}: {s['geomean']:5.2f} "
                  f"(min {s['min']:.2f}, {s['min_case']}), >= 1.0: {s['at_least_1']}/"
                  f"{s['rows']}, >= 1.3: {s['at_least_1_3']}, roofline {s['roofline_pct']:.0f}%")

    t0 = perf_counter()
    overhead = call_overhead(rounds=5 if args.quick else 9, number=300 if args.quick else 2000,
                             onednn=runner.onednn)
    print(f"\nper-call overhead on {tuple(overhead['shape'])} f32 NCX training (median us/call):")
    for name, us in overhead["us_per_call"].items():
        print(f"  {name:<36} {us:8.1f}")
    sections["overhead"] = perf_counter() - t0

    t0 = perf_counter()
    big_name = max(named, key=lambda n: np.prod(named[n]))
    memory = peak_memory(big_name, named[big_name], runner.reference,
                         torch_cache=runner.torch_cache)
    print(f"\npeak extra memory of one call on {big_name} {tuple(memory['shape'])} f32 NCX "
          f"(one tensor = {memory['tensor_bytes'] / 2**20:.1f} MiB):")
    print(f"  {'call':<30} {'tracemalloc':>12} {'RSS growth':>12}")
    for label, m in memory["peak"].items():
        rss = m["rss_growth_bytes"]
        print(f"  {label:<30} {m['tracemalloc_bytes'] / 2**20:9.2f} MiB "
              f"{'-' if rss is None else f'{rss / 2**20:9.2f} MiB':>12}")
    print("  (tracemalloc: Python/NumPy allocations only; RSS growth: new resident pages, any "
          "allocator, torch included; torch 'reused blocks' is the xtorch column's allocator)")
    sections["memory"] = perf_counter() - t0

    per_class = class_bandwidth(rows)
    print("\nprobe bandwidth per size class (median over rows, model bytes / roofline time):")
    for e in per_class:
        print(f"  {e['class']:<5} {e['formula']:<12} {e['threads']} thread(s): "
              f"{e['probe_gbs']:6.1f} GB/s  ({e['rows']} rows)")

    weak = weak_rows(rows)
    print(f"\nweak rows (DRAM < {WEAK_DRAM_PCT:.0f}% of roofline, tiny/L2/L3 < "
          f"{WEAK_CACHE_SPEEDUP:.0f}x torch (xtorch, reused blocks)): {len(weak)} of {len(rows)}; "
          "by group (weak/rows, median % of roofline, median x torch):")
    for key, group in weak_summary(rows, weak):
        print(f"  {key[0]:<4} {key[1]:<4} {key[2]:<12} {key[3]:<7} thr {key[4]}: "
              f"{group['weak']:>2}/{group['rows']:<2} {group['roofline_pct']:6.1f}% "
              f"{group['vs_torch']:6.2f}x")

    layers = None
    if args.layers:
        t0 = perf_counter()
        try:
            layers = run_layers(threads, protocol, layer_shapes(args.layer_shapes))
        except CheckFailed as exc:
            print(f"\nLAYER CHECK FAILED: {exc}", file=sys.stderr)
            write_json({"machine": info, "failure": str(exc),
                        "rows": [asdict(r) for r in rows]}, args.json)
            return 1
        sections["layers"] = perf_counter() - t0

    info["load_average_end"] = list(os.getloadavg())
    results = {
        "machine": info, "notes": notes,
        "protocol": asdict(protocol), "quick": args.quick,
        "torch_peer": runner.torch_peer_info() if runner.peers & TORCH_COLUMNS else None,
        "traffic_model": traffic_model(),
        "forward_momentum": MOMENTUM,
        "err_outputs": {"backward": OUTPUT_NAMES["backward"],
                        "forward": OUTPUT_NAMES["forward"]},
        "tolerance": TOLERANCE, "bandwidth": bw, "bandwidth_per_class": per_class,
        "onednn_implementations": impls, "networks": networks,
        "fair": [dict(zip(("formula", "dtype", "layout", "threads"), key), **stats)
                 for key, stats in fair],
        "rows": [asdict(r) for r in rows], "overhead": overhead, "memory": memory,
        "weak": [{"case": r.case, "layout": r.layout, "dtype": r.dtype, "formula": r.formula,
                  "threads": r.threads, "body": r.body, "why": why} for r, why in weak],
        "layers": None if layers is None else [asdict(r) for r in layers],
    }
    t0 = perf_counter()
    if args.plot:
        plot(rows, args.plot)
    sections["plot"] = perf_counter() - t0
    return finish(results, sections, args, wall0, info)


def layers_only(args, protocol, threads, wall0):
    """--layers-only: the header's machine lines, the layer rows, their JSON."""
    info = machine_info(threads)
    print(f"machine: {info['cpu']}, {info['cores']} cores; load average {info['load_average']}")
    print(f"threads used: {threads}; torch {info['torch']}, python {info['python']}")
    print(info["bnbw_native_config"])
    sections = {"setup": perf_counter() - wall0}
    t0 = perf_counter()
    try:
        layers = run_layers(threads, protocol, layer_shapes(args.layer_shapes))
    except CheckFailed as exc:
        print(f"\nLAYER CHECK FAILED: {exc}", file=sys.stderr)
        write_json({"machine": info, "failure": str(exc)}, args.json)
        return 1
    sections["layers"] = perf_counter() - t0
    info["load_average_end"] = list(os.getloadavg())
    results = {"machine": info, "protocol": asdict(protocol), "quick": args.quick,
               "layers": [asdict(r) for r in layers]}
    return finish(results, sections, argparse.Namespace(json=args.json, plot=""), wall0, info)


def finish(results, sections, args, wall0, info):
    results["section_seconds"] = sections
    results["wall_seconds"] = wall = perf_counter() - wall0
    write_json(results, args.json)
    print(f"\nwrote {args.json}" + (f" and {args.plot}" if args.plot else "") +
          f"; wall time {wall:.1f} s (" +
          ", ".join(f"{k} {v:.1f}" for k, v in sections.items()) +
          f"); load average at end {info['load_average_end']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
