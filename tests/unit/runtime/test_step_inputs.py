"""The inputs of one forward: each node at its prefix + depth, seeing its prefix and its ancestors only."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lookahead.algorithm.draft import Draft
from lookahead.runtime.step_inputs import (
    FULL,
    SLIDING,
    AttentionMasks,
    Segment,
    decode_inputs,
    own_visibility,
    ragged_inputs,
    ragged_tokens,
)

PLAIN = AttentionMasks(SimpleNamespace(), torch.float32)


def seen(mask: torch.Tensor) -> list[str]:
    """Each query row of a [1, 1, q, kv] additive mask as a string: 1 where the key is visible."""
    assert set(mask.unique().tolist()) <= {0.0, torch.finfo(mask.dtype).min}
    return ["".join("1" if v == 0 else "0" for v in row) for row in mask[0, 0].tolist()]


def blocks(*rows: str) -> list[str]:
    """Rows written with a space between the segments' reads."""
    return [row.replace(" ", "") for row in rows]


def test_a_ragged_step_places_each_segment_after_its_own_prefix():
    tree = Draft([10, 11, 12, 13], [-1, 0, 1, 0])  # 10 -> 11 -> 12, and 10 -> 13
    segments = [
        Segment(slot=0, start=3, prompt=[], draft=tree),  # decoding after 3 cached entries
        Segment(slot=1, start=2, prompt=[20, 21], draft=Draft([22, 23], [-1, 0])),  # the prompt's last chunk
        Segment(slot=2, start=0, prompt=[30, 31, 32], draft=None),  # a chunk that does not end the prompt
    ]
    ids, positions, mask = ragged_inputs(segments, PLAIN)
    assert ids.tolist() == [[10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32]]
    assert positions.tolist() == [[3, 4, 5, 4, 2, 3, 4, 5, 0, 1, 2]]
    assert mask.shape == (1, 1, 11, 7 + 6 + 3)  # each segment reads start + width entries
    assert seen(mask) == blocks(
        # slot 0: 3 cached, 4 nodes | slot 1: 2 cached, 2 chunk, 2 draft | slot 2: 3 chunk
        "111 1000 00 0000 000",
        "111 1100 00 0000 000",
        "111 1110 00 0000 000",
        "111 1001 00 0000 000",  # 13 sees the root, not its sibling's branch
        "000 0000 11 1000 000",
        "000 0000 11 1100 000",
        "000 0000 11 1110 000",
        "000 0000 11 1111 000",
        "000 0000 00 0000 100",
        "000 0000 00 0000 110",
        "000 0000 00 0000 111",
    )


def test_each_rows_own_lists_name_what_its_mask_row_shows_past_its_prefix():
    """The lists the fused stack reads in place of the mask: row r sees its slot's first `start`
    entries and then exactly the columns of its own segment that its mask row shows."""
    segments = [
        Segment(slot=0, start=3, prompt=[], draft=Draft([10, 11, 12, 13], [-1, 0, 1, 0])),
        Segment(slot=1, start=2, prompt=[20, 21], draft=Draft([22, 23], [-1, 0])),
        Segment(slot=2, start=0, prompt=[30, 31, 32], draft=None),
    ]
    ids, positions, mask = ragged_inputs(segments, PLAIN)
    assert [t.tolist() for t in ragged_tokens(segments)] == [ids.tolist(), positions.tolist()]
    offsets, columns = own_visibility(segments)
    assert offsets.dtype == columns.dtype == torch.int32
    lists = [columns[offsets[r] : offsets[r + 1]].tolist() for r in range(len(offsets) - 1)]
    tree, chunk_and_draft, chunk = lists[:4], lists[4:8], lists[8:]
    assert tree == [[0], [0, 1], [0, 1, 2], [0, 3]]  # 13 sees the root, not its sibling's branch
    assert chunk_and_draft == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert chunk == [[0], [0, 1], [0, 1, 2]]
    rows = seen(mask)
    row = column = 0
    for segment in segments:  # the same rows, read off the mask's diagonal blocks
        for t in range(segment.width):
            own = rows[row + t][column + segment.start : column + segment.start + segment.width]
            assert [i for i, bit in enumerate(own) if bit == "1"] == lists[row + t]
            assert rows[row + t][column : column + segment.start] == "1" * segment.start
        row, column = row + segment.width, column + segment.start + segment.width


def test_a_decode_step_pads_short_drafts_with_rows_that_see_only_themselves():
    drafts = [Draft([5], [-1]), Draft([6, 7, 8], [-1, 0, 0])]
    ids, positions, mask = decode_inputs(drafts, lengths=[4, 2], masks=PLAIN)
    assert ids.tolist() == [[5, 0, 0], [6, 7, 8]]
    assert positions.tolist() == [[4, 0, 0], [2, 3, 3]]
    assert [seen(mask[i : i + 1]) for i in range(2)] == [
        ["1111100", "0000010", "0000001"],
        ["1110000", "1111000", "1110100"],  # siblings 7 and 8 see the root, not each other
    ]


def test_sliding_layers_see_only_their_window_and_full_layers_everything():
    masks = AttentionMasks(
        SimpleNamespace(sliding_window=2, layer_types=[FULL, SLIDING, FULL]), torch.float32
    )
    _, _, mask = ragged_inputs([Segment(slot=0, start=0, prompt=[1, 2, 3, 4], draft=None)], masks)
    assert seen(mask[FULL]) == ["1000", "1100", "1110", "1111"]
    assert seen(mask[SLIDING]) == ["1000", "1100", "0110", "0011"]
