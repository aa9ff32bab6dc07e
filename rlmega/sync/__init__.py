"""Weight sync: trained Megatron shards -> rollout engines, through a transport, versioned and checked.

See README.md in this folder.
"""

from rlmega.sync.config import SyncConfig
from rlmega.sync.errors import StaleWeightsError, TransportError, WeightSyncError
from rlmega.sync.post_sync_check import PostSyncCheck, post_sync_check
from rlmega.sync.registry import TRANSPORTS, kept_transport, make_transport
from rlmega.sync.stats import SyncStats
from rlmega.sync.transports import BucketTransport, stream_update
from rlmega.sync.weight_sync import GatheredTransport, Transport, WeightSync, push_weights, require_version

__all__ = [
    "TRANSPORTS",
    "BucketTransport",
    "GatheredTransport",
    "PostSyncCheck",
    "StaleWeightsError",
    "SyncConfig",
    "SyncStats",
    "Transport",
    "TransportError",
    "WeightSync",
    "WeightSyncError",
    "kept_transport",
    "make_transport",
    "post_sync_check",
    "push_weights",
    "require_version",
    "stream_update",
]
