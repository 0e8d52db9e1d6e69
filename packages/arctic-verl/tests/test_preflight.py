"""Bad input stops verl's start in seconds with one line naming the problem and the fix.

The unmodified ``main_ppo`` exits with status 2 before Ray starts (no traceback, no hang) for a
setting Arctic cannot honour, a missing model, or a server that does not answer; the server
checks (token, served model, reference model) run against a real ``arctic-rl serve`` on loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import yaml
from verl.utils.torch_functional import get_cosine_schedule_with_warmup

from arctic_core.adapters import preflight as adapter_preflight
from arctic_core.errors import ArcticError
from arctic_core.ports import free_port
from arctic_core.transports.http import wait_until_serving
from arctic_verl import plugin
from arctic_verl.mapping import actor_optim, arctic_config, refusals
from arctic_verl.settings import ArcticSettings
from arctic_verl.preflight import preflight
from arctic_verl.settings import read_settings
from arctic_verl.trainer import learning_rates
from verl_run import gsm8k_rows, main_ppo_args, run_main_ppo, verl_config, write_parquet

TOKEN = "t0ken-for-tests"


STOPS = {
    "loss-mode": ("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
                  "actor_rollout_ref.actor.policy_loss.loss_mode='clip_cov': "
                  "supported: vanilla, gspo, sapo, cispo, gpg"),
    "critic": ("algorithm.adv_estimator=gae", "a critic (value model) is not served by Arctic"),
    "unreachable-url": ("+arctic.url=http://127.0.0.1:{port}", "127.0.0.1:{port}"),
    "missing-model": ("actor_rollout_ref.model.path=/nonexistent/model", "/nonexistent/model"),
    "legacy-trainer": ("trainer.use_v1=False",
                       "trainer.use_v1=False: trainer.v1.trainer_mode=arctic runs in verl's v1"),
    "misspelt-mode": ("trainer.v1.trainer_mode=artic",  # after main_ppo_args' own: Hydra's last value wins
                      "trainer.v1.trainer_mode='artic': no such trainer mode; did you mean 'arctic'?"),
}


@pytest.fixture(scope="module")
def stops(policy, tmp_path_factory):
    """Each case's ``main_ppo`` run (and its port); the runs go at once (each is mostly verl's imports)."""

    def attempt(case: str):
        folder, port = tmp_path_factory.mktemp(case), free_port()
        data = write_parquet(gsm8k_rows(2), folder / "data.parquet")
        args = main_ppo_args(policy, data, data, folder, steps=1, extra=(STOPS[case][0].format(port=port),))
        return run_main_ppo(args, cwd=folder, timeout=240), port, folder

    with ThreadPoolExecutor(len(STOPS)) as pool:
        return dict(zip(STOPS, pool.map(attempt, STOPS), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", STOPS)
def test_main_ppo_stops_with_one_line(stops, case):
    result, port, folder = stops[case]
    named = STOPS[case][1]
    assert result.returncode == 2, result.stderr[-4000:]
    assert result.stderr.count("arctic-verl: error:") == 1, result.stderr[-4000:]
    message = result.stderr[result.stderr.index("arctic-verl: error:"):]
    assert named.format(port=port) in message, result.stderr[-4000:]
    assert "Traceback" not in result.stderr
    assert not (folder / "checkpoints").exists()


@pytest.mark.parametrize("mode", ["artic", "Arctic", "arctic-verl", "arcitc"])
def test_a_misspelt_arctic_mode_stops_before_ray(mode, capsys):
    with pytest.raises(SystemExit) as stopped:
        plugin._check_mode_spelling(verl_config(f"trainer.v1.trainer_mode={mode}"))
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"arctic-verl: error: trainer.v1.trainer_mode={mode!r}: no such trainer mode; did you mean 'arctic'? "
        "(verl's modes: arctic, colocate_async, separate_async, sync)")


@pytest.mark.parametrize("overrides", [("trainer.v1.trainer_mode=sync",), ("trainer.v1.trainer_mode=colocate_async",),
                                       ("trainer.v1.trainer_mode=separate_async",), ("trainer.v1.trainer_mode=arctic",),
                                       # unknown, but no 'arctic': verl's to say
                                       ("trainer.v1.trainer_mode=my_trainer",),
                                       ("trainer.v1.trainer_mode=artic", "trainer.use_v1=False")])  # no v1: unread
def test_verls_other_modes_pass_untouched(overrides, capsys):
    plugin._check_mode_spelling(verl_config(*overrides))
    assert capsys.readouterr().err == ""


def test_a_registered_mode_close_to_arctic_passes(monkeypatch, capsys):
    from verl.trainer.ppo.v1 import PPOTrainerSync
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    monkeypatch.setitem(TRAINER_REGISTRY, "arctic2", PPOTrainerSync)  # another plugin's mode
    plugin._check_mode_spelling(verl_config("trainer.v1.trainer_mode=arctic2"))
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def server(policy, tmp_path_factory):
    """``arctic-rl serve`` of the tiny policy, with a token and no reference model."""
    folder = tmp_path_factory.mktemp("server")
    config = folder / "arctic.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(policy), "device": "cpu"},
                                      "trainer": {"backend": "torch"}}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "arctic_core.cli", "serve", "--config", str(config),
                             "--port", str(port)],
                            env={**os.environ, "ARCTIC_RL_TOKEN": TOKEN}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(url, timeout=120, alive=lambda: proc.poll() is None)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def served_config(policy, url: str, *overrides: str):
    return verl_config(f"actor_rollout_ref.model.path={policy}", f"+arctic.url={url}", *overrides)


def test_the_server_checks(server, policy, tmp_path):
    preflight(served_config(policy, server, f"+arctic.token={TOKEN}"))  # all well

    with pytest.raises(ArcticError, match="token"):
        preflight(served_config(policy, server, "+arctic.token=wrong"))
    other = tmp_path / "other-model"
    other.mkdir()
    with pytest.raises(ArcticError, match=f"serves {policy}, but actor_rollout_ref.model.path is {other}"):
        preflight(verl_config(f"actor_rollout_ref.model.path={other}", f"+arctic.url={server}",
                              f"+arctic.token={TOKEN}"))
    with pytest.raises(ArcticError, match="needs reference log-probs.*has no reference model"):
        preflight(served_config(policy, server, f"+arctic.token={TOKEN}", "actor_rollout_ref.actor.use_kl_loss=True"))


def assert_refused_naming(config, *names: str) -> None:
    """preflight refuses ``config`` with one message naming each of ``names``."""
    with pytest.raises(ArcticError) as refused:
        preflight(config)
    for named in names:
        assert named in str(refused.value)


def test_settings_refused_by_name(policy):
    with pytest.raises(ArcticError, match="arctic.nmu_gpus: unknown key .*did you mean 'num_gpus'"):
        preflight(verl_config(f"actor_rollout_ref.model.path={policy}", "+arctic.nmu_gpus=1"))
    model = f"actor_rollout_ref.model.path={policy}"
    assert_refused_naming(
        verl_config(model, "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
                    "actor_rollout_ref.actor.optim.optimizer=SGD", "+arctic.config.model.path=/elsewhere"),
        "actor_rollout_ref.actor.loss_agg_mode='seq-mean-token-sum-norm'", "actor_rollout_ref.actor.optim.optimizer",
        "arctic.config.model.path")
    assert_refused_naming(
        verl_config(model, "+actor_rollout_ref.model.override_config.attention_dropout=0.1",
                    "actor_rollout_ref.actor.checkpoint.save_contents=[model]"),
        "actor_rollout_ref.model.override_config=", "actor_rollout_ref.actor.checkpoint.load_contents=")
    correction = "algorithm.rollout_correction."
    assert_refused_naming(
        verl_config(model, f"{correction}rollout_is=token", f"{correction}rollout_is_batch_normalize=True",
                    f"{correction}bypass_mode=True", "actor_rollout_ref.rollout.calculate_log_probs=False"),
        "rollout_is_batch_normalize", "bypass_mode", "needs actor_rollout_ref.rollout.calculate_log_probs=True")
    assert_refused_naming(
        verl_config(model, f"{correction}rollout_is=sequence", f"{correction}rollout_rs='seq_mean_k1,token_k2'",
                    f"{correction}rollout_rs_threshold='0.5_2.0,1.0'",
                    "actor_rollout_ref.rollout.calculate_log_probs=True"),
        "rollout_correction.rollout_rs", "(token_k2) with rollout_is=sequence")
    assert_refused_naming(verl_config(model, f"{correction}rollout_is=null", f"{correction}rollout_rs=token_k1",
                                      "actor_rollout_ref.rollout.calculate_log_probs=False"),
                          "rollout_correction.rollout_rs='token_k1': "
                          "needs actor_rollout_ref.rollout.calculate_log_probs=True")
    assert_refused_naming(verl_config(model, f"{correction}rollout_is=token", f"{correction}rollout_is_threshold=abc",
                                      "actor_rollout_ref.rollout.calculate_log_probs=True"),
                          "rollout_correction.rollout_is_threshold='abc': a number")
    for mapped in ([f"{correction}rollout_is=sequence", f"{correction}rollout_rs=seq_mean_k1"],
                   [f"{correction}rollout_is=token", f"{correction}rollout_rs='token_k1,seq_max_k2'"]):
        assert refusals(verl_config(model, *mapped, "actor_rollout_ref.rollout.calculate_log_probs=True"),
                        ArcticSettings()) == [], mapped


def test_what_would_fail_after_ray_starts_is_named_before(policy):
    """Backend options (checked by the backend's own model, without importing it), prompt and
    response lengths past the model's positions, values verl's own config classes refuse."""
    model = f"actor_rollout_ref.model.path={policy}"
    assert_refused_naming(verl_config(model, "+arctic.config.trainer.options.zero_stge=2"),
                          "trainer.options.zero_stge: unknown key (did you mean 'zero_stage'?)")
    assert_refused_naming(verl_config(model, "data.max_prompt_length=512", "data.max_response_length=1024"),
                          "prompt_length + response_length", "= 1536 tokens, more than the model's "
                          "max_position_embeddings=512")
    assert_refused_naming(verl_config(model, "actor_rollout_ref.actor.optim.lr_scheduler_type=linear"),
                          "actor_rollout_ref.actor.optim: verl's config check `assert self.lr_scheduler_type in")


def test_verls_deprecated_optimizer_keys_are_read_as_verl_reads_them(policy):
    """``warmup_style`` and ``grad_clip``: verl's optimizer config copies them onto lr_scheduler_type
    and clip_grad; the schedule and the clipping Arctic runs follow them too."""
    config = verl_config(f"actor_rollout_ref.model.path={policy}", "actor_rollout_ref.actor.optim.lr=1e-3",
                         "actor_rollout_ref.actor.optim.warmup_style=cosine",
                         "+actor_rollout_ref.actor.optim.grad_clip=0.5",
                         "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
                         "actor_rollout_ref.actor.optim.total_training_steps=10")
    assert arctic_config(config, read_settings(config), on_gpu=False).trainer.optimizer.max_grad_norm == 0.5
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    cosine = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=10, min_lr_ratio=0.0)
    rate = learning_rates(actor_optim(config))
    assert [rate(n) for n in range(10)] == pytest.approx([1e-3 * cosine.lr_lambdas[0](n) for n in range(10)])
    assert rate(5) < rate(2)  # cosine: the constant schedule would hold 1e-3


def test_an_unsupported_verl_version_stops_runs_that_ask_for_arctic(monkeypatch, policy, capsys):
    import verl.utils.config as verl_config_module

    monkeypatch.setattr(verl_config_module, "validate_config", verl_config_module.validate_config)
    monkeypatch.setattr(adapter_preflight, "version", lambda name: "0.8.0")
    plugin._install()
    with pytest.raises(SystemExit) as stopped:
        verl_config_module.validate_config(verl_config(f"actor_rollout_ref.model.path={policy}",
                                                       "trainer.v1.trainer_mode=arctic"))
    assert stopped.value.code == 2
    assert "arctic-verl supports verl >=0.9.1,<0.10; verl 0.8.0 is installed" in capsys.readouterr().err
