"""The family registry (topology/families.py) is the one place a family is named: no
product module spells an architecture, and a family registered with nothing else is
synthesized, certified and listed by the matrices."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from skippy.topology import families
from skippy.topology.families import FAMILIES, SynthCase

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("topology", "stages", "cache", "mesh", "proto", "evals")
REGISTRY = {"topology/families.py"}
# Literals equal to an architecture's name that name something else.
NOT_ARCHITECTURES = {
    ("mesh/front/chat.py", "llama"): "a tokenizer model (llama-vocab.cpp's add_bos default)",
    ("evals/bench_constraint.py", "gemma3"): "a result label of the shipped Gemma 3 model",
    **{("mesh/prefix_tokens.py", name): "a llama.cpp pre-tokenizer (tokenizer.ggml.pre)"
       for name in ("olmo", "falcon-h1", "lfm2", "glm4", "minimax-m2")},
}


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _graph_modules() -> set[str]:
    """Each family's own graph module, where it may name itself."""
    return {fam.graph[0].removeprefix("skippy.").replace(".", "/") + ".py"
            for fam in FAMILIES.values() if fam.graph}


def test_no_product_module_spells_an_architecture():
    archs = set(FAMILIES)
    allowed = REGISTRY | _graph_modules() | {"mesh/models.py"}  # the model catalogue
    found = []
    for top in PRODUCT:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in allowed:
                continue
            tree = ast.parse(path.read_text(), rel)
            docs = _docstrings(tree)
            found += [f"{rel}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
                      if isinstance(n, ast.Constant) and n.value in archs
                      and id(n) not in docs and (rel, n.value) not in NOT_ARCHITECTURES]
    assert not found, "\n".join(found)


@pytest.fixture
def toy(smollm2, monkeypatch):
    """A llama-shaped family under a new name, on the shared decoder: one registry entry."""
    toy = dataclasses.replace(
        FAMILIES["llama"], name="toyllama",
        cases=(SynthCase("toyllama", "Toy llama", 2, 3,
                         settings=(("hidden", 64), ("ff", 128), ("heads", 2),
                                   ("kv_heads", 1))),))
    monkeypatch.setitem(FAMILIES, "toyllama", toy)
    return toy


def test_a_family_registered_alone_is_synthesized_certified_and_listed(toy, tmp_path):
    from skippy.evals import certify_matrix, family_matrix
    from skippy.stages.certify import certify
    from skippy.topology.gguf_file import GGUFFile
    path = certify_matrix.model_path("toyllama", synth_dir=tmp_path)
    f = GGUFFile(path)
    assert f.architecture == "toyllama" and f.arch_key("embedding_length") == 64
    f.close()
    report = certify(path, 2, weight_format="fp32")
    assert report.passed, report.table()
    assert "toyllama" in certify_matrix.default_models()
    entry = family_matrix.matrix()["toyllama"]
    assert entry.label == "Toy llama" and entry.family.kind == "dense"
    assert entry.family.shape.arch == "toyllama"


def test_every_case_names_a_family_with_a_table_and_names_are_unique():
    names = [case.name for _, case in families.synth_cases()]
    assert len(names) == len(set(names))
    assert all(fam.synth is not None for fam, _ in families.synth_cases())
    assert families.synth_case("llama3")[0] is FAMILIES["llama"]
    with pytest.raises(families.UnsupportedFamily, match="no synthetic file 'nope'"):
        families.synth_case("nope")
