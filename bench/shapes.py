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

# --- Every distinct batch norm of two published networks, at training batch 50 -------------
# Each entry is one distinct BN input shape; the comment gives how many BN layers of the network
# have it (LAYERS below holds the same counts as data), so a sum weighted by LAYERS is one
# whole backward pass of the network's batch norms.  Input 224 x 224.

# ResNet-50 (He et al. 2016, "Deep Residual Learning for Image Recognition", Table 1), with the
# stride-2 of each stage's first bottleneck on its 3x3 convolution (torchvision's "v1.5"): a
# stage's first 1x1 convolution still sees the previous stage's resolution.  53 batch norms.
RESNET50_B50 = {
    "r50b50-64x112": (50, 64, 112, 112),    # 1: stem
    "r50b50-64x56": (50, 64, 56, 56),       # 6: conv2_x 1x1 and 3x3 (x3)
    "r50b50-256x56": (50, 256, 56, 56),     # 4: conv2_x expansion (x3), projection
    "r50b50-128x56": (50, 128, 56, 56),     # 1: conv3_1 first 1x1 (before the stride)
    "r50b50-128x28": (50, 128, 28, 28),     # 7: conv3_1 3x3, conv3_2..4 1x1 and 3x3
    "r50b50-512x28": (50, 512, 28, 28),     # 5: conv3_x expansion (x4), projection
    "r50b50-256x28": (50, 256, 28, 28),     # 1: conv4_1 first 1x1
    "r50b50-256x14": (50, 256, 14, 14),     # 11: conv4_1 3x3, conv4_2..6 1x1 and 3x3
    "r50b50-1024x14": (50, 1024, 14, 14),   # 7: conv4_x expansion (x6), projection
    "r50b50-512x14": (50, 512, 14, 14),     # 1: conv5_1 first 1x1
    "r50b50-512x7": (50, 512, 7, 7),        # 5: conv5_1 3x3, conv5_2..3 1x1 and 3x3
    "r50b50-2048x7": (50, 2048, 7, 7),      # 4: conv5_x expansion (x3), projection
}

# MobileNetV2 (Sandler et al. 2018, "MobileNetV2: Inverted Residuals and Linear Bottlenecks",
# Table 2: t, c, n, s = 1,16,1,1 / 6,24,2,2 / 6,32,3,2 / 6,64,4,2 / 6,96,3,1 / 6,160,3,2 /
# 6,320,1,1, a 32-channel stride-2 stem and a 1280-channel 1x1 head).  Each bottleneck has a
# BN after its expansion (absent when t = 1), its depthwise 3x3 (which carries the stride) and
# its projection.  52 batch norms.
MOBILENETV2_B50 = {
    "mnv2b50-32x112": (50, 32, 112, 112),    # 2: stem, first depthwise
    "mnv2b50-16x112": (50, 16, 112, 112),    # 1: first projection
    "mnv2b50-96x112": (50, 96, 112, 112),    # 1: expansion of 16 (x6)
    "mnv2b50-96x56": (50, 96, 56, 56),       # 1: its depthwise, stride 2
    "mnv2b50-24x56": (50, 24, 56, 56),       # 2: projections to 24
    "mnv2b50-144x56": (50, 144, 56, 56),     # 3: expansions of 24, one depthwise
    "mnv2b50-144x28": (50, 144, 28, 28),     # 1: depthwise, stride 2
    "mnv2b50-32x28": (50, 32, 28, 28),       # 3: projections to 32
    "mnv2b50-192x28": (50, 192, 28, 28),     # 5: expansions of 32, depthwise
    "mnv2b50-192x14": (50, 192, 14, 14),     # 1: depthwise, stride 2
    "mnv2b50-64x14": (50, 64, 14, 14),       # 4: projections to 64
    "mnv2b50-384x14": (50, 384, 14, 14),     # 8: expansions of 64, depthwise
    "mnv2b50-96x14": (50, 96, 14, 14),       # 3: projections to 96
    "mnv2b50-576x14": (50, 576, 14, 14),     # 5: expansions of 96, depthwise
    "mnv2b50-576x7": (50, 576, 7, 7),        # 1: depthwise, stride 2
    "mnv2b50-160x7": (50, 160, 7, 7),        # 3: projections to 160
    "mnv2b50-960x7": (50, 960, 7, 7),        # 6: expansions of 160, depthwise
    "mnv2b50-320x7": (50, 320, 7, 7),        # 1: projection to 320
    "mnv2b50-1280x7": (50, 1280, 7, 7),      # 1: head
}

# Wide channel-last rows (600-1024 channels of 14x14 to 16x16 maps: transformer-sized
# channel counts on CNN maps), where each row is a page or more of x.
WIDE = {
    "wide-768x16": (32, 768, 16, 16),
    "wide-1024x14": (64, 1024, 14, 14),
}

# How many batch-norm layers of the network have each shape (the comments above, as data).
LAYERS = {
    **dict(zip(RESNET50_B50, (1, 6, 4, 1, 7, 5, 1, 11, 7, 1, 5, 4))),
    **dict(zip(MOBILENETV2_B50, (2, 1, 1, 1, 2, 3, 1, 3, 5, 1, 4, 8, 3, 5, 1, 3, 6, 1, 1))),
}
NETWORK_LAYERS = {"RESNET50_B50": 53, "MOBILENETV2_B50": 52}

GROUPS = {
    "RESNET50": RESNET50,
    "DENSE": DENSE,
    "VOLUMETRIC": VOLUMETRIC,
    "CACHE": CACHE,
    "SMALL_ODD": SMALL_ODD,
    "RESNET50_B50": RESNET50_B50,
    "MOBILENETV2_B50": MOBILENETV2_B50,
    "WIDE": WIDE,
}

ALL = {name: shape for group in GROUPS.values() for name, shape in group.items()}

# What `run.py` runs without --shapes: the groups above the networks (the whole networks are
# asked for by name: they hold 31 shapes, mostly DRAM-sized).
DEFAULT = {name: shape for group in ("RESNET50", "DENSE", "VOLUMETRIC", "CACHE", "SMALL_ODD")
           for name, shape in GROUPS[group].items()}

# A subset for `run.py --quick` and for smoke tests: one DRAM shape, one L3 shape, one
# L2 shape, an odd case and the tiny one.
QUICK = {name: ALL[name] for name in
         ("r50-conv2", "r50-conv4", "cache-4d", "odd-4d", "tiny-2d")}

# The shape the per-call overhead is measured on.
OVERHEAD_SHAPE = SMALL_ODD["tiny-2d"]

assert len(ALL) == sum(len(group) for group in GROUPS.values()), "duplicate shape names"
assert all(sum(LAYERS[n] for n in GROUPS[g]) == total for g, total in NETWORK_LAYERS.items())
