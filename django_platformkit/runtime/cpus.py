"""How many CPUs this process may really use (``runworker --processes auto``).

A container's ``--cpus``, a Kubernetes CPU limit or a systemd ``CPUQuota``
is a cgroup CPU quota, not an affinity mask: ``os.process_cpu_count()`` and
``sched_getaffinity`` see every core of the host, and ``auto`` started one
child per host core in a 1-CPU container (two children fighting for one
CPU). The count here is the smaller of the affinity mask and the quota
(cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``),
the quota rounded up (1.5 CPUs -> 2, 0.5 -> 1), at least 1. The cgroup is
this process's own (``/proc/self/cgroup``), found under its mount
(``/proc/self/mountinfo``), and every ancestor's quota up to the mount's
root counts (a parent's limit binds its children). joblib/loky's
``cpu_count`` reads only the root's file, which is right inside a container
but misses a limit on a cgroup of a host (systemd's); hence our own reading,
with its paths passed in so a test can point them at a fake tree.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuFiles:
    """Where the CPU limits are read from (the real ``/proc`` by default; a fake tree in tests)."""

    cgroup: Path = Path("/proc/self/cgroup")
    mountinfo: Path = Path("/proc/self/mountinfo")


def usable_cpus(files: CpuFiles | None = None, *, affinity: int | None = None) -> int:
    """The CPUs this process may use: the affinity mask's count, lowered to
    the cgroup CPU quota rounded up; at least 1.

    Args:
        files: Where ``/proc/self/cgroup`` and ``/proc/self/mountinfo`` are.
        affinity: The affinity mask's count (default: this process's).

    Returns:
        A whole number of CPUs, 1 or more.
    """
    if affinity is None:
        affinity = _affinity_count()
    quota = cgroup_cpu_quota(files or CpuFiles())
    count = affinity if quota is None else min(affinity, math.ceil(quota))
    return max(1, count)


def _affinity_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cgroup_cpu_quota(files: CpuFiles) -> float | None:
    """The tightest CPU quota of this process's cgroup and its ancestors, in
    CPUs (``quota / period``), or None: no quota (``max``, ``-1``), no cgroup
    CPU controller, or nothing readable (not Linux)."""
    try:
        memberships = files.cgroup.read_text().splitlines()
        mounts = files.mountinfo.read_text().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in memberships:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            mount = _mount(mounts, "cgroup2", None)
            if mount is not None:
                found += _quotas(mount, path, _read_v2)
        elif "cpu" in controllers.split(","):
            mount = _mount(mounts, "cgroup", "cpu")
            if mount is not None:
                found += _quotas(mount, path, _read_v1)
    return min(found) if found else None


def _mount(mounts: list[str], kind: str, controller: str | None) -> tuple[Path, str] | None:
    """``(mount point, the cgroup path mounted there)`` of the ``kind`` filesystem
    (``cgroup2``, or ``cgroup`` carrying ``controller``), from mountinfo lines."""
    for line in mounts:
        head, _, tail = line.partition(" - ")
        fields, after = head.split(), tail.split()
        if len(fields) < 5 or len(after) < 3 or after[0] != kind:
            continue
        if controller is not None and controller not in after[2].split(","):
            continue
        return Path(fields[4]), fields[3]
    return None


def _quotas(mount: tuple[Path, str], path: str, read: Callable[[Path], float | None]) -> list[float]:
    """Every quota from the process's cgroup up to the mount's root."""
    point, root = mount
    relative = path
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        relative = path[len(root.rstrip("/")) :]  # a container's namespace: its own cgroup mounted as the root
    directory = point / relative.lstrip("/")
    quotas = []
    while True:
        quota = read(directory)
        if quota is not None:
            quotas.append(quota)
        if directory == point or point not in directory.parents:
            return quotas
        directory = directory.parent


def _read_v2(directory: Path) -> float | None:
    """``cpu.max``: ``"<quota> <period>"`` in microseconds, or ``"max <period>"``."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _read_v1(directory: Path) -> float | None:
    """``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
