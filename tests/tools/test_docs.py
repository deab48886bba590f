"""Every link in the documentation resolves (issue 50).

The Markdown files a reader walks (README.md, docs/, configs/README.md,
bench/RESULTS.md, the tests' and fixtures' READMEs) link to each other and
to sections inside each other. A link whose file is gone, or whose #anchor
names no heading of its target (as GitHub makes anchors from headings), is a
dead end for a newcomer; this test names each one. Code references to the
design document must name the file in the repo (docs/design.md).

Run by CTest (docs) with ZINC_ROOT set; python3 -m pytest tests/tools/test_docs.py from the repo root.
"""
import os
import re
import subprocess

ROOT = os.environ.get("ZINC_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def markdown_files():
    """Every .md file git tracks or would (ls-files where the tree is a checkout, else a walk)."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
                             capture_output=True, text=True, check=True)
        files = [f for f in out.stdout.splitlines() if f]
        if files:
            return files
    except (OSError, subprocess.CalledProcessError):
        pass
    found = []
    for base, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "build"]
        found += [os.path.relpath(os.path.join(base, n), ROOT) for n in names if n.endswith(".md")]
    return found


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    """The anchors of a Markdown file's headings, duplicates numbered as GitHub numbers them."""
    seen, out, fenced = {}, set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if FENCE.match(line):
                fenced = not fenced
            m = None if fenced else re.match(r"^#{1,6} (.*)$", line)
            if m:
                s = slug(m.group(1))
                n = seen.get(s, 0)
                out.add(s if n == 0 else "%s-%d" % (s, n))
                seen[s] = n + 1
    return out


def links(path):
    """(line number, target) of every link outside code blocks and inline code."""
    out, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if FENCE.match(line):
                fenced = not fenced
                continue
            if fenced:
                continue
            for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
                out.append((i, m.group(1)))
    return out


def test_every_link_resolves():
    problems = []
    files = markdown_files()
    assert "README.md" in files and any(f.startswith("docs/") for f in files), files
    cache = {}
    checked = 0
    for rel in files:
        path = os.path.join(ROOT, rel)
        for line, target in links(path):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            checked += 1
            if not os.path.exists(dest):
                problems.append("%s:%d: %s: no such file" % (rel, line, target))
                continue
            if anchor and dest.endswith(".md"):
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    problems.append("%s:%d: %s: no heading of %s has the anchor #%s"
                                    % (rel, line, target, os.path.relpath(dest, ROOT), anchor))
    assert checked > 30, "only %d links found: is the documentation where this test looks?" % checked
    assert not problems, "\n".join(problems)


def test_the_code_cites_the_design_in_the_repo():
    """The design document is docs/design.md: code that cites it names that file."""
    design = os.path.join(ROOT, "docs", "design.md")
    assert os.path.exists(design)
    bad = []
    for base, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "docs")]
        for n in names:
            if n.endswith((".h", ".cpp", ".cu", ".py", ".sh", ".txt")) or n == "CMakeLists.txt":
                p = os.path.join(base, n)
                if os.path.samefile(p, __file__):
                    continue
                with open(p, encoding="utf-8", errors="replace") as f:
                    for i, line in enumerate(f, 1):
                        if re.search(r"(?<![\w/])DESIGN\.md", line):
                            bad.append("%s:%d: %s" % (os.path.relpath(p, ROOT), i, line.strip()))
    assert not bad, "cites a design document the repo does not hold (docs/design.md is the design):\n" + "\n".join(bad)


def test_anchors_follow_githubs_rules():
    """The slug rules the link check relies on, on headings of the kinds the docs use."""
    assert slug("Train") == "train"
    assert slug("`bash scripts/train.sh` on a fresh AVX512-BF16 machine (2026-11-27, fourth session)") == \
        "bash-scriptstrainsh-on-a-fresh-avx512-bf16-machine-2026-11-27-fourth-session"
    assert slug("gpu: second run, on an H200 (2026-11-28)") == "gpu-second-run-on-an-h200-2026-11-28"
