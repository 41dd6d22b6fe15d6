"""Configuration of the conformance suite: profiles and upstream deviations.

Hypothesis profiles: ``fast`` (default, for CI) and ``thorough`` (nightly);
choose with ``--hypothesis-profile thorough`` or
``TORCH_CTXEXT_HYPOTHESIS_PROFILE=thorough``.

A test marked ``upstream_deviation(member, n)`` checks the documented contract
at a place where torch 2.15 is known to break it (docs/deviations.md). Where
``member`` is provided natively by torch, such a test is expected to fail
(strict xfail): it fails loudly the day upstream fixes the deviation.
"""
import os

import pytest
from hypothesis import HealthCheck, settings

import torch_ctxext

settings.register_profile(
    "fast",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.register_profile(
    "thorough",
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("TORCH_CTXEXT_HYPOTHESIS_PROFILE", "fast"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "upstream_deviation(member, number): checks the contract where native "
        "torch 2.15 is known to break it (docs/deviations.md)",
    )


def pytest_collection_modifyitems(config, items):
    features = torch_ctxext.features()
    for item in items:
        marker = item.get_closest_marker("upstream_deviation")
        if marker is None:
            continue
        member, number = marker.args
        if features.get(member) == "native":
            item.add_marker(
                pytest.mark.xfail(
                    strict=True,
                    reason=f"known upstream deviation {number} of {member} "
                    "(docs/deviations.md); an XPASS means upstream fixed it",
                )
            )
