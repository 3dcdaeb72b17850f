"""models/kv_cache.single_sequence_metadata: the notebook helper maps tokens to slots, and a
prompt that does not fit the pages it is given is a clear error, not an IndexError."""

import numpy as np
import pytest

from jaxfill.models.kv_cache import single_sequence_metadata


def test_slots_follow_the_given_pages():
    meta = single_sequence_metadata(5, 14, [3, 7], page_size=16, pad_to=8)
    # tokens 14..18: the last two of page 3, then the first three of page 7; padding -1
    assert np.asarray(meta.slot_mapping).tolist() == [3 * 16 + 14, 3 * 16 + 15, 7 * 16, 7 * 16 + 1, 7 * 16 + 2,
                                                      -1, -1, -1]
    assert np.asarray(meta.kv_lens).tolist() == [19]
    assert np.asarray(meta.logits_indices).tolist() == [4]


def test_exactly_full_pages_fit():
    meta = single_sequence_metadata(32, 0, [1, 2], page_size=16)
    assert np.asarray(meta.slot_mapping)[-1] == 2 * 16 + 15


@pytest.mark.parametrize("num_tokens,start,pages", [(17, 0, [3]), (1, 32, [3, 5]), (20, 0, [])])
def test_too_few_pages_is_a_clear_error(num_tokens, start, pages):
    need = -(-(start + num_tokens) // 16)
    with pytest.raises(ValueError, match=f"need {need} pages of 16 tokens; got {len(pages)} pages"):
        single_sequence_metadata(num_tokens, start, pages, page_size=16)


def test_bad_counts_are_clear_errors():
    with pytest.raises(ValueError, match="num_tokens >= 1"):
        single_sequence_metadata(0, 0, [1], page_size=16)
    with pytest.raises(ValueError, match="pad_to=4 is less than num_tokens=5"):
        single_sequence_metadata(5, 0, [1], page_size=16, pad_to=4)
