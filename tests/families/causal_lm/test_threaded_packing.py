"""Packing on a CPU with several threads (``batch_budget.masks_per_forward``'s token floor): the rule on hand-built
sizes, and a causal LM whose rows are as large as a real LM's (the logits of a 32,000-word vocabulary) packed to
the floor at two threads, against the plain path at one mask a pass.

The plain path with one mask a pass is the independent route (itself checked against weight surgery in
test_causal_lm_gates.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_lm_tokenizer, lm_text, tiny_causal_lm
from tolerances import assert_routes_agree

from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.families.hf_causal_lm.tasks.perplexity import CausalLMAdapter
from headsweep.workers.memory.batch_budget import (
    CPU_PASS_BYTES,
    CPU_PASS_ROOM_CAP_BYTES,
    CPU_TOKENS_PER_THREAD,
    cpu_pass_room,
    masks_per_forward,
)

CPU = torch.device("cpu")
LAYERS, WINDOW, VOCAB, BATCH = 2, 64, 32000, 2  # the bound's width: the window, the feed-forward size (64)


@pytest.fixture
def threads():
    """Sets torch's thread count for one test, and puts it back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_several_threads_pack_to_the_token_floor_within_memory(threads):
    row = CPU_PASS_BYTES  # a row the size of the dense pass's cap: one mask a pass by bytes alone
    threads(1)
    assert masks_per_forward(0, 4, row, CPU, tokens_per_row=128) == 1
    threads(2)
    room = cpu_pass_room(2)
    assert 0 < room <= CPU_PASS_ROOM_CAP_BYTES and cpu_pass_room(1) <= room
    # 2 threads x 1,024 tokens over 4 rows of 128 tokens: 4 masks, where memory holds them
    assert 2 * CPU_TOKENS_PER_THREAD // (4 * 128) == 4
    assert masks_per_forward(0, 4, row, CPU, tokens_per_row=128) == min(4, max(1, room // (4 * row)))
    # memory binds: a row of a quarter of the room, 4 rows a mask: one mask a pass
    assert masks_per_forward(0, 4, room // 4, CPU, tokens_per_row=128) == 1
    assert masks_per_forward(0, 1, room // 2, CPU, tokens_per_row=128) == 2
    # the floor never lowers what the byte caps allow (small rows already pack past it)
    assert masks_per_forward(0, 4, 1024, CPU, tokens_per_row=128) == CPU_PASS_BYTES // (4 * 1024)
    # rows of unknown length, state kept across steps (beam search) and a set count: as before
    assert masks_per_forward(0, 4, row, CPU) == 1
    assert masks_per_forward(0, 4, row, CPU, dense=False, tokens_per_row=128) == 8
    assert masks_per_forward(3, 4, row, CPU, tokens_per_row=128) == 3


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("big_vocab")
    model = tiny_causal_lm("llama_8q2kv", layers=LAYERS, vocab_size=VOCAB, max_positions=WINDOW)
    model.config._attn_implementation = None
    model.save_pretrained(root / "model")
    build_lm_tokenizer().save_pretrained(root / "model")
    (root / "corpus.txt").write_text(lm_text(600, seed=3))
    return root


def adapter(files, masks_per_batch: int, reuse: bool) -> CausalLMAdapter:
    return CausalLMAdapter(CausalLMModel(path=str(files / "model")),
                           CausalLMData(path=str(files / "corpus.txt"), window=WINDOW, max_windows=4),
                           RuntimeOptions(batch_size=BATCH, reuse=reuse, masks_per_batch=masks_per_batch))


def test_two_threads_pack_real_lm_rows_and_equal_one_mask_a_pass(files, threads):
    threads(2)
    packed = adapter(files, 0, reuse=True)
    row = packed.bytes_per_row()
    assert BATCH * row > CPU_PASS_BYTES  # one mask a pass by bytes alone, as for GPT-2 or Llama
    wanted = 2 * CPU_TOKENS_PER_THREAD // (BATCH * WINDOW)
    assert packed.masks_per_forward(BATCH) == min(wanted, cpu_pass_room(2) // (BATCH * row)) == wanted
    plain = adapter(files, 1, reuse=False)
    masks = [[]] + [[h] for h in plain.gates.inventory.heads]
    assert len(masks) > wanted  # more than one packed pass per batch
    expected = plain.nll(masks)
    assert (np.abs(expected[1:] - expected[0]).max(axis=1) > 1e-4).all()  # every head moves some window
    got = packed.nll(masks)
    for mask, a, b in zip(masks, got, expected, strict=True):
        # summation order: the packed pass multiplies taller matrices than one mask alone
        assert_routes_agree(a, b, depth=LAYERS + 1, width=WINDOW, dtype=torch.float32, what=mask)
    threads(1)
    assert packed.masks_per_forward(BATCH) == 1
