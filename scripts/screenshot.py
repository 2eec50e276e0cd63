"""Make docs/ui.png: start an rdzv-server and a small live job (three real
rdzv-agent processes whose workers report progress), lose one node and bring
it back (so the page has a round history), then open /ui/jobs/<id> in headless
Chromium and save the page. Everything it starts is stopped at the end, by pid.

    scripts/screenshot [--out docs/ui.png]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers import browser as chromium  # noqa: E402
from tests.helpers.procs import free_port  # noqa: E402

JOB = "llama-8b-pretrain"
WORKER = """
import time
from rdzv_client.worker import progress
step = 0
while True:
    step += 1
    progress(step)
    time.sleep(0.05)
"""

procs: list[subprocess.Popen] = []


def start(argv: list[str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "PET_"))}
    env["PYTHONPATH"] = str(ROOT)
    with log.open("w") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    procs.append(p)
    return p


def job(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/jobs/{JOB}", timeout=5) as r:
        return json.loads(r.read())


def wait(what: str, pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"screenshot: timed out waiting for {what}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "docs" / "ui.png"))
    args = p.parse_args()
    if not chromium.available():
        raise SystemExit(f"screenshot: {chromium.HOW_TO_GET}")
    from playwright.sync_api import sync_playwright

    tmp = Path(tempfile.mkdtemp(prefix="rdzv-screenshot-"))
    (tmp / "worker.py").write_text(WORKER)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    start(
        [sys.executable, "-m", "rdzv_server", "--host", "127.0.0.1", "--port", str(port), "--data-dir", "none"],
        tmp / "server.log",
    )
    wait("the server", lambda: urllib.request.urlopen(f"{url}/healthz", timeout=1).status == 200)

    def agent(host: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "rdzv_client.agent", "--endpoint", f"127.0.0.1:{port}", "--job-id", JOB]
        argv += ["--nnodes", "2:4", "--nproc-per-node", "2", "--local-addr", "127.0.0.1", "--host-name", host]
        argv += ["--last-call", "3", "--max-restarts", "3", str(tmp / "worker.py")]
        return start(argv, tmp / f"{host}.log")

    try:
        nodes = {h: agent(h) for h in ("gpu-node-01", "gpu-node-02", "gpu-node-03")}

        def running(n: int, after: int = -1) -> bool:
            v = job(url)
            return bool(v["state"] == "running" and len(v["nodes"]) == n and v["round"] > after)

        wait("three nodes running", lambda: running(3))
        time.sleep(2)
        r = job(url)["round"]
        victim = nodes["gpu-node-03"]
        workers = subprocess.run(["pgrep", "-P", str(victim.pid)], capture_output=True, text=True).stdout.split()
        os.killpg(victim.pid, signal.SIGKILL)  # a node dies: the agent, and its workers (groups of their own)
        for pid in workers:
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        victim.wait()
        wait("the two others re-formed", lambda: running(2, r))
        time.sleep(1.5)
        r = job(url)["round"]
        nodes["gpu-node-04"] = agent("gpu-node-04")
        wait("a new node joined", lambda: running(3, r), timeout=90)
        time.sleep(2.5)  # step/s settle
        with sync_playwright() as pw:
            b = chromium.launch(pw)
            page = b.new_page(viewport={"width": 1280, "height": 640})
            page.goto(f"{url}/ui/jobs/{JOB}")
            page.wait_for_selector("body[data-ready='1']")
            page.wait_for_selector("#live:not(.off)")
            page.wait_for_timeout(500)
            page.screenshot(path=args.out)
            b.close()
        print(f"screenshot: wrote {args.out} ({Path(args.out).stat().st_size} bytes)")
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


if __name__ == "__main__":
    main()
