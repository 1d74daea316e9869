"""bench/ stands on its own: it imports nothing from tests/, and its committed result files follow
bench/common.py's naming rule (one `<name>.jsonl` per benchmark, a JSON object a line)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_bench_imports_nothing_from_tests() -> None:
    found = []
    for path in sorted(BENCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            found += [f"{path.relative_to(BENCH)}:{node.lineno} {n}" for n in names
                      if n == "tests" or n.startswith("tests.")]  # fmt: skip
    assert found == []


def test_result_files_are_one_jsonl_per_benchmark() -> None:
    files = sorted(p for p in BENCH.rglob("results/*") if "tmp" not in p.parts and p.is_file())
    assert files
    for path in files:
        assert re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)*\.jsonl", path.name), path
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert rows and all(isinstance(row, dict) for row in rows), path
