"""pytest plugin: the Mamba-2 launch after the readout at $HB heads a program (each xdist worker loads it)."""
import os
import replayssm_jax.kernels.mamba2 as m
m.HEADS_A_PROGRAM = int(os.environ["HB"])
