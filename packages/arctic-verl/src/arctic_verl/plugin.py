"""The verl plugin (entry point group ``verl.plugins``): registers ``trainer.v1.trainer_mode=arctic``.

verl imports every plugin at ``import verl``, in its driver and in each of its Ray actors, and
logs a plugin that fails only at DEBUG. So this module reports its own problems: it never raises
at import; instead, a run that asks for the ``arctic`` mode stops at verl's config check, in the
driver, with one line saying what is wrong (an unsupported verl version, a failed import, a
setting Arctic cannot honour, an unreachable server, a missing model). A misspelt mode
(``trainer_mode=artic``) stops there too, and a run on ``arctic.url`` whose server goes away ends
on a line naming it.
"""

from __future__ import annotations

import difflib
import sys

MODE = "arctic"
NEAR_MISS = 0.7  # difflib's ratio from which a trainer mode reads as a misspelt 'arctic' ('arctic-verl' included)
RERUN = "rerun to resume from the last checkpoint"


def _asks_for_arctic(config) -> bool:
    from omegaconf import OmegaConf

    return OmegaConf.select(config, "trainer.v1.trainer_mode") == MODE


def _check_at_start(problem: str | None) -> None:
    """Run Arctic's start-up checks inside verl's ``validate_config`` (the driver calls it before
    it starts Ray); ``problem`` is one found already, at import."""
    import verl.utils.config as verl_config

    original = verl_config.validate_config

    def validate_config(config, *args, **kwargs):
        _check_mode_spelling(config)
        if _asks_for_arctic(config):
            from arctic_verl.preflight import fail_fast

            fail_fast(config, problem)
            _name_a_lost_server(config, sys._getframe(1).f_globals)
            from arctic_verl.run_folders import under_runs

            under_runs(config)  # checkpoints and TensorBoard logs under runs/verl/, not the working folder
        return original(config, *args, **kwargs)

    verl_config.validate_config = validate_config


def _check_mode_spelling(config) -> None:
    """A misspelt ``trainer_mode=arctic`` stops here, in seconds: verl itself finds an unknown mode
    only inside its first Ray actor. Any mode verl has registered passes, however it is spelt."""
    from omegaconf import OmegaConf

    mode = OmegaConf.select(config, "trainer.v1.trainer_mode")
    if not OmegaConf.select(config, "trainer.use_v1", default=True) or not isinstance(mode, str) or mode == MODE:
        return
    if not difflib.get_close_matches(mode.lower(), [MODE], n=1, cutoff=NEAR_MISS) or mode in _registered_modes():
        return
    from arctic_core.adapters.preflight import exit_with

    known = ", ".join(sorted(_registered_modes() | {MODE}))
    exit_with("arctic-verl", f"trainer.v1.trainer_mode={mode!r}: no such trainer mode; did you mean '{MODE}'? "
                             f"(verl's modes: {known})")


def _registered_modes() -> set[str]:
    """The trainer modes verl knows in this process (its own and those of its plugins)."""
    try:
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    except Exception:  # noqa: BLE001 (a verl without v1 trainers, or one that fails to import: nothing is known for sure)
        return set()
    return set(TRAINER_REGISTRY)


def _name_a_lost_server(config, caller: dict) -> None:
    """With ``arctic.url``: a run whose server went away ends on one line saying so, not on what
    verl's trainer failed with next (its workers' errors, an empty batch).

    verl's ``main()`` calls ``run_ppo`` right after ``validate_config``; the wrapper goes where
    ``main()`` looks the name up, its own module's globals (``__main__`` under ``python -m``), so an
    entry point with no ``run_ppo`` is left as it is."""
    from arctic_verl.settings import read_settings

    settings, run = read_settings(config), caller.get("run_ppo")
    if not settings.url or not callable(run) or getattr(run, "names_a_lost_server", False):
        return

    def run_ppo(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except Exception:
            from arctic_core.adapters.lost_server import end_if_server_lost

            end_if_server_lost("arctic-verl", settings, RERUN)
            raise

    run_ppo.names_a_lost_server = True
    caller["run_ppo"] = run_ppo


def _install() -> None:
    from arctic_core.adapters.mapping import framework_version_problem
    from arctic_verl.mapping import MAPPING

    problem = framework_version_problem(MAPPING)
    if problem:
        _check_at_start(problem)
        return
    from arctic_core.ray.actors import ray_environment

    ray_environment()  # before verl starts Ray: workers run this environment as it is
    from arctic_verl.run_folders import hydra_run_dir, main_module

    hydra_run_dir(sys.argv, main_module(), MODE)  # before main_ppo's Hydra reads the command line
    import arctic_verl.trainer  # noqa: F401  (registers the mode)

    _check_at_start(None)


try:
    _install()
except Exception as exc:  # noqa: BLE001 (verl would hide it: say it, and stop any run that asks for the mode)
    print(f"arctic-verl: the verl plugin failed to load: {exc!r}", file=sys.stderr)
    try:
        _check_at_start(f"the arctic-verl plugin failed to load: {exc!r}")
    except Exception:  # noqa: BLE001 (the plugin never raises at import)
        pass
