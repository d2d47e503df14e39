"""Former home of the epoch schedule and shuffle, now :mod:`datacat.loading.epochs` and :mod:`datacat.loading.shuffle`.

Kept until imports are repointed.
"""

from datacat.loading.epochs import Schedule, cumulative, locate, plan_schedule, round_robin_consumed
from datacat.loading.shuffle import Feistel, epoch_key, shard_order

__all__ = [
    "Feistel",
    "Schedule",
    "cumulative",
    "epoch_key",
    "locate",
    "plan_schedule",
    "round_robin_consumed",
    "shard_order",
]
