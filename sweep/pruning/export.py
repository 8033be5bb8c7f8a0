"""``headsweep export``: a copy of a sweep's model with heads physically removed.

The model is the config's ``model`` section; the heads are a mask given by name, or the mask
of a stored run's pruning level or evaluation (``headsweep.sweep.pruning.masks``). Loading,
pruning and saving are the model family's (``headsweep.workers.core.family.ModelFamily``): for a
Llama-style causal LM whose mask leaves the same heads in every layer and key/value group (the masks of
``prune.uniform`` levels), the stock architecture (``--stock``, the default where the mask fits): a
``save_pretrained`` directory whose ``config.json`` states the pruned ``num_attention_heads``,
``num_key_value_heads`` and ``head_dim``, which stock ``from_pretrained`` loads; for other masks and for a
transformers classifier, a ``save_pretrained`` directory whose ``config.pruned_heads`` lists the
removed heads (load it with ``headsweep.load_pruned``); for a fairseq translation model,
``checkpoint.pt`` with the removed heads under ``headsweep_pruned_heads`` and the model's
dictionaries beside it (a config with ``model.checkpoint: OUT/checkpoint.pt`` and
``model.data_bin: OUT`` loads it). Every export gets ``headsweep-export.json``: which heads were
removed, which survive per layer, where the mask came from, and the parameter counts before and
after.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from headsweep.errors import HeadsweepError
from headsweep.results.outputs import check_output, written_folder
from headsweep.results.store import ResultStore
from headsweep.sweep.ablation.fold import constants_to_fold, fold
from headsweep.sweep.configuration.sections import Config
from headsweep.sweep.models.weights import check_same_weights
from headsweep.sweep.pruning.masks import MaskChoice, explicit_mask, stored_mask
from headsweep.workers.core.heads import HeadInventory
from headsweep.workers.families.registry import model_family
from headsweep.workers.hub.cache import is_hub_id, resolve_snapshot

MANIFEST = "headsweep-export.json"


def choose(inventory: HeadInventory, store: ResultStore | None, from_run: str | None, level: float | None,
           eval_id: str | None, mask: Sequence[str] | None) -> MaskChoice:
    """The mask named on the command line: head names, or a level / eval id of ``from_run``."""
    if mask is not None:
        if from_run or level is not None or eval_id is not None:
            raise HeadsweepError("--mask names the heads itself: leave out --from-run, --level and --eval-id")
        if not mask:
            raise HeadsweepError("--mask is empty: name the heads to remove (e.g. self:0:1,self:2:3)")
        return explicit_mask(mask, inventory)
    if not from_run or (level is None) == (eval_id is None):
        raise HeadsweepError("name the heads with --mask, or with --from-run RUN_ID and one of --level / --eval-id")
    if store is None:
        raise HeadsweepError("--from-run needs the results store (--store)")
    return stored_mask(store, from_run, inventory, level=level, eval_id=eval_id)


def check_run_model(store: ResultStore, run_id: str, cfg: Config) -> None:
    """Refuse a stored run whose model is not the config's: a mask names heads of the model it was found on, and
    the same head numbers of another model are other heads. The run's model is its config's ``model`` section
    (``model.kind`` and the file or folder of its weights, or one of its ``checkpoints``)."""
    rows = store.read("runs", run_id, columns=["config"]).to_pylist()
    if not rows:
        return  # no such run: stored_mask names the run and the store
    stored = json.loads(rows[-1]["config"])
    key = model_family(cfg.model.kind).checkpoint_key
    model = stored.get("model") or {}
    theirs = [model.get(key), *(stored.get("checkpoints") or [])]
    mine = str(getattr(cfg.model, key))
    if model.get("kind") != cfg.model.kind or not any(_same_file(t, mine) for t in theirs if t):
        raise HeadsweepError(
            f"run {run_id} is of model {model.get(key)} ({model.get('kind')}), this config's model is {mine} "
            f"({cfg.model.kind}): a stored mask fits only the model it was found on; export with that run's config, "
            "or name a run of this model"
        )


def check_export_weights(store: ResultStore, run_id: str, cfg: Config) -> None:
    """Refuse a stored run made with other weights than the config's model holds now (the files were changed in
    place since): its mask would prune weights it was not found on, and the manifest would name the run as source."""
    run = store.run(run_id)
    if run is None:
        return
    checkpoints = json.loads(run["config"] or "{}").get("checkpoints") or []
    mine = _checkpoint_of(store, run_id, cfg)
    index = checkpoints.index(mine) if mine in checkpoints else None
    check_same_weights(run, cfg.model, f"export --from-run {run_id} would prune these weights with a mask found on "
                                       "the run's", index)


def _same_file(a: str, b: str) -> bool:
    """Whether two model paths from configs name the same file or folder (also through links; a hub id by the
    cached snapshot it resolves to); else whether they are equal strings."""
    a, b = _location(a), _location(b)
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a == b


def _location(spec: str) -> str:
    """A hub id's snapshot folder in the local cache (a run stores the ``id@<commit>`` it pinned); else ``spec``."""
    if is_hub_id(spec):
        try:
            return str(resolve_snapshot(spec).folder)
        except HeadsweepError:
            return spec
    return spec


def _checkpoint_of(store: ResultStore | None, run_id: str | None, cfg: Config) -> str | None:
    """Which of run ``run_id``'s training checkpoints the config's model is (None: a run of one model)."""
    if not run_id or store is None:
        return None
    rows = store.read("runs", run_id, columns=["config"]).to_pylist()
    checkpoints = (json.loads(rows[-1]["config"]).get("checkpoints") or []) if rows else []
    mine = str(getattr(cfg.model, model_family(cfg.model.kind).checkpoint_key))
    return next((c for c in checkpoints if _same_file(c, mine)), None)


def read_paths(cfg: Config) -> list[str]:
    """The files and folders an export reads its model from (every path its ``model`` section names that exists; a
    hub id's cached snapshot): ``--out`` may neither be nor hold one of them."""
    paths = []
    for value in vars(cfg.model).values():
        if not isinstance(value, str) or not value:
            continue
        if is_hub_id(value):
            with contextlib.suppress(HeadsweepError):
                paths.append(str(resolve_snapshot(value).folder))
        elif Path(value).expanduser().exists():
            paths.append(value)
    return paths


def _stock_sizes(family, model, heads, stock: bool | None) -> dict[str, int] | None:
    """The stock sizes for this mask; None for the ``pruned_heads`` format (``stock`` False, or None and the mask
    or the family has no stock config). ``stock`` True refuses what does not fit, with the reason."""
    if stock is False:
        return None
    try:
        return family.stock_sizes(model, heads)
    except HeadsweepError:
        if stock:
            raise
        return None


def export_pruned(cfg: Config, out_dir: str | Path, store: ResultStore | None = None, from_run: str | None = None,
                  level: float | None = None, eval_id: str | None = None,
                  mask: Sequence[str] | None = None, stock: bool | None = None, force: bool = False) -> Path:
    """Write the config's model without the chosen heads to ``out_dir``; returns the folder.

    ``stock``: True writes the stock architecture or refuses the mask; False the ``pruned_heads`` format; None
    (default) the stock architecture where the mask and the family allow it. ``out_dir`` follows the rule of every
    output (:mod:`headsweep.results.outputs`): a folder that is not empty is refused unless ``force``, which
    replaces an earlier export there and writes beside files headsweep did not write (never over them), and the
    model's own files are never replaced. The folder is written beside
    ``out_dir`` and put in place once complete, so a refusal or a failure leaves ``out_dir`` as it was.
    """
    from headsweep.workers.core.gates import site_inventory
    from headsweep.workers.pruning.removal import count_parameters

    # before the model is loaded: a wrong folder fails fast
    output = check_output(out_dir, "folder", force=force, store=store, protected=read_paths(cfg), replace_own=False)
    if from_run and store is not None:
        check_run_model(store, from_run, cfg)
        check_export_weights(store, from_run, cfg)
    family = model_family(cfg.model.kind)
    loaded = family.load_model(cfg.model)
    model = loaded.model
    inventory = site_inventory(family.find_sites(model))
    choice = choose(inventory, store, from_run, level, eval_id, mask)
    sizes = _stock_sizes(family, model, choice.heads, stock)
    # Mean and optimal ablation: the removed heads' constants folded into the biases first (sweep/ablation/fold.py).
    method, constants = constants_to_fold(cfg, store, from_run, _checkpoint_of(store, from_run, cfg))
    if constants:
        fold(family.find_sites(model), choice.heads, constants, method, str(getattr(cfg.model,
                                                                                    family.checkpoint_key)))
    n_full = count_parameters(model)
    slices = family.prune(model, choice.heads)
    with written_folder(output, "headsweep export") as staging:
        sizes = _save(family, cfg, loaded, choice.heads, sizes, stock, staging)
        manifest = {
            "model": str(getattr(cfg.model, family.checkpoint_key)),
            "kind": cfg.model.kind,
            # stock: config.json states the pruned sizes (from_pretrained loads it); pruned_heads: it lists the
            # removed heads (headsweep.load_pruned loads it)
            "format": "stock" if sizes else "pruned_heads",
            "stock_sizes": sizes,
            "heads_removed": [str(h) for h in choice.heads],
            # every layer, each with its heads' numbers in the full model (a layer left whole: all of them)
            "heads_kept": {f"{s.attention}:{s.layer}": list(slices[(s.attention, s.layer)].kept)
                           if (s.attention, s.layer) in slices else list(range(s.num_heads))
                           for s in inventory.layers},
            "mask_source": choice.source,
            "ablation": method,  # mean / optimal: the removed heads' constants folded into the output biases
            "source_run": choice.run_id,
            "level": choice.level,
            "n_params_full": n_full,
            "n_params_pruned": count_parameters(model),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return output.path


def _save(family, cfg: Config, loaded, heads, sizes: dict[str, int] | None, stock: bool | None,
          folder: Path) -> dict[str, int] | None:
    """Save in the stock format where ``sizes`` is set (falling back to ``pruned_heads`` when the default's
    config check refuses it), else in the family's ``pruned_heads`` format; returns the sizes written."""
    if sizes:
        try:
            family.save_stock(cfg.model, loaded, sizes, folder)
            return sizes
        except HeadsweepError:
            if stock:
                raise
    family.save_pruned(cfg.model, loaded, heads, folder)
    return None
