"""Is this machine's CPU time capped (a cgroup quota), and does a busy host stall a waiting thread?

    python3 cpu_throttle_probe.py [BUSY_PROCESSES] [SECONDS]

Prints the cgroup's cpu.max and cpu.stat, then runs BUSY_PROCESSES spinning processes for
SECONDS while this process sleeps 1 ms at a time and records how late each wake-up is: a
quota shows as wake-ups 10-100 ms late and nr_throttled rising; plain sharing of the cores
shows as wake-ups late by a scheduler tick at most.
"""
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def cgroup(name: str) -> str:
    for base in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu,cpuacct"), Path("/sys/fs/cgroup/cpu")):
        p = base / name
        if p.exists():
            return p.read_text().strip().replace("\n", "; ")
    return "(none)"


def late_wakeups(seconds: float) -> list[float]:
    lates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        time.sleep(0.001)
        lates.append((time.perf_counter() - t - 0.001) * 1e3)
    return sorted(lates)


def main(num_busy: int, seconds: float) -> None:
    print(f"cores {os.cpu_count()}, affinity {len(os.sched_getaffinity(0))}")
    for name in ("cpu.max", "cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.stat"):
        print(f"{name}: {cgroup(name)}")
    for busy in (0, num_busy):
        procs = [mp.Process(target=spin, args=(seconds,)) for _ in range(busy)]
        for p in procs:
            p.start()
        lates = late_wakeups(seconds)
        for p in procs:
            p.join()
        n = len(lates)
        print(f"{busy:2d} busy processes: 1 ms sleeps late by p50 {lates[n // 2]:.3f} ms, p99 {lates[int(n * 0.99)]:.3f},"
              f" max {lates[-1]:.1f}; over 10 ms: {sum(1 for x in lates if x > 10)}; cpu.stat: {cgroup('cpu.stat')}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16, float(sys.argv[2]) if len(sys.argv) > 2 else 3.0)
