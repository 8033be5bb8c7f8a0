"""The Hugging Face cache: finding model folders offline and pinning their revisions."""
