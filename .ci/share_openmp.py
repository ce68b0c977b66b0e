"""Let a repaired Linux wheel share one OpenMP runtime with the rest of the process.

    python .ci/share_openmp.py WHEEL_OR_DIR [...]      # rewrites each wheel in place

auditwheel vendors GCC's libgomp as bnbw_native.libs/libgomp-<hash>.so.1.0.0, under that new
name, so a process that also loads PyTorch's libgomp.so.1 holds two runtimes and two thread
pools.  After either one's parallel region its idle threads spin for a while, and on a
machine with as many cores as threads the other team then waits for a core: measured with the
wheel on a 2-core guest, a 2-thread backward right after a 2-thread torch.add took 4.2-4.8 ms
instead of 0.26-0.75 ms.  Here the vendored copy gets the usual name back - file and soname
libgomp.so.1, each module's NEEDED entry with it - so the dynamic linker loads one library of
that name per process: the wheel's own when nothing else brought one, else the one already
loaded (PyTorch's, a system one), in either import order.  The run path $ORIGIN/../
bnbw_native.libs still finds the wheel's copy when it is the first.  Our modules need
GOMP_4.5 at most (GCC 6 and newer provide it).  Wheels without a vendored libgomp (macOS,
Windows) are left as they are.  Needs patchelf on PATH (auditwheel installs it).
"""
import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile

SHARED = "libgomp.so.1"


def record_line(root, path):
    with open(os.path.join(root, path), "rb") as f:
        data = f.read()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [path, f"sha256={digest}", str(len(data))]


def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                         check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines()
            if "(NEEDED)" in line]


def share(wheel):
    """Rewrite `wheel` in place; returns the vendored name it replaced, or None."""
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            infos = z.infolist()
            z.extractall(tmp)
        infos = [i for i in infos if not i.is_dir()]     # a wheel lists files only
        names = [i.filename for i in infos]
        vendored = [n for n in names if ".libs/" in n
                    and os.path.basename(n).startswith("libgomp-")]
        if not vendored:
            return None
        if len(vendored) != 1:
            raise SystemExit(f"{wheel}: expected one vendored libgomp, found {vendored}")
        old_path = vendored[0]
        old = os.path.basename(old_path)
        new_path = os.path.join(os.path.dirname(old_path), SHARED)
        os.rename(os.path.join(tmp, old_path), os.path.join(tmp, new_path))
        subprocess.run(["patchelf", "--set-soname", SHARED, os.path.join(tmp, new_path)],
                       check=True)
        for n in names:
            if n.endswith(".so") and old in needed(os.path.join(tmp, n)):
                subprocess.run(["patchelf", "--replace-needed", old, SHARED,
                                os.path.join(tmp, n)], check=True)
        names = [new_path if n == old_path else n for n in names]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        lines = [record_line(tmp, n) for n in names if n != record] + [[record, "", ""]]
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(lines)
        with open(os.path.join(tmp, record), "w") as f:
            f.write(text.getvalue())
        modes = {(new_path if i.filename == old_path else i.filename): i.external_attr
                 for i in infos}
        rewritten = wheel + ".tmp"
        with zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as z:
            for n in names:
                info = zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0))
                info.external_attr = modes[n]
                info.compress_type = zipfile.ZIP_DEFLATED
                with open(os.path.join(tmp, n), "rb") as f:
                    z.writestr(info, f.read())
        os.replace(rewritten, wheel)
    return old


def main(argv):
    wheels = []
    for arg in argv or ["."]:
        if os.path.isdir(arg):
            wheels += [os.path.join(arg, n) for n in sorted(os.listdir(arg)) if n.endswith(".whl")]
        else:
            wheels.append(arg)
    if not wheels:
        raise SystemExit("no wheel given")
    for wheel in wheels:
        old = share(wheel)
        print(f"share_openmp: {os.path.basename(wheel)}: "
              + (f"{old} -> {SHARED}" if old else "no vendored libgomp, unchanged"))


if __name__ == "__main__":
    main(sys.argv[1:])
