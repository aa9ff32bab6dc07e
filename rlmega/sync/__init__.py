"""Weight sync: trained Megatron shards -> rollout engines, versioned and checked."""

from rlmega.sync.weight_sync import SyncStats, WeightSyncError, post_sync_check, push_weights

__all__ = ["SyncStats", "WeightSyncError", "post_sync_check", "push_weights"]
