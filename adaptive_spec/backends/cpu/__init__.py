"""The torch engine's CPU kernels: which path this CPU runs (machine.py), the kernel choice for its linear layers
(packed.py), the int8/int4 draft layers (quant.py)."""
