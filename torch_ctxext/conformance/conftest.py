"""Configuration of the conformance suite: profiles and upstream deviations.

Hypothesis profiles: ``fast`` (default, for CI) and ``thorough`` (nightly);
choose with ``--hypothesis-profile thorough`` or
``TORCH_CTXEXT_HYPOTHESIS_PROFILE=thorough``.

A test marked ``upstream_deviation(member, n)`` checks the documented contract
at a place where native torch is known to break it (docs/deviations.md). Where
``member`` is provided natively by torch, such a test is expected to fail
(strict xfail): it fails loudly the day upstream fixes the deviation. A
deviation of older releases only, fixed upstream since, says up to which
release it exists: ``upstream_deviation(member, n, until=(2, 10))``; on later
releases the test must pass.
"""
import os

import pytest
from hypothesis import HealthCheck, settings

import torch_ctxext
from torch_ctxext import _features

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
        "upstream_deviation(member, number, until=None): checks the contract "
        "where native torch (up to release `until`, default every release) is "
        "known to break it (docs/deviations.md)",
    )


def deviates(marker, features, release):
    """Whether the running torch has the deviation ``marker`` describes."""
    member, _number = marker.args
    until = marker.kwargs.get("until")
    return features.get(member) == "native" and (until is None or release <= tuple(until))


def pytest_collection_modifyitems(config, items):
    features = torch_ctxext.features()
    release = _features.torch_release()
    for item in items:
        marker = item.get_closest_marker("upstream_deviation")
        if marker is None or not deviates(marker, features, release):
            continue
        member, number = marker.args
        item.add_marker(
            pytest.mark.xfail(
                strict=True,
                reason=f"known upstream deviation {number} of {member} on torch "
                f"{release[0]}.{release[1]} (docs/deviations.md); an XPASS means "
                "upstream fixed it",
            )
        )
