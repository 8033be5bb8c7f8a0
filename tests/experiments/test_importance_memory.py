"""What gradient importance keeps for its backward pass (headsweep.workers.memory.backward_memory).

- With the blocks checkpointed, what autograd keeps grows with the number of layers by each layer's input alone
  (a 2- and a 6-layer model of one width differ by four layer inputs); without, by every layer's activations. The
  bytes are counted by a ``saved_tensors_hooks`` pair of the test's own around the loss (each storage once,
  parameters left out).
- Loss batches are cut to the budget: a budget of k rows' estimate gives pieces of k windows, a batch's pieces
  share its group, and a run under resample ablation does not recompute (its fill is set for the forward pass only).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import lm_text, save_tiny_causal_lm

from headsweep.workers.ablation.spec import AblationSpec
from headsweep.workers.core.family import RuntimeOptions
from headsweep.workers.families.hf_causal_lm.by_task import load_causal_lm_adapter
from headsweep.workers.families.hf_causal_lm.config import CausalLMData, CausalLMModel
from headsweep.workers.families.hf_causal_lm.model.scoring import backward_bytes_per_row
from headsweep.workers.memory.backward_memory import blocks_of, checkpointed

pytestmark = pytest.mark.usefixtures("one_thread")
WINDOW = 16


def lm_adapter(folder, layers: int, **runtime):
    model_dir = folder / f"lm{layers}"
    if not model_dir.exists():
        save_tiny_causal_lm(model_dir, layers=layers)
        (folder / "text.txt").write_text(lm_text(400, seed=3))
    return load_causal_lm_adapter(CausalLMModel(path=str(model_dir), attn_implementation="eager"),
                                  CausalLMData(path=str(folder / "text.txt"), window=WINDOW, max_windows=6),
                                  RuntimeOptions(batch_size=4, **runtime))


def kept_bytes(adapter, checkpoint: bool) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of the first loss batch (outside checkpointed
    blocks: what a checkpointed block keeps is its inputs, recomputed from there)."""
    params = {p.untyped_storage().data_ptr() for p in adapter.model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    batch = adapter.loss_batches(None, torch.float32).batches[0]
    blocks = blocks_of(adapter.model, adapter.gates.sites) if checkpoint else []
    gate = {s.key: torch.ones(batch.n_examples, WINDOW, s.num_heads, requires_grad=True) for s in adapter.gates.sites}
    adapter.gates.set_values(gate)
    try:
        with torch.enable_grad(), checkpointed(blocks), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = batch.loss()
        loss.backward()
    finally:
        adapter.gates.clear()
    assert all(g.grad is not None and g.grad.abs().sum() > 0 for g in gate.values())
    return sum(storages.values())


def test_checkpointed_blocks_keep_nothing_that_grows_with_layers(tmp_path):
    shallow, deep = lm_adapter(tmp_path, 2), lm_adapter(tmp_path, 6)
    assert len(blocks_of(deep.model, deep.gates.sites)) == 6
    plain_shallow, plain_deep = kept_bytes(shallow, False), kept_bytes(deep, False)
    assert plain_deep > plain_shallow * 2  # every layer's activations
    kept_shallow, kept_deep = kept_bytes(shallow, True), kept_bytes(deep, True)
    # Four more layers keep four more layer inputs (4 windows x 16 positions x hidden, float32), nothing else.
    inputs = 4 * 4 * WINDOW * deep.model.config.hidden_size * 4
    assert kept_deep - kept_shallow == inputs
    assert kept_shallow < plain_shallow / 2 and plain_deep - plain_shallow > 10 * inputs


def test_loss_batches_are_cut_to_the_budget(tmp_path):
    adapter = lm_adapter(tmp_path, 2)
    row = backward_bytes_per_row(adapter.model.config, adapter.model.dtype, WINDOW, checkpointed=True)
    adapter.backward_budget = 2 * row + row // 2
    batches = adapter.loss_batches(None, torch.float32).batches
    assert [b.n_examples for b in batches] == [2, 2, 2]  # 6 windows in batches of 4: (2, 2) and (2)
    assert [b.group for b in batches] == [0, 0, 1]
    assert all(b.recompute for b in batches)
    # Without checkpointing (a per-example fill) a row keeps every layer's activations: fewer rows fit.
    assert backward_bytes_per_row(adapter.model.config, adapter.model.dtype, WINDOW, checkpointed=False) > row / 2


def test_a_per_example_fill_is_not_recomputed(tmp_path):
    adapter = lm_adapter(tmp_path, 2, ablation=AblationSpec(method="resample"))
    batches = adapter.loss_batches(None, torch.float32).batches
    assert batches and not any(b.recompute for b in batches)
