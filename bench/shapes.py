"""Named shape lists shared by the tests and the benchmarks.

Every shape is given in NCX logical order: (N, C, spatial...) for images and volumes, (N, C)
for dense layers.  The channel is axis 1 and every other axis is reduced.  The memory layout
(NCX contiguous, channel-last NXC, strided view) is chosen by whoever uses the shape, never
here: the same name means the same logical problem in every layout.

Import from a test or a script with the bench directory on the path::

    sys.path.insert(0, str(REPO / "bench"))
    import shapes
    shapes.ALL["r50-conv4"]        # (32, 256, 14, 14)

Size notes for this project's reference machine (L2 1 MiB per core, L3 ~36 MiB shared):
"elements" is the product of the sizes, one f32 tensor is 4 bytes per element and a training
call touches three tensors (x, dy read; dx written).
"""

# ResNet-50 batch-norm layers, training batch 32 (64 for the stem, the largest tensor).
RESNET50 = {
    "r50-stem": (64, 64, 112, 112),    # 51.4 M elements, 205 MB per f32 tensor: DRAM
    "r50-conv2": (32, 64, 56, 56),     # 6.4 M, 25.7 MB per tensor: DRAM (3 tensors > L3)
    "r50-conv3": (32, 128, 28, 28),    # 3.2 M, 12.8 MB per tensor: DRAM at the L3 edge
    "r50-conv4": (32, 256, 14, 14),    # 1.6 M, 6.4 MB per tensor: L3
    "r50-conv5": (32, 512, 7, 7),      # 0.8 M, 3.2 MB per tensor: L3; rows of 49 elements
}

# Fully connected / batch-norm-1d: no spatial axis, channel stride 1 in both layouts.
DENSE = {
    "fc-2048": (256, 2048),            # 0.5 M, 2 MB per tensor: L3
}

# A 5-D (volumetric) case: N, C, D, H, W.
VOLUMETRIC = {
    "3d": (4, 32, 16, 32, 32),         # 2.1 M, 8.4 MB per tensor: L3/DRAM edge
}

# Tensors that fit in L2 (one tensor <= 256 KiB, three tensors < 1 MiB).
CACHE = {
    "cache-4d": (8, 32, 16, 16),       # 64 K elements, 256 KiB per tensor
    "cache-2d": (64, 512),             # 32 K elements, 128 KiB per tensor
}

# Odd, tiny and degenerate sizes: lengths that are not multiples of any vector width, a
# single-element reduction (M = 1, so var = 0 and x == mean), and a call-overhead probe.
SMALL_ODD = {
    "odd-4d": (3, 7, 5, 11),           # M = 165 per channel, all sizes odd
    "m1-3d": (1, 3, 1),                # M = 1: every channel reduces one element
    "tiny-2d": (8, 16),                # the per-call overhead shape
}

GROUPS = {
    "RESNET50": RESNET50,
    "DENSE": DENSE,
    "VOLUMETRIC": VOLUMETRIC,
    "CACHE": CACHE,
    "SMALL_ODD": SMALL_ODD,
}

ALL = {name: shape for group in GROUPS.values() for name, shape in group.items()}

# A subset for `run.py --quick` and for smoke tests: one DRAM shape, one L3 shape, one
# L2 shape, an odd case and the tiny one.
QUICK = {name: ALL[name] for name in
         ("r50-conv2", "r50-conv4", "cache-4d", "odd-4d", "tiny-2d")}

# The shape the per-call overhead is measured on.
OVERHEAD_SHAPE = SMALL_ODD["tiny-2d"]

assert len(ALL) == sum(len(group) for group in GROUPS.values()), "duplicate shape names"
