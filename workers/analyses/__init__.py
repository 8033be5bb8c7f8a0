"""Per-head analyses beyond the mask grid: importance, LRP, role inputs, efficiency (attention patterns and head
roles are ``headsweep.workers.attention``)."""
