"""The box of a stored tensor that a box of its param covers, for the readers of stored
forms (models/safetensors_file.py, models/gguf/tensors.py): the param is the stored array
reshaped and transposed by `perm` (param axis i is stored axis perm[i])."""

from __future__ import annotations


def stored_box(index: tuple,  # slices of the param's axes (fewer: the rest whole), step 1
               param_shape: tuple, perm: tuple) -> list[tuple[int, int]]:  # (start, stop) per stored axis
    index = tuple(index) + (slice(None),) * (len(perm) - len(tuple(index)))
    box = [(0, 0)] * len(perm)
    for axis, (s, dim) in enumerate(zip(index, param_shape)):
        start, stop, step = s.indices(dim)
        if step != 1:
            raise ValueError(f"slice {s} of a checkpoint tensor must have step 1")
        box[perm[axis]] = (start, max(start, stop))
    return box
