"""zinc.prepare against what a hostile user tries (issue 49): an output that
is a file the run reads is refused, a run killed at each phase of its commit
leaves the old set, the new one or one the .bin's set record refuses, chat
templates are bounded in size and time, and what is no regular file or no
prefix gets one line. Needs tokenizers and jinja2; no torch, no network."""
import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import zlib

import pytest

tokenizers = pytest.importorskip("tokenizers", reason="zinc.prepare needs the tokenizers package (setup.sh)")
pytest.importorskip("jinja2", reason="zinc.prepare renders chat templates with jinja2 (setup.sh)")

from zinc import prepare  # noqa: E402
# The tool's parts, whose globals a test patches where the code reads them (prepare's copies are not read).
from zinc import _prepare_outputs, _prepare_records, _prepare_template  # noqa: E402

from prepare_util import CHATML, FIX, LLAMA3, bad_lines, read_outputs, run_prepare, snapshot, tok  # noqa: E402


FAULT_PHASES = ("writing", "before_rename", "after_mask", "after_docs", "after_bin", "after_manifest")
# The files a run killed at each phase has already renamed into place (.mask, .docs, .bin, the manifest last;
# the old manifest is removed before the first rename).
RENAMED = {"writing": (), "before_rename": (), "after_mask": ("mask",), "after_docs": ("mask", "docs"),
           "after_bin": ("mask", "docs", "bin"), "after_manifest": ("mask", "docs", "bin", "json")}
MANIFEST_REMOVED = ("after_mask", "after_docs", "after_bin")  # no manifest there: the old one went first


def tree(folder):
    """{relative path: bytes, or "-> target" for a symlink} of everything under folder."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, folder)
            if os.path.islink(full):
                out[rel] = "-> " + os.readlink(full)
            elif os.path.isfile(full):
                out[rel] = open(full, "rb").read()
            else:
                out[rel] = "folder" if os.path.isdir(full) else "other"
    return out


def error_lines(err):
    return [line for line in err.splitlines() if line.strip()]


def cli(*args, timeout=60, code=None, env=None):
    """python -m zinc.prepare ARGS in a fresh interpreter, so that a hang, a crash or a kill is this test's
    failure, not the suite's; code: Python run before main() (e.g. a lowered bound). Returns (rc, stderr)."""
    head = ["-m", "zinc.prepare"] if code is None else \
        ["-c", f"import sys\nfrom zinc import prepare\n{code}\nsys.exit(prepare.main(sys.argv[1:]))"]
    r = subprocess.run([sys.executable, *head, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       env=None if env is None else {**os.environ, **env})
    return r.returncode, r.stderr


def copy_model(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("case", ["input .bin", "input .json", "tokenizer.json", "tokenizer_config.json",
                                  "chat template", "symlink", "hard link"])
def test_out_never_overwrites_what_the_run_reads(tmp_path, capsys, case):
    """An output (PREFIX.bin, .mask, .docs, .json) that is a file the run reads (an input, the tokenizer.json,
    tokenizer_config.json, the chat template), under its own name or another (a symlink, a hard link): refused
    before anything is written, exit 1, one line naming both paths."""
    model = copy_model(LLAMA3, tmp_path / "tok")
    data = tmp_path / "d.jsonl"
    data.write_bytes((FIX / "text.jsonl").read_bytes())
    args, out, read, written = [data], tmp_path / "out", data, None
    if case in ("input .bin", "input .json"):
        read = tmp_path / ("in.bin" if case == "input .bin" else "g.json")
        read.write_bytes(data.read_bytes())
        args, out = [read, "--format", "jsonl"], read.with_suffix("")
    elif case in ("tokenizer.json", "tokenizer_config.json"):
        read = model / case
        out = read.with_suffix("")
    elif case == "chat template":
        read = tmp_path / "t.json"
        read.write_bytes((CHATML / "chat_template.jinja").read_bytes())
        args, out = [FIX / "chat.jsonl", "--chat-template", read], tmp_path / "t"
    elif case == "symlink":
        written = tmp_path / "out.mask"
        written.symlink_to(data)
    else:
        written = tmp_path / "out.docs"
        os.link(data, written)
    before = tree(tmp_path)
    rc = prepare.main([*map(str, args), "--tokenizer", str(model), "--seq-len", "64", "--out", str(out)])
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert rc == 1 and len(lines) == 1, err
    assert lines[0].startswith("zinc.prepare: error: --out would overwrite the ")
    assert str(read) in lines[0] and str(written or read) in lines[0]
    assert tree(tmp_path) == before


def set_rule(prefix):
    """What zinc-train's reader refuses in a set (the .mask or .docs whose size or CRC-32 differ from what the
    .bin beside it records), as the format states it: the names of the files it would refuse."""
    raw = open(f"{prefix}.bin", "rb").read(1024)
    u = struct.unpack("<256I", raw)
    if raw[12:16] != b"ZINC":
        return []
    refused = []
    for ext, slot in (("mask", 5), ("docs", 8)):
        data = open(f"{prefix}.{ext}", "rb").read()
        if (zlib.crc32(data), len(data)) != (u[slot], u[slot + 1] + (u[slot + 2] << 32)):
            refused.append(ext)
    return refused


@pytest.mark.parametrize("phase", FAULT_PHASES)
def test_a_kill_at_any_phase_leaves_one_set_or_a_refused_one(tmp_path, capsys, phase):
    """A run killed (SIGKILL, ZINC_PREPARE_FAULT) at each phase of its commit over an earlier set: the files it
    renamed are the .mask, then the .docs, then the .bin, and the manifest last (the old one removed before
    the first rename), so that the .bin present always vouches for the .mask and .docs beside it (a mixed set
    is refused) and a manifest present always describes the .bin; its temporaries are removed by the next run,
    which leaves the new set and nothing else."""
    prefix = tmp_path / "set"
    outputs = [f"{prefix}.{ext}" for ext in ("bin", "mask", "docs", "json")]
    new_args = [FIX / "text.jsonl", "--tokenizer", LLAMA3, "--seq-len", 256, "--out", prefix]
    assert prepare.main(list(map(str, new_args))) == 0
    new = {p: open(p, "rb").read() for p in outputs}
    assert prepare.main([str(FIX / "alpaca.jsonl"), "--tokenizer", str(LLAMA3), "--seq-len", "256",
                         "--out", str(prefix)]) == 0
    old = {p: open(p, "rb").read() for p in outputs}
    capsys.readouterr()
    assert all(old[p] != new[p] for p in outputs)
    rc, err = cli(*new_args, env={"ZINC_PREPARE_FAULT": phase})
    assert rc == -9, err  # killed by the hook
    state = {p: open(p, "rb").read() if os.path.exists(p) else None for p in outputs}
    renamed = [ext for ext in ("bin", "mask", "docs", "json") if state[f"{prefix}.{ext}"] == new[f"{prefix}.{ext}"]]
    assert sorted(renamed) == sorted(RENAMED[phase])
    assert all(state[f"{prefix}.{ext}"] == old[f"{prefix}.{ext}"] for ext in ("bin", "mask", "docs")
               if ext not in renamed)
    assert state[f"{prefix}.json"] == (None if phase in MANIFEST_REMOVED else
                                       new[f"{prefix}.json"] if "json" in renamed else old[f"{prefix}.json"])
    assert set_rule(prefix) == [ext for ext in ("mask", "docs") if ext in renamed and "bin" not in renamed]
    left = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert len(left) == (3 if phase == "writing" else 4 - len(renamed))
    assert prepare.main(list(map(str, new_args))) == 0
    assert {p: open(p, "rb").read() for p in outputs} == new
    assert sorted(os.listdir(tmp_path)) == ["set.bin", "set.docs", "set.json", "set.mask"]


def test_sigterm_stops_between_batches_never_inside_the_commit(tmp_path, capsys, monkeypatch):
    """A SIGTERM while records are read stops the run (SystemExit 143: the exit status) with the earlier set as
    it was and no temporary; one during the renames lets them end, so the new set is whole."""
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "alpaca.jsonl")
    assert rc == 0, err
    before = snapshot(tmp_path)
    original = prepare.Outputs.add

    def add_then_term(self, docs):
        original(self, docs)
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(prepare.Outputs, "add", add_then_term)
    monkeypatch.setattr(prepare, "BATCH_CHARS", 64)
    with pytest.raises(SystemExit) as stopped:
        run_prepare(tmp_path, capsys, FIX / "text.jsonl")
    assert stopped.value.code == 143 and snapshot(tmp_path) == before
    monkeypatch.setattr(prepare.Outputs, "add", original)
    fired = []

    def term_after_mask(phase):
        if phase == "after_mask":
            fired.append(phase)
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(_prepare_outputs, "fault_point", term_after_mask)
    rc, err, _ = run_prepare(tmp_path, capsys, FIX / "text.jsonl")
    assert rc == 0, err
    assert fired == ["after_mask"]  # the SIGTERM came during the renames
    assert read_outputs(prefix)[3]["sources"][0]["path"] == str(FIX / "text.jsonl")  # the whole new set
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "out.docs", "out.json", "out.mask"]


def test_temporaries_of_dead_runs_are_removed_those_of_live_ones_kept(tmp_path, capsys):
    """The temporaries a killed run left (.out.EXT.tmp-PID, PID no live process) go at the next run on the
    prefix; those of a live process stay, and so do other prefixes' and other names."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        names = {f".out.bin.tmp-{dead.pid}": False, f".out.json.tmp-{dead.pid}": False,
                 f".out.mask.tmp-{live.pid}": True, f".other.bin.tmp-{dead.pid}": True,
                 f".out.bin.tmp-{dead.pid}.keep": True}
        for n in names:
            (tmp_path / n).write_bytes(b"partial")
        rc, err, _ = run_prepare(tmp_path, capsys, FIX / "text.jsonl")
        assert rc == 0, err
        assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == \
            sorted(n for n, kept in names.items() if kept)
    finally:
        live.kill()
        live.wait()


def test_a_second_run_on_the_same_out_is_refused(tmp_path, capsys):
    """Two runs on one --out at once: the second is refused with one line naming the first's pid (the lock
    file's holder), and writes nothing; the lock file goes with the run that held it."""
    lock = open(tmp_path / ".out.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.write("4242\n")
    lock.flush()
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "text.jsonl")
    lines = error_lines(err)
    assert rc == 1 and len(lines) == 1, err
    assert "another zinc.prepare (pid 4242)" in lines[0] and str(tmp_path / ".out.lock") in lines[0]
    assert os.listdir(tmp_path) == [".out.lock"]
    lock.close()
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "text.jsonl")
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "out.docs", "out.json", "out.mask"]


BOOM_RECORDS = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fine"}],
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "boom"}],
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]]


def boom_files(tmp_path, expression):
    """A chat file whose line 2 holds the assistant content "boom", and a template that renders each message's
    content through `expression` (of c, the content) for that content, as itself otherwise."""
    data = tmp_path / "boom.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in BOOM_RECORDS))
    template = tmp_path / "boom.jinja"
    template.write_text("{% for m in messages %}{% set c = m['content'] %}<{{ m['role'] }}>"
                        "{% if c == 'boom' %}" + expression + "{% else %}{{ c }}{% endif %}</s>{% endfor %}")
    return data, template


def test_a_template_repeating_a_string_without_bound_is_a_bad_record(tmp_path):
    """`{{ content * 100000000 }}` (issue 49: past 40 s and gigabytes): the record is bad, reported by file and
    line, in well under a second; the others are prepared."""
    data, template = boom_files(tmp_path, "{{ c * 100000000 }}")
    rc, err = cli(data, "--tokenizer", LLAMA3, "--chat-template", template, "--seq-len", 64,
                  "--out", tmp_path / "out", timeout=30)
    assert rc == 0, err
    assert bad_lines(err) == [2] and "boom.jsonl:2: the chat template repeats a str of 4 characters" in err
    manifest = read_outputs(tmp_path / "out")[3]
    assert manifest["documents"] - manifest["padding_documents"] == 2


def test_a_template_running_without_end_is_a_bad_record(tmp_path):
    """A template looping 10^10 times without output stops at MAX_RENDER_SECONDS (here 0.5 s): a bad record."""
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ c }}"
    data, template = boom_files(tmp_path, loop)
    lowered = "from zinc import _prepare_template\n_prepare_template.MAX_RENDER_SECONDS = 0.5"  # where it is read
    rc, err = cli(data, "--tokenizer", LLAMA3, "--chat-template", template, "--seq-len", 64,
                  "--out", tmp_path / "out", code=lowered, timeout=30)
    assert rc == 0, err
    assert bad_lines(err) == [2] and "boom.jsonl:2: the chat template ran past 0.5 s" in err


def test_a_template_cannot_outlast_its_deadline_in_the_search_for_assistant_turns(tmp_path):
    """The marker search for assistant turns (a template whose prefixes are not prefixes of the whole) caught
    every exception around two of its renders, the deadline's BadRecord too: the one-shot deadline spent, the
    next render ran with none (355 s on one record; SIGKILL only)."""
    template = tmp_path / "slow.jinja"
    template.write_text(
        "{%- set n = messages|length -%}"
        "{%- if n == 1 and not add_generation_prompt -%}"
        "{%- for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor -%}"
        "{%- elif n == 2 and '\ue000' in messages[1].content -%}"
        "{%- for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor -%}"
        "{%- endif -%}"
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
        "{%- if add_generation_prompt %}NOTPREFIX{% endif -%}")
    data = tmp_path / "four.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                             {"role": "user", "content": "Bye"},
                                             {"role": "assistant", "content": "Ciao"}]}) + "\n")
    lowered = "from zinc import _prepare_template\n_prepare_template.MAX_RENDER_SECONDS = 0.5"  # where it is read
    rc, err = cli(data, "--tokenizer", CHATML, "--chat-template", template, "--seq-len", 64,
                  "--out", tmp_path / "out", code=lowered, timeout=60)  # unbounded before: past the timeout
    assert rc == 1 and bad_lines(err) == [1] and "four.jsonl:1: the chat template ran past 0.5 s" in err, err


@pytest.mark.parametrize("expression,why", [
    ("{% set ns = namespace(s=c) %}{% for i in range(12) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "builds a namespace attribute 's' of 1,024 characters"),
    ("{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}{% endmacro %}{{ f(c, 12) }}",
     "builds an argument of 1,024 characters"),
    ("{% for i in range(400) %}{{ c }}{% endfor %}", "rendering passes 1,000 characters"),
    ("{{ '%5000s' % c }}", "formats with a width or precision above 1,000"),
    ("{{ '{:>5000}'.format(c) }}", "formats with a width or precision above 1,000"),
    ("{{ '%-5000s'|format(c) }}", "formats with a width or precision above 1,000"),
    ("{{ '%s%s' % (c * 200, c * 200) }}", "builds a '%' result of 1,600 characters"),
    ("{{ c|center(5000) }}", "passes 5,000 to a function or filter"),
    ("{{ c.ljust(5000) }}", "passes 5,000 to a function or filter"),
    ("{{ ([c] * 5000)|join }}", "repeats a list of 1 items 5,000 times"),
    ("{{ 7 ** 9000 % 10 }}", "raises 7 to the power 9,000"),
    ("{{ (c ~ c ~ c ~ c) + (c ~ c ~ c ~ c) }}" * 40, "rendering passes 1,000 characters"),
    # Built before its result was checked: 1.6 GB for ('a' * 16000000).replace('a', 'a' * 100).
    ("{{ (c * 200).replace('o', 'oooooooooo') }}", "str.replace would build 4,400 characters"),
    ("{{ ''.join([c * 200] * 4) }}", "str.join would build 3,200 characters"),
    ("{{ ([c * 200] * 4)|join }}", "join would build 3,200 characters"),
    # Each piece under the bound, kept in a list: 150 of 16 MB held 2.4 GB (MAX_RENDER_BUILT: 4,000 here).
    ("{% set ns = namespace(l=[]) %}{% for i in range(10) %}{% set ns.l = ns.l + [c * 200] %}{% endfor %}{{ c }}",
     "builds more than 4,000 characters and items in all in one rendering"),
])
def test_what_a_template_builds_is_bounded(tmp_path, capsys, monkeypatch, expression, why):
    """Each way a template can build a huge string or number (doubling in a namespace or through a macro's
    argument, output in a loop, '%' and filter widths, list repetition, '**'), against MAX_RENDER_CHARS
    lowered to 1,000: the record is bad, saying what, and the run goes on."""
    monkeypatch.setattr(_prepare_template, "MAX_RENDER_CHARS", 1000)
    monkeypatch.setattr(_prepare_template, "MAX_RENDER_BUILT", 4000)
    data, template = boom_files(tmp_path, expression)
    rc, err, prefix = run_prepare(tmp_path, capsys, data, "--chat-template", template, seq_len=64)
    assert rc == 0, err
    assert bad_lines(err) == [2] and why in err
    manifest = read_outputs(prefix)[3]
    assert manifest["documents"] - manifest["padding_documents"] == 2


@pytest.mark.parametrize("fmt", ["jsonl", "alpaca", "chat"])
def test_a_lone_surrogate_is_a_bad_record(tmp_path, capsys, fmt):
    """A JSON "\\ud800" escape alone (no Unicode text): a bad record naming file and line, not a TypeError from
    the tokenizer for its whole batch; a file of nothing else fails with exit 1, without a traceback."""
    def record(text):
        if fmt == "jsonl":
            return {"text": text}
        if fmt == "alpaca":
            return {"instruction": "Say it.", "output": text}
        return {"messages": [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": text}]}
    lines = [json.dumps(record(t)) for t in ("fine", "a \ud800 b", "also fine")]
    assert "\\ud800" in lines[1]
    data = tmp_path / "s.jsonl"
    data.write_text("\n".join(lines) + "\n")
    rc, err, prefix = run_prepare(tmp_path, capsys, data, tokenizer=CHATML if fmt == "chat" else LLAMA3)
    assert rc == 0, err
    assert bad_lines(err) == [2] and "s.jsonl:2: a lone surrogate '\\ud800'" in err
    manifest = read_outputs(prefix)[3]
    assert manifest["documents"] - manifest["padding_documents"] == 2
    data.write_text(lines[1] + "\n")
    rc, err, _ = run_prepare(tmp_path, capsys, data, tokenizer=CHATML if fmt == "chat" else LLAMA3, name="only")
    assert rc == 1 and "Traceback" not in err and "s.jsonl:1: a lone surrogate" in err
    assert error_lines(err)[-1].startswith("zinc.prepare: error: nothing usable")


def test_a_first_record_nested_too_deeply(tmp_path, capsys):
    """200,000 nested lists in the first record: with the format to infer, one line saying so (exit 1), not a
    RecursionError; with --format, a bad record, in a fresh interpreter (orjson overflowed its stack there:
    SIGSEGV)."""
    data = tmp_path / "deep.jsonl"
    data.write_text("[" * 200000 + "]" * 200000 + '\n{"text": "fine"}\n')
    rc, err, _ = run_prepare(tmp_path, capsys, data)
    lines = error_lines(err)
    assert rc == 1 and lines == [f"zinc.prepare: error: {data}:1: invalid JSON in the first record (nested too "
                                 "deeply); pass --format"]
    rc, err = cli(data, "--format", "jsonl", "--tokenizer", LLAMA3, "--seq-len", 64, "--out", tmp_path / "out")
    assert rc == 0, err
    assert bad_lines(err) == [1] and "deep.jsonl:1: invalid JSON: nested too deeply" in err


ODD_FILES = {"fifo": "is a FIFO, not a regular file", "/dev/zero": "is a character device, not a regular file",
             "folder": "is a folder, not a file"}


@pytest.mark.parametrize("where,kind", [
    (where, kind) for where in ("input", "--tokenizer", "tokenizer.json", "tokenizer_config.json", "--chat-template")
    for kind in ODD_FILES if (where, kind) != ("--tokenizer", "folder")])  # that one is a model folder
def test_a_file_that_is_no_regular_file(tmp_path, where, kind):
    """A FIFO, /dev/zero or a folder where a file is read (an input, the tokenizer, its config, the chat
    template): one line naming it and saying what it is, exit 1, at once (never blocking on the FIFO, never
    reading /dev/zero to its end), nothing written."""
    says = ODD_FILES[kind]
    model = copy_model(LLAMA3, tmp_path / "tok")
    odd = {"input": tmp_path / "odd.jsonl", "--tokenizer": tmp_path / "odd", "tokenizer.json": model / "tokenizer.json",
           "tokenizer_config.json": model / "tokenizer_config.json", "--chat-template": tmp_path / "odd.jinja"}[where]
    if odd.exists():
        odd.unlink()
    if kind == "fifo":
        os.mkfifo(odd)
    elif kind == "folder":
        odd.mkdir()
    else:
        odd.symlink_to("/dev/zero")
    args = [odd if where == "input" else FIX / "chat.jsonl", "--tokenizer", odd if where == "--tokenizer" else model,
            "--seq-len", 64, "--out", tmp_path / "out"]
    if where == "--chat-template":
        args += ["--chat-template", odd]
    before = tree(tmp_path)
    rc, err = cli(*args, timeout=30)
    lines = error_lines(err)
    assert rc == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"zinc.prepare: error: {odd}: {says}")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("out", ["", "sub/", ".", "..", "sub/.."])
def test_out_must_name_a_file_prefix(tmp_path, capsys, monkeypatch, out):
    """--out "" (the outputs were ../NAME.bin beside the working folder), a folder or . or ..: one line, exit 1,
    nothing written anywhere."""
    work = tmp_path / "a" / "b"
    (work / "sub").mkdir(parents=True)
    monkeypatch.chdir(work)
    before = tree(tmp_path)
    rc = prepare.main([str(FIX / "text.jsonl"), "--tokenizer", str(LLAMA3), "--seq-len", "64", "--out", out])
    lines = error_lines(capsys.readouterr().err)
    assert rc == 1 and len(lines) == 1
    assert lines[0].startswith(f"zinc.prepare: error: --out {out!r} is not a file prefix")
    assert tree(tmp_path) == before


def test_an_input_too_large_for_memory_gets_one_line_and_writes_nothing(tmp_path):
    # A record is read whole: a 1 GB input without line breaks under a 512 MB
    # address-space limit ended in a MemoryError traceback.
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: no disk space, no line break
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 29, 1 << 29)); "
            "from zinc import prepare; sys.exit(prepare.main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, str(big), "--format", "jsonl", "--tokenizer", str(CHATML),
                        "--seq-len", "64", "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "zinc.prepare: error: out of memory reading the input" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]


def test_a_record_longer_than_a_row_could_hold_is_bad_before_it_is_tokenized(tmp_path):
    # A 2 MB line took ~170 bytes of memory per byte in the tokenizer before
    # its length was checked (a 50 MB one 8.5 GB), and under a 512 MB limit
    # the tokenizer's allocator aborted the process (rc 134, no message).
    # Its length is now bounded first: no tokenizer covers 2 MB with 65
    # tokens. --truncate still tokenizes it (and cuts it).
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"text": "word " * 400_000}) + "\n" + json.dumps({"text": "a short one"}) + "\n")
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 29, 1 << 29)); "
            "from zinc import prepare; sys.exit(prepare.main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, str(data), "--tokenizer", str(CHATML), "--seq-len", "64",
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert "one.jsonl:1: 2000000 characters, more than the tokens a row holds could cover" in r.stderr, \
        r.stderr
    assert "1 documents" in r.stderr and "1 bad records" in r.stderr, r.stderr
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "word " * 100}) + "\n" + json.dumps({"text": "a short one"}) + "\n")
    for extra, words in (((), "302 tokens, more than --seq-len + 1 = 65"), (("--truncate",), "0 bad records")):
        r = subprocess.run([sys.executable, "-m", "zinc.prepare", str(small), "--tokenizer", str(CHATML),
                            "--seq-len", "64", "--out", str(tmp_path / "s"), *extra], capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        assert r.returncode == 0 and words in r.stderr, (extra, r.stderr)


def test_a_lock_path_that_is_a_fifo_and_a_prefix_folder_that_is_a_file_are_named(tmp_path, capsys):
    # A FIFO at .PREFIX.lock gave "[Errno 22] Invalid argument" naming no
    # path; --out FILE/x said FILE was "no such folder".
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "one"}\n')
    os.mkfifo(tmp_path / ".o.lock")
    rc, err, _ = run_prepare(tmp_path, capsys, data, name="o")
    assert rc == 1 and err.strip().splitlines()[-1] == (
        f"zinc.prepare: error: {tmp_path}/.o.lock: the --out prefix's lock file is not a regular file; remove it"), err
    (tmp_path / "afile").write_text("mine")
    rc, err, _ = run_prepare(tmp_path, capsys, data, name="afile/x")
    assert rc == 1 and "afile: not a folder (the --out prefix's folder must be one)" in err, err
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_disk_that_refuses_writes_names_the_file_and_keeps_the_old_set(tmp_path):
    # Found by a hostile user's sweep of full disks (2026-12-03): where the
    # manifest or the last buffered bytes failed, at the commit, the error
    # was "[Errno 28] No space left on device" with no file. Under ulimit -f
    # (EFBIG, as a full disk's ENOSPC) at limits from the first write to the
    # last (the largest file's last bytes go out at the commit's flush),
    # every failure names its file, and the set already there stays.
    src = tmp_path / "in.txt"
    src.write_text("\n\n".join(" ".join(("alpha", "beta", "gamma", "delta")[(i * 7 + j) % 4] for j in range(30))
                               for i in range(600)), encoding="utf-8")
    out = tmp_path / "p"
    base = ["--tokenizer", CHATML, "--seq-len", 32, "--split", "paragraphs", "--chunk", "--out", out]
    rc, err = cli(src, *base)
    assert rc == 0, err
    old = tree(tmp_path)
    size = max(len(v) for k, v in old.items() if k.startswith("p."))
    for limit in sorted({1, 512, 1024, 4096, size // 3, size // 2, size - 4096, size - 1}):
        code = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))")
        rc, err = cli(src, *base[:-1], out, code=code)
        assert rc == 1 and "Traceback" not in err, (limit, err)
        assert f"cannot write {tmp_path}/.p." in err and "File too large" in err, (limit, err)
        assert tree(tmp_path) == old, limit


def test_a_manifest_name_that_is_another_tools_file_is_refused(tmp_path):
    # --out m.safetensors.index writes m.safetensors.index.json, a sharded
    # export's index there: it was replaced (found by a sweep of two writers
    # on one folder, 2026-12-03). Only a zinc.prepare manifest is replaced.
    src = tmp_path / "in.txt"
    src.write_text("alpha beta gamma delta\n\nbeta gamma\n", encoding="utf-8")
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 8}, "weight_map": {"w": "m-00001-of-00002.safetensors"}}))
    before = tree(tmp_path)
    rc, err = cli(src, "--tokenizer", CHATML, "--seq-len", 32, "--split", "paragraphs", "--chunk",
                  "--out", tmp_path / "m.safetensors.index")
    assert rc == 1 and f"{index}: is not a zinc.prepare manifest" in err, err
    assert tree(tmp_path) == before
    rc, err = cli(src, "--tokenizer", CHATML, "--seq-len", 32, "--split", "paragraphs", "--chunk", "--out", tmp_path / "d")
    assert rc == 0, err
    rc, err = cli(src, "--tokenizer", CHATML, "--seq-len", 32, "--split", "paragraphs", "--chunk", "--out", tmp_path / "d")
    assert rc == 0, err  # its own manifest is replaced
