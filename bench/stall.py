"""Stall benchmark: how much does one maximal request delay every other stream's tokens?

Steady streams (bench.stall_clock, a process of its own) decode from the base model while this
process sends maximal requests one after another, each just under `http.max_body_bytes`, in
phases of one shape each:

- `chat_string`    one chat message holding the whole body (issue 45's finding: a chat prompt
                   just under the 8 MiB cap stalled every stream 11.4 s);
- `chat_messages`  the body full of tiny messages (the most JSON values a body can hold);
- `prompt_ids`     a text completion whose prompt is a token-id list filling the body;
- `nested`         arrays nested as deep as the body allows;
- `at_char_bound`  the longest prompt the gateway tokenizes (its character bound: context x the
                   tokenizer's longest token), of ordinary words, then refused for its tokens;
- `at_char_bound_cjk`  the same length in CJK characters (about 2.7 tokens each: the most
                   tokenizer work per character found for this tokenizer).

Each attack phase follows a steady one, `--rounds` times per shape, so drift on a shared machine
hits both alike; the p99 inter-token latency (ITL) of a shape's attack phases is compared with
that of the steady phases just before them (goal: at most 50 ms higher, on the 2-core CPU
machine). Beside ITL, the latency of a GET /health every 50 ms shows the gateway's event loop
alone: a stall there is the gateway's, a slower engine step is not. Prints a table, appends one
JSON row per shape (machine, commit, config) to bench/results/stall.jsonl.

    python -m bench.stall [--streams 4] [--phase-s 10] [--rounds 3] [--shapes chat_string,...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from bench.common import append_rows, stamp
from bench.loadgen.server import LiveServer, live_server
from loraplex.server.settings import load_settings

GOAL_P99_INCREASE_S = 0.050
# A phase's gaps are those ending up to this long after its last reply (a stall ends when the
# request that caused it is answered); phases are twice this far apart.
SETTLE_S = 1.0
LOREM = "lorem ipsum dolor sit amet, consectetur adipiscing elit sed do eiusmod tempor "


def char_bound(max_model_len: int) -> int:
    """The gateway's character bound on a prompt that leaves one token for the output: the
    embedded model's tokenizer as vLLM caches it, whose longest token is what the bound uses."""
    from transformers import AutoTokenizer
    from vllm.tokenizers.hf import get_cached_tokenizer

    from loraplex.server.demo.model import ensure_demo_model
    from loraplex.server.settings import default_cache_dir

    tokenizer = get_cached_tokenizer(AutoTokenizer.from_pretrained(ensure_demo_model(
        default_cache_dir())))  # fmt: skip
    return (max_model_len - 1) * int(tokenizer.max_chars_per_token)


def maximal_bodies(model: str, cap: int, bound: int) -> dict[str, tuple[str, bytes]]:
    """(path, body) of each shape, every body under `cap` bytes."""
    room = cap - 1024

    def chat(messages: list[dict[str, str]]) -> bytes:
        return json.dumps({"model": model, "messages": messages, "max_tokens": 4}).encode()

    tiny = {"role": "user", "content": "hi"}
    per_message = len(json.dumps(tiny)) + 2
    random.seed(0)
    cjk = "".join(chr(random.randint(0x4E00, 0x9FFF)) for _ in range(bound - 256))
    open_, close = b"[" * (room // 2), b"]" * (room // 2)
    bodies = {
        "chat_string": chat([{"role": "user", "content": (LOREM * (room // len(LOREM)))}]),
        "chat_messages": chat([tiny] * (room // per_message)),
        "prompt_ids": json.dumps(
            {"model": model, "prompt": [1000] * (room // 6), "max_tokens": 4}
        ).encode(),
        "nested": b'{"model": "%s", "messages": %s%s}' % (model.encode(), open_, close),
        "at_char_bound": chat([{"role": "user", "content": (LOREM * bound)[: bound - 256]}]),
        "at_char_bound_cjk": chat([{"role": "user", "content": cjk}]),
    }
    paths = {"prompt_ids": "/v1/completions"}
    for name, body in bodies.items():
        assert len(body) < cap, (name, len(body), cap)
    return {name: (paths.get(name, "/v1/chat/completions"), body) for name, body in bodies.items()}


@dataclass
class Phase:
    name: str  # `steady` or the shape sent
    start: float
    end: float = 0.0
    replies: list[tuple[int, float]] = field(default_factory=list)  # (status, seconds)
    gaps: list[float] = field(default_factory=list)  # the steady streams' ITL in the phase
    probes: list[float] = field(default_factory=list)  # GET /health latencies in the phase


def attack(server: LiveServer, phase: Phase, path: str, body: bytes, duration: float) -> None:
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        while time.monotonic() - phase.start < duration:
            sent = time.monotonic()
            try:
                status = client.post(path, content=body, headers=headers).status_code
            except httpx.HTTPError:
                status = 0  # the connection failed: counted as such in the table
            phase.replies.append((status, time.monotonic() - sent))
            time.sleep(0.2)


def gaps_ending_in(requests: list[list[float]], start: float, end: float) -> list[float]:
    """Inter-token gaps of every stream request whose later token came in [start, end]: a
    stall shows up in the phase where it ends, however long it was."""
    return [b - a for times in requests for a, b in itertools.pairwise(times) if start <= b <= end]


def run(args: argparse.Namespace) -> list[Phase]:
    """`rounds` x (steady, shape) for each shape: each attack phase has a steady one just
    before it, so drift on a shared machine hits both alike."""
    settings = load_settings()  # what the server reads too: the defaults, this environment
    cap = settings.http.max_body_bytes
    bound = char_bound(settings.engine.max_model_len)
    workdir = args.out_dir / "tmp" / "stall"
    phases: list[Phase] = []
    with live_server({}, workdir) as server:
        model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        bodies = maximal_bodies(model, cap, bound)
        clock = subprocess.Popen(
            [sys.executable, "-m", "bench.stall_clock", "--base-url", server.base_url,
             "--model", model, "--streams", str(args.streams),
             "--max-tokens", str(args.max_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert clock.stdin is not None and clock.stdout is not None
        assert clock.stdout.readline().strip() == "decoding"
        for _, shape in itertools.product(range(args.rounds), args.shapes):
            steady = Phase("steady", time.monotonic())
            time.sleep(args.phase_s)
            steady.end = time.monotonic()
            time.sleep(2 * SETTLE_S)
            path, body = bodies[shape]
            phase = Phase(shape, time.monotonic())
            attack(server, phase, path, body, args.phase_s)
            phase.end = time.monotonic()
            phases += [steady, phase]
            time.sleep(2 * SETTLE_S)  # the last reply's aftermath is not the next phase's
        out, _ = clock.communicate("stop\n", timeout=120)
    clocked = json.loads(out)
    for phase in phases:
        end = phase.end + SETTLE_S
        phase.gaps = gaps_ending_in(clocked["requests"], phase.start, end)
        phase.probes = [s for sent, s in clocked["probes"] if phase.start <= sent + s <= end]
    return phases


def _ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000


def report(args: argparse.Namespace, phases: list[Phase]) -> list[dict[str, Any]]:
    """One row per shape: its attack phases' ITL and loop probes against the steady phases
    just before them, pooled over the rounds."""
    title = f"{args.streams} steady streams; maximal requests one after another, by shape"
    table = Table(title=title)
    columns = ("shape", "replies", "ITL p50 ms", "steady p99 ms", "attack p99 ms",
               "p99 increase ms", "attack max ms", "loop p99 ms (steady/attack)")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    rows = []
    base = {**stamp(), "config": {k: str(v) for k, v in vars(args).items()}}
    for shape in args.shapes:
        pairs = [(phases[i - 1], p) for i, p in enumerate(phases) if p.name == shape]
        steady = [g for s, _ in pairs for g in s.gaps]
        attacked = [g for _, p in pairs for g in p.gaps]
        steady_probes = [x for s, _ in pairs for x in s.probes]
        attack_probes = [x for _, p in pairs for x in p.probes]
        statuses: dict[str, int] = {}
        for _, p in pairs:
            for status, _ in p.replies:
                statuses[str(status)] = statuses.get(str(status), 0) + 1
        row = {
            **base,
            "shape": shape,
            "replies": statuses,
            "reply_s_max": max((t for _, p in pairs for _, t in p.replies), default=None),
            "gaps": {"steady": len(steady), "attack": len(attacked)},
            "itl_p50_ms": {"steady": _ms(steady, 50), "attack": _ms(attacked, 50)},
            "itl_p99_ms": {"steady": _ms(steady, 99), "attack": _ms(attacked, 99)},
            "itl_max_ms": {"steady": _ms(steady, 100), "attack": _ms(attacked, 100)},
            "p99_increase_ms": _ms(attacked, 99) - _ms(steady, 99),
            "goal_p99_increase_ms": GOAL_P99_INCREASE_S * 1000,
            "loop_probe_p99_ms": {
                "steady": _ms(steady_probes, 99),
                "attack": _ms(attack_probes, 99),
            },
            "loop_probe_max_ms": {
                "steady": _ms(steady_probes, 100),
                "attack": _ms(attack_probes, 100),
            },
        }
        rows.append(row)
        table.add_row(
            shape, " ".join(f"{k}x{v}" for k, v in statuses.items()),
            f"{_ms(steady, 50):.1f}/{_ms(attacked, 50):.1f}", f"{_ms(steady, 99):.1f}",
            f"{_ms(attacked, 99):.1f}", f"{row['p99_increase_ms']:+.1f}",
            f"{_ms(attacked, 100):.1f}",
            f"{_ms(steady_probes, 99):.1f}/{_ms(attack_probes, 99):.1f}",
        )  # fmt: skip
    Console(width=180).print(table)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stall", description=__doc__)
    parser.add_argument("--streams", type=int, default=4, help="steady streams")
    parser.add_argument("--max-tokens", type=int, default=400, help="tokens per steady request")
    parser.add_argument("--phase-s", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--rounds", type=int, default=3, help="steady/attack pairs per shape")
    parser.add_argument(
        "--shapes", type=lambda s: s.split(","),
        default=["chat_string", "chat_messages", "prompt_ids", "nested", "at_char_bound",
                 "at_char_bound_cjk"],
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    rows = report(args, run(args))
    path = append_rows("stall", rows)
    print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
