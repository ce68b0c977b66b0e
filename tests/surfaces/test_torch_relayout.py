"""The torch layers' copy of a gradient into x's layout (bnbw_native/_relayout.pyx by tiles
where both are dense, channel-first and channel-last): the tensor torch's copy gives."""
import pytest

torch = pytest.importorskip("torch")
from bnbw_native import _torch_ops as ops  # noqa: E402  (after the importorskip)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 17, 33, 2), (2, 64, 32, 32),
                                   (2, 5, 3, 4, 6), (0, 3, 4, 4), (3, 1, 5, 5)])
@pytest.mark.parametrize("grad_is_channel_last", [False, True])
def test_a_gradient_reaches_the_kernels_in_xs_layout_with_its_values(dtype, shape,
                                                                     grad_is_channel_last):
    last = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x_format, g_format = ((torch.contiguous_format, last) if grad_is_channel_last
                          else (last, torch.contiguous_format))
    x = torch.randn(shape).to(dtype).contiguous(memory_format=x_format)
    g = torch.randn(shape).to(dtype).contiguous(memory_format=g_format)
    for num_threads in (1, 2):
        out = ops._in_layout_of(x, g, num_threads)
        assert torch.equal(out, g) and out.dtype == g.dtype
        assert ops._laid_out_like(x, out)


def test_only_dense_opposite_layouts_go_by_tiles():
    x = torch.randn(2, 4, 6, 6).contiguous(memory_format=torch.channels_last)
    dst = torch.empty_like(x)
    assert ops._transposed(torch.randn(2, 4, 6, 6), dst, 1)
    assert not ops._transposed(torch.randn(2, 4, 6, 6, dtype=torch.float64),
                               dst.double(), 1)                       # 8-byte elements
    assert not ops._transposed(torch.randn(2, 4, 6, 12)[..., ::2], dst, 1)   # not dense
    assert not ops._transposed(torch.randn(2, 4, 6, 6), torch.empty(2, 4, 6, 6), 1)
    assert not ops._transposed(torch.randn(2, 4, 6), torch.empty(2, 4, 6), 1)  # no such layout
    assert not ops._transposed(torch.randn(2, 4, 6, 6, device="meta"),
                               torch.empty_like(x, device="meta"), 1)  # memory not in reach


@pytest.mark.parametrize("dtype, block", [(torch.bfloat16, 8), (torch.float32, 4)])
@pytest.mark.parametrize("short", [1, 0])
def test_rows_shorter_than_a_vector_block_keep_copy(dtype, block, short):
    """The tiles take src's rows from one 16-byte block up (8 two-byte elements, 4 four-byte
    ones): shorter rows would go one element at a time, where copy_ is as fast."""
    n = block - short
    last = torch.channels_last
    first = torch.randn(2, 5, 1, n).to(dtype)                          # rows: the planes
    cl = torch.randn(2, n, 1, 5).to(dtype).contiguous(memory_format=last)  # rows: the channels
    assert ops._transposed(first, torch.empty_like(first, memory_format=last), 1) == (not short)
    assert ops._transposed(cl, torch.empty(cl.shape, dtype=dtype), 1) == (not short)
    for grad in (first, cl):                                           # either way, its values
        x = torch.empty_like(grad, memory_format=last if grad is first
                             else torch.contiguous_format)
        out = ops._in_layout_of(x, grad, 1)
        assert torch.equal(out, grad) and ops._laid_out_like(x, out)
