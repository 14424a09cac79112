"""A description of the machine a benchmark ran on (recorded beside every result)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys


def _lscpu_model() -> str | None:
    if shutil.which("lscpu"):
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def describe_machine() -> dict:
    """Platform, CPU model, usable cores, memory, GPUs and library versions (no torch import)."""
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:
        nproc = os.cpu_count()
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_model": _lscpu_model(),
        "nproc": nproc,
        "cpu_count": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "gpus": _gpus(),
        "torch": _version("torch"),
        "kvserve": _version("kvserve"),
        # Other work on the machine skews CPU results (torch's OpenMP threads suffer most).
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def machine_markdown(m: dict) -> str:
    gpus = ", ".join(m.get("gpus") or []) or "none"
    return (
        f"- CPU: {m.get('cpu_model')} ({m.get('nproc')} usable cores of {m.get('cpu_count')})\n"
        f"- Memory: {m.get('memory_gib')} GiB; GPUs: {gpus}\n"
        f"- Platform: {m.get('platform')}; Python {m.get('python')}; torch {m.get('torch')}\n"
        f"- Load average (1 min) when the report was written: {m.get('loadavg_1m')}\n"
    )
