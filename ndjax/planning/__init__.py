"""Choosing a layout before renting GPUs: every mesh for N devices checked, compiled and
priced (``planner``), and the least traffic a layout can have, which leaves out compiles
that cannot rank (``traffic_bound``)."""
