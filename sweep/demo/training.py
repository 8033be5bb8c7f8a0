"""The demo models' training loop: AdamW with a one-cycle schedule over seeded shuffles of the rows."""

from __future__ import annotations

from collections.abc import Callable

import torch


def train_shuffled(model: torch.nn.Module, n_rows: int, batch: int, lr: float, epochs: int, seed: int,
                   loss_of: Callable[[torch.Tensor], torch.Tensor], name: str, log: Callable[[str], None]) -> None:
    """Trains ``model`` for ``epochs`` passes over ``n_rows`` rows in batches of ``batch``, shuffled by a generator
    seeded with ``seed``; ``loss_of(indices)`` is the mean loss of those rows. Logs each epoch's mean train loss as
    ``demo NAME epoch i/n``, and leaves the model in eval mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps = epochs * ((n_rows + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    g = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(n_rows, generator=g)
        total = 0.0
        for start in range(0, n_rows, batch):
            idx = order[start : start + batch]
            loss = loss_of(idx)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        log(f"  demo {name} epoch {epoch + 1}/{epochs}: train loss {total / n_rows:.4f}")
    model.eval()
