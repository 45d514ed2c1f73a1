"""Batched random augmentation on the device: spatial (crops, flips, affine) and intensity."""
