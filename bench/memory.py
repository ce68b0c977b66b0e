"""Peak extra memory of one call on a large case: ours, the peers (readings from procmem.py)."""
import tracemalloc

import numpy as np

import bnbw_native

from cases import EPSILON, make_problem
from peers import numpy_f32_backward, torch, torch_call, torch_inputs
from procmem import release_free_heap, reset_rss_peak, status_bytes


def peak_growth(call):
    """(tracemalloc peak bytes, RSS high-water growth bytes or None) of one call()."""
    release_free_heap()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    can_reset = reset_rss_peak()
    rss0 = status_bytes().get("VmRSS")
    result = call()
    traced = tracemalloc.get_traced_memory()[1] - before
    tracemalloc.stop()
    rss = status_bytes()
    del result
    growth = rss["VmHWM"] - rss0 if can_reset and rss0 and "VmHWM" in rss else None
    return int(traced), growth


def peak_memory(name, shape, reference, torch_cache=None):
    """Peak extra memory of one call on a large f32 NCX case.

    tracemalloc sees Python and NumPy allocations (not C malloc in the kernels, not torch's
    allocator).  The RSS figure is the growth of the resident high-water mark during the call
    (new pages touched, any allocator), when Linux lets us reset that mark.  With `torch_cache`
    (the loaded torch_cache allocator), torch is measured a second time with its outputs in
    reused blocks, as the xtorch column times it."""
    problem = make_problem(name, shape, "f32")
    x, dy, mean, var, gamma = (problem[k] for k in ("x", "dy", "mean", "var", "gamma"))
    C = x.shape[1]
    out = (np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32))
    out[0].fill(0)
    fns = {
        "ours training (out=)": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPSILON, data_format="NCX", out=out),
        "ours frozen (out=)": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPSILON, data_format="NCX", num_outputs=1,
            out=out[:1]),
        "ours training (allocating)": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPSILON, data_format="NCX"),
        "numpy f32 training": lambda: numpy_f32_backward(x, dy, mean, var, gamma, EPSILON,
                                                         "NCX", 3),
        "reference training": lambda: reference(x, dy, mean, var, gamma, epsilon=EPSILON,
                                                data_format="NCX", num_outputs=3),
    }
    if torch is not None:
        fns["torch training (allocating)"] = torch_call(*torch_inputs((x, dy), "NCX"), problem,
                                                        3)
        if torch_cache is not None:
            fns["torch training (reused blocks)"] = fns["torch training (allocating)"]
    result = {}
    for label, fn in fns.items():
        reuse = torch_cache is not None and label.endswith("(reused blocks)")
        if reuse:
            torch_cache.on()
        try:
            for _ in range(3 if reuse else 1):  # warm: first-call allocations are not the point
                fn()                            # (torch's blocks settle in two calls)
            traced, growth = peak_growth(fn)
        finally:
            if reuse:
                torch_cache.off()
                torch_cache.flush()
        result[label] = {"tracemalloc_bytes": traced, "rss_growth_bytes": growth}
    return {"case": name, "shape": list(shape), "tensor_bytes": int(x.nbytes),
            "peak": result}
