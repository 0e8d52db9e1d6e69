"""``arctic-primerl rl @ rl.toml``: PRIME-RL's settings mapped or refused by name, PRIME-RL's
processes configured as its own launcher configures them, bad runs stopped in seconds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from arctic_core.errors import ArcticError, ConfigError
from arctic_primerl.config import read_run
from arctic_primerl.launch import Process, Watchdog, check_commands, env_sources, preflight, prime_rl_processes
from arctic_primerl.schedule import LRSchedule
from runs import write_toml

REFUSED = {
    "weight_broadcast.type = 'nccl'": ("[weight_broadcast]\ntype = 'nccl'\n", "serves 'filesystem'"),
    "rollout_transport zmq": ("[trainer.rollout_transport]\ntype = 'zmq'\n", "trainer.rollout_transport.type = 'zmq'"),
    "LoRA": ("[trainer.model.lora]\nrank = 8\n", "trainer.model.lora: LoRA"),
    "Muon": ("[trainer.optim]\ntype = 'muon'\n", "arctic-primerl trains with AdamW"),
    "custom loss": ("[trainer.loss]\ntype = 'custom'\nimport_path = 'x.y'\n", "'custom' is not supported"),
    "two trainer GPUs": ("[deployment]\nnum_train_gpus = 2\n", "deployment.num_train_gpus = 2"),
    "context parallel": ("[trainer.model]\ncp = 2\n", "trainer.model.cp"),
    "steps disagree": ("[trainer]\nmax_steps = 7\n", "max_steps differs between sections"),
    "skip_optimizer": ("[ckpt]\nskip_optimizer = true\n", "ckpt.skip_optimizer: not supported by arctic-primerl"),
    "unknown scheduler key": ("[trainer.scheduler]\ntype = 'cosine'\ndecay_steps = 3\n",
                              r"unknown key\(s\) \['decay_steps'\]"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_settings_arctic_does_not_reproduce_are_refused_by_name(case, tmp_path, policy):
    extra, message = REFUSED[case]
    toml = write_toml(tmp_path / "rl.toml", policy, tmp_path / "run")
    text = toml.read_text()
    if extra.startswith("[trainer.optim]"):  # replaces the table the base file has
        text = text.replace("[trainer.optim]\n", "[trainer.optim]\ntype = 'muon'\n")
        extra = ""
    toml.write_text(text + "\n" + extra)
    with pytest.raises(ConfigError, match=message):
        read_run(toml)


# (a line of the base file, what replaces it or, with no line, a table to append; the message)
UNKNOWN = {
    "top level": ("max_steps = 2\n", "max_steps = 2\nmax_step = 3\n",
                  "max_step: unknown key at the top level (did you mean 'max_steps'?); valid keys: arctic, ckpt, "),
    "PRIME-RL's slurm": ("", "[slurm]\njob_name = 'x'\n", "slurm: unknown key at the top level; valid keys: "),
    "[trainer]": ("", "[trainer]\nenable_router_replya = false\n",
                  "trainer.enable_router_replya: unknown key in [trainer] (did you mean 'enable_router_replay'?)"),
    "[trainer.optim]": ("[trainer.optim]\n", "[trainer.optim]\nmax_nrom = 1.0\n",
                        "trainer.optim.max_nrom: unknown key in [trainer.optim] (did you mean 'max_norm'?); "
                        "valid keys: betas1, betas2, lr, max_norm, type, weight_decay"),
    "[ckpt]": ("", "[ckpt]\nkeep_lst = 2\n", "ckpt.keep_lst: unknown key in [ckpt] (did you mean 'keep_last'?)"),
    "[trainer.resume]": ("", "[trainer.resume]\nstpe = 2\n",
                         "trainer.resume.stpe: unknown key in [trainer.resume] (did you mean 'step'?)"),
    "[run]": ('name = "run"\n', 'nmae = "run"\n', "run.nmae: unknown key in [run] (did you mean 'name'?)"),
    "[log]": ("", "[log]\nlevl = 'debug'\n", "log.levl: unknown key in [log] (did you mean 'level'?)"),
    "[deployment]": ("", "[deployment]\nnum_train_gpu = 1\n",
                     "deployment.num_train_gpu: unknown key in [deployment] (did you mean 'num_train_gpus'?)"),
}


@pytest.mark.parametrize("case", UNKNOWN, ids=list(UNKNOWN))
def test_unknown_keys_in_the_tables_read_are_named_with_their_table(case, tmp_path, policy):
    """As PRIME-RL's launcher refuses keys its config lacks: one line naming the key and its table,
    with the closest key there when one is close."""
    line, replacement, message = UNKNOWN[case]
    toml = write_toml(tmp_path / "rl.toml", policy, tmp_path / "run")
    text = toml.read_text()
    toml.write_text(text.replace(line, replacement, 1) if line else text + replacement)
    with pytest.raises(ConfigError) as refused:
        read_run(toml)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_keys_of_prime_rl_that_are_read_or_ignored_pass(tmp_path, policy):
    """PRIME-RL's keys that the adapter reads, hands to the orchestrator, or ignores (the speed and
    memory settings of PRIME-RL's own trainer) pass the key check; tables handed to PRIME-RL whole
    are not checked here."""
    toml = write_toml(tmp_path / "rl.toml", policy, tmp_path / "run", extra="""
[trainer]
dist_timeout_seconds = 600
matmul_precision = "high"

[trainer.model]
seq_len = 256
impl = "custom"

[trainer.model.compile]

[weight_broadcast]
type = "filesystem"

[deployment]
type = "single_node"
gpus_per_node = 8

[log]
level = "debug"
json_logging = false

[monitors.wandb]
project = "x"

[orchestrator.sampling]
temperature = 0.7
""")
    text = toml.read_text().replace("max_steps = 2\n", "max_steps = 2\nclean = true\n")
    toml.write_text(text.replace("lr = 1e-3\nweight_decay = 0.0\n", "max_norm = 0.5\nbetas2 = 0.99\n"))
    run = read_run(toml)
    assert run.optimizer["max_grad_norm"] == 0.5 and run.optimizer["betas"] == (0.9, 0.99) and run.clean
    assert run.orchestrator_config()["sampling"] == {"temperature": 0.7}


def test_env_vars_go_to_the_processes_of_their_sections_as_prime_rls_launcher_sets_them(tmp_path, policy):
    """[env_vars] everywhere; [orchestrator.env_vars] in the orchestrator and env servers; the
    trainer's and inference server's in this process, which trains and samples in their stead.
    A skip_* checkpoint key left false (PRIME-RL's default) is Arctic's behaviour and passes."""
    toml = write_toml(tmp_path / "rl.toml", policy, tmp_path / "run", extra="""
[env_vars]
TRITON_CACHE_DIR = "/tmp/triton"
SHARED = "top"

[trainer.env_vars]
SHARED = "trainer"

[inference.env_vars]
VLLM_CACHE = "/tmp/vllm"

[orchestrator.env_vars]
SHARED = "orchestrator"

[ckpt]
skip_optimizer = false
""")
    run = read_run(toml)
    assert run.process_env == {"TRITON_CACHE_DIR": "/tmp/triton", "SHARED": "orchestrator"}
    assert run.backend_env == {"TRITON_CACHE_DIR": "/tmp/triton", "SHARED": "trainer", "VLLM_CACHE": "/tmp/vllm"}
    toml.write_text(toml.read_text().replace('SHARED = "trainer"', "SHARED = 1"))
    with pytest.raises(ConfigError, match="trainer.env_vars: a table of environment variables with string values"):
        read_run(toml)


def test_the_orchestrator_and_env_servers_get_prime_rls_launcher_settings(tmp_path, policy):
    toml = write_toml(tmp_path / "rl.toml", policy, tmp_path / "run", extra="""
[trainer.loss]
type = "ipo"
ipo_threshold = 0.3

[trainer.scheduler]
type = "cosine"
warmup_steps = 1
min_lr = 1e-5

[[orchestrator.train.source]]
name = "reverse"
env = {taskset = {id = "reverse-text"}}

[[orchestrator.train.source]]
env = {taskset = {id = "math"}}

[orchestrator.eval]
source = [{name = "held-out", env = {taskset = {id = "math"}}}]
""")
    run = read_run(toml)
    config = run.orchestrator_config()
    assert config["model"]["name"] == str(policy) and config["max_steps"] == 2 and config["seq_len"] == 256
    assert config["model"]["client"]["base_url"] == "http://127.0.0.1:0/v1"
    assert config["rollout_transport"] == config["weight_broadcast"] == {"type": "filesystem"}
    assert config["output_dir"] == str(tmp_path / "run") and config["num_train_workers"] == 1
    addresses = [(split, address) for split, _, address in env_sources(config)]
    assert addresses == [("train", "tcp://127.0.0.1:5000"), ("train", "tcp://127.0.0.1:5001"), ("eval", "tcp://127.0.0.1:5002")]
    processes = prime_rl_processes(run)
    assert [p.name for p in processes] == ["env server train/reverse", "env server train/math",
                                           "env server eval/held-out", "orchestrator"]
    assert processes[-1].command == ["orchestrator", "@", str(tmp_path / "run" / "configs" / "orchestrator.json")]
    assert run.loss[0]["trust_region"] == "both-sides" and run.loss[0]["mask_high"] == 0.3
    assert run.schedule.rates()[0] == pytest.approx(1e-5) and run.schedule.rates()[1] == pytest.approx(1e-3)


def test_prime_rls_schedules_step_by_step():
    linear = LRSchedule.from_prime_rl({"type": "linear", "warmup_steps": 2, "decay_steps": 3, "min_lr": 1e-4},
                                      1e-3, 8).rates()
    assert linear == pytest.approx([1e-4, 5.5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 5.5e-4, 1e-4])
    cosine = LRSchedule.from_prime_rl({"type": "cosine", "warmup_steps": 0, "min_lr": 0.0}, 1e-3, 4).rates()
    assert cosine == pytest.approx([1e-3, 1e-3 * (1 + 2**-0.5) / 2, 5e-4, 1e-3 * (1 - 2**-0.5) / 2])
    assert LRSchedule.from_prime_rl({}, 1e-3, 3).rates() == [1e-3] * 3


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "arctic_primerl.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


@pytest.mark.slow
def test_bad_runs_stop_in_seconds_with_one_line(tmp_path, policy):
    toml = write_toml(tmp_path / "rl.toml", policy, tmp_path / "run", extra="[weight_broadcast]\ntype = 'nccl'\n")
    missing = write_toml(tmp_path / "missing.toml", policy, tmp_path / "run2")  # 'orchestrator' is not installed here
    for path, message in ((toml, "serves 'filesystem'"), (missing, "'orchestrator' is not on PATH")):
        result = run_cli("rl", "@", str(path), cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("arctic-primerl: error:") and message in line


def test_a_command_given_as_a_path_is_named_as_missing_or_not_executable(tmp_path, policy, monkeypatch):
    """A path is started as it is (a relative one from the working folder), never looked up on PATH."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "orchestrator").write_text("#!/bin/sh\n")  # not executable
    for command, message in (("prime-rl/bin/orchestrator",
                              f"does not exist ({tmp_path / 'prime-rl' / 'bin' / 'orchestrator'})"),
                             (str(tmp_path / "nowhere" / "orchestrator"), "does not exist:"),
                             ("./bin/orchestrator", f"is not executable ({tmp_path / 'bin' / 'orchestrator'})")):
        toml = write_toml(tmp_path / "rl.toml", policy, tmp_path / "run",
                          arctic=f'orchestrator_command = ["{command}"]')
        with pytest.raises(ArcticError) as refused:
            check_commands(read_run(toml))
        assert f"orchestrator command {command!r} {message}" in str(refused.value)
        assert "PATH" not in str(refused.value)


def test_dry_run_prints_the_commands_and_writes_nothing(tmp_path, policy):
    """With PRIME-RL's defaults (no output_dir, no run name: a new run folder at every launch)."""
    commands = f'orchestrator_command = ["{sys.executable}", "-m", "prime_rl.entrypoints.orchestrator"]\n' \
               f'env_server_command = ["{sys.executable}"]'
    toml = write_toml(tmp_path / "rl.toml", policy, tmp_path / "run", arctic=commands)
    toml.write_text(toml.read_text().replace(f'output_dir = "{tmp_path}"\n', "").replace('[run]\nname = "run"\n', ""))
    before = sorted(tmp_path.rglob("*"))
    result = run_cli("rl", "@", str(toml), "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"{re.escape(sys.executable)} -m prime_rl.entrypoints.orchestrator @ "
                        rf"runs/primerl/no-env--{Path(policy).name.lower()}--[0-9a-f]{{8}}/configs/orchestrator.json",
                        result.stdout.strip()), result.stdout
    assert sorted(tmp_path.rglob("*")) == before


def test_a_process_writes_its_config_when_it_starts(tmp_path, policy):
    toml = write_toml(tmp_path / "rl.toml", policy, tmp_path / "run",
                      arctic=f'orchestrator_command = ["{sys.executable}"]')
    (orchestrator,) = prime_rl_processes(read_run(toml))
    assert not (tmp_path / "run").exists()
    orchestrator.command = [sys.executable, "-c", "pass"]
    orchestrator.start(dict(os.environ))
    orchestrator.popen.wait(timeout=60)
    config = json.loads((tmp_path / "run" / "configs" / "orchestrator.json").read_text())
    assert config["output_dir"] == str(tmp_path / "run")



def test_preflight_names_an_unreachable_backend_and_an_exposed_front_without_token(tmp_path, policy, monkeypatch):
    commands = f'orchestrator_command = ["{sys.executable}"]\nenv_server_command = ["{sys.executable}"]'
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    remote = write_toml(tmp_path / "remote.toml", policy, tmp_path / "run", arctic=commands + '\nurl = "http://127.0.0.1:9"')
    remote.write_text(remote.read_text().split("[arctic.config]")[0])  # a server named by url keeps its own config
    with pytest.raises(ArcticError, match="127.0.0.1:9"):
        preflight(read_run(remote))
    exposed = write_toml(tmp_path / "exposed.toml", policy, tmp_path / "run", arctic=commands + '\nhost = "0.0.0.0"')
    with pytest.raises(ArcticError, match="exposes the inference front: set the orchestrator's API key"):
        preflight(read_run(exposed))
    monkeypatch.setenv("VLLM_API_KEY", "k3y")
    token, processes = preflight(read_run(exposed))
    assert token == "k3y" and processes[-1].name == "orchestrator"


def test_shared_tables_reach_the_orchestrator_and_an_empty_resume_takes_the_latest_checkpoint(tmp_path, policy):
    for step in (2, 4):
        (tmp_path / "run" / "checkpoints" / f"step_{step}" / "arctic").mkdir(parents=True)
    toml = write_toml(tmp_path / "rl.toml", policy, tmp_path / "run", extra="""
[ckpt]
keep_last = 2
keep_interval = 10

[resume]

[log]
level = "debug"

[tokenizer]
chat_template = "{{ messages }}"
""")
    run = read_run(toml)
    config = run.orchestrator_config()
    assert config["ckpt"] == {"keep_last": 2, "keep_interval": 10} and config["resume"] == {}
    assert config["log"] == {"level": "debug"} and config["tokenizer"] == {"chat_template": "{{ messages }}"}
    assert run.resume_step == 4 and run.ckpt_keep_last == 2 and run.ckpt_keep_interval == 10


@pytest.mark.parametrize(("extra", "message"), [
    ("[ckpt]\noutput_dir = '/elsewhere'\n", "ckpt.output_dir: not supported"),
    ("[resume]\ndir = '/other/run/checkpoints/step_5'\n", "resume.dir: arctic-primerl resumes from this run's own"),
    ("[resume]\n", "holds none"),
])
def test_checkpoint_settings_arctic_does_not_follow_are_refused(tmp_path, policy, extra, message):
    with pytest.raises(ConfigError, match=message):
        read_run(write_toml(tmp_path / "rl.toml", policy, tmp_path / "run", extra=extra))


def test_a_run_without_a_name_gets_a_new_folder_at_every_launch(tmp_path, policy):
    """As PRIME-RL's launcher: neither run.name nor run.dir makes ``<envs>--<model>--<id>`` under
    output_dir, a new one per launch; resuming needs the name of the run to resume."""
    toml = write_toml(tmp_path / "rl.toml", policy, tmp_path / "run", extra="""
[[orchestrator.train.source]]
name = "Reverse"

[[orchestrator.train.source]]
env = {taskset = {id = "math"}}
""")
    toml.write_text(toml.read_text().replace('[run]\nname = "run"\n', ""))
    first, second = read_run(toml).run_dir, read_run(toml).run_dir
    assert first.parent == second.parent == tmp_path and first != second
    assert re.fullmatch(rf"reverse\+math--{Path(policy).name.lower()}--[0-9a-f]{{8}}", first.name), first.name
    toml.write_text(toml.read_text() + "\n[resume]\nstep = 2\n")
    with pytest.raises(ConfigError, match=r"\[resume\] needs run.name"):
        read_run(toml)


def test_the_orchestrator_ending_cleanly_before_the_last_step_stops_the_run(tmp_path):
    """A clean exit while the trainer waits for a rollout file would leave it waiting forever: the
    watchdog stops the run naming the file; once the file is there the same exit is the normal end."""
    awaited = tmp_path / "rollouts" / "step_3" / "rank_0.bin"

    def reason_after_clean_exit() -> str | None:
        orchestrator = Process("orchestrator", [sys.executable, "-c", "pass"], tmp_path / "orchestrator.log")
        orchestrator.start(dict(os.environ))
        orchestrator.popen.wait()
        stop = threading.Event()
        watchdog = Watchdog([orchestrator], stop, lambda: awaited)
        watchdog.start()
        if not stop.wait(3.0):
            stop.set()  # the trainer's own end
        watchdog.join()
        return watchdog.reason

    reason = reason_after_clean_exit()
    assert reason is not None and f"orchestrator exited (status 0) before writing {awaited}" in reason
    awaited.parent.mkdir(parents=True)
    awaited.write_bytes(b"")
    assert reason_after_clean_exit() is None


def test_mistakes_in_the_toml_are_named(tmp_path, policy):
    """A file that is not TOML, a misspelt [arctic] key, a step count below 1, a context past the
    model's positions: each a ConfigError naming it (the command prints it as one line, status 2)."""
    commands = f'orchestrator_command = ["{sys.executable}"]\nenv_server_command = ["{sys.executable}"]'
    broken = write_toml(tmp_path / "broken.toml", policy, tmp_path / "run")
    broken.write_text(broken.read_text() + "\n[unclosed\n")
    cases = {broken: "broken.toml is not valid TOML",
             write_toml(tmp_path / "typo.toml", policy, tmp_path / "run", arctic="orchestrator_comand = ['x']"):
                 "arctic.orchestrator_comand: unknown key (did you mean 'orchestrator_command'?)",
             write_toml(tmp_path / "zero.toml", policy, tmp_path / "run", steps=0): "max_steps = 0: a number of steps"}
    for toml, message in cases.items():
        with pytest.raises(ConfigError) as refused:
            read_run(toml)
        assert message in str(refused.value)
    long = write_toml(tmp_path / "long.toml", policy, tmp_path / "run", seq_len=4096, arctic=commands)
    with pytest.raises(ArcticError, match=r"the context served \(\[arctic\] max_model_len, else seq_len\) = 4096 "
                                          r"tokens, more than the model's max_position_embeddings=512"):
        preflight(read_run(long))
