"""`hybridserve generate` end to end, as a user runs it: once as a process of its own (`python -m hybridserve`),
the other cases through the same `main` in this process (a process each cost the CI box seconds of imports)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

from checkpoints import nemotron_h

from hybridserve.cli import main


def _cli_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridserve", *args], capture_output=True, text=True, timeout=300)


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`hybridserve ARGS` through the CLI's `main` in this process: its exit code and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --help, a malformed flag
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def test_help_explains_itself() -> None:
    out = _cli("--help")
    assert out.returncode == 0 and "generate" in out.stdout
    sub = _cli("generate", "--help")
    assert sub.returncode == 0 and "--prompt-ids" in sub.stdout and "--max-tokens" in sub.stdout


def test_generate_on_the_default_model_with_text() -> None:
    out = _cli_process("generate", "--prompt", "def fib(n):", "--max-tokens", "6", "--ignore-eos", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 6 and result["finish_reason"] == "length"
    assert isinstance(result["text"], str) and 0 < len(result["prompt_token_ids"]) < len("def fib(n):")  # BPE


def test_generate_on_a_transformers_checkpoint_with_ids() -> None:
    model_dir, _ = nemotron_h("M*-M")
    out = _cli("generate", "--model", str(model_dir), "--prompt-ids", "5,6,7", "--max-tokens", "4", "--ignore-eos", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["prompt_token_ids"] == [5, 6, 7] and len(result["token_ids"]) == 4


def test_bad_input_is_a_clear_error() -> None:
    model_dir, _ = nemotron_h("M*-M")
    out = _cli("generate", "--model", str(model_dir), "--prompt-ids", "5,999", "--max-tokens", "4")
    assert out.returncode == 2 and "[0, 128)" in out.stderr
    out = _cli("generate", "--prompt-ids", "1,2", "--max-tokens", "0")
    assert out.returncode == 2 and "max_tokens" in out.stderr


def test_generate_with_mtp_speculation_matches_plain_and_reports_drafts() -> None:
    spec = '{"method": "mtp", "num_speculative_tokens": 3}'
    plain = _cli("generate", "--prompt", "import os", "--max-tokens", "16", "--ignore-eos", "--json")
    fast = _cli("generate", "--prompt", "import os", "--max-tokens", "16", "--ignore-eos", "--json",
                "--speculative-config", spec)
    assert plain.returncode == 0 and fast.returncode == 0, fast.stderr
    plain_out, fast_out = (json.loads(o.stdout.strip().splitlines()[-1]) for o in (plain, fast))
    assert fast_out["token_ids"] == plain_out["token_ids"]
    assert fast_out["num_draft_tokens"] > 0 and 0 <= fast_out["num_accepted_tokens"] <= fast_out["num_draft_tokens"]
    bad = _cli("generate", "--prompt", "x", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}')
    assert bad.returncode == 2 and "method" in bad.stderr
    bad = _cli("generate", "--prompt", "x", "--speculative-config", "not json")
    assert bad.returncode == 2 and "JSON" in bad.stderr


def _subcommand(name: str):  # noqa: ANN202 - argparse.ArgumentParser
    import argparse

    from hybridserve.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_flag_has_help_and_a_default_shown() -> None:
    import argparse

    for command in ("generate", "worker", "serve", "up", "down"):
        parser = _subcommand(command)
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[0] if action.option_strings else action.dest
            assert action.help, f"{command} {flag} has no help"
            if action.default not in (None, False) and action.option_strings and not action.required:
                assert "default" in action.help.lower(), f"{command} {flag}: help does not name its default"
        text = parser.format_help()
        assert "bench/" not in text and "results/" not in text, command
    for flag in ("--prefill-workers", "--decode-workers", "--num-gpus-per-worker", "--max-running", "--max-queued",
                 "--timeout", "--worker-port-base"):
        assert flag in _subcommand("serve").format_help()
    worker = _subcommand("worker").format_help()
    assert "--host" in worker and "--worker-id" in worker and "--metrics-port" in worker


def test_generate_help_lists_no_serving_only_flag_and_one_seed() -> None:
    text = _subcommand("generate").format_help()
    for flag in ("--standby-state-slots", "--max-num-waiting", "--max-cache-events", "--request-seed", "--api-key",
                 "--prefill-workers"):
        assert flag not in text, flag
    import re

    assert set(re.findall(r"--[\w-]*seed[\w-]*", text)) == {"--seed"}
    # the old spelling still works (with a warning) and means the same seed
    a = _cli("generate", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--temperature", "1", "--seed", "7", "--json")
    b = _cli("generate", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--temperature", "1", "--request-seed", "7",
             "--json")
    assert a.returncode == 0 and b.returncode == 0 and "deprecated" in b.stderr
    assert json.loads(a.stdout.splitlines()[-1])["token_ids"] == json.loads(b.stdout.splitlines()[-1])["token_ids"]
