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
    if "<<<" in out:
        sys.exit("translate.py: %s: a launch the rewrite does not understand is left" % src)
    with open(dst, "w", encoding="utf-8") as f:
        f.write('#line 1 "%s"\n' % src)
        f.write(out)
    print("translate.py: %s: %d launches" % (src, count))


if __name__ == "__main__":
    main()
