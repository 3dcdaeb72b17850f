"""The check every linear rule's oracle test makes (tests/test_gated_delta_rule*.py,
tests/test_ssd*.py): on a ragged batch of `lens` sequences whose state array has one more,
NaN-filled slot, the live rows' outputs and the sequences' final states equal the
float64 oracle's, are finite, and the unused slot is neither read nor written."""

import numpy as np


def check_against_oracle(out: np.ndarray,  # [T, H, V] the rule's output (padding rows after the live ones)
                         states: np.ndarray,  # [S+1, H, K, V] its final states (the last slot unused)
                         want_out: np.ndarray,  # [live rows, H, V] float64
                         want_states: np.ndarray,  # [S(+1), H, K, V] float64
                         lens: list[int],
                         tol: float) -> None:
    live, s = sum(lens), len(lens)
    assert np.isfinite(out[:live]).all() and np.isfinite(states[:s]).all()
    np.testing.assert_allclose(out[:live], want_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(states[:s], want_states[:s], rtol=tol, atol=tol)
    assert np.isnan(states[s]).all()  # the unused slot: never read, never written
