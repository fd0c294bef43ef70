"""Packed chat-SFT rows for the step benchmark: conversations of ultrachat's shape, prompts masked, flattened.

The conversations of ``examples/data/ultrachat_sample.jsonl`` give the shape: how many turns, each turn's share
of its conversation, and the spread of conversation lengths (the log-length's standard deviation). Their
absolute size does not carry over (the sample's conversations are short by design), so documents are scaled to
a mean of ``doc_tokens`` tokens. Each row is what ``DataCollatorWithFlattening`` (TRL's ``padding_free``)
gives a model: one row of several documents, ``position_ids`` restarting at each, the user turns' labels
-100 (assistant-only loss), the first label of every document -100 (no loss across a boundary), the flash
varlen arguments ``cu_seq_lens_q/k`` and ``max_length_q/k``, and ``seq_idx`` (each token's document, as
``return_seq_idx=True`` gives it). transformers hands the causal-conv1d package only the arguments its function
names: ``seq_idx`` is the one that keeps its conv window inside each document (without it the window of a
document's first three tokens reached into the document before).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import random
import statistics

import torch

SAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data", "ultrachat_sample.jsonl"
)


@functools.cache
def conversations(path: str = SAMPLE) -> tuple[tuple[tuple[bool, int], ...], ...]:
    """Each conversation as ``(is_prompt, characters)`` per turn (system and user turns are prompt). Read once a
    process: every timed step draws its rows from it, and a file read there would be host time in the step."""
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return tuple(tuple((m["role"] != "assistant", len(m["content"])) for m in row["messages"]) for row in rows)


def shape(convs) -> dict:
    """What the rows take from the sample: the log-length spread and the prompt share (reported with a run)."""
    totals = [sum(chars for _, chars in conv) for conv in convs]
    prompt = [sum(c for p, c in conv if p) / sum(c for _, c in conv) for conv in convs]
    return {
        "conversations": len(convs),
        "log_length_std": round(statistics.pstdev(math.log(t) for t in totals), 3),
        "prompt_share": round(statistics.mean(prompt), 3),
        "turns": round(statistics.mean(len(conv) for conv in convs), 2),
    }


def documents(total: int, doc_tokens: int, draws: random.Random, convs=None) -> list[list[tuple[bool, int]]]:
    """Documents filling ``total`` tokens: a sampled conversation each, its length drawn log-normally around
    ``doc_tokens`` with the sample's spread, its turns in their sample proportions; the last one cut at the
    row's end."""
    convs = convs or conversations()
    sigma = shape(convs)["log_length_std"]
    mu = math.log(doc_tokens) - sigma * sigma / 2  # the mean of the drawn lengths is doc_tokens
    docs, used = [], 0
    while used < total:
        conv = draws.choice(convs)
        length = min(total - used, max(len(conv), round(draws.lognormvariate(mu, sigma))))
        docs.append(_split(length, conv))
        used += length
    return docs


def _split(length: int, conv: list[tuple[bool, int]]) -> list[tuple[bool, int]]:
    """``length`` tokens over ``conv``'s turns in proportion to their characters (largest remainders)."""
    chars = sum(c for _, c in conv)
    exact = [length * c / chars for _, c in conv]
    counts = [math.floor(e) for e in exact]
    for i in sorted(range(len(conv)), key=lambda i: counts[i] - exact[i])[: length - sum(counts)]:
        counts[i] += 1
    return [(p, n) for (p, _), n in zip(conv, counts) if n]


def packed_batch(total: int, doc_tokens: int, vocab: int, draws: random.Random, device) -> dict:
    """One flattened row of ``total`` tokens as the model gets it (see the module docstring)."""
    docs = documents(total, doc_tokens, draws)
    lengths = [sum(t for _, t in doc) for doc in docs]
    ids = torch.randint(0, vocab, (1, total))
    labels = ids.clone()
    start = 0
    for doc in docs:
        labels[0, start] = -100
        for is_prompt, tokens in doc:
            if is_prompt:
                labels[0, start : start + tokens] = -100
            start += tokens
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
    return {
        "input_ids": ids.to(device),
        "labels": labels.to(device),
        "position_ids": position_ids.to(device),
        "cu_seq_lens_q": cu.to(device),
        "cu_seq_lens_k": cu.to(device),
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
        "seq_idx": seq_idx.unsqueeze(0).to(device),
        "documents": len(lengths),
        "labelled": int((labels != -100).sum()),
    }
