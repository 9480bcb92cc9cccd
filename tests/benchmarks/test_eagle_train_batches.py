"""benchmarks/eagle_train.py's padded batches: a conversation's loss and counts in a batch
with a longer one are what it gives alone (the padding at the end never reaches real rows)."""

from __future__ import annotations

import torch

from benchmarks.eagle_train import HeadWeights, ttt_loss

CONFIG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, rope_theta=10000.0)


def test_a_padded_batch_scores_each_conversation_as_alone():
    torch.manual_seed(0)
    head = HeadWeights(CONFIG, 50, torch.randn(200, 64), torch.arange(0, 100, 2), torch.ones(64))
    lengths, batch = [30, 22], []
    for n in lengths:
        labels = torch.randint(-1, 50, (n - 1,))
        labels[:5] = -1  # context rows
        batch.append((torch.randn(n, 192), torch.randint(0, 100, (n,)), labels))
    alone = [ttt_loss(head, a[None], ids[None], lab[None], 3) for a, ids, lab in batch]
    aux, token_ids = torch.zeros(2, 30, 192), torch.zeros(2, 30, dtype=torch.int64)
    labels = torch.full((2, 29), -1)
    for j, (a, ids, lab) in enumerate(batch):
        aux[j, :len(ids)], token_ids[j, :len(ids)], labels[j, :len(lab)] = a, ids, lab
    loss, counts = ttt_loss(head, aux, token_ids, labels, 3)
    assert counts == [(a[0] + b[0], a[1] + b[1]) for a, b in zip(alone[0][1], alone[1][1])]
    # every step's count is the same here (rows 5.. scored), so the batch's loss is the
    # count-weighted mean of the two alone
    n0, n1 = alone[0][1][0][1], alone[1][1][0][1]
    expected = (alone[0][0] * n0 + alone[1][0] * n1) / (n0 + n1)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
