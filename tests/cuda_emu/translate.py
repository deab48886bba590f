#!/usr/bin/env python3
"""Kernel emulation (Note [kernel emulation] in cuda_emu.h): copies a .cu file
to a C++ file, rewriting each launch kernel<<<grid, block[, smem[, stream]]>>>(
into ::zinc_emu::launcher("kernel", kernel, grid, block[, smem[, stream]])(
and nothing else; #line keeps compiler errors pointing into the .cu file.

usage: translate.py IN.cu OUT.cpp
"""
import re
import sys

# A kernel name, optionally qualified and with template arguments, then <<<...>>>.
LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;{}]*>)?)\s*<<<(.*?)>>>", re.S)


# A __shared__ declaration on one line: each array it declares is registered
# with the runtime (on the same line, so line numbers hold), which refills it
# with NaN bytes before every block and checks the kernel's total against
# the 48 KiB a block may declare statically.
SHARED = re.compile(r"^(\s*__shared__\s+[^;]*;)(.*)$", re.M)
DECLARATOR = re.compile(r"([A-Za-z_]\w*)\s*(?:\[|$)")


def shared(m):
    decl = m.group(1)
    body = decl.strip()[len("__shared__"):].rstrip(";")
    # The declarators after the type: split at top-level commas.
    parts, depth, cur = [], 0, ""
    for ch in body:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    names = []
    # The first part holds the type too: its declarator is the last word before any [.
    head = parts[0].split("[")[0].split()
    names.append(head[-1])
    for p in parts[1:]:
        names.append(p.split("[")[0].strip())
    regs = " ".join("ZINC_EMU_SHARED(%s);" % n for n in names)
    return decl + " " + regs + m.group(2)


# Dynamic shared memory, `extern __shared__ [__align__(n)] type name[];` on
# one line, becomes a pointer to the launch's (cuda_emu.h, dynamic_shared()).
DYNAMIC = re.compile(r"^(\s*)extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][\w: ]*?)\s+([A-Za-z_]\w*)\s*\[\s*\]\s*;",
                     re.M)


def main():
    src, dst = sys.argv[1], sys.argv[2]
    text = open(src, encoding="utf-8").read()
    count = 0

    def launch(m):
        nonlocal count
        count += 1
        name = m.group(1)
        return '::zinc_emu::launcher("%s", %s, %s)' % (name.replace('"', ""), name, m.group(2))

    out = LAUNCH.sub(launch, text)
    out = DYNAMIC.sub(lambda m: "%s%s* const %s = static_cast<%s*>(::zinc_emu::dynamic_shared());"
                      % (m.group(1), m.group(2), m.group(3), m.group(2)), out)
    out = SHARED.sub(shared, out)
    if "<<<" in out:
        sys.exit("translate.py: %s: a launch the rewrite does not understand is left" % src)
    with open(dst, "w", encoding="utf-8") as f:
        f.write('#line 1 "%s"\n' % src)
        f.write(out)
    print("translate.py: %s: %d launches" % (src, count))


if __name__ == "__main__":
    main()
