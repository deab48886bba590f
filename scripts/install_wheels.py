#!/usr/bin/env python3
"""Installs named distributions from a folder of wheels into a private folder, without pip.

The GPU bundle (scripts/gpu_bundle.sh) carries DeepSpeed and its pure
dependencies as wheels, with the compiled ones (msgpack, pydantic-core) for
several CPython versions, since the GPU machine's Python is not known when
the bundle is made and that machine reaches no package index. This picks,
for each name, the newest wheel this interpreter can load (its CPython
version, abi3, or pure; a manylinux platform this machine's glibc and
architecture run), unpacks it into TARGET and writes TARGET/bin scripts for
its console entry points. Nothing outside TARGET is touched; the caller puts
TARGET first on PYTHONPATH and TARGET/bin on PATH. Each name is installed
from the folder even where the machine has that distribution already, so
what runs is what the bundle carries.

  python3 install_wheels.py WHEELS TARGET NAME...    # e.g. deepspeed pydantic pydantic-core ...

Exit status 1, with one line naming the distribution and what was wrong,
when a name has no wheel this interpreter can load, or its wheel is not a
sound zip or holds a member that would land outside TARGET; every wheel is
found and checked before any is unpacked.
"""
import os
import platform
import re
import stat
import sys
import zipfile

WHEEL_RE = re.compile(r"^(?P<name>[^-]+)-(?P<ver>[^-]+)(-(?P<build>\d[^-]*))?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


def norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def version_key(v):
    return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.+-]", v))


def glibc():
    try:
        lib, ver = os.confstr("CS_GNU_LIBC_VERSION").split()
        return tuple(int(x) for x in ver.split(".")[:2]) if lib == "glibc" else None
    except (ValueError, OSError, AttributeError):
        return None


def platform_ok(plat, machine=None, libc="detect"):
    """Whether this machine runs a wheel of platform tag `plat` (libc: (major, minor), None if not glibc)."""
    machine = machine or platform.machine()
    libc = glibc() if libc == "detect" else libc
    for p in plat.split("."):
        if p == "any":
            return True
        m = re.match(r"^manylinux(?:_(\d+)_(\d+)|(2014|2010|1))_(.+)$", p)
        if not m or m.group(4) != machine or libc is None:
            continue
        need = (int(m.group(1)), int(m.group(2))) if m.group(1) else {"2014": (2, 17), "2010": (2, 12), "1": (2, 5)}[m.group(3)]
        if need <= libc:
            return True
    return False


def rank(py, abi, plat, version=None, machine=None, libc="detect"):
    """How well a wheel's tags suit this interpreter: higher is better, None when it cannot load."""
    major, minor = version or sys.version_info[:2]
    cp = f"cp{major}{minor}"
    if not platform_ok(plat, machine, libc):
        return None
    pys = py.split(".")
    if abi == cp and cp in pys:
        return 3
    if abi == "abi3":
        for t in pys:
            m = re.match(r"^cp(\d)(\d+)$", t)
            if m and int(m.group(1)) == major and int(m.group(2)) <= minor:
                return 2
    if abi == "none" and any(t in (f"py{major}", f"py{major}{minor}", cp) for t in pys):
        return 1
    return None


def choose(wheels, name, **tags):
    best = None
    for f in wheels:
        m = WHEEL_RE.match(f)
        if not m or norm(m.group("name")) != norm(name):
            continue
        r = rank(m.group("py"), m.group("abi"), m.group("plat"), **tags)
        if r is None:
            continue
        key = (version_key(m.group("ver")), r)
        if best is None or key > best[0]:
            best = (key, f, m.group("ver"))
    return best


def check(path):
    """The wheel's member names, or an error line: not a zip, or a member that would land outside the target."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError) as e:
        return f"{os.path.basename(path)} is not a readable wheel ({e})"
    if bad is not None:
        return f"{os.path.basename(path)} is damaged: member {bad} fails its CRC check"
    for n in names:
        parts = n.split("/")
        if n.startswith("/") or "\\" in n or ".." in parts or (parts and parts[0].endswith(":")):
            return f"{os.path.basename(path)} has a member outside the folder it unpacks into: {n}"
    return None


def install(path, target):
    """Unpacks one wheel into target: its .data folders where they belong, scripts for its console entry points."""
    with zipfile.ZipFile(path) as z:
        entry_points = None
        for info in z.infolist():
            parts = info.filename.split("/")
            dest = info.filename
            if parts[0].endswith(".data") and len(parts) > 2:
                kind = parts[1]
                if kind in ("purelib", "platlib"):
                    dest = "/".join(parts[2:])
                elif kind == "scripts":
                    dest = "bin/" + "/".join(parts[2:])
                else:
                    continue  # headers and data files: not needed to import and run
            if parts[0].endswith(".dist-info") and parts[-1] == "entry_points.txt":
                entry_points = z.read(info).decode()
            out = os.path.join(target, dest)
            if info.is_dir():
                os.makedirs(out, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(info) as src, open(out, "wb") as dst:
                dst.write(src.read())
            mode = (info.external_attr >> 16) & 0o777
            if mode & 0o111 or dest.startswith("bin/"):
                os.chmod(out, os.stat(out).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    if entry_points:
        section = None
        for line in entry_points.splitlines():
            line = line.strip()
            if line.startswith("["):
                section = line.strip("[]")
            elif section == "console_scripts" and "=" in line:
                script, target_fn = (x.strip() for x in line.split("=", 1))
                module, _, fn = target_fn.partition(":")
                bin_path = os.path.join(target, "bin", script)
                os.makedirs(os.path.dirname(bin_path), exist_ok=True)
                with open(bin_path, "w") as f:
                    f.write(f"#!{sys.executable}\nimport sys\nfrom {module} import {fn.split('.')[0]}\n"
                            f"sys.exit({fn}())\n")
                os.chmod(bin_path, 0o755)


def main(argv):
    if len(argv) < 4:
        print(__doc__.strip().splitlines()[0] + "\nusage: install_wheels.py WHEELS TARGET NAME...", file=sys.stderr)
        return 2
    folder, target, names = argv[1], argv[2], argv[3:]
    if os.path.realpath(folder) == os.path.realpath(target):
        print(f"install_wheels: the target {target} is the wheel folder itself; give another", file=sys.stderr)
        return 1
    try:
        wheels = sorted(os.listdir(folder))
    except OSError as e:
        print(f"install_wheels: cannot read the wheel folder {folder}: {e.strerror}", file=sys.stderr)
        return 1
    os.makedirs(target, exist_ok=True)
    chosen = []
    for name in names:
        best = choose(wheels, name)
        if best is None:
            have = [f for f in wheels if WHEEL_RE.match(f) and norm(WHEEL_RE.match(f).group("name")) == norm(name)]
            print(f"install_wheels: no wheel of {name} in {folder} loads on CPython "
                  f"{sys.version_info[0]}.{sys.version_info[1]} ({platform.machine()}, glibc "
                  f"{'.'.join(map(str, glibc() or ())) or 'unknown'}); there: {', '.join(have) or 'none'}",
                  file=sys.stderr)
            return 1
        chosen.append((name, best))
    for name, (_, f, ver) in chosen:  # all found and sound before any is unpacked
        why = check(os.path.join(folder, f))
        if why:
            print(f"install_wheels: {name}: {why}", file=sys.stderr)
            return 1
    for name, (_, f, ver) in chosen:
        install(os.path.join(folder, f), target)
        print(f"install_wheels: {name} {ver} ({f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
