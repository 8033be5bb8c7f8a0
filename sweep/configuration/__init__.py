"""Configuration: YAML files, overrides, the typed sections and the config reader."""
