"""Load test for `clover serve`: N concurrent clients for T seconds against a real server process.

Each client sends chat, streamed chat and completion requests back to back over raw HTTP; one client
also leaves a stream after its first chunk (a disconnect mid-stream). The run is bounded: it stops after
--seconds or --max-requests, whichever comes first, and every socket has a timeout. Every request must be
answered (200) or refused (503 with Retry-After): "lost" counts any other ending (a reset, a timeout, a
malformed answer), and the server must still be up and its counters must agree with ours at the end.
Reported, not asserted: p50/p95 latency of answered requests, p50/p95 time they waited in the queue.

    python benchmarks/serve_load.py --clients 8 --seconds 30 --max-queue 4 [--model DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = "serving "


class ServerProcess:
    """`clover serve --port 0 ARGS` in a child process; its URL read from the line it prints when ready."""

    def __init__(self, *args: str, timeout: float = 120.0):
        cmd = [sys.executable, "-c", "from clover_lite.cli.main import main; main()", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.url: str | None = None
        ready = threading.Event()

        def drain() -> None:  # read stderr to the end, so a chatty server never blocks on a full pipe
            for line in self.proc.stderr:
                self.log.append(line)
                if self.url is None and line.startswith(READY) and "http://" in line:
                    self.url = line.split("http://", 1)[1].split("/v1", 1)[0]
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.log))
        self.host, port = self.url.rsplit(":", 1)
        self.port = int(port)

    @property
    def base(self) -> str:
        return f"http://{self.url}"

    def request(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
                timeout: float = 60.0) -> tuple[int, dict, bytes]:
        """One raw HTTP request: (status, headers, body)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def health(self) -> dict:
        return json.loads(self.request("GET", "/health")[2])

    def stop(self, sig: int | None = None, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def one_request(server: ServerProcess, kind: str, rng: random.Random, disconnect: bool = False) -> dict:
    digits = " ".join(str(rng.randrange(10)) for _ in range(rng.randint(3, 8)))
    max_tokens = rng.randint(8, 48)
    if kind == "completion":
        path, body = "/v1/completions", {"prompt": f"sort: {digits}", "max_tokens": max_tokens}
    else:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": f"sort: {digits}"}], "max_tokens": max_tokens,
                "stream": kind == "stream" or disconnect}
    t0 = time.monotonic()
    out = {"kind": "disconnect" if disconnect else kind, "status": None, "ok": False}
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out["status"] = resp.status
        if resp.status == 503:
            retry = resp.getheader("Retry-After")
            out["ok"] = retry is not None and retry.isdigit()
            out["retry_after"] = int(retry) if out["ok"] else None
            resp.read()
        elif resp.status == 200 and body.get("stream"):
            if disconnect:
                out["ok"] = bool(resp.readline())  # the first chunk arrived: now leave
                conn.sock.close()
            else:
                lines = resp.read().decode().splitlines()
                events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
                out["ok"] = lines[-1:] == ["data: [DONE]"] or "data: [DONE]" in lines
                stats = [e["clover"] for e in events if "clover" in e]
                out["queue_seconds"] = stats[-1]["queue_seconds"] if stats else None
                out["ok"] = out["ok"] and bool(stats)
        elif resp.status == 200:
            data = json.loads(resp.read())
            out["ok"] = bool(data.get("choices"))
            out["queue_seconds"] = data["clover"]["queue_seconds"]
        else:
            resp.read()
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    out["seconds"] = time.monotonic() - t0
    return out


def run_load(server: ServerProcess, clients: int, seconds: float, max_requests: int, seed: int) -> dict:
    deadline = time.monotonic() + seconds
    results: list[dict] = []
    lock = threading.Lock()
    budget = [max_requests]

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        first = True
        while time.monotonic() < deadline:
            with lock:
                if budget[0] <= 0:
                    return
                budget[0] -= 1
            kind = rng.choice(["chat", "stream", "completion"])
            r = one_request(server, kind, rng, disconnect=(k == 0 and first))
            first = False
            with lock:
                results.append(r)
            if r.get("retry_after"):  # a polite client waits as told (capped, so the run stays short)
                time.sleep(min(r["retry_after"], 2.0) * rng.uniform(0.5, 1.0))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    wall = time.monotonic() - t0
    answered = [r for r in results if r["status"] == 200 and r["ok"]]
    refused = [r for r in results if r["status"] == 503 and r["ok"]]
    lost = [r for r in results if r not in answered and r not in refused]
    # The server's side: wait for the abandoned stream's job to end, then compare counts.
    for _ in range(100):
        health = server.health()
        if not health["busy"] and not health["waiting"]:
            break
        time.sleep(0.1)
    queue = [r["queue_seconds"] for r in answered if r.get("queue_seconds") is not None]
    lat = [r["seconds"] for r in answered if r["kind"] != "disconnect"]
    return {
        "clients": clients, "seconds": seconds, "wall_seconds": round(wall, 2), "requests": len(results),
        "answered": len(answered), "refused_503": len(refused), "lost": len(lost),
        "lost_examples": lost[:5], "disconnects": sum(r["kind"] == "disconnect" for r in results),
        "latency_p50": percentile(lat, 0.5), "latency_p95": percentile(lat, 0.95),
        "queue_wait_p50": percentile(queue, 0.5), "queue_wait_p95": percentile(queue, 0.95),
        "server": health, "server_alive": server.proc.poll() is None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-requests", type=int, default=400)
    ap.add_argument("--max-queue", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    server = ServerProcess(*([args.model] if args.model else []), "--max-queue", str(args.max_queue))
    try:
        res = run_load(server, args.clients, args.seconds, args.max_requests, args.seed)
    finally:
        code = server.stop()
    res["server_exit_code"] = code
    res["max_queue"] = args.max_queue

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    print(f"{res['clients']} clients, {res['wall_seconds']} s, queue {args.max_queue}: {res['requests']} requests, "
          f"{res['answered']} answered, {res['refused_503']} refused (503), {res['lost']} lost, "
          f"{res['disconnects']} disconnect(s)")
    print(f"latency p50 {ms(res['latency_p50'])}, p95 {ms(res['latency_p95'])}; queue wait p50 "
          f"{ms(res['queue_wait_p50'])}, p95 {ms(res['queue_wait_p95'])}; server exit code {code}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    return 0 if res["lost"] == 0 and res["server_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
