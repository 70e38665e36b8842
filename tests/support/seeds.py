"""One printed seed replays a run: the test order and every hypothesis example (a pytest plugin,
loaded by ``tests/conftest.py``).

* The order: ``--random-order`` (pytest-random-order, in ``addopts``) shuffles the modules and
  the tests inside each module, with a seed it prints in the header (``Using
  --random-order-seed=N``); ``--random-order-seed=N`` replays it, ``--random-order-bucket=none`` turns it
  off. Module buckets keep a module's tests together, so a module-scoped fixture (a private
  broker, a module's training run) is still set up once.
* Hypothesis: the ``rlstream`` profile, loaded here unless ``--hypothesis-profile`` names
  another, is the active one (``ci`` under ``CI=true``, else ``default``) with ``derandomize``
  off and ``print_blob`` on: every run explores new examples, CI included, and a failure prints
  its falsifying example with a ``@reproduce_failure`` blob. Unless ``--hypothesis-seed`` is
  given, hypothesis draws from the run's seed, so the one seed replays the examples too. A
  failed hypothesis test says the seed in a section of its report (``hypothesis seed``). A test
  that sets ``derandomize=True`` itself (the codec fuzz) keeps its fixed examples.
"""

from __future__ import annotations

import random

import pytest

_SEED = pytest.StashKey[int]()


def run_seed(config: pytest.Config) -> int:
    """The run's seed: pytest-random-order's (given or drawn), or drawn here without it."""
    if _SEED not in config.stash:
        seed = None
        if config.pluginmanager.hasplugin("random_order"):
            value = str(config.getoption("random_order_seed", default="") or "").removeprefix("default:")
            if value.isdigit():
                seed = int(value)
        config.stash[_SEED] = seed if seed is not None else random.randint(1, 1_000_000)
    return config.stash[_SEED]


def _hypothesis_seed(config: pytest.Config) -> int:
    given = config.getoption("--hypothesis-seed", default=None)
    return int(given) if given is not None else run_seed(config)


@pytest.hookimpl(trylast=True)  # after hypothesis' own plugin has read its options
def pytest_configure(config: pytest.Config) -> None:
    from hypothesis import core, settings

    if not config.getoption("--hypothesis-profile", default=None):
        settings.register_profile("rlstream", parent=settings.get_profile(settings.get_current_profile_name()),
                                  derandomize=False, print_blob=True)
        settings.load_profile("rlstream")
    if config.getoption("--hypothesis-seed", default=None) is None:
        core.global_force_seed = run_seed(config)


def pytest_report_header(config: pytest.Config) -> str:
    return (f"rlstream seed {run_seed(config)}: --random-order-seed={run_seed(config)} replays the order, "
            f"--hypothesis-seed={_hypothesis_seed(config)} the hypothesis examples")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.when == "call" and rep.failed and getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
        seed = _hypothesis_seed(item.config)
        rep.sections.append(("hypothesis seed", f"hypothesis seed {seed}: rerun with --hypothesis-seed={seed} "
                                                f"(and --random-order-seed={run_seed(item.config)} for this run's order)"))
    return rep
