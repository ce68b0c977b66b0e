"""One rank of tests/surfaces/test_distributed.py: torch.distributed (gloo) on 127.0.0.1.

    python torch_worker.py RANK WORLD DATA.npz OUT_DIR        (MASTER_ADDR, MASTER_PORT set)

Reads the whole batch from DATA.npz, takes this rank's rows (bounds[rank]:bounds[rank + 1]),
runs every case and saves the results to OUT_DIR/rank<RANK>.npz for the parent to check
against single-process results.  Exits non-zero on any error; the parent's timeout catches
hangs.
"""
import copy
import datetime
import sys

import numpy as np
import torch
import torch.distributed as dist

from bnbw_native.autograd import SyncBatchNorm, SyncBatchNormReLU, convert_batchnorm
from bnbw_native.distributed import sync_batchnorm_backward


def main(rank, world, data_path, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    data = np.load(data_path)
    lo, hi = data["bounds"][rank], data["bounds"][rank + 1]
    x, dy = data["x"][lo:hi], data["dy"][lo:hi]                 # NXC: (n, H, W, C)
    mean, var, gamma = data["mean"], data["var"], data["gamma"]
    eps = float(data["eps"])
    saved = {}

    # NumPy arrays, channels last
    res = sync_batchnorm_backward(x, dy, mean, var, gamma, epsilon=eps, num_threads=1)
    saved.update(nxc_dx=res.diff_src, nxc_dgamma=res.diff_gamma, nxc_dbeta=res.diff_beta)

    # a SyncBatchNorm followed by ReLU: this rank's rows of the forward's output as the mask
    relu = data["relu"][lo:hi]
    res_grad = np.empty_like(dy)
    res = sync_batchnorm_backward(x, dy, mean, var, gamma, epsilon=eps, num_threads=1,
                                  relu_dst=relu, diff_residual=res_grad)
    saved.update(relu_dx=res.diff_src, relu_dgamma=res.diff_gamma, relu_dbeta=res.diff_beta,
                 relu_residual=res_grad)

    # torch tensors, channels first, outputs written into torch tensors (DLPack, no copy)
    xt = torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, -1, 1)))
    dyt = torch.from_numpy(np.ascontiguousarray(np.moveaxis(dy, -1, 1)))
    out = (torch.empty_like(xt), torch.empty(len(mean)), torch.empty(len(mean)))
    res = sync_batchnorm_backward(xt, dyt, torch.from_numpy(mean), torch.from_numpy(var),
                                  torch.from_numpy(gamma), epsilon=eps, data_format="NCX",
                                  out=out, num_threads=1)
    views = all(r.size == 0 or np.shares_memory(r, np.from_dlpack(o)) for r, o in zip(res, out))
    saved.update(ncx_dx=out[0].numpy(), ncx_dgamma=out[1].numpy(), ncx_dbeta=out[2].numpy(),
                 ncx_out_views=np.array(views))

    # the SyncBatchNorm module, channels-first and channels-last input; then the fused
    # SyncBatchNormReLU, built directly and by convert_batchnorm from BatchNorm2d + ReLU
    relu_net = torch.nn.Sequential(torch.nn.BatchNorm2d(len(mean), eps=eps),
                                   torch.nn.ReLU(inplace=True))
    relu_net = convert_batchnorm(relu_net, sync=True, fuse_relu=True, num_threads=1)
    for tag, fmt, layer in (
            ("mod_cf", torch.contiguous_format, SyncBatchNorm(len(mean), eps=eps, num_threads=1)),
            ("mod_cl", torch.channels_last, SyncBatchNorm(len(mean), eps=eps, num_threads=1)),
            ("modrelu_cf", torch.contiguous_format,
             SyncBatchNormReLU(len(mean), eps=eps, num_threads=1)),
            ("modrelu_cl", torch.channels_last, relu_net)):
        bn = layer if isinstance(layer, SyncBatchNorm) else layer[0]
        assert isinstance(bn, SyncBatchNormReLU) == tag.startswith("modrelu")
        with torch.no_grad():
            bn.weight.copy_(torch.from_numpy(gamma))
            bn.bias.copy_(torch.from_numpy(data["beta"]))
        xin = xt.clone().contiguous(memory_format=fmt).requires_grad_()
        y = layer(xin)
        (y * dyt).sum().backward()          # the loss of the whole batch is the sum over ranks
        saved.update({f"{tag}_y": y.detach().numpy(), f"{tag}_dx": xin.grad.numpy(),
                      f"{tag}_dw": bn.weight.grad.numpy(),
                      f"{tag}_db": bn.bias.grad.numpy(),
                      f"{tag}_rm": bn.running_mean.numpy(),
                      f"{tag}_rv": bn.running_var.numpy(),
                      f"{tag}_dx_format": np.array(xin.grad.is_contiguous(memory_format=fmt))})

    # far from zero (every x + 1e4): the backward centres on the forward's exact mean here too
    far = SyncBatchNorm(len(mean), eps=eps, num_threads=1)
    xin = (xt + 1e4).contiguous(memory_format=torch.channels_last).requires_grad_()
    (far(xin) * dyt).sum().backward()
    saved.update(far_dx=xin.grad.numpy(), far_dw=far.weight.grad.numpy(),
                 far_db=far.bias.grad.numpy())

    # the fused layer compiled (aot_eager, one graph): the same bits as in eager mode
    eager = SyncBatchNormReLU(len(mean), eps=eps, num_threads=1)
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager", fullgraph=True)
    results = []
    for layer in (eager, compiled):
        xin = xt.clone().contiguous(memory_format=torch.channels_last).requires_grad_()
        (layer(xin) * dyt).sum().backward()
        results.append([xin.grad, layer.weight.grad, layer.bias.grad, layer.running_var])
    saved["compiled_equal"] = np.array(all(torch.equal(a, b) for a, b in zip(*results)))

    dist.barrier()
    dist.destroy_process_group()
    np.savez(f"{out_dir}/rank{rank}.npz", **saved)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
