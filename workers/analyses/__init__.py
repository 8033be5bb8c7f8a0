"""Per-head analyses beyond the mask grid: importance, LRP, roles and their inputs, syntax, attention maps,
efficiency."""
