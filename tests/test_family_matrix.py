"""evals/family_matrix.py's table and plot from results as run_family returns them, and
its entries: every family the runtime has, each a file synth can write."""

from __future__ import annotations

from skippy.evals import family_matrix as fm
from skippy.evals import plots
from skippy.topology.families import FAMILIES, synth_archs


def _result(label: str, payload: str, speedup: float) -> dict:
    row = {"prefix_tokens": 128, "request_tokens": 144, "llama_cpp_ms": 20.0,
           "ours_ms": 20.0 / speedup, "speedup": speedup, "bitwise": True}
    return {"family": label.lower(), "label": label, "payload": payload,
            "certify": {"fp32": True, "int4": False}, "cache_bytes": 3 * 2**20,
            "rows": {"changed_tail": row}}


def test_markdown_names_payload_certify_speedup_and_bytes():
    table = fm.markdown([_result("Qwen3Next", "KvRecurrent", 12.5)]).splitlines()
    assert table[0].startswith("| family | payload | certify")
    assert table[2] == ("| Qwen3Next | `KvRecurrent` | pass / FAIL | changed_tail | 128 | 144 | "
                        "20.0 | 1.6 | **12.50x** | 3.0 MiB |")


def test_plot_is_written_next_to_the_json(tmp_path):
    out = tmp_path / "m.json"
    png = plots.write({"families": [_result("A", "ResidentKv", 1.5),
                                    _result("B", "KvRecurrent", 9.0)], "repeats": 1},
                      out, "family_matrix")
    assert png == tmp_path / "m.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_family_has_an_entry_synth_can_write():
    archs = {e.family.shape.arch for e in fm.matrix().values() if e.family.shape}
    assert archs == set(synth_archs())  # every synthetic table has a row
    held = archs | {"llama", "gemma3"}  # the shipped models' families
    assert set(FAMILIES) <= held
