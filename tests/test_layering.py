"""Layering rules of the library that a grep can check.

Device-specific code lives behind the backend interface: only offload/backend.py (and the
hardware-measuring tool, which times the device itself) may touch torch.cuda. Checked on the
syntax tree, so docstrings that name torch.cuda do not count and aliases like `x.cuda()` do.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moe_engine"
MAY_TOUCH_CUDA = {"offload/backend.py", "tools/profile_hardware.py"}


def cuda_uses(source: str) -> list[int]:
    """Line numbers where `source` reaches torch.cuda: an attribute named cuda (torch.cuda.x,
    t.cuda()), `import torch.cuda` or `from torch import cuda`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "cuda":
            lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name.startswith("torch.cuda")
                                                  for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (
                (node.module or "").startswith("torch.cuda")
                or (node.module == "torch" and any(a.name == "cuda" for a in node.names))):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_check_sees_every_way_to_reach_cuda_and_ignores_text():
    assert cuda_uses("import torch\ntorch.cuda.synchronize()\n") == [2]
    assert cuda_uses("x = t.cuda()\n") == [1]
    assert cuda_uses("from torch import cuda\nimport torch.cuda\n") == [1, 2]
    assert cuda_uses('"""Only the backend touches torch.cuda."""\n# torch.cuda\n') == []


def test_only_the_backend_touches_torch_cuda():
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in MAY_TOUCH_CUDA:
            continue
        hits += [f"moe_engine/{rel}:{line}" for line in cuda_uses(path.read_text())]
    assert not hits, ("torch.cuda outside offload/backend.py (route it through a Backend "
                      "method): " + ", ".join(hits))
