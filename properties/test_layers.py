"""The package's architecture: layers import one way (every import, lazy ones too), no module uses
another's privates, blocks and the scheduler load without torch, beside HF's ``kernels``."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LAYER_FOLDERS = {  # layer -> the folder of the repository that holds it
    "root": "pagedkv", "spec": "spec", "impl": "impl", "blocks": "impl/blocks",
    "serving": "impl/serving", "kernels": "kernels",
}  # fmt: skip
MODULE_PREFIXES = {  # import name prefix -> layer; the longest prefix wins
    "pagedkv": "root", "pagedkv.spec": "spec", "pagedkv.impl": "impl",
    "pagedkv.impl.blocks": "blocks", "pagedkv.impl.serving": "serving",
    "pagedkv.kernels": "kernels",
}  # fmt: skip
ALLOWED_LAYERS = {  # the rule: spec <- blocks <- serving, and spec <- kernels <- serving
    "root": set(), "spec": {"spec"}, "impl": set(), "blocks": {"spec", "blocks"},
    "kernels": {"spec", "kernels"}, "serving": {"spec", "blocks", "kernels", "serving"},
}  # fmt: skip
ALLOWED_THIRD_PARTY = {  # besides the standard library
    "root": set(), "spec": set(), "impl": set(), "blocks": {"numpy"},
    "kernels": {"numpy", "torch", "triton", "numba", "llvmlite"},  # llvmlite: numba's, for prefetch
    "serving": {"numpy", "torch", "tqdm", "transformers"},
}  # fmt: skip


def layer_of_module(name: str) -> str | None:
    """The layer an absolute import name belongs to, or None outside the package."""
    matches = [p for p in MODULE_PREFIXES if name == p or name.startswith(p + ".")]
    return MODULE_PREFIXES[max(matches, key=len)] if matches else None


def imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Each module an import names, with its line (``"."``: relative; ``from pagedkv import x``)."""
    names: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.append((node.lineno, "."))
            elif node.module in MODULE_PREFIXES:
                names.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
            else:
                names.append((node.lineno, node.module or ""))
    return names


def defined_private_names(tree: ast.AST) -> set[str]:
    """Underscore names a module defines: functions, classes, assigned names and attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if name.startswith("_")}


def private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``from m import _x``, and ``obj._x`` (``self._x`` too) that the module does not define."""
    own = defined_private_names(tree)
    uses: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            uses.extend(
                (node.lineno, f"{node.module}.{a.name}")
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            )
        elif isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if private and node.attr not in own:
                uses.append((node.lineno, ast.unparse(node)))
    return uses


TORCH_PRIVATE_USES = {  # the only other package's privates the package may use: (path, use): why
    ("impl/serving/model.py", "torch.ops.mkldnn._reorder_linear_weight"): "oneDNN weight prepack",
    ("impl/serving/model.py", "torch.ops.mkldnn._linear_pointwise"): "the prepacked CPU linear",
    ("impl/serving/model.py", "weight._version"): "tells that the prepacked copy is stale",
}


def check_tree(root: Path) -> list[tuple[str, str]]:
    """(path, what) of every break of the layer contract or the private-name rule under root, and
    of every ``TORCH_PRIVATE_USES`` entry whose use its file no longer makes (stale)."""
    violations: list[tuple[str, str]] = []
    stale = set(TORCH_PRIVATE_USES)
    stdlib = set(sys.stdlib_module_names)
    for layer, folder in LAYER_FOLDERS.items():
        directory = root / folder
        for path in sorted(directory.glob("*.py")):
            where = str(path.relative_to(root))
            tree = ast.parse(path.read_text(), filename=where)
            for line, name in imported_names(tree):
                target = layer_of_module(name) if name != "." else None
                top = name.split(".")[0]
                if name == ".":
                    violations.append((f"{where}:{line}", "relative import"))
                elif target is not None and target not in ALLOWED_LAYERS[layer]:
                    violations.append((f"{where}:{line}", f"{layer} imports {name}"))
                elif target is None and top not in stdlib | ALLOWED_THIRD_PARTY[layer]:
                    violations.append((f"{where}:{line}", f"{layer} imports {top}"))
            uses = private_uses(tree)
            stale -= {(where, use) for _, use in uses}
            violations.extend(
                (f"{where}:{line}", f"uses private {use}")
                for line, use in uses
                if (where, use) not in TORCH_PRIVATE_USES
            )
    return violations + [(path, f"stale allowed use {use}") for path, use in sorted(stale)]


def test_the_package_keeps_its_layers_and_privates() -> None:
    assert check_tree(ROOT) == []


def test_every_package_module_is_in_a_checked_layer() -> None:
    """A new subfolder cannot escape the contract: every package folder is a listed layer."""
    package_dirs = {
        str(init.parent.relative_to(ROOT))
        for folder in ("pagedkv", "spec", "impl", "kernels")
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert package_dirs == set(LAYER_FOLDERS.values())


def test_a_wrong_import_fails_the_contract(tmp_path: Path) -> None:
    """On a copy of the tree, each planted break of the contract is reported."""
    for folder in ("pagedkv", "spec", "impl", "kernels"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__py*"))
    (tmp_path / "impl" / "blocks" / "wrong.py").write_text(
        textwrap.dedent(
            """
            import torch
            from pagedkv.impl.blocks.manager import BlockManager


            def export(manager: BlockManager) -> object:
                from pagedkv.impl.serving import engine

                return engine, manager._ref, torch


            class Wrong(BlockManager):
                def inherited(self) -> object:
                    return self._base_private
            """
        )
    )
    (tmp_path / "spec" / "wrong.py").write_text("import numpy\n")
    found = {(where.split(":")[0], what) for where, what in check_tree(tmp_path)}
    assert found == {
        ("impl/blocks/wrong.py", "blocks imports torch"),
        ("impl/blocks/wrong.py", "blocks imports pagedkv.impl.serving.engine"),
        ("impl/blocks/wrong.py", "uses private manager._ref"),
        ("impl/blocks/wrong.py", "uses private self._base_private"),
        ("spec/wrong.py", "spec imports numpy"),
    }


FRESH_PROCESSES = {  # rule -> (a script, what it prints run by a fresh interpreter in tmp_path)
    # The block-management API and the scheduler import, and schedule a step, without torch.
    "blocks-and-scheduler-without-torch": (
        """
        import sys
        from pagedkv.impl.blocks import BlockManager, BlockTableStore, PrefixCachingBlockManager
        from pagedkv.impl.blocks import page_tables
        from pagedkv.impl.serving.scheduler import Scheduler
        from pagedkv import spec

        store = BlockTableStore(PrefixCachingBlockManager(8, 4), 8, 8)
        scheduler = Scheduler(store)
        scheduler.add_request(0, [1, 2, 3, 4, 5], 3)
        plan = scheduler.schedule()
        tables = page_tables.block_tables(store)
        print(len(plan.seqs), tables.tolist(), BlockManager.__name__, spec.__name__)
        print("torch" in sys.modules, "pagedkv.kernels" in sys.modules)
        """,
        ["1 [[0, 1, -1, -1, -1, -1, -1, -1]] BlockManager pagedkv.spec", "False False"],
    ),
    # pagedkv.kernels and Hugging Face's kernels import in one process, each under its own name.
    "beside-hugging-face-kernels": (
        """
        import torch
        import kernels as hf_kernels
        from pagedkv import kernels as paged_kernels

        @hf_kernels.use_kernel_forward_from_hub("RMSNorm")  # registers; downloads nothing
        class Doubler(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return 2 * x

        tables = torch.tensor([[2, 0]], dtype=torch.int32)
        slot = paged_kernels.slot_mapping(tables, torch.tensor([5]), 4, backend="reference")
        print(hf_kernels.__name__, paged_kernels.__name__, hf_kernels is not paged_kernels)
        print(Doubler()(torch.ones(2)).tolist(), slot.tolist())
        """,
        ["kernels pagedkv.kernels True", "[2.0, 2.0] [1]"],
    ),
    # With the repository root on ``sys.path`` the short names refuse: one module, one name.
    "short-names-refuse": (
        f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        for name in ("spec", "impl", "kernels"):
            try:
                __import__(name)
            except ImportError as error:
                print(error)
        """,
        [
            f"import pagedkv.{name}, not {name}: one module, one name"
            for name in ("spec", "impl", "kernels")
        ],
    ),
}


@pytest.mark.parametrize("rule", list(FRESH_PROCESSES))
def test_in_a_fresh_process_outside_the_root(rule: str, tmp_path: Path) -> None:
    source, expected = FRESH_PROCESSES[rule]
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(source)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == expected
