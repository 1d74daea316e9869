"""Issue 45, findings 6 and 7 (the adapter files' part), re-run as filed against the shared
server: each registration is a 400 naming the field and the bound, answered quickly with a short
body that quotes no file, nothing is registered, and the bystanders' outputs are unchanged.

Before: a config linked to a 20 MiB host file gave a 104 MB response embedding it; weights linked
to /proc/self/pagemap were copied without bound (2.4 GB in 8 s); `r` or `data_offsets` of 5,001
digits, a regex nested 3,000 deep and a symlink loop were 500s; a `__metadata__` that is not a
string map registered, then failed every request with 503; an 80 MB adapter_config.json stalled
every stream 4.5 s."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.loadgen.server import LiveServer
from loraplex.server.settings import default_cache_dir
from tests.support.bystanders import Bystanders, admin

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def link(folder: Path, name: str, target: Path | str) -> None:
    (folder / name).unlink()
    (folder / name).symlink_to(target)


def edit_config(folder: Path, edit: Callable[[str], str]) -> None:
    (folder / CONFIG).write_text(edit((folder / CONFIG).read_text()))


def set_config(folder: Path, **fields: object) -> None:
    config = json.loads((folder / CONFIG).read_text())
    (folder / CONFIG).write_text(json.dumps({**config, **fields}))


def edit_header(folder: Path, edit: Callable[[str], str]) -> None:
    """Rewrite the weights' JSON header as text (the data after it unchanged)."""
    raw = (folder / WEIGHTS).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = edit(raw[8 : 8 + length].decode()).encode()
    (folder / WEIGHTS).write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length :])


def host_file(folder: Path) -> Path:
    path = folder.parent / "host-file"
    path.write_bytes(b"host secret " * (20 * 2**20 // 12))  # 20 MiB
    return path


def sparse_80mb_config(folder: Path) -> None:
    with (folder / CONFIG).open("ab") as f:
        f.truncate(80_000_000)


DEEP = "(" * 3000 + "q_proj" + ")" * 3000
CASES: dict[str, tuple[Callable[[Path], None], str, str]] = {
    # name: (what to do to a copy of demo-attn, the error's param, what its message says)
    "weights-linked-to-proc-pagemap": (
        lambda f: link(f, WEIGHTS, "/proc/self/pagemap"), "source", "another filesystem"),
    "config-linked-to-a-20-mib-host-file": (
        lambda f: link(f, CONFIG, host_file(f)), CONFIG, "MAX_CONFIG_BYTES allows at most"),
    "symlink-loop": (lambda f: link(f, WEIGHTS, f / WEIGHTS), "source", "loop"),
    "r-of-5001-digits": (
        lambda f: edit_config(f, lambda t: t.replace('"r": 8', f'"r": {"7" * 5001}')), "r",
        "an integer of 5001 digits; at most 20 are read"),
    "data-offsets-of-5001-digits": (
        lambda f: edit_header(f, lambda t: t.replace("[0,", f"[{'1' * 5001},", 1)),
        WEIGHTS, "at most 20 are read"),
    "rank-pattern-nested-3000-deep": (
        lambda f: set_config(f, rank_pattern={DEEP: 8}), "rank_pattern", "3000 deep; at most 32"),
    "target-modules-nested-3000-deep": (
        lambda f: set_config(f, target_modules=DEEP), "target_modules", "3000 deep; at most 32"),
    "metadata-not-a-string-map": (
        lambda f: edit_header(f, lambda t: t.replace("{", '{"__metadata__":{"format":["pt"]},', 1)),
        WEIGHTS, "__metadata__ must map strings to strings"),
    "80-mb-config": (sparse_80mb_config, CONFIG, "is 80000000 bytes"),
    "rank-pattern-filling-the-config": (  # compiling them held the GIL 344 ms
        lambda f: set_config(f, rank_pattern={f"zz{i}": 8 for i in range(19_490)}),
        "rank_pattern", "has 19490 keys; at most 256"),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_bad_adapter_file_is_a_short_400_naming_the_field(
    shared_server: LiveServer, bystanders: Bystanders, tmp_path: Path, case: str
) -> None:
    make_bad, param, says = CASES[case]
    folder = tmp_path / "adapter"
    shutil.copytree(default_cache_dir() / "demo-adapters" / "demo-attn", folder)
    make_bad(folder)
    name = f"mallory/{case}"
    r = admin(
        shared_server, "POST", "/admin/v1/adapters", json={"name": name, "source": str(folder)}
    )
    assert r.status_code == 400, r.text[:2000]
    assert len(r.content) < 1000, len(r.content)  # no file's bytes in it
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert error["type"] == "invalid_request_error" and b"secret" not in r.content
    assert admin(shared_server, "GET", f"/admin/v1/adapters/{name}").status_code == 404
    bystanders.assert_unchanged()
