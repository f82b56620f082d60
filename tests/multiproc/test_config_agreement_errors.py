"""A config that fails on one rank, in any way, makes every rank raise its `ZeroConfigError` (probe 38D F6).

``zero3.initialize`` resolves the config, then every rank meets in the config agreement, which turns one
rank's error into the same `ZeroConfigError` on all of them. Only a `ZeroConfigError` reached the
agreement: a value whose reading raised something else (``10**400`` as a float knob raised
OverflowError) left that rank out, and its peers got a closed connection, or waited until the process
group's timeout when the failing rank lived on.
"""

from __future__ import annotations

import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import zero3

pytestmark = pytest.mark.multiproc

GOOD = {"collective_timeout": 30}


def initialize_with(configs: list, broken_reader: bool = False) -> tuple[str, str] | None:
    """``zero3.initialize`` with this rank's config (with ``broken_reader``, rank 1's config reader
    raises a RuntimeError, as a bug in it would): the error's type and message, or None."""
    rank = dist.get_rank()
    engine_module = sys.modules["zero3.engine"]
    reader = engine_module.resolve_config
    if broken_reader and rank == 1:
        reader = mock.Mock(side_effect=RuntimeError("a reader's bug"))
    try:
        with mock.patch.object(engine_module, "resolve_config", reader):
            zero3.initialize(torch.nn.Linear(4, 4), config=configs[rank])
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank got
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("bad, named", [
    ({"collective_timeout": 10**400}, "collective_timeout must be a finite number"),
    ({"zero_optimization": {"stage": 3}, "communication_data_type": ["bf16"]}, "communication_data_type must be"),
    ({"collective_timeout": 30, 1: 2}, "unknown config key 1"),
    ({"max_traces": 0}, "max_traces must be >= 1"),  # a ZeroConfigError already: the agreement carried it
])
def test_a_config_bad_on_one_rank_raises_its_config_error_on_every_rank(pools, bad, named):
    results = pools.get(2).run(initialize_with, [GOOD, bad], timeout=60)
    for rank, result in enumerate(results):
        assert result is not None, rank
        kind, message = result
        assert kind == "ZeroConfigError" and "the config is invalid on rank 1" in message and named in message, \
            (rank, result)


def test_a_reader_that_raises_anything_still_reaches_the_agreement(pools):
    """Whatever resolving the config raises on one rank (a bug in the reader included), every rank
    raises a ZeroConfigError naming it, instead of a peer's communication error or a wait until timeout."""
    results = pools.get(2).run(initialize_with, [GOOD, GOOD], True, timeout=60)
    for rank, result in enumerate(results):
        assert result is not None, rank
        kind, message = result
        assert kind == "ZeroConfigError" and "invalid on rank 1" in message, (rank, result)
        assert "reading or checking the config raised RuntimeError: a reader's bug" in message, (rank, result)
