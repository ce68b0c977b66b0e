"""The report: the terminal table, the summaries (weak rows, probe bandwidth per size class),
the JSON file and the plot."""
import json
import os

import numpy as np

import shapes as shape_lists
from cases import DTYPE_KEYS

WEAK_DRAM_PCT = 90.0     # DRAM-sized rows below this % of roofline are flagged
WEAK_CACHE_SPEEDUP = 2.0  # cache-sized rows below this speed-up over torch are flagged


def fmt_ratio(value):
    return f"{value:6.2f}" if value is not None else "     -"


class Table:
    """The terminal table's columns: the standard ones, plus `xtorch-alloc` when the run times
    torch allocating its outputs (the default), `xtorch-compiled` when it times torch.compile's
    (asked for), `xunfus` when it has fused ReLU rows and `body`, `xbody` when it compares
    kernel bodies.  With forward rows (`forward`) the error column is headed `err dx|y`: dx's
    error on backward rows, dst's on forward rows."""

    def __init__(self, unfused=False, bodies=False, torch_alloc=True, forward=False,
                 torch_compiled=False):
        self.unfused, self.bodies, self.torch_alloc = unfused, bodies, torch_alloc
        self.forward, self.torch_compiled = forward, torch_compiled

    @property
    def header(self):
        return (f"{'case':<14} {'layout':<7} {'dtype':<4} {'formula':<12} {'thr':>3} "
                f"{'class':<4} " + (f"{'body':<7} " if self.bodies else "") +
                f"{'ms':>9} {'GB/s':>6} {'%roof':>6} "
                + (f"{'xbody':>6} " if self.bodies else "") +
                f"{'xtorch':>6} " + (f"{'xtorch-alloc':>12} " if self.torch_alloc else "") +
                (f"{'xtorch-compiled':>15} " if self.torch_compiled else "") +
                f"{'xonednn':>7} "
                + (f"{'xunfus':>6} " if self.unfused else "") +
                f"{'xnp32':>6} {'xref':>6} {'err dx|y' if self.forward else 'err dx':>8} "
                "check")

    def row(self, row):
        notes = (" " + ",".join(row.notes)) if row.notes else ""
        body = (row.body or "-")[:7]
        return (f"{row.case:<14} {row.layout:<7} {row.dtype:<4} {row.formula:<12} "
                f"{row.threads:>3} {row.size_class:<4} "
                + (f"{body:<7} " if self.bodies else "") +
                f"{row.ours_ms:9.4f} {row.gbs:6.1f} {row.roofline_pct:6.1f} "
                + (f"{fmt_ratio(row.vs_first_body)} " if self.bodies else "") +
                f"{fmt_ratio(row.vs_torch)} "
                + (f"{fmt_ratio(row.vs_torch_alloc):>12} " if self.torch_alloc else "") +
                (f"{fmt_ratio(row.vs_torch_compiled):>15} " if self.torch_compiled else "") +
                f"{fmt_ratio(row.vs_onednn):>7} "
                + (f"{fmt_ratio(row.vs_unfused)} " if self.unfused else "") +
                f"{fmt_ratio(row.vs_numpy)} {fmt_ratio(row.vs_ref)} "
                f"{row.err[0] if row.err else float('nan'):8.1e} {row.check}{notes}")


def format_row(row, table=None):
    return (table or Table()).row(row)


def weak_rows(rows):
    """Rows that are input for kernel work: DRAM rows below WEAK_DRAM_PCT of roofline,
    cache-sized rows (tiny, L2, L3) below WEAK_CACHE_SPEEDUP x torch."""
    weak = []
    for row in rows:
        if row.size_class == "DRAM" and row.roofline_pct < WEAK_DRAM_PCT:
            weak.append((row, f"{row.roofline_pct:.0f}% of roofline"))
        elif row.size_class != "DRAM" and row.vs_torch is not None \
                and row.vs_torch < WEAK_CACHE_SPEEDUP:
            weak.append((row, f"{row.vs_torch:.2f}x torch"))
    return weak


def weak_summary(rows, weak):
    """[(class, dtype, formula, layout, threads), stats] for the groups holding weak rows."""
    weak_ids = {id(row) for row, _ in weak}
    groups = {}
    for row in rows:
        key = (row.size_class, row.dtype, row.formula, row.layout, row.threads)
        groups.setdefault(key, []).append(row)
    order = {c: i for i, c in enumerate(("DRAM", "L3", "L2", "tiny"))}
    out = []
    for key in sorted(groups, key=lambda k: (order.get(k[0], 9), k[1:])):
        members = groups[key]
        n_weak = sum(id(r) in weak_ids for r in members)
        if n_weak:
            ratios = [r.vs_torch for r in members if r.vs_torch is not None]
            out.append((key, {"weak": n_weak, "rows": len(members),
                              "roofline_pct": float(np.median([r.roofline_pct
                                                               for r in members])),
                              "vs_torch": float(np.median(ratios)) if ratios else float("nan")}))
    return out


def class_bandwidth(rows):
    """Median probe GB/s (model bytes / roofline time) per (size class, formula, threads)."""
    groups = {}
    for row in rows:
        groups.setdefault((row.size_class, row.formula, row.threads), []).append(row.probe_gbs)
    return [{"class": c, "formula": f, "threads": t, "probe_gbs": float(np.median(v)),
             "rows": len(v)} for (c, f, t), v in sorted(groups.items())]


def network_totals(rows):
    """For each whole network (shapes.NETWORK_LAYERS) whose every shape has a row: the time of
    all its batch norms' backward, or forward for the forward formulas (each shape's ms x how
    many layers have it), ours and the peers (torch with reused blocks, torch allocating,
    torch compiled, oneDNN), per layout, dtype, formula, threads and body.  A peer's total
    needs all its rows."""
    out = []
    for group in shape_lists.NETWORK_LAYERS:
        members = shape_lists.GROUPS[group]
        variants = {}
        for row in rows:
            if row.case in members:
                key = (row.layout, row.dtype, row.formula, row.threads, row.body)
                variants.setdefault(key, {})[row.case] = row
        for (layout, dtype, formula, threads, body), found in variants.items():
            if set(found) != set(members):
                continue
            entry = {"network": group, "layout": layout, "dtype": dtype, "formula": formula,
                     "threads": threads, "body": body}
            for who, attr in (("ours", "ours_ms"), ("torch", "torch_ms"),
                              ("torch_alloc", "torch_alloc_ms"),
                              ("torch_compiled", "torch_compiled_ms"), ("onednn", "onednn_ms")):
                times = [getattr(r, attr) for r in found.values()]
                entry[f"{who}_ms"] = (sum(shape_lists.LAYERS[n] * getattr(r, attr)
                                          for n, r in found.items())
                                      if all(t is not None for t in times) else None)
            for who in ("torch", "torch_alloc", "torch_compiled", "onednn"):
                entry[f"vs_{who}"] = (entry[f"{who}_ms"] / entry["ours_ms"]
                                      if entry[f"{who}_ms"] else None)
            out.append(entry)
    return out


def fair_summary(rows):
    """Each row against the faster fair peer: the fastest of the peers that ran on memory they
    reuse (torch with reused blocks, compiled torch, oneDNN) divided by ours, > 1 where ours is
    faster; rows that no such peer ran are left out.  [((formula, dtype, layout, threads),
    stats)]: the rows' geometric mean, the worst row and its case, how many rows reach 1.0 and
    1.3, and their median % of the two-pass roofline."""
    groups = {}
    for row in rows:
        peers = [t for t in (row.torch_ms, row.torch_compiled_ms, row.onednn_ms) if t]
        if peers and row.ours_ms > 0:
            key = (row.formula, row.dtype, row.layout, row.threads)
            groups.setdefault(key, []).append((min(peers) / row.ours_ms, row))
    out = []
    for key in sorted(groups):
        members = groups[key]
        ratios = np.array([ratio for ratio, _ in members])
        worst, worst_row = min(members, key=lambda m: m[0])
        out.append((key, {"rows": len(members), "geomean": float(np.exp(np.log(ratios).mean())),
                          "min": float(worst), "min_case": worst_row.case,
                          "at_least_1": int((ratios >= 1.0).sum()),
                          "at_least_1_3": int((ratios >= 1.3).sum()),
                          "roofline_pct": float(np.median([r.roofline_pct
                                                           for _, r in members]))}))
    return out


def onednn_implementations(rows):
    """{implementation oneDNN chose: number of rows}, "unsupported" included."""
    found = {}
    for row in rows:
        if row.onednn_impl is not None:
            found[row.onednn_impl] = found.get(row.onednn_impl, 0) + 1
    return found


def plot(rows, path):
    """% of roofline, speed-up vs PyTorch and vs oneDNN (when measured) per case."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = []
    for row in rows:
        key = (row.case, row.layout, row.formula)
        if key not in keys:
            keys.append(key)
    variants = sorted({(row.dtype, row.threads, row.body if row.body_cap else None)
                       for row in rows},
                      key=lambda v: (DTYPE_KEYS.index(v[0]), v[1], v[2] or ""))
    colors = {"f32": "tab:blue", "f16": "tab:orange", "bf16": "tab:green"}
    markers = ["o", "s", "^", "D"]
    thread_list = sorted({row.threads for row in rows})
    bodies = sorted({row.body for row in rows if row.body_cap})
    forward = any(row.formula.startswith("forward") for row in rows)
    backward = any(not row.formula.startswith("forward") for row in rows)
    models = "; ".join(name for name, there in (("backward: two-pass model", backward),
                                                ("forward: two-read model", forward)) if there)
    panels = [("roofline_pct", "% of roofline (probe time / our time)",
               f"bnbw_native: % of the roofline ({models})")]
    torch_ops = " / ".join(name for name, there in (("native_batch_norm_backward", backward),
                                                    ("native_batch_norm", forward)) if there)
    onednn_ops = " / ".join(name for name, there in (("backward", backward),
                                                     ("forward_training", forward)) if there)
    for attr, who, what in (("vs_torch", "PyTorch",
                             f"torch.ops.aten.{torch_ops}, outputs in reused blocks"),
                            ("vs_onednn", "oneDNN",
                             f"oneDNN's batch normalization {onednn_ops}")):
        if any(getattr(r, attr) for r in rows):
            panels.append((attr, f"speed-up vs {who} ({who} ms / our ms)",
                           f"speed-up vs {what}"))
    width = max(8.0, 0.28 * len(keys) + 2)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, 1.5 + 3.5 * len(panels)),
                             sharex=True, squeeze=False)
    axes = axes[:, 0]
    spread = 0.6 / max(1, len(variants))
    for vi, (dtype_key, nthreads, body) in enumerate(variants):
        sel = [r for r in rows if (r.dtype, r.threads) == (dtype_key, nthreads)
               and (body is None or r.body == body)]
        xs = [keys.index((r.case, r.layout, r.formula)) - 0.3 + spread * (vi + 0.5)
              for r in sel]
        label = f"{dtype_key}, {nthreads} thread{'s' if nthreads > 1 else ''}" + \
            (f", {body}" if body else "")
        style = dict(color=colors.get(dtype_key, "k"), linestyle="none", markersize=5,
                     marker=markers[thread_list.index(nthreads) % len(markers)], label=label)
        if body and bodies.index(body) > 0:
            style["markerfacecolor"] = "none"
        for ax, (attr, _, _) in zip(axes, panels):
            points = [(x, getattr(r, attr)) for x, r in zip(xs, sel) if getattr(r, attr)]
            if points:
                ax.plot(*zip(*points), **style)
    axes[0].axhline(100, color="gray", lw=0.8)
    axes[0].axhline(WEAK_DRAM_PCT, color="gray", lw=0.8, ls=":")
    axes[0].legend(fontsize=7, ncol=min(len(variants), 6))
    for ax, (attr, ylabel, title) in zip(axes, panels):
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_xlim(-0.6, len(keys) - 0.4)
        if attr != "roofline_pct":
            ax.set_yscale("log")
            ax.axhline(1, color="gray", lw=0.8)
            if attr == "vs_torch":
                ax.axhline(WEAK_CACHE_SPEEDUP, color="gray", lw=0.8, ls=":")
    axes[-1].set_xticks(range(len(keys)))
    axes[-1].set_xticklabels([f"{c} {l} {f}" for c, l, f in keys], rotation=90, fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(results, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=lambda o: o.tolist()
                  if isinstance(o, np.ndarray) else str(o))
