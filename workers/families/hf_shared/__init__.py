"""What both transformers families (``hf_classifier``, ``hf_causal_lm``) share: checking and loading a model
folder, the attention layouts and sites, physical pruning's bookkeeping and exported folders, prefix reuse's
common steps, and reading attention weights. Neither family imports the other; both import this layer."""
