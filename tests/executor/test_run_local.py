"""`jetserve run-local` as a user runs it: a JSONL file in, one JSON line out per request."""

import json
import subprocess
import sys


def test_run_local_mixed_good_and_bad_lines(tmp_path):
    lines = [
        {"prompt": "Hello", "max_tokens": 8, "temperature": 0},
        {"prompt": "", "max_tokens": 8},
        {"prompt_token_ids": [17] * 2100, "max_tokens": 8},
        {"prompt": "Hi", "max_tokens": 0},
        {"prompt": "Hi", "temperature": -1},
        {"prompt": "Hi", "top_p": 0},
        {"prompt": "Hi", "top_p": 1.5},
        {"prompt": "Hi", "max_tokens": 4, "speed": "fast"},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
         "request_id": "chat"},
    ]
    raw = [json.dumps(line) for line in lines] + ["{not json", "[1, 2]"]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(raw) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "run-local", str(path), "--model", "dummy:tiny",
         "--progress"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(out) == len(raw)
    kinds = [o["type"] for o in out]
    assert kinds == ["completion"] + ["error"] * 7 + ["completion", "error", "error"]
    assert out[0]["usage"]["completion_tokens"] == 8 and out[0]["request_id"] == "line-1"
    assert out[8]["request_id"] == "chat" and len(out[8]["token_ids"]) == 6
    expectations = [
        (1, "invalid_request", "`prompt` is empty"),
        (2, "prompt_too_long", "max_model_len 2048"),
        (3, "invalid_request", "$.max_tokens"),
        (4, "invalid_request", "$.temperature"),
        (5, "invalid_request", "$.top_p"),
        (6, "invalid_request", "$.top_p"),
        (7, "invalid_request", "unknown field `speed`"),
        (9, "invalid_request", "malformed JSON"),
        (10, "invalid_request", "Expected `object`"),
    ]
    for index, code, needle in expectations:
        assert out[index]["request_id"] == f"line-{index + 1}"
        assert out[index]["code"] == code, out[index]
        assert needle in out[index]["message"], out[index]
    assert "11/11 requests" in result.stderr




def test_run_local_dtype_reaches_the_engine_config(monkeypatch):
    """`--dtype` sets model.dtype (an in-process engine leaves the environment out, so
    JETSERVE_MODEL__DTYPE cannot)."""
    from services import cli
    from services.executor import run_local

    seen = []
    monkeypatch.setattr(run_local, "main", lambda path, config, progress: seen.append(config) or 0)
    assert cli.main(["run-local", "q.jsonl", "--dtype", "bfloat16"]) == 0
    assert cli.main(["run-local", "q.jsonl"]) == 0
    assert [c.model.dtype for c in seen] == ["bfloat16", "auto"]


def test_a_bad_setting_model_or_file_is_one_line_naming_it(tmp_path):
    """Exit status 2 and the cause, not a traceback."""
    path = tmp_path / "one.jsonl"
    path.write_text('{"prompt": "hi", "max_tokens": 2}\n')
    for args, needle in ((["--block-size", "0"], "$.kv_cache.block_size"),
                         (["--model", "dummy:bogus"], "unknown dummy model 'bogus'"),
                         (["--model", "sim:nope"], "unknown sim profile 'nope'")):
        result = subprocess.run([sys.executable, "-m", "services.cli", "run-local", str(path),
                                 *args], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and needle in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    missing = subprocess.run([sys.executable, "-m", "services.cli", "run-local",
                              str(tmp_path / "none.jsonl"), "--model", "dummy:tiny"],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "none.jsonl" in missing.stderr
    assert "Traceback" not in missing.stderr
