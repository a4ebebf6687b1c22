"""Packages: a model split by layer loads stage by stage, bitwise as the GGUF does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from skippy.mesh.cli import main as cli_main
from skippy.stages.chain import StageChain
from skippy.stages.package import split_package
from skippy.stages.runtime import StageSpec
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_package import (MANIFEST, ModelPackage, PackageError, open_model,
                                           verify_package)
from skippy.topology.planner import ModelFacts, gguf_model_digest

PROMPT_IDS = list(range(1, 90))


@pytest.fixture(scope="module")
def smollm2_pkg(smollm2, tmp_path_factory):
    return _split(smollm2, tmp_path_factory.mktemp("pkg") / "smollm2")


@pytest.fixture(scope="module")
def gemma3_pkg(gemma3, tmp_path_factory):
    return _split(gemma3, tmp_path_factory.mktemp("pkg") / "gemma3")


def _split(model: Path, out: Path) -> Path:
    split_package(model, out)
    return out


def _logits(path: Path, n_stages: int) -> torch.Tensor:
    pipe = StageChain(path, n_stages)
    return pipe.prefill(pipe.alloc(), PROMPT_IDS, logits="all")


def _copy_package(pkg: Path, dst: Path) -> Path:
    shutil.copytree(pkg, dst)
    return dst


def _flip_byte(path: Path, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))


# -- logits ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_smollm2_package_logits_bitwise_equal_to_gguf(smollm2, smollm2_pkg, n_stages):
    assert torch.equal(_logits(smollm2_pkg, n_stages), _logits(smollm2, n_stages))


@pytest.mark.slow
def test_gemma3_package_logits_bitwise_equal_to_gguf(gemma3, gemma3_pkg):
    # 3 stages: first, middle and last each load from the package (the last one reads the
    # tied embeddings); every split is SmolLM2's check above
    assert torch.equal(_logits(gemma3_pkg, 3), _logits(gemma3, 3))


def test_package_stage_has_the_gguf_stages_identity(smollm2, smollm2_pkg):
    # the same bytes loaded: the same weights digest, so caches are shared between the two
    spec = dict(layer_start=10, layer_end=20, stage_index=1, n_stages=3)
    a = TorchStageRuntime(StageSpec(str(smollm2_pkg), **spec))
    b = TorchStageRuntime(StageSpec(str(smollm2), **spec))
    assert a.identity() == b.identity()


# -- only your parts -------------------------------------------------------------------------
def test_middle_stage_loads_from_only_its_own_parts(smollm2, smollm2_pkg, tmp_path):
    manifest = json.loads((smollm2_pkg / MANIFEST).read_text())
    keep = {"shared.gguf"} | {f"layer-{i:03d}.gguf" for i in range(10, 20)}
    pkg = tmp_path / "partial"
    pkg.mkdir()
    shutil.copy(smollm2_pkg / MANIFEST, pkg)
    for part in manifest["parts"]:
        if part["file"] in keep:
            shutil.copy(smollm2_pkg / part["file"], pkg)
    spec = dict(layer_start=10, layer_end=20, stage_index=1, n_stages=3)
    rt = TorchStageRuntime(StageSpec(str(pkg), **spec))
    ref = TorchStageRuntime(StageSpec(str(smollm2), **spec))
    assert rt.weights_digest == ref.weights_digest
    with pytest.raises(PackageError, match="embeddings.gguf is missing"):
        TorchStageRuntime(StageSpec(str(pkg), 0, 10, 0, 3))


def test_tied_head_last_stage_reads_the_embeddings_part(smollm2_pkg):
    pkg = ModelPackage(smollm2_pkg)
    names = ["output_norm.weight", "token_embd.weight"]
    assert [p.file for p in pkg.parts_for(names)] == ["embeddings.gguf", "output.gguf"]
    assert pkg.manifest.tied_head


# -- the package's files ---------------------------------------------------------------------
def test_manifest_names_every_tensor_once_with_its_hash(smollm2, smollm2_pkg):
    f = GGUFFile(smollm2)
    m = json.loads((smollm2_pkg / MANIFEST).read_text())
    assert (m["format"], m["version"]) == ("skippy-package", 1)
    assert m["architecture"] == "llama" and m["n_layers"] == 30
    assert m["model_digest"] == gguf_model_digest(f)
    files = [p["file"] for p in m["parts"]]
    assert files[:2] == ["shared.gguf", "embeddings.gguf"] and files[-1] == "output.gguf"
    assert files[2:-1] == [f"layer-{i:03d}.gguf" for i in range(30)]
    names = [t["name"] for p in m["parts"] for t in p["tensors"]]
    assert sorted(names) == sorted(f.tensors)
    for p in m["parts"]:
        assert (smollm2_pkg / p["file"]).stat().st_size == p["size"]
        assert len(p["blake3"]) == 64


def test_every_part_is_a_gguf_that_gguf_py_reads(smollm2, smollm2_pkg):
    src = GGUFFile(smollm2)
    layer = GGUFReader(smollm2_pkg / "layer-004.gguf")
    assert {t.name for t in layer.tensors} == {n for n in src.tensors if n.startswith("blk.4.")}
    for t in layer.tensors:
        assert np.array_equal(np.asarray(t.data).view(np.uint8).ravel(),
                              np.asarray(src.raw(t.name)))
    assert layer.fields["llama.block_count"].contents() == 30
    assert "tokenizer.ggml.tokens" not in layer.fields  # only the shared part carries it
    shared = GGUFReader(smollm2_pkg / "shared.gguf")
    assert len(shared.tensors) == 0
    tokens = shared.fields["tokenizer.ggml.tokens"].contents()
    assert tokens == src.get("tokenizer.ggml.tokens")


def test_package_reads_like_its_gguf(smollm2, smollm2_pkg):
    f, pkg = GGUFFile(smollm2), open_model(smollm2_pkg)
    assert isinstance(pkg, ModelPackage)
    assert pkg.architecture == f.architecture
    assert pkg.get("tokenizer.chat_template") == f.get("tokenizer.chat_template")
    for name, info in f.tensors.items():
        assert (pkg.tensors[name].shape, pkg.tensors[name].qtype) == (info.shape, info.qtype)
    assert np.array_equal(pkg.raw("blk.7.ffn_up.weight"), f.raw("blk.7.ffn_up.weight"))
    assert ModelFacts.from_gguf(smollm2_pkg) == \
        replace(ModelFacts.from_gguf(smollm2), name=smollm2_pkg.name)


def test_split_refuses_a_non_empty_directory(smollm2, tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(PackageError, match="not an empty directory"):
        split_package(smollm2, tmp_path)


# -- split GGUF sets -------------------------------------------------------------------------
def _reshard(src: Path, out_dir: Path, max_tensors: int) -> list[Path]:
    """Rewrite a small GGUF as a split set with gguf-py's own sharding writer."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out_dir / "model.gguf", arch, split_max_tensors=max_tensors)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(out_dir.glob("model-*-of-*.gguf"))


def test_split_gguf_set_packs_like_the_single_file(smollm2, qwen3_f32, tmp_path):
    shards_dir = tmp_path / "shards"
    shards_dir.mkdir()
    shards = _reshard(qwen3_f32, shards_dir, max_tensors=20)
    assert len(shards) >= 3
    from_set = split_package(shards[0], tmp_path / "from-set")
    from_file = split_package(qwen3_f32, tmp_path / "from-file")
    def layout(m):
        return [[(t.name, t.shape, t.qtype, t.nbytes) for t in p.tensors] for p in m.parts]

    assert layout(from_set) == layout(from_file)
    assert from_set.source == tuple(p.name for p in shards)
    pkg = ModelPackage(tmp_path / "from-set")
    assert not any(k.startswith("split.") for k in pkg.metadata)
    expected = _logits(qwen3_f32, 3)
    assert torch.equal(_logits(tmp_path / "from-set", 3), expected)
    shards[1].unlink()
    with pytest.raises(PackageError, match=f"shard {shards[1].name} is missing"):
        split_package(shards[0], tmp_path / "again")


def test_layers_present_counts_parts_at_their_size_of_this_model(smollm2_pkg, tmp_path):
    from skippy.topology.model_package import PackageManifest, layers_present
    digest = PackageManifest.load(smollm2_pkg).model_digest
    assert layers_present(smollm2_pkg, digest) == frozenset(range(30))
    pkg = _copy_package(smollm2_pkg, tmp_path / "some")
    (pkg / "layer-003.gguf").unlink()
    with open(pkg / "layer-004.gguf", "r+b") as fh:
        fh.truncate(100)
    assert layers_present(pkg, digest) == frozenset(range(30)) - {3, 4}
    assert layers_present(pkg, "0" * 64) == frozenset()  # another model's package
    assert layers_present(tmp_path / "nothing", digest) == frozenset()


def test_a_head_holding_some_parts_verifies_those_and_needs_the_shared_one(smollm2_pkg,
                                                                          tmp_path):
    """A cluster's head may hold the manifest and a few parts; nodes fetch the rest."""
    pkg = _copy_package(smollm2_pkg, tmp_path / "head")
    for layer in range(5, 30):
        (pkg / f"layer-{layer:03d}.gguf").unlink()
    with pytest.raises(PackageError, match="layer-005.gguf is missing"):
        verify_package(pkg)
    verify_package(pkg, held_only=True)
    _flip_byte(pkg / "layer-002.gguf", 500_000)
    with pytest.raises(PackageError, match="layer-002.gguf is corrupted"):
        verify_package(pkg, held_only=True)
    (pkg / "shared.gguf").unlink()
    with pytest.raises(PackageError, match="shared.gguf is missing"):
        verify_package(pkg, held_only=True)


# -- corruption ------------------------------------------------------------------------------
def test_corrupt_byte_fails_verify_and_load_naming_the_part(smollm2_pkg, tmp_path):
    pkg = _copy_package(smollm2_pkg, tmp_path / "bad")
    _flip_byte(pkg / "layer-012.gguf", 500_000)
    with pytest.raises(PackageError, match="layer-012.gguf is corrupted"):
        verify_package(pkg)
    with pytest.raises(PackageError, match="layer-012.gguf is corrupted"):
        TorchStageRuntime(StageSpec(str(pkg), 10, 20, 1, 3))
    TorchStageRuntime(StageSpec(str(pkg), 20, 30, 2, 3))  # other stages' parts are fine


def _manifest_only(tmp_path: Path, manifest: dict) -> Path:
    """A package directory holding only this manifest (the name checks need no part)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / MANIFEST).write_text(json.dumps(manifest))
    return pkg


@pytest.mark.parametrize("field,value,reason", [
    ("file", "../layer-003.gguf", "holds a path separator"),
    ("file", "..", "holds '..'"),
    ("file", "layer..gguf", "holds '..'"),
    ("file", "/etc/passwd", "is an absolute path"),
    ("file", "sub/layer-003.gguf", "holds a path separator"),
    ("file", "sub\\layer-003.gguf", "holds a path separator"),
    ("file", "", "is empty"),
    ("file", "layer\0.gguf", "holds a NUL byte"),
    ("file", ".", "names the directory"),
    ("name", "../layer-003", "holds a path separator"),
    ("name", "", "is empty"),
])
def test_a_manifest_naming_a_part_outside_the_package_is_refused(smollm2_pkg, tmp_path,
                                                                 field, value, reason):
    manifest = json.loads((smollm2_pkg / MANIFEST).read_text())
    manifest["parts"][5][field] = value
    pkg = _manifest_only(tmp_path, manifest)
    message = f"part {field} {value!r} is not allowed: it {reason}"
    for load in (verify_package, ModelPackage):
        with pytest.raises(PackageError) as e:
            load(pkg)
        assert message in str(e.value)
    from skippy.topology.model_package import layers_present
    assert layers_present(pkg, manifest["model_digest"]) == frozenset()


def test_a_manifest_listing_one_file_twice_is_refused(smollm2_pkg, tmp_path):
    manifest = json.loads((smollm2_pkg / MANIFEST).read_text())
    manifest["parts"][5]["file"] = manifest["parts"][4]["file"]
    pkg = _manifest_only(tmp_path, manifest)
    with pytest.raises(PackageError, match="part file 'layer-002.gguf' is listed twice"):
        verify_package(pkg)


def test_a_manifest_part_name_must_be_text(smollm2_pkg, tmp_path):
    manifest = json.loads((smollm2_pkg / MANIFEST).read_text())
    manifest["parts"][5]["file"] = ["..", "x"]
    pkg = _manifest_only(tmp_path, manifest)
    with pytest.raises(PackageError, match="malformed manifest .*is not a string"):
        verify_package(pkg)


def test_cli_verify_and_serve_fail_on_a_bad_part_in_one_line(smollm2_pkg, tmp_path, capsys):
    pkg = _copy_package(smollm2_pkg, tmp_path / "bad")
    assert cli_main(["package", "verify", str(pkg)]) == 0
    _flip_byte(pkg / "output.gguf", 100)
    assert cli_main(["package", "verify", str(pkg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "part output.gguf is corrupted" in err
    (pkg / "layer-003.gguf").unlink()   # missing is fine (fetched from a peer); corrupt is not
    assert cli_main(["serve", "--package", str(pkg), "--stages", "2"]) == 2
    assert "part output.gguf is corrupted" in capsys.readouterr().err
    assert cli_main(["serve", "--package", str(smollm2_pkg), "--runtime", "llama.cpp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a package" in err
    from skippy.stages.llamacpp_runtime import LlamaCppStageRuntime
    from skippy.stages.runtime import StageError
    with pytest.raises(StageError, match="not a package"):
        LlamaCppStageRuntime(StageSpec(str(smollm2_pkg), 0, 30))


def test_cli_split_writes_a_verified_package(smollm2, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["package", "split", str(smollm2), "--out", str(out)]) == 0
    assert "33 parts" in capsys.readouterr().out
    verify_package(out)


# -- memory ----------------------------------------------------------------------------------
_MEASURE = textwrap.dedent("""
    import json, sys
    from skippy.stages.package import split_package
    from skippy.topology.gguf_file import GGUFFile

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    largest = max(t.nbytes for t in GGUFFile(sys.argv[1]).tensors.values())
    base = status("VmRSS")
    split_package(sys.argv[1], sys.argv[2])
    print(json.dumps({"base": base, "peak": status("VmHWM"), "largest": largest}))
""")


def test_splitting_gemma3_holds_about_one_tensor(gemma3, tmp_path):
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(gemma3), str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    grown = m["peak"] - m["base"]
    limit = 2 * m["largest"] + 256 * 2**20
    print(f"split gemma3: peak RSS - RSS after imports = {grown / 2**20:.1f} MiB "
          f"(largest tensor {m['largest'] / 2**20:.1f} MiB, limit {limit / 2**20:.1f} MiB)")
    assert grown <= limit
