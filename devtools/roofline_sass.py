"""NVIDIA SASS as the roofline model reads it: instructions with their control codes, loops, and one
warp's own instruction stream through a loop trip.

``cuobjdump -sass`` prints each 128-bit sm_70+ instruction as two 64-bit words; the high word's top
bits are the control code ptxas scheduled: the stall count (cycles before the warp's next
instruction issues, bits 41-44), the scoreboard the instruction sets when its result is ready
(write barrier, bits 46-48; 7: none), the one it sets when its sources have been read (read barrier,
bits 49-51) and the scoreboards it waits for (wait mask, bits 52-57). Fixed-latency dependencies are
in the stall counts; variable-latency ones (shared / global loads, MUFU, shuffles) are scoreboard
waits, which :func:`stream_cycles` resolves with the latencies it is given.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([.\w]*)[\s;]")
_WORD = re.compile(r"/\*\s*(0x[0-9a-f]{16})\s*\*/")
_BRANCH = re.compile(r"\bBRA\s+(?:`?\()?0x([0-9a-f]+)")
NO_BARRIER = 7

#: opcode prefix -> the latency kind of its scoreboard (first match wins); others: "fixed"
LATENCY_KINDS = (("LDGSTS", "async"), ("LDGDEPBAR", "fixed"), ("LDSM", "shared"), ("LDS", "shared"),
                 ("LDG", "global"), ("LD", "global"), ("MUFU", "xu"), ("SHFL", "shfl"), ("HGMMA", "matrix"),
                 ("HMMA", "matrix"))


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction: byte address, opcode (``LDS``), modifiers (``.U16``), the source line and
    its control code (stall cycles, write / read scoreboard, wait mask)."""
    address: int
    opcode: str
    modifiers: str
    text: str
    stall: int
    write_barrier: int
    read_barrier: int
    wait_mask: int

    @property
    def kind(self) -> str:
        return next((k for prefix, k in LATENCY_KINDS if self.opcode.startswith(prefix)), "fixed")


def parse(sass: str) -> list[Instruction]:
    """Every instruction of ``cuobjdump -sass`` text with its control code."""
    lines = sass.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = _LINE.match(line)
        words = _WORD.findall(lines[i + 1]) if m and i + 1 < len(lines) else []
        if not m or not words:
            continue
        hi = int(words[-1], 16)
        out.append(Instruction(int(m.group(1), 16), m.group(2), m.group(3), line.strip(), (hi >> 41) & 0xF,
                               (hi >> 46) & 0x7, (hi >> 49) & 0x7, (hi >> 52) & 0x3F))
    return out


def loops(code: list[Instruction]) -> list[tuple[int, int]]:
    """(first, last address) of every backward branch's range, innermost (shortest) first."""
    spans = {(int(b.group(1), 16), ins.address) for ins in code
             if (b := _BRANCH.search(ins.text)) and int(b.group(1), 16) < ins.address}
    return sorted(spans, key=lambda s: s[1] - s[0])


def body(code: list[Instruction], span: tuple[int, int]) -> list[Instruction]:
    """The instructions of a loop span."""
    return [ins for ins in code if span[0] <= ins.address <= span[1]]


def stream_cycles(loop: Iterable[Instruction], latency: Mapping[str, float]) -> float:
    """Cycles one warp takes for one trip of ``loop`` on its own, in steady state (the second of two
    simulated trips): each instruction issues ``stall`` cycles after the previous one (at least 1),
    or later when its wait mask names a scoreboard whose producer has not finished; a producer's
    result is ready ``latency[kind]`` cycles after it issues (kinds: :data:`LATENCY_KINDS`; a kind
    missing from ``latency`` is ready at once: "matrix" results are the model's matrix term,
    "async" copies its latency bound's)."""
    trip = list(loop)
    ready = [0.0] * 8
    t, ends = 0.0, []
    for _ in range(2):
        for ins in trip:
            for sb in range(6):
                if ins.wait_mask >> sb & 1:
                    t = max(t, ready[sb])
            if ins.write_barrier != NO_BARRIER:
                ready[ins.write_barrier] = t + latency.get(ins.kind, 0.0)
            if ins.read_barrier != NO_BARRIER:
                ready[ins.read_barrier] = t + latency.get("read", 0.0)
            t += max(ins.stall, 1)
        ends.append(t)
    return ends[1] - ends[0]


def cuobjdump() -> str | None:
    """The cuobjdump Triton ships (or one on PATH), None without either."""
    import shutil
    try:
        from triton import knobs
        path = knobs.nvidia.cuobjdump.path
        if path and Path(path).exists():
            return str(path)
    except Exception:        # an older Triton, or none: fall back to PATH
        pass
    return shutil.which("cuobjdump")


def disassemble(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin."""
    tool = cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump not found (Triton's NVIDIA backend ships one)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        return subprocess.run([tool, "-sass", fh.name], capture_output=True, text=True, check=True).stdout


#: SASS opcode prefix -> the roofline model's NVIDIA instruction class (first match wins; others: "alu")
CLASSES = (("HGMMA", "wgmma"), ("HMMA", "mma"), ("MUFU", "sfu"), ("LDSM", "lds"), ("LDS", "lds"),
           ("STS", "lds"), ("LDGSTS", "ldg"), ("LDG", "ldg"), ("STG", "ldg"), ("BRA", "branch"), ("BAR", "branch"),
           ("WARPSYNC", "branch"), ("BSYNC", "branch"), ("BSSY", "branch"))

#: Scoreboard latencies on Hopper in cycles (ASSUMPTIONS, of the order published microbenchmarks of
#: Hopper report; not measured here): a shared-memory load 30, a global load that hits L1 40 (the loops
#: read block-table words every program of a sequence reads), MUFU 20, a shuffle 30, a register read by
#: a store 2
HOPPER_LATENCY = {"shared": 30.0, "global": 40.0, "xu": 20.0, "shfl": 30.0, "read": 2.0}

_WIDTHS = {".U8": 1, ".S8": 1, ".U16": 2, ".S16": 2, ".64": 8, ".128": 16}


def class_of(opcode: str) -> str:
    """The roofline class of an opcode (NOPs included in "alu": they take issue slots)."""
    return next((c for prefix, c in CLASSES if opcode.startswith(prefix)), "alu")


def access_width(ins: Instruction) -> int:
    """Bytes per lane of a shared / global access from its modifiers (4 without a width)."""
    return next((w for suffix, w in _WIDTHS.items() if suffix in ins.modifiers), 4)
