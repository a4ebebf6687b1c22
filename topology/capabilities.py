"""Capability registry: which cache policy a model may be served with.

Dense attention families reuse resident KV (ResidentKv). Hybrid and recurrent families
must restore KV and recurrent state together (KvRecurrent), never KV alone: their next
token depends on state KV does not hold. Anything not certified runs with the cache off,
and says so once at startup. The guard looks at the file itself, not only at the
architecture name, so a hybrid checkpoint under a dense name is still caught.
"""

from __future__ import annotations

from dataclasses import dataclass

from .families import FAMILIES
from .gguf_file import GGUFFile

# Tensor-name fragments of recurrent / state-space layers (llama.cpp naming).
RECURRENT_MARKERS = (".ssm", "ssm_", "time_mix", "recurrent", "rwkv", "shortconv",
                     "conv1d", "delta_net")


@dataclass(frozen=True)
class Capability:
    architecture: str
    hybrid: bool
    policy: str      # "ResidentKv", "KvRecurrent" or "disabled"
    reason: str      # one line for the startup log


def recurrent_evidence(f: GGUFFile) -> str | None:
    """Why the file looks hybrid/recurrent (a tensor name or per-layer KV heads), or None."""
    for name in f.tensors:
        for marker in RECURRENT_MARKERS:
            if marker in name:
                return f"tensor {name}"
    kv = f.arch_key("attention.head_count_kv")
    if isinstance(kv, list) and (0 in kv or len(set(kv)) > 1):
        return f"per-layer KV head counts {sorted(set(kv))}"
    return None


def capability_for(f: GGUFFile) -> Capability:
    arch = f.architecture
    family = FAMILIES.get(arch)
    evidence = recurrent_evidence(f)
    if family is None:
        return Capability(arch, evidence is not None, "disabled",
                          f"cache disabled: architecture '{arch}' has no certified cache policy")
    if evidence is None:
        if family.cache_policy == "KvRecurrent":
            return Capability(arch, True, "KvRecurrent", f"{arch}: KvRecurrent")
        return Capability(arch, False, "ResidentKv", f"{arch}: ResidentKv (dense attention)")
    if family.cache_policy == "KvRecurrent":
        return Capability(arch, True, "KvRecurrent",
                          f"{arch}: KvRecurrent (recurrent state found: {evidence})")
    return Capability(arch, True, "disabled",
                      f"cache disabled: {arch} is registered dense but the file has "
                      f"recurrent state ({evidence}); KV alone would not be exact")
