"""Edits of a compiled kernel's machine code (Hopper SASS) that ptxas does not make itself.

An sm_90 instruction is 16 bytes, two little-endian 64-bit words. The low word holds the opcode
(bits 0-11) and operands; the high word's top bits are the scheduling controls ptxas sets for
each instruction, among them (bit numbers within the high word):

    45      yield: 0 lets the warp scheduler switch to another warp after this instruction
    58-61   reuse: keep an operand (slots a, b, c, ...) in the operand cache for the next instruction

ptxas gives a run of float32 adds (FADD) a yield every other instruction, so that a warp adding
up a long run lets the SM sub-partition's other warps issue in between; for a run of fused
multiply-adds (FFMA) it does not, and it has them read a repeated operand from the operand cache
instead. In the FP8 block-scaled product each K step's partial joins the total by such a run
(``total = fma(partial, scale, total)``, 64 a thread), while the other consumer warpgroup is
waiting to issue its next tensor-core product from the same sub-partitions.
``interleave_yields`` gives the FFMA runs the FADD runs' pattern: a yield every other instruction,
and no operand cache on those (after a switch the cache holds another warp's operands). Neither
bit changes what an instruction computes, only when the warps issue.
"""

from __future__ import annotations

import struct

FFMA_REGISTERS = 0x223  # opcode bits 0-11: FFMA Rd, Ra, Rb, Rc
OPCODE_MASK = 0xFFF
YIELD = 1 << 45  # high word: set = stay on this warp, clear = may switch after this instruction
REUSE = 0xF << 58  # high word: the operand-cache flags
INSTRUCTION = 16  # bytes
SHT_PROGBITS = 1


def text_sections(cubin: bytes) -> list:
    """(offset, size) of each ``.text.<kernel>`` section (the kernels' code) of an ELF64 cubin."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i):  # sh_name, sh_type, sh_offset, sh_size
        name, kind, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        return name, kind, offset, size

    names = header(shstrndx)[2]
    sections = []
    for i in range(shnum):
        name, kind, offset, size = header(i)
        label = cubin[names + name:cubin.index(b"\0", names + name)]
        if kind == SHT_PROGBITS and label.startswith(b".text."):
            sections.append((offset, size))
    return sections


def ffma_runs(cubin: bytes, offset: int, size: int, min_run: int) -> list:
    """[(first instruction's offset, count)] of the runs of ``min_run`` or more register FFMAs in a row."""
    runs, start, count = [], 0, 0
    for at in range(offset, offset + size, INSTRUCTION):
        low, = struct.unpack_from("<Q", cubin, at)
        if low & OPCODE_MASK == FFMA_REGISTERS:
            if count == 0:
                start = at
            count += 1
            continue
        if count >= min_run:
            runs.append((start, count))
        count = 0
    if count >= min_run:
        runs.append((start, count))
    return runs


def interleave_yields(cubin: bytes, min_run: int = 16) -> bytes:
    """``cubin`` with a yield (and no operand reuse) on every other FFMA of each run of ``min_run``
    or more, from the run's first, as ptxas does for runs of FADD. The same computation: only
    the warps' issue order can change."""
    out = bytearray(cubin)
    for offset, size in text_sections(cubin):
        for start, count in ffma_runs(cubin, offset, size, min_run):
            for at in range(start + 8, start + 8 + count * INSTRUCTION, 2 * INSTRUCTION):
                high, = struct.unpack_from("<Q", out, at)
                struct.pack_into("<Q", out, at, high & ~YIELD & ~REUSE)
    return bytes(out)
