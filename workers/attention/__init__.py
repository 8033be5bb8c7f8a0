"""Attention patterns as the model families capture them (:mod:`.reader`) and the head-role statistics computed from
them (:mod:`.head_roles`, :mod:`.syntax`): below the families, which implement the reader, and the analyses."""
