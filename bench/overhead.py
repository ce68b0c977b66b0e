"""Per-call overhead: microseconds per call on the tiny shape, ours and the peers."""
from time import perf_counter

import numpy as np
from threadpoolctl import threadpool_limits

import bnbw_native

import shapes as shape_lists
from cases import EPSILON, MOMENTUM, make_problem
from peers import numpy_f32_backward, torch, torch_call, torch_inputs


def call_overhead(rounds, number, onednn=None):
    """Median microseconds per call on the tiny shape: ours (out= and not; the forward with
    out=), torch, numpy, and oneDNN (a loaded onednn_peer binding, when given)."""
    problem = make_problem("overhead", shape_lists.OVERHEAD_SHAPE, "f32")
    x, dy, mean, var, gamma = (problem[k] for k in ("x", "dy", "mean", "var", "gamma"))
    C = x.shape[1]
    out = (np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32))
    fwd_out = (np.empty_like(x),) + tuple(np.empty(C, np.float32) for _ in range(4))
    fns = {
        "ours (out=, 1 thread)": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPSILON, data_format="NCX", out=out,
            num_threads=1),
        "ours (allocating, default threads)": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPSILON, data_format="NCX"),
        "ours frozen (out=, 1 thread)": lambda: bnbw_native.batchnorm_training_backward(
            x, dy, mean, var, gamma, epsilon=EPSILON, data_format="NCX", num_outputs=1,
            out=out[:1], num_threads=1),
        "ours forward (out=, 1 thread)": lambda: bnbw_native.batchnorm_training_forward(
            x, problem["run_mean"], problem["run_var"], gamma, problem["beta"],
            epsilon=EPSILON, momentum=MOMENTUM, data_format="NCX", out=fwd_out,
            num_threads=1),
        "numpy f32": lambda: numpy_f32_backward(x, dy, mean, var, gamma, EPSILON, "NCX", 3),
    }
    if torch is not None:
        fns["torch (1 thread)"] = torch_call(*torch_inputs((x, dy), "NCX"), problem, 3)
        torch.set_num_threads(1)
    if onednn is not None:   # its thread count is fixed when the primitive is created
        dout = (np.empty_like(x), np.empty(C, np.float32), np.empty(C, np.float32))
        with threadpool_limits(limits=1):
            fns["onednn (1 thread)"] = onednn.backward(
                x, dy, mean, var, gamma, dout, epsilon=EPSILON, data_format="NCX",
                formula="training")
    result = {}
    for name, fn in fns.items():   # batches of `number` calls, one implementation at a time
        for _ in range(number):
            fn()
        samples = []
        for _ in range(rounds):
            t0 = perf_counter()
            for _ in range(number):
                fn()
            samples.append((perf_counter() - t0) / number)
        result[name] = float(np.median(samples)) * 1e6
    return {"shape": list(shape_lists.OVERHEAD_SHAPE), "us_per_call": result}
