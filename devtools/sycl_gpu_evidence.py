"""Intel GPU compile evidence for the SYCL kernels, on a host without an Intel GPU.

Pipeline (each step is a public tool, nothing is emulated):

1. The SPIR-V of ``sycl/kernels.cpp`` for one build configuration is taken from the SYCL runtime
   itself: a child process builds the kernels through the project's shim (the oneAPI
   kernel_compiler, as at run time) with ``SYCL_DUMP_IMAGES=1``, which makes the runtime write every
   device image it creates (``sycl_spir64*.spv``) into the working directory. The image holding
   ``__sycl_kernel_kvm_paged_attention`` is ours.
2. Debian 12's ``ocloc`` (package ``intel-opencl-icd`` 22.43.24595.41, IGC 1.0.12504) compiles that
   SPIR-V for Intel GPU targets (``acm-g10`` = DG2 / Arc A770, ``pvc`` = Data Center GPU Max) with
   ``IGC_ShaderDumpEnable=1``, which writes IGC's final assembly per kernel.
3. The assembly headers and instructions give, per kernel: SIMD width (file name ``simdN``), register
   file size (``//.thread_config numGRF=``), spill bytes (``//.spill size``), global load messages
   (LSC ``load.ugm.*``: bytes per lane x lanes, or the whole block for transposed ``*t`` loads) and
   the number of ``dpas`` (XMX) instructions.

:func:`report_rows` returns one dict per (kernel, target) with the keys
``kernel, target, regs_or_grf_mode, spills, slm_bytes, simd_width, matrix_instructions,
load_widths_bytes, notes, hot_loop_instructions, hot_loop_load_bytes, hot_loop_bytes_in_flight,
hot_loop_dpas_flops`` (the key loop per thread, :func:`hot_loop_mix`). Results are cached in
``<kvmulti cache>/sycl/gpu_evidence/`` by the hash of the kernel source, the build options, the
ocloc binary and the row keys (a cold run takes a minute or two).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TARGETS = ("acm-g10", "pvc")
#: Kernel builds (SPIR-V flavours) by name: kernel_options(matrix_sg16=, gpu=) and whether
#: -DKVM_LARGE_GRF=1 stays in. "mma": KVM_MMA=2 with the kernel property grf_size<256> (what a PVC
#: gets; the property travels in the SPIR-V, so IGC compiles it at 256 GRF with no ocloc option);
#: "mma-128": the same without the property; "vector": KVM_MMA=0 (what a GPU without the built-ins
#: such as DG2 gets); "emulated": KVM_MMA=1 (what the OpenCL CPU device runs).
FLAVOURS = {"mma": (True, True, True), "mma-128": (True, True, False), "vector": (False, True, False),
            "emulated": (False, False, False)}
#: How each target row is built, as the backend ships it on that device: (flavour, ocloc -options).
#: DG2 has the matrix unit at sub-group size 8 only (no matrix_sg16): the vector path at 128 GRF.
SHIPPED = {"acm-g10": ("vector", ""), "pvc": ("mma", "")}
#: Other modes, reported as rows of their own: (row name, ocloc device, flavour, ocloc -options).
VARIANTS = (("pvc-128grf", "pvc", "mma-128", ""),
            ("pvc-vector-large-grf", "pvc", "vector", "-ze-opt-large-register-file"),
            ("pvc-emulated", "pvc", "emulated", "-ze-opt-large-register-file"))
#: The decode case of sycl/README.md's paper model: bf16, head size 128.
DEFAULT_CONFIG = {"dtype": "bfloat16", "head_size": 128, "head_size_v": 128}
#: The same case over an fp8 e4m3fn cache (kernels.cpp built with KVM_CACHE=3; bf16 activations).
FP8_CONFIG = dict(DEFAULT_CONFIG, cache_dtype="float8_e4m3fn")
#: kvm_paged_attention_terms (ALiBi / non-causal) is built with -DKVM_TERMS=1, as the backend builds it
KERNELS = ("kvm_paged_attention", "kvm_paged_attention_terms", "kvm_paged_prefill", "kvm_paged_prefill_terms",
           "kvm_split_reduce", "kvm_write_kv")
KEYS = ("kernel", "target", "regs_or_grf_mode", "spills", "slm_bytes", "simd_width", "matrix_instructions",
        "load_widths_bytes", "notes", "hot_loop_instructions", "hot_loop_load_bytes", "hot_loop_bytes_in_flight",
        "hot_loop_dpas_flops")


class EvidenceUnavailable(RuntimeError):
    """A tool of the pipeline is missing or failed; the message says which and why."""


def ocloc() -> str:
    path = shutil.which("ocloc")
    if path is None:
        raise EvidenceUnavailable("ocloc not found: apt-get install intel-opencl-icd (Debian 12 ships ocloc with "
                                  "IGC 1.0.12504); scripts/setup.sh --test installs it where it runs as root")
    return path


def _options(config: dict, flavour: str = "emulated") -> list[str]:
    import torch

    from kvmulti.backends import sycl as S
    dtype = getattr(torch, config["dtype"])
    cache = getattr(torch, config["cache_dtype"]) if config.get("cache_dtype") else None
    matrix_sg16, gpu, large_grf = FLAVOURS[flavour]
    opts = S.kernel_options(dtype, config["head_size"], config["head_size_v"], S.WG, cache_dtype=cache, terms=True,
                            matrix_sg16=matrix_sg16, gpu=gpu)
    return [o for o in opts if large_grf or o != "-DKVM_LARGE_GRF=1"]


def dump_spirv(config: dict, out_dir: Path, flavour: str = "emulated", timeout: int = 900) -> list[Path]:
    """Build the kernels for ``config`` as :data:`FLAVOURS` ``flavour`` in a child
    process with SYCL_DUMP_IMAGES=1; the SPIR-V images holding our kernels (the runtime splits them
    over several images), copied to ``out_dir``. The images are written before the device build,
    which is not needed: SYCL_PROGRAM_COMPILE_OPTIONS gives it a GPU-only option that the OpenCL CPU
    device rejects at once (it also could not finish a matrix_sg16 flavour: the built-ins exist on
    Intel GPUs only), so a failed build with the images present is the expected outcome."""
    work = Path(tempfile.mkdtemp(prefix="kvm-spv-"))
    code = ("import sys, json; from kvmulti.backends import sycl as S; from kvmulti.backends.sycl import runtime\n"
            "S.default_session().build(S.kernel_source(), json.loads(sys.argv[1]), runtime.KERNEL_NAMES)\n")
    import kvmulti
    here = str(Path(kvmulti.__file__).resolve().parents[1])   # the child imports the parent's kvmulti
    env = {**os.environ, "SYCL_DUMP_IMAGES": "1", "SYCL_CACHE_PERSISTENT": "0",
           "SYCL_PROGRAM_COMPILE_OPTIONS": "-ze-opt-large-register-file",
           "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    try:
        res = subprocess.run([sys.executable, "-c", code, json.dumps(_options(config, flavour))], cwd=work,
                             env=env, capture_output=True, text=True, timeout=timeout)
        images = sorted(p for p in work.glob("*.spv") if b"__sycl_kernel_kvm_" in p.read_bytes())
        if res.returncode != 0 and not images:
            raise EvidenceUnavailable(f"building the kernels with SYCL_DUMP_IMAGES=1 failed:\n{res.stderr[-3000:]}")
        if not any(b"__sycl_kernel_kvm_paged_attention" in p.read_bytes() for p in images):
            raise EvidenceUnavailable(f"SYCL_DUMP_IMAGES=1 wrote no image with our kernels in {work} "
                                      f"(files: {sorted(p.name for p in work.iterdir())})")
        out_dir.mkdir(parents=True, exist_ok=True)
        copies = []
        for i, image in enumerate(images):
            copies.append(out_dir / f"kernels-{flavour}-{i}.spv")
            shutil.copyfile(image, copies[-1])
        return copies
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compile_spirv(spv: Path, target: str, out_dir: Path, options: str = "") -> tuple[str, dict[str, str]]:
    """``ocloc compile -spirv_input`` for ``target`` with IGC's shader dumps; (ocloc output, {asm file
    name: text}). Raises EvidenceUnavailable (with ocloc's output) when ocloc fails."""
    dump = out_dir / f"igc-{spv.stem}-{target}{'-' + str(abs(hash(options))) if options else ''}"
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    env = {**os.environ, "IGC_ShaderDumpEnable": "1", "IGC_DumpToCustomDir": str(dump)}
    cmd = [ocloc(), "compile", "-spirv_input", "-file", str(spv), "-device", target, "-output",
           str(out_dir / f"{spv.stem}-{target}"), "-output_no_suffix"]
    if options:
        cmd += ["-options", options]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    log = res.stdout + res.stderr
    if res.returncode != 0 or "Build succeeded" not in log:
        raise EvidenceUnavailable(f"ocloc could not compile our SPIR-V for {target} (rc {res.returncode}):\n{log}")
    asm = {p.name: p.read_text(errors="replace") for p in sorted(dump.glob("*.asm"), key=lambda p: p.stat().st_mtime)}
    return log, asm


_LSC_LOAD = re.compile(r"\bload\.ugm\.(d\d+)(?:u32)?(?:x(\d+))?(t?)\S*\s+\((\d+)\|M\d+\)")


#: a 2D block load (``load_block2d.ugm``) and the registers it writes (``rN:count``)
_BLOCK2D_LOAD = re.compile(r"\bload_block2d\.ugm\.\S+\s+\(\d+\|M\d+\)\s+r\d+:(\d+)")
#: bytes of a PVC general register (the only target the kernels use 2D block loads on)
GRF_BYTES = 64


def load_message_bytes(asm: str) -> dict[int, int]:
    """{bytes per global load message: count} over the LSC ``load.ugm`` and ``load_block2d.ugm``
    instructions of ``asm``.

    A ``dNxM`` load reads M elements of N bits per lane (x the execution size); a transposed
    ``dNxMt`` load (a block load) reads M elements once for the whole message; a 2D block load
    returns the registers it writes (``rN:count`` x :data:`GRF_BYTES`). An LSC prefetch (a load into
    ``null``) counts as a load of its data size (4 bytes per lane for ``d32`` and ``d8u32`` alike; it
    fills whole cache lines, so this undercounts the traffic it starts)."""
    out: dict[int, int] = {}
    for m in _LSC_LOAD.finditer(asm):
        bits, vec, transposed, lanes = int(m.group(1)[1:]), int(m.group(2) or 1), m.group(3) == "t", int(m.group(4))
        elem = 4 if bits >= 32 and bits != 64 else (8 if bits == 64 else 4)   # d8/d16 travel as u32 per lane
        per_lane = elem * vec
        nbytes = per_lane if transposed else per_lane * lanes
        out[nbytes] = out.get(nbytes, 0) + 1
    for m in _BLOCK2D_LOAD.finditer(asm):
        nbytes = int(m.group(1)) * GRF_BYTES
        out[nbytes] = out.get(nbytes, 0) + 1
    return out


_LABEL = re.compile(r"^(_\w+|L\d+):")
_BRANCH = re.compile(r"\b(?:jmpi|goto|while|brd|brc)\b(?:\s+\(\d+\|M\d+\))?\s+(_\w+|L\d+)")
_INSTRUCTION = re.compile(r"^\s*(?:\([~\w.&|]+\)\s*)?([a-z][a-z0-9_]*)(?:\.[\w.()&|~]+)?\s*(?:\((\d+)\|M\d+\))?")
_BRANCH_OPS = {"jmpi", "goto", "join", "while", "if", "else", "endif", "brd", "brc", "call", "ret", "sync", "halt"}
_DPAS = re.compile(r"\bdpasw?\.(\d+)x(\d+)\s+\((\d+)\|M\d+\)")
_SEND_OPS = {"load", "store", "send", "sends", "sendc", "sendsc", "atomic", "fence", "lsc_load", "lsc_store",
             "load_block2d", "store_block2d"}


_SWSB = re.compile(r"\{([^}]*)\}")
_TOKEN = re.compile(r"\$(\d+)(\.dst|\.src)?")


def peak_load_bytes_in_flight(lines: list[str]) -> int:
    """Peak global-load bytes one thread has outstanding in a loop body, in steady state (the body
    replayed twice), from IGC's software scoreboard: a ``load.ugm`` message allocates the SBID token
    in its ``{...}`` annotation; an instruction annotated with that token (``$N`` or ``$N.dst``), or
    a ``sync.allwr`` listing it, waits for the load, which is then no longer in flight. A prefetch,
    which nothing waits for, stays in flight until its token is allocated again."""
    outstanding: dict[str, int] = {}
    peak = 0
    for trip in (0, 1):
        for line in lines:
            code = line.split("//")[0]
            load = load_message_bytes(code)
            notes = _SWSB.search(code)
            tokens = _TOKEN.findall(notes.group(1)) if notes else []
            if "sync.allwr" in code:
                tokens += [(t, "") for t in re.findall(r"\$(\d+)", code)]
            if load:
                for t, suffix in tokens:
                    if suffix == ".dst":
                        outstanding.pop(t, None)
                own = [t for t, suffix in tokens if not suffix]
                if own:
                    outstanding[own[-1]] = sum(n * c for n, c in load.items())
            else:
                for t, suffix in tokens:
                    if suffix != ".src":
                        outstanding.pop(t, None)
            if trip:
                peak = max(peak, sum(outstanding.values()))
    return peak


def dpas_flops(lines: list[str]) -> int:
    """Flops of the ``dpas.DxR (N|M0)`` instructions of ``lines`` with 16-bit operands: each is an
    R x N x 2D multiply-accumulate (systolic depth D of 2 bf16 / fp16 pairs, repeat count R rows,
    N = the execution size columns), 2 x R x N x 2D flops."""
    return sum(2 * int(r) * int(n) * 2 * int(d) for line in lines for d, r, n in _DPAS.findall(line))


def hot_loop_mix(text: str) -> tuple[dict[str, float], int, int, int]:
    """(instruction classes of the innermost loop with the most global load messages, its global
    load bytes per trip, its peak load bytes in flight (:func:`peak_load_bytes_in_flight`), its
    dpas flops (:func:`dpas_flops`)) of one IGC assembly dump, per thread; ({}, 0, 0, 0) without
    such a loop. Classes are those of
    the roofline model's Intel targets (devtools/roofline.py), counted in SIMD16-instruction
    equivalents: ``alu`` (an instruction of execution size 32 counts 2), ``math`` (extended math),
    ``send`` (memory messages), ``branch`` (control flow and ``sync``), ``dpas``. A loop is the
    lines from a label to a later branch back to it; innermost: it holds no other loop. Among loops
    with equally many load bytes the one with the fewest instructions is taken: a key loop split
    FlashAttention-style runs its masked copies for the few steps at a causal or window edge and the
    unmasked copy for the rest (kvm_paged_prefill; an assumption stated with the estimates)."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := _BRANCH.search(line)) and labels.get(m.group(1), i) < i]
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    best: tuple[dict[str, float], int, int, int] = ({}, 0, 0, 0)
    rank = (0, 0.0)
    for a, b in innermost:
        body = "\n".join(lines[a:b + 1])
        loads = load_message_bytes(body)
        mix: dict[str, float] = {}
        for line in lines[a:b + 1]:
            m = _INSTRUCTION.match(line)
            if not m or line.lstrip().startswith("//") or _LABEL.match(line) or m.group(1) == "nop":
                continue
            op, width = m.group(1), int(m.group(2) or 1)
            cls = ("send" if op in _SEND_OPS else "branch" if op in _BRANCH_OPS else "math" if op == "math"
                   else "dpas" if op.startswith("dpas") else "alu")
            mix[cls] = mix.get(cls, 0) + (max(1, width // 16) if cls == "alu" else 1)
        if sum(loads.values()) == 0 or (sum(loads.values()), -sum(mix.values())) <= rank:
            continue
        rank = (sum(loads.values()), -sum(mix.values()))
        best = (mix, sum(n * count for n, count in loads.items()), peak_load_bytes_in_flight(lines[a:b + 1]),
                dpas_flops(lines[a:b + 1]))
    return best


def parse_kernel_asm(name: str, text: str) -> dict:
    """SIMD width, GRF count, spill bytes, load messages and dpas count of one IGC assembly dump."""
    kernel = re.search(r"^//\.kernel\s+(\S+)", text, re.M)
    grf = re.search(r"numGRF=(\d+)", text)
    spill = re.search(r"^//\.spill size (\d+)", text, re.M)
    simd = re.search(r"simd(\d+)", name)
    return {
        "kernel": kernel.group(1).removeprefix("__sycl_kernel_") if kernel else name,
        "grf": int(grf.group(1)) if grf else None,
        "spill_bytes": int(spill.group(1)) if spill else 0,
        "simd_width": int(simd.group(1)) if simd else None,
        "loads": load_message_bytes(text),
        "slm_ops": len(re.findall(r"\b(?:load|store)\.slm\.", text)),
        "dpas": len(re.findall(r"\bdpas", text)),
        "barriers": text.count("signal barrier"),
        "hot_loop": hot_loop_mix(text),
    }


def rows_for_target(asm: dict[str, str], target: str, slm_bytes: dict[str, int]) -> list[dict]:
    """One report row per kernel; when IGC compiled a kernel twice (its spill retry), the last
    dump is the one kept, and the notes name the other attempt's spills."""
    parsed: dict[str, list[dict]] = {}
    for name, text in asm.items():
        info = parse_kernel_asm(name, text)
        parsed.setdefault(info["kernel"], []).append(info)
    rows = []
    for kernel in KERNELS:
        attempts = parsed.get(kernel)
        if not attempts:
            continue
        last = attempts[-1]
        notes = [f"global load messages {{bytes: count}} = {dict(sorted(last['loads'].items()))}",
                 f"SLM load/store instructions {last['slm_ops']}", f"barriers {last['barriers']}"]
        if len(attempts) > 1:
            notes.append("IGC retried the compile; spills per attempt: "
                         + ", ".join(str(a["spill_bytes"]) for a in attempts))
        rows.append({"kernel": kernel, "target": target, "regs_or_grf_mode": f"{last['grf']} GRF",
                     "spills": last["spill_bytes"], "slm_bytes": slm_bytes.get(kernel, 0),
                     "simd_width": last["simd_width"], "matrix_instructions": last["dpas"],
                     "load_widths_bytes": sorted(last["loads"]), "notes": "; ".join(notes),
                     "hot_loop_instructions": last["hot_loop"][0], "hot_loop_load_bytes": last["hot_loop"][1],
                     "hot_loop_bytes_in_flight": last["hot_loop"][2], "hot_loop_dpas_flops": last["hot_loop"][3]})
    return rows


def _slm_bytes(config: dict, matrix: bool) -> dict[str, int]:
    """Local memory the host gives the attention kernels of a matrix-body or vector-body build."""
    from kvmulti.backends import sycl as S
    sizes = {k: 4 * S.lm_floats(config["head_size_v"], S.WG, matrix, narrow=k.startswith("kvm_paged_attention"))
             for k in KERNELS if k.startswith("kvm_paged_")}
    sizes["kvm_paged_prefill"] = 4 * S.prefill_lm_floats(config["head_size"], config["head_size_v"], S.WG, matrix)
    return sizes


def _cache_file(config: dict) -> Path:
    from kvmulti import native_build
    from kvmulti.backends import sycl as S
    h = hashlib.sha256(S.kernel_source().encode())
    h.update(json.dumps([config, [_options(config, f) for f in FLAVOURS], SHIPPED, VARIANTS,
                         [_slm_bytes(config, m) for m in (False, True)]]).encode())
    h.update(Path(ocloc()).read_bytes()[:1 << 20])
    h.update(repr(KEYS).encode())           # rows of an older evidence format are recomputed
    return native_build.cache_root() / "sycl" / "gpu_evidence" / f"{h.hexdigest()[:16]}.json"


def report_rows(config: dict | None = None) -> list[dict]:
    """Per (kernel, target) compile facts of the SYCL kernels for Intel GPUs (see the module doc).

    Raises :class:`EvidenceUnavailable` when ocloc is missing, the SPIR-V cannot be obtained, or
    ocloc cannot compile it (the message carries ocloc's output)."""
    config = dict(config or DEFAULT_CONFIG)
    cached = _cache_file(config)
    if cached.exists():
        return json.loads(cached.read_text())
    with tempfile.TemporaryDirectory(prefix="kvm-gpu-evidence-") as tmp:
        out = Path(tmp)
        flavours = sorted({f for f, _ in SHIPPED.values()} | {v[2] for v in VARIANTS})
        images = {f: dump_spirv(config, out, f) for f in flavours}
        rows = []
        for name, device, flavour, options in [(t, t, *SHIPPED[t]) for t in TARGETS] + list(VARIANTS):
            asm: dict[str, str] = {}
            for spv in images[flavour]:
                asm.update({f"{spv.stem}/{k}": v for k, v in compile_spirv(spv, device, out, options)[1].items()})
            rows += rows_for_target(asm, name, _slm_bytes(config, flavour != "vector"))
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(rows, indent=1))
    return rows


def main() -> int:
    rows = report_rows()
    print("| " + " | ".join(KEYS) + " |")
    print("|" + "---|" * len(KEYS))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in KEYS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
