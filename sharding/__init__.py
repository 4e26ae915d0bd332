"""Meshes and placement rules: `--mesh` strings, the one logical-axis table, expert-parallel MoE and
multi-host start-up (ARCHITECTURE.md, "Meshes"). Depends on jax alone; model code names logical axes
and this package maps them to mesh axes."""
