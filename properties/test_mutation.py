"""The mutation tool: its edits are the documented ones, its ids are stable, and under the long
command (``pytest -m long``) a sample of the spec's mutants is killed, as CI would run them."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from properties.mutation import EQUIVALENT, ROOT, apply, module_name, mutants_in, mutants_of, sites

EXAMPLE = '''
def f(x: int = 1) -> bool:
    """Docstrings, annotations and f-strings are never edited."""
    if x < 2 and not x:
        raise ValueError(f"{x + 1}")
    return min(x, 3) == x
'''


def test_edits_are_the_documented_ones() -> None:
    tree = ast.parse(EXAMPLE)
    expected = "1->2 And->Or Lt->LtE 2->3 drop-Not delete-Raise Eq->NotEq min->max 3->4"
    assert [site.operator for site in sites(tree)] == expected.split()
    for index, expected in [(2, "x <= 2 and (not x)"), (4, "x < 2 and x")]:
        edited = ast.parse(EXAMPLE)
        apply(sites(edited)[index])
        assert expected in ast.unparse(edited)


def test_mutant_ids_name_the_file_scope_and_edit() -> None:
    mutants = mutants_of("spec/block_manager.py")
    assert len({m.ident for m in mutants}) == len(mutants)
    ident = "spec/block_manager.py::BlockManager._release::Eq->NotEq::if block.ref_count == 0:"
    assert ident in {m.ident for m in mutants}
    assert module_name("impl/blocks/manager.py") == "pagedkv.impl.blocks.manager"


def test_mutant_ids_survive_edits_elsewhere() -> None:
    """An id names its function, edit and statement: a function added above and the statement
    laid out over lines leave every id as it was."""
    edited = "def g() -> int:\n    return 0\n\n" + EXAMPLE.replace(
        "if x < 2 and not x:", "if (\n        x < 2\n        and not x\n    ):"
    )
    before = {m.ident for m in mutants_in(EXAMPLE, "example.py")}
    after = {m.ident for m in mutants_in(edited, "example.py")}
    assert before < after  # g's own edit is the one new id


@pytest.mark.long
def test_a_sample_of_spec_mutants_is_killed() -> None:
    """Exit status 0: every sampled mutant killed or known equivalent (after a passing baseline)."""
    command = [sys.executable, "-m", "properties.mutation", "spec/block_manager.py"]
    result = subprocess.run(
        [*command, "--sample", "6"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 mutants run" in result.stdout


def test_every_recorded_equivalent_names_a_mutant_of_its_file() -> None:
    """A stale ``EQUIVALENT`` entry (its function edited or renamed) would label nothing, or the
    wrong mutant if the numbering moved onto another."""
    paths = {ident.split("::")[0] for ident in EQUIVALENT}
    idents = {mutant.ident for path in paths for mutant in mutants_of(path)}
    assert sorted(set(EQUIVALENT) - idents) == []
