"""Random-weight GGUFs of model families we have no real checkpoint for.

llama.cpp loads and runs these files, so they give an independent numeric reference for
our torch port of each family (DESIGN.md §7). A family's registry entry
(topology/families.py) names its synthetic table (stages/synth_*.py: default sizes, knobs,
hyperparameter keys, tensor list with shapes); this one writer turns a table and knob
values into a file. The vocabulary (all `tokenizer.*` keys) is borrowed from a real GGUF
such as SmolLM2's.

The writer streams: the header, metadata and tensor index go out first, then each tensor
is generated just before it is written, so peak memory is about one tensor even for a
multi-GiB file. Every tensor's values come from an RNG seeded by (seed, tensor name), so
the same arguments always give a byte-identical file.
"""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path

import blake3
import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from skippy.topology.families import FAMILIES, synth_archs
from skippy.topology.tally import Progress, Tally

from .synth_dense import llama3_rope_factors
from .synth_gemma4 import rope_divisors
from .synth_table import SynthError, SynthTable, TensorSpec, knob_suffix

# Bumped whenever the values a given (arch, sizes, seed) produce change, so a file's
# provenance says which generator made it.
SYNTH_VERSION = 1

_DTYPES = {"f32": (np.float32, 0), "f16": (np.float16, 1)}  # -> (numpy dtype, general.file_type)

# Rows of scratch generated at a time (in float32) before casting into the output tensor,
# so an f16 tensor never needs a full-size float32 twin.
_CHUNK_ELEMENTS = 1 << 22


def synth_table(arch: str) -> SynthTable:
    """`arch`'s synthetic table, imported from the module its registry entry names."""
    fam = FAMILIES.get(arch)
    if fam is None or fam.synth is None:
        raise SynthError(f"unknown synthetic arch {arch!r}; known: {', '.join(synth_archs())}")
    module, name = fam.synth
    return getattr(importlib.import_module(module), name)


def synth_file_name(arch: str, *, layers: int, seed: int, dtype: str = "f32",
                    **settings: object) -> str:
    """The default name of a file: the arch, layers, seed, dtype and every knob set to
    other than its default, so two files that differ anywhere have two names."""
    knobs = knob_suffix(synth_table(arch).changed(arch, settings))
    return f"{arch}-L{layers}-s{seed}-{dtype}{knobs}.gguf"


# -- the shared writer ------------------------------------------------------------------------
def write_synthetic(arch: str, *, layers: int, seed: int, out: Path, tokenizer_from: Path,
                    dtype: str = "f32", progress: Progress | None = None,
                    chat_template: str | None = None, **settings: object) -> Path:
    """Write a random-weight `arch` GGUF with `layers` blocks to `out`; return `out`.

    `settings` are the arch's knobs (SynthTable.knobs: sizes such as hidden or head_dim,
    its own options such as deepseek2's kv_lora_rank, llama's rope_freqs, gemma4's
    variant), each checked against its table; None means not set. 2-D weights are stored
    as `dtype` ("f32" or "f16"); 1-D norm weights (and tensors marked always_f32, such as
    LFM2's conv kernels) are always f32. `chat_template` replaces the borrowed
    tokenizer's chat template (Jinja text). `progress(done, total)` hears the tensor bytes
    written. The file appears atomically (written under a temporary name, then renamed),
    so an interrupted write never leaves a loadable stub."""
    table = synth_table(arch)
    if dtype not in _DTYPES:
        raise SynthError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise SynthError(f"seed must be an integer in [0, 2**63), not {seed!r}")
    table.checked(arch, settings)  # a bad knob is named before the tokenizer is read
    tok = _tokenizer_kv(Path(tokenizer_from), chat_template)
    dims = table.resolve(arch, layers, len(tok["tokenizer.ggml.tokens"][0]), settings)
    np_dtype, file_type = _DTYPES[dtype]
    out = Path(out)
    tensors = table.tensors(dims)
    tmp = out.with_name(out.name + ".partial")
    writer = GGUFWriter(tmp, arch)
    try:
        _add_metadata(writer, arch, layers, seed, file_type, table.hparams(dims), tok)
        if dims.variant:
            writer.add_string("skippy.synth.variant", dims.variant)
        _add_tensors(writer, tensors, seed, np_dtype, progress)
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out


def synth_bytes(arch: str, *, layers: int, vocab: int, dtype: str = "f32",
                **settings: object) -> int:
    """Tensor bytes of the file write_synthetic would write with these arguments (its
    metadata aside): lets a caller pick the layer count that reaches a size."""
    table = synth_table(arch)
    dims = table.resolve(arch, layers, vocab, settings)
    item = np.dtype(_DTYPES[dtype][0]).itemsize
    return sum(int(np.prod(t.shape)) * (4 if len(t.shape) == 1 or t.always_f32 else item)
               for t in table.tensors(dims))


def synth_description(arch: str, layers: int, **settings: object) -> str:
    """What the table fixes beyond the sizes (e.g. a hybrid's layer pattern), or ""."""
    table = synth_table(arch)
    if table.describe is None:
        return ""
    return table.describe(table.resolve(arch, layers, 1, settings))


def _add_metadata(writer: GGUFWriter, arch: str, layers: int, seed: int, file_type: int,
                  hparams: dict, tok: dict) -> None:
    """The file's name, type, the architecture's hyperparameters, our synth keys and the
    borrowed tokenizer."""
    writer.add_name(f"synthetic {arch} L{layers} seed {seed}")
    writer.add_file_type(file_type)
    for key, value in hparams.items():
        _add_typed(writer, f"{arch}.{key}", value)
    writer.add_uint64("skippy.synth.seed", seed)
    writer.add_string("skippy.synth.arch", arch)
    writer.add_uint32("skippy.synth.version", SYNTH_VERSION)
    for key, (value, vtype, sub_type) in tok.items():
        writer.add_key_value(key, value, vtype, sub_type)


def _add_tensors(writer: GGUFWriter, tensors: list[TensorSpec], seed: int, np_dtype,
                 progress: Progress | None) -> None:
    """Header, metadata and tensor infos, then each tensor's random data in turn."""
    stored = [np.float32 if len(t.shape) == 1 or t.always_f32 else np_dtype for t in tensors]
    sizes = [int(np.prod(t.shape)) * np.dtype(dt).itemsize for t, dt in zip(tensors, stored)]
    for t, dt, nbytes in zip(tensors, stored, sizes):
        writer.add_tensor_info(t.name, t.shape, np.dtype(dt), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    written = Tally(sum(sizes), progress)
    for t, dt, nbytes in zip(tensors, stored, sizes):
        writer.write_tensor_data(_generate(t, seed, dt))
        written.add(nbytes)


def _add_typed(writer: GGUFWriter, key: str,
               value: int | float | bool | str | list[int]) -> None:
    # llama.cpp reads hparams as u32 / f32 (arrays of i32); Python ints and floats
    # would otherwise be guessed as 64-bit by gguf-py.
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):  # before int: a bool is an int to Python
        writer.add_bool(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list) and value and all(isinstance(v, bool) for v in value):
        writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.BOOL)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_key_value(key, list(value), GGUFValueType.ARRAY, GGUFValueType.INT32)


def _rng(seed: int, name: str) -> np.random.Generator:
    # Per-tensor streams: a tensor's values do not depend on which other tensors exist, so
    # a model with more layers shares its first layers' weights with a shorter one.
    digest = blake3.blake3(f"skippy.synth/{seed}/{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


def _generate(t: TensorSpec, seed: int, dtype: type[np.generic]) -> np.ndarray:
    if t.init == "rope_freqs":
        return llama3_rope_factors(t.shape[0]).astype(dtype)
    if t.init == "rope_divisors":
        return rope_divisors(t.shape[0]).astype(dtype)
    rng = _rng(seed, t.name)
    out = np.empty(t.shape, dtype=dtype)
    if t.init == "norm":
        mean, std = 1.0, 0.1
    elif t.init == "head_norm":
        mean, std = 0.3, 0.03
    elif t.init == "qk_norm":  # norm weights that also carry the 1/sqrt(head_dim) scale
        mean = float(t.shape[0]) ** -0.25
        std = 0.1 * mean
    elif t.init in ("bias", "ssm_a"):  # ssm_a: -exp(N(0, 0.5)), negative decay rates
        mean, std = 0.0, (0.1 if t.init == "bias" else 0.5)
    elif t.init == "embed":
        mean, std = 0.0, 1.0
    elif t.init == "tied_embed":
        mean, std = 0.0, 0.25 / np.sqrt(t.shape[-1])
    else:
        mean, std = 0.0, 1.0 / np.sqrt(t.shape[-1])
    flat = out.reshape(t.shape[0], -1)
    rows = max(1, _CHUNK_ELEMENTS // flat.shape[1])
    for r in range(0, flat.shape[0], rows):
        block = rng.standard_normal((min(rows, flat.shape[0] - r), flat.shape[1]), dtype=np.float32)
        block *= np.float32(std)
        block += np.float32(mean)
        if t.init == "ssm_a":
            block = -np.exp(block)
        flat[r:r + rows] = block
    return out


# -- tokenizer borrowing ----------------------------------------------------------------------
TokenizerKv = dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]


def _tokenizer_kv(path: Path, chat_template: str | None = None) -> TokenizerKv:
    """The tokenizer keys of `path`, with `chat_template` instead of its own if given."""
    if not path.is_file():
        raise SynthError(f"tokenizer GGUF not found: {path}")
    st = path.stat()
    kv = _read_tokenizer_kv(path.resolve(), st.st_size, st.st_mtime_ns)
    if chat_template is None:
        return kv
    return {**kv, "tokenizer.chat_template": (chat_template, GGUFValueType.STRING, None)}


@functools.lru_cache(maxsize=4)
def _read_tokenizer_kv(path: Path, size: int, mtime_ns: int) -> TokenizerKv:
    # Cached on (path, size, mtime): GGUFReader takes seconds over a vocabulary's arrays
    # (evals/README.md, GGUF reading), and callers (tests, sweeps) write many models with
    # the same tokenizer.
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise SynthError(f"cannot read tokenizer GGUF {path}: {e}") from e
    kv: TokenizerKv = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        if vtype == GGUFValueType.ARRAY and len(field.types) != 2:
            raise SynthError(f"{path}: nested array {key} is not supported")
        kv[key] = (field.contents(), vtype, sub_type)
    if "tokenizer.ggml.tokens" not in kv:
        raise SynthError(f"{path} has no tokenizer.ggml.tokens; pick a GGUF with a vocabulary")
    return kv
