"""The Hugging Face cache: finding model folders and the commits they resolve to, offline (the driver pins a run's
hub ids with them: ``headsweep.sweep.models.hub_pins``)."""
