"""Knowing the future order: the control protocol, sampler replay, datasets' sample lists,
streams of readers, and the next epoch's log laid out in that epoch's order (LCache)."""
