"""The drain under real uvicorn and a real SIGTERM, without an engine: `serving.run` serves a
small app whose stream is cut as the gateway's is (generation.py: `Drain.cuttable`, then
`was_cut` and the error event), so the signal handling, the cut of a task inside Starlette's
streaming response and the shutdown are the real ones. The gateway's own drain on a real engine:
test_fleet_replica.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.loadgen.polling import wait_until
from bench.loadgen.server import free_port

DRAIN_S = 2.0

APP = """
import asyncio, json, sys
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from loraplex.server.drain import Drain, DrainGate, ShuttingDown
from loraplex.server.serving import run
from loraplex.server.settings import HttpSettings

app = FastAPI()
app.state.drain = Drain(float(sys.argv[2]))
app.add_middleware(DrainGate, drain=app.state.drain)

@app.get("/ready")
async def ready():
    return JSONResponse({}, status_code=503 if app.state.drain.draining else 200)

@app.get("/v1/stream")
async def stream(chunks: int):
    async def body():
        try:
            with app.state.drain.cuttable():
                for i in range(chunks):
                    await asyncio.sleep(0.05)
                    yield f"data: {i}\\n\\n"
        except asyncio.CancelledError:
            if not app.state.drain.was_cut():
                raise
            e = ShuttingDown()
            yield "data: " + json.dumps({"error": {"code": e.code}}) + "\\n\\n"
            return
        yield "data: [DONE]\\n\\n"
    return StreamingResponse(body(), media_type="text/event-stream")

run(app, HttpSettings(port=int(sys.argv[1])))
"""


def read_stream(url: str, events: list[str], started: threading.Event) -> None:
    with httpx.stream("GET", url, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


@pytest.mark.parametrize(
    ("drain_s", "signals"),
    [(DRAIN_S, 1), (60.0, 2)],
    ids=["drain-then-cut", "second-signal-cuts-at-once"],
)
def test_sigterm_drains_then_cuts_with_the_error_event_and_exits(
    tmp_path: Path, drain_s: float, signals: int
) -> None:
    port = free_port()
    script = tmp_path / "app.py"
    script.write_text(APP)
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, str(script), str(port), str(drain_s)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parents[2],
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            try:
                return httpx.get(base + "/ready").status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(ready, 60), (tmp_path / "server.log").read_text()
        streams = {"short": 10, "long": 100_000}  # 0.5 s, and more than drain_s
        events: dict[str, list[str]] = {name: [] for name in streams}
        threads = []
        for name, chunks in streams.items():
            started = threading.Event()
            url = f"{base}/v1/stream?chunks={chunks}"
            thread = threading.Thread(target=read_stream, args=(url, events[name], started))
            thread.start()
            assert started.wait(10)
            threads.append(thread)
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert wait_until(lambda: httpx.get(base + "/ready").status_code == 503, 2)
        r = httpx.get(f"{base}/v1/stream?chunks=1")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        if signals == 2:
            time.sleep(1.0)  # the short stream ends meanwhile
            process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        assert events["short"][-1] == "[DONE]" and len(events["short"]) == 11
        assert json.loads(events["long"][-1]) == {"error": {"code": "shutting_down"}}
        assert process.wait(timeout=30) == -signal.SIGTERM  # uvicorn re-raises the signal
        cut_after = DRAIN_S if signals == 1 else 1.0
        assert cut_after - 0.5 <= time.monotonic() - sent < cut_after + 10
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
