"""Readings of this process's memory (Linux /proc, glibc, getrusage), in one place: the benchmarks
use them, and tests that measure memory can import them too (bench/ on sys.path, as for
shapes.py).  No imports beyond the standard library, so importing this costs nothing."""
import ctypes

try:
    import resource
except ImportError:          # not on Windows
    resource = None


def status_bytes():
    """{"VmRSS": bytes, "VmHWM": bytes} of this process from /proc ({} elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                    if line.startswith(("VmRSS", "VmHWM"))}
    except OSError:
        return {}


def release_free_heap():
    """Return freed heap pages to the OS (glibc), so the next call's allocations show up as
    new resident pages instead of reusing pages an earlier call left behind."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_rss_peak():
    """Reset the resident high-water mark (VmHWM) to the current RSS (Linux >= 4.0); False
    when not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def minor_faults():
    """Page faults this process has taken so far that needed no I/O (getrusage ru_minflt: every
    thread's; a page touched for the first time after mmap counts one), or 0 where getrusage is
    missing."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0
