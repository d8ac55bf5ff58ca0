"""Hygiene checks that need no launch: labels all -100, and reading sample indices without drawing them."""

from __future__ import annotations

import random

import pytest
import torch

from hf_fsdp_qlora.train.hygiene import NoLabelsError, check_labels, sample_indices


def test_check_labels():
    check_labels(torch.tensor([[-100, -100, 5]]))
    check_labels(None)
    with pytest.raises(NoLabelsError, match=r"Every label in the first batch is -100.*max_length"):
        check_labels(torch.full((2, 4), -100), where="the first batch")


def test_sample_indices_leave_the_real_draw_unchanged():
    data = list(range(10))
    torch.manual_seed(3)
    random.seed(3)
    expected = [b.tolist() for b in torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)]
    torch.manual_seed(3)
    random.seed(3)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    peeked = sample_indices(loader, 2)
    assert peeked == [b for b in expected[:2]]  # the indices equal the samples for this dataset
    assert [b.tolist() for b in loader] == expected

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    assert sample_indices(torch.utils.data.DataLoader(Stream(), batch_size=2), 2) is None
