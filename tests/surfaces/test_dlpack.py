"""DLPack in and out of the array front-ends (issue 7): torch tensors as inputs and as `out=`.

Inputs that are `__dlpack__` producers are viewed, never copied; `out=` entries that are
producers are written in place, and the returned NumPy arrays view their memory.  Which
producers are refused (gradient-carrying and bfloat16 tensors as inputs; read-only, gradient-
carrying and expanded ones as outputs) is in test_refusals.py.
"""
import numpy as np
import pytest

import bnbw_native as bn
from bnbw_native import _dlpack
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
    arr = _dlpack.as_array(t, "x")
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
    partial, count = bn.backward_reduce(nxc(x), nxc(dy), mean, data_format="NXC")
    res = bn.backward_apply(nxc(x), nxc(dy), mean, var, gamma, torch.from_numpy(partial),
                            count, epsilon=EPS, data_format="NXC")
    want = bn.batchnorm_training_backward(nxc(x), nxc(dy), mean, var, gamma, epsilon=EPS,
                                          data_format="NXC")
    assert same_bits(res, want)


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


def test_writable_producer_is_accepted_as_out():
    x, dy, mean, var, gamma = batch()
    buf = np.full(5, np.nan, np.float32)
    got = bn.batchnorm_training_backward(x, dy, mean, var, gamma, epsilon=EPS,
                                         data_format="NCX",
                                         out=(torch.empty_like(x), Producer(buf),
                                              torch.empty(5)))
    assert address(got.diff_gamma) == address(buf) and np.all(np.isfinite(buf))


# ---- data_format and torch's (N, C, *) sizes ------------------------------------------------

def _front_end_calls(x, s, v, **kw):
    """Every array front-end once, on a 4-D tensor x with statistics s, v."""
    from bnbw_native import distributed, intel_spec  # noqa: F401  (imported, not all called)
    yield lambda: bn.batchnorm_training_backward(x, x, s, v, epsilon=EPS, **kw)
    yield lambda: bn.batchnorm_training_forward(x, s, v, epsilon=EPS, **kw)
    yield lambda: intel_spec.batch_norm_training_backprop(x, x, s, v, epsilon=EPS, **kw)
    yield lambda: bn.backward_reduce(x, x, s, **kw)
    partial = np.zeros((2, s.shape[0]))
    yield lambda: bn.backward_apply(x, x, s, v, None, partial, 1000, epsilon=EPS, **kw)


def test_a_torch_tensor_under_the_default_data_format_warns(recwarn):
    """Torch tensors carry (N, C, *) sizes in any memory format: the default "NXC" would
    normalise an NCHW tensor over its last axis, silently when C equals that axis' size.
    Every front-end warns then, naming the caller's line; an explicit data_format, a NumPy
    array or a 2-D tensor (both formats alike) does not."""
    x = torch.randn(4, 5, 6, 5)                       # C = 5 = W: no shape error to catch it
    s, v = torch.zeros(5), torch.ones(5)
    for call in _front_end_calls(x, s, v):
        with pytest.warns(bn.DataFormatWarning, match="data_format='NCX'") as caught:
            call()
        assert caught[0].filename == __file__
    for kw in (dict(data_format="NXC"), dict(data_format="NCX")):
        for call in _front_end_calls(x, s, v, **kw):
            call()
    for call in _front_end_calls(x.numpy(), s.numpy(), v.numpy()):
        call()
    flat = torch.randn(12, 5)
    for call in _front_end_calls(flat, s, v):
        call()
    assert not [w for w in recwarn if issubclass(w.category, bn.DataFormatWarning)]
    # the default is still "NXC" for tensors: the warning changes nothing computed
    want = bn.batchnorm_training_backward(x, x, s, v, epsilon=EPS, data_format="NXC")
    with pytest.warns(bn.DataFormatWarning):
        got = bn.batchnorm_training_backward(x, x, s, v, epsilon=EPS)
    assert all(same_bits(a, b) for a, b in zip(got, want))


def test_layout_names_of_other_libraries_are_refused_with_their_mapping():
    x = np.zeros((4, 5, 6, 5), np.float32)
    s = np.zeros(5, np.float32)
    for name, ours in (("NHWC", "NXC"), ("NCHW", "NCX"), ("NDHWC", "NXC"), ("NCW", "NCX")):
        with pytest.raises(ValueError, match=f"one of NXC, NCX .*{ours}: [^;)]*{name}"):
            bn.batchnorm_training_backward(x, x, s, s + 1, epsilon=EPS, data_format=name)
