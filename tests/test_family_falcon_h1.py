"""Falcon-H1, Mamba2 SSM and attention in parallel in every layer, on a synthetic GGUF: what
only this family has (its file, its f32 SSM parameters, its conv and SSM state). The family
bar (tests/test_family_bar.py) runs llama.cpp agreement, resume and export checks on the
registry's file; tests/test_certify.py its split equivalence at 3 stages in every format."""

from __future__ import annotations

import numpy as np
import torch

from skippy.evals.numerics import top2_margins
from skippy.evals.reference import LlamaCppReference
from skippy.stages.layers import rms_norm
from skippy.stages.runtime import StageSpec
from skippy.stages.synth import write_synthetic
from skippy.stages.synth_hybrid import FALCON_H1_SSM, falcon_h1_conv_dim
from skippy.stages.torch_runtime import TorchStageRuntime
from skippy.topology.families import family_for
from skippy.topology.gguf_file import GGUFFile
from skippy.topology.model_config import ModelConfig

LAYERS = 4
CHUNK = 32
PROMPT = [(i * 7919) % 40000 + 100 for i in range(150)]  # boundaries 32, 64, 96, 128
SSM = FALCON_H1_SSM
SSM_STATE = (SSM["heads"], SSM["d_inner"] // SSM["heads"], SSM["d_state"])


def runtime(path, **kw) -> TorchStageRuntime:
    return TorchStageRuntime(StageSpec(str(path), 0, LAYERS, n_ctx=512, **kw))


# -- the family and its file ------------------------------------------------------------------
def test_falcon_h1_is_a_kv_recurrent_family():
    fam = family_for("falcon-h1")
    assert fam.cache_policy == "KvRecurrent" and fam.recurrent_mixer == "mamba2_parallel"


def test_synthetic_file_layout_and_config(falcon_h1_f32, smollm2, tmp_path):
    f = GGUFFile(falcon_h1_f32)
    conv_dim = falcon_h1_conv_dim()
    assert f.tensors["blk.0.ssm_conv1d.weight"].shape == (SSM["d_conv"], conv_dim)  # ggml order
    assert f.tensors["blk.0.ssm_conv1d.weight"].qtype.name == "F32"
    assert f.tensors["blk.0.ssm_a"].shape == (1, SSM["heads"])
    assert f.tensors["blk.0.ssm_in.weight"].shape == (256, SSM["d_inner"] + conv_dim + SSM["heads"])
    assert "blk.0.ffn_norm" in f.tensors and "blk.0.ffn_norm.weight" not in f.tensors
    assert (np.asarray(f.raw("blk.0.ssm_a")).view(np.float32) < 0).all()
    cfg = ModelConfig.from_gguf(f)
    assert cfg.ssm_layers == set(range(LAYERS)) and cfg.is_recurrent
    assert (cfg.ssm_d_conv, cfg.ssm_d_inner, cfg.ssm_d_state, cfg.ssm_heads, cfg.ssm_groups) == \
        (SSM["d_conv"], SSM["d_inner"], SSM["d_state"], SSM["heads"], SSM["groups"])
    f.close()
    again = write_synthetic("falcon-h1", layers=LAYERS, seed=7, out=tmp_path / "again.gguf",
                            tokenizer_from=smollm2)
    assert again.read_bytes() == falcon_h1_f32.read_bytes()


# -- llama.cpp as the reference ---------------------------------------------------------------
def test_f16_file_keeps_ssm_params_f32_and_matches_llama_cpp(smollm2, tmp_path):
    """llama.cpp's ssm_conv reads only f32 kernels; its f16 matmuls round activations to
    f16, so the bar is top-1, not 1e-3."""
    path = write_synthetic("falcon-h1", layers=2, seed=7, out=tmp_path / "f16.gguf",
                           tokenizer_from=smollm2, dtype="f16")
    f = GGUFFile(path)
    for name in ("ssm_conv1d.weight", "ssm_a", "ssm_d", "ssm_norm.weight"):
        assert f.tensors[f"blk.0.{name}"].qtype.name == "F32"
    assert f.tensors["blk.0.ssm_in.weight"].qtype.name == "F16"
    f.close()
    expected = LlamaCppReference(path, n_ctx=256).logits(PROMPT)
    rt = TorchStageRuntime(StageSpec(str(path), 0, 2, n_ctx=256))
    got = rt.prefill(rt.alloc_lane(), torch.tensor(PROMPT), logits="all").logits.numpy()
    clear = top2_margins(expected) > 0.02  # well above the f16 rounding seen (< 0.01)
    print(f"\nfalcon-h1 f16: top-1 {(got.argmax(-1) == expected.argmax(-1)).mean():.3f}, "
          f"max |dlogit| {np.abs(got - expected).max():.2e}")
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.98
    assert (got.argmax(-1)[clear] == expected.argmax(-1)[clear]).all()
    assert np.abs(got - expected).max() < 0.05


# -- recurrent state -------------------------------------------------------------------------
def test_a_snapshot_holds_the_conv_and_ssm_state_of_every_layer(falcon_h1_f32):
    rt = runtime(falcon_h1_f32, chunk=CHUNK)
    snaps = rt.prefill(rt.alloc_lane(), torch.tensor(PROMPT), logits="none",
                       snapshots=(32, 64)).snapshots
    names = sorted(f"{kind}.{i}" for i in range(LAYERS) for kind in ("conv", "ssm"))
    for b, snap in snaps.items():
        assert snap.n_tokens == b and snap.prefilled == b
        assert sorted(snap.fixed) == names
        assert snap.fixed["conv.0"].shape == (SSM["d_conv"] - 1, falcon_h1_conv_dim())
        assert snap.fixed["ssm.0"].shape == SSM_STATE


def test_padding_rows_never_enter_the_recurrent_state(falcon_h1_f32):
    """A 40-row prefill (chunk 32: 8 real rows + 24 padding in the second chunk): layer 0's
    conv state is exactly xBC of real rows 37..39, and its SSM state is the scan over the 8
    real rows from the state at 32, not over the padding after them."""
    rt = runtime(falcon_h1_f32, chunk=CHUNK)
    lane = rt.alloc_lane()
    at32 = rt.prefill(lane, torch.tensor(PROMPT[:40]), logits="none",
                      snapshots=(32,)).snapshots[32].fixed
    state = rt.export_state(lane, 40).fixed
    m = rt.layers[0].mixer.ssm
    ids = torch.tensor(PROMPT[32:40] + [0] * 24)
    h = rms_norm(rt.embed(ids), rt.layers[0].attn_norm.weight,
                 rt.cfg.rms_eps)
    _, xbc, dt = m.in_proj(h).split([m.d_inner, m.conv_dim, m.n_head], dim=-1)
    assert torch.equal(state["conv.0"], xbc[5:8])
    # an independent scan (float64) over the real rows only, from the state at 32
    full = torch.cat([at32["conv.0"], xbc]).double()
    conv = sum(full[j:j + 32] * m.taps[j].double() for j in range(SSM["d_conv"]))
    xs, bs, _ = torch.nn.functional.silu(conv + m.conv_bias.double()).split(
        [m.d_inner, SSM["groups"] * SSM["d_state"], SSM["groups"] * SSM["d_state"]], dim=-1)
    delta = torch.nn.functional.softplus(dt.double() + m.dt_bias.double())
    s = at32["ssm.0"].double()
    rep = SSM["heads"] // SSM["groups"]
    for t in range(32):
        x = xs[t].view(SSM["heads"], -1)
        bg = bs[t].view(SSM["groups"], -1).repeat_interleave(rep, dim=0)
        s = s * torch.exp(delta[t] * m.A.double())[:, None, None] \
            + (x * delta[t][:, None])[:, :, None] * bg[:, None, :]
        if t == 7:
            real = s.clone()
    assert torch.allclose(state["ssm.0"].double(), real, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(state["ssm.0"].double(), s, rtol=1e-2, atol=1e-3)
