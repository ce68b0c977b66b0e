"""DLPack in and out of the array front-ends (issue 7): torch tensors as inputs and as `out=`.

Inputs that are `__dlpack__` producers are viewed, never copied; `out=` entries that are
producers are written in place, and the returned NumPy arrays view their memory.  Read-only
producers must be refused as outputs like read-only arrays are.
"""
import numpy as np
import pytest

import bnbw_native as bn
from bnbw_native import _arrays
from error_bounds import same_bits

torch = pytest.importorskip("torch")

EPS = 1e-3


def address(a):
    """The first byte of an ndarray or tensor."""
    return a.data_ptr() if isinstance(a, torch.Tensor) else a.__array_interface__["data"][0]


class Producer:
    """A bare DLPack producer around a NumPy array (what other libraries hand over)."""

    def __init__(self, array, versioned=True):
        self.array, self.versioned = array, versioned

    def __dlpack__(self, stream=None, **kwargs):
        # versioned: DLPack 1.x capsules, which carry the read-only flag; legacy: 0.x ones
        return self.array.__dlpack__(**kwargs) if self.versioned else self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def batch(shape=(6, 5, 4, 7), channels_last=False, seed=0):
    """x, dy (NCHW torch tensors, optionally channels-last memory) and float32 statistics."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2 + 1
    dy = torch.randn(shape, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        dy = dy.contiguous(memory_format=torch.channels_last)
    x64 = x.double()
    mean = x64.mean(dim=(0, 2, 3)).float()
    var = x64.var(dim=(0, 2, 3), unbiased=False).float()
    gamma = torch.rand(shape[1], generator=g) + 0.5
    return x, dy, mean, var, gamma


def nxc(t):
    """The (N, H, W, C) view of an NCHW tensor (no copy)."""
    return t.permute(0, 2, 3, 1)


def numpy_result(x, dy, mean, var, gamma, data_format):
    return bn.batchnorm_training_backward(x.numpy().copy(), dy.numpy().copy(), mean.numpy(),
                                          var.numpy(), gamma.numpy(), epsilon=EPS,
                                          data_format=data_format)


# ---- inputs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    pytest.param(lambda t: t, id="contiguous"),
    pytest.param(lambda t: t.contiguous(memory_format=torch.channels_last), id="channels_last"),
    pytest.param(lambda t: t.transpose(0, 3), id="transposed"),
    pytest.param(lambda t: t[:, :, ::2], id="sliced"),
])
def test_tensor_inputs_are_viewed_not_copied(make):
    t = make(torch.randn(6, 5, 4, 7))
    arr = _arrays.as_array(t, "x")
    assert address(arr) == address(t)
    assert arr.strides == tuple(s * 4 for s in t.stride())
    assert np.array_equal(arr, t.numpy())


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCX", "NXC"])
def test_tensor_inputs_give_the_numpy_result(channels_last):
    x, dy, mean, var, gamma = batch(channels_last=channels_last)
    if channels_last:      # pass the NHWC views: contiguous memory, channel last
        args, data_format = (nxc(x), nxc(dy)), "NXC"
    else:
        args, data_format = (x, dy), "NCX"
    got = bn.batchnorm_training_backward(*args, mean, var, gamma, epsilon=EPS,
                                         data_format=data_format)
    want = numpy_result(*(a.contiguous() for a in args), mean, var, gamma, data_format)
    assert all(isinstance(r, np.ndarray) for r in got)
    assert same_bits(got, want)


def test_expanded_gradient_is_read_in_place():
    # autograd hands over zero-stride gradients (e.g. the gradient of y.sum())
    x, _, mean, var, gamma = batch()
    dy = torch.ones(1, 1, 1, 1).expand(x.shape)
    got = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                         data_format="NCX")
    want = numpy_result(x, torch.ones(x.shape), mean, var, gamma, "NCX")
    assert same_bits(got, want)


def test_two_phases_take_tensors():
    x, dy, mean, var, gamma = batch(channels_last=True)
    partial, count = bn.backward_reduce(nxc(x), nxc(dy), mean)
    res = bn.backward_apply(nxc(x), nxc(dy), mean, var, gamma, torch.from_numpy(partial),
                            count, epsilon=EPS)
    want = bn.batchnorm_training_backward(nxc(x), nxc(dy), mean, var, gamma, epsilon=EPS)
    assert same_bits(res, want)


def test_gradient_carrying_tensor_is_refused_as_input():
    x, dy, mean, var, gamma = batch()
    with pytest.raises(TypeError, match="src"):
        bn.batchnorm_training_backward(x.requires_grad_(), dy, mean, var, gamma, epsilon=EPS,
                                       data_format="NCX")


# ---- outputs --------------------------------------------------------------------------------

@pytest.mark.parametrize("channels_last", [False, True], ids=["NCX", "NXC"])
def test_out_tensors_are_written_in_place(channels_last):
    x, dy, mean, var, gamma = batch(channels_last=channels_last)
    dx = torch.full_like(x, np.nan)       # keeps x's memory format
    dgamma, dbeta = torch.full((x.shape[1],), np.nan), torch.full((x.shape[1],), np.nan)
    if channels_last:
        args, out, data_format = (nxc(x), nxc(dy)), (nxc(dx), dgamma, dbeta), "NXC"
    else:
        args, out, data_format = (x, dy), (dx, dgamma, dbeta), "NCX"
    got = bn.batchnorm_training_backward(*args, mean, var, gamma, epsilon=EPS,
                                         data_format=data_format, out=out)
    for result, tensor in zip(got, out):
        assert isinstance(result, np.ndarray)
        assert address(result) == address(tensor)      # the result views the tensor
        assert np.shares_memory(result, np.from_dlpack(tensor))
    want = numpy_result(*(a.contiguous() for a in args), mean, var, gamma, data_format)
    assert same_bits([t.numpy() for t in out], want)


def test_out_tensor_may_be_the_gradient_itself():
    x, dy, mean, var, gamma = batch()
    want = numpy_result(x, dy, mean, var, gamma, "NCX")
    got = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                         data_format="NCX",
                                         out=(dy, torch.empty(5), torch.empty(5)))
    assert address(got.diff_src) == address(dy)
    assert np.array_equal(dy.numpy(), want.diff_src)


def test_two_phase_apply_writes_out_tensors():
    x, dy, mean, var, gamma = batch()
    partial, count = bn.backward_reduce(x, dy, mean, data_format="NCX")
    out = (torch.empty_like(x), torch.empty(5), torch.empty(5))
    got = bn.backward_apply(x, dy, mean, var, gamma, partial, count, epsilon=EPS,
                            data_format="NCX", out=out)
    assert all(address(r) == address(t) for r, t in zip(got, out))
    assert same_bits([t.numpy() for t in out], numpy_result(x, dy, mean, var, gamma, "NCX"))


def test_read_only_producer_is_refused_as_out_and_nothing_is_written():
    x, dy, mean, var, gamma = batch()
    frozen = np.zeros(5, np.float32)
    frozen.flags.writeable = False
    dx, dbeta = torch.full_like(x, 7.0), torch.full((5,), 7.0)
    with pytest.raises(ValueError, match=r"out\[1\].*read-only"):
        bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                       data_format="NCX", out=(dx, Producer(frozen), dbeta))
    assert bool((dx == 7).all()) and bool((dbeta == 7).all())


def test_writable_producer_is_accepted_as_out():
    x, dy, mean, var, gamma = batch()
    buf = np.full(5, np.nan, np.float32)
    got = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                         data_format="NCX",
                                         out=(torch.empty_like(x), Producer(buf),
                                              torch.empty(5)))
    assert address(got.diff_gamma) == address(buf) and np.all(np.isfinite(buf))


# Producers that cannot be outputs: their DLPack export fails, or their elements share memory.


def test_read_only_legacy_producer_is_refused_as_out():
    # a DLPack 0.x capsule cannot say "read-only": NumPy refuses to export it (BufferError)
    x, dy, mean, var, gamma = batch()
    frozen = np.zeros(5, np.float32)
    frozen.flags.writeable = False
    with pytest.raises((TypeError, ValueError), match=r"out\[1\]"):
        bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                       data_format="NCX",
                                       out=(torch.empty_like(x),
                                            Producer(frozen, versioned=False),
                                            torch.empty(5)))


def test_gradient_carrying_tensor_is_refused_as_out():
    x, dy, mean, var, gamma = batch()
    with pytest.raises(TypeError, match=r"out\[0\]"):
        bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                       data_format="NCX",
                                       out=(torch.empty_like(x, requires_grad=True),
                                            torch.empty(5), torch.empty(5)))


def test_expanded_tensor_is_refused_as_out():
    # writable through DLPack, but all N rows share one row of memory
    x, dy, mean, var, gamma = batch()
    dx = torch.zeros(x.shape[1:]).expand(x.shape)
    with pytest.raises(ValueError, match=r"out\[0\]"):
        bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                       data_format="NCX",
                                       out=(dx, torch.empty(5), torch.empty(5)))
