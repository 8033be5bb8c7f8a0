"""The model files a run loads: hub ids pinned to the commit they resolve to (:mod:`.hub_pins`), and the fingerprints
of the weights that a resumed run, a report and an export check against the run's (:mod:`.weights`)."""
