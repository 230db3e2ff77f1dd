"""Inputs made by hand: the hand-worked batch "the cats sleep" ("cats" split into "cat" + "##s")
with its gold arcs, and a pattern hook that gives layer 0's heads known jobs."""

import torch

# Tokens: [CLS] the cat ##s sleep [SEP]; gold heads: the -> cats (det), cats -> sleep (nsubj).
WORD_OF_TOKEN = torch.tensor([[-1, 0, 1, 1, 2, -1]])


def hand_batch(index: int = 0):
    from probe.inputs.corpus import Batch
    from probe.inputs.treebank import RELATIONS

    rel = RELATIONS.index
    return Batch(
        input_ids=torch.zeros(1, 6, dtype=torch.long),
        attention_mask=torch.ones(1, 6, dtype=torch.long),
        word_of_token=WORD_OF_TOKEN,
        heads=torch.tensor([[1, 2, -1]]),
        relations=torch.tensor([[rel("det"), rel("nsubj"), rel("root")]]),
        punct=torch.zeros(1, 3, dtype=torch.bool),
        n_words=torch.tensor([3]),
        index=torch.tensor([index]),
    )


def set_patterns(p, name):
    """Layer 0: head 0 previous token, head 1 on [CLS], head 2 uniform; head 3 untouched."""
    real = p > 0  # masked keys get exactly zero weight
    out = p.clone()
    T = p.shape[-1]
    previous = torch.zeros(T, T)
    previous[0, 0] = 1
    previous[torch.arange(1, T), torch.arange(T - 1)] = 1
    out[:, 0] = previous
    out[:, 1] = 0
    out[:, 1, :, 0] = 1
    out[:, 2] = real[:, 2] / real[:, 2].sum(-1, keepdim=True)
    return out
