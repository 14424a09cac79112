"""Data and expert parallelism: rank processes, their process group, MoE dispatch/combine."""
