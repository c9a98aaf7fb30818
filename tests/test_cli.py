"""The ``oxibonsai`` command run as a user would: a subprocess, text on stdout, timing on stderr."""

from __future__ import annotations

import re
import subprocess
import sys

import oxibonsai as ob


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oxibonsai.cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=300,
    )


def test_generate_streams_text_and_reports_timing(tiny_model):
    params = ob.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = ob.LLM(str(tiny_model)).generate(["the model"], params)[0].outputs[0].text
    done = run(
        "generate",
        "the model",
        "--model",
        str(tiny_model),
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
    )
    assert done.returncode == 0, done.stderr
    # A random model's six greedy tokens may all be whitespace: compare with the library's text.
    assert expected and done.stdout == expected + "\n"
    assert "time to first token" in done.stderr and "6 generated" in done.stderr


def test_chat_keeps_history(tiny_model):
    done = run("chat", "--model", str(tiny_model), "--max-tokens", "3", stdin="hello\nand again\n\n")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("generated tokens") == 2
    first, second = (line for line in done.stderr.splitlines() if "prompt +" in line)
    prompt_tokens = [int(line.split("[")[1].split()[0]) for line in (first, second)]
    assert prompt_tokens[1] > prompt_tokens[0] + 3


def test_info_describes_the_file(tiny_model):
    done = run("info", str(tiny_model))
    assert done.returncode == 0, done.stderr
    for needle in ("architecture: qwen3", "qwen3.block_count", "Q1_0", "F32", "gpt2", "chat template"):
        assert needle in done.stdout


def test_errors_are_one_line_and_exit_1(tmp_path):
    done = run("generate", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert done.returncode == 1
    assert "error" in done.stderr and "Traceback" not in done.stderr
    bad = run("generate", "hi", "--model", str(tmp_path / "missing.gguf"), "--temperature", "-1")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr


def test_the_torch_runner_and_bad_devices_from_the_command_line(tiny_model):
    torch_run = run(
        "generate",
        "the model",
        "--model",
        str(tiny_model),
        "--max-tokens",
        "3",
        "--runner",
        "torch",
        "--device",
        "cpu",
    )
    if torch_run.returncode != 0 and "oxibonsai[torch]" in torch_run.stderr:
        return  # torch is not installed: the error names the extra, which is what it should do
    assert torch_run.returncode == 0, torch_run.stderr
    assert "3 generated" in torch_run.stderr
    bad = run("generate", "hi", "--model", str(tiny_model), "--device", "tpu")
    assert bad.returncode == 1 and "device must be" in bad.stderr and "Traceback" not in bad.stderr


def test_generate_constrains_output_with_llama_cpp_style_flags(tiny_model, tmp_path):
    grammar = tmp_path / "digits.gbnf"
    grammar.write_text('root ::= "n" [0-9] [0-9]? "!"\n', encoding="utf-8")
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    flags = {
        "--grammar-file": (str(grammar), r"n[0-9][0-9]?!"),
        "--regex": ("[a-c]{4}", r"[a-c]{4}"),
        # JSON whitespace is spaces, tabs and newlines; a random model may pick any of them.
        "--json-schema": (schema, r'\{\s*"ok"\s*:\s*(true|false)\s*\}'),
    }
    for flag, (value, pattern) in flags.items():
        done = run("generate", "the model", "--model", str(tiny_model), flag, value, "--max-tokens", "40")
        assert done.returncode == 0, done.stderr
        text = done.stdout.rstrip("\n")
        if flag == "--json-schema" and "finish: length" in done.stderr:
            assert text.startswith("{"), text  # a random model may loop on whitespace inside the JSON
        else:
            assert "finish: stop" in done.stderr and re.fullmatch(pattern, text), (flag, text)
    bad_specs = (("--regex", "(a", "invalid structured output"), ("-j", "{x", "not valid JSON"))
    for flag, value, message in bad_specs:
        bad = run("generate", "x", "--model", str(tiny_model), flag, value)
        assert bad.returncode == 1 and message in bad.stderr
