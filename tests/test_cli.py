"""The ``arctic-rl`` command as a user meets it: one-line errors, quiet stdout, a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def arctic_rl(*args: str, timeout: float = 300,
              env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    """``arctic-rl *args`` with this environment and ``env`` over it (None: a variable removed)."""
    merged = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "arctic_core.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={k: v for k, v in merged.items() if v is not None})


# Other libraries' lines about a GPU that is not there, on every CPU run.
BANNERS = ("Setting accelerator to CPU", "No CUDA runtime is found", "deepspeed_shm_comm_op built successfully")
# As a user's shell has it: nothing picks DeepSpeed's accelerator (an engine imported by an earlier
# test sets DS_ACCELERATOR in this process), no verbosity asked for.
USER_ENV: dict[str, str | None] = {"DS_ACCELERATOR": None, "ARCTIC_RL_VERBOSE": None}


def config_file(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "arctic.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *expected: str) -> list[str]:
    """Exit status 2 and the error (no traceback) as the first line of stderr."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    message = "\n".join(lines[start:])
    for text in expected:
        assert text in message, message
    return lines[start:]


def test_a_typo_in_the_config_file_is_one_line_with_the_valid_keys(tmp_path, tiny_policy):
    path = config_file(tmp_path, {"model": {"path": str(tiny_policy)}, "trainer": {"optimiser": {"lr": 1e-5}}})
    lines = assert_one_line_error(arctic_rl("serve", "--config", str(path)), f"invalid config {path}",
                                  "trainer.optimiser: unknown key (did you mean 'optimizer'?); valid keys: backend,")
    assert len(lines) <= 3, lines


def test_a_missing_model_path_is_named_before_any_engine_starts(tmp_path):
    path = config_file(tmp_path, {"model": {"path": str(tmp_path / "no-such-model")}})
    proc = arctic_rl("serve", "--config", str(path))
    assert_one_line_error(proc, f"config {path}: model.path: '{tmp_path / 'no-such-model'}' does not exist",
                          "arctic-rl tiny-model DIR")
    assert "Repo id" not in proc.stderr and "deepspeed" not in proc.stderr.lower()


@pytest.mark.slow
def test_a_typo_inside_backend_options_names_path_file_keys_and_suggestion(tmp_path, tiny_policy):
    path = config_file(tmp_path, {"model": {"path": str(tiny_policy), "device": "cpu"},
                                  "trainer": {"backend": "deepspeed", "options": {"zero_stag": 2}}})
    assert_one_line_error(
        arctic_rl("serve", "--config", str(path)),
        f"config {path}: invalid trainer.options of backend 'deepspeed'",
        "trainer.options.zero_stag: unknown key (did you mean 'zero_stage'?); valid keys: offload_optimizer, "
        "offload_param, zero_stage, zorro",
    )


def test_a_token_no_http_header_can_carry_is_refused_before_any_engine_starts(tmp_path, tiny_policy):
    path = config_file(tmp_path, {"model": {"path": str(tiny_policy), "device": "cpu"}})
    proc = arctic_rl("serve", "--config", str(path), "--port", "1", env={"ARCTIC_RL_TOKEN": "pässwörd"})
    assert_one_line_error(proc, "the bearer token (--token / ARCTIC_RL_TOKEN) must be printable ASCII")


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback_before_or_after_the_subcommand(tmp_path, where):
    path = config_file(tmp_path, {"model": {"path": str(tmp_path / "nothing")}})
    args = ["serve", "--config", str(path)]
    proc = arctic_rl(*(["--debug", *args] if where == "before" else [*args, "--debug"]))
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr


@pytest.mark.slow
def test_tiny_model_writes_a_folder_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc = arctic_rl("tiny-model", str(tmp_path / "tiny"), "--family", "llama")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{tmp_path / 'tiny'}\n"  # the folder alone: `DIR=$(arctic-rl tiny-model ...)` works
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "tiny").config.model_type == "llama"
    assert AutoTokenizer.from_pretrained(tmp_path / "tiny").apply_chat_template(
        [{"role": "user", "content": "repeat 3"}], tokenize=False).startswith("<|im_start|>user")
    assert_one_line_error(arctic_rl("tiny-model", str(tmp_path / "tiny")), "exists and is not empty")
    assert_one_line_error(arctic_rl("tiny-model", str(tmp_path / "x"), "--family", "gpt9"), "unknown family 'gpt9'")


@pytest.mark.slow
def test_tiny_model_prints_no_library_banners_unless_verbose(tmp_path):
    import torch

    quiet = arctic_rl("tiny-model", str(tmp_path / "quiet"), env=USER_ENV)
    assert quiet.returncode == 0 and quiet.stdout == f"{tmp_path / 'quiet'}\n", quiet.stderr[-3000:]
    assert not [b for b in BANNERS if b in quiet.stderr], quiet.stderr[-3000:]
    if not torch.cuda.is_available():  # DeepSpeed's notice is there to be kept
        loud = arctic_rl("tiny-model", str(tmp_path / "loud"), "--verbose", env=USER_ENV)
        assert loud.returncode == 0 and "Setting accelerator to CPU" in loud.stderr, loud.stderr[-3000:]


def test_tiny_model_refuses_a_path_that_is_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    assert_one_line_error(arctic_rl("tiny-model", str(tmp_path / "notes.txt")),
                          f"{tmp_path / 'notes.txt'} exists and is not a folder")
    assert (tmp_path / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_the_demo_reuses_an_earlier_runs_folder_and_refuses_any_other(tmp_path):
    from arctic_core.demo.grpo import clear_earlier_run

    earlier = tmp_path / "earlier"
    for name in ("tensorboard/events.out", "checkpoint/arctic_state.json", "summary.json"):
        (earlier / name).parent.mkdir(parents=True, exist_ok=True)
        (earlier / name).write_text("{}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep me")
    (earlier / "policy").symlink_to(elsewhere)  # a link among the outputs goes, what it points to stays
    clear_earlier_run(earlier)
    assert list(earlier.iterdir()) == [] and (elsewhere / "keep.txt").read_text() == "keep me"
    (tmp_path / "model" / "config.json").parent.mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert_one_line_error(arctic_rl("demo", "--out", str(tmp_path / "model")),
                          f"the demo's folder {tmp_path / 'model'} holds ['config.json'], which no demo run wrote")
    assert (tmp_path / "model" / "config.json").read_text() == "{}"


@pytest.mark.slow
def test_options_out_of_range_and_folders_that_cannot_be_written_are_one_line_before_anything_runs(tmp_path):
    for args, message in ((["demo", "--seed", "-5"], "Invalid value for '--seed'"),
                          (["demo", "--seed", "99999999999999999999"], "Invalid value for '--seed'"),
                          (["demo", "--steps", "99999999999999999999"], "Invalid value for '--steps'"),
                          (["tiny-model", str(tmp_path / "t"), "--seed", "-1"], "Invalid value for '--seed'")):
        proc = arctic_rl(*args, "--out", str(tmp_path / "demo")) if args[0] == "demo" else arctic_rl(*args)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "demo").exists() and not (tmp_path / "t").exists()
    assert_one_line_error(arctic_rl("tiny-model", "/proc/arctic-test"), "cannot write /proc/arctic-test")
    assert_one_line_error(arctic_rl("demo", "--out", "/proc/arctic-test", "--steps", "1", "--warmup-steps", "0"),
                          "cannot write /proc/arctic-test")


def test_help_and_version_answer_as_clis_do():
    from importlib.metadata import version

    assert arctic_rl("-h").stdout == arctic_rl("--help").stdout and "demo" in arctic_rl("-h").stdout
    assert arctic_rl("serve", "-h").returncode == 0
    assert arctic_rl("--version").stdout == f"arctic-rl {version('arctic-core')}\n"


@pytest.mark.slow
def test_demo_stdout_is_one_json_line_and_progress_goes_to_stderr(tmp_path):
    extensions = tmp_path / "torch_extensions"  # where DeepSpeed would build its ops
    proc = arctic_rl("demo", "--out", str(tmp_path / "demo"), "--steps", "2", "--warmup-steps", "2",
                     env={**USER_ENV, "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout[:3000]  # `arctic-rl demo | jq` works
    assert json.loads(lines[0])["steps"] == 2
    assert "SFT warm-up" in proc.stderr and "GRPO" in proc.stderr  # both phases show progress bars
    assert "Loading weights" not in proc.stderr
    assert not [b for b in BANNERS if b in proc.stderr], proc.stderr[-3000:]
    assert not extensions.exists() or not any(extensions.iterdir())  # a world of one builds no comm op


@pytest.mark.slow
def test_a_tiny_mistral_runs_on_the_default_sampler(tmp_path):
    from transformers import AutoModelForCausalLM

    from arctic_core.config import SamplingParams
    from arctic_fca.engine import EmbeddedEngine, EngineOptions

    assert arctic_rl("tiny-model", str(tmp_path / "tiny"), "--family", "mistral").returncode == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    assert model.config.model_type == "mistral" and model.config.sliding_window is None
    engine = EmbeddedEngine(model, EngineOptions(kv_cache_tokens=1024))
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].tokens) == 4
