"""The benchmarks, each a module run from the repository root: ``python -m bench.<name> [--smoke]``.

Beside them, the support modules they share: ``common`` (``--smoke``, ``RESULT`` and ``SKIP`` lines, data and
cache), ``multi30k`` (the Multi30k data and translation models), ``classifier`` (the BERT classifiers and their
word tokenizer), ``flops`` (FLOP counts and the matrix-product rate), ``measure`` (memory and timing of grids run
in-process) and ``sweeps`` (sweeps run through ``headsweep.run``, watched and read back). ``gpu_check`` also runs
as a plain script on a GPU machine where nothing is installed (``python bench/gpu_check.py``), so it imports no
other module of this package.
"""
