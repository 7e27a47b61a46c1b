"""Instructions per 256 int8 multiply-accumulates in the quantized matmul's inner loop, counted
as executed by each aarch64 path's compiled code (issue 29), under qemu-user: no ARM CPU needed.

The code counted is the kernel for one group of 8 weight rows over K = 2048 columns (64 blocks of
32: cpu/matmul_neon.h's group_tile_neon, what cpu/matmul_q.c calls for every format) against
R = 1 row of x (a decode step: every block decoded for one row) and R = 8 rows (a prefill tile:
each block decoded once for 8 rows). One block of one group against one row is 8 x 32 = 256 MACs,
so the figure is the probe function's executed instructions / (64 R): decode, integer dot
products, float scaling and loop overhead together. `dot` counts the integer multiply-accumulate
instructions alone (SMMLA, SDOT; SMULL(2), SMLAL(2), SADALP). qemu's `-d in_asm,exec,nochain` log gives
each translated block's instructions and every execution of one.

    python tools/count_matmul_instructions.py     # needs aarch64-linux-gnu-gcc and qemu-aarch64
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ember_cupy.ops import host_build  # noqa: E402

CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
FORMATS = {"Q8_0": 0, "Q4_1": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4, "Q5_0": 5, "Q5_1": 6, "Q4_0": 7}
PATHS = {"neon-i8mm": ("max", {"smmla", "sdot"}), "neon-dotprod": ("max", {"sdot"}), "neon": ("cortex-a53", {"smull", "smull2", "smlal", "smlal2", "sadalp"})}
BLOCKS = 64
ROWS_OF_X = (1, 8)

_MAIN = """
#include <stdio.h>
int main(void) {
    const int64_t nb = %(blocks)d, K = 32 * nb;
    int8_t *xq = calloc((size_t)(8 * K), 1);
    float *xd = malloc(sizeof(float) * 8 * nb), *xs = malloc(sizeof(float) * 8 * nb);
    int32_t *xsum = calloc((size_t)(8 * nb), 4), *xsum_lo = calloc((size_t)(8 * nb), 4);
    for (int64_t i = 0; i < 8 * nb; i++) xd[i] = xs[i] = 1.0f;
    float out[MR][ROWS];
%(calls)s
    printf("%%f\\n", out[0][0]);
    return 0;
}
"""


def probe_source() -> str:
    """cpu/matmul_q.c with a probe per format and row count, and a main that calls each once."""
    lines, calls = ['#include "matmul_q.c"'], []
    for name, code in FORMATS.items():
        for rows in ROWS_OF_X:
            lines.append(f"__attribute__((noinline)) void probe_{name}_r{rows}(const uint8_t *g, int64_t nb, "
                         "const int8_t *xq, int64_t K, const float *xd, const float *xs, const int32_t *xsum, "
                         "const int32_t *xsum_lo, float out[MR][ROWS]) {\n"
                         f"    group_tile_neon(g, {code}, nb, xq, K, xd, xs, xsum, xsum_lo, {rows}, 1, out);\n}}")
            calls.append(f"    {{ uint8_t *g = calloc((size_t)(nb / FORMATS[{code}].blocks "
                         f"* record_bytes({code})), 1);\n"
                         f"      probe_{name}_r{rows}(g, nb, xq, K, xd, xs, xsum, xsum_lo, out); free(g); }}")
    return "\n".join(lines) + _MAIN % {"blocks": BLOCKS, "calls": "\n".join(calls)}


def _mnemonic(word: int, shown: str) -> str:
    """qemu's disassembler shows SDOT and SMMLA as `.byte`: told by their encodings (SDOT vector
    and by element)."""
    if (word & 0xBFE0FC00) == 0x0E809400 or (word & 0xBFC0F400) == 0x0F80E000:
        return "sdot"
    return "smmla" if (word & 0xFFE0FC00) == 0x4E80A400 else shown


def executed(isa: str, workdir: Path) -> dict[str, Counter]:
    """Per function: the mnemonics it executed, with their counts."""
    source = workdir / f"probe-{isa}.c"
    source.write_text(probe_source())
    program = workdir / f"probe-{isa}"
    flags = [f for f in host_build.flags(isa) if f not in ("-shared", "-fPIC")]
    subprocess.run([CC, *flags, "-Wno-unused-function", "-static", "-I", str(ROOT / "cpu"), str(source),
                    *[str(s) for s in host_build.sources(ROOT / "cpu") if s.name != "matmul_q.c"],
                    "-o", str(program), "-lm"], check=True, capture_output=True, text=True)
    log = workdir / f"probe-{isa}.log"
    subprocess.run([QEMU, "-cpu", PATHS[isa][0], "-d", "in_asm,exec,nochain", "-D", str(log), str(program)],
                   check=True, capture_output=True, text=True, env={"EMBER_NUM_THREADS": "1"})
    blocks, current, totals = {}, None, {}
    for line in log.read_text().splitlines():
        if line.startswith("IN:"):
            current = None
        elif (m := re.match(r"^0x([0-9a-f]+):\s+([0-9a-f]{8})\s+(\S+)", line)):
            if current is None:
                current = blocks[int(m.group(1), 16)] = Counter()
            current[_mnemonic(int(m.group(2), 16), m.group(3))] += 1
        elif (m := re.match(r"^Trace \d+: \S+ \[[0-9a-f]+/([0-9a-f]+)/.*\] (\S+)", line)):
            current = None
            totals.setdefault(m.group(2), Counter()).update(blocks[int(m.group(1), 16)])
    return totals


def table(isas=tuple(PATHS)) -> dict[tuple[str, str, int], tuple[float, float]]:
    """(path, format, rows of x): (instructions, dot instructions) per 256 MACs"""
    result = {}
    with tempfile.TemporaryDirectory() as workdir:
        for isa in isas:
            totals = executed(isa, Path(workdir))
            for name in FORMATS:
                for rows in ROWS_OF_X:
                    mnemonics = totals[f"probe_{name}_r{rows}"]
                    macs = BLOCKS * rows
                    dot = sum(n for m, n in mnemonics.items() if m in PATHS[isa][1])
                    result[isa, name, rows] = (sum(mnemonics.values()) / macs, dot / macs)
    return result


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    counts = table()
    header = [f"{isa} R={rows}" for isa in PATHS for rows in ROWS_OF_X]
    print("| format | " + " | ".join(header) + " |")
    print("|---|" + "---|" * len(header))
    for name in FORMATS:
        cells = [f"{counts[isa, name, rows][0]:.1f} ({counts[isa, name, rows][1]:.0f})"
                 for isa in PATHS for rows in ROWS_OF_X]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
