"""Host-side layout of a batch of images for the encoder, from their (t, h, w) patch grids.

The processor emits each image's patches in spatial-merge-block order (every m x m block of
patches contiguous, blocks in raster order, frames one after another), so the merger can fold
m*m consecutive rows into one. Everything here follows that order: the rotary (row, col) of
each patch, the bilinear taps into the learned square position table (align_corners, as
transformers resamples it), and the image each patch belongs to (attention stays within an
image). Built in numpy once per batch of images: the shapes depend on the grids, which the
jitted encoder sees as static row counts only.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class GridLayout:
    rows_cols: np.ndarray  # [N, 2] int32: each patch's (row, col) in its image
    taps: np.ndarray  # [N, 4] int32: rows of the learned position table
    tap_weights: np.ndarray  # [N, 4] f32: their bilinear weights
    segments: np.ndarray  # [N] int32: which image (frame) a patch belongs to


def block_order(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row [h*w], col [h*w]) of the patches in spatial-merge-block order."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return (rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1),
            cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1))


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Two taps and weights per target index, the target axis (size) stretched over the table
    side with its end points on the table's end points; in f32 in torch's operation order, so
    the weights round as transformers' do."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)),
                         np.float32(0))
    return np.clip(taps, 0, side - 1), weights.astype(np.float32)


def layout(grids: list[tuple[int, int, int]], merge: int, side: int) -> GridLayout:
    """The layout of images with patch grids `grids` [(t, h, w), ...], in that order."""
    rows_cols, taps, weights, segments = [], [], [], []
    segment = 0
    for t, h, w in grids:
        row, col = block_order(h, w, merge)
        h_taps, h_w = _axis_taps(row, h, side)
        w_taps, w_w = _axis_taps(col, w, side)
        frame_taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        frame_weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
        for _ in range(t):
            rows_cols.append(np.stack([row, col], -1))
            taps.append(frame_taps)
            weights.append(frame_weights)
            segments.append(np.full(h * w, segment))
            segment += 1
    return GridLayout(np.concatenate(rows_cols).astype(np.int32), np.concatenate(taps).astype(np.int32),
                      np.concatenate(weights).astype(np.float32), np.concatenate(segments).astype(np.int32))
