"""The model on torch: loading, frozen layers, adapters, heads, experts, vision, attention, merging."""
