"""Weight sync: trained Megatron shards -> rollout engines, through a transport, versioned and checked.

See README.md in this folder.
"""

from rlmega.sync.errors import StaleWeightsError, TransportError, WeightSyncError
from rlmega.sync.registry import TRANSPORTS, kept_transport, make_transport
from rlmega.sync.transports import Transport, stream_update
from rlmega.sync.weight_sync import SyncStats, post_sync_check, push_weights, require_version

__all__ = [
    "TRANSPORTS",
    "StaleWeightsError",
    "SyncStats",
    "Transport",
    "TransportError",
    "WeightSyncError",
    "kept_transport",
    "make_transport",
    "post_sync_check",
    "push_weights",
    "require_version",
    "stream_update",
]
