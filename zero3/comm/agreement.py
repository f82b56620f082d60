"""Every rank runs with the same config, or every rank raises.

``zero3.Init`` and ``zero3.initialize`` resolve their config on each rank; ranks given different
configs (a per-rank ``max_live_parameters``) would partition, prefetch or persist differently and, where
no collective differs, train on quietly. A config that fails to resolve on one rank would leave the
others waiting in their first collective until a store timeout that names neither the rank nor the
config. So each rank posts a digest of its effective config, or its config error, in one object
exchange before anything else; on a difference the flat dicts are exchanged too, to name each key.
Where a rank keeps its swap files (`RANK_LOCAL`) may differ between ranks and is left out.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..config import ZeroConfig
from ..errors import ZeroConfigError
from ..metrics import StepMetrics
from .communicator import Communicator
from .settings import CommSettings
from .tags import Kind, Tag
from .wire import group_info


RANK_LOCAL = frozenset({"offload_param_nvme_path", "offload_optimizer_nvme_path"})
"""Knobs that may differ between ranks: each rank's own directory for its swap files (a local drive
per node, or one directory per rank), which changes nothing the ranks do together."""


def shared_knobs(config: ZeroConfig) -> dict[str, Any]:
    """The flat knobs every rank must agree on (all but `RANK_LOCAL`)."""
    return {k: v for k, v in config.to_dict().items() if k not in RANK_LOCAL}


def config_digest(config: ZeroConfig) -> str:
    """A digest of the knobs the ranks must share (equal configs, equal digests, on any rank)."""
    text = json.dumps(shared_knobs(config), sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def differing_keys(dicts: list[dict[str, Any]]) -> list[str]:
    """The keys whose value is not the same in every rank's flat config."""
    keys = sorted(set().union(*dicts))
    return [k for k in keys if any(d.get(k, "<unset>") != dicts[0].get(k, "<unset>") for d in dicts[1:])]


def agree_on_config(group: Any, config: ZeroConfig | None, error: ZeroConfigError | None, who: str) -> None:
    """A collective over ``group`` (every rank calls it, with its config or the error resolving it gave).

    Raises:
        ZeroConfigError: on every rank, when some rank's config was invalid (naming each such rank
            and its error), or when the configs differ (naming each differing key and every rank's
            value). With one rank, its own error.
    """
    group, world, rank = group_info(group)
    if world == 1:
        if error is not None:
            raise error
        return
    # The caller's group as it is: no group of its own to make (which a rank with no config could not
    # match) and no node exchange; verified, so a rank elsewhere in its collectives is named.
    comm = Communicator(group, CommSettings(overlap=False, verify=True, plans=1), metrics=StepMetrics(),
                        world_size=world, rank=rank, nodes=(0,) * world)
    digest = None if config is None else config_digest(config)
    posted = comm.exchange_objects((digest, None if error is None else str(error)),
                                   Tag(Kind.OBJECTS, f"{who} config agreement"))
    failed = [(r, message) for r, (_, message) in enumerate(posted) if message is not None]
    if failed:
        raise ZeroConfigError(
            f"{who}: the config is invalid on " + "; ".join(f"rank {comm.global_rank(r)}: {m}" for r, m in failed)
            + " (every rank stops here; fix that rank's config)") from error
    if len({d for d, _ in posted}) == 1:
        return
    assert config is not None
    dicts = comm.exchange_objects(shared_knobs(config), Tag(Kind.OBJECTS, f"{who} config difference"))
    keys = differing_keys(dicts)
    detail = "; ".join(f"{k}: " + ", ".join(f"rank {comm.global_rank(r)} = {d.get(k, '<unset>')!r}"
                                            for r, d in enumerate(dicts))
                       for k in keys)
    raise ZeroConfigError(f"{who}: the ranks' configs differ in {', '.join(keys)} ({detail}); pass every rank "
                          "the same config")
