# Channel-first <-> channel-last copies by tiles (compiled from _relayout.pyx); _torch_ops uses it.

PARALLEL_MIN: int

def transpose_samples(
    src: int,
    dst: int,
    samples: int,
    rows: int,
    cols: int,
    itemsize: int,
    num_threads: int = 0,
) -> None: ...
