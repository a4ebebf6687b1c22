"""The `skippy` command as a user runs it: a real process, real models."""

from __future__ import annotations


import pytest

from skippy.evals.reference import LlamaCppReference
from skippy.mesh.tokenizer import Tokenizer
from skippy.topology.errors import RequestError
from skippy_cli import skippy

PROMPT = "The three most useful things to know about the Moon are"


def test_generate_three_stages_matches_llama_cpp_greedy(smollm2_f16):
    tok = Tokenizer(smollm2_f16)
    ids = tok.encode(PROMPT)
    expected_ids = LlamaCppReference(smollm2_f16).greedy(ids, 16, set(tok.eog_ids))
    stream = tok.stream_decoder()
    expected = "".join(stream.push(t) for t in expected_ids) + stream.flush()
    r = skippy("generate", "--model", str(smollm2_f16), "--stages", "3",
               "--temperature", "0", "--max-tokens", "16", PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected + "\n"
    assert len(expected_ids) == 16


def test_generate_by_name_with_chat_template(smollm2):
    r = skippy("generate", "--model", "smollm2", "--stages", "2", "--max-tokens", "8",
               "--chat", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_seeded_sampling_repeats(smollm2):
    args = ("generate", "--model", "smollm2", "--max-tokens", "8", "--temperature", "0.9",
            "--seed", "11", PROMPT)
    first, second = skippy(*args), skippy(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


@pytest.mark.parametrize("args, message", [
    (("generate", "--model", "no-such-model", "hi"), "no such model file"),
    (("generate", "--model", "smollm2", "--stages", "31", "hi"), "30 layers"),
    (("generate", "--model", "smollm2", "--stages", "0", "hi"), "at least 1"),
    (("generate", "--model", "smollm2", "   "), "prompt is empty"),
    (("generate", "--model", "/no/such/file.gguf", "hi"), "no such model file"),
    (("generate", "--model", "smollm2", "--max-tokens", "0", "hi"), "max-tokens"),
    (("generate", "--model", "smollm2", "--temperature", "-1", "hi"), "temperature"),
    (("generate",), "PROMPT"),
    (("models", "pull", "nonexistent"), "unknown model"),
    (("models", "synth", "--arch", "nope", "--layers", "2", "--seed", "1"), "nope"),
    (("models", "synth", "--arch", "qwen3", "--layers", "1", "--seed", "1",
      "--chat-template", "/no/such/template.jinja"), "--chat-template: cannot read"),
    (("serve", "--stages", "0"), "at least 1"),
    (("serve", "--runtime", "llama.cpp", "--stages", "2"), "--stages 1"),
    (("serve", "--weight-format", "int3"), "weight-format"),
    (("serve", "--lane-batch", "0"), "lane-batch"),
    (("serve", "--pipelines", "0"), "pipelines"),
    (("serve", "--port", "70000"), "port"),
    (("serve", "--model", "no-such-model"), "no such model file"),
    (("serve", "--cache-bytes", "lots"), "cache"),
    (("serve", "--host", "0.0.0.0"), "without API keys"),
    (("serve", "--host", "10.1.2.3", "--api-keys-file", "/dev/null"), "holds no key"),
    (("serve", "--api-keys-file", "/no/such/keys"), "cannot read the API key file"),
    (("serve", "--cluster-secret-file", "/dev/null"), "is empty"),
    (("serve", "--request-timeout", "0"), "request timeout"),
    (("serve", "--otlp-endpoint", "collector:4318"), "OTLP endpoint"),
    (("serve", "--wait-nodes", "3"), "--wait-nodes needs --address"),
    (("service", "start", "--", "--host", "0.0.0.0"), "without API keys"),
    (("service", "start", "--wait", "soon"), "--wait"),
    (("service", "restart"), "no gateway service to restart"),
])
def test_bad_input_is_one_line_and_exit_code_2(smollm2, args, message, capsys):
    """main() as the console script calls it, in this process (a child per case would
    spend its time importing torch); the next test runs the same path as a process."""
    from skippy.mesh import cli
    try:
        code = cli.main(list(args))
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize("args, message", [
    (("generate",), "PROMPT"),
    (("generate", "--model", "smollm2", "--stages", "31", "hi"), "30 layers"),
])
def test_a_bad_input_process_prints_one_line_and_exits_2(smollm2, args, message):
    r = skippy(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_only_our_user_errors_are_one_line_a_builtin_value_error_keeps_its_traceback(
        monkeypatch, capsys):
    """A ValueError from inside a command is a bug of ours, never the user's mistake."""
    from skippy.mesh import cli
    monkeypatch.delenv("SKIPPY_DEBUG", raising=False)

    def bug(args):
        raise ValueError("a bug deep inside")
    monkeypatch.setattr(cli, "cmd_generate", bug)
    with pytest.raises(ValueError, match="a bug deep inside"):
        cli.main(["generate", "--model", "smollm2", "hi"])

    def mistake(args):
        raise RequestError("temperature must be a finite number >= 0, not -1.0",
                           "temperature")
    monkeypatch.setattr(cli, "cmd_generate", mistake)
    assert cli.main(["generate", "--model", "smollm2", "hi"]) == 2
    assert capsys.readouterr().err == \
        "skippy: error: temperature must be a finite number >= 0, not -1.0\n"


def test_gemma_chat_uses_the_family_template(gemma3):
    """The Gemma 3 file has no chat template: the family's standard one applies."""
    r = skippy("generate", "--model", "gemma3-270m", "--stages", "2", "--max-tokens", "4",
               "--chat", "Say hello.")
    assert r.returncode == 0, r.stderr


def test_models_list_and_synth(tmp_path, smollm2):
    out = tmp_path / "q.gguf"
    r = skippy("models", "synth", "--arch", "qwen3", "--layers", "2", "--seed", "3",
               "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert out.exists() and r.stdout.strip() == str(out)
    listing = skippy("models", "list")
    assert listing.returncode == 0
    assert "smollm2" in listing.stdout and "llama" in listing.stdout and "Q4_1" in listing.stdout
