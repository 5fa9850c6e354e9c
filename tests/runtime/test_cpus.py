"""``runworker --processes auto`` counts the CPUs the process may really use:
the affinity mask and a cgroup CPU quota (v2 ``cpu.max``, v1
``cpu.cfs_quota_us``/``cpu.cfs_period_us``), rounded up, at least 1. Fake
cgroup trees for each shape, then a real quota where this machine lets a
test make a cgroup."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from django_platformkit.runtime.cpus import CpuFiles, cgroup_cpu_quota, usable_cpus

ROOT = Path(__file__).resolve().parents[2]


def fake_tree(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> CpuFiles:
    for relative, text in files.items():
        target = tmp_path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "mountinfo").write_text(mountinfo.replace("{root}", str(tmp_path)))
    return CpuFiles(cgroup=tmp_path / "cgroup", mountinfo=tmp_path / "mountinfo")


V2_MOUNT = "31 23 0:28 / {root}/sys/fs/cgroup rw,relatime shared:9 - cgroup2 cgroup2 rw\n"
V1_MOUNT = "32 31 0:29 / {root}/sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("100000 100000", 1), ("50000 100000", 1), ("150000 100000", 2), ("max 100000", 8), ("400000 100000", 4)],
)
def test_cgroup_v2_cpu_max_rounded_up_and_at_least_one(tmp_path, cpu_max, expected):
    files = fake_tree(
        tmp_path, "0::/kubepods/pod1/app\n", V2_MOUNT, {"sys/fs/cgroup/kubepods/pod1/app/cpu.max": cpu_max}
    )
    assert usable_cpus(files, affinity=8) == expected


@pytest.mark.unit
def test_a_parents_quota_binds_its_children_and_affinity_stays_the_ceiling(tmp_path):
    files = fake_tree(
        tmp_path,
        "0::/system.slice/worker.service\n",
        V2_MOUNT,
        {
            "sys/fs/cgroup/system.slice/cpu.max": "150000 100000",
            "sys/fs/cgroup/system.slice/worker.service/cpu.max": "max 100000",
        },
    )
    assert cgroup_cpu_quota(files) == 1.5
    assert usable_cpus(files, affinity=8) == 2
    assert usable_cpus(files, affinity=1) == 1


@pytest.mark.unit
def test_cgroup_v1_quota_and_period_and_a_containers_own_root(tmp_path):
    # Docker on cgroup v1: /proc/self/cgroup names /docker/<id>, mounted as the container's root.
    files = fake_tree(
        tmp_path,
        "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n",
        V1_MOUNT.replace(" / ", " /docker/abc "),
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "250000",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
        },
    )
    assert usable_cpus(files, affinity=16) == 3
    unlimited = fake_tree(
        tmp_path / "none",
        "4:cpu,cpuacct:/\n",
        V1_MOUNT,
        {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1", "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"},
    )
    assert usable_cpus(unlimited, affinity=16) == 16


@pytest.mark.unit
def test_nothing_readable_leaves_the_affinity_count(tmp_path):
    assert usable_cpus(CpuFiles(cgroup=tmp_path / "missing", mountinfo=tmp_path / "missing"), affinity=3) == 3
    assert usable_cpus(CpuFiles(cgroup=tmp_path / "missing", mountinfo=tmp_path / "missing"), affinity=0) == 1


def _writable_cpu_cgroup() -> tuple[Path, str] | str:
    """A fresh cgroup with a CPU controller this test may write (``(dir, version)``), or why not."""
    if os.geteuid() != 0:
        return "not root: no cgroup of our own can be made"
    if len(os.sched_getaffinity(0)) < 2:
        return "fewer than 2 CPUs in the affinity mask: a 1-CPU quota would change nothing"
    mounts = Path("/proc/self/mountinfo").read_text()
    name = f"pk_test_{uuid.uuid4().hex[:8]}"
    v2 = re.search(r" (\S+) \S+ - cgroup2 ", mounts)
    # A child of the root: its cpu.max exists only with cpu in the root's subtree_control.
    if v2 and "cpu" in Path(v2.group(1), "cgroup.subtree_control").read_text().split():
        return Path(v2.group(1), name), "v2"
    v1 = re.search(r" (\S+) \S+ - cgroup cgroup \S*\bcpu\b", mounts)
    if v1:
        return Path(v1.group(1), name), "v1"
    return "no cgroup CPU controller is mounted writable here (v2 without cpu in subtree_control, no v1 cpu)"


@pytest.mark.process
def test_processes_auto_in_a_one_cpu_quota_starts_one_consumer_child(broker, tmp_path):
    from tests.conftest import worker_env

    found = _writable_cpu_cgroup()
    if isinstance(found, str):
        pytest.skip(found)
    directory, version = found
    try:
        directory.mkdir()
    except OSError as exc:
        pytest.skip(f"can't make a cgroup at {directory}: {exc}")
    try:
        if version == "v2":
            (directory / "cpu.max").write_text("100000 100000")
        else:
            (directory / "cpu.cfs_period_us").write_text("100000")
            (directory / "cpu.cfs_quota_us").write_text("100000")
        env = worker_env(broker)
        # The shell joins the cgroup, then becomes the supervisor: its CPU quota is one CPU on a machine of more.
        command = (
            f"echo $$ > {directory}/cgroup.procs && exec {sys.executable} {ROOT}/tests/manage.py runworker "
            "--processes auto --no-jobs --no-relay --subscription testapp.record_order"
        )
        proc = subprocess.Popen(["sh", "-c", command], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        started, lines = "", []
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append(line)
                started = line if "supervisor started" in line else started
                if "worker started pid=" in line:
                    break  # its child runs: a SIGTERM now stops the tree (not one in a child's start-up)
        finally:
            proc.terminate()
            proc.communicate(timeout=120)
        assert started.rstrip().endswith("children=consumer0"), "".join(lines)[-3000:]
    finally:
        for _ in range(50):
            try:
                directory.rmdir()
                break
            except OSError:
                time.sleep(0.2)  # the exited processes leave the cgroup a moment later
