"""One roofline model for every attention kernel family (HIP, SYCL, Triton) on every GPU target.

An ESTIMATE from compiler output and published figures, never a measurement. Inputs:

* :class:`Target`: one GPU's figures (units, issue ports, clock, DRAM bandwidth and the share of it
  a copy kernel was measured to reach, the dense bf16 matrix peak, an assumed loaded DRAM latency,
  and per instruction class the cycles an issue port's pipe is busy per wave instruction). The
  shipped table is :data:`TARGETS`; every figure there names its source or says it is an assumption.
* :class:`KernelLaunch`: what one launch of a kernel does, as the family adapters
  (``devtools/roofline_hip.py``, ``roofline_sycl.py``, ``roofline_triton.py``) read it from the
  assembly: programs (work-groups / CTAs), waves (warps, sub-group threads) per program, mean
  hot-loop iterations per program, one iteration's :class:`LoopMix` (instructions per wave by class,
  bytes loaded and matrix flops per program), programs resident per unit, bytes in flight per
  program, the DRAM bytes the launch moves, a second launch's bytes (the split-KV reduce), and the
  useful bytes / flops of the case the launch serves.

:func:`estimate` computes six bounds separately, each a lower bound on the launch's time from one
resource (seconds; a second launch, when there is one, runs after the first and adds its own
time, ``second_launch_s``, to every bound):

``memory``
    DRAM bytes / (peak bandwidth x the target's DRAM efficiency).
``issue``
    Per issue port (SIMD on CDNA, SM sub-partition on NVIDIA, XVE on Intel), the waves' work spread
    evenly over the ports that have waves: every instruction class has its own pipe, and different
    classes issue in parallel from different waves, so the port's time is the busiest pipe's
    (``count x cycles`` per class; matrix classes: their flops at the port's share of the matrix
    peak), or the port's dispatch limit (``dispatch_per_cycle`` instructions of any class per
    cycle), or one wave's own stream (a wave issues at most one instruction per
    ``wave_issue_interval`` cycles and waits for its own matrix results; the resident waves run
    their streams side by side), whichever is longest. Static counts: both sides of a branch in
    the loop count, so this is pessimistic for loops with rarely taken branches.
``latency``
    Little's law: at most ``min(programs, units x resident)`` programs are resident, each with
    ``bytes_in_flight`` outstanding for one round trip (``latency_s`` for the ``dram_share`` of the
    loop's bytes, ``cache_latency_s`` for the rest); every byte the loop loads passes through that
    window. The part of a wave's instruction stream that issues with none of
    its loads outstanding (``serial_share``) holds the program on top of the round trip. Programs
    that exit at once still hold their slot for ``exit_s``.
``grid``
    The tail: some program slot runs ``ceil(programs / (units x resident))`` programs one after
    another, each taking at least its own critical path (its ``prologue_s``, then its iterations x
    max(one wave's instruction stream, its own Little's-law round trip + the serial part of the
    stream)), plus the exiting programs' slot time spread over all slots. With
    ``program_iterations`` (each program's iterations in launch order) the slots take the programs
    in that order, each the next one as it frees (list scheduling), and the bound is the last slot
    to finish: programs of unequal length (causal prefill) leave a tail when the longest come last.

``shared``
    The busiest unit's shared-memory (LDS) wavefronts: ``ceil(programs / units)`` programs x their
    iterations x ``shared_wavefronts`` (per program and iteration, counted from the access pattern by
    :func:`shared_wavefronts`) at the target's ``shared_wavefronts_per_cycle``. 0 when the adapter
    gives no wavefronts.
``l2``
    Bytes the launch reads from the last-level cache beyond its DRAM bytes (``l2_bytes``: e.g. K/V
    tiles that every block of rows fetches again) / the target's ``l2_bandwidth``. 0 when either is 0.

The estimate is the slowest bound; :attr:`Estimate.bound` names it (ties go to the first of
memory, issue, latency, grid, shared, l2). Decode is judged against the memory floor (useful bytes at the
cited efficiency: ``fraction`` = floor / estimate can reach 1 only when the kernel moves no byte
more than the useful ones, so no figure above what the cited efficiency allows is ever reported);
prefill against the dense matrix peak (useful causal flops / matrix peak).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Mapping

BOUNDS = ("memory", "issue", "latency", "grid", "shared", "l2")
CASES = ("decode", "prefill")


@dataclass(frozen=True)
class Target:
    """One GPU as the model sees it. Units: Hz, bytes/s, flop/s, seconds, cycles.

    ``ports_per_unit``: issue ports per CU / SM / Xe-core (CDNA: 4 SIMDs; NVIDIA: 4 sub-partitions;
    Intel: 8 (Xe-HPC) or 16 (Xe-HPG) XVEs). ``pipe_cycles``: instruction class -> cycles that class's
    pipe on one port is busy per wave instruction (a pipe shared by the unit's ports is entered as
    its cycles x the ports). ``matrix_rate``: matrix class -> the share of ``matrix_peak`` that
    instruction reaches; a matrix class's pipe time comes from the loop's matrix flops, not from
    ``pipe_cycles``. ``dispatch_per_cycle``: instructions of any classes one port issues per cycle.
    ``wave_issue_interval``: the fewest cycles between two instructions of one wave.
    ``latency_s`` / ``cache_latency_s``: loaded round trip of a load served by DRAM / by the
    last-level cache (assumptions; ``latency_source`` says so).
    ``launch_gap_s``: the idle time between two dependent launches on one stream (assumption).
    ``matrix_issue_port``: the pipe through which matrix instructions issue, holding it for that
    pipe's cycles per instruction (CDNA: MFMA issues through the VALU port); None: only the dispatch
    slot. ``shared_banks`` x ``shared_bank_bytes``: the shared memory / LDS banks one wavefront (one
    pass) serves; ``shared_wavefronts_per_cycle``: wavefronts one unit's shared memory serves per cycle.
    ``l2_bandwidth``: last-level-cache read bandwidth (bytes/s; 0: no l2 bound), ``l2_source`` its
    source. ``measured``: the device has run kvmulti's kernels (docs/data/device_check.json), so its
    estimates carry a calibration error."""
    name: str
    arch: str
    vendor: str
    units: int
    ports_per_unit: int
    clock_hz: float
    peak_bandwidth: float
    dram_efficiency: float
    dram_efficiency_source: str
    matrix_peak: float
    latency_s: float
    latency_source: str
    cache_latency_s: float
    pipe_cycles: Mapping[str, float]
    matrix_rate: Mapping[str, float]
    dispatch_per_cycle: float
    wave_issue_interval: float
    launch_gap_s: float = 2e-6
    matrix_issue_port: str | None = None
    sources: str = ""
    shared_banks: int = 32
    shared_bank_bytes: int = 4
    shared_wavefronts_per_cycle: float = 1.0
    l2_bandwidth: float = 0.0
    l2_source: str = ""
    measured: bool = False

    @property
    def bandwidth(self) -> float:
        """The DRAM bandwidth the model lets a kernel reach: peak x efficiency (bytes/s)."""
        return self.peak_bandwidth * self.dram_efficiency

    @property
    def classes(self) -> frozenset[str]:
        return frozenset(self.pipe_cycles) | frozenset(self.matrix_rate)


@dataclass(frozen=True)
class LoopMix:
    """One iteration of a kernel's hot loop.

    ``instructions``: class -> instructions ONE WAVE issues per iteration (static counts from the
    assembly; classes must be the target's). ``bytes``: bytes ONE PROGRAM loads per iteration
    (from DRAM or a cache). ``matrix_flops``: matrix class -> flops ONE PROGRAM executes per
    iteration on that class's instructions."""
    instructions: Mapping[str, float]
    bytes: float
    matrix_flops: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class KernelLaunch:
    """One launch of one kernel for one case on one target, as an adapter read it.

    ``programs``: work-groups / CTAs. ``waves_per_program``: waves / warps / sub-group threads each.
    ``iterations``: mean hot-loop iterations per program. ``resident_per_unit``: programs resident
    per CU / SM / Xe-core at once (registers, LDS, wave slots). ``bytes_in_flight``: loop bytes one
    program has outstanding at once. ``dram_bytes``: bytes the launch must move to or from DRAM
    (K/V once, plus queries, outputs, partials). ``useful_bytes`` / ``useful_flops``: the case's
    floor (decode: the K/V bytes; prefill: the causal attention flops). ``second_launch_bytes``:
    DRAM bytes of a dependent second launch (the split-KV reduce; 0: none).
    ``serial_share``: the share of a wave's per-iteration instructions that issue with none of its
    loads outstanding (read from the assembly: 0 when the next tile's loads are in flight during
    this tile's work, 1 when a wave computes only after all of its loads have returned); that part
    of the stream follows the loads' round trip instead of hiding it, in the latency and grid
    bounds: an iteration takes max(stream, round trip + serial_share x stream). ``dram_share``: the
    share of the loop's bytes that come from DRAM (the rest hit the last-level cache, e.g. K/V tiles
    that other programs of the same sequence read before). ``exiting_programs``:
    programs of the launch that do no loop work and only hold a slot for ``exit_s`` seconds each
    (work-groups that find another one covers their rows and return). ``notes``: what the adapter
    assumed. ``program_iterations``: each working program's iterations in launch order (None: all
    ``iterations``; the grid bound then list-schedules them). ``prologue_s``: a program's serial time
    before its first iteration (dependent round trips that find its work and its first tile).
    ``lockstep_matrix``: the program's waves meet at a barrier every iteration, so they issue their
    matrix work together and each waits for all of the program's matrix work on its unit's matrix
    units (several waves of the program on one port share that port's matrix unit)."""
    kernel: str
    target: str
    case: str
    programs: int
    waves_per_program: int
    iterations: float
    loop: LoopMix
    resident_per_unit: int
    bytes_in_flight: float
    dram_bytes: float
    useful_bytes: float
    useful_flops: float
    second_launch_bytes: float = 0.0
    serial_share: float = 0.0
    dram_share: float = 1.0
    exiting_programs: int = 0
    exit_s: float = 0.0
    notes: str = ""
    shared_wavefronts: float = 0.0
    l2_bytes: float = 0.0
    stream_cycles: float | None = None
    program_iterations: tuple[float, ...] | None = None
    prologue_s: float = 0.0
    lockstep_matrix: bool = False


@dataclass(frozen=True)
class Estimate:
    """The model's answer for one launch on one target. ``bounds``: seconds per bound (:data:`BOUNDS`);
    ``bound``: the slowest one's name; ``time_s``: the estimate; ``floor_s``: the case's floor
    (decode: useful bytes at peak x efficiency; prefill: useful flops at the matrix peak);
    ``fraction`` = floor_s / time_s (<= 1); ``issue_pipes``: seconds per pipe of the issue bound
    (with "dispatch" and "wave_stream"); ``resident_programs``: programs resident device-wide."""
    kernel: str
    target: str
    case: str
    bounds: Mapping[str, float]
    bound: str
    time_s: float
    floor_s: float
    judged_against: str
    fraction: float
    issue_pipes: Mapping[str, float]
    resident_programs: int
    second_launch_s: float
    notes: str = ""

    def row(self) -> dict:
        """A flat dict for reports and JSON (times in microseconds)."""
        return {"kernel": self.kernel, "target": self.target, "case": self.case,
                **{f"{b}_us": self.bounds[b] * 1e6 for b in BOUNDS}, "bound": self.bound,
                "estimate_us": self.time_s * 1e6, "floor_us": self.floor_s * 1e6,
                "judged_against": self.judged_against, "fraction": self.fraction,
                "issue_limiter": max(self.issue_pipes, key=self.issue_pipes.get) if self.issue_pipes else None,
                "notes": self.notes}


@dataclass(frozen=True)
class Case:
    """A batch the adapters turn into launches: ``sequences`` requests of ``query_len`` new tokens
    each, whose last token sees ``context`` keys (causal), ``q_heads`` / ``kv_heads`` heads of
    ``head`` dims, 16-bit queries and outputs, cache blocks of ``block_size`` keys."""
    name: str
    sequences: int
    query_len: int
    context: int
    q_heads: int = 32
    kv_heads: int = 8
    head: int = 128
    block_size: int = 16

    @property
    def tokens(self) -> int:
        return self.sequences * self.query_len

    def kv_bytes(self, elem_bytes: int = 2) -> int:
        """K and V of every key once, in a cache of ``elem_bytes`` per element."""
        return self.sequences * self.context * self.kv_heads * self.head * 2 * elem_bytes

    @property
    def q_bytes(self) -> int:
        """The queries (= the outputs) in 16 bits."""
        return self.tokens * self.q_heads * self.head * 2

    @property
    def useful_flops(self) -> float:
        """QK^T and P.V over the keys each query token sees (causal): 4 x head flops per (row, key)."""
        first = self.context - self.query_len           # keys before the first new token
        keys = sum(first + i + 1 for i in range(self.query_len))
        return float(self.sequences * self.q_heads * keys * 4 * self.head)


#: 32 sequences x 4096 keys, one new token each (32 / 8 heads, head 128, bf16, block 16)
DECODE = Case("decode", sequences=32, query_len=1, context=4096)
#: 8 prompts x 2048 tokens, causal, no context before them (32 / 8 heads, head 128, bf16)
PREFILL = Case("prefill", sequences=8, query_len=2048, context=2048)


def _check(launch: KernelLaunch, target: Target) -> None:
    if launch.case not in CASES:
        raise ValueError(f"case {launch.case!r} is not one of {CASES}")
    unknown = (set(launch.loop.instructions) | set(launch.loop.matrix_flops)) - target.classes
    if unknown:
        raise ValueError(f"{launch.kernel} on {target.name}: instruction classes {sorted(unknown)} unknown to the "
                         f"target (known: {sorted(target.classes)})")
    if min(launch.programs, launch.waves_per_program, launch.resident_per_unit) < 1 or launch.iterations < 0:
        raise ValueError(f"{launch.kernel}: programs, waves per program and resident programs must be >= 1")
    missing = [c for c, n in launch.loop.instructions.items()
               if n and c in target.matrix_rate and not launch.loop.matrix_flops.get(c)]
    if missing:
        raise ValueError(f"{launch.kernel}: matrix classes {missing} issued without their flops (matrix_flops)")
    for name in ("serial_share", "dram_share"):
        if not 0 <= getattr(launch, name) <= 1:
            raise ValueError(f"{launch.kernel}: {name} {getattr(launch, name)} outside [0, 1]")
    if launch.loop.bytes > 0 and launch.bytes_in_flight <= 0:
        raise ValueError(f"{launch.kernel}: a loop that loads bytes needs bytes_in_flight > 0")
    if launch.program_iterations is not None and len(launch.program_iterations) != launch.programs:
        raise ValueError(f"{launch.kernel}: {len(launch.program_iterations)} program_iterations for "
                         f"{launch.programs} programs")
    if launch.dram_bytes < launch.useful_bytes:
        raise ValueError(f"{launch.kernel}: dram_bytes {launch.dram_bytes:.3g} < useful_bytes "
                         f"{launch.useful_bytes:.3g} (every useful byte is read at least once)")


def wave_stream(loop: LoopMix, launch: KernelLaunch, target: Target) -> float:
    """Seconds one wave needs for one iteration on its own: its non-matrix instructions at one per
    ``wave_issue_interval`` cycles (or the launch's ``stream_cycles``, read from the assembly), plus its share of the iteration's matrix work at one port's
    matrix rate (a wave waits for its own matrix results: the softmax needs QK^T, P.V needs P); with
    ``lockstep_matrix`` the shares of all the program's waves on its port."""
    clock = target.clock_hz
    plain = sum(n for c, n in loop.instructions.items() if c not in target.matrix_rate)
    port_rate = target.matrix_peak / (target.units * target.ports_per_unit)
    # a wave's share of the program's matrix work on its port; in lockstep the program's waves on
    # one port wait for each other's share on that port's matrix unit
    sharers = (max(1.0, launch.waves_per_program / target.ports_per_unit) if launch.lockstep_matrix else 1.0)
    matrix = sum(sharers * f / launch.waves_per_program / (port_rate * target.matrix_rate[c])
                 for c, f in loop.matrix_flops.items())
    cycles = launch.stream_cycles if launch.stream_cycles is not None else plain * target.wave_issue_interval
    return cycles / clock + matrix


def issue_pipes(launch: KernelLaunch, target: Target) -> dict[str, float]:
    """Seconds per pipe (instruction class), plus "dispatch" and "wave_stream", of the issue bound
    (see the module docstring)."""
    loop, clock = launch.loop, target.clock_hz
    resident = min(launch.programs, target.units * launch.resident_per_unit)
    ports = min(target.units * target.ports_per_unit, resident * launch.waves_per_program)
    wave_iterations = launch.programs * launch.waves_per_program * launch.iterations
    per_port = wave_iterations / ports
    pipes = {c: per_port * n * target.pipe_cycles[c] / clock
             for c, n in loop.instructions.items() if c not in target.matrix_rate and n}
    port = target.matrix_issue_port
    matrix_issues = sum(n for c, n in loop.instructions.items() if c in target.matrix_rate)
    if port and matrix_issues:
        pipes[port] = pipes.get(port, 0.0) + per_port * matrix_issues * target.pipe_cycles[port] / clock
    share = ports / (target.units * target.ports_per_unit)
    for c, flops in loop.matrix_flops.items():
        if flops:
            rate = target.matrix_peak * target.matrix_rate[c] * share
            pipes[c] = pipes.get(c, 0.0) + launch.programs * launch.iterations * flops / rate
    total = sum(loop.instructions.values())
    pipes["dispatch"] = per_port * total / target.dispatch_per_cycle / clock
    pipes["wave_stream"] = launch.programs * launch.iterations * wave_stream(loop, launch, target) / resident
    return pipes


def shared_wavefronts(addresses: list[int | None], width: int, banks: int = 32, bank_bytes: int = 4) -> int:
    """Wavefronts (passes through the banks) one shared-memory / LDS instruction needs, from the byte
    address each lane accesses (None: the lane is inactive) and the access width in bytes.

    A pass serves one ``bank_bytes`` word per bank; lanes that read the same word share it (a
    broadcast). Accesses wider than a bank word are split into phases of ``banks x bank_bytes /
    width`` consecutive lanes (NVIDIA: half-warps for 8-byte, quarter-warps for 16-byte accesses),
    each phase needing as many passes as the most distinct words any one bank holds for it. Sub-word
    accesses (1 or 2 bytes) touch the word that holds them."""
    if width <= 0 or banks <= 0 or bank_bytes <= 0:
        raise ValueError("width, banks and bank_bytes must be positive")
    per_phase = max(1, banks * bank_bytes // max(width, bank_bytes))
    total = 0
    for start in range(0, len(addresses), per_phase):
        words: dict[int, set[int]] = {}
        for address in addresses[start:start + per_phase]:
            if address is None:
                continue
            first, last = address // bank_bytes, (address + width - 1) // bank_bytes
            for word in range(first, last + 1):
                words.setdefault(word % banks, set()).add(word)
        total += max((len(w) for w in words.values()), default=0)
    return total


def shared_seconds(launch: KernelLaunch, target: Target) -> float:
    """The shared bound (seconds): the busiest unit's programs' wavefronts at the unit's rate."""
    if not launch.shared_wavefronts:
        return 0.0
    per_unit = math.ceil(launch.programs / target.units) * launch.iterations * launch.shared_wavefronts
    return per_unit / (target.shared_wavefronts_per_cycle * target.clock_hz)


def list_schedule(durations: list[float], slots: int) -> float:
    """When the last of ``slots`` slots finishes, each taking the next duration in order as it frees."""
    free = [0.0] * max(1, min(slots, len(durations)))
    for d in durations:
        heapq.heapreplace(free, free[0] + d)
    return max(free)


def grid_seconds(launch: KernelLaunch, slots: int, per_iteration: float) -> float:
    """The grid bound's working programs (see the module docstring): list-scheduled from
    ``program_iterations`` where the launch gives them, else ceil(programs / slots) x one program."""
    if launch.program_iterations:
        return list_schedule([launch.prologue_s + n * per_iteration for n in launch.program_iterations], slots)
    return math.ceil(launch.programs / slots) * (launch.prologue_s + launch.iterations * per_iteration)


def estimate(launch: KernelLaunch, target: Target) -> Estimate:
    """The four bounds of ``launch`` on ``target``, the slowest named, and the fraction of the
    case's floor (see the module docstring). Raises ValueError on inconsistent inputs (classes the
    target does not know, fewer DRAM bytes than useful bytes, a fraction above 1)."""
    _check(launch, target)
    loop, clock = launch.loop, target.clock_hz
    slots = target.units * launch.resident_per_unit
    resident = min(launch.programs, slots)
    second = launch.second_launch_bytes / target.bandwidth + target.launch_gap_s if launch.second_launch_bytes else 0.0

    pipes = issue_pipes(launch, target)
    stream = wave_stream(loop, launch, target)
    round_trip = launch.dram_share * target.latency_s + (1 - launch.dram_share) * target.cache_latency_s
    wait = round_trip * loop.bytes / launch.bytes_in_flight if loop.bytes else 0.0
    # one program's iteration, alone: its loads' round trip, then the part of its waves' stream
    # that issues with no load outstanding
    per_iteration = max(stream, wait + launch.serial_share * stream)
    # exiting programs hold slots (resident ones side by side) without loop work
    exits = launch.exiting_programs * launch.exit_s
    work = launch.programs * launch.iterations * (wait + launch.serial_share * stream)
    latency = max(work / resident, (work + exits) / slots)
    bounds = {
        "memory": launch.dram_bytes / target.bandwidth + second,
        "issue": max(pipes.values()) + second,
        "latency": latency + second,
        "grid": grid_seconds(launch, slots, per_iteration) + exits / slots + second,
        "shared": shared_seconds(launch, target) + second,
        "l2": (launch.l2_bytes / target.l2_bandwidth if launch.l2_bytes and target.l2_bandwidth else 0.0) + second,
    }
    time_s = max(bounds.values())
    bound = next(b for b in BOUNDS if bounds[b] >= time_s * (1 - 1e-9))
    if launch.case == "decode":
        floor, against = launch.useful_bytes / target.bandwidth, "memory floor"
    else:
        floor, against = launch.useful_flops / target.matrix_peak, "matrix peak"
    fraction = floor / time_s if time_s > 0 else 0.0
    if fraction > 1 + 1e-9:
        raise ValueError(f"{launch.kernel} on {target.name}: estimate {time_s:.3g} s below the {against} "
                         f"{floor:.3g} s -- the launch's counts are inconsistent with its case")
    return Estimate(launch.kernel, target.arch, launch.case, bounds, bound, time_s, floor, against, fraction,
                    pipes, resident, second, launch.notes)


# ------------------------------------------------------------------------------------------ targets
_CDNA_PIPES = {
    # wave64 on a 16-lane SIMD: 4 cycles per VALU instruction; the scalar unit and the issue slot
    # come round to a SIMD once per 4 cycles; LDS: 128 B/cycle per CU shared by 4 SIMDs, so a
    # 32-bit-per-lane access (256 B) holds it 2 CU cycles = 8 SIMD-cycles (wider accesses are
    # counted as multiples by the adapters where the width is known); VMEM: one instruction's 64
    # addresses at 16 per cycle.
    "valu": 4, "salu": 4, "lds": 8, "vmem": 4, "branch": 4,
}
_CDNA_ISSUE = ("CDNA issue (AMD CDNA3 ISA / instinct docs): each SIMD gets an issue slot every 4 cycles and "
               "then issues up to one instruction per category (VALU, SALU, VMEM, LDS, branch; an MFMA issues "
               "through the VALU port) from different waves; one wave issues at most one instruction per slot; MFMA "
               "of one wave runs while VALU of other waves issues.")
_NVIDIA_PIPES = {
    # per SM sub-partition (SMSP), per warp instruction: 32 FP32 lanes (1 cycle), MUFU 4 lanes per
    # SMSP (8 cycles); shared memory 128 B/cycle per SM shared by 4 SMSPs (a 32-bit warp access =
    # 1 SM cycle = 4 SMSP-cycles); LSU address path likewise 4 SMSP-cycles per global instruction.
    "alu": 1, "sfu": 8, "lds": 4, "ldg": 4, "branch": 1,
}
_XE_PIPES = {
    # per XVE, per SIMD16 instruction equivalent (adapters scale SIMD32 counts by 2): "alu" FPU/INT,
    # "math" extended-math pipe (transcendentals, 1/4 rate), "send" memory messages (issue only;
    # their bytes are the memory / latency bounds' business), "branch" control flow.
    "alu": 1, "math": 4, "send": 1, "branch": 1,
}

TARGETS: dict[str, Target] = {t.arch: t for t in (
    Target(
        name="H100 SXM", arch="sm_90", vendor="nvidia", units=132, ports_per_unit=4, clock_hz=1.83e9,
        peak_bandwidth=3.35e12, dram_efficiency=0.90,
        dram_efficiency_source="device-to-device copy measured at ~3.0 TB/s counting read + write bytes "
                               "(figure the project's GPU evidence plan cites for H100 SXM; not re-measured here)",
        matrix_peak=989.4e12, latency_s=650e-9,
        latency_source="assumption: loaded HBM3 latency (pointer-chase figures are ~500 ns; queues add more); "
                       "a hit in the 50 MB L2: also an assumption",
        cache_latency_s=300e-9,
        pipe_cycles=_NVIDIA_PIPES, matrix_rate={"wgmma": 1.0, "mma": 0.6}, dispatch_per_cycle=1.0,
        wave_issue_interval=1.0,
        sources="NVIDIA H100 datasheet: 132 SMs, 3.35 TB/s, 989.4 TFLOP/s dense bf16 (1.83 GHz boost); one warp "
                "instruction per SMSP per cycle; mma.sync at 0.6 of wgmma's rate is an assumption"),
    Target(
        name="A100 SXM 40GB", arch="sm_80", vendor="nvidia", units=108, ports_per_unit=4, clock_hz=1.41e9,
        peak_bandwidth=1.555e12, dram_efficiency=0.846,
        dram_efficiency_source="GPUInspector.jl data-bandwidth example on a DGX A100: memcpy 1225 GiB/s of a "
                               "1448 GiB/s theoretical peak "
                               "(pc2.github.io/GPUInspector.jl/dev/examples/data_bandwidth)",
        matrix_peak=312e12, latency_s=600e-9,
        latency_source="assumption: loaded HBM2 latency; a hit in the 40 MB L2: also an assumption",
        cache_latency_s=300e-9,
        pipe_cycles=dict(_NVIDIA_PIPES, sfu=8), matrix_rate={"mma": 1.0}, dispatch_per_cycle=1.0,
        wave_issue_interval=1.0,
        sources="NVIDIA A100 datasheet: 108 SMs, 1.555 TB/s (40 GB), 312 TFLOP/s dense bf16 at 1.41 GHz"),
    Target(
        name="MI300X", arch="gfx942", vendor="amd", units=304, ports_per_unit=4, clock_hz=2.1e9,
        peak_bandwidth=5.3e12, dram_efficiency=0.80,
        dram_efficiency_source="assumption: 80 % of peak for a streaming copy; the one public copy measurement "
                               "found (ScalarLM's MI300X memcpy blog) plateaus at 2.0-3.0 TB/s without saying "
                               "whether it counts read and write bytes",
        matrix_peak=1307.4e12, latency_s=800e-9,
        latency_source="assumption: loaded HBM3 latency behind the 256 MB Infinity Cache; "
                       "a hit in the Infinity Cache: also an assumption",
        cache_latency_s=350e-9,
        pipe_cycles=_CDNA_PIPES, matrix_rate={"mfma": 1.0}, dispatch_per_cycle=1.25, wave_issue_interval=4.0,
        matrix_issue_port="valu",
        sources="AMD MI300X datasheet: 304 CUs, 2.1 GHz, 5.3 TB/s, 1307.4 TFLOP/s dense bf16. " + _CDNA_ISSUE),
    Target(
        name="MI250X (one GCD)", arch="gfx90a", vendor="amd", units=110, ports_per_unit=4, clock_hz=1.7e9,
        peak_bandwidth=1.6384e12, dram_efficiency=0.80,
        dram_efficiency_source="assumption: 80 % of peak for a streaming copy on one GCD",
        matrix_peak=191.5e12, latency_s=750e-9,
        latency_source="assumption: loaded HBM2e latency; a hit in the 8 MB L2: also an assumption",
        cache_latency_s=300e-9,
        pipe_cycles=_CDNA_PIPES, matrix_rate={"mfma": 1.0}, dispatch_per_cycle=1.25, wave_issue_interval=4.0,
        matrix_issue_port="valu",
        sources="AMD MI250X datasheet halved (one GCD, the device ROCm exposes): 110 CUs, 1.7 GHz, 1.64 TB/s, "
                "191.5 TFLOP/s dense bf16. " + _CDNA_ISSUE),
    Target(
        name="Max 1550", arch="pvc", vendor="intel", units=128, ports_per_unit=8, clock_hz=1.6e9,
        peak_bandwidth=3.2768e12, dram_efficiency=0.61,
        dram_efficiency_source="ALCF Aurora node performance overview: STREAM triad 1 TB/s per tile, 12 TB/s per "
                               "node of 6 Max 1550 = 2.0 TB/s per GPU of 3.28 TB/s peak "
                               "(docs.alcf.anl.gov/aurora/node-performance-overview)",
        matrix_peak=838.9e12, latency_s=1.0e-6,
        latency_source="assumption: loaded HBM2e latency across the stack's L2 / base tile; "
                       "a hit in the stack L2: also an assumption",
        cache_latency_s=400e-9,
        pipe_cycles=_XE_PIPES, matrix_rate={"dpas": 1.0}, dispatch_per_cycle=2.0, wave_issue_interval=1.0,
        sources="Intel Max 1550: 128 Xe-cores x 8 XVEs, 1.6 GHz, 3.2768 TB/s, 838.9 TFLOP/s bf16 XMX; "
                "an XVE's FPU is 16 fp32 lanes; dispatch of 2 instructions per XVE cycle (ALU + send / math "
                "from different threads) is an assumption"),
    Target(
        name="Arc A770", arch="acm-g10", vendor="intel", units=32, ports_per_unit=16, clock_hz=2.1e9,
        peak_bandwidth=560e9, dram_efficiency=0.80,
        dram_efficiency_source="assumption: 80 % of peak for a streaming copy on GDDR6",
        matrix_peak=137.6e12, latency_s=700e-9,
        latency_source="assumption: loaded GDDR6 latency; a hit in the 16 MB L2: also an assumption",
        cache_latency_s=300e-9,
        pipe_cycles=dict(_XE_PIPES, alu=2), matrix_rate={"dpas": 1.0}, dispatch_per_cycle=2.0,
        wave_issue_interval=1.0,
        sources="Intel Arc A770: 32 Xe-cores x 16 XVEs, 2.1 GHz, 560 GB/s; XVE FPU 8 fp32 lanes (a SIMD16 "
                "instruction takes 2 cycles); matrix peak derived from 128 bf16 XMX flops per XVE per cycle "
                "(an assumption: 137.6 TFLOP/s)"),
)}


# ------------------------------------------------------------------------------------ measured devices
#: device_check.json's ceilings on the H200 (docs/performance.md, "Measured on a GPU"): a 1024 MiB
#: device-to-device copy at 4244 GB/s counting read + write bytes, a dense bf16 8192^3 matmul at 702 TFLOP/s
H200_COPY_BYTES_PER_S = 4244e9
H200_MATMUL_FLOPS = 702e12

H200 = replace(   # the H100 SXM's GH100 (SMs, clock, pipes, latencies) with the H200's memory and ceilings
    TARGETS["sm_90"], name="H200",
    peak_bandwidth=4.8e12, dram_efficiency=H200_COPY_BYTES_PER_S / 4.8e12,
    dram_efficiency_source="measured: device-to-device copy 4244 GB/s (read + write bytes of 1024 MiB) on the "
                           "H200 of docs/data/device_check.json = 0.884 of the 4.8 TB/s peak",
    latency_source="assumption: loaded HBM3e latency as the H100's (650 ns); a hit in the 50 MB L2: 300 ns, "
                   "also an assumption",
    matrix_rate={"wgmma": H200_MATMUL_FLOPS / 989.4e12, "mma": 0.6},
    shared_banks=32, shared_bank_bytes=4, shared_wavefronts_per_cycle=1.0,
    l2_bandwidth=5.5e12,
    l2_source="assumption: 5.5 TB/s, of the order of published H100 L2 bandwidth microbenchmarks (Chips and "
              "Cheese, 'Nvidia's H100: Funny L2, and Tons of Bandwidth', 2023, measured on an H100 PCIe); "
              "not measured on the H200",
    measured=True,
    sources="NVIDIA H200 datasheet: 132 SMs (GH100, as H100 SXM), 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16 "
            "(1,979 with sparsity); clock 1.83 GHz = the clock that bf16 figure implies (132 SMs x 4096 flops "
            "per SM and cycle), an assumption for every kernel; wgmma at 0.71 of the spec = the measured 702 "
            "TFLOP/s matmul of the same run; mma.sync at 0.6: an assumption (as H100); shared memory: 32 banks "
            "of 4 bytes, one wavefront per SM and cycle (CUDA C++ Programming Guide, compute capability 9.0)",
)

#: devices that have measured kvmulti's kernels, by name: the model's rows for them carry a calibration
#: error against the measurement (devtools/roofline_calibration.py)
MEASURED_TARGETS: dict[str, Target] = {"h200": H200}
