"""Whole-volume inference: sliding-window prediction, flip test-time augmentation, NIfTI writers.

:func:`sliding_window` tiles a 2-D or 3-D input with overlapping ROIs, runs the model on batches of
windows and blends the outputs with a constant or Gaussian weight, the scheme of MONAI's
``sliding_window_inference`` (same window positions and weights, so results agree to float
rounding). :func:`flip_tta` averages predictions over mirrored inputs. :func:`write_nifti` and
:func:`save_segmentation` write predictions in the geometry (affine and header) of the input file, the
labels taken there from linearly resampled probabilities (:func:`~fastvision.inference.nifti.labels_on_input`);
:func:`predict_nifti_files` runs all of it for ``fastvision predict`` on NIfTI files and BraTS folders.
``volumes`` (ensembles of folds, the pipelined and sharded predict), ``postprocess`` (largest
component, decided by cross-validation) and ``folds`` (``train --folds``, ``predict DIR``; above the
engine, so never imported here) complete the path from folds to deployed predictions.
"""
from fastvision.inference.window import (
    flip_tta,
    importance_map,
    sliding_window,
    sliding_window_inference,
    window_starts,
)

__all__ = ["flip_tta", "importance_map", "sliding_window", "sliding_window_inference", "window_starts"]
