"""Building quickdraft's C kernel library (``native.py`` loads it): the compiler's commands, run side by side under
a time limit, into a cache keyed by the sources, the compiler, the flags and the CPU, a checksum recorded beside it.

The objects compile as many at a time as the process may use cores; ``qmatmul.c`` compiles in the parts its
``QD_PARTS`` names (its formats' kernels are most of the build), and the link refuses a kernel no object defines.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from quickdraft.models import iq_grids
from quickdraft.paths import cache_root

SOURCES = tuple(Path(__file__).with_name(name) for name in ("qmatmul.c", "cpu_ops.c", "attention.c", "layer.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("floats.h", "kv.h", "qformats.h", "tasks.h"))
# -ffp-contract=off: an auto-vectorized loop and its scalar prologue (whose length depends on the address) then
# round alike, so a row's result never depends on where its buffer lies
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# =avx2: no AVX-512 or AVX-VNNI, the code CPUs without them run (measured here); =avx512-novbmi: AVX-512 without its
# byte permutations (AVX512-VBMI), as on the CPUs with VNNI but not VBMI (Cascade Lake)
ISA_ENV = "QUICKDRAFT_KERNEL_ISA"
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f", "-mno-avxvnni"), "avx512-novbmi": ("-mno-avx512vbmi",)}
GENERATED_HEADER = "iq_grids.h"  # qformats.h's grid tables (iq_grids.c_header), written into the build directory
COMPILE_TIMEOUT_S = 300.0  # a compiler that hangs must not hang the first model load with it


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``); empty where they cannot be read."""
    try:
        return frozenset(next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                              if ln.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration, IndexError):
        return frozenset()


def _cpu_identity() -> str:
    """Model name and feature flags: a library built with -march=native is only reused on the same CPU type."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(keep)
    except OSError:
        return platform.processor()


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run the compiler in its own process group with a time limit; on timeout (or interrupt) the whole group is
    killed (the driver's cc1/as/ld children too, which would otherwise keep its pipes open)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=COMPILE_TIMEOUT_S)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL) if hasattr(os, "killpg") else proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_all(cmds: list[list[str]]) -> subprocess.CompletedProcess | None:
    """Run ``cmds`` as ``run`` does, as many at a time as this process may use cores; after a command fails or
    times out none starts. Returns the first failed command's result, or None; a timeout is raised once the commands
    running beside it have ended."""
    stop = threading.Event()

    def one(cmd: list[str]) -> subprocess.CompletedProcess | None:
        if stop.is_set():
            return None
        try:
            proc = run(cmd)
        except BaseException:
            stop.set()
            raise
        if proc.returncode != 0:
            stop.set()
        return proc

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=min(cores, len(cmds))) as pool:
        try:
            done = list(pool.map(one, cmds))
        except BaseException:
            stop.set()
            raise
    return next((proc for proc in done if proc is not None and proc.returncode != 0), None)


def _compile_commands(compiler: str, build_dir: Path, out: Path) -> tuple[list[list[str]], list[str]]:
    """The commands that compile the objects (each source whole, or once per part where it defines ``QD_PARTS``)
    and the command that links them into ``out``; ``-z defs``: a kernel missing from every object fails the link,
    not the load."""
    flags = (*build_flags(), "-I", str(build_dir))  # the grid tables' header, written beside the objects
    objects, compiles = [], []
    for source in SOURCES:
        parts = re.search(r"^#define QD_PARTS (\d+)$", source.read_text(), re.MULTILINE)
        for part in range(int(parts.group(1)) + 1) if parts else [None]:
            obj = build_dir / (source.stem + ("" if part is None else f"-{part}") + ".o")
            defines = [] if part is None else [f"-DQD_PART={part}"]
            compiles.append([compiler, *flags, *defines, "-c", "-o", str(obj), str(source)])
            objects.append(str(obj))
    return compiles, [compiler, *flags, "-Wl,-z,defs", "-o", str(out), *objects, "-lm"]


def build_flags() -> tuple[str, ...]:
    """``FLAGS`` and those of ``QUICKDRAFT_KERNEL_ISA`` (``native``, the default, ``avx2`` or ``avx512-novbmi``)."""
    isa = os.environ.get(ISA_ENV, "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={isa!r}: must be one of {', '.join(ISA_FLAGS)}")
    return FLAGS + ISA_FLAGS[isa]


def library_path(compiler: str) -> Path:
    """Where the library built from these sources, by this compiler, for this CPU type is cached."""
    version = run([compiler, "--version"])
    if version.returncode != 0:
        raise RuntimeError(f"{compiler} --version failed: {version.stderr.strip()[-400:]}")
    key = "\n".join([*(s.read_text() for s in SOURCES + HEADERS), iq_grids.c_header(), compiler, version.stdout,
                     " ".join(build_flags()), _cpu_identity()])
    return cache_root() / "kernels" / f"quickdraft-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def checksum_path(target: Path) -> Path:
    return target.with_name(target.stem + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compile_library(compiler: str, target: Path) -> None:
    """Build into a fresh private directory beside ``target`` (mode 0700, random name: nobody can plant or read a
    file there), record the library's checksum, and rename both into place: concurrent builders and loaders never
    see half a file, and a library damaged later on disk is recognised before it is mapped."""
    target.parent.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        out = build_dir / target.name
        (build_dir / GENERATED_HEADER).write_text(iq_grids.c_header())
        compiles, link = _compile_commands(compiler, build_dir, out)
        proc = run_all(compiles) or run(link)  # (the first failed compile's result, or the link's)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-400:]}")
        checksum = build_dir / "checksum"
        checksum.write_text(_sha256(out))
        os.replace(checksum, checksum_path(target))
        os.replace(out, target)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def damage(target: Path) -> str | None:
    """Why the cached library must not be mapped (dlopen of a truncated file can crash the process), or None."""
    try:
        recorded = checksum_path(target).read_text().strip()
    except OSError:
        return "has no recorded checksum"
    if _sha256(target) != recorded:
        return "does not match the checksum recorded when it was built (truncated or damaged)"
    return None


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
