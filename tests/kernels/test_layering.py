"""kernels/ by kind: only `kernels/vllm/` touches vLLM, the ops import torch, triton and each other
only, and no private name is imported from another file. Read from the sources (every import
statement, also those inside functions), so no import is run."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
# What a file under kernels/ops/ may import besides the standard library.
OPS_MAY_IMPORT = ("torch", "triton", "loraplex.kernels.ops", "loraplex.kernels.dispatch")


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) of every import statement in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            found.append((node.module or "", [a.name for a in node.names], node.lineno))
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _sources(folder: Path) -> list[Path]:
    files = sorted(folder.rglob("*.py"))
    assert files, f"no sources under {folder}"
    return files


def test_no_module_outside_kernels_vllm_imports_vllm() -> None:
    vllm_package = KERNELS / "vllm"
    outside = [p for p in _sources(KERNELS) if vllm_package not in p.parents]
    assert any("ops" in p.parts for p in outside)
    found = [
        f"{p.relative_to(KERNELS.parent)}:{line} imports {module}"
        for p in outside
        for module, _, line in _imports(p)
        if _within(module, "vllm")
    ]
    assert found == []


def test_ops_import_only_torch_triton_and_each_other() -> None:
    found = [
        f"{p.relative_to(KERNELS.parent)}:{line} imports {module}"
        for p in _sources(KERNELS / "ops")
        for module, _, line in _imports(p)
        if module.split(".")[0] not in sys.stdlib_module_names
        and not any(_within(module, allowed) for allowed in OPS_MAY_IMPORT)
    ]
    assert found == []


def test_no_private_name_is_imported_from_another_file() -> None:
    """Helpers that kernels of several files call live in kernels/ops/shared.py, by public name."""
    found = [
        f"{p.relative_to(KERNELS.parent)}:{line} imports {name} from {module}"
        for p in _sources(KERNELS)
        for module, names, line in _imports(p)
        if _within(module, "loraplex.kernels")
        for name in names
        if name.startswith("_")
    ]
    assert found == []
