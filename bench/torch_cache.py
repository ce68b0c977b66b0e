"""The torch peer's allocator: bench/torch_cache.cpp, a CPU allocator for PyTorch that hands a
freed block out again for the next request of the same size, built at first use against the
imported torch's headers (a C++ compiler and torch's include/ are needed) and loaded with
ctypes.

Why it exists: ``aten.native_batch_norm_backward`` allocates dx on every call, and its ``.out``
overload is generated from it (torch's native_functions.yaml: ``autogen:
native_batch_norm_backward.out``): it runs the allocating op and copies the result into
``out0``, so it still allocates, and copies besides.  Under glibc a block larger than 32 MiB is
a fresh mmap on every allocation, so every such torch call paid one page fault per 4 KiB of dx.
With this allocator installed while torch's calls are timed, dx lands on the pages the previous
call's dx had (the runner drops that result first), as PyTorch's caching allocator does on a
GPU and jemalloc or tcmalloc do on a CPU.

    cache = load()          # None when it cannot be built here (see `why_absent`)
    cache.on(); ...; cache.off()
    cache.counts()          # {"fresh": blocks made, "reused": blocks handed out again, ...}
"""
import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(BENCH_DIR, "torch_cache.cpp")

why_absent = None
_loaded = None


class TorchCache:
    """The loaded allocator; `on` makes it torch's CPU allocator, `off` restores torch's own."""

    def __init__(self, lib, path):
        self.lib, self.path = lib, path
        lib.bnbw_keep_install.restype = ctypes.c_int
        lib.bnbw_keep_install.argtypes = []
        lib.bnbw_keep_remove.argtypes = []
        lib.bnbw_keep_flush.argtypes = []
        lib.bnbw_keep_counts.argtypes = [ctypes.POINTER(ctypes.c_longlong)]

    def on(self):
        """Install it; True when torch's CPU allocations now go through it."""
        return bool(self.lib.bnbw_keep_install())

    def off(self):
        self.lib.bnbw_keep_remove()

    def flush(self):
        """Free the blocks waiting for reuse (blocks still in use come back later)."""
        self.lib.bnbw_keep_flush()

    def counts(self):
        c = (ctypes.c_longlong * 4)()
        self.lib.bnbw_keep_counts(c)
        return {"fresh": c[0], "reused": c[1], "waiting_blocks": c[2], "waiting_bytes": c[3]}


def _build(torch, build_dir=None):
    from torch.utils import cpp_extension
    with open(SOURCE, "rb") as f:
        code = f.read()
    cxx = os.environ.get("CXX") or "c++"
    libdirs = cpp_extension.library_paths()
    flags = ["-O2", "-std=c++17", "-shared", "-fPIC",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    flags += [f"-I{d}" for d in cpp_extension.include_paths()]
    links = [f"-L{d}" for d in libdirs] + [f"-Wl,-rpath,{d}" for d in libdirs] + ["-lc10"]
    build_dir = build_dir or os.path.join(tempfile.gettempdir(),
                                          f"bnbw_bench_build_{os.getuid()}")
    os.makedirs(build_dir, exist_ok=True)
    key = hashlib.sha256(code + " ".join([cxx, torch.__version__, *flags, *links])
                         .encode()).hexdigest()[:16]
    target = os.path.join(build_dir, f"torch_cache-{key}.so")
    if not os.path.exists(target):
        partial = f"{target}.{os.getpid()}.tmp"
        done = subprocess.run([cxx, *flags, SOURCE, "-o", partial, *links],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1:] or ["compiler failed"]
            raise OSError(f"{cxx}: {last[0]}")
        os.replace(partial, target)
    return target


def load(build_dir=None):
    """The allocator (one per process), or None with the reason in `why_absent`."""
    global _loaded, why_absent
    if _loaded is None and why_absent is None:
        try:
            import torch
        except ImportError:
            why_absent = "torch is not importable"
            return None
        if sys.platform != "linux":
            why_absent = f"built on Linux only (here: {sys.platform})"
            return None
        try:
            path = _build(torch, build_dir)
            _loaded = TorchCache(ctypes.CDLL(path), path)
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            why_absent = f"bench/torch_cache.cpp not built: {exc}"
    return _loaded
