"""The LM head and loss over whole logits against a slice of the vocabulary at a time, on this CPU.

For each LM-head shape (hidden size x vocabulary of SmolLM2-135M, GPT-2 small, Qwen2.5-0.5B, Llama-3.2-1B) and each
row count (``--rows``: 508 is 4 windows of 128 tokens, one mask's perplexity pass of ``bench/peers.py``; 2,032 four
masks packed), times on the same random weights and hidden states:

* ``whole``: ``F.linear`` over the whole vocabulary, then ``scoring.target_nll`` (``F.cross_entropy``): what every
  perplexity pass computed before ``workers/families/hf_causal_lm/model/vocab_slices.py``;
* ``sliced``: ``vocab_slices.sliced_nll`` at ``--columns`` (default ``CPU_VOCAB_SLICE``) columns a slice, and, with
  ``--sweep``, at 256 to 4,096.

Each route runs ``--repeats`` times interleaved with the other (the best time counts), after one unmeasured run.
``RESULT vocab_slices shape=<name> rows=<n> threads=<t> columns=<c> whole_s=<s> sliced_s=<s> speedup=<x>
max_diff=<nats>`` per shape and row count; ``max_diff`` is the largest difference of a token's NLL between the two
routes (float32 rounding, see tests/families/causal_lm/test_vocab_slices.py).
"""

from __future__ import annotations

import time

from bench.common import command_line, enable_smoke, log, result

#: name -> (hidden size, vocabulary)
SHAPES = {"smollm2-135m": (576, 49152), "gpt2": (768, 50257), "qwen2.5-0.5b": (896, 151936),
          "llama-3.2-1b": (2048, 128256)}
SMOKE_SHAPES = {"tiny": (32, 3000)}


def seconds_of(fn) -> float:
    """Wall seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, hidden: int, vocab: int, rows: int, columns: int, sweep: list[int], repeats: int) -> None:
    import torch

    from headsweep.workers.families.hf_causal_lm.model.scoring import target_nll
    from headsweep.workers.families.hf_causal_lm.model.vocab_slices import sliced_nll

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, hidden**-0.5)
    states = torch.randn(rows, hidden)
    targets = torch.randint(0, vocab, (rows,))
    routes = {"whole": lambda: target_nll(head(states), targets)}
    for width in dict.fromkeys([columns, *sweep]):
        routes[f"sliced_{width}"] = lambda w=width: sliced_nll(states, head, targets, w)
    with torch.inference_mode():
        diff = float((routes[f"sliced_{columns}"]() - routes["whole"]()).abs().max())
        seconds = {key: float("inf") for key in routes}
        for _ in range(repeats):
            for key, fn in routes.items():
                seconds[key] = min(seconds[key], seconds_of(fn))
    for key, s in seconds.items():
        log(f"  {name} rows {rows}: {key:12s} {s:.3f} s")
    whole, sliced = seconds["whole"], seconds[f"sliced_{columns}"]
    result("vocab_slices", shape=name, rows=rows, threads=torch.get_num_threads(), columns=columns,
           whole_s=f"{whole:.3f}", sliced_s=f"{sliced:.3f}", speedup=f"{whole / sliced:.3f}", max_diff=f"{diff:.2g}")


def main() -> None:
    from headsweep.workers.families.hf_causal_lm.model.vocab_slices import CPU_VOCAB_SLICE

    parser = command_line(__doc__)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--rows", type=int, nargs="+", default=[508, 2032], help="rows (positions) per pass")
    parser.add_argument("--columns", type=int, default=CPU_VOCAB_SLICE, help="vocabulary columns per slice")
    parser.add_argument("--sweep", action="store_true", help="also time slices of 256, 1,024 and 4,096 columns")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each route (the best counts)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    args = parser.parse_args()
    smoke = enable_smoke(args)
    import torch

    torch.set_num_threads(args.threads)
    shapes = SMOKE_SHAPES if smoke else {name: SHAPES[name] for name in args.shapes}
    rows = [16] if smoke else args.rows
    sweep = [256, 1024, 4096] if args.sweep else []
    repeats = 1 if smoke else args.repeats
    log(f"vocab_slices: {args.threads} thread(s), torch {torch.__version__}")
    for name, (hidden, vocab) in shapes.items():
        for n in rows:
            measure(name, hidden, vocab, n, args.columns, sweep, repeats)


if __name__ == "__main__":
    main()
