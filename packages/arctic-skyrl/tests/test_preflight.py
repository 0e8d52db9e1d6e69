"""Bad settings end SkyRL's start within seconds with one line naming the problem (exit status 2)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from skyrl_run import gsm8k_rows, main_base_args, run_main_base, write_parquet

CASES = {
    "unsupported loss": (("trainer.algorithm.policy_loss_type=clip_cov",),
                         "trainer.algorithm.policy_loss_type='clip_cov': supported: regular, dual_clip"),
    "critic": (("trainer.critic.model.path=/somewhere", "trainer.algorithm.advantage_estimator=gae"),
               "trainer.critic.model.path='/somewhere': a critic (value model) is not served"),
    "stop strings": (("generator.sampling_params.stop=['###']",), "generator.sampling_params.stop=['###']"),
    "unknown arctic key": (("arctic.urll=http://x",),
                           "arctic.urll: unknown key in the arctic section (did you mean 'url'?)"),
    "unreachable server": (("arctic.url=http://127.0.0.1:9",), "127.0.0.1:9"),
    "missing model": (("trainer.policy.model.path=/no/such/model",), "/no/such/model"),
}


@pytest.fixture(scope="module")
def outcomes(policy, tmp_path_factory):
    """Each case's SkyRL run and its seconds; the runs go at once (each is mostly SkyRL's imports)."""

    def attempt(case: str):
        folder = tmp_path_factory.mktemp(case.replace(" ", "-"))
        data = write_parquet(gsm8k_rows(4), folder / "train.parquet")
        start = time.monotonic()
        result = run_main_base(main_base_args(policy, data, folder, steps=1, extra=CASES[case][0]), cwd=folder,
                               timeout=180)
        return result, time.monotonic() - start

    with ThreadPoolExecutor(len(CASES)) as pool:
        return dict(zip(CASES, pool.map(attempt, CASES), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_bad_settings_exit_fast_with_one_message(outcomes, case):
    result, seconds = outcomes[case]
    message = CASES[case][1]
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("arctic-skyrl: error:")]
    assert len(errors) == 1 and message in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert seconds < 90  # no Ray, no model load, no data (six runs sharing the cores)


def test_an_unsupported_skyrl_version_is_refused(monkeypatch, policy):
    from arctic_core.adapters import preflight as adapter_preflight
    from arctic_core.errors import ArcticError
    from arctic_skyrl.preflight import preflight
    from arctic_skyrl.settings import ArcticSkyRLConfig

    monkeypatch.setattr(adapter_preflight, "version", lambda name: "0.3.0")
    cfg = ArcticSkyRLConfig.from_cli_overrides([f"trainer.policy.model.path={policy}"])
    with pytest.raises(ArcticError, match=r"arctic-skyrl supports skyrl >=0.4.0,<0.5; skyrl 0.3.0 is installed"):
        preflight(cfg)


def test_what_would_fail_after_ray_starts_is_named_before(policy):
    """Backend options (checked by the backend's own model, without importing it) and a response
    limit that leaves no room for a prompt in the model's positions."""
    from arctic_core.errors import ArcticError
    from arctic_skyrl.preflight import preflight
    from arctic_skyrl.settings import ArcticSkyRLConfig

    for override, message in (("arctic.config.trainer.options.zero_stge=2",
                               "trainer.options.zero_stge: unknown key (did you mean 'zero_stage'?)"),
                              ("generator.sampling_params.max_generate_length=512",
                               "max_generate_length + one prompt token = 513 tokens, more than the model's "
                               "max_position_embeddings=512")):
        cfg = ArcticSkyRLConfig.from_cli_overrides([f"trainer.policy.model.path={policy}", override])
        with pytest.raises(ArcticError) as refused:
            preflight(cfg)
        assert message in str(refused.value)
