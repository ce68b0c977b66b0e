"""One rank of the MPI test in tests/surfaces/test_distributed.py, started by mpirun.

    mpirun -n 2 python mpi_worker.py DATA.npz OUT_DIR

Takes this rank's rows of the batch in DATA.npz, runs sync_batchnorm_backward_mpi and saves
the results to OUT_DIR/rank<RANK>.npz.
"""
import sys

import numpy as np
from mpi4py import MPI

from bnbw_native.distributed import sync_batchnorm_backward_mpi


def main(data_path, out_dir):
    rank = MPI.COMM_WORLD.Get_rank()
    data = np.load(data_path)
    lo, hi = data["bounds"][rank], data["bounds"][rank + 1]
    res = sync_batchnorm_backward_mpi(data["x"][lo:hi], data["dy"][lo:hi], data["mean"],
                                      data["var"], data["gamma"], epsilon=float(data["eps"]),
                                      num_threads=1)
    relu = sync_batchnorm_backward_mpi(data["x"][lo:hi], data["dy"][lo:hi], data["mean"],
                                       data["var"], data["gamma"], epsilon=float(data["eps"]),
                                       num_threads=1, relu_dst=data["relu"][lo:hi])
    np.savez(f"{out_dir}/rank{rank}.npz", nxc_dx=res.diff_src, nxc_dgamma=res.diff_gamma,
             nxc_dbeta=res.diff_beta, relu_dx=relu.diff_src, relu_dgamma=relu.diff_gamma,
             relu_dbeta=relu.diff_beta, world=np.array(MPI.COMM_WORLD.Get_size()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
