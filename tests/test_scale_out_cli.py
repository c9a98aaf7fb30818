"""``oxibonsai serve --replicas 2`` as a user runs it: the command starts its own local Ray instance,
serves the OpenAI routes from two replicas, and on SIGTERM stops Serve and Ray and exits 0, leaving no
Ray process behind. (A module of its own: the other scale-out tests' Ray instance has stopped by now.)"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'oxibonsai[ray]')")

from server_support import free_port, wait_until


def ray_processes() -> list[str]:
    found = subprocess.run(["pgrep", "-af", "raylet|gcs_server"], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def test_the_command_serves_two_replicas_and_stops_cleanly(tiny_model: Path, tmp_path: Path):
    if ray_processes():
        pytest.skip("another Ray instance runs on this machine; this test owns the only one")
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")  # a file, not a pipe: Ray logs enough to fill one
    flags = ["--replicas", "2", "--num-threads", "1", "--max-model-len", "256", "--served-model-name", "m"]
    cmd = [sys.executable, "-m", "oxibonsai", "serve", "--model", str(tiny_model), "--port", str(port)]
    cmd += flags
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:

        def answers() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
            return False

        assert wait_until(answers, 120), (tmp_path / "serve.log").read_text()[-3000:]
        body = {"model": "m", "prompt": "the", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        assert wait_until(lambda: not ray_processes(), 30), ray_processes()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
