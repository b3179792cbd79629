"""iCACHE's importance: per-sample scores from the training's losses (booked by the samples
actually served, in losses), the H-list, and the packer that builds substitution packages
of L-samples."""

from dlcachefs.importance.scores import Importance, JobImportance, percentile_ranks, select_epoch

__all__ = ["Importance", "JobImportance", "percentile_ranks", "select_epoch"]
