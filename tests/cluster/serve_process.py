"""Helpers of the tests that run `mtpserve serve` as a user would: a subprocess on the session's
Ray cluster (tests/conftest.py's ray_cluster)."""
from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    lines: queue.Queue              # its output, line by line, after the "serving" line
    reader: threading.Thread
    model: str                      # the served model's name, from the "serving" line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)


def start_serve(ray_cluster, model_dir, app_name: str, *flags: str, timeout_s: float = 180) -> ServeProcess:
    """`mtpserve serve --address <cluster>` with ``flags``, once it prints that it is serving."""
    port = ray_cluster["url"].rsplit(":", 1)[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtpserve.cluster.serve", "--address", ray_cluster["address"], "--port", port,
         "--model", str(model_dir), "--app-name", app_name, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    output, deadline = [], time.monotonic() + timeout_s
    while not any(line.startswith("mtpserve: serving") for line in output):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(output)
        try:
            output.append(lines.get(timeout=1))
        except queue.Empty:
            pass
    return ServeProcess(proc, lines, reader, output[-1].split("`")[1])
