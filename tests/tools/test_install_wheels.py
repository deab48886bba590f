"""scripts/install_wheels.py, which puts the GPU bundle's DeepSpeed wheels on a machine without pip or an index.

Wheels are built here as small zip files with the tags real ones carry: the
installer must pick the one this interpreter loads (its CPython version over
abi3 over pure, the newest version), unpack the .data folders where they
belong, keep executables executable, write console-script launchers that run,
and refuse what it cannot do with one line, before unpacking anything.
"""
import os
import subprocess
import sys
import zipfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
import install_wheels  # noqa: E402

SCRIPT = os.path.join(HERE, "..", "..", "scripts", "install_wheels.py")
CP = "cp%d%d" % sys.version_info[:2]
PLAT = "manylinux_2_17_" + os.uname().machine + ".manylinux2014_" + os.uname().machine


def make_wheel(folder, name, ver, py, abi, plat, files, entry_points=None, modes=None):
    path = os.path.join(folder, f"{name}-{ver}-{py}-{abi}-{plat}.whl")
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in files.items():
            info = zipfile.ZipInfo(arc)
            info.external_attr = ((modes or {}).get(arc, 0o644) & 0o777) << 16
            z.writestr(info, text)
        if entry_points:
            z.writestr(f"{name}-{ver}.dist-info/entry_points.txt", entry_points)
        z.writestr(f"{name}-{ver}.dist-info/METADATA", f"Name: {name}\nVersion: {ver}\n")
    return path


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


def test_picks_the_wheel_this_interpreter_loads(tmp_path):
    w, t = tmp_path / "w", tmp_path / "t"
    w.mkdir()
    # The same module from an other CPython's build, an abi3 one and a pure one: this CPython's wins.
    make_wheel(w, "fast", "1.0", "cp39", "cp39", PLAT, {"fast/__init__.py": "WHO = 'cp39'\n"})
    make_wheel(w, "fast", "1.0", "cp38", "abi3", PLAT, {"fast/__init__.py": "WHO = 'abi3'\n"})
    make_wheel(w, "fast", "1.0", CP, CP, PLAT, {"fast/__init__.py": "WHO = 'mine'\n"})
    make_wheel(w, "fast", "1.0", "py3", "none", "any", {"fast/__init__.py": "WHO = 'pure'\n"})
    # A newer version that runs on no machine here (another architecture) is passed over.
    make_wheel(w, "fast", "9.0", CP, CP, "manylinux_2_17_s390x", {"fast/__init__.py": "WHO = 's390x'\n"})
    # Names are compared normalised (dashes, dots and underscores alike), newest version first.
    make_wheel(w, "py_thing", "0.1", "py3", "none", "any", {"thing/__init__.py": "V = 1\n"})
    make_wheel(w, "py_thing", "0.10", "py2.py3", "none", "any", {"thing/__init__.py": "V = 10\n"})
    r = run(str(w), str(t), "fast", "py-thing")
    assert r.returncode == 0, r.stderr
    out = subprocess.run([sys.executable, "-c", "import fast, thing; print(fast.WHO, thing.V)"],
                         env={**os.environ, "PYTHONPATH": str(t)}, capture_output=True, text=True)
    assert out.stdout.split() == ["mine", "10"], out.stderr


def test_data_folders_executables_and_entry_points(tmp_path):
    w, t = tmp_path / "w", tmp_path / "t"
    w.mkdir()
    make_wheel(w, "tool", "2.0", "py3", "none", PLAT,
               {"tool/__init__.py": "def main():\n    print('tool ran')\n    return 0\n",
                "tool/data/bin/tool-bin": "#!/bin/sh\necho binary ran\n",
                "tool-2.0.data/purelib/tool_extra.py": "X = 5\n",
                "tool-2.0.data/scripts/tool-sh": "#!/bin/sh\necho script ran\n",
                "tool-2.0.data/headers/tool.h": "int x;\n"},
               entry_points="[console_scripts]\ntool = tool:main\n", modes={"tool/data/bin/tool-bin": 0o755})
    r = run(str(w), str(t), "tool")
    assert r.returncode == 0, r.stderr
    assert (t / "tool_extra.py").exists() and not (t / "tool-2.0.data").exists()
    env = {**os.environ, "PYTHONPATH": str(t)}
    for cmd, want in ((t / "tool" / "data" / "bin" / "tool-bin", "binary ran"), (t / "bin" / "tool-sh", "script ran"),
                      (t / "bin" / "tool", "tool ran")):
        out = subprocess.run([str(cmd)], env=env, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip() == want, (cmd, out.stderr)


def test_a_missing_or_unloadable_name_fails_before_anything_is_unpacked(tmp_path):
    w, t = tmp_path / "w", tmp_path / "t"
    w.mkdir()
    make_wheel(w, "good", "1.0", "py3", "none", "any", {"good/__init__.py": ""})
    make_wheel(w, "other", "1.0", "cp27", "cp27mu", "manylinux1_x86_64", {"other/__init__.py": ""})
    r = run(str(w), str(t), "good", "other")
    assert r.returncode == 1
    assert "no wheel of other" in r.stderr and "other-1.0-cp27" in r.stderr
    assert not (t / "good").exists()
    r = run(str(w), str(t), "absent")
    assert r.returncode == 1 and "there: none" in r.stderr
    r = run(str(tmp_path / "nowhere"), str(t), "good")
    assert r.returncode == 1 and "cannot read the wheel folder" in r.stderr
    r = run(str(w), str(w), "good")
    assert r.returncode == 1 and "is the wheel folder itself" in r.stderr


def test_a_damaged_or_escaping_wheel_is_refused_before_anything_is_unpacked(tmp_path):
    w, t = tmp_path / "w", tmp_path / "t"
    w.mkdir()
    make_wheel(w, "good", "1.0", "py3", "none", "any", {"good/__init__.py": ""})
    make_wheel(w, "escape", "1.0", "py3", "none", "any", {"../../outside.py": "X = 1\n"})
    r = run(str(w), str(t), "good", "escape")
    assert r.returncode == 1 and "outside the folder it unpacks into: ../../outside.py" in r.stderr, r.stderr
    assert not (t / "good").exists() and not (tmp_path / "outside.py").exists()
    make_wheel(w, "rooted", "1.0", "py3", "none", "any", {"/tmp/rooted.py": "X = 1\n"})
    r = run(str(w), str(t), "rooted")
    assert r.returncode == 1 and "outside the folder" in r.stderr
    # Truncated: the download cut short.
    path = make_wheel(w, "cut", "1.0", "py3", "none", "any", {"cut/__init__.py": "X = 1\n" * 100})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    r = run(str(w), str(t), "good", "cut")
    assert r.returncode == 1 and "not a readable wheel" in r.stderr, r.stderr
    assert not (t / "good").exists()
    # A flipped byte in a member's data: its CRC no longer matches.
    path = make_wheel(w, "flip", "1.0", "py3", "none", "any", {"flip/__init__.py": "X = 1\n" * 100})
    data = bytearray(open(path, "rb").read())
    at = data.index(b"X = 1")
    data[at] ^= 0x01
    open(path, "wb").write(bytes(data))
    r = run(str(w), str(t), "flip")
    assert r.returncode == 1 and "fails its CRC check" in r.stderr, r.stderr


@pytest.mark.parametrize("plat,libc,ok", [("manylinux_2_17_x86_64", (2, 36), True),
                                          ("manylinux_2_39_x86_64", (2, 36), False),
                                          ("manylinux2014_x86_64", (2, 17), True),
                                          ("manylinux2010_x86_64.manylinux_2_12_x86_64", (2, 12), True),
                                          ("manylinux_2_17_aarch64", (2, 36), False),
                                          ("musllinux_1_2_x86_64", (2, 36), False),
                                          ("manylinux_2_17_x86_64", None, False),
                                          ("any", None, True)])
def test_platform_tags(plat, libc, ok):
    assert install_wheels.platform_ok(plat, machine="x86_64", libc=libc) is ok


def test_python_tags():
    rank = install_wheels.rank
    assert rank("cp312", "cp312", "any", version=(3, 12)) == 3
    assert rank("cp312", "cp312", "any", version=(3, 13)) is None
    assert rank("cp312", "cp312t", "any", version=(3, 12)) is None  # free-threaded builds
    assert rank("cp38", "abi3", "any", version=(3, 12)) == 2
    assert rank("cp313", "abi3", "any", version=(3, 12)) is None
    assert rank("py3", "none", "any", version=(3, 12)) == 1
    assert rank("py2.py3", "none", "any", version=(3, 12)) == 1
    assert rank("py2", "none", "any", version=(3, 12)) is None
