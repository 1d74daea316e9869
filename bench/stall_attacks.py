"""The maximal requests bench.stall sends, one kind each: the most work a single request can
make the gateway do within the bounds (issue 45: "measure the worst stall a maximal request
causes to other streams").

Prompts, each body just under `http.max_body_bytes`:
- `chat_string`    one chat message holding the whole body (issue 45's finding: a chat prompt
                   just under the 8 MiB cap stalled every stream 11.4 s);
- `chat_messages`  the body full of tiny messages (the most JSON values a body can hold);
- `prompt_ids`     a text completion whose prompt is a token-id list filling the body;
- `nested`         arrays nested as deep as the body allows;
- `at_char_bound`  the longest prompt the gateway tokenizes (its character bound: context x the
                   tokenizer's longest token), of ordinary words, then refused for its tokens;
- `at_char_bound_cjk`  the same length in CJK characters (about 2.7 tokens each: the most
                   tokenizer work per character found for this tokenizer).

Responses, from a short prompt to the end of the context:
- `logprobs_response`  a whole (not streamed) chat response of n=16 choices with
                   top_logprobs=20 at every token: 48 MB at 2,047 tokens;
- `n16_stream`     the same streamed: 16 choices' chunks, each with its 20 top logprobs;
- `n16_plain`      the same streamed without logprobs: what 16 more sequences in the engine's
                   batch cost the steady streams alone, beside which the logprobs' share shows.

Registrations (POST /admin/v1/adapters of a copy of the demo adapter, deleted after):
- `config_ints`    an adapter_config.json just under MAX_CONFIG_BYTES of small JSON values;
- `config_patterns`  rank_pattern at both pattern bounds (MAX_PATTERN_KEYS keys of character
                   sets, MAX_PATTERN_CHARS in all: the slowest shape to compile measured);
- `config_patterns_past`  the config filled with ~19,500 rank_pattern keys, refused by
                   MAX_PATTERN_KEYS (registered before the bound: 9-11 s of compiling and
                   matching in a worker thread that held the GIL up to 344 ms at a time);
- `config_80mb`    the issue's 80 MB adapter_config.json (stalled every stream 4.5 s), refused.

Scrapes:
- `metrics_scrape`  GET /metrics once `seed_metrics` had 20 tenants each send a request to 21
                   shared adapters and the base model: every tenant x adapter label the
                   default `tenancy.adapter_label_top_k` (20, then `other`) allows, 61k samples.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen.server import ADMIN_TOKEN

LOREM = "lorem ipsum dolor sit amet, consectetur adipiscing elit sed do eiusmod tempor "
PROMPT_KINDS = ("chat_string", "chat_messages", "prompt_ids", "nested", "at_char_bound",
                "at_char_bound_cjk")  # fmt: skip
RESPONSE_KINDS = ("logprobs_response", "n16_stream", "n16_plain")
CONFIG_KINDS = ("config_ints", "config_patterns", "config_patterns_past", "config_80mb")
METRICS_KINDS = ("metrics_scrape",)
KINDS = PROMPT_KINDS + RESPONSE_KINDS + CONFIG_KINDS + METRICS_KINDS
ATTACKER_KEY = "stall-attacker-key-0123456789"  # the tenant sending every request but scrapes
SEED_TENANTS = 20
SEED_ADAPTERS = 21  # adapter_label_top_k's 20 and one that is counted as `other`
CONFIG_FILE = "adapter_config.json"
Send = Callable[[httpx.Client], tuple[int, int]]  # one request: its status and bytes received


@dataclass
class Attack:
    """One kind of maximal request."""

    name: str
    send: Send


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


def prompt_bodies(model: str, cap: int, bound: int) -> dict[str, tuple[str, bytes]]:
    """(path, body) of each prompt kind, every body under `cap` bytes."""
    room = cap - 1024

    def chat(messages: list[dict[str, str]]) -> bytes:
        return json.dumps({"model": model, "messages": messages, "max_tokens": 4}).encode()

    tiny = {"role": "user", "content": "hi"}
    per_message = len(json.dumps(tiny)) + 2
    rng = random.Random(0)
    cjk = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(bound - 256))
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


def _post(path: str, body: bytes) -> Send:
    def send(client: httpx.Client) -> tuple[int, int]:
        reply = client.post(path, content=body, headers={"content-type": "application/json"})
        return reply.status_code, len(reply.content)

    return send


def _stream(path: str, body: bytes) -> Send:
    def send(client: httpx.Client) -> tuple[int, int]:
        headers = {"content-type": "application/json"}
        with client.stream("POST", path, content=body, headers=headers) as reply:
            return reply.status_code, sum(len(b) for b in reply.iter_bytes())

    return send


def response_body(model: str, tokens: int, stream: bool, logprobs: bool = True) -> bytes:
    """n=16 choices of `tokens` tokens each, top_logprobs=20 at every one (the bounds' most)."""
    from loraplex.server.protocol import MAX_N, MAX_TOP_LOGPROBS

    asked = {"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS} if logprobs else {}
    return json.dumps({
        "model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": tokens, "n": MAX_N, "temperature": 1.0, "seed": 0, "ignore_eos": True,
        "stream": stream, **asked,
    }).encode()  # fmt: skip


def config_folders(demo_adapter: Path, workdir: Path) -> dict[str, Path]:
    """A copy of `demo_adapter` for each registration kind, its config replaced."""
    from loraplex.adapters_registry.peft_config import (
        MAX_CONFIG_BYTES,
        MAX_PATTERN_CHARS,
        MAX_PATTERN_KEYS,
    )

    config = json.loads((demo_adapter / CONFIG_FILE).read_text())
    room = MAX_CONFIG_BYTES - len(json.dumps(config)) - 64
    many: dict[str, int] = {}
    size = 2  # json.dumps(many), counted as it grows: `{}`, then `"zz0": 8, ` an entry
    for i in itertools.count():  # patterns no module name ends in
        size += len(f'"zz{i}": {config["r"]}, ')
        if size > room:
            break
        many[f"zz{i}"] = config["r"]
    width = MAX_PATTERN_CHARS // MAX_PATTERN_KEYS
    sets = "[ab]" * ((width - 4) // 4)
    at_bounds = {f"{sets}{i:04d}".ljust(width, "x"): config["r"] for i in range(MAX_PATTERN_KEYS)}
    assert sum(map(len, at_bounds)) == MAX_PATTERN_CHARS
    texts = {
        "config_ints": json.dumps({**config, "padding": [0] * (room // 2)}, separators=(",", ":")),
        "config_patterns": json.dumps({**config, "rank_pattern": at_bounds}),
        "config_patterns_past": json.dumps({**config, "rank_pattern": many}),
    }
    folders = {}
    for kind in CONFIG_KINDS:
        folder = workdir / kind
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(demo_adapter, folder)
        if kind in texts:
            assert len(texts[kind]) <= MAX_CONFIG_BYTES, (kind, len(texts[kind]))
            (folder / CONFIG_FILE).write_text(texts[kind])
        else:  # sparse: the bound refuses it by its size, before a byte is read
            with (folder / CONFIG_FILE).open("ab") as f:
                f.truncate(80_000_000)
        folders[kind] = folder
    return folders


def _register(folder: Path, names: itertools.count[int]) -> Send:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def send(client: httpx.Client) -> tuple[int, int]:
        name = f"stall-{folder.name.replace('_', '-')}-{next(names)}"
        body = {"name": name, "source": str(folder)}
        reply = client.post("/admin/v1/adapters", json=body, headers=headers)
        if reply.status_code == 201:  # the next one registers anew, not a known version
            client.delete(f"/admin/v1/adapters/{name}", headers=headers).raise_for_status()
        return reply.status_code, len(reply.content)

    return send


def _get(path: str) -> Send:
    def send(client: httpx.Client) -> tuple[int, int]:
        reply = client.get(path)
        return reply.status_code, len(reply.content)

    return send


def seed_tenants() -> list[dict[str, Any]]:
    """The config of the tenants `seed_metrics` sends as."""
    return [{"id": f"seed{t:02d}", "api_keys": [f"seed-key-{t:02d}-0123456789"]}
            for t in range(SEED_TENANTS)]  # fmt: skip


def seed_metrics(base_url: str, model: str, tenants: list[dict[str, Any]]) -> None:
    """Each of `tenants` sends one 1-token request to each of SEED_ADAPTERS shared adapters
    (copies of a demo adapter, registered here) and to the base model, 20 at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from loraplex.server.demo.adapters import ensure_demo_adapters
    from loraplex.server.demo.model import ensure_demo_model
    from loraplex.server.settings import default_cache_dir

    cache = default_cache_dir()
    demo = ensure_demo_adapters(ensure_demo_model(cache), cache) / "demo-attn"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=base_url, timeout=600) as client:
        names = [f"seed-{a:02d}" for a in range(SEED_ADAPTERS)]
        for name in names:
            body = {"name": name, "source": str(demo)}
            client.post("/admin/v1/adapters", json=body, headers=admin).raise_for_status()

        def one(tenant: dict[str, Any], target: str) -> None:
            body = {"model": target, "max_tokens": 1,
                    "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
            headers = {"Authorization": f"Bearer {tenant['api_keys'][0]}"}
            reply = client.post("/v1/chat/completions", json=body, headers=headers)
            reply.raise_for_status()

        with ThreadPoolExecutor(SEED_TENANTS) as pool:
            for target in [model, *names]:
                list(pool.map(lambda t: one(t, target), tenants))  # noqa: B023


def attacks(
    model: str, cap: int, max_model_len: int, response_tokens: int, workdir: Path, kinds: Any
) -> dict[str, Attack]:
    """The attacks named in `kinds`, ready to send."""
    from loraplex.server.demo.adapters import ensure_demo_adapters
    from loraplex.server.demo.model import ensure_demo_model
    from loraplex.server.settings import default_cache_dir

    out: dict[str, Attack] = {}
    if any(k in PROMPT_KINDS for k in kinds):
        for name, (path, body) in prompt_bodies(model, cap, char_bound(max_model_len)).items():
            out[name] = Attack(name, _post(path, body))
    for name, stream, logprobs in (
        ("logprobs_response", False, True),
        ("n16_stream", True, True),
        ("n16_plain", True, False),
    ):
        body = response_body(model, response_tokens, stream, logprobs)
        out[name] = Attack(name, (_stream if stream else _post)("/v1/chat/completions", body))
    if any(k in CONFIG_KINDS for k in kinds):
        cache = default_cache_dir()
        demo = ensure_demo_adapters(ensure_demo_model(cache), cache) / "demo-attn"
        names = itertools.count()
        for name, folder in config_folders(demo, workdir / "adapters").items():
            out[name] = Attack(name, _register(folder, names))
    out["metrics_scrape"] = Attack("metrics_scrape", _get("/metrics"))
    return {k: out[k] for k in kinds}
