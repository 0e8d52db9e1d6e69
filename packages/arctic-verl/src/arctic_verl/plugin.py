"""The verl plugin (entry point group ``verl.plugins``): registers ``trainer.v1.trainer_mode=arctic``.

verl imports every plugin at ``import verl``, in its driver and in each of its Ray actors, and
logs a plugin that fails only at DEBUG. So this module reports its own problems: it never raises
at import; instead, a run that asks for the ``arctic`` mode stops at verl's config check, in the
driver, with one line saying what is wrong (an unsupported verl version, a failed import, a
setting Arctic cannot honour, an unreachable server, a missing model).
"""

from __future__ import annotations

import sys

MODE = "arctic"
SUPPORTED = ("0.9.1", "0.10")  # verl releases this adapter is tested with


def _asks_for_arctic(config) -> bool:
    from omegaconf import OmegaConf

    return OmegaConf.select(config, "trainer.v1.trainer_mode") == MODE


def _check_at_start(problem: str | None) -> None:
    """Run Arctic's start-up checks inside verl's ``validate_config`` (the driver calls it before
    it starts Ray); ``problem`` is one found already, at import."""
    import verl.utils.config as verl_config

    original = verl_config.validate_config

    def validate_config(config, *args, **kwargs):
        if _asks_for_arctic(config):
            from arctic_verl.preflight import fail_fast

            fail_fast(config, problem)
        return original(config, *args, **kwargs)

    verl_config.validate_config = validate_config


def _install() -> None:
    from arctic_core.adapters.preflight import version_problem

    problem = version_problem("arctic-verl", "verl", *SUPPORTED)
    if problem:
        _check_at_start(problem)
        return
    from arctic_core.ray.actors import ray_environment

    ray_environment()  # before verl starts Ray: workers run this environment as it is
    import arctic_verl.trainer  # noqa: F401  (registers the mode)

    _check_at_start(None)


try:
    _install()
except Exception as exc:  # verl would hide it: say it, and stop any run that asks for the mode
    print(f"arctic-verl: the verl plugin failed to load: {exc!r}", file=sys.stderr)
    try:
        _check_at_start(f"the arctic-verl plugin failed to load: {exc!r}")
    except Exception:
        pass
